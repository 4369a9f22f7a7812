"""Admission by invitation: the admin key, invitations, certificates, revocations.

Theory of operation. A swarm has one admin key (Ed25519), made by ``p2pswarm init`` and
kept in that machine's home. The join token no longer makes a member; a certificate does:

- an ``Invitation`` (id, uses N, expiry, the highest leader priority and the labels it
  allows) is signed by the admin key and travels in the join token;
- a joiner holding it asks an issuer for a ``Certificate``: the fellow's public key, name,
  allowed priority and labels (never more than the invitation's), the invitation's id and
  uses, a slot index below the uses, when it was issued and until when it holds. It is
  signed by the admin key, or by a fellow the admin key delegated admission to (the
  ``Delegation`` then rides in the certificate);
- a ``Revocation`` (admin-signed) names a node id or a fellow's name; it is gossiped and
  kept, and the fellow is out of every view.

Anyone verifies all of it offline with the admin public key alone.

The slot rule. Issuers remember the slots they gave, but two issuers may give the same
slot to two keys at once. So a view keeps at most one identity per (invitation, slot):
the certificate issued first wins, ties broken by the lower signature bytes
(``better``). Every fellow applies the same rule to what it has seen, so the swarm holds
at most N identities per invitation of N uses, and all views converge on the same N.

Encoding. Signed bytes are a domain string, fixed-width fields and length-prefixed
strings (as ``membership.proofs``): no field bleeds into the next, and one kind of record
can never be taken for another. A record's encoding is its signed bytes and its
signature; ``decode`` bounds every length before reading it. Times are whole seconds
since the epoch, handed in as ``now_s`` (nothing here reads a clock).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from p2pswarm.errors import AuthenticationError, ConfigError
from p2pswarm.security.identity import (
    NODE_ID_BYTES,
    PUBLIC_KEY_BYTES,
    SIGNATURE_BYTES,
    Identity,
    node_id_of,
    verify,
)

__all__ = [
    "INVITATION_ID_BYTES",
    "MAX_LABELS",
    "MAX_PRIORITY",
    "MAX_USES",
    "AdminKey",
    "Certificate",
    "Delegation",
    "Invitation",
    "Revocation",
    "SlotHolders",
    "better",
    "certificate_problem",
    "issue_under",
    "ask_problem",
    "ask_signed_bytes",
    "labels_of",
]

INVITATION_ID_BYTES = 16
MAX_USES = 4096
MAX_LABELS = 16
MAX_LABEL_CHARS = 64
MAX_NAME_CHARS = 64
MAX_PRIORITY = 2**31 - 1
MIN_PRIORITY = -(2**31)
MAX_TIME_S = 2**40  # far beyond any real expiry; bounds what a record may claim

_INVITATION_DOMAIN = b"p2pswarm-invitation\x00"
_CERTIFICATE_DOMAIN = b"p2pswarm-certificate\x00"
_DELEGATION_DOMAIN = b"p2pswarm-delegation\x00"
_REVOCATION_DOMAIN = b"p2pswarm-revocation\x00"
_ASK_DOMAIN = b"p2pswarm-admit-ask\x00"
ASK_FRESH_S = 300  # how far a signed ask's time may be from the issuer's clock

Labels = tuple[tuple[str, str], ...]  # sorted (key, value) pairs


def labels_of(pairs: Mapping[str, str] | Iterable[tuple[str, str]]) -> Labels:
    """Labels as a sorted tuple, each key and value checked."""
    items = pairs.items() if isinstance(pairs, Mapping) else pairs
    out = tuple(sorted((str(k), str(v)) for k, v in items))
    if len(out) > MAX_LABELS:
        raise ConfigError(f"at most {MAX_LABELS} labels")
    for k, v in out:
        if not k or len(k) > MAX_LABEL_CHARS or len(v) > MAX_LABEL_CHARS:
            raise ConfigError(
                f"a label is key=value, the key 1 to {MAX_LABEL_CHARS} characters and the "
                f"value at most {MAX_LABEL_CHARS}")
    if len({k for k, _ in out}) != len(out):
        raise ConfigError("each label key may appear once")
    return out


# --- canonical bytes ----------------------------------------------------------------------


def _text(value: str) -> bytes:
    raw = value.encode()
    return struct.pack(">H", len(raw)) + raw


def _labels(labels: Labels) -> bytes:
    return struct.pack(">B", len(labels)) + b"".join(_text(k) + _text(v) for k, v in labels)


class _Reader:
    """Reads canonical bytes, bounding each length before it reads: a short or padded
    record raises AuthenticationError, nothing is allocated past the input."""

    __slots__ = ("_data", "_at")

    def __init__(self, data: bytes) -> None:
        self._data = data
        self._at = 0

    def take(self, n: int) -> bytes:
        if n < 0 or self._at + n > len(self._data):
            raise AuthenticationError("bad-record", "record is cut short")
        out = self._data[self._at:self._at + n]
        self._at += n
        return out

    def unpack(self, fmt: struct.Struct) -> tuple[Any, ...]:
        return tuple(fmt.unpack(self.take(fmt.size)))

    def text(self, limit: int) -> str:
        (n,) = self.unpack(_U16)
        if n > limit * 4:
            raise AuthenticationError("bad-record", "text field too long")
        try:
            value = self.take(n).decode()
        except UnicodeDecodeError:
            raise AuthenticationError("bad-record", "text field is not UTF-8") from None
        if len(value) > limit:
            raise AuthenticationError("bad-record", "text field too long")
        return value

    def labels(self) -> Labels:
        (n,) = self.unpack(_U8)
        if n > MAX_LABELS:
            raise AuthenticationError("bad-record", "too many labels")
        out = tuple((self.text(MAX_LABEL_CHARS), self.text(MAX_LABEL_CHARS)) for _ in range(n))
        if list(out) != sorted(out):
            raise AuthenticationError("bad-record", "labels out of order")
        return out

    def domain(self, expected: bytes) -> None:
        if self.take(len(expected)) != expected:
            raise AuthenticationError("bad-record", "not this kind of record")

    def end(self) -> None:
        if self._at != len(self._data):
            raise AuthenticationError("bad-record", "trailing bytes")


_U8 = struct.Struct(">B")
_U16 = struct.Struct(">H")
_INVITATION = struct.Struct(">16sIQi32s")  # id, uses, expires, max priority, admin key
_CERTIFICATE = struct.Struct(">32s16sIIQQi32s")  # key, inv id, uses, slot, issued, expires,
# max priority, issuer key
_DELEGATION = struct.Struct(">32sQ32s")  # delegate key, expires, admin key
_REVOCATION = struct.Struct(">16sQ32s")  # node id (zeros: by name), issued, admin key


def _checked(public_key: bytes, signature: bytes, data: bytes) -> bool:
    try:
        verify(public_key, signature, data)
    except AuthenticationError:
        return False
    return True


def _time_ok(value: int) -> None:
    if not 0 <= value <= MAX_TIME_S:
        raise ConfigError(f"a time is 0 to {MAX_TIME_S} seconds since the epoch")


# --- the admin key --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, eq=False)
class AdminKey:
    """The swarm's admin key pair: kept in one home (mode 0600), never sent anywhere."""

    identity: Identity

    @classmethod
    def generate(cls) -> AdminKey:
        return cls(Identity.generate())

    @classmethod
    def from_private_bytes(cls, raw: bytes) -> AdminKey:
        return cls(Identity.from_private_bytes(raw))

    def private_bytes(self) -> bytes:
        return self.identity.private_bytes()

    @property
    def public_key(self) -> bytes:
        return self.identity.public_key

    def invite(self, invitation_id: bytes, uses: int, expires_at_s: int, *,
               max_priority: int = 0, labels: Labels = ()) -> Invitation:
        body = Invitation(invitation_id, uses, expires_at_s, max_priority, labels,
                          self.public_key, b"")
        return body.signed(self.identity.sign(body.signed_bytes()))

    def delegate(self, delegate_key: bytes, expires_at_s: int) -> Delegation:
        body = Delegation(delegate_key, expires_at_s, self.public_key, b"")
        return Delegation(delegate_key, expires_at_s, self.public_key,
                          self.identity.sign(body.signed_bytes()))

    def revoke(self, issued_at_s: int, *, node_id: bytes = b"", name: str = "") -> Revocation:
        body = Revocation(node_id, name, issued_at_s, self.public_key, b"")
        return Revocation(node_id, name, issued_at_s, self.public_key,
                          self.identity.sign(body.signed_bytes()))


