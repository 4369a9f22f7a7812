"""The swarm's last events as this fellow saw them, for the dashboard and ``/metrics``.

A bounded ring (the newest ``EVENTS_KEPT``) fed where events already happen: the agent's
membership and election events (``Agent._note``) and the load events serving publishes
(``LoadEvents``: a load came up, a load went). Beside the ring, a count of every kind
ever noted, so a scrape sees how many leader changes or deaths happened, not only the
last ones. Times are the agent's clock (virtual in a simulation). A fellow's
new metadata is counted but not kept (``QUIET_KINDS``).
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass

EVENTS_KEPT = 200
# counted, not kept: a fellow's new metadata comes every few seconds and tells a person
# little; kept, it would push the deaths and elections out of the ring
QUIET_KINDS = frozenset({"metadata"})
DETAIL_CHARS = 300  # a detail is a sentence, never a document


@dataclass(frozen=True, slots=True)
class NotedEvent:
    """One event: when (agent clock, seconds), what kind, about whom, and why."""

    at_s: float
    kind: str
    fellow_id: str  # hex node id; "" when about no fellow (a load)
    fellow: str
    detail: str = ""
    term: int = 0

    def to_doc(self, now_s: float) -> dict[str, str | int | float]:
        return {"kind": self.kind, "fellow_id": self.fellow_id, "fellow": self.fellow,
                "detail": self.detail, "term": self.term,
                "ago_s": round(max(0.0, now_s - self.at_s), 3)}


class EventRing:
    """The newest events (oldest first) and a count per kind since the agent started."""

    __slots__ = ("_events", "kinds")

    def __init__(self, keep: int = EVENTS_KEPT) -> None:
        self._events: deque[NotedEvent] = deque(maxlen=keep)
        self.kinds: Counter[str] = Counter()

    def note(self, at_s: float, kind: str, fellow_id: str = "", fellow: str = "",
             detail: str = "", term: int = 0) -> None:
        self.kinds[kind] += 1
        if kind not in QUIET_KINDS:
            self._events.append(NotedEvent(at_s, kind, fellow_id, fellow,
                                           detail[:DETAIL_CHARS], term))

    def events(self) -> tuple[NotedEvent, ...]:
        return tuple(self._events)


__all__ = ["EVENTS_KEPT", "QUIET_KINDS", "EventRing", "NotedEvent"]
