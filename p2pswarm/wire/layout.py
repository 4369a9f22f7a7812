"""The bytes a message schema allows, known before anything is unpacked.

Every registered message type has a ``Layout``: the tree of msgpack types its fields may
take, with their bounds (items, characters, bytes). From it come the largest envelope a
message of that kind can be (its frame limit) and the msgpack limits the whole protocol
needs (``max_array_len`` and the others: the largest any kind allows). ``skim`` walks a
frame's bytes along a layout without building a single object, so a large frame is known
to follow its schema before msgpack allocates anything for it: sixteen MiB of ``0x90``
(empty arrays) where a tensor's bytes belong fails at the first byte.

Pure: no I/O, no trio.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Union

from p2pswarm.errors import RemoteProtocolError

__all__ = ["ENVELOPE_HEAD_BYTES", "Bin", "Bool", "Envelope", "Float", "Int", "Layout",
           "Optional", "Skimmer", "Str", "Struct", "Tuple", "largest_bytes", "peek_envelope",
           "skim", "skimmer"]


@dataclass(frozen=True, slots=True)
class Int:
    pass


@dataclass(frozen=True, slots=True)
class Float:
    pass


@dataclass(frozen=True, slots=True)
class Bool:
    pass


@dataclass(frozen=True, slots=True)
class Str:
    most_chars: int

    @property
    def most_bytes(self) -> int:
        return 4 * self.most_chars  # UTF-8: at most four bytes a character


@dataclass(frozen=True, slots=True)
class Bin:
    most_bytes: int


@dataclass(frozen=True, slots=True)
class Optional:
    inner: Layout


@dataclass(frozen=True, slots=True)
class Tuple:
    most_items: int
    item: Layout


@dataclass(frozen=True, slots=True)
class Struct:
    required: int  # fields without a default; a shorter array is invalid
    fields: tuple[Layout, ...]


Layout = Union[Int, Float, Bool, Str, Bin, Optional, Tuple, Struct]

# [major, minor, [[tag, fields]]]: fixarray, two uint16 at most, an array32 header, a
# fixarray of two, a uint16 tag
ENVELOPE_HEAD_BYTES = 1 + 3 + 3 + 5 + 1 + 3
_HEADER_BYTES = 5  # the longest msgpack header before a str, bin or array's contents
_NUMBER_BYTES = 9  # an int or float at its widest


def largest_bytes(layout: Layout) -> int:
    """The most bytes an encoding of ``layout`` can take."""
    if isinstance(layout, (Int, Float)):
        return _NUMBER_BYTES
    if isinstance(layout, Bool):
        return 1
    if isinstance(layout, Str):
        return _HEADER_BYTES + layout.most_bytes
    if isinstance(layout, Bin):
        return _HEADER_BYTES + layout.most_bytes
    if isinstance(layout, Optional):
        return max(1, largest_bytes(layout.inner))
    if isinstance(layout, Tuple):
        return _HEADER_BYTES + layout.most_items * largest_bytes(layout.item)
    return _HEADER_BYTES + sum(largest_bytes(f) for f in layout.fields)


# --- reading msgpack headers by hand ------------------------------------------------------

# first byte -> how many bytes of length follow (str, bin, array), or of payload (numbers)
_UINT_WIDTH = {0xcc: 1, 0xcd: 2, 0xce: 4, 0xcf: 8}
_INT_WIDTH = {0xcc: 1, 0xcd: 2, 0xce: 4, 0xcf: 8, 0xd0: 1, 0xd1: 2, 0xd2: 4, 0xd3: 8}
_STR_WIDTH = {0xd9: 1, 0xda: 2, 0xdb: 4}
_BIN_WIDTH = {0xc4: 1, 0xc5: 2, 0xc6: 4}
_ARRAY_WIDTH = {0xdc: 2, 0xdd: 4}
_NUMBER_WIDTH = {**_INT_WIDTH, 0xca: 4, 0xcb: 8}  # a float field takes ints too


class _Off(Exception):
    """Internal: the bytes leave the layout (turned into RemoteProtocolError)."""


def _length(data: bytes, at: int, width: int) -> int:
    end = at + width
    if end > len(data):
        raise _Off("truncated")
    return int.from_bytes(data[at:end], "big")


def _array(data: bytes, at: int) -> tuple[int, int]:
    """An array header at ``at``: (items, offset after the header)."""
    first = data[at]
    if 0x90 <= first <= 0x9f:
        return first & 0x0f, at + 1
    width = _ARRAY_WIDTH.get(first)
    if width is None:
        raise _Off("expected an array")
    return _length(data, at + 1, width), at + 1 + width


def _uint(data: bytes, at: int) -> tuple[int, int]:
    first = data[at]
    if first <= 0x7f:
        return first, at + 1
    width = _UINT_WIDTH.get(first)
    if width is None:
        raise _Off("expected an unsigned int")
    return _length(data, at + 1, width), at + 1 + width


@dataclass(frozen=True, slots=True)
class Envelope:
    """What the first bytes of an envelope say: read without unpacking anything."""

    major: int
    minor: int
    messages: int  # how many messages the body holds
    first_tag: int  # the first message's tag
    fields_at: int  # offset of the first message's field array


def peek_envelope(data: bytes) -> Envelope:
    """Read an envelope's version, message count and first tag from its first bytes;
    RemoteProtocolError("malformed") when they are not an envelope's."""
    try:
        if not data or data[0] != 0x93:
            raise _Off("not an envelope")
        major, at = _uint(data, 1)
        minor, at = _uint(data, at)
        count, at = _array(data, at)
        if count == 0:
            raise _Off("an envelope without messages")
        body_at = at
    except _Off as exc:
        raise RemoteProtocolError("malformed", str(exc)) from None
    except IndexError:
        raise RemoteProtocolError("malformed", "truncated") from None
    try:
        if data[body_at] != 0x92:
            raise _Off("expected [tag, fields]")
        tag, at = _uint(data, body_at + 1)
        return Envelope(major, minor, count, tag, at)
    except _Off as exc:
        raise RemoteProtocolError("invalid-field", str(exc)) from None
    except IndexError:
        raise RemoteProtocolError("malformed", "truncated") from None


