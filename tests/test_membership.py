"""The membership machine on its own: formulas, the queue, and hand-driven exchanges."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from p2pswarm.config import GossipConfig, GossipTuning
from p2pswarm.errors import AuthenticationError
from p2pswarm.membership import (
    Event,
    LocalNode,
    Membership,
    SendDatagram,
    StreamRequest,
    node_id_of,
    retransmit_limit,
    suspicion_timeout_s,
)
from p2pswarm.membership.awareness import Awareness
from p2pswarm.membership.broadcasts import BroadcastQueue
from p2pswarm.membership.proofs import U32_MAX, alive_signed_bytes
from p2pswarm.membership.timing import push_pull_interval_s, suspicion_max_s
from p2pswarm.sim.gossip_lab import fake_sign_for, fake_verify
from p2pswarm.wire import gossip as g

# --- formulas ----------------------------------------------------------------------------


@pytest.mark.parametrize(("mult", "n", "limit"), [
    (4, 1, 4), (4, 9, 4), (4, 10, 8), (4, 99, 8), (4, 100, 12), (5, 1000, 20), (3, 5, 3),
])
def test_retransmit_limit_grows_with_log_n(mult: int, n: int, limit: int) -> None:
    assert retransmit_limit(mult, n) == limit


@pytest.mark.parametrize(("confirmations", "expected_s"), [
    (0, 8.0), (1, 8.0 - 7.0 * math.log(2) / math.log(3)), (2, 1.0), (5, 1.0),
])
def test_suspicion_timeout_shrinks_logarithmically(confirmations: int,
                                                   expected_s: float) -> None:
    assert suspicion_timeout_s(confirmations, 2, 1.0, 8.0) == pytest.approx(expected_s)


def test_suspicion_max_and_push_pull_scale() -> None:
    assert suspicion_max_s(4.0, 100, 1.0) == pytest.approx(8.0)
    assert suspicion_max_s(4.0, 3, 1.0) == pytest.approx(4.0)  # log10(max(N, 10))
    assert push_pull_interval_s(30.0, 32) == 30.0
    assert push_pull_interval_s(30.0, 100) == 90.0
    assert suspicion_timeout_s(3, 0, 2.0, 9.0) == 2.0  # too few fellows to confirm


def test_awareness_is_bounded_and_scales() -> None:
    a = Awareness(8)
    for _ in range(20):
        a.apply(1)
    assert a.score == 7 and a.scale(0.5) == 4.0
    for _ in range(20):
        a.apply(-1)
    assert a.score == 0 and a.scale(0.5) == 0.5


def test_broadcast_queue_replaces_limits_and_lingers() -> None:
    q = BroadcastQueue(linger_s=2.0)
    q.add(b"a", g.Left(b"a" * 16, 1))
    q.add(b"a", g.Left(b"a" * 16, 2))  # newer news about the same fellow replaces
    q.add(b"b", g.Left(b"b" * 16, 1))
    assert len(q) == 2
    first = q.take(1000, limit=2, now=0.0)
    assert [m.incarnation for m in first] == [1, 2]  # newest first among the least sent
    q.take(1000, limit=2, now=0.0)
    assert len(q) == 0  # both reached the limit: no more gossip rounds for them
    assert q.take(1000, limit=2, now=0.0, lingering=False) == []
    assert len(q.take(1000, limit=2, now=1.0)) == 2  # but they still ride along
    assert q.take(1000, limit=2, now=3.5) == []  # until they expire
    q.add(b"c", g.Left(b"c" * 16, 1))
    assert q.take(5, limit=2, now=4.0) == []  # nothing fits


def test_lingering_update_rides_to_each_recipient_once() -> None:
    q = BroadcastQueue(linger_s=4.0)
    q.add(b"a", g.Left(b"a" * 16, 1))
    assert len(q.take(1000, limit=1, now=0.0, to="x:1")) == 1  # its one gossip send
    assert len(q.take(1000, limit=1, now=0.5, to="x:1")) == 1  # lingering: once more to x
    assert q.take(1000, limit=1, now=1.0, to="x:1") == []  # x has it twice: no more
    assert len(q.take(1000, limit=1, now=1.5, to="y:1")) == 1  # another fellow still gets it
    assert q.take(1000, limit=1, now=2.0, to="y:1") == []
    q.add(b"a", g.Left(b"a" * 16, 2))  # newer news about the same fellow: told afresh
    assert len(q.take(1000, limit=1, now=2.5, to="x:1")) == 1
    assert len(q.take(1000, limit=1, now=3.0, to="x:1")) == 1


# --- hand-driven machines ----------------------------------------------------------------


def make(i: int, *, config: GossipConfig | None = None, metadata: bytes = b"",
         tuning: GossipTuning | None = None) -> Membership:
    key = bytes([i + 1]) * 32
    local = LocalNode(node_id_of(key), f"n{i}", f"10.0.0.{i + 1}:7946", key)
    config = config or GossipConfig()
    if tuning is not None:
        config = dataclasses.replace(config, tuning=tuning)
    return Membership(local, config, random.Random(i),
                      sign=fake_sign_for(key), verify=fake_verify, metadata=metadata)


def alive_of(m: Membership, incarnation: int) -> g.Alive:
    """``m``'s Alive at ``incarnation``, signed as ``m`` would sign it."""
    loc = m.local
    fields = (loc.node_id, incarnation, loc.name, loc.addr, loc.public_key, 0, 0, 0)
    return g.Alive(*fields[:6], signature=fake_sign_for(loc.public_key)(
        alive_signed_bytes(*fields)))


