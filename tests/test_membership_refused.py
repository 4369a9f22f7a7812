"""A probe whose stream ping the target's host refuses: nothing listens there, so the
process is gone and no radio fade needs waiting out (sans-I/O, by hand)."""

from __future__ import annotations

from p2pswarm.config import GossipTuning
from p2pswarm.membership import SendDatagram, StreamRequest
from p2pswarm.wire import gossip as g
from tests.test_membership import joined_pair, make


def _crash_to_dead(refused: bool, late: bool = False, crash_at: float = 5.0
                   ) -> tuple[float, dict[str, int]]:
    """a probes b on a lossy network; b's process dies at ``crash_at``: pings to it go
    unanswered, helper c nacks, and a's stream pings fail, refused or timed out (the
    refusal first, as an RST comes back in a round trip; ``late``: after the nacks).
    Returns how long after its first unanswered ping a declared b dead, and a's
    counters."""
    lossy = GossipTuning(loss_prior=GossipTuning().lossy_reference)
    a, b = joined_pair(lossy)
    c = make(2)
    a.handle(c._alive_msg(), c.local.addr, 0.0)
    t, first_miss = 0.0, None
    while t < 60.0:
        t = a.next_deadline()
        effects = a.tick(t)
        if not late:  # the refusal before the nacks
            effects.sort(key=lambda e: not isinstance(e, StreamRequest))
        i = 0
        while i < len(effects):  # answers may bring more effects
            e = effects[i]
            i += 1
            if isinstance(e, StreamRequest) and isinstance(e.message, g.Ping) \
                    and e.addr == b.local.addr and t >= crash_at:
                effects += a.stream_failed(e.request_id, t + 0.01, nobody_listens=refused)
            elif isinstance(e, SendDatagram):
                msg = e.messages[0]
                if isinstance(msg, g.Ping) and (msg.target == c.node_id or t < crash_at):
                    effects += a.handle(g.Ack(msg.seq), e.addr, t + 0.01)
                elif isinstance(msg, g.Ping) and first_miss is None:
                    first_miss = t
                elif isinstance(msg, g.PingReq) and e.addr == c.local.addr:
                    effects += a.handle(g.Nack(msg.seq), c.local.addr, t + 0.3)
        if a.member(b.node_id).state == "dead":
            assert first_miss is not None
            return t - first_miss, a.counters()
    raise AssertionError("b was never declared dead")


def test_a_refused_stream_ping_finds_a_crash_without_waiting_out_a_fade() -> None:
    refused_s, counters = _crash_to_dead(True)
    timed_out_s, plain = _crash_to_dead(False)
    late_s, _ = _crash_to_dead(True, late=True)
    assert late_s < timed_out_s - 1.0, (late_s, timed_out_s)
    floor = GossipTuning().suspicion_floor_lossy_s
    assert timed_out_s >= floor - 0.1  # a silent fellow may be behind a fade: the lossy floor
    assert refused_s <= 2.0 and refused_s < timed_out_s - 1.0, (refused_s, timed_out_s)
    # still two failed probes of its own over the clean floor, not one refusal
    assert refused_s >= GossipTuning().suspicion_floor_clean_s - 0.01
    assert counters["probes_refused"] >= 1 and plain["probes_refused"] == 0
    assert counters["dead_declared"] == 1