Skimmer = Callable[[bytes, int], int]  # data, offset of a value -> offset after it


def skim(data: bytes, at: int, layout: Layout | Skimmer) -> None:
    """Check that ``data[at:]`` is exactly one value of ``layout`` (types, item counts,
    lengths; not ranges, which the codec's checkers test after unpacking). Costs a few
    operations a value present and allocates nothing of the frame's size; raises
    RemoteProtocolError("invalid-field") at the first byte that leaves the layout.
    ``layout`` may be its ``skimmer`` already (the codec keeps one per kind)."""
    run = layout if callable(layout) else skimmer(layout)
    try:
        end = run(data, at)
    except _Off as exc:
        raise RemoteProtocolError("invalid-field", str(exc)) from None
    except IndexError:
        raise RemoteProtocolError("malformed", "truncated") from None
    if end != len(data):
        raise RemoteProtocolError("malformed", f"{len(data) - end} bytes after the message")


def skimmer(layout: Layout) -> Skimmer:
    """A function that skims one value of ``layout``: built once per kind, so skimming
    costs a call and a few comparisons a value, with no dispatch on the layout."""
    if isinstance(layout, Struct):
        fields = tuple(skimmer(f) for f in layout.fields)
        low, high = layout.required, len(fields)

        def skim_struct(data: bytes, at: int) -> int:
            n, at = _array(data, at)
            if not low <= n <= high:
                raise _Off(f"expected {low}..{high} fields, got {n}")
            for field in fields[:n]:
                at = field(data, at)
            return at

        return skim_struct
    if isinstance(layout, Tuple):
        item, most = skimmer(layout.item), layout.most_items

        def skim_tuple(data: bytes, at: int) -> int:
            n, at = _array(data, at)
            if n > most:
                raise _Off(f"expected at most {most} items, got {n}")
            for _ in range(n):
                at = item(data, at)
            return at

        return skim_tuple
    if isinstance(layout, Optional):
        inner = skimmer(layout.inner)

        def skim_optional(data: bytes, at: int) -> int:
            return at + 1 if data[at] == 0xc0 else inner(data, at)

        return skim_optional
    if isinstance(layout, (Int, Float)):
        widths = _INT_WIDTH if isinstance(layout, Int) else _NUMBER_WIDTH

        def skim_number(data: bytes, at: int) -> int:
            first = data[at]
            if first <= 0x7f or first >= 0xe0:
                return at + 1
            width = widths.get(first)
            if width is None:
                raise _Off("expected a number")
            return at + 1 + width

        return skim_number
    if isinstance(layout, Bool):
        def skim_bool(data: bytes, at: int) -> int:
            if data[at] not in (0xc2, 0xc3):
                raise _Off("expected a bool")
            return at + 1

        return skim_bool
    if isinstance(layout, Str):
        most_str = layout.most_bytes

        def skim_str(data: bytes, at: int) -> int:
            first = data[at]
            if 0xa0 <= first <= 0xbf:
                size, at = first & 0x1f, at + 1
            else:
                width = _STR_WIDTH.get(first)
                if width is None:
                    raise _Off("expected a str")
                size, at = _length(data, at + 1, width), at + 1 + width
            if size > most_str:
                raise _Off(f"a str of {size} bytes, at most {most_str}")
            return _within(data, at + size)

        return skim_str
    most_bin = layout.most_bytes

    def skim_bin(data: bytes, at: int) -> int:
        width = _BIN_WIDTH.get(data[at])
        if width is None:
            raise _Off("expected bytes")
        size, at = _length(data, at + 1, width), at + 1 + width
        if size > most_bin:
            raise _Off(f"{size} bytes, at most {most_bin}")
        return _within(data, at + size)

    return skim_bin


def _within(data: bytes, end: int) -> int:
    if end > len(data):
        raise _Off("truncated")
    return end
