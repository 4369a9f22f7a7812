"""The admission gate: only a fellow with a valid certificate is a member.

Theory of operation. Where the swarm has an admin key (``security.admission``), every
``Alive`` that would add a fellow or change it must carry a certificate the admin key
signed (or a delegate of it) for that very key and name, still valid, not revoked, that
holds its (invitation, slot) in this view, and whose priority cap the ``Alive`` does not
exceed. Everything else is refused and counted: a record without one never enters the
roster, so it is in no electorate, is never probed (its silence cannot raise our health
score) and is never kept. A certificate that takes a slot from another identity (the
slot rule: issued first, then the lower signature) pushes that identity out; so does a
revocation, which is kept and gossiped.

Checks cost Ed25519 verifications, so a certificate checked once is remembered by its
bytes, and each sender has a budget of fresh checks (a token bucket, ``SignatureBudget``):
a flood costs the sender its allowance, nothing else.

Time: the machine's ``now`` is the driver's clock; certificates hold wall-clock seconds,
so the gate adds ``wall_offset_s`` (handed in by the driver) to compare them.
"""

from __future__ import annotations

from collections import OrderedDict

from p2pswarm.errors import AuthenticationError
from p2pswarm.security.admission import (
    Certificate,
    Revocation,
    SlotHolders,
    certificate_problem,
)
from p2pswarm.security.identity import node_id_of
from p2pswarm.wire.gossip import Alive

_CACHE = 4096
MAX_REVOCATIONS = 4096


class SignatureBudget:
    """A token bucket of signature checks per sender: ``rate_per_s`` refilled, at most
    ``burst`` saved up; a sender out of tokens gets nothing checked until it refills."""

    __slots__ = ("_buckets", "burst", "rate_per_s")

    def __init__(self, rate_per_s: float = 200.0, burst: float = 600.0) -> None:
        self.rate_per_s = rate_per_s
        self.burst = burst
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # tokens, at

    def take(self, sender: str, now: float, n: int = 1) -> bool:
        tokens, at = self._buckets.get(sender, (self.burst, now))
        tokens = min(self.burst, tokens + max(0.0, now - at) * self.rate_per_s)
        ok = tokens >= n
        self._buckets[sender] = (tokens - n if ok else tokens, now)
        self._buckets.move_to_end(sender)
        if len(self._buckets) > 1024:  # senders are fellows and sources: bounded
            self._buckets.popitem(last=False)
        return ok


MESSAGE_CHECKS = 256  # fresh signature checks one message may cost (a SyncRecords of 65,536)


