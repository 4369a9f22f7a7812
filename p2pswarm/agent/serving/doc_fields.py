"""Reading a document that came from elsewhere into a value, once, at the edge.

A load's record a leader answers, what a fellow keeps on disk, a model's identity: each
is a plain map read into a typed value by its ``from_doc``. ``DocFields`` reads one
map field by field, each value checked against its type and bounds as it is read (as
the planner's ``from_doc`` and ``fellow_meta`` do), so no unchecked value gets past the
edge; a bad one is ``ConfigError`` naming what was read.
"""

from __future__ import annotations

import math
from typing import Any, Final

from p2pswarm.errors import ConfigError

MAX_WHOLE: Final = 1 << 62  # above any count of bytes, tokens or stages
MAX_TEXT_CHARS: Final = 4096

_NONE: Any = object()  # no default: the field must be there


class DocFields:
    """One map of a document, read field by field; ConfigError(``what`` ...) where the
    document is not a map, a field that must be there is not, or a value is out of its
    type or bounds."""

    __slots__ = ("_raw", "_what")

    def __init__(self, raw: object, what: str) -> None:
        if not isinstance(raw, dict):
            raise ConfigError(f"{what} is not a map")
        self._raw: dict[Any, Any] = raw
        self._what = what

    def _bad(self, key: str, why: str) -> ConfigError:
        return ConfigError(f"{self._what}: {key} {why}")

    def has(self, key: str) -> bool:
        return key in self._raw

    def value(self, key: str, default: Any = _NONE) -> Any:
        """The field as it came, unchecked (``default`` where it is missing)."""
        if key in self._raw:
            return self._raw[key]
        if default is _NONE:
            raise self._bad(key, "is missing")
        return default

    def text(self, key: str, default: Any = _NONE, max_chars: int = MAX_TEXT_CHARS) -> str:
        value = self.value(key, default)
        if not isinstance(value, str) or len(value) > max_chars:
            raise self._bad(key, f"is not text of at most {max_chars} characters")
        return value

    def whole(self, key: str, default: Any = _NONE, low: int = 0,
              high: int = MAX_WHOLE) -> int:
        value = self.value(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise self._bad(key, f"is not an integer from {low} to {high}")
        return value

    def number(self, key: str, default: Any = _NONE, low: float = 0.0) -> float:
        value = self.value(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value) or value < low:
            raise self._bad(key, f"is not a finite number of at least {low}")
        return float(value)

    def flag(self, key: str) -> bool:
        """Whether the field is ``True`` itself (missing, or anything else: False)."""
        return self._raw.get(key) is True

    def fields(self, key: str, default: Any = _NONE) -> DocFields:
        """The field, a map, read the same way."""
        return DocFields(self.value(key, default), f"{self._what}: {key}")

    def items(self, key: str, limit: int, default: Any = _NONE) -> list[Any]:
        """The field, a list of at most ``limit`` items (each unchecked)."""
        value = self.value(key, default)
        if not isinstance(value, list) or len(value) > limit:
            raise self._bad(key, f"is not a list of at most {limit} items")
        return value

    def pair(self, key: str, default: Any = _NONE) -> tuple[int, int]:
        """The field, a list of two integers (a layer range)."""
        value = self.value(key, default)
        if not isinstance(value, list) or len(value) != 2 or not all(
                isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_WHOLE
                for v in value):
            raise self._bad(key, "is not a pair of integers")
        return value[0], value[1]


__all__ = ["MAX_TEXT_CHARS", "MAX_WHOLE", "DocFields"]
