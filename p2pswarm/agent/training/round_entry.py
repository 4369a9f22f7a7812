"""One closed sync round as the job's record lists it, as a value.

The rounds keeper appends a ``RoundEntry`` when a round closes; the job record (``jobs``)
and a job copy (``job_state``) carry them as documents, written by ``to_doc`` and read
back, checked, by ``from_doc`` (a copy came over the network: a malformed entry is
refused with one line, never half read).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from p2pswarm.errors import RemoteProtocolError

MAX_INT = 2**63 - 1
MAX_NAMES = 256  # replicas one round may name
MAX_NAME = 256

RoundDoc = dict[str, object]


def _bad() -> RemoteProtocolError:
    return RemoteProtocolError("bad-job-copy", "a job copy's rounds is malformed")


def _whole(doc: Mapping[str, object], key: str) -> int:
    value = doc.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_INT:
        raise _bad()
    return value


def _real(doc: Mapping[str, object], key: str) -> float:
    value = doc.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value):
        raise _bad()
    return float(value)


def _names(doc: Mapping[str, object], key: str) -> tuple[str, ...]:
    value = doc.get(key)
    if not isinstance(value, list) or len(value) > MAX_NAMES or not all(
            isinstance(n, str) and len(n) <= MAX_NAME for n in value):
        raise _bad()
    return tuple(value)


@dataclass(frozen=True, slots=True)
class LateContribution:
    """A replica's delta that arrived rounds late: weighed down, or dropped."""

    replica: str
    staleness: int  # rounds late
    samples: int
    weight: float
    dropped: bool

    def to_doc(self) -> RoundDoc:
        return {"replica": self.replica, "staleness": self.staleness,
                "samples": self.samples, "weight": self.weight, "dropped": self.dropped}

    @staticmethod
    def from_doc(doc: object) -> LateContribution:
        if not isinstance(doc, Mapping):
            raise _bad()
        replica, dropped = doc.get("replica"), doc.get("dropped")
        if not isinstance(replica, str) or len(replica) > MAX_NAME \
                or not isinstance(dropped, bool):
            raise _bad()
        return LateContribution(replica, _whole(doc, "staleness"), _whole(doc, "samples"),
                                _real(doc, "weight"), dropped)


@dataclass(frozen=True, slots=True)
class RoundEntry:
    """A round that closed: at which step and version, when, whose deltas it applied,
    whose it dropped, and which arrived late."""

    step: int
    version: int
    closed_at_s: float
    replicas: tuple[str, ...]
    dropped: tuple[str, ...]
    late: tuple[LateContribution, ...]

    def to_doc(self) -> RoundDoc:
        return {"step": self.step, "version": self.version, "closed_at_s": self.closed_at_s,
                "replicas": list(self.replicas), "dropped": list(self.dropped),
                "late": [x.to_doc() for x in self.late]}

    @staticmethod
    def from_doc(doc: object) -> RoundEntry:
        if not isinstance(doc, Mapping):
            raise _bad()
        late = doc.get("late")
        if not isinstance(late, list) or len(late) > MAX_NAMES:
            raise _bad()
        return RoundEntry(_whole(doc, "step"), _whole(doc, "version"),
                          _real(doc, "closed_at_s"), _names(doc, "replicas"),
                          _names(doc, "dropped"),
                          tuple(LateContribution.from_doc(x) for x in late))


__all__ = ["LateContribution", "RoundDoc", "RoundEntry"]
