"""A budget on the bytes peers make us hold in frames they have not finished sending.

A stream reads a frame larger than its small buffer only once that frame's announced size
fits in the budget of its source host and, once authenticated, of its fellow; until then
it reads nothing more (TCP flow control holds the sender back) and waits for a frame
handed over or a stream closed. So twelve streams that each send a 48 MiB frame but its
last byte cost one frame's bytes, not twelve, whatever the number of streams a host or a
fellow may open; and the wait costs only the host or fellow that caused it.

The budget is never smaller than the largest frame, so any one frame can always pass.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import trio

__all__ = ["HeldBytes"]

Key = tuple[str, str]  # ("host", "10.0.0.5") or ("fellow", node id in hex)


class HeldBytes:
    """Bytes reserved by unfinished frames, per source host and per fellow."""

    def __init__(self, per_host_bytes: int, per_fellow_bytes: int,
                 counters: dict[str, int] | None = None) -> None:
        self._limits = {"host": per_host_bytes, "fellow": per_fellow_bytes}
        self._held: Counter[Key] = Counter()
        self._lot = trio.lowlevel.ParkingLot()
        # "frame_budget_waits": reservations that had to wait for room
        self._counters = counters if counters is not None else {}
        self._counters.setdefault("frame_budget_waits", 0)

    def held(self, key: Key) -> int:
        return self._held[key]

    def total(self) -> int:
        return sum(self._held.values())

    def _fits(self, keys: Iterable[Key], size: int) -> bool:
        return all(self._held[k] + size <= self._limits[k[0]] for k in keys)

    async def reserve(self, keys: tuple[Key, ...], size: int) -> None:
        """Wait until ``size`` more bytes fit under every key's budget, then take them.
        Cancelled while waiting, it takes nothing."""
        await trio.lowlevel.checkpoint_if_cancelled()
        if not self._fits(keys, size):
            self._counters["frame_budget_waits"] += 1
            while not self._fits(keys, size):
                await self._lot.park()
        for k in keys:
            self._held[k] += size
        await trio.lowlevel.cancel_shielded_checkpoint()

    def release(self, keys: tuple[Key, ...], size: int) -> None:
        for k in keys:
            self._held[k] -= size
            if self._held[k] <= 0:
                del self._held[k]
        self._lot.unpark_all()
