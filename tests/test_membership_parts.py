"""The membership machine's parts on their own: suspicion, the leave handshake, the roster,
the clock and the failure detector's verdicts."""

from __future__ import annotations

import random

import pytest

from p2pswarm.config import GossipConfig
from p2pswarm.effects import Effect, SendDatagram
from p2pswarm.membership.clock import Clock
from p2pswarm.membership.detector import FailureDetector
from p2pswarm.membership.leave import LeaveHandshake
from p2pswarm.membership.roster import Entry, Roster
from p2pswarm.membership.states import ALIVE, DEAD, INF, SUSPECT
from p2pswarm.membership.suspicion import Suspicion, suspicion_bounds
from p2pswarm.membership.timing import suspicion_timeout_s
from p2pswarm.wire.gossip import Left, Ping

A, B, C, ME = b"a" * 16, b"b" * 16, b"c" * 16, b"m" * 16


def test_a_suspicion_shrinks_with_independent_confirmations_only() -> None:
    s = Suspicion(3, 10.0, A, 1.0, 8.0, 2)
    assert s.deadline == 18.0 and not s.due(17.9) and s.due(18.0)
    assert s.confirm(10.0, gap_s=0.4)  # the first one always counts
    assert not s.confirm(10.2, gap_s=0.4)  # too close to the last one: the same fade
    assert s.confirm(10.5, gap_s=0.4)
    assert s.counted == 2 and s.deadline == pytest.approx(10.0 + 1.0)
    assert s.add_source(B) and not s.add_source(B) and not s.add_source(A)


def test_nobody_listening_cuts_a_suspicion_to_the_clean_floor() -> None:
    s = Suspicion(0, 5.0, A, 3.0, 12.0, 2)
    s.nobody_listens(0.8)
    assert (s.min_s, s.max_s) == (0.8, 0.8) and s.deadline == pytest.approx(5.8)
    s.nobody_listens(2.0)  # never lengthens it again
    assert s.min_s == 0.8


def test_another_watchers_run_extends_ours_only_if_they_touch() -> None:
    s = Suspicion(0, 10.0, A, 1.0, 8.0, 2)
    assert s.joined_run(11.0, 1.9) == 11.0  # nobody reported a run
    s.report(3000, 10.5)  # failing since 7.5, said at 10.5
    assert s.joined_run(11.0, 1.9) == pytest.approx(7.5)
    assert s.joined_run(13.0, 1.9) == 13.0  # too long after the report


def test_suspicion_bounds_grow_with_loss() -> None:
    config = GossipConfig()
    clean, lossy = suspicion_bounds(config, 10, 0.0), suspicion_bounds(config, 10, 0.5)
    assert clean[0] == config.tuning.suspicion_floor_clean_s
    assert lossy[0] == config.tuning.suspicion_floor_lossy_s
    assert clean[0] <= clean[1] and suspicion_bounds(config, 3, 0.0)[2] == 0
    assert suspicion_timeout_s(0, *reversed(clean[:2]), 0) >= clean[0]


def test_the_leave_handshake_spreads_once_enough_fellows_acknowledge() -> None:
    seqs = iter(range(100))
    config = GossipConfig(probe_timeout_s=0.5, leave_timeout_s=2.0)
    roster = _roster((A, ALIVE), (B, ALIVE), (C, ALIVE))
    leave = LeaveHandshake(config, roster, lambda: next(seqs))
    assert not leave.spread(2, True) and not leave.acknowledged(7)
    out: list[Effect] = []
    goodbye = Left(ME, 4)
    leave.begin(goodbye, 0.0, out)
    assert [e.messages for e in out if isinstance(e, SendDatagram)] == [
        (goodbye, Ping(seq, node, ME)) for seq, node in enumerate((A, B, C))]
    assert leave.deadline() == 0.5 and not leave.due(0.4) and leave.due(0.5)
    assert leave.acknowledged(0) and leave.acknowledged(1) and not leave.acknowledged(9)
    assert not leave.acknowledged(1)  # the same ping acked twice: counted once
    assert leave.acked == 2 and not leave.spread(2, gossip_done=False)
    assert leave.spread(2, gossip_done=True)
    roster.live_remove(C)  # found dead meanwhile: it will not answer
    out.clear()
    leave.ask_again(goodbye, 1.9, out)
    assert out == [] and leave.deadline() == INF
    assert leave.spread(5, gossip_done=False)  # nobody left to wait for


