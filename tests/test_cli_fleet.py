"""`plan --train` and `train --plan` on a cluster file: the fleet training plan
offline, as text and as JSON."""

from __future__ import annotations

import json
from pathlib import Path

from p2pswarm.planner import REFERENCE_CONFIGS
from tests.test_cli_plan import run

CLUSTERS = Path(__file__).resolve().parent.parent / "simulations" / "clusters"


def test_plan_train_shows_every_replica_its_batch_and_the_cards_left_out() -> None:
    result = run("plan", "llama-3-8b", "--train", "--lora-rank", "16", "--micro-batch",
                 "auto", "--cluster", str(CLUSTERS / "home.json"))
    assert result.exit_code == 0, result.output
    text = result.stdout
    assert "replica 0: micro-batch" in text and "on rig's RTX 3090 #0" in text
    assert "left out (" in text and "oldserver's CPU" in text and "plan_id " in text


def test_train_plan_offline_from_job_json(tmp_path: Path) -> None:
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"model": {"config": REFERENCE_CONFIGS["tinyllama-1.1b"]},
                               "seq_len": 256,
                               "micro_batch": "auto", "weights_dtype": "bf16",
                               "sync": {"inner_steps": 100}}))
    result = run("train", "--config", str(job), "--plan", "--cluster",
                 str(CLUSTERS / "fleet.json"), "--json")
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    assert plan["fits"] and len(plan["replicas"]) > 1
    assert all(r["micro_batch"] >= 1 and r["stages"] for r in plan["replicas"])
    left = [c for c in plan["cards"] if not c["used"]]
    assert left and all(c["reason"] for c in left)
    assert plan["fleet"]["round"]["codec"] == "int8"


def test_bad_fleet_options_are_one_line() -> None:
    result = run("plan", "tiny-llama", "--train", "--replicas", "lots", "--cluster",
                 str(CLUSTERS / "reference.json"))
    assert result.exit_code == 2 and "--replicas must be auto or a whole number" in \
        result.output


def test_lora_plan_on_a_cluster_whose_cpu_card_comes_after_two_gpus(tmp_path: Path) -> None:
    # The fleet planner leaves cards out by name (FELLOW:cpu); a CPU card numbered 2 in the
    # cluster file was "no such card" although it was in the card's own list.
    data = json.loads((CLUSTERS / "home-busy.json").read_text())
    desk = data["fellows"][0]
    assert [c["kind"] for c in desk["cards"]] == ["cuda", "cuda", "cpu"]
    desk["cards"][2]["index"] = 2
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(data))
    result = run("plan", "tiny-llama", "--train", "--lora-rank", "16", "--cluster", str(path))
    assert result.exit_code == 0, result.output
    assert "no such card" not in result.output and "plan_id " in result.stdout
