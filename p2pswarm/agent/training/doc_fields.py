"""A document from the network (a job copy, a job record) read field by field, each
checked for its type and bound as it is read: a field that is not what it must be is
refused with one line naming it (``RemoteProtocolError``), so a value built from the
document is never half read."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from p2pswarm.errors import RemoteProtocolError

MAX_INT = 2**63 - 1
TEXT = 4096  # the longest free text (a reason, a moved line) a document may carry


def _real(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) \
        and math.isfinite(value)


@dataclass(frozen=True, slots=True)
class DocFields:
    """The fields of ``doc``; a fault is ``code``, "``what``'s FIELD is malformed"."""

    doc: Mapping[str, Any]
    code: str  # e.g. "bad-job-copy"
    what: str  # e.g. "a job copy"

    def bad(self, key: str) -> RemoteProtocolError:
        return RemoteProtocolError(self.code, f"{self.what}'s {key} is malformed")

    def whole(self, key: str, high: int = MAX_INT) -> int:
        value = self.doc.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= high:
            raise self.bad(key)
        return value

    def text(self, key: str, high: int = TEXT) -> str:
        value = self.doc.get(key)
        if not isinstance(value, str) or len(value) > high:
            raise self.bad(key)
        return value

    def real(self, key: str) -> float:
        """A finite number."""
        value = self.number(key)
        if not math.isfinite(value):
            raise self.bad(key)
        return value

    def number(self, key: str) -> float:
        """A number, finite or not (a diverged loss is still reported)."""
        value = self.doc.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.bad(key)
        return float(value)

    def flag(self, key: str) -> bool:
        value = self.doc.get(key)
        if not isinstance(value, bool):
            raise self.bad(key)
        return value

    def items(self, key: str, high: int) -> list[Any]:
        value = self.doc.get(key)
        if not isinstance(value, list) or len(value) > high:
            raise self.bad(key)
        return value

    def reals(self, key: str, high: int) -> list[float]:
        values = self.items(key, high)
        if not all(_real(x) for x in values):
            raise self.bad(key)
        return [float(x) for x in values]

    def numbers(self, key: str, high: int) -> list[float]:
        values = self.items(key, high)
        if not all(not isinstance(x, bool) and isinstance(x, (int, float)) for x in values):
            raise self.bad(key)
        return [float(x) for x in values]

    def texts(self, key: str, high: int, chars: int = TEXT) -> list[str]:
        values = self.items(key, high)
        if not all(isinstance(v, str) and len(v) <= chars for v in values):
            raise self.bad(key)
        return list(values)

    def optional_map(self, key: str) -> DocFields | None:
        """The map at ``key`` (None: none), read with this reader's fault."""
        value = self.doc.get(key)
        if value is not None and not isinstance(value, dict):
            raise self.bad(key)
        return None if value is None else DocFields(value, self.code, self.what)

    def optional_whole(self, key: str, high: int = MAX_INT) -> int | None:
        return None if self.doc.get(key) is None else self.whole(key, high)

    def optional_real(self, key: str) -> float | None:
        return None if self.doc.get(key) is None else self.real(key)

    def optional_number(self, key: str) -> float | None:
        return None if self.doc.get(key) is None else self.number(key)

    def holders(self, key: str, high: int) -> dict[str, list[str]]:
        """A map of names to the names holding them (a checkpoint shard's fellows)."""
        inner = self.optional_map(key)
        if inner is None:
            raise self.bad(key)
        value = inner.doc
        if len(value) > high or not all(
                isinstance(name, str) and isinstance(holders, list)
                and all(isinstance(h, str) for h in holders)
                for name, holders in value.items()):
            raise self.bad(key)
        return {str(k): list(v) for k, v in value.items()}

    def counts(self, key: str, high: int) -> dict[str, int]:
        """A map of names to whole numbers (each replica's local steps)."""
        inner = self.optional_map(key)
        if inner is None:
            raise self.bad(key)
        value = inner.doc
        if len(value) > high or not all(
                isinstance(k, str) and isinstance(v, int) for k, v in value.items()):
            raise self.bad(key)
        return dict(value)


__all__ = ["MAX_INT", "TEXT", "DocFields"]
