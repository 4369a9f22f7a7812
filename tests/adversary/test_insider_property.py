"""Property: whatever schema-valid membership messages an insider sends, in any order and
with any integers, the machine raises nothing and everything it sends still encodes
(a number it cannot outdo saturates here and never spreads)."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p2pswarm import wire
from p2pswarm.config import GossipConfig
from p2pswarm.effects import SendDatagram, StreamRequest
from p2pswarm.membership import LocalNode, Membership, node_id_of
from p2pswarm.membership.proofs import alive_signed_bytes
from p2pswarm.sim.gossip_lab import fake_sign_for, fake_verify
from p2pswarm.wire import gossip as g
from tests.wire_strategies import for_class

U32_MAX = 2**32 - 1


def machine(i: int) -> Membership:
    key = bytes([i + 1]) * 32
    local = LocalNode(node_id_of(key), f"n{i}", f"10.0.0.{i + 1}:7946", key)
    return Membership(local, GossipConfig(), random.Random(i), sign=fake_sign_for(key),
                      verify=fake_verify)


A, B = machine(0), machine(1)
NODES = st.sampled_from([A.node_id, B.node_id, b"\x07" * 16])
EDGES = st.sampled_from([0, 1, 2, U32_MAX - 1, U32_MAX]) | st.integers(0, U32_MAX)


def signed_by_b(incarnation: int, meta_version: int) -> g.Alive:
    loc = B.local
    fields = (loc.node_id, incarnation, loc.name, loc.addr, loc.public_key, meta_version, 0, 1)
    return g.Alive(*fields[:6], epoch=1,
                   signature=fake_sign_for(loc.public_key)(alive_signed_bytes(*fields)))


HOSTILE = st.one_of(
    st.builds(g.Suspect, NODES, EDGES, NODES, st.integers(0, U32_MAX)),
    st.builds(g.Dead, NODES, EDGES, NODES),
    st.builds(g.Left, NODES, EDGES),
    st.builds(signed_by_b, EDGES, EDGES),
    st.builds(g.Ping, st.integers(0, U32_MAX), NODES, NODES),
    st.builds(g.PingReq, st.integers(0, U32_MAX), NODES, st.just("10.0.0.9:1"), NODES, EDGES),
    *(for_class(cls) for cls in (g.Alive, g.Ack, g.Nack, g.SyncSummary, g.MetaPush)),
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.lists(HOSTILE, min_size=1, max_size=5), min_size=1, max_size=8))
def test_hostile_sequences_raise_nothing_and_everything_sent_encodes(batches) -> None:
    a = machine(0)
    a.join((), 0.0)
    a.handle(signed_by_b(0, 0), B.local.addr, 0.0)
    now = 0.0
    for batch in batches:
        now += 0.3
        effects = a.handle_datagram(batch, "10.0.0.66:7946", now) + a.tick(now)
        for effect in effects:
            if isinstance(effect, SendDatagram):
                wire.encode(*effect.messages)
            elif isinstance(effect, StreamRequest):
                wire.encode(effect.message)
        wire.encode(*a.piggyback(10_000, now))
        wire.encode(g.SyncRecords(a.node_id, (a.self_record(),)))
    assert 0 <= a.incarnation <= U32_MAX and 0 <= a.meta_version <= U32_MAX