def sends(effects: list) -> list[SendDatagram]:
    return [e for e in effects if isinstance(e, SendDatagram)]


def kinds(effects: list) -> list[str]:
    return [e.kind for e in effects if isinstance(e, Event)]


def joined_pair(tuning: GossipTuning | None = None) -> tuple[Membership, Membership]:
    a, b = make(0, tuning=tuning), make(1)
    a.join((), 0.0)
    (req,) = [e for e in b.join((a.local.addr,), 0.0) if isinstance(e, StreamRequest)]
    reply, effects = a.handle_stream(req.message, b.local.addr, 0.0)
    assert "member-joined" in kinds(effects)
    assert "joined" in kinds(b.handle_reply(req.request_id, reply, 0.0))
    return a, b


def test_roster_changes_give_an_election_only_what_changed() -> None:
    a, b = joined_pair()
    changed, gone = a.roster_changes()  # the first call: everyone, this node included
    assert {m.node_id for m in changed} == {a.node_id, b.node_id} and gone == ()
    assert a.roster_changes() == ((), ())
    a.handle(g.Suspect(b.node_id, 0, a.node_id), b.local.addr, 1.0)
    a.set_metadata(b"cards", 1.0)  # not roster news
    changed, gone = a.roster_changes()
    assert [(m.node_id, m.state) for m in changed] == [(b.node_id, "suspect")]
    a.handle(g.Dead(b.node_id, 0, a.node_id), b.local.addr, 2.0)
    assert [m.state for m in a.roster_changes()[0]] == ["dead"]
    a.tick(2.0 + 61.0)  # the tombstone is reaped: gone
    assert a.roster_changes() == ((), (b.node_id,))
    assert a.member(b.node_id) is None


def test_join_through_a_seed_exchanges_full_state() -> None:
    a, b = joined_pair()
    assert [m.name for m in a.members()] == sorted(["n0", "n1"], key=lambda n: {
        "n0": a.node_id, "n1": b.node_id}[n])
    assert b.member(a.node_id).state == "alive" and a.member(b.node_id).state == "alive"
    assert a.digest() == b.digest()


def test_join_retries_with_backoff_while_no_seed_answers() -> None:
    b = make(1)
    (req,) = [e for e in b.join(("10.9.9.9:7946",), 0.0) if isinstance(e, StreamRequest)]
    assert "join-retry" in kinds(b.stream_failed(req.request_id, 5.0))
    assert b.next_deadline() == pytest.approx(6.0)  # 1 s, then 2, 4, ... capped
    (again,) = [e for e in b.tick(6.0) if isinstance(e, StreamRequest)]
    b.stream_failed(again.request_id, 11.0)
    assert b.next_deadline() == pytest.approx(13.0)


