"""The stream requests this node has in flight, by request id.

A reply or a failure names its request by id: the ledger says what the request was (a
probe's stream ping, a sync, a join, a metadata pull, a pushed refutation), to whom, and
with what extra (the probe's seq, the node whose metadata was asked for). Requests nobody
answered are forgotten after a while, and the ledger never holds more than a few hundred.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

RequestKind = Literal["ping", "sync", "join", "meta", "refute"]
PENDING_S = 60.0  # forget a stream request nobody answered after this long
_MAX_PENDING = 256


@dataclass(frozen=True, slots=True)
class Pending:
    kind: RequestKind
    addr: str
    extra: Any
    at: float


class StreamRequests:
    __slots__ = ("_last_rid", "_pending")

    def __init__(self) -> None:
        self._pending: dict[int, Pending] = {}
        self._last_rid = 0

    def new(self, kind: RequestKind, addr: str, extra: Any, now: float) -> int:
        self._last_rid += 1
        self._pending[self._last_rid] = Pending(kind, addr, extra, now)
        if len(self._pending) > _MAX_PENDING:
            for rid in list(self._pending)[:_MAX_PENDING // 2]:
                del self._pending[rid]
        return self._last_rid

    def pop(self, rid: int) -> Pending | None:
        return self._pending.pop(rid, None)

    def expire(self, now: float) -> None:
        stale = now - PENDING_S
        for rid in [r for r, v in self._pending.items() if v.at < stale]:
            del self._pending[rid]


__all__ = ["PENDING_S", "Pending", "RequestKind", "StreamRequests"]