# --- invitation ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Invitation:
    """Up to ``uses`` identities may be admitted under it until ``expires_at_s``, each with
    a leader priority at most ``max_priority`` and these labels."""

    invitation_id: bytes
    uses: int
    expires_at_s: int
    max_priority: int
    labels: Labels
    admin_key: bytes
    signature: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if len(self.invitation_id) != INVITATION_ID_BYTES:
            raise ConfigError(f"an invitation id is {INVITATION_ID_BYTES} bytes")
        if not 1 <= self.uses <= MAX_USES:
            raise ConfigError(f"an invitation has 1 to {MAX_USES} uses")
        if not MIN_PRIORITY <= self.max_priority <= MAX_PRIORITY:
            raise ConfigError("a leader priority is a signed 32-bit integer")
        _time_ok(self.expires_at_s)
        if len(self.admin_key) != PUBLIC_KEY_BYTES:
            raise ConfigError(f"an admin key is {PUBLIC_KEY_BYTES} bytes")

    def signed(self, signature: bytes) -> Invitation:
        return Invitation(self.invitation_id, self.uses, self.expires_at_s, self.max_priority,
                          self.labels, self.admin_key, signature)

    def signed_bytes(self) -> bytes:
        return (_INVITATION_DOMAIN
                + _INVITATION.pack(self.invitation_id, self.uses, self.expires_at_s,
                                   self.max_priority, self.admin_key)
                + _labels(self.labels))

    def encode(self) -> bytes:
        return self.signed_bytes() + self.signature

    @classmethod
    def decode(cls, data: bytes) -> Invitation:
        if len(data) > 4096:
            raise AuthenticationError("bad-record", "invitation too long")
        r = _Reader(data)
        r.domain(_INVITATION_DOMAIN)
        inv_id, uses, expires, prio, admin = r.unpack(_INVITATION)
        labels = r.labels()
        sig = r.take(SIGNATURE_BYTES)
        r.end()
        try:
            return cls(bytes(inv_id), uses, expires, prio, labels, bytes(admin), sig)
        except ConfigError as exc:
            raise AuthenticationError("bad-record", str(exc)) from None

    def problem(self, admin_key: bytes, now_s: int) -> str | None:
        """Why this invitation admits nobody now, or None if it is good."""
        if self.admin_key != admin_key:
            return "it was made by another swarm's admin key"
        if not _checked(admin_key, self.signature, self.signed_bytes()):
            return "its signature does not verify"
        if now_s >= self.expires_at_s:
            return "it has expired"
        return None