def test_ping_is_acked_with_news_riding_along() -> None:
    a, b = joined_pair()
    (out,) = sends(a.handle_datagram([g.Ping(7, a.node_id, b.node_id)], b.local.addr, 1.0))
    assert out.addr == b.local.addr and out.messages[0] == g.Ack(7)
    assert sends(a.handle_datagram([g.Ping(8, b"x" * 16, b.node_id)], b.local.addr, 1.0)) == []


def test_a_suspected_node_refutes_on_the_ack_itself() -> None:
    a, b = joined_pair()
    effects = a.handle_datagram([g.Ping(9, a.node_id, b.node_id),
                                 g.Suspect(a.node_id, 0, b.node_id)], b.local.addr, 2.0)
    assert a.incarnation == 1 and "refuted" in kinds(effects)
    (ack,) = [s for s in sends(effects) if s.messages[0] == g.Ack(9)]
    assert any(isinstance(m, g.Alive) and m.incarnation == 1 for m in ack.messages)
    assert any(isinstance(e, StreamRequest) and isinstance(e.message, g.Alive)
               for e in effects)  # and pushes it to its accuser over a stream


def test_old_news_about_us_is_answered_not_refuted_again() -> None:
    a, b = joined_pair()
    a.handle(g.Suspect(a.node_id, 0, b.node_id), b.local.addr, 2.0)
    assert a.incarnation == 1
    effects = a.handle(g.Dead(a.node_id, 0, b.node_id), b.local.addr, 3.0)
    assert a.incarnation == 1  # no new incarnation for stale news...
    (reply,) = sends(effects)  # ...but the sender is told the current one
    assert reply.messages == (a._alive_msg(),)


def test_suspicion_refutation_and_incarnation_rules() -> None:
    a, b = joined_pair()
    bid = b.node_id
    assert "suspect" in kinds(a.handle(g.Suspect(bid, 0, b"q" * 16), "x:1", 1.0))
    a.handle(alive_of(b, 0), "x:1", 1.1)
    assert a.member(bid).state == "suspect"  # same incarnation does not refute
    unsigned = g.Alive(bid, 1, "n1", b.local.addr, b.local.public_key, 0)
    assert kinds(a.handle(unsigned, "x:1", 1.15)) == []  # nobody else speaks for b
    assert a.counters()["unsigned_alives"] == 1
    assert "alive" in kinds(a.handle(alive_of(b, 1), "x:1", 1.2))
    assert a.member(bid).state == "alive"
    a.handle(g.Dead(bid, 0, b"q" * 16), "x:1", 1.3)
    assert a.member(bid).state == "alive"  # older incarnation: ignored
    assert "dead" in kinds(a.handle(g.Dead(bid, 1, b"q" * 16), "x:1", 1.4))
    a.handle(g.Suspect(bid, 1, b"q" * 16), "x:1", 1.5)
    assert a.member(bid).state == "dead"  # a dead fellow is not merely suspect
    assert "alive" in kinds(a.handle(alive_of(b, 2), "x:1", 1.6))


def test_leave_is_left_not_dead_and_reaped_later() -> None:
    a, b = joined_pair()
    effects = b.leave(5.0)
    (left,) = {s.messages for s in sends(effects)}
    assert "left" in kinds(a.handle(left[0], b.local.addr, 5.0))
    assert a.member(b.node_id).state == "left"
    a.handle(g.Dead(b.node_id, 0, b"q" * 16), "x:1", 6.0)
    assert a.member(b.node_id).state == "left"
    assert "reaped" in kinds(a.tick(5.0 + GossipConfig().dead_reap_after_s))
    assert a.member(b.node_id) is None


def test_an_alive_whose_key_does_not_match_its_id_is_dropped() -> None:
    a = make(0)
    a.join((), 0.0)
    a.handle(g.Alive(b"f" * 16, 1, "fake", "10.0.0.9:7946", b"k" * 32, 0), "x:1", 0.0)
    assert a.member(b"f" * 16) is None and a.counters()["bad_bindings"] == 1


