"""What the membership modules share: the states a fellow can be in, as the wire numbers
them, and the few constants every part counts with. A leaf imports these, never the
machine."""

from __future__ import annotations

from p2pswarm.wire.gossip import STATE_ALIVE, STATE_DEAD, STATE_LEFT, STATE_SUSPECT

ALIVE, SUSPECT, DEAD, LEFT = STATE_ALIVE, STATE_SUSPECT, STATE_DEAD, STATE_LEFT
PRESENT = (ALIVE, SUSPECT)  # still counted as part of the swarm (``Member.present``)
GONE = (DEAD, LEFT)  # no longer probed; reaped after ``dead_reap_after_s``
PRESENT_NAMES = ("alive", "suspect")  # the same, as ``Member.state`` spells them

INF = float("inf")
SEQ_MOD = 2**32  # probe sequence numbers wrap here (a u32 on the wire)

# what the machine counts (``Membership.counters``), in the order ``status`` shows them
COUNTERS = (
    "probes", "probes_failed", "probes_inconclusive", "suspicions_raised",
    "confirmations_sent", "dead_declared", "refutations", "syncs", "bad_signatures",
    "bad_bindings", "unsigned_alives", "claims_clamped", "incarnation_exhausted",
    "probes_refused", "refutations_unasked", "late_wakes", "ping_reqs_refused",
    "uncertified", "bad_certificates", "expired_certificates", "revoked_refused",
    "priority_beyond_certificate", "slot_taken", "signature_checks_refused",
    "bad_revocations", "unsigned_lefts", "revoked", "third_party_dead_as_suspicion",
    "certificate_waits", "certificate_waits_dropped", "certificate_waits_expired",
    "certificate_asks_sent", "certificate_asks_refused", "certificates_unasked",
)

__all__ = [
    "ALIVE",
    "COUNTERS",
    "DEAD",
    "GONE",
    "INF",
    "LEFT",
    "PRESENT",
    "PRESENT_NAMES",
    "SEQ_MOD",
    "SUSPECT",
]
