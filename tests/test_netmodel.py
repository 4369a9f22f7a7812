"""The pure network model: TCP's retransmission timer, and one radio chain two ways."""

from __future__ import annotations

import pytest

from p2pswarm.errors import ConfigError
from p2pswarm.sim.gossip_lab import RandomDraws
from p2pswarm.transport.netmodel import (
    DATA_RETRANSMISSION,
    HANDSHAKE_RETRANSMISSION,
    RTO_MAX_S,
    FadeTimeline,
    GilbertElliott,
    LossState,
    Retransmission,
    SplitMixRng,
    is_lost,
)


@pytest.mark.parametrize(("timer", "sent", "give_up", "expected"), [
    (HANDSHAKE_RETRANSMISSION, 0.0, 5.0, [0.0, 1.0, 3.0]),
    (HANDSHAKE_RETRANSMISSION, 0.0, 3.0, [0.0, 1.0]),  # not at the give-up instant
    (Retransmission(0.25), 0.0, 5.0, [0.0, 0.25, 0.75, 1.75, 3.75]),
    (DATA_RETRANSMISSION, 10.0, 12.0, [10.0, 10.2, 10.6, 11.4]),
    (Retransmission(1.0, max_rto_s=2.0), 0.0, 8.0, [0.0, 1.0, 3.0, 5.0, 7.0]),
    (DATA_RETRANSMISSION, 5.0, 5.0, []),  # sent after giving up: never
])
def test_the_timer_doubles_up_to_its_cap_and_stops_at_give_up(timer, sent, give_up,
                                                              expected) -> None:
    assert list(timer.attempts(sent, give_up)) == pytest.approx(expected)


def test_first_arrival_is_the_first_copy_not_lost() -> None:
    lost_until = 2.0
    arrival = HANDSHAKE_RETRANSMISSION.first_arrival(
        0.0, 10.0, lambda t: None if t < lost_until else t + 0.01)
    assert arrival == pytest.approx(3.01)  # sent at 0, 1, 3: the third gets through
    assert HANDSHAKE_RETRANSMISSION.first_arrival(0.0, 10.0, lambda t: None) is None
    assert DATA_RETRANSMISSION.retry(0.0, 40.0) == (40.0, RTO_MAX_S)
    with pytest.raises(ConfigError):
        Retransmission(0.0)


def test_both_chain_keepers_lose_about_the_bad_fraction() -> None:
    model = GilbertElliott(bad_fraction=0.2, mean_burst_s=0.3)
    timeline = FadeTimeline(model, RandomDraws(7))
    state, rng = LossState(), SplitMixRng("t")
    steps = 200_000
    ahead = sum(timeline.lost_at(k * 0.05) for k in range(steps)) / steps
    lazy = sum(is_lost(state, model, rng, k * 0.05) for k in range(steps)) / steps
    assert ahead == pytest.approx(0.2, abs=0.02) and lazy == pytest.approx(0.2, abs=0.02)
    assert timeline.longest_outage_s(0.0, 100.0) > 0.3