def test_a_restarted_node_rejoins_with_a_higher_incarnation() -> None:
    a, b = joined_pair()
    a.handle(g.Dead(b.node_id, 3, a.node_id), "x:1", 1.0)
    b2 = make(1)  # same identity, fresh process, incarnation 0
    (req,) = [e for e in b2.join((a.local.addr,), 2.0) if isinstance(e, StreamRequest)]
    reply, _ = a.handle_stream(req.message, b2.local.addr, 2.0)
    effects = b2.handle_reply(req.request_id, reply, 2.0)
    # the verdict counts at the incarnation b signed (0), not at the 3 a third party named
    assert a.counters()["claims_clamped"] == 1
    assert b2.incarnation == 1 and "refuted" in kinds(effects)
    alive = b2._alive_msg()
    assert "alive" in kinds(a.handle(alive, b2.local.addr, 2.1))
    assert a.member(b.node_id).incarnation == 1


def test_failed_probe_with_nacks_raises_suspicion_on_a_clean_link() -> None:
    a, b = joined_pair()
    c = make(2)
    t = 0.0
    for _ in range(200):  # a clean history: every ping answered, helpers relay
        t = a.next_deadline()
        for s in sends(a.tick(t)):
            first = s.messages[0]
            if isinstance(first, g.Ping):
                a.handle(g.Ack(first.seq), s.addr, t + 0.01)
        if t > 40.0:
            break
    assert a.loss_estimate < 0.05
    a.handle(c._alive_msg(), c.local.addr, t)
    for _ in range(50):  # now b stops answering; c (the only helper) still works
        t = a.next_deadline()
        effects = a.tick(t)
        for s in sends(effects):
            first = s.messages[0]
            if isinstance(first, g.Ping) and first.target == c.node_id:
                a.handle(g.Ack(first.seq), c.local.addr, t + 0.01)
            if isinstance(first, g.PingReq) and s.addr == c.local.addr:
                assert any(isinstance(e, StreamRequest) for e in effects)  # stream fallback
                effects = a.handle(g.Nack(first.seq), c.local.addr, t + 0.4)
                assert "suspect" in kinds(effects)
                assert a.member(b.node_id).state == "suspect"
                return
    raise AssertionError("b was never probed")


def _fade(fade_s: float, until: float = 30.0, seen: tuple[float, ...] = (),
          refute_after: float = math.inf) -> tuple[float | None, float]:
    """a probes b, whose radio goes out for ``fade_s`` from a's first ping of it after 5 s
    (after fades of ``seen`` seconds, 10 s apart, first); helper c answers a's pings and
    nacks whatever it was asked about b meanwhile. ``refute_after`` s into the last fade a
    newer incarnation of b reaches a (b refuted someone else's suspicion). Returns when a
    suspected b during the last fade (None: never) and when that fade began."""
    lossy = GossipTuning(loss_prior=GossipTuning().lossy_reference)  # a believes its links lossy
    a, b = joined_pair(lossy)
    c = make(2)
    a.handle(c._alive_msg(), c.local.addr, 0.0)
    fades = [*seen, fade_s]
    until += 10.0 * len(seen)
    fade_at, fade_len = math.inf, 0.0
    t = 0.0
    while t < until:
        t = a.next_deadline()
        effects = a.tick(t)
        if not fades and t >= fade_at + refute_after:
            refute_after = math.inf
            b.handle(g.Suspect(b.node_id, b.incarnation, c.node_id), c.local.addr, t)
            effects += a.handle(b._alive_msg(), c.local.addr, t)
        for s in sends(effects):
            msg = s.messages[0]
            if isinstance(msg, g.Ping) and msg.target == c.node_id:
                effects += a.handle(g.Ack(msg.seq), c.local.addr, t + 0.01)
            elif isinstance(msg, g.Ping):
                due = 5.0 + 10.0 * (len(seen) + 1 - len(fades))
                if fades and t >= due and not fade_at <= t < fade_at + fade_len:
                    fade_at, fade_len = t, fades.pop(0)
                if not fade_at <= t < fade_at + fade_len:
                    effects += a.handle(g.Ack(msg.seq), b.local.addr, t + 0.01)
                    if a.member(b.node_id).state == "suspect":  # b heard of it: refutes
                        inc = a.member(b.node_id).incarnation
                        b.handle(g.Suspect(b.node_id, inc, a.node_id), a.local.addr, t)
                        effects += a.handle(b._alive_msg(), b.local.addr, t + 0.02)
            elif isinstance(msg, g.PingReq) and s.addr == c.local.addr:
                effects += a.handle(g.Nack(msg.seq), c.local.addr, t + 0.3)
        if "suspect" in kinds(effects) and not fades:
            return t, fade_at
    return None, fade_at


