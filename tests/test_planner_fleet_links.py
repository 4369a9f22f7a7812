"""The fleet plan on slow links: auto batches and auto-sized rounds by default, the
sharded all-reduce's bytes per fellow, access points sharing their airtime, and
`train --plan` naming each card once. Pure planner and CLI tests, fast."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from p2pswarm.errors import ConfigError
from p2pswarm.planner import (
    REFERENCE_CONFIGS,
    cluster_from_dict,
    plan,
    profile_from_config,
    request_from_dict,
)
from p2pswarm.planner.fleet import (
    COMM_SHARE,
    MIN_AUTO_INNER_STEPS,
    FleetPlan,
    FleetRequest,
    fleet_request_from_dict,
    plan_fleet,
)
from p2pswarm.planner.sync_cost import round_traffic

CLUSTERS = Path(__file__).resolve().parent.parent / "simulations" / "clusters"
GB = 10**9
TINYLLAMA = profile_from_config(REFERENCE_CONFIGS["tinyllama-1.1b"], "tinyllama-1.1b")


def fleet_file(bandwidth: float | None = None, latency: float | None = None,
               access_points: Any = ...) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((CLUSTERS / "fleet.json").read_text())
    if bandwidth is not None:
        data["links"]["default"] = {"bandwidth_bytes_s": bandwidth,
                                    "latency_s": latency or 0.0}
    if access_points is not ...:
        data["access_points"] = access_points
    return data


def default_plan(data: dict[str, Any], seq_len: int = 512) -> FleetPlan:
    """``plan --train`` with nothing but the sequence length: the defaults."""
    fleet, rest = fleet_request_from_dict({"kind": "train", "seq_len": seq_len,
                                           "weights_dtype": "bf16"})
    return plan_fleet(TINYLLAMA, cluster_from_dict(data), request_from_dict(rest), fleet)


def test_the_default_plan_on_slow_links_uses_most_of_the_fleet() -> None:
    fleet = default_plan(fleet_file(1.25e6, 0.04))
    assert fleet.fleet.auto_batch and fleet.fleet.inner_steps is None  # the defaults
    fellows = {s.fellow_id for r in fleet.replicas for s in r.plan.stages}
    assert fleet.fits and len(fellows) >= 30
    assert fleet.tokens_per_s >= 8 * fleet.single_pipeline_tokens_per_s
    rnd = fleet.round
    assert rnd is not None and rnd.inner_steps_auto
    assert rnd.comm_s <= rnd.compute_s * COMM_SHARE * (1 + 1e-9)
    assert rnd.busiest_bytes <= 3 * rnd.delta_bytes
    batches: dict[str, int] = {}  # the largest micro-batch of each kind of device
    for r in fleet.replicas:
        kind = r.plan.stages[0].fellow.split("-")[0]
        batches[kind] = max(batches.get(kind, 0), r.micro_batch)
    assert batches["server"] > batches["desktop"] and batches["server"] > batches["pi"]
    assert len({r.micro_batch for r in fleet.replicas}) >= 3
    # each replica says why its batch is what it is: memory per sample on its tightest card
    for r in fleet.replicas:
        assert r.memory is not None and r.memory.sample_bytes > 0
        assert r.micro_batch <= r.memory_micro_batch <= max(r.memory.holds, 1)
    assert "sized to the links" in fleet.sentence and "through" not in fleet.sentence


def test_rounds_grow_with_slower_links_and_a_number_still_wins() -> None:
    fast, slow = default_plan(fleet_file(4e6), 256), default_plan(fleet_file(0.5e6), 256)
    assert fast.round is not None and slow.round is not None
    assert slow.round.inner_steps > fast.round.inner_steps >= MIN_AUTO_INNER_STEPS
    for fleet in (fast, slow):
        assert fleet.round is not None
        assert fleet.round.comm_fraction <= COMM_SHARE + 1e-9
    fixed_part, rest = fleet_request_from_dict({"kind": "train", "seq_len": 256,
                                                "weights_dtype": "bf16", "inner_steps": 2,
                                                "micro_batch": 2, "replicas": 3})
    fixed = plan_fleet(TINYLLAMA, cluster_from_dict(fleet_file(0.5e6)),
                       request_from_dict(rest), fixed_part)
    assert fixed.round is not None and fixed.round.inner_steps == 2
    assert not fixed.round.inner_steps_auto and fixed.round.comm_fraction > COMM_SHARE
    assert {r.micro_batch for r in fixed.replicas} == {2}


def test_auto_inner_steps_and_the_number_it_chose_are_one_plan() -> None:
    """A leader fixes the number before placing: the plan_id must not change."""
    auto = default_plan(fleet_file(1.25e6), 256)
    assert auto.round is not None
    fleet, rest = fleet_request_from_dict({"kind": "train", "seq_len": 256,
                                           "weights_dtype": "bf16",
                                           "inner_steps": auto.round.inner_steps})
    fixed = plan_fleet(TINYLLAMA, cluster_from_dict(fleet_file(1.25e6)),
                       request_from_dict(rest), fleet)
    assert fixed.plan_id == auto.plan_id


def identical_fellows(n: int) -> dict[str, Any]:
    return {"fellows": [{"id": f"f{i:02d}", "cards": [
        {"kind": "cpu", "index": 0, "total_bytes": 64 * GB, "free_bytes": 60 * GB,
         "flops": 1e11, "mem_bandwidth": 2e10}]} for i in range(n)],
        "links": {"default": {"bandwidth_bytes_s": 1e6, "latency_s": 0.01}}}


def test_no_fellow_is_a_hub_whatever_the_number_of_replicas() -> None:
    profile = profile_from_config(REFERENCE_CONFIGS["smollm-135m"], "smollm-135m")
    request = request_from_dict({"kind": "train", "seq_len": 128, "weights_dtype": "bf16"})
    for n in (4, 8, 16):
        fleet = plan_fleet(profile, cluster_from_dict(identical_fellows(n)), request,
                           FleetRequest(replicas=n, inner_steps=50))
        rnd = fleet.round
        assert fleet.fits and rnd is not None
        # (R - 1) / R of a delta and of an update each way: under twice the delta
        expected = 2 * (n - 1) / n
        assert rnd.busiest_over_delta == pytest.approx(expected, rel=0.01)
        assert rnd.busiest_bytes <= 2 * rnd.delta_bytes
        # the round's sync is bounded by twice the delta on one link, whatever R
        assert rnd.comm_s <= 2 * rnd.delta_bytes / 1e6 + 1.0


def test_an_access_point_shares_its_airtime() -> None:
    pis = [f"pi-{i:02d}" for i in range(1, 21)]
    wide = default_plan(fleet_file(4e6, access_points={}), 256)
    narrow = default_plan(fleet_file(4e6, access_points={
        "ap-pis": {"capacity_bytes_s": 2e6, "fellows": pis}}), 256)
    assert wide.round is not None and narrow.round is not None
    assert narrow.round.limit == "access point ap-pis"
    assert narrow.round.comm_s > wide.round.comm_s
    assert narrow.round.inner_steps > wide.round.inner_steps
    assert narrow.round.comm_fraction <= COMM_SHARE + 1e-9
    # the shipped file groups its WiFi fellows, and says so when written back
    view = cluster_from_dict(fleet_file())
    assert view.access_points and view.access_point("e0000001") is not None
    assert cluster_from_dict(view.to_dict()) == view


@pytest.mark.parametrize("groups, message", [
    ([], "must be a JSON object"),
    ({"ap": {"fellows": ["pi-01"]}}, "needs capacity_bytes_s"),
    ({"ap": {"capacity_bytes_s": -1, "fellows": ["pi-01"]}}, "positive number"),
    ({"ap": {"capacity_bytes_s": 1e6, "fellows": ["nobody"]}}, "not a fellow"),
    ({"ap": {"capacity_bytes_s": 1e6, "fellows": []}}, "must list"),
    ({"a": {"capacity_bytes_s": 1e6, "fellows": ["pi-01"]},
      "b": {"capacity_bytes_s": 1e6, "fellows": ["pi-01"]}}, "already behind"),
])
def test_bad_access_points_are_refused(groups: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        cluster_from_dict(fleet_file(access_points=groups))


def test_round_traffic_counts_a_byte_between_two_members_twice() -> None:
    view = cluster_from_dict({**identical_fellows(3), "access_points": {
        "ap": {"capacity_bytes_s": 1e6, "fellows": ["f00", "f01"]}}})
    traffic = round_traffic({("f00", "f01"): 10**6, ("f01", "f02"): 10**6}, view)
    (ap,) = traffic.access_points
    assert ap.air_bytes == 3 * 10**6 and traffic.limit == "access point ap"
    assert traffic.busiest is not None and traffic.busiest.fellow_id == "f01"


def test_a_job_plan_of_single_pipelines_names_each_card_once() -> None:
    """`train --plan` of fixed-batch replicas: no card both left out and in a replica."""
    from p2pswarm.agent.training.jobs import card_key, job_plan
    from p2pswarm.cli.fleet_render import print_job_plan
    from p2pswarm.training.job import JobConfig

    view = cluster_from_dict(fleet_file())
    profile = profile_from_config(REFERENCE_CONFIGS["smollm-135m"], "smollm-135m")
    plans, exclude = [], []
    for _ in range(3):
        one = plan(profile, view, request_from_dict({
            "kind": "train", "seq_len": 128, "micro_batch": 2, "exclude": list(exclude)}))
        assert one.fits
        plans.append(one)
        exclude += [card_key(s) for s in one.stages]
    job = JobConfig.from_dict({"model": {"config": REFERENCE_CONFIGS["smollm-135m"]},
                               "micro_batch": 2})
    doc = job_plan(job, plans)
    console = Console(record=True, width=200)
    print_job_plan(doc, console)
    text = console.export_text()
    assert "Replica 0" not in text  # its own account would call the others left out
    left = text.split("\nleft out (")[1]
    for p in plans:
        for s in p.stages:
            assert f"on {s.fellow}'s CPU" in text
            assert f"  {s.fellow}'s CPU" not in left, s.fellow
    assert left.count("'s CPU") == 38 - len(exclude)


def test_train_plan_offline_lists_each_card_in_a_replica_or_left_out(tmp_path: Path) -> None:
    from tests.test_cli_plan import run

    job = tmp_path / "job.json"
    job.write_text(json.dumps({"model": {"config": REFERENCE_CONFIGS["tinyllama-1.1b"]},
                               "seq_len": 256, "weights_dtype": "bf16"}))
    result = run("train", "--config", str(job), "--plan", "--cluster",
                 str(CLUSTERS / "fleet.json"))
    assert result.exit_code == 0, result.output
    text = result.stdout
    placed, left = text.split("left out (") if "left out (" in text else (text, "")
    names = [f"pi-{i:02d}" for i in range(1, 21)] + [f"desktop-{i:02d}" for i in range(1, 11)]
    for name in names:  # each fellow once: in a replica's stages or left out
        assert (f"on {name}'s CPU" in placed) != (f"{name}'s CPU" in left), name
    assert "sized so its communication is at most a third" in text


def test_job_json_defaults_are_auto_and_a_number_wins() -> None:
    from p2pswarm.training.job import JobConfig

    job = JobConfig.from_dict({"model": "tiny-llama"})
    assert job.auto_batch and job.sync.inner_steps_auto
    shown = job.to_dict()
    assert shown["micro_batch"] == "auto" and shown["sync"]["inner_steps"] == "auto"
    assert JobConfig.from_dict(shown) == job
    request = job.fleet_request()
    assert request["micro_batch"] == "auto" and request["inner_steps"] == "auto"
    fixed = JobConfig.from_dict({"model": "tiny-llama", "micro_batch": 4,
                                 "sync": {"inner_steps": 20}})
    assert not fixed.auto_batch and fixed.micro_batch == 4
    assert not fixed.sync.inner_steps_auto and fixed.sync.inner_steps == 20
    with pytest.raises(ConfigError, match="inner_steps"):
        JobConfig.from_dict({"model": "tiny-llama", "sync": {"inner_steps": "soon"}})


def test_the_leader_reads_the_round_the_plan_sized() -> None:
    """A job with inner_steps auto takes the plan's round before it is placed."""
    from p2pswarm.agent.training.job_plan import JobPlan
    from p2pswarm.planner import fleet_plan_message

    doc = fleet_plan_message({"model": {"name": "tinyllama", "config":
                                        REFERENCE_CONFIGS["tinyllama-1.1b"]},
                              "kind": "train", "seq_len": 256, "weights_dtype": "bf16",
                              "replicas": "auto"}, cluster_from_dict(fleet_file(1.25e6)))
    assert doc["fleet"]["round"]["inner_steps_auto"]
    assert JobPlan.from_doc(doc).inner_steps == doc["fleet"]["round"]["inner_steps"]
    assert JobPlan.from_doc({"fleet": {"round": {"inner_steps": "many"}}}).inner_steps is None
