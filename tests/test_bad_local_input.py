"""Bad local files get one line and exit code 2, never a traceback: deeply nested JSON,
numbers a job cannot run, fractions and strings and infinities in config.json, cluster
files with impossible sizes, safetensors ranges past the end of the file. Every case
runs the real CLI (typer's runner, no agent needed: each is refused before one is asked).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from p2pswarm.cli import app
from p2pswarm.planner import BUILTIN_MODELS

DEEP = "[" * 100_000 + "]" * 100_000
runner = CliRunner()


def one_line_error(tmp_path: Path, args: list[str], *expected: str) -> str:
    result = runner.invoke(app, [*args], env={"P2PSWARM_HOME": str(tmp_path / "home"),
                                              "P2PSWARM_TOKEN": ""})
    assert result.exception is None or isinstance(result.exception, SystemExit), \
        repr(result.exception)
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2, result.output
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert "Traceback" not in result.output
    for text in expected:
        assert text in lines[0], lines[0]
    return lines[0]


def write(path: Path, data: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def cluster(tmp_path: Path, card: dict[str, Any] | None = None) -> Path:
    return write(tmp_path / "cluster.json", {"fellows": [{"id": "a", "cards": [
        {"kind": "cpu", "total_bytes": "16GB", **(card or {})}]}]})


# --- JSON nested thousands deep ----------------------------------------------------------


def test_deeply_nested_json_is_one_line_wherever_it_is_read(tmp_path: Path) -> None:
    one_line_error(tmp_path, ["plan", "tiny-llama", "--cluster",
                              str(write(tmp_path / "deep.json", DEEP))], "--cluster", "JSON")
    job = write(tmp_path / "job.json", '{"model": "tiny-llama", "data": ' + DEEP + "}")
    one_line_error(tmp_path, ["train", "--config", str(job), "--plan"], "not valid JSON")
    model = tmp_path / "deep-model"
    write(model / "config.json", '{"rope_scaling": ' + DEEP + "}")
    one_line_error(tmp_path, ["plan", str(model), "--cluster", str(cluster(tmp_path))],
                   "config.json")


# --- a job that cannot run -----------------------------------------------------------------


@pytest.mark.parametrize(("field", "value", "says"), [
    ("steps", 10**30, "steps must be a whole number from 1 to 1,000,000,000"),
    ("seq_len", 2**70, "seq_len must be a whole number"),
    ("micro_batch", 1.5, "micro_batch must be a whole number"),
    ("seed", 2**64, "seed must be a whole number from 0 to 2**63-1"),
])
def test_numbers_a_job_cannot_run_are_refused(tmp_path: Path, field: str, value: Any,
                                              says: str) -> None:
    job = write(tmp_path / "job.json", {"model": "tiny-llama", field: value})
    one_line_error(tmp_path, ["train", "--config", str(job), "--plan"], says)


@pytest.mark.parametrize(("flag", "most"), [("--sequences", "1,048,576"),
                                            ("--context", "1,073,741,824"),
                                            ("--micro-batches", "1,000,000,000"),
                                            ("--stages", "256")])
def test_plan_numbers_beyond_any_request_are_refused(tmp_path: Path, flag: str,
                                                     most: str) -> None:
    args = ["plan", "tiny-llama", flag, str(10**30), "--cluster", str(cluster(tmp_path))]
    if flag == "--micro-batches":
        args.append("--train")
    one_line_error(tmp_path, args, f"{flag} must be a whole number from 1 to {most}")


# --- config.json ------------------------------------------------------------------------


@pytest.mark.parametrize(("change", "says"), [
    ({"num_hidden_layers": 1.5}, "num_hidden_layers must be a whole number"),
    ({"hidden_size": "64"}, "hidden_size must be a whole number up to 2,147,483,647, got '64'"),
    ({"vocab_size": 10**30}, "vocab_size must be a whole number"),
    ({"rms_norm_eps": float("inf")}, "rms_norm_eps must be a finite number, got inf"),
    ({"rope_theta": float("nan")}, "rope_theta must be a finite number"),
    ({"rope_theta": "10000"}, "rope_theta must be a finite number"),
    ({"rope_scaling": {"rope_type": "linear", "factor": float("inf")}}, "factor must be"),
    ({"rope_scaling": 7}, "rope_scaling must be an object"),
])
def test_config_json_numbers_are_whole_finite_numbers_or_refused(
        tmp_path: Path, change: dict[str, Any], says: str) -> None:
    model = tmp_path / "model"
    # json.dumps writes inf and nan as Infinity and NaN, which Python's reader accepts
    write(model / "config.json", {**BUILTIN_MODELS["tiny-llama"], **change})
    one_line_error(tmp_path, ["plan", str(model), "--cluster", str(cluster(tmp_path))], says)


def test_a_whole_number_written_as_a_float_still_reads(tmp_path: Path) -> None:
    model = tmp_path / "model"
    config = BUILTIN_MODELS["tiny-llama"]
    write(model / "config.json", {**config, "num_hidden_layers":
                                  float(config["num_hidden_layers"])})
    result = runner.invoke(app, ["plan", str(model), "--cluster", str(cluster(tmp_path)),
                                 "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["layout"]["strip"]


# --- cluster files ----------------------------------------------------------------------


@pytest.mark.parametrize(("card", "says"), [
    ({"total_bytes": float("inf")}, "total_bytes must be a number of bytes"),
    ({"total_bytes": float("nan")}, "total_bytes must be a number of bytes"),
    ({"total_bytes": "9" * 400 + "GB"}, "more than any card holds"),
    ({"free_bytes": 10**40}, "free_bytes must be a number of bytes"),
    ({"flops": float("inf"), "mem_bandwidth": 1e9}, "flops must be a positive number"),
    ({"held_by_others": [{"pid": "x", "bytes": 1}]}, "pid must be a process id"),
    ({"index": 10**30}, "index must be a card index"),
])
def test_cluster_files_with_impossible_values_are_refused(tmp_path: Path,
                                                          card: dict[str, Any],
                                                          says: str) -> None:
    one_line_error(tmp_path, ["plan", "tiny-llama", "--cluster", str(cluster(tmp_path, card))],
                   "--cluster", says)


def test_a_link_with_infinite_latency_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path / "links.json", {
        "fellows": [{"id": "a", "cards": [{"kind": "cpu", "total_bytes": "16GB"}]}],
        "links": {"default": {"bandwidth_bytes_s": 1e8, "latency_s": float("inf")}}})
    one_line_error(tmp_path, ["plan", "tiny-llama", "--cluster", str(path)], "latency_s")


# --- safetensors --------------------------------------------------------------------------

LORA_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


def adapter(tmp_path: Path, entry: dict[str, Any], data_bytes: int = 64) -> Path:
    root = tmp_path / "adapter"
    write(root / "adapter_config.json", {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]})
    header = json.dumps({LORA_A: entry}).encode()
    (root / "adapter_model.safetensors").write_bytes(
        struct.pack("<Q", len(header)) + header + bytes(data_bytes))
    return root


@pytest.mark.parametrize(("entry", "says"), [
    ({"dtype": "F32", "shape": [4, 64], "data_offsets": [0, 10**15]}, "past the end"),
    ({"dtype": "F32", "shape": [4, 4], "data_offsets": [64, 0]}, "past the end"),
    ({"dtype": "F32", "shape": [4, 64], "data_offsets": [0, 64]}, "is 1024 bytes, its range 64"),
    ({"dtype": "F32", "shape": [-4], "data_offsets": [0, 16]}, "bad header entry"),
    ({"dtype": "Q9", "shape": [4], "data_offsets": [0, 16]}, "not a tensor this reader knows"),
])
def test_safetensors_ranges_must_lie_in_the_file_and_match_the_shape(
        tmp_path: Path, entry: dict[str, Any], says: str) -> None:
    one_line_error(tmp_path, ["load", "tiny-llama", "--adapter", str(adapter(tmp_path, entry))],
                   "adapter_model.safetensors", says)


def test_a_safetensors_header_longer_than_its_file_is_refused(tmp_path: Path) -> None:
    root = adapter(tmp_path, {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]})
    (root / "adapter_model.safetensors").write_bytes(struct.pack("<Q", 2**40) + b"{}")
    one_line_error(tmp_path, ["load", "tiny-llama", "--adapter", str(root)],
                   "not a safetensors file")


# --- what the agent answers ----------------------------------------------------------------


async def test_an_answer_that_cannot_be_encoded_is_an_error_not_a_dead_agent(
        tmp_path: Path) -> None:
    import trio

    from p2pswarm.control import client as control_client
    from p2pswarm.control.server import emit, serve_control
    from p2pswarm.errors import ControlError

    async def handle(request: dict[str, Any]) -> Any:
        if request["op"] == "giant":  # a plan of a model config with 2**31-sized layers
            emit({"bytes": 2**90})
            return {"does_not_fit_bytes": 2**90}
        return {"ok": request["op"]}

    async with trio.open_nursery() as nursery:
        await nursery.start(serve_control, tmp_path, handle)
        for streaming in (False, True):
            def ask() -> Any:
                if streaming:
                    return control_client.stream(tmp_path, {"op": "giant"}, lambda e: None, 5.0)
                return control_client.request(tmp_path, {"op": "giant"}, 5.0)
            with pytest.raises(ControlError, match="could not be encoded"):
                await trio.to_thread.run_sync(ask)
        still = await trio.to_thread.run_sync(
            lambda: control_client.request(tmp_path, {"op": "status"}, 5.0))
        assert still == {"ok": "status"}
        nursery.cancel_scope.cancel()