class AdmissionGate:
    __slots__ = ("_by_key", "_checked", "_message_left", "_revoked", "admin_key", "budget",
                 "slots", "stats", "wall_offset_s")

    def __init__(self, admin_key: bytes, *, wall_offset_s: float = 0.0,
                 budget: SignatureBudget | None = None) -> None:
        self.admin_key = admin_key
        self.wall_offset_s = wall_offset_s
        self.slots = SlotHolders()
        self.budget = budget if budget is not None else SignatureBudget()
        self.stats: dict[str, int] = {}  # the machine hands in its counters
        self._checked: OrderedDict[bytes, Certificate] = OrderedDict()  # bytes -> valid
        # public key -> the bytes of its certificate last found valid: relays leave
        # certificates out, and an Alive without one is checked against this
        self._by_key: OrderedDict[bytes, bytes] = OrderedDict()
        self._revoked: dict[bytes, Revocation] = {}  # signature -> revocation
        self._message_left: int | None = None  # fresh checks left to the message in hand

    def begin_message(self, cap: int = MESSAGE_CHECKS) -> None:
        """A message of many records: at most ``cap`` fresh signature checks for it."""
        self._message_left = cap

    def end_message(self) -> None:
        self._message_left = None

    def charge(self, sender: str, now: float) -> bool:
        """One fresh signature check for ``sender``: within its budget and the message's
        cap, or refused (counted)."""
        left = self._message_left
        if left is not None and left <= 0:
            self._refuse("signature_checks_refused")
            return False
        if not self.budget.take(sender, now):
            self._refuse("signature_checks_refused")
            return False
        if left is not None:
            self._message_left = left - 1
        return True

    def wall_s(self, now: float) -> int:
        return int(now + self.wall_offset_s)

    def _refuse(self, counter: str) -> None:
        self.stats[counter] = self.stats.get(counter, 0) + 1

    def certificate(self, data: bytes, public_key: bytes, name: str, now: float,
                    sender: str = "") -> Certificate | None:
        """The certificate if ``data`` admits ``public_key`` as ``name`` now."""
        if not data:
            self._refuse("uncertified")
            return None
        cert = self._checked.get(data)
        if cert is None:
            if not self.charge(sender, now):
                return None
            cert, problem = certificate_problem(data, self.admin_key, public_key,
                                                self.wall_s(now))
            if cert is None or problem is not None:
                self._refuse("bad_certificates")
                return None
            self._checked[data] = cert
            if len(self._checked) > _CACHE:
                self._checked.popitem(last=False)
        else:
            self._checked.move_to_end(data)
        if cert.public_key != public_key or cert.name != name:
            self._refuse("bad_certificates")
            return None
        if self.wall_s(now) >= cert.expires_at_s:
            self._refuse("expired_certificates")
            return None
        if self.revoked(cert.node_id, cert.name) or (  # or its delegated issuer was
                cert.delegation is not None and self.revoked(node_id_of(cert.issuer_key), "")):
            self._refuse("revoked_refused")
            return None
        self._by_key[public_key] = data
        self._by_key.move_to_end(public_key)
        if len(self._by_key) > _CACHE:
            self._by_key.popitem(last=False)
        return cert

    def known(self, public_key: bytes, name: str, now: float) -> bytes:
        """The certificate last found valid for ``public_key`` as ``name`` and not expired
        (b"": none, or another name: ask for the fellow's current one). It is checked
        again (revocation, slot) whenever it admits anything."""
        data = self._by_key.get(public_key, b"")
        cert = self._checked.get(data) if data else None
        if cert is None or cert.name != name or self.wall_s(now) >= cert.expires_at_s:
            return b""
        return data

    def admits(self, msg: Alive, now: float, sender: str = "") -> tuple[bool, bytes | None]:
        """Whether ``msg`` may add or change its fellow: (yes or no, the node id the slot
        rule pushed out, if any)."""
        cert = self.certificate(msg.certificate, msg.public_key, msg.name, now, sender)
        if cert is None:
            return False, None
        if msg.priority > cert.max_priority:
            self._refuse("priority_beyond_certificate")
            return False, None
        held, pushed_out = self.slots.offer(cert)
        if not held:
            self._refuse("slot_taken")
            return False, None
        return True, pushed_out

    # --- revocations ------------------------------------------------------------------

    def revoke(self, data: bytes) -> Revocation | None:
        """Take in a revocation's bytes: it if new and valid, else None."""
        try:
            rev = Revocation.decode(data)
        except AuthenticationError:  # malformed: dropped and counted
            self._refuse("bad_revocations")
            return None
        if rev.signature in self._revoked:
            return None
        if len(self._revoked) >= MAX_REVOCATIONS or not rev.valid(self.admin_key):
            self._refuse("bad_revocations")
            return None
        self._revoked[rev.signature] = rev
        if rev.node_id:
            self.slots.release(rev.node_id)
        return rev

    def revoked(self, node_id: bytes, name: str) -> bool:
        return self.revocation_of(node_id, name) is not None

    def revocation_of(self, node_id: bytes, name: str) -> Revocation | None:
        for r in self._revoked.values():
            if r.covers(node_id, name):
                return r
        return None

    @property
    def revocation_count(self) -> int:
        return len(self._revoked)

    def revocations(self) -> tuple[Revocation, ...]:
        return tuple(sorted(self._revoked.values(), key=lambda r: r.signature))


__all__ = ["MAX_REVOCATIONS", "MESSAGE_CHECKS", "AdmissionGate", "SignatureBudget"]
