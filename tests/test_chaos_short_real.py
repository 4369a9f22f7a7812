"""The chaos run's short version in the default suite (``p2pswarm.sim.chaos_short``):
four real `join` fellows take a leader kill, a freeze, a leave and a crash, each fellow
started again from its own state directory; never two leaders in one term, a leader
again within 10 s whenever a majority runs, no agent crashed. The long run with a model
and a job is ``simulations/chaos_real.py`` (and ``tests/test_chaos_real.py``, opt-in)."""

from __future__ import annotations

import pytest

from p2pswarm.sim.chaos_short import EVENTS, run, verdict

pytestmark = pytest.mark.slow


def test_a_leader_kill_a_freeze_a_leave_and_a_crash_leave_one_leader_per_term() -> None:
    report = run(fellows=4, seed=2, say=lambda line: None)
    assert [e["kind"] for e in report["events"]] == list(EVENTS), report
    assert verdict(report) == [], report
    kill = report["events"][0]
    assert kill["new_leader_s"] is not None and kill["leader_after"] != kill["fellow"], report
    print(f"chaos short: {report['run_s']} s, leaderless spells {report['leaderless_s']}, "
          f"new leader {kill['new_leader_s']} s after the kill")