def test_on_a_lossy_link_a_short_fade_is_doubt_and_a_long_one_suspicion() -> None:
    span = GossipTuning().doubt_span_lossy_s
    assert span > 0.9  # a fade of 0.9 s fails two probes in a row: no longer enough
    suspected, _ = _fade(0.9)
    assert suspected is None
    suspected, fade_at = _fade(60.0)
    assert suspected is not None and suspected - fade_at >= span


def test_a_node_that_saw_long_fades_end_waits_them_out() -> None:
    """The span grows to the fades this node has seen fellows come back from: after
    eight 1.7 s fades, a 1.4 s fade is doubt, where with no such history it is suspicion."""
    assert GossipTuning().doubt_span_max_s >= 1.7
    suspected, _ = _fade(1.4)
    assert suspected is not None
    suspected, _ = _fade(1.4, seen=(1.7,) * 8)
    assert suspected is None
    suspected, fade_at = _fade(60.0, seen=(1.7,) * 8)  # a crash is still found
    assert suspected is not None and suspected - fade_at >= 1.7


def test_a_newer_incarnation_restarts_the_doubt() -> None:
    """Failed probes from before a fellow's refutation do not count against the new
    incarnation: the span of failures starts again after it."""
    span = GossipTuning().doubt_span_lossy_s
    suspected, fade_at = _fade(60.0, refute_after=0.8)
    assert suspected is not None and suspected - (fade_at + 0.8) >= span


def test_a_probe_that_hears_nothing_at_all_blames_ourselves() -> None:
    a, b = joined_pair()
    c = make(2)
    a.handle(c._alive_msg(), c.local.addr, 0.0)
    t = 0.0
    for _ in range(10):  # acks and nacks never come back
        t = a.next_deadline()
        a.tick(t)
    assert a.member(b.node_id).state == "alive" and a.member(c.node_id).state == "alive"
    assert a.counters()["probes_inconclusive"] >= 2 and a.health_score > 0


def ed25519() -> tuple[Ed25519PrivateKey, bytes]:
    private = Ed25519PrivateKey.generate()
    return private, private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


def ed_verify(public_key: bytes, signature: bytes, data: bytes) -> None:
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, data)
    except Exception as exc:
        raise AuthenticationError("bad-signature") from exc


def signed_pair() -> tuple[Membership, Membership, StreamRequest]:
    """a, and b joined through it with metadata b"cards v1" (Ed25519), and b's join."""
    nodes = []
    for i, (private, public) in enumerate([ed25519(), ed25519()]):
        local = LocalNode(node_id_of(public), f"n{i}", f"10.0.0.{i + 1}:7946", public)
        nodes.append(Membership(local, GossipConfig(), random.Random(i), sign=private.sign,
                                verify=ed_verify, metadata=b"cards v1" if i else b""))
    a, b = nodes
    a.join((), 0.0)
    (req,) = [e for e in b.join((a.local.addr,), 0.0) if isinstance(e, StreamRequest)]
    reply, _ = a.handle_stream(req.message, b.local.addr, 0.0)
    b.handle_reply(req.request_id, reply, 0.0)
    return a, b, req