# --- delegation ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Delegation:
    """The admin key lets ``delegate_key`` issue certificates until ``expires_at_s``."""

    delegate_key: bytes
    expires_at_s: int
    admin_key: bytes
    signature: bytes = field(repr=False)

    def signed_bytes(self) -> bytes:
        return _DELEGATION_DOMAIN + _DELEGATION.pack(self.delegate_key, self.expires_at_s,
                                                     self.admin_key)

    def encode(self) -> bytes:
        return self.signed_bytes() + self.signature

    @classmethod
    def read(cls, r: _Reader) -> Delegation:
        r.domain(_DELEGATION_DOMAIN)
        key, expires, admin = r.unpack(_DELEGATION)
        return cls(bytes(key), expires, bytes(admin), r.take(SIGNATURE_BYTES))

    def valid(self, admin_key: bytes, now_s: int) -> bool:
        return (self.admin_key == admin_key and now_s < self.expires_at_s
                and _checked(admin_key, self.signature, self.signed_bytes()))


# --- certificate ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Certificate:
    """A fellow's admission: its key, name and what it may claim, under one invitation
    slot, until ``expires_at_s``. Signed by ``issuer_key``: the admin key, or a delegate
    whose ``delegation`` the admin key signed."""

    public_key: bytes
    name: str
    max_priority: int
    labels: Labels
    invitation_id: bytes
    uses: int
    slot: int
    issued_at_s: int
    expires_at_s: int
    issuer_key: bytes
    delegation: Delegation | None
    signature: bytes = field(repr=False)

    @property
    def node_id(self) -> bytes:
        return node_id_of(self.public_key)

    @property
    def slot_key(self) -> tuple[bytes, int]:
        return (self.invitation_id, self.slot)

    @classmethod
    def issue(cls, issuer: Identity, invitation: Invitation, public_key: bytes, name: str,
              slot: int, issued_at_s: int, expires_at_s: int, *, max_priority: int | None = None,
              delegation: Delegation | None = None) -> Certificate:
        """A certificate under ``invitation``'s ``slot``, never allowing more than it does."""
        if not 0 <= slot < invitation.uses:
            raise ConfigError(f"slot {slot} is not below the invitation's {invitation.uses} uses")
        if len(public_key) != PUBLIC_KEY_BYTES or not 0 < len(name) <= MAX_NAME_CHARS:
            raise ConfigError("a certificate binds a 32-byte key and a name of 1 to 64 characters")
        _time_ok(issued_at_s)
        _time_ok(expires_at_s)
        prio = invitation.max_priority if max_priority is None else min(
            max_priority, invitation.max_priority)
        body = cls(public_key, name, prio, invitation.labels, invitation.invitation_id,
                   invitation.uses, slot, issued_at_s, expires_at_s, issuer.public_key,
                   delegation, b"")
        return cls(public_key, name, prio, invitation.labels, invitation.invitation_id,
                   invitation.uses, slot, issued_at_s, expires_at_s, issuer.public_key,
                   delegation, issuer.sign(body.signed_bytes()))

    def signed_bytes(self) -> bytes:
        delegated = b"" if self.delegation is None else self.delegation.encode()
        return (_CERTIFICATE_DOMAIN
                + _CERTIFICATE.pack(self.public_key, self.invitation_id, self.uses, self.slot,
                                    self.issued_at_s, self.expires_at_s, self.max_priority,
                                    self.issuer_key)
                + _text(self.name) + _labels(self.labels)
                + struct.pack(">B", 0 if self.delegation is None else 1) + delegated)

    def encode(self) -> bytes:
        return self.signed_bytes() + self.signature

    @classmethod
    def decode(cls, data: bytes) -> Certificate:
        """A certificate from its bytes (structure only: ``problem`` checks signatures)."""
        if len(data) > 4096:
            raise AuthenticationError("bad-record", "certificate too long")
        r = _Reader(data)
        r.domain(_CERTIFICATE_DOMAIN)
        key, inv, uses, slot, issued, expires, prio, issuer = r.unpack(_CERTIFICATE)
        name = r.text(MAX_NAME_CHARS)
        labels = r.labels()
        (has_delegation,) = r.unpack(_U8)
        if has_delegation > 1:
            raise AuthenticationError("bad-record", "bad delegation flag")
        delegation = Delegation.read(r) if has_delegation else None
        sig = r.take(SIGNATURE_BYTES)
        r.end()
        return cls(bytes(key), name, prio, labels, bytes(inv), uses, slot, issued,
                   expires, bytes(issuer), delegation, sig)

    def problem(self, admin_key: bytes, now_s: int) -> str | None:
        """Why this certificate admits nobody now, or None if it is good."""
        if not 0 <= self.slot < self.uses <= MAX_USES:
            return "its slot is not below its invitation's uses"
        if now_s >= self.expires_at_s:
            return "it has expired"
        if self.issuer_key != admin_key:
            d = self.delegation
            if d is None or d.delegate_key != self.issuer_key:
                return "its issuer is not the admin key nor a delegate of it"
            if not d.valid(admin_key, now_s):
                return "its issuer's delegation is not valid"
        if not _checked(self.issuer_key, self.signature, self.signed_bytes()):
            return "its signature does not verify"
        return None


