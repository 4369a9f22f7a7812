"""The election on real `join` processes, as users meet it (p2pswarm.sim.field)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from p2pswarm.sim.field import leave_then_leader_crash, seed_last
from p2pswarm.sim.processes import local_swarm

pytestmark = pytest.mark.slow


def one_seed_last_run(_: int) -> dict:
    with local_swarm(lambda message: None, start_timeout_s=120) as swarm:
        return seed_last(swarm)


def test_a_seed_started_last_never_gives_a_term_two_leaders() -> None:
    # 2 swarms of three at once, each seed booting after its two joiners (20 and more:
    # simulations/field_election.py; 20 seeds in virtual time: test_election_churn)
    with ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(one_seed_last_run, range(2)))
    assert [r["two_leaders"] for r in runs] == [{}] * 2
    assert all(r["leader"] in ("a", "b", "c") for r in runs)


def test_a_leave_then_a_leader_crash_leaves_a_swarm_that_elects_and_restarts() -> None:
    with local_swarm(lambda message: None, start_timeout_s=120) as swarm:
        run = leave_then_leader_crash(swarm)
    assert run["leave_recorded_as"] == "left"
    assert run["second"][1] > run["first"][1] and run["new_leader_s"] <= 10.0
    assert run["third"] is not None and run["two_leaders"] == {}