def test_metadata_is_signed_pulled_and_newer_wins() -> None:
    a, b, req = signed_pair()
    assert a.member(b.node_id).metadata == b"cards v1"  # came with the join
    v2 = b"cards v2 " * 64  # too big to ride in an Alive: announced, then pulled
    b.set_metadata(v2, 1.0)
    effects = a.handle(b._alive_msg(), b.local.addr, 1.0)  # announced: version 2
    (pull,) = [e for e in effects if isinstance(e, StreamRequest)]
    assert pull.addr == b.local.addr and isinstance(pull.message, g.MetaPull)
    answer, _ = b.handle_stream(pull.message, a.local.addr, 1.0)
    assert "metadata" in kinds(a.handle_reply(pull.request_id, answer, 1.1))
    assert a.member(b.node_id).metadata == v2
    v1 = req.message.records[0]  # b's own record as it joined: version 1, signed
    assert v1.meta_version == 1
    a.handle(g.MetaPush((v1,)), b.local.addr, 2.0)
    assert a.member(b.node_id).metadata == v2  # an old version never wins
    forged = dataclasses.replace(v1, meta_version=9, metadata=b"evil")
    a.handle(g.MetaPush((forged,)), b.local.addr, 2.0)
    assert a.member(b.node_id).metadata == v2  # nor a forged one
    assert a.counters()["bad_signatures"] == 1


def test_small_metadata_rides_in_the_alive_that_announces_it() -> None:
    a, b, _ = signed_pair()
    b.set_metadata(b"cards v2", 1.0)
    alive = b._alive_msg()
    assert alive.metadata == b"cards v2" and alive.meta_signature is not None
    forged = dataclasses.replace(alive, meta_version=3, metadata=b"evil")
    a.handle(forged, b.local.addr, 1.0)
    assert a.member(b.node_id).metadata == b"cards v1"  # a forged one never lands
    assert a.counters()["bad_signatures"] == 2  # neither the Alive's nor the metadata's
    effects = a.handle(alive, b.local.addr, 1.0)
    assert not [e for e in effects if isinstance(e, StreamRequest)]  # nothing to pull
    assert "metadata" in kinds(effects) and a.member(b.node_id).metadata == b"cards v2"
    b.tick(60.0)  # long after the news: a refutation only announces the version
    b.handle(g.Suspect(b.node_id, b.incarnation, a.node_id), a.local.addr, 60.0)
    refutation = b._alive_msg()
    assert refutation.incarnation > alive.incarnation and refutation.meta_signature is None
    assert refutation.meta_version == 2


def test_an_alive_is_relayed_with_its_metadata_only_while_that_is_news() -> None:
    a, b, _ = signed_pair()
    b.set_metadata(b"cards v2", 1.0)
    news = b._alive_msg()
    a.handle(news, b.local.addr, 1.0)

    def relayed() -> g.Alive:
        (alive,) = [m for m in a.piggyback(10_000, 1.0) if isinstance(m, g.Alive)]
        return alive

    assert relayed().metadata == b"cards v2"  # news here: the bytes spread with it
    # a refutation learnt later with the same bytes (as from a sync record): not news
    b.incarnation += 1
    again = b._alive_msg()
    a.handle(again, "", 2.0)
    alive = relayed()
    assert alive.incarnation == again.incarnation and alive.meta_version == 2
    assert alive.metadata == b"" and alive.meta_signature is None