def certificate_problem(data: bytes, admin_key: bytes, public_key: bytes, now_s: int
                        ) -> tuple[Certificate | None, str | None]:
    """(the certificate, None) if ``data`` admits ``public_key`` now; else (it or None,
    why not)."""
    try:
        cert = Certificate.decode(data)
    except AuthenticationError as exc:
        return None, exc.detail or exc.reason
    if cert.public_key != public_key:
        return cert, "it was issued to another key"
    return cert, cert.problem(admin_key, now_s)


def better(a: Certificate, b: Certificate) -> bool:
    """Whether ``a`` beats ``b`` for their shared slot: issued first, then the lower
    signature bytes (every view picks the same one)."""
    return (a.issued_at_s, a.signature) < (b.issued_at_s, b.signature)


class SlotHolders:
    """At most one identity per (invitation, slot): who holds each slot in this view."""

    __slots__ = ("_holders",)

    def __init__(self) -> None:
        self._holders: dict[tuple[bytes, int], Certificate] = {}

    def __len__(self) -> int:
        return len(self._holders)

    def holder(self, slot_key: tuple[bytes, int]) -> Certificate | None:
        return self._holders.get(slot_key)

    def offer(self, cert: Certificate) -> tuple[bool, bytes | None]:
        """Offer a valid certificate: (whether it holds its slot now, the node id of the
        identity it pushed out, if any)."""
        current = self._holders.get(cert.slot_key)
        if current is None or current.public_key == cert.public_key:
            if current is None or better(cert, current) or current == cert:
                self._holders[cert.slot_key] = cert
            return True, None
        if better(cert, current):
            self._holders[cert.slot_key] = cert
            return True, current.node_id
        return False, None

    def release(self, node_id: bytes) -> None:
        """Forget the slots ``node_id`` held (revoked)."""
        for k in [k for k, c in self._holders.items() if c.node_id == node_id]:
            del self._holders[k]

    def holders(self) -> tuple[Certificate, ...]:
        return tuple(self._holders[k] for k in sorted(self._holders))


