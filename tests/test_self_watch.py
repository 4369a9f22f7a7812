"""The agent watches itself: its loop's lag, what each fellow makes it hold, and a line
logged when a fellow's messages cost more than their budget."""

from __future__ import annotations

import logging

import pytest
import trio

from p2pswarm.agent.self_watch import HELD_BUDGET_BYTES, Held, SelfWatch

ROGUE = b"\x07" * 32


def watch() -> SelfWatch:
    w = SelfWatch("victim", interval_s=0.25, warn_s=0.1)
    w.watch(lambda: {ROGUE: Held(3, HELD_BUDGET_BYTES + 1)}, lambda fellow: "rogue")
    return w


def test_lag_is_kept_and_a_late_wake_is_logged_naming_the_costliest_fellow(
        caplog: pytest.LogCaptureFixture) -> None:
    w = watch()
    w.note(0.002, 1.0)
    w.charge(ROGUE, "frame", 0.2, 1.0)
    with caplog.at_level(logging.WARNING, "p2pswarm.agent"):
        w.note(0.3, 2.0)
        w.note(0.4, 3.0)  # the same complaint, within a minute: not logged again
    lines = [r.getMessage() for r in caplog.records if "woke" in r.getMessage()]
    assert lines == ["victim: the agent's loop woke 300 ms late (over 100 ms); lately "
                     "rogue's messages cost it most (200 ms)"]
    doc = w.to_doc()
    assert doc["loop_lag_ms"] == 400.0 and doc["loop_lag_max_ms"] == 400.0
    assert doc["loop_lag_recent_max_ms"] == 400.0 and doc["loop_lag_over_warn"] == 2
    w.note(0.001, 100.0)  # a minute later, the recent maximum forgets
    assert w.to_doc()["loop_lag_recent_max_ms"] == 1.0
    assert w.to_doc()["loop_lag_max_ms"] == 400.0


def test_a_costly_message_and_a_fellow_holding_too_much_are_logged_and_counted(
        caplog: pytest.LogCaptureFixture) -> None:
    w = watch()
    with caplog.at_level(logging.WARNING, "p2pswarm.agent"):
        w.charge(ROGUE, "frame", 0.01, 1.0)  # within budget: nothing
        w.charge(ROGUE, "frame", 0.5, 1.0)
        w.check_held(1.0)
    text = caplog.text
    assert "a frame from rogue held the loop 500 ms, over the 50 ms a message may cost" in text
    assert "rogue makes this agent hold 64.0 MiB in 3 streams, over its 64 MiB budget" in text
    doc = w.to_doc()
    assert doc["over_budget"] == {"frame": 1, "held-bytes": 1}
    assert doc["held_bytes"] == HELD_BUDGET_BYTES + 1
    assert doc["held_by_fellow"] == {ROGUE.hex(): {"name": "rogue", "streams": 3,
                                                   "bytes": HELD_BUDGET_BYTES + 1}}


async def test_the_watch_task_measures_how_late_it_wakes(
        autojump_clock: trio.testing.MockClock) -> None:
    w = watch()
    with trio.move_on_after(1.1):
        await w.run()
    assert w.ticks == 4 and w.max_s == 0.0  # virtual time: never late