def test_a_restarted_node_publishes_above_its_old_metadata() -> None:
    private, public = ed25519()
    other_private, other_public = ed25519()

    def node(i: int, key, pub, metadata: bytes) -> Membership:  # type: ignore[no-untyped-def]
        local = LocalNode(node_id_of(pub), f"n{i}", f"10.0.0.{i + 1}:7946", pub)
        return Membership(local, GossipConfig(), random.Random(i), sign=key.sign,
                          verify=ed_verify, metadata=metadata)

    def join(b: Membership, a: Membership, now: float) -> None:
        (req,) = [e for e in b.join((a.local.addr,), now) if isinstance(e, StreamRequest)]
        reply, _ = a.handle_stream(req.message, b.local.addr, now)
        b.handle_reply(req.request_id, reply, now)

    a = node(0, other_private, other_public, b"")
    a.join((), 0.0)
    b = node(1, private, public, b"cards v1")
    join(b, a, 0.0)
    for version in range(2, 6):  # a long life: metadata version 5
        b.set_metadata(b"training %d" % version, float(version))
        a.handle(b._alive_msg(), b.local.addr, float(version))
    a.handle(g.MetaPush((b.self_record(),)), b.local.addr, 6.0)
    assert a.member(b.node_id).metadata == b"training 5"
    b2 = node(1, private, public, b"idle")  # restarted: version 1 again
    join(b2, a, 10.0)  # learns its old self at version 5 and publishes above it
    assert b2.meta_version > 5
    a.handle(g.MetaPush((b2.self_record(),)), b2.local.addr, 11.0)
    assert a.member(b.node_id).metadata == b"idle"


def test_a_restarted_node_outdoes_its_old_metadata_at_the_same_version() -> None:
    """Its last life published version 1 too, other bytes: fellows holding those compare
    versions, so they would keep them; the owner publishes above once it sees them."""
    private, public = ed25519()

    def life(metadata: bytes) -> Membership:
        local = LocalNode(node_id_of(public), "n1", "10.0.0.2:7946", public)
        return Membership(local, GossipConfig(), random.Random(1), sign=private.sign,
                          verify=ed_verify, metadata=metadata)

    old = life(b"16 GB")
    old._news_of_metadata(0.0)
    relayed = old._alive_msg()  # its Alive with its bytes inline, as gossip relays it
    assert relayed.meta_version == 1 and relayed.metadata == b"16 GB"
    new = life(b"8 GB")  # restarted: version 1 again, incarnation 0 again
    effects = new.handle(relayed, "10.0.0.1:7946", 1.0)
    assert new.meta_version == 2 and "metadata" in kinds(effects)
    new.handle(relayed, "10.0.0.1:7946", 2.0)
    assert new.meta_version == 2  # outdone once, not again
    same = life(b"8 GB")  # the same bytes at the same version: nothing to outdo
    same.handle(dataclasses.replace(relayed, metadata=b"8 GB",
                                    meta_signature=same.meta_signature), "10.0.0.1:7946", 1.0)
    assert same.meta_version == 1
    unsigned = life(b"8 GB")  # bytes we never signed: no reason to publish again
    unsigned.handle(dataclasses.replace(relayed, metadata=b"forged"), "10.0.0.1:7946", 1.0)
    assert unsigned.meta_version == 1
    top = life(b"8 GB")  # at the top of the U32 range: saturate, never wrap
    top.meta_version = U32_MAX
    top.meta_signature = top._sign_meta()
    top_old = life(b"16 GB")
    top_old.meta_version = U32_MAX
    top_old.meta_signature = top_old._sign_meta()
    top_old._news_of_metadata(0.0)
    top.handle(top_old._alive_msg(), "10.0.0.1:7946", 1.0)
    assert top.meta_version == U32_MAX and top.counters()["incarnation_exhausted"] == 1


