"""The election's bounds and role names, shared by the machine and its leaves (so that
no leaf imports the machine)."""

from __future__ import annotations

INF = float("inf")
CHECK_REPLY_RANK = 255  # a beat's rank that answers a voter's LeaderCheck
MAX_VOTERS = 4096  # a bound on the electorate kept (and restored from disk)
MAX_TERM_STEP = 8  # the most a vote request may raise a fellow's term
MAX_TERM = 2**62  # no term beyond: far past any swarm's count, far from 2^64 - 1
PROOF_ASK_EVERY_S = 1.0  # a fellow asks a leader for its proof at most this often
CHECKS_PER_S = 16.0  # signatures checked per second per (signer, address), twice at once
PRESENT = ("alive", "suspect")  # the member states that count as present
FOLLOWER, CANDIDATE, LEADER_ROLE = "follower", "candidate", "leader"

__all__ = [
    "CANDIDATE",
    "CHECKS_PER_S",
    "CHECK_REPLY_RANK",
    "FOLLOWER",
    "INF",
    "LEADER_ROLE",
    "MAX_TERM",
    "MAX_TERM_STEP",
    "MAX_VOTERS",
    "PRESENT",
    "PROOF_ASK_EVERY_S",
]