# --- revocation ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Revocation:
    """The admin key takes a fellow out, by node id or (``node_id`` empty) by name."""

    node_id: bytes
    name: str
    issued_at_s: int
    admin_key: bytes
    signature: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if len(self.node_id) not in (0, NODE_ID_BYTES) or len(self.name) > MAX_NAME_CHARS:
            raise ConfigError("a revocation names a 16-byte node id or a name")
        if not self.node_id and not self.name:
            raise ConfigError("a revocation names a node id or a name")

    def signed_bytes(self) -> bytes:
        return (_REVOCATION_DOMAIN
                + _REVOCATION.pack(self.node_id or bytes(NODE_ID_BYTES), self.issued_at_s,
                                   self.admin_key)
                + _text(self.name))

    def encode(self) -> bytes:
        return self.signed_bytes() + self.signature

    @classmethod
    def decode(cls, data: bytes) -> Revocation:
        if len(data) > 1024:
            raise AuthenticationError("bad-record", "revocation too long")
        r = _Reader(data)
        r.domain(_REVOCATION_DOMAIN)
        node, issued, admin = r.unpack(_REVOCATION)
        name = r.text(MAX_NAME_CHARS)
        sig = r.take(SIGNATURE_BYTES)
        r.end()
        node_b = bytes(node)
        try:
            return cls(b"" if node_b == bytes(NODE_ID_BYTES) else node_b, name, issued,
                       bytes(admin), sig)
        except ConfigError as exc:
            raise AuthenticationError("bad-record", str(exc)) from None

    def valid(self, admin_key: bytes) -> bool:
        return self.admin_key == admin_key and _checked(admin_key, self.signature,
                                                        self.signed_bytes())

    def covers(self, node_id: bytes, name: str) -> bool:
        return self.node_id == node_id if self.node_id else self.name == name


