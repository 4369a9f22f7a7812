"""What a fellow signs about itself, and a cache of the signatures already checked.

An ``Alive`` counts only with its owner's signature over who it is and where: node id,
incarnation, name, address, public key, metadata version, leader priority and datagram
epoch. The owner signs once per incarnation; relays carry the signature unchanged, so a
third party can neither move a fellow, rename it, nor invent one. Checking costs an
Ed25519 verification, so results are remembered by (signature, signed bytes): the same
signature over other bytes is checked again. Metadata carries a signature of its own, over
its version and bytes. A node id is bound to the first public key that hashes to it.
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from collections.abc import Callable

from p2pswarm.errors import AuthenticationError
from p2pswarm.membership.member import node_id_of
from p2pswarm.wire.gossip import Alive

Signer = Callable[[bytes], bytes]
Verifier = Callable[[bytes, bytes, bytes], object]  # (public_key, signature, data)
AliveFields = tuple[bytes, int, str, str, bytes, int, int, int]  # as alive_signed_bytes takes

_ALIVE_DOMAIN = b"p2pswarm-alive\x00"
_META_DOMAIN = b"p2pswarm-meta\x00"
_LEFT_DOMAIN = b"p2pswarm-left\x00"
_FIXED = struct.Struct(">16sIIiQ32s")  # node, incarnation, meta version, priority, epoch, key
U32_MAX = 2**32 - 1


def alive_signed_bytes(node: bytes, incarnation: int, name: str, addr: str,
                       public_key: bytes, meta_version: int, priority: int,
                       epoch: int) -> bytes:
    """What a fellow signs for its ``Alive`` (lengths prefixed: no field bleeds into the
    next)."""
    name_b, addr_b = name.encode(), addr.encode()
    return (_ALIVE_DOMAIN
            + _FIXED.pack(node, incarnation, meta_version, priority, epoch, public_key)
            + struct.pack(">H", len(name_b)) + name_b + struct.pack(">H", len(addr_b)) + addr_b)


def left_signed_bytes(node: bytes, incarnation: int) -> bytes:
    """What a fellow signs for its goodbye: nobody else can make it left."""
    return _LEFT_DOMAIN + node + struct.pack(">I", incarnation)


def meta_signed_bytes(node_id: bytes, version: int, metadata: bytes) -> bytes:
    """What an owner signs for its metadata."""
    return _META_DOMAIN + node_id + struct.pack(">Q", version) + metadata


class OwnSignatures:
    """What this node signs of itself: its Alive (once per incarnation: the signature is
    kept until a field changes) and its metadata."""

    __slots__ = ("_alive", "_sign")

    def __init__(self, sign: Signer) -> None:
        self._sign = sign
        self._alive: tuple[AliveFields, bytes] | None = None  # fields, signature

    def alive(self, fields: AliveFields) -> bytes:
        if self._alive is None or self._alive[0] != fields:
            self._alive = (fields, self._sign(alive_signed_bytes(*fields)))
        return self._alive[1]

    def meta(self, node_id: bytes, version: int, metadata: bytes) -> bytes:
        return self._sign(meta_signed_bytes(node_id, version, metadata))


class ProofCache:
    """Verifies owner signatures, remembering the last ``capacity`` answers."""

    def __init__(self, verify: Verifier, counters: dict[str, int],
                 capacity: int = 4096) -> None:
        self._verify = verify
        self._counters = counters  # what fails is counted here (the machine's counters)
        self._capacity = capacity
        self._seen: OrderedDict[tuple[bytes, bytes], bool] = OrderedDict()
        self._bindings: dict[bytes, bytes] = {}  # node id -> the public key it is bound to

    def binding_ok(self, node: bytes, public_key: bytes) -> bool:
        """Whether ``public_key`` is ``node``'s: it hashes to the id (bound from then on)."""
        if self._bindings.get(node) == public_key:
            return True
        if node_id_of(public_key) != node:
            self._counters["bad_bindings"] += 1
            return False
        self._bindings[node] = public_key
        return True

    def signed_by(self, public_key: bytes, signature: bytes, data: bytes) -> bool:
        """Whether ``signature`` is ``public_key``'s over ``data`` (not cached)."""
        try:
            return self._verify(public_key, signature, data) is not False
        except AuthenticationError:
            return False

    def alive(self, msg: Alive) -> bool:
        """Whether ``msg`` carries its owner's valid signature (cached)."""
        return self.check(msg.node, msg.public_key, msg.signature, alive_signed_bytes(
            msg.node, msg.incarnation, msg.name, msg.addr, msg.public_key, msg.meta_version,
            msg.priority, msg.epoch))

    def known_alive(self, msg: Alive) -> bool:
        """Whether ``msg``'s signature was checked already (a check that costs nothing)."""
        if msg.signature is None:
            return True  # refused without a check
        return (msg.signature, alive_signed_bytes(
            msg.node, msg.incarnation, msg.name, msg.addr, msg.public_key, msg.meta_version,
            msg.priority, msg.epoch)) in self._seen

    def proven(self, msg: Alive) -> bool:
        """``alive``, counting what fails: an Alive counts only if its owner signed it."""
        if node_id_of(msg.public_key) != msg.node:
            self._counters["bad_bindings"] += 1
            return False
        if msg.signature is None:
            self._counters["unsigned_alives"] += 1
            return False
        if not self.alive(msg):
            self._counters["bad_signatures"] += 1
            return False
        return True

    def check(self, node: bytes, public_key: bytes, signature: bytes | None,
              data: bytes) -> bool:
        """Whether ``signature`` is ``node``'s (its key hashes to its id) over ``data``."""
        if signature is None or node_id_of(public_key) != node:
            return False
        key = (signature, data)
        known = self._seen.get(key)
        if known is not None:
            self._seen.move_to_end(key)
            return known
        try:
            ok = self._verify(public_key, signature, data) is not False
        except AuthenticationError:
            ok = False
        self._seen[key] = ok
        if len(self._seen) > self._capacity:
            self._seen.popitem(last=False)
        return ok


__all__ = [
    "U32_MAX",
    "AliveFields",
    "OwnSignatures",
    "ProofCache",
    "Signer",
    "Verifier",
    "alive_signed_bytes",
    "left_signed_bytes",
    "meta_signed_bytes",
]
