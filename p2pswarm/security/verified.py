"""A bounded memory of Ed25519 signature checks that passed.

Signed records (a fellow's ``Alive`` and metadata, votes, ballots, beats) travel unchanged
from fellow to fellow and arrive again and again: every gossip round, every leader proof,
every push-pull. An Ed25519 check costs far more than everything else a record's arrival
does, and in a simulation the same record reaches each of N agents in one process. A check
is a pure function of (public key, signature, signed bytes), so its answer can be
remembered: the key of an entry is those three exactly, byte for byte, so a record changed
in any byte (or the same signature under another key) is checked again. Only checks that
passed are remembered: a forged signature cannot fill the memory, and nothing here ever
says yes to a claim that was not verified in full once.

The memory is bounded by bytes held (keys and data together), least recently used first
out, and guarded by a lock (checks may run on worker threads).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

DEFAULT_CAPACITY_BYTES = 8 * 1024 * 1024
ENTRY_OVERHEAD_BYTES = 200  # the tuple, three bytes objects and the dict slot, roughly


class VerifiedSignatures:
    """(public key, signature, signed bytes) that verified, at most ``capacity_bytes``."""

    __slots__ = ("_capacity_bytes", "_held_bytes", "_lock", "_seen", "hits", "misses")

    def __init__(self, capacity_bytes: int = DEFAULT_CAPACITY_BYTES) -> None:
        self._capacity_bytes = max(0, capacity_bytes)
        self._held_bytes = 0
        self._seen: OrderedDict[tuple[bytes, bytes, bytes], int] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    @property
    def capacity_bytes(self) -> int:
        return self._capacity_bytes

    def resize(self, capacity_bytes: int) -> None:
        """Hold at most ``capacity_bytes`` from now on (0: remember nothing)."""
        with self._lock:
            self._capacity_bytes = max(0, capacity_bytes)
            self._evict()

    def known(self, public_key: bytes, signature: bytes, data: bytes) -> bool:
        """Whether exactly this signature by exactly this key over exactly these bytes
        verified before (and is still remembered)."""
        key = (bytes(public_key), bytes(signature), bytes(data))
        with self._lock:
            if key in self._seen:
                self._seen.move_to_end(key)
                self.hits += 1
                return True
            self.misses += 1
            return False

    def remember(self, public_key: bytes, signature: bytes, data: bytes) -> None:
        """Note a check that just passed in full."""
        key = (bytes(public_key), bytes(signature), bytes(data))
        size = len(key[0]) + len(key[1]) + len(key[2]) + ENTRY_OVERHEAD_BYTES
        with self._lock:
            if size > self._capacity_bytes or key in self._seen:
                return
            self._seen[key] = size
            self._held_bytes += size
            self._evict()

    def clear(self) -> None:
        with self._lock:
            self._seen.clear()
            self._held_bytes = 0
            self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._seen)

    def _evict(self) -> None:
        while self._held_bytes > self._capacity_bytes and self._seen:
            _, size = self._seen.popitem(last=False)
            self._held_bytes -= size


__all__ = ["DEFAULT_CAPACITY_BYTES", "VerifiedSignatures"]
