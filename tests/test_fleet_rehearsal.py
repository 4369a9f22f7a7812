"""The fleet rehearsal on a small fleet file: the plan's replicas train in virtual time
against the best single pipeline; drops cost time, never a round past its deadline."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from p2pswarm.planner import REFERENCE_CONFIGS

pytest.importorskip("torch")

GB = 10**9


def small_fleet() -> dict[str, Any]:
    def cpu(i: str, free: float, flops: float) -> dict[str, Any]:
        return {"id": i, "name": i, "cards": [{"kind": "cpu", "index": 0,
                                               "total_bytes": 16 * GB, "free_bytes": free,
                                               "flops": flops, "mem_bandwidth": 1.2e10}]}
    return {"fellows": [cpu("server", 14 * GB, 2e11), cpu("desk-1", 6 * GB, 1.2e11),
                        cpu("desk-2", 6 * GB, 1.2e11), cpu("pi-1", 4 * GB, 1.2e10)],
            "links": {"default": {"bandwidth_bytes_s": 4e6, "latency_s": 0.005}},
            "access_points": {"ap": {"capacity_bytes_s": 8e6,
                                     "fellows": ["desk-2", "pi-1"]}}}


def test_the_rehearsal_trains_the_plan_and_counts_what_churn_costs() -> None:
    from p2pswarm.sim.fleet_rehearsal import markdown, rehearse

    result = rehearse(small_fleet(), model=REFERENCE_CONFIGS["smollm-135m"], seq_len=256,
                      single_steps=6, seed=1, drop_every_s=60.0)
    single, fleet, churned = result["runs"]
    assert len(result["replicas"]) >= 2 and single["rounds"] >= 1
    # one rule for every arm: the first held-out evaluation at or below the target, which
    # for the single pipeline may come before its last step
    assert single["time_to_target_s"] == result["single_time_s"]
    assert single["time_to_target_s"] <= single["curve"][-1][0]
    assert min(loss for _, loss in single["curve"]) <= result["target_loss"]
    assert fleet["rounds"] >= 1 and fleet["curve"]
    # the fleet's global model learns: its loss falls below the untrained model's
    assert fleet["curve"][-1][1] < 5.0
    assert fleet["bytes_per_fellow"] and max(fleet["bytes_per_fellow"].values()) > 0
    # drops (here every minute) pause the replicas behind the access point
    assert churned["paused_s"] > 0 and fleet["paused_s"] == 0
    assert churned["time_to_target_s"] is None or fleet["time_to_target_s"] is None or \
        churned["time_to_target_s"] >= fleet["time_to_target_s"]
    for run in (fleet, churned):  # rounds close by their deadline, drops or not
        assert run["max_round_gap_s"] <= result["round_deadline_s"] + 1e-6
    assert len(result["lead_by_round"]["fleet"]) == len(fleet["curve"])
    assert "| fleet, W3 drops |" in markdown(result)


def test_an_outage_past_the_suspicion_time_redoes_the_step_unless_stages_are_kept() -> None:
    from p2pswarm.sim.fleet_rehearsal import REPLACED_AFTER_S, outage_cost_s

    out_s = REPLACED_AFTER_S + 1
    short, long = [(300.0, 305.0)], [(300.0, 300.0 + out_s)]
    # 300 s into a step of 400 s in 4 micro-batches (100 s each)
    # a short outage: its length, then the micro-batch in flight again
    assert outage_cost_s(short, 0.0, 1000.0, 400.0, 4) == 5.0 + 100.0
    # a long one tears the pipeline down: the 300 s of the step done so far are redone
    assert outage_cost_s(long, 0.0, 1000.0, 400.0, 4) == out_s + 300.0
    # kept stages (the what-if): only the micro-batch in flight is redone
    assert outage_cost_s(long, 0.0, 1000.0, 400.0, 4, stages_kept=True) == out_s + 100.0
    assert outage_cost_s(short, 400.0, 1000.0, 400.0, 4) == 0.0  # began before the step


def test_the_lead_at_a_round_reads_the_single_curve_between_its_evaluations() -> None:
    from p2pswarm.sim.fleet_rehearsal import lead_by_round, time_to_loss_s

    single = [(100.0, 4.0), (200.0, 3.0), (300.0, 2.5)]
    assert time_to_loss_s(single, 3.5) == 150.0
    assert time_to_loss_s(single, 4.5) == 100.0 and time_to_loss_s(single, 2.0) is None
    assert lead_by_round(single, [(50.0, 3.5), (60.0, 2.0)]) == [3.0, None]


def test_w3_outages_come_every_ten_minutes_for_two_to_ten_seconds() -> None:
    from p2pswarm.sim.fleet_rehearsal import w3_outages

    spans = w3_outages(["a", "b"], 3600.0, random.Random(0))
    for name in ("a", "b"):
        assert len(spans[name]) == 6
        assert all(2.0 <= b - a <= 10.0 for a, b in spans[name])


def test_simulate_fleet_reads_its_arguments(tmp_path: Path) -> None:
    from tests.test_cli_plan import run

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"fellows": [], "access_points": []}))
    result = run("simulate", "fleet", "--cluster", str(bad))
    assert result.exit_code == 2 and "access_points" in result.output
    result = run("simulate", "fleet", "--steps", "1")
    assert result.exit_code == 2 and "--steps must be" in result.output


def test_the_ceilings_bound_the_lead_by_steps_and_by_samples() -> None:
    from p2pswarm.sim.fleet_rehearsal import FleetSchedule, RehearsedReplica, ceilings

    def replica(name: str, step_s: float, batch: int) -> RehearsedReplica:
        return RehearsedReplica(name, (name,), step_s, 1, batch * 8, batch, 0.0, (), 0)

    fleet = FleetSchedule("p", 10, 1000.0, 200.0, (replica("fast", 100.0, 2),
                                                   replica("slow", 1000.0, 8)), (), (), "")
    single = FleetSchedule("s", 1, 0.0, 0.0, (replica("one", 500.0, 8),), (), (), "")
    # rounds closed every 1,250 s (the median gap: the last, cut short by the end of the
    # run, does not count): at most 10 single-pipeline steps (5,000 s) a round
    bound = ceilings(fleet, single, [(1250.0, 3.0), (2500.0, 2.9), (3750.0, 2.8),
                                     (4000.0, 2.7)])
    assert bound["round_s"] == 1250.0 and bound["steps"] == 4.0
    assert bound["fastest"] == 5.0  # 500 s a step against the fast replica's 100 s
    # samples/s: 2/100 + 8/1000 against 8/500
    assert bound["samples"] == pytest.approx((0.02 + 0.008) / 0.016)
    assert ceilings(fleet, single, [])["steps"] is None


def test_the_what_ifs_weigh_deltas_and_tune_the_single_pipeline_as_told() -> None:
    from p2pswarm.errors import ConfigError
    from p2pswarm.sim.fleet_rehearsal import markdown, rehearse

    model = REFERENCE_CONFIGS["smollm-135m"]
    result = rehearse(small_fleet(), model=model, seq_len=256, single_steps=3, seed=1,
                      drops=False, weighting="steps", single_batch=16, fleet_lr=1e-3)
    single = result["single_pipeline"]
    assert single["rehearsed_batch"] == 16 and single["samples_per_step"] == 128
    assert result["tuning"] == {"lr": 3e-3, "fleet_lr": 1e-3, "weighting": "steps"}
    assert result["runs"][1]["curve"] and result["ceiling"]["samples"] > 0
    assert "Ceilings on the fleet's lead" in markdown(result)
    with pytest.raises(ConfigError, match="weighting"):
        rehearse(small_fleet(), model=model, weighting="tokens")
    with pytest.raises(ConfigError, match="batch"):
        rehearse(small_fleet(), model=model, single_batch=0)
    with pytest.raises(ConfigError, match="fleet_lr"):
        rehearse(small_fleet(), model=model, fleet_lr=-1.0)