def test_a_fellow_drops_the_metadata_of_a_restarted_member_s_last_life() -> None:
    """The restarted member never saw its old record (its seed knew nothing of it) and
    refuted a suspicion at its own incarnation: a fellow taking that refutation sees a later
    signed epoch, so its version-1 bytes from before no longer outrank the fresh ones."""
    private, public = ed25519()
    other_private, other_public = ed25519()

    def life(metadata: bytes, epoch: int) -> Membership:
        local = LocalNode(node_id_of(public), "b", "10.0.0.2:7946", public)
        return Membership(local, GossipConfig(), random.Random(1), sign=private.sign,
                          verify=ed_verify, metadata=metadata, epoch=epoch)

    a = Membership(LocalNode(node_id_of(other_public), "a", "10.0.0.1:7946", other_public),
                   GossipConfig(), random.Random(2), sign=other_private.sign, verify=ed_verify)
    a.join((), 0.0)
    old = life(b"16 GB", epoch=1)
    old._news_of_metadata(0.0)
    old_alive = old._alive_msg()
    a.handle(old_alive, old.local.addr, 0.0)
    new = life(b"8 GB", epoch=2)
    new.join((), 1.0)
    new.handle(g.Suspect(new.node_id, 0, a.node_id), a.local.addr, 2.0)
    assert (new.incarnation, new.meta_version) == (1, 1)  # nothing told it of its old bytes
    effects = a.handle(new._alive_msg(), new.local.addr, 2.1)
    held = a.member(new.node_id)
    assert held.incarnation == 1 and held.metadata == b""  # not the old life's cards
    # the old life's bytes, relayed late (before the fresh ones came): not taken again
    a.handle(old_alive, old.local.addr, 2.15)
    a.handle_stream(g.SyncRecords(old.node_id, (old.self_record(),), ()), "x:1", 2.15)
    assert a.member(new.node_id).metadata == b""
    (pull,) = [e for e in effects if isinstance(e, StreamRequest)]
    reply, _ = new.handle_stream(pull.message, a.local.addr, 2.2)
    a.handle_reply(pull.request_id, reply, 2.2)
    assert a.member(new.node_id).metadata == b"8 GB"


def test_anti_entropy_sends_only_what_differs() -> None:
    a, b = joined_pair()
    (req,) = [e for e in a.tick(100.0) if isinstance(e, StreamRequest)]
    assert isinstance(req.message, g.SyncDigest)
    same, _ = b.handle_stream(req.message, a.local.addr, 100.0)
    assert same == g.SyncSame()  # equal views: one hash each way, nothing else
    c = make(2)
    b.handle(c._alive_msg(), c.local.addr, 100.0)  # b learns of c; a does not
    summary, _ = b.handle_stream(req.message, a.local.addr, 100.0)
    assert isinstance(summary, g.SyncSummary) and len(summary.entries) == 3
    (records_req,) = [e for e in a.handle_reply(req.request_id, summary, 100.0)
                      if isinstance(e, StreamRequest)]
    assert records_req.message.records == () and records_req.message.want == (c.node_id,)
    answer, _ = b.handle_stream(records_req.message, a.local.addr, 100.0)
    a.handle_reply(records_req.request_id, answer, 100.0)
    assert a.member(c.node_id).state == "alive" and a.digest() == b.digest()


def test_tick_always_makes_progress() -> None:
    a, _ = joined_pair()
    t = 0.0
    for _ in range(500):
        d = a.next_deadline()
        assert d is not None and d >= t - 1e-9
        t = max(t, d)
        a.tick(t)
        t += 1e-6
    assert t > 100.0  # about one wake-up per half second, not a spin


def test_a_probe_whose_ack_waits_behind_a_late_loop_is_not_failed() -> None:
    """A starved node (its own loop woke late) reads the ack waiting in its socket before
    it judges the probe, and counts the lateness against its own health (Lifeguard)."""
    def probe_then_stall(lag_noted: bool) -> Membership:
        a, b = joined_pair()
        ping = None
        while ping is None:
            t = a.next_deadline()
            ping = next((m for e in a.tick(t) if isinstance(e, SendDatagram)
                         for m in e.messages if isinstance(m, g.Ping)), None)
        late = a.next_deadline() + 1.0  # the probe's deadline, and the loop a second late
        (ack,) = [m for e in b.handle(ping, a.local.addr, t) if isinstance(e, SendDatagram)
                  for m in e.messages if isinstance(m, g.Ack)]
        if lag_noted:
            a.note_lag(GossipConfig().probe_timeout_s / 2, late)  # (a lag within bounds)
            assert a.health_score == 0
            a.note_lag(1.0, late)
            assert a.health_score == 1  # probes slow down, no dead verdicts from it
        a.tick(late)
        a.handle(ack, b.local.addr, late + 0.01)  # read from the socket after the tick
        return a

    assert probe_then_stall(False).counters()["probes_failed"] == 1
    starved = probe_then_stall(True)
    assert starved.counters()["probes_failed"] == 0
    assert starved.counters()["late_wakes"] == 1
    assert starved.health_score == 0  # the ack it then read lowered the score again
