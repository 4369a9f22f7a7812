"""`p2pswarm plan / cards / bench / cluster` through typer's CliRunner."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import p2pswarm.control.client as control_client
from p2pswarm.cli import app
from p2pswarm.errors import ConfigError, ControlError

REFERENCE = Path(__file__).resolve().parent.parent / "simulations" / "clusters" / "reference.json"
runner = CliRunner()


def run(*args: str) -> Any:
    return runner.invoke(app, list(args))


def one_error_line(result: Any, code: int, *words: str) -> None:
    assert result.exit_code == code, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for word in words:
        assert word in lines[0]
    assert "Traceback" not in result.output


def test_plan_cluster_json() -> None:
    result = run("plan", "llama-3-8b", "--cluster", str(REFERENCE), "--json", "--context", "8192",
                 "--maximize", "speed")
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    assert plan["fits"] and plan["kind"] == "serve" and len(plan["plan_id"]) == 16
    assert plan["request"]["context"] == 8192 and plan["request"]["maximize"] == "speed"
    assert {c["fellow"] for c in plan["cards"]} >= {"fxserver", "rig", "pi-4"}
    assert plan["layout"]["limit"]["sentence"].startswith("Context 8,192 tokens; the cards hold")
    again = run("plan", "llama-3-8b", "--cluster", str(REFERENCE), "--json", "--context", "8192",
                "--maximize", "speed")
    assert again.stdout == result.stdout


def test_plan_human_output_has_the_sentence_bars_and_table() -> None:
    result = run("plan", "llama-2-13b", "--cluster", str(REFERENCE), "--maximize", "speed",
                 "--exclude", "laptop-2:cpu")
    assert result.exit_code == 0, result.output
    text = result.stdout
    assert "Context 4,096 tokens; the cards hold" in text
    assert "layers" in text and "plan_id" in text and "left out by you" in text
    assert "▕" in text  # the bars


def test_plan_that_does_not_fit_exits_1_after_printing() -> None:
    result = run("plan", "llama-3-70b", "--cluster", str(REFERENCE), "--json",
                 "--weights-dtype", "f16")
    assert result.exit_code == 1
    assert json.loads(result.stdout)["fits"] is False


def test_training_plan() -> None:
    result = run("plan", "tiny-llama", "--cluster", str(REFERENCE), "--json", "--train",
                 "--maximize", "seq_len", "--micro-batch", "8", "--lora-rank", "8")
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    assert plan["kind"] == "train" and plan["request"]["method"] == "lora"
    assert plan["layout"]["limit"]["sentence"].startswith("Sequence length 2,048 tokens")


@pytest.mark.parametrize("args, code, words", [
    (["plan", "no-such-model", "--cluster", str(REFERENCE)], 2,
     ["unknown model", "tiny-llama"]),
    (["plan", "tiny-llama", "--cluster", "/nonexistent/cluster.json"], 2, ["--cluster"]),
    (["plan", "tiny-llama", "--cluster", str(REFERENCE), "--weights-dtype", "f8"], 2,
     ["--weights-dtype", "int4"]),
    (["plan", "tiny-llama", "--cluster", str(REFERENCE), "--maximize", "seq_len"], 2,
     ["--maximize seq_len"]),
    (["plan", "tiny-llama", "--cluster", str(REFERENCE), "--exclude", "ghost:0"], 2,
     ["no fellow 'ghost'"]),
    (["plan", "tiny-llama", "--cluster", str(REFERENCE), "--context", "99999"], 2,
     ["--context 2048 or less"]),
    (["plan", "tiny-llama", "--cluster", str(REFERENCE), "--stages", "9"], 2, ["--stages 8"]),
    (["plan", "tiny-llama", "--cluster", str(REFERENCE), "--floor", "tpu=1GB"], 2, ["--floor"]),
    (["plan", "tiny-llama", "--cluster", str(REFERENCE), "--seq-len", "64"], 2, ["--train"]),
])
def test_bad_arguments_give_one_line_and_exit_2(args: list[str], code: int,
                                                words: list[str]) -> None:
    one_error_line(run(*args), code, *words)


def test_bad_cluster_file_names_the_field(tmp_path: Path) -> None:
    bad = tmp_path / "c.json"
    bad.write_text(json.dumps({"fellows": [{"id": "a", "cards": [{"kind": "cuda"}]}]}))
    one_error_line(run("plan", "tiny-llama", "--cluster", str(bad)), 2,
                   "fellows[0].cards[0]", "total_bytes")


def test_online_plan_without_an_agent(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    result = run("plan", "tiny-llama", "--home", str(tmp_path))
    one_error_line(result, 1, f"no agent running in {tmp_path}", "p2pswarm join",
                   "--cluster FILE")


def test_online_plan_asks_the_agent(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from p2pswarm.planner import cluster_from_dict, plan_message

    seen: list[dict[str, Any]] = []

    def fake_request(home: Path, message: dict[str, Any], *args: Any) -> Any:
        seen.append(message)
        view = cluster_from_dict(json.loads(REFERENCE.read_text()))
        return plan_message(message["request"], view)

    monkeypatch.setattr(control_client, "request", fake_request)
    result = run("plan", "tiny-llama", "--home", str(tmp_path), "--json", "--context", "1024")
    assert result.exit_code == 0, result.output
    assert seen[0]["op"] == "plan"
    assert seen[0]["request"]["model"]["name"] == "tiny-llama"
    assert seen[0]["request"]["model"]["config"]["num_hidden_layers"] == 8
    offline = run("plan", "tiny-llama", "--cluster", str(REFERENCE), "--json", "--context",
                  "1024")
    assert json.loads(result.stdout) == json.loads(offline.stdout)


def test_online_refusals_keep_their_exit_code(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(home: Path, message: dict[str, Any], *args: Any) -> Any:
        raise ConfigError("--stages 3 needs 3 usable cards: use --stages 1")

    monkeypatch.setattr(control_client, "request", refuse)
    one_error_line(run("plan", "tiny-llama"), 2, "--stages 1")

    def timeout(home: Path, message: dict[str, Any], *args: Any) -> Any:
        raise ControlError("the agent in /x did not answer within 30 s")

    monkeypatch.setattr(control_client, "request", timeout)
    one_error_line(run("plan", "tiny-llama"), 1, "did not answer")


def test_cluster_export_and_check(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    data = json.loads(REFERENCE.read_text())
    monkeypatch.setattr(control_client, "request", lambda home, message, *a: data)
    out = tmp_path / "mine.json"
    result = run("cluster", "export", "--out", str(out))
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text()) == data
    checked = run("cluster", "check", str(out))
    assert checked.exit_code == 0 and "8 fellows, 10 cards" in checked.stdout
    printed = run("cluster", "export")
    assert json.loads(printed.stdout) == data


def test_cluster_export_without_an_agent(tmp_path: Path) -> None:
    one_error_line(run("cluster", "export", "--home", str(tmp_path)), 1, "no agent running")


def test_cards_and_bench_on_this_machine(tmp_path: Path) -> None:
    cards = run("cards", "--gpus", "none", "--cpu-memory", "2GB", "--json", "--home",
                str(tmp_path))
    assert cards.exit_code == 0, cards.output
    (cpu,) = json.loads(cards.stdout)["cards"]
    assert cpu["kind"] == "cpu" and cpu["total_bytes"] <= 2 * 10**9
    assert cpu["benchmark"]["measured"] is False
    bench = run("bench", "--gpus", "none", "--seconds", "0.1", "--json", "--home", str(tmp_path))
    assert bench.exit_code == 0, bench.output
    assert json.loads(bench.stdout)["benchmarks"]["cpu:0"]["measured"] is True
    again = run("cards", "--gpus", "none", "--json", "--home", str(tmp_path))
    assert json.loads(again.stdout)["cards"][0]["benchmark"]["measured"] is True
    one_error_line(run("cards", "--cpu-memory", "lots"), 2, "lots", "e.g. 6GB")
    one_error_line(run("bench", "--seconds", "0"), 2, "--seconds")


def test_auto_plan_text_names_each_stages_dtype_and_why() -> None:
    pis = REFERENCE.parent / "pis-4gb.json"
    result = run("plan", "llama-3-8b", "--cluster", str(pis))
    assert result.exit_code == 0, result.output
    text = " ".join(result.stdout.split())
    assert "int8: f16 needs" in text and "this card has 3.2 GB free" in text
    assert "layers 0-6 int8" in text  # the card's bar names its stage's dtype
    plan = json.loads(run("plan", "llama-3-8b", "--cluster", str(pis), "--json").stdout)
    assert plan["request"]["weights_dtype"] == "auto"
    assert all(s["weights_dtype"] in ("f16", "int8", "int4") and s["dtype_reason"]
               for s in plan["stages"])
    f16 = run("plan", "llama-3-8b", "--cluster", str(pis), "--weights-dtype", "f16", "--json")
    assert f16.exit_code == 1 and json.loads(f16.stdout)["plan_id"] != plan["plan_id"]
    bad = run("plan", "llama-3-8b", "--cluster", str(pis), "--weights-dtype", "q3")
    assert bad.exit_code == 2 and "use one of auto, f32" in bad.output
