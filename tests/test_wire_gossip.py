"""Membership and election messages: round trips, sizes, and the datagram budget."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p2pswarm.config import GossipConfig
from p2pswarm.membership import LocalNode, Membership, SendDatagram, node_id_of
from p2pswarm.membership.proofs import alive_signed_bytes
from p2pswarm.sim.gossip_lab import SEAL_OVERHEAD_BYTES, fake_sign_for, fake_verify
from p2pswarm.wire import decode, encode, message_types
from p2pswarm.wire import gossip as g
from tests.wire_strategies import for_class

GOSSIP_TYPES = {tag: cls for tag, cls in message_types().items() if 10 <= tag < 70}
DATAGRAM_BUDGET = 1400 - SEAL_OVERHEAD_BYTES


def test_tags_sit_in_their_ranges() -> None:
    for tag, cls in GOSSIP_TYPES.items():
        assert g.is_election(cls.__new__(cls)) == (tag in g.ELECTION_TAGS), cls.__name__
    assert len(GOSSIP_TYPES) == 30  # Revoked, the admission exchange (27-30), certificates (40-41)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from(sorted(GOSSIP_TYPES.items())).flatmap(
    lambda item: for_class(item[1])), min_size=1, max_size=4))
def test_every_gossip_message_round_trips(messages: list) -> None:
    assert decode(encode(*messages)) == messages


def _alive(i: int) -> g.Alive:
    key = bytes([i]) * 32
    fields = (node_id_of(key), 7 + i, f"laptop-{i:02d}.kitchen", f"192.168.1.{100 + i}:7946",
              key, 3, 0, 2**60 + i)
    return g.Alive(*fields[:7], epoch=fields[7],
                   signature=fake_sign_for(key)(alive_signed_bytes(*fields)))


def test_a_ping_and_eight_updates_fit_one_sealed_datagram() -> None:
    ping = g.Ping(2**32 - 1, b"t" * 16, b"s" * 16)
    updates = [_alive(i) for i in range(4)] + [
        g.Suspect(b"x" * 16, 2**31, b"y" * 16, 2**32 - 1), g.Dead(b"d" * 16, 9, b"y" * 16),
        g.Left(b"l" * 16, 4), g.Suspect(b"z" * 16, 5, b"y" * 16, 3100)]
    size = len(encode(ping, *updates))
    assert size <= DATAGRAM_BUDGET, size
    assert size < 950  # room to spare: typical updates are small (a signed Alive ~150 B)


def test_membership_never_hands_out_an_oversized_datagram() -> None:
    key = b"k" * 32
    local = LocalNode(node_id_of(key), "desk", "10.0.0.1:7946", key)
    m = Membership(local, GossipConfig(), random.Random(1), sign=fake_sign_for(key),
                   verify=fake_verify, datagram_budget_bytes=DATAGRAM_BUDGET)
    m.join((), 0.0)
    for i in range(200):  # 200 newcomers at once: far more updates than one datagram holds
        m.handle(_alive(i), f"192.168.1.{100 + i}:7946", 0.0)
    sends = [e for e in m.tick(0.0) + m.tick(1.0) if isinstance(e, SendDatagram)]
    assert sends
    for effect in sends:
        assert len(encode(*effect.messages)) <= DATAGRAM_BUDGET


@pytest.mark.parametrize("msg", [
    g.SyncDigest(b"s" * 16, b"d" * 32, 100), g.SyncSame(), g.Noted(), g.MetaPull((b"n" * 16,)),
    g.LeaderIs(3, b"l" * 16, 5), g.VoteRequest(4, b"c" * 16, -3, 5, True),
])
def test_small_messages_stay_small(msg: object) -> None:
    assert len(encode(msg)) <= 64