def test_the_clock_only_moves_forward() -> None:
    clock = Clock(5.0)
    clock.advance(4.0)
    assert clock.now == 5.0
    clock.advance(6.5)
    assert clock.now == 6.5


def _roster(*states: tuple[bytes, int]) -> Roster:
    roster = Roster(ME, random.Random(1))
    for node, state in states:
        roster.add(Entry(node, node.hex()[:4], f"10.0.0.{node[0]}:1", b"", 0, 1, state, 0.0))
    return roster


def test_the_roster_keeps_the_live_set_ring_and_reaps() -> None:
    roster = _roster((A, ALIVE), (B, SUSPECT), (C, DEAD))
    assert sorted(roster.live) == [A, B] and len(roster) == 3
    assert roster.successor(1) == A  # the ring wraps past this node's id
    roster.live_remove(A)
    assert roster.live == [B] and roster.successor(1) == B
    roster.schedule_reap(60.0, C)
    assert roster.due_reaps(59.0) == [] and roster.due_reaps(60.0) == [C]
    assert roster.reap(C, 60.0, 60.0, max_lost=4) is not None
    assert C not in roster.members and C in roster.lost
    assert roster.take_changes() == [ME]  # the first call gives this node
    roster.changed(B, roster=False)  # metadata only: not the election's business
    assert (roster.version, roster.roster_version, roster.take_changes()) == (1, 0, [])
    roster.changed(A)
    assert (roster.version, roster.roster_version, roster.take_changes()) == (2, 1, [A])


def test_a_failed_probe_on_a_clean_link_is_a_suspect_verdict() -> None:
    config = GossipConfig()
    roster = _roster((A, ALIVE), (B, ALIVE), (C, ALIVE))
    stats = {k: 0 for k in ("probes", "probes_failed", "probes_inconclusive",
                            "probes_refused", "confirmations_sent", "suspicions_raised")}
    detector = FailureDetector(ME, config, random.Random(2), roster, stats,
                               next_probe_at=0.0, seq=0, now=0.0)
    detector.loss = 0.0  # a clean link: one failure, with nacks, is enough
    p = detector.start_probe(0.0)
    assert p is not None and stats["probes"] == 1
    assert len(detector.go_indirect(p)) == 2  # the two other fellows help
    p.nacks = 2
    verdict = detector.finish_probe(False, 1.0)
    assert verdict.kind == "suspect" and verdict.target == p.target
    assert verdict.start_s == 0.0 and not verdict.nobody_listens
    p = detector.start_probe(1.0)
    assert p is not None
    verdict = detector.finish_probe(True, 1.1)
    assert verdict.kind == "healthy" and detector.awareness.score == 0


def test_a_probe_that_heard_nothing_at_all_is_inconclusive() -> None:
    roster = _roster((A, ALIVE), (B, ALIVE))
    stats = {k: 0 for k in ("probes", "probes_failed", "probes_inconclusive")}
    detector = FailureDetector(ME, GossipConfig(), random.Random(3), roster, stats,
                               next_probe_at=0.0, seq=0, now=0.0)
    p = detector.start_probe(0.0)
    assert p is not None and detector.go_indirect(p)
    verdict = detector.finish_probe(False, 1.0)  # no ack, not one nack
    assert verdict.kind == "inconclusive" and stats["probes_inconclusive"] == 1
    assert detector.next_probe_at == 1.0  # asked once more, at once
