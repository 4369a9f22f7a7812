"""The harness proves itself: every planted bug is caught by the oracle in a run short
enough for CI (the shipped `smoke` scenario, through the real CLI), and the honest run of
the same scenario is ok. A plant added to ``PLANTED`` without a check here fails."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from p2pswarm.cli import app
from p2pswarm.sim.harness import PLANTED
from p2pswarm.sim.oracle import Oracle
from p2pswarm.sim.scenario import Checks

# what the oracle says when it catches each plant
CAUGHT_BY = {
    "never-refutes": "did not refute",
    "never-declares-dead": "never saw a crash as dead",
}


def simulate(*args: str) -> tuple[int, dict]:
    result = CliRunner().invoke(app, ["simulate", "smoke", "--json", "--no-progress", *args])
    return result.exit_code, json.loads(result.stdout)


def test_every_plant_has_a_check() -> None:
    assert set(CAUGHT_BY) == set(PLANTED)


def test_the_honest_smoke_run_is_ok() -> None:
    code, doc = simulate()
    assert code == 0 and doc["ok"], doc["failures"]
    assert doc["unrefuted_beliefs"] == 0 and doc["crash_to_dead_s"]["missed"] == 0


@pytest.mark.parametrize("plant", sorted(PLANTED))
def test_the_oracle_catches_every_planted_bug_in_a_smoke_run(plant: str) -> None:
    code, doc = simulate("--plant", plant)
    assert code == 1 and not doc["ok"]
    assert doc["variant"] == f"ours+{plant}"
    assert any(CAUGHT_BY[plant] in f for f in doc["failures"]), doc["failures"]


def test_reachable_time_is_summed_across_cuts() -> None:
    # fellow 1 is cut off for 5 s every 20 s; a belief that outlasts many cuts, never
    # refuted, is caught though no gap between cuts is longer than 15 s
    oracle = Oracle(2, Checks(refute_within_s=30.0, refute_grace_s=5.0, max_suspect_s=120.0))
    for i in range(2):
        oracle.started(i, 0.0)
    for k in range(10):
        oracle.cut(1, 20.0 * k + 10.0)
        oracle.uncut(1, 20.0 * k + 15.0)
    oracle.event(11.0, 0, "suspect", 1, 0, 0)  # during a cut: excused at first
    oracle.event(200.0, 0, "alive", 1, 1, 0)
    r = oracle.finish(210.0)
    assert r["long_suspicions"] == 0  # no gap since a cut was over 120 s
    assert r["unrefuted_beliefs"] == 1 and any("did not refute" in f for f in r["failures"])
    # ~10 s reachable between cuts (20 s less the 5 s cut and the 5 s grace), 9 of them
    assert 85.0 < oracle.unrefuted[0]["reachable_s"] < 95.0


def test_a_fellow_that_refutes_soon_after_its_cut_is_not_flagged() -> None:
    oracle = Oracle(2, Checks(refute_within_s=30.0, refute_grace_s=10.0))
    for i in range(2):
        oracle.started(i, 0.0)
    oracle.cut(1, 10.0)
    oracle.event(12.0, 0, "dead", 1, 0, 0)
    oracle.uncut(1, 60.0)
    oracle.event(63.0, 0, "alive", 1, 1, 0)  # refuted 3 s after it was back
    r = oracle.finish(100.0)
    assert r["ok"] and r["unrefuted_beliefs"] == 0


def test_a_belief_still_held_at_the_end_is_judged() -> None:
    oracle = Oracle(2, Checks(refute_within_s=30.0, max_suspect_s=120.0))
    for i in range(2):
        oracle.started(i, 0.0)
    oracle.event(5.0, 0, "suspect", 1, 0, 0)  # never refuted, never cut off
    r = oracle.finish(200.0)
    assert r["long_suspicions"] == 1 and r["unrefuted_beliefs"] == 1 and not r["ok"]