# --- a joiner's signed ask ------------------------------------------------------------------


def ask_signed_bytes(invitation: bytes, public_key: bytes, name: str, priority: int,
                     asked_at_s: int) -> bytes:
    """What a joiner signs when it asks for its certificate: whoever relays the ask cannot
    change the key, the name, the priority or the invitation, and the time keeps it fresh."""
    import hashlib

    return (_ASK_DOMAIN + hashlib.sha256(invitation).digest() + public_key
            + struct.pack(">qQ", priority, asked_at_s) + _text(name))


def ask_problem(invitation: bytes, public_key: bytes, name: str, priority: int,
                asked_at_s: int, signature: bytes, now_s: int) -> str | None:
    """Why a relayed ask does not prove its key, or None if it does."""
    if len(public_key) != PUBLIC_KEY_BYTES or len(signature) != SIGNATURE_BYTES:
        return "the ask carries no signature of its key"
    if abs(now_s - asked_at_s) > ASK_FRESH_S:
        return "the ask is stale (or a clock is off by more than 5 minutes)"
    if not _checked(public_key, signature,
                    ask_signed_bytes(invitation, public_key, name, priority, asked_at_s)):
        return "the ask's signature does not match its key"
    return None


# --- issuing -------------------------------------------------------------------------------

CERTIFICATE_TTL_S = 10 * 365 * 86400  # a fellow is taken out by revocation, not by age


def issue_under(issuer: Identity, admin_key: bytes, invitation: Invitation, public_key: bytes,
                name: str, priority: int, now_s: int, issued: Iterable[Certificate], *,
                delegation: Delegation | None = None) -> Certificate | str:
    """The certificate an issuer gives ``public_key`` under ``invitation``, or why not.

    The same key asking again under the same invitation gets its certificate again (a
    joiner that lost the answer, or restarted); a new key gets the lowest free slot;
    none is left once ``uses`` keys hold one. ``issued``: what this issuer gave so far
    (and what it saw of other issuers')."""
    problem = invitation.problem(admin_key, now_s)
    if problem is not None:
        return f"the invitation admits nobody: {problem}"
    if not 0 < len(name) <= MAX_NAME_CHARS:
        return f"a fellow's name is 1 to {MAX_NAME_CHARS} characters"
    taken: set[int] = set()
    for c in issued:
        if c.invitation_id != invitation.invitation_id:
            continue
        if c.public_key == public_key:
            return c if c.name == name else (
                f"this fellow was admitted as {c.name!r}: join with --name {c.name}")
        taken.add(c.slot)
    free = [s for s in range(invitation.uses) if s not in taken]
    if not free:
        return (f"the invitation is used up: its {invitation.uses} use"
                f"{'' if invitation.uses == 1 else 's'} admitted "
                f"{invitation.uses} fellow{'' if invitation.uses == 1 else 's'} already")
    return Certificate.issue(issuer, invitation, public_key, name, free[0], now_s,
                             now_s + CERTIFICATE_TTL_S, max_priority=priority,
                             delegation=delegation)
