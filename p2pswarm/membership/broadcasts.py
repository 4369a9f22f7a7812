"""The queue of updates waiting to be piggybacked (memberlist's TransmitLimitedQueue).

One entry per fellow: a newer update about a fellow replaces the older one. Each time an
update rides on a datagram its count goes up; after the retransmit limit it is dropped.
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
    __slots__ = ("msg", "size", "sends", "order")

    def __init__(self, msg: Any, size: int, order: int) -> None:
        self.msg = msg
        self.size = size
        self.sends = 0
        self.order = order


class BroadcastQueue:
    __slots__ = ("_items", "_order")

    def __init__(self) -> None:
        self._items: dict[bytes, _Item] = {}
        self._order = 0

    def __len__(self) -> int:
        return len(self._items)

    def add(self, key: bytes, msg: Any) -> None:
        self._order += 1
        self._items.pop(key, None)
        self._items[key] = _Item(msg, item_bytes(msg), self._order)

    def has_fresh(self) -> bool:
        """Whether some update has not been sent at all yet."""
        return any(item.sends == 0 for item in self._items.values())

    def discard(self, key: bytes) -> None:
        self._items.pop(key, None)

    def take(self, budget_bytes: int, limit: int) -> list[Any]:
        """Updates fitting in ``budget_bytes`` of items; each counts as one more send."""
        if not self._items or budget_bytes <= 0:
            return []
        chosen: list[Any] = []
        spent: list[tuple[bytes, _Item]] = []
        for key, item in sorted(self._items.items(), key=lambda kv: (kv[1].sends, -kv[1].order)):
            if item.size <= budget_bytes:
                budget_bytes -= item.size
                chosen.append(item.msg)
                spent.append((key, item))
                if budget_bytes < 20:
                    break
        for key, item in spent:
            item.sends += 1
            if item.sends >= limit:
                del self._items[key]
        return chosen

    def messages(self) -> list[Any]:
        return [item.msg for item in self._items.values()]


__all__ = ["BroadcastQueue", "item_bytes", "ENVELOPE_BYTES"]
