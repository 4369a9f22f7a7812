"""Field types and bounds for wire messages.

A message is a frozen dataclass whose fields are annotated with the types below. The
codec reads the annotations once, at registration, and builds one validator per field,
so decoding checks every type, length and range without reflection per packet.

Fields travel positionally, in declaration order; the schema (names, types, bounds) lives
here in the class. New fields may only be appended, with a default, in a new minor
protocol version; a tag is never reused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated


@dataclass(frozen=True, slots=True)
class Range:
    """Inclusive bounds for an int or float field."""

    low: float
    high: float


@dataclass(frozen=True, slots=True)
class Size:
    """Length bounds (inclusive) for bytes and str fields; str is measured in characters."""

    low: int
    high: int


@dataclass(frozen=True, slots=True)
class Items:
    """Most items a tuple field may hold."""

    high: int


@dataclass(frozen=True, slots=True)
class Elided:
    """A trailing field left off the wire while it holds its default: a field added to a
    message later costs nothing where it is not used (a shorter field list decodes with
    the defaults)."""


U8 = Annotated[int, Range(0, 2**8 - 1)]
U16 = Annotated[int, Range(0, 2**16 - 1)]
U32 = Annotated[int, Range(0, 2**32 - 1)]
U64 = Annotated[int, Range(0, 2**64 - 1)]
I64 = Annotated[int, Range(-(2**63), 2**63 - 1)]
F64 = Annotated[float, Range(-1e300, 1e300)]  # finite: NaN and infinities are refused
Seconds = Annotated[float, Range(0.0, 1e9)]
NodeId = Annotated[bytes, Size(16, 16)]  # SHA-256 of the Ed25519 public key, first 16 bytes
PublicKey = Annotated[bytes, Size(32, 32)]
Signature = Annotated[bytes, Size(64, 64)]
Name = Annotated[str, Size(1, 64)]  # a fellow's or a card's human name
Addr = Annotated[str, Size(3, 128)]  # "host:port"
Reason = Annotated[str, Size(0, 512)]  # human-readable explanation
Digest = Annotated[bytes, Size(32, 32)]  # SHA-256
