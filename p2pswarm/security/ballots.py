"""What election messages sign, and the proof that a leader was elected.

The swarm key only says a datagram came from some holder of the token; it says nothing
about which one. So every election message that speaks for a fellow is signed by that
fellow's identity, over a statement that binds what it says: the term, the candidate or
leader, the voter, whether it is a PreVote, whether it is granted. Statements start with
their own domain tag, so a signature for one kind can never be replayed as another.

A *ballot* is one fellow's signature over "I back ``leader`` for ``term``". A fellow
signs one when it grants its (real) vote, and when it follows a leader after checking
that leader's proof (its signed ``LeaderAck``). A *proof* is ballots from more than half
of the electorate of whoever checks it, counted only for fellows in that electorate,
whose public keys it knows: a fellow that holds the token alone cannot make one, however
small an electorate it claims, since the checker counts against its own.

``Signatures`` is the seam: the agent hands the election its identity's ``sign`` and a
``verify`` that knows keys; a lab without identities hands none, and the election runs
unsigned (the rule tests and the gossip lab, which measure the algorithm, not the
cryptography).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass

__all__ = [
    "MAX_PROOFS_PENDING",
    "CheckBudget",
    "ProofTally",
    "Signatures",
    "ballot_statement",
    "beat_statement",
    "reply_statement",
    "request_statement",
    "step_down_statement",
]

MAX_PROOFS_PENDING = 4  # (term, leader) pairs whose ballots a fellow gathers at once

_TERM = struct.Struct(">Q")


def _u64(value: int) -> bytes:
    return _TERM.pack(value)


def ballot_statement(term: int, leader: bytes, voter: bytes) -> bytes:
    """``voter`` backs ``leader`` for ``term`` (a granted vote, or a checked follow)."""
    return b"p2pswarm/ballot/1\0" + _u64(term) + leader + voter


def reply_statement(term: int, candidate: bytes, voter: bytes, pre_vote: bool,
                    granted: bool) -> bytes:
    """Any answer to a vote request other than a granted real vote."""
    return (b"p2pswarm/vote-reply/1\0" + _u64(term) + candidate + voter
            + bytes((int(pre_vote), int(granted))))


def request_statement(term: int, candidate: bytes, pre_vote: bool) -> bytes:
    return b"p2pswarm/vote-request/1\0" + _u64(term) + candidate + bytes((int(pre_vote),))


def beat_statement(term: int, leader: bytes, seq: int, rank: int) -> bytes:
    return b"p2pswarm/beat/1\0" + _u64(term) + leader + _u64(seq) + bytes((rank & 0xFF,))


def step_down_statement(term: int, leader: bytes) -> bytes:
    return b"p2pswarm/step-down/1\0" + _u64(term) + leader


@dataclass(frozen=True, slots=True)
class Signatures:
    """How the election signs as this fellow and checks a fellow's signature."""

    sign: Callable[[bytes], bytes]
    # (node id, its public key, signature, statement) -> valid and the key is that node's
    verify: Callable[[bytes, bytes, bytes, bytes], bool]


class ProofTally:
    """Ballots checked so far, for the few (term, leader) pairs a fellow is shown.

    Bounded: at most ``MAX_PROOFS_PENDING`` pairs (the one with the fewest ballots goes
    first, so one-ballot claims cannot push out the proof of the leader followed) and,
    per pair, one ballot per fellow of the electorate. A ballot costs one signature check
    only the first time its voter is seen for that pair, so a flood of copies is cheap.
    """

    def __init__(self) -> None:
        self._ballots: dict[tuple[int, bytes], dict[bytes, None]] = {}

    def add(self, term: int, leader: bytes, voters: Iterable[bytes]) -> None:
        """Record ``voters`` (already checked) as backing ``leader`` in ``term``."""
        key = (term, leader)
        seen = self._ballots.get(key)
        if seen is None:
            seen = self._ballots[key] = {}
        for v in voters:
            seen[v] = None
        while len(self._ballots) > MAX_PROOFS_PENDING:
            ballots = self._ballots
            del ballots[min(ballots, key=lambda k: (len(ballots[k]), k))]

    def has(self, term: int, leader: bytes, voter: bytes) -> bool:
        seen = self._ballots.get((term, leader))
        return seen is not None and voter in seen

    def count(self, term: int, leader: bytes, electorate: Iterable[bytes]) -> int:
        """Ballots for (``term``, ``leader``) from fellows in ``electorate``."""
        seen = self._ballots.get((term, leader), {})
        return sum(1 for v in electorate if v in seen)

    def forget_below(self, term: int) -> None:
        for key in [k for k in self._ballots if k[0] < term]:
            del self._ballots[key]


class CheckBudget:
    """Signature checks a sender may cost us: a token bucket per key (who it claims to be,
    from which address), refilled with time. A fellow that floods signed or forged
    messages spends its own buckets, not the budget of fellows that speak from their own
    addresses. At most ``max_keys`` buckets are kept (the least recently used go)."""

    def __init__(self, max_keys: int = 1024) -> None:
        self._buckets: dict[object, tuple[float, float]] = {}  # key -> (tokens, when)
        self._max_keys = max_keys

    def take(self, key: object, now: float, per_s: float, burst: float) -> bool:
        tokens, when = self._buckets.pop(key, (burst, now))
        tokens = min(burst, tokens + max(0.0, now - when) * per_s)
        ok = tokens >= 1.0
        self._buckets[key] = (tokens - 1.0 if ok else tokens, now)
        while len(self._buckets) > self._max_keys:
            del self._buckets[next(iter(self._buckets))]
        return ok
