"""The queue of updates waiting to be piggybacked (memberlist's TransmitLimitedQueue).

One entry per fellow: a newer update about a fellow replaces the older one. Each time an
update rides on a datagram its count goes up; once it reaches the retransmit limit it
stops driving gossip rounds but lingers for ``linger_s`` more, riding only where a
probe or an ack has room anyway: a fellow whose radio was out during the wave still gets
the news from the next datagram it hears, at no extra datagram. A lingering update rides
to each recipient once: riding again on every probe and ack to the same fellow, it told
that fellow nothing new and made most of what a starved, otherwise idle swarm sent
(ten lingering sends to every active one, 40 % of its bytes).
The least-sent updates go first, newest first among equals, as many as fit the budget.
"""

from __future__ import annotations

from typing import Any

from p2pswarm.wire.codec import encode

ENVELOPE_BYTES = 6  # [major, minor, [items...]]: fixarray + 2 small ints + array header <= 3
_SIZE_CACHE: dict[Any, int] = {}


def item_bytes(msg: Any) -> int:
    """Encoded size of one message inside an envelope (its [tag, fields] item)."""
    size = _SIZE_CACHE.get(msg)
    if size is None:
        size = len(encode(msg)) - 4  # fixarray(3), major, minor, fixarray(1)
        if len(_SIZE_CACHE) > 8192:
            _SIZE_CACHE.clear()
        _SIZE_CACHE[msg] = size
    return size


class _Item:
    __slots__ = ("lingered_to", "msg", "order", "retired_at", "sends", "size")

    def __init__(self, msg: Any, size: int, order: int) -> None:
        self.msg = msg
        self.size = size
        self.sends = 0
        self.order = order
        self.retired_at: float | None = None
        self.lingered_to: set[str] = set()  # recipients it rode to while lingering


class BroadcastQueue:
    __slots__ = ("_active", "_items", "_order", "linger_s")

    def __init__(self, linger_s: float = 0.0) -> None:
        self._items: dict[bytes, _Item] = {}
        self._order = 0
        self._active = 0  # items still below their retransmit limit
        self.linger_s = linger_s

    def __len__(self) -> int:
        """Updates still to be sent (lingering ones do not count)."""
        return self._active

    def add(self, key: bytes, msg: Any) -> None:
        self._order += 1
        self.discard(key)
        self._items[key] = _Item(msg, item_bytes(msg), self._order)
        self._active += 1

    def has_fresh(self) -> bool:
        """Whether some update has not been sent at all yet."""
        return any(item.sends == 0 for item in self._items.values())

    def retired(self, key: bytes) -> bool:
        """Whether the update under ``key`` has had its full count of sends (or is gone)."""
        item = self._items.get(key)
        return item is None or item.retired_at is not None

    def discard(self, key: bytes) -> None:
        item = self._items.pop(key, None)
        if item is not None and item.retired_at is None:
            self._active -= 1

    def take(self, budget_bytes: int, limit: int, now: float, *,
             lingering: bool = True, to: str | None = None) -> list[Any]:
        """Updates fitting in ``budget_bytes`` of items; each counts as one more send.
        ``lingering``: fill what room is left with retired updates too, each at most
        once to the recipient ``to`` (None: a recipient not told apart)."""
        if not self._items or budget_bytes <= 0:
            return []
        chosen: list[Any] = []
        spent: list[_Item] = []
        expired: list[bytes] = []
        for key, item in sorted(self._items.items(), key=lambda kv: (
                kv[1].retired_at is not None, kv[1].sends, -kv[1].order)):
            if item.retired_at is not None:
                if now - item.retired_at > self.linger_s:
                    expired.append(key)
                    continue
                if not lingering:
                    break
                if to is not None and to in item.lingered_to:
                    continue
            if item.size <= budget_bytes:
                budget_bytes -= item.size
                chosen.append(item.msg)
                spent.append(item)
                if budget_bytes < 20:
                    break
        for key in expired:
            del self._items[key]
        for item in spent:
            if item.retired_at is not None and to is not None:
                item.lingered_to.add(to)
            item.sends += 1
            if item.sends >= limit and item.retired_at is None:
                item.retired_at = now
                self._active -= 1
        return chosen

    def messages(self) -> list[Any]:
        return [item.msg for item in self._items.values()]


__all__ = ["ENVELOPE_BYTES", "BroadcastQueue", "item_bytes"]
