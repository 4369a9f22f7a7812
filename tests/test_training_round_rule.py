"""The round rule the driver and ``VirtualSwarm`` share: table-driven, no torch, no clock."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from p2pswarm.errors import ConfigError
from p2pswarm.training.round_rule import (
    delta_weight,
    round_budgets,
    round_closes,
    step_budgets,
    worth_waiting,
)


@dataclass
class FakeKeeper:
    everyone_sent: bool
    anything_arrived: bool
    deadline: float

    def ready(self, now: float) -> bool:
        return self.anything_arrived and (self.everyone_sent or now >= self.deadline)

    def next_deadline(self) -> float:
        return self.deadline


@pytest.mark.parametrize(("everyone_sent", "arrived", "now", "closes"), [
    (True, True, 1.0, True),  # every member sent: closes before its deadline
    (False, True, 1.0, False),  # some still to send, deadline ahead: stays open
    (False, True, 5.0, True),  # at the deadline, with whatever arrived
    (False, False, 5.0, True),  # at the deadline with nothing: closing moves it on
    (False, False, 1.0, False),
])
def test_a_round_closes_when_everyone_sent_or_at_its_deadline(
        everyone_sent: bool, arrived: bool, now: float, closes: bool) -> None:
    assert round_closes(FakeKeeper(everyone_sent, arrived, 5.0), now) is closes


@pytest.mark.parametrize(("samples", "staleness", "weight"), [
    (8, 0, 8.0), (8, 1, 4.0), (8, 2, 2.0), (8, 3, 0.0), (0, 1, 0.0)])
def test_a_late_delta_is_down_weighted_then_dropped(samples: int, staleness: int,
                                                    weight: float) -> None:
    assert delta_weight(samples, staleness, decay=0.5, bound=2) == weight


def test_budgets_go_by_speed_and_near_speeds_count_as_one() -> None:
    assert step_budgets({"a": 10.0, "b": 5.0, "c": 0.1}, 10) == {"a": 10, "b": 5, "c": 1}
    # within SAME_SPEED of the fastest: jitter never shortens a budget
    assert round_budgets({"a": 1.0, "b": 0.95, "c": 0.5}, 10) == {"a": 10, "b": 10, "c": 5}
    assert round_budgets({"a": 1.0, "b": 0.5}, 10, speed_aware=False) == {"a": 10, "b": 10}
    assert round_budgets({}, 10) == {}
    with pytest.raises(ConfigError):
        step_budgets({"a": 0.0}, 10)


@pytest.mark.parametrize(("own_step_s", "unsent", "waits"), [
    (1.0, [], True),  # nobody left to send
    (1.0, [(1, 1.0)], True),  # one step away: wait, as one process would
    (1.0, [(2, 1.0)], False),  # two of its steps away: train on
    (1.0, [(0, 9.0)], True),  # budget already spent: about to send
    (1.0, [(5, 0.0)], True),  # not measured yet
    (0.0, [(5, 1.0)], True),  # itself not measured yet
    (1.0, [(1, 1.0), (10, 1.0)], False),  # one slow replica is enough not to wait
])
def test_a_fresh_replica_waits_only_for_a_round_about_to_close(
        own_step_s: float, unsent: list[tuple[int, float]], waits: bool) -> None:
    assert worth_waiting(own_step_s, unsent) is waits
