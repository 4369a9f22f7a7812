"""What a fellow signs about itself, and a cache of the signatures already checked.

An ``Alive`` counts only with its owner's signature over who it is and where: node id,
incarnation, name, address, public key, metadata version, leader priority and datagram
epoch. The owner signs once per incarnation; relays carry the signature unchanged, so a
third party can neither move a fellow, rename it, nor invent one. Checking costs an
Ed25519 verification, so results are remembered by (signature, signed bytes): the same
signature over other bytes is checked again.
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from collections.abc import Callable

from p2pswarm.errors import AuthenticationError
from p2pswarm.membership.member import node_id_of

Verifier = Callable[[bytes, bytes, bytes], object]  # (public_key, signature, data)

_ALIVE_DOMAIN = b"p2pswarm-alive\x00"
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


class ProofCache:
    """Verifies owner signatures, remembering the last ``capacity`` answers."""

    def __init__(self, verify: Verifier, capacity: int = 4096) -> None:
        self._verify = verify
        self._capacity = capacity
        self._seen: OrderedDict[tuple[bytes, bytes], bool] = OrderedDict()

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


__all__ = ["U32_MAX", "ProofCache", "Verifier", "alive_signed_bytes"]
