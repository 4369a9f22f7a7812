"""The values cards are described by: what a fellow offers and how fast it runs.

Pure values, shared by the hardware side (``inventory`` reads cards through NVML and
psutil, ``bench`` measures them with torch) and by the pure planner, which plans on
these values without touching any hardware: cards and inventories with their dict
forms, benchmark numbers with the conservative estimates for cards never measured,
and byte sizes as people write them.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypedDict

from p2pswarm.errors import ConfigError

CARD_KINDS = ("cuda", "cpu")
MEMORY_SOURCE_MAX_CHARS = 64  # a fellow's word on where its memory figure came from


class HolderDoc(TypedDict):
    """A holder as gossip, status and saved inventories show it (``Holder.to_dict``)."""

    pid: int
    name: str
    bytes: int


class _CardSaid(TypedDict):
    index: int
    kind: str
    name: str
    uuid: str
    total_bytes: int
    free_bytes: int
    held_by_others: list[HolderDoc]


class CardDoc(_CardSaid, total=False):
    """A card as gossip, status and saved inventories show it (``Card.to_dict``):
    ``memory_source`` only where one is known."""

    memory_source: str


@dataclass(frozen=True, slots=True)
class Holder:
    """A program that holds memory on a card: its pid, its name and how much."""

    pid: int
    name: str
    held_bytes: int

    def to_dict(self) -> HolderDoc:
        return {"pid": self.pid, "name": self.name, "bytes": self.held_bytes}

    @staticmethod
    def from_dict(data: Mapping[str, Any]) -> Holder:
        return Holder(pid=int(data.get("pid", 0)), name=str(data.get("name", "")),
                      held_bytes=int(data["bytes"]))


@dataclass(frozen=True, slots=True)
class Card:
    """One device a fellow offers. ``free_bytes`` is what p2pswarm may use now."""

    index: int
    kind: str  # "cuda" | "cpu"
    name: str
    uuid: str
    total_bytes: int
    free_bytes: int
    held_by_others: tuple[Holder, ...] = ()
    # where total and free came from, for people: "cgroup memory.max", "/proc/meminfo",
    # "--cpu-memory", "NVML"; "" where a source does not say. Never planned on.
    memory_source: str = ""

    @property
    def key(self) -> str:
        """``cuda:0`` or ``cpu:0``: unique within one fellow."""
        return f"{self.kind}:{self.index}"

    def to_dict(self) -> CardDoc:
        doc: CardDoc = {
            "index": self.index, "kind": self.kind, "name": self.name, "uuid": self.uuid,
            "total_bytes": self.total_bytes, "free_bytes": self.free_bytes,
            "held_by_others": [h.to_dict() for h in self.held_by_others],
        }
        if self.memory_source:
            doc["memory_source"] = self.memory_source
        return doc

    @staticmethod
    def from_dict(data: Mapping[str, Any]) -> Card:
        kind = str(data.get("kind", "cuda"))
        if kind not in CARD_KINDS:
            raise ConfigError(f"card kind {kind!r} is not one of {', '.join(CARD_KINDS)}")
        holders = tuple(sorted((Holder.from_dict(h) for h in data.get("held_by_others", ())),
                               key=lambda h: (-h.held_bytes, h.pid, h.name)))
        return Card(index=int(data.get("index", 0)), kind=kind, name=str(data.get("name", "")),
                    uuid=str(data.get("uuid", "")), total_bytes=int(data["total_bytes"]),
                    free_bytes=int(data["free_bytes"]), held_by_others=holders,
                    memory_source=str(data.get("memory_source", ""))[:MEMORY_SOURCE_MAX_CHARS])


@dataclass(frozen=True, slots=True)
class Inventory:
    """A fellow's cards in canonical order (GPUs by index, then the CPU)."""

    cards: tuple[Card, ...] = ()

    def __post_init__(self) -> None:
        # canonical order, so two reads of the same machine compare and encode equal
        ordered = tuple(sorted(self.cards, key=lambda c: (CARD_KINDS.index(c.kind), c.index)))
        object.__setattr__(self, "cards", ordered)

    def to_dict(self) -> dict[str, Any]:
        return {"cards": [c.to_dict() for c in self.cards]}

    @staticmethod
    def from_dict(data: Mapping[str, Any]) -> Inventory:
        return Inventory(cards=tuple(Card.from_dict(c) for c in data.get("cards", ())))


# --- sizes -----------------------------------------------------------------------------

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")
MAX_SIZE_BYTES = 1 << 60  # 1 EiB: more than any card holds (the bound gossip is held to)


def parse_size(text: str) -> int:
    """Bytes in ``6GB``, ``1.5GB``, ``512MiB``, ``4096``; GB is 10**9, GiB is 2**30."""
    match = _SIZE.match(str(text))
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ConfigError(
            f"cannot read the size {text!r}: write a number and a unit, e.g. 6GB or 512MiB"
        )
    number = float(match.group(1)) * _UNITS[unit]
    if not number <= MAX_SIZE_BYTES:  # also infinity: 400 digits are a float's inf
        raise ConfigError(f"the size {str(text)[:40]!r} is more than any card holds")
    value = int(number)
    if value <= 0:
        raise ConfigError(f"the size {text!r} must be more than zero: e.g. 6GB")
    return value


# --- speed ----------------------------------------------------------------------------

# Conservative guesses for cards never measured: a low-end GPU and a Raspberry Pi 4 class
# CPU. Too slow is safer than too fast: the planner then prefers measured cards.
ESTIMATED_FLOPS = {"cuda": 1.0e12, "cpu": 10.0e9}
ESTIMATED_MEM_BANDWIDTH = {"cuda": 50.0e9, "cpu": 4.0e9}

# Weights dtypes whose speed ``bench`` measures on a card: tokens/s of one reference
# linear at batch 1 in each (``DtypeRates``); the planner weighs int8/int4 stages by them
RATED_DTYPES = ("f32", "f16", "bf16", "int8", "int4")
MAX_TOKENS_PER_S = 1e12  # more than any card: a figure past it is a bad document

DtypeRates = tuple[tuple[str, float], ...]  # (dtype, tokens/s), in RATED_DTYPES order


def dtype_rates(value: Any, where: str = "dtype_tokens_per_s") -> DtypeRates:
    """A ``{"f16": tokens/s, "int8": ..., "int4": ...}`` map checked (it may come from the
    network or a file): known dtypes only, each a positive finite number; ConfigError."""
    if value is None:
        return ()
    if not isinstance(value, Mapping) or len(value) > len(RATED_DTYPES):
        raise ConfigError(f"{where} must map some of {', '.join(RATED_DTYPES)} to tokens/s")
    out = []
    for dtype in RATED_DTYPES:
        if dtype not in value:
            continue
        rate = value[dtype]
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) \
                or not 0 < rate <= MAX_TOKENS_PER_S or math.isnan(rate):
            raise ConfigError(f"{where}.{dtype} must be a positive number of tokens/s")
        out.append((dtype, float(rate)))
    if len(out) != len(value):
        raise ConfigError(f"{where} names a dtype that is not one of {', '.join(RATED_DTYPES)}")
    return tuple(out)


@dataclass(frozen=True, slots=True)
class Benchmark:
    flops: float  # FLOP/s of a large matmul in `dtype`
    mem_bandwidth: float  # bytes/s moved by a large copy (read + write)
    dtype: str  # compute dtype the matmul ran in: "f32", "f16", "bf16"
    measured: bool  # False: a conservative estimate, never benchmarked
    fingerprint: str  # which hardware this belongs to
    seconds: float = 0.0  # how long the measurement ran
    # tokens/s of the reference linear in each weights dtype measured (() before bench)
    dtype_tokens_per_s: DtypeRates = ()

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "flops": self.flops, "mem_bandwidth": self.mem_bandwidth, "dtype": self.dtype,
            "measured": self.measured, "fingerprint": self.fingerprint,
            "seconds": self.seconds}
        if self.dtype_tokens_per_s:
            data["dtype_tokens_per_s"] = dict(self.dtype_tokens_per_s)
        return data

    @staticmethod
    def from_dict(data: Mapping[str, Any]) -> Benchmark:
        return Benchmark(flops=float(data["flops"]), mem_bandwidth=float(data["mem_bandwidth"]),
                         dtype=str(data.get("dtype", "f32")),
                         measured=bool(data.get("measured", True)),
                         fingerprint=str(data.get("fingerprint", "")),
                         seconds=float(data.get("seconds", 0.0)),
                         dtype_tokens_per_s=dtype_rates(data.get("dtype_tokens_per_s")))


def fingerprint(card: Card) -> str:
    """Same hardware, same fingerprint: kind, name, uuid and size of the card."""
    text = f"{card.kind}|{card.name}|{card.uuid}|{card.total_bytes}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def estimate(card: Card) -> Benchmark:
    """The conservative speed of a card never benchmarked."""
    return Benchmark(flops=ESTIMATED_FLOPS[card.kind],
                     mem_bandwidth=ESTIMATED_MEM_BANDWIDTH[card.kind],
                     dtype="f32" if card.kind == "cpu" else "f16", measured=False,
                     fingerprint=fingerprint(card))


def benchmarks_to_dict(benchmarks: Mapping[str, Benchmark]) -> dict[str, Any]:
    """Gossip form: ``{"cards": {"cuda:0": {...}, "cpu:0": {...}}}``."""
    return {"cards": {k: benchmarks[k].to_dict() for k in sorted(benchmarks)}}


def benchmarks_from_dict(data: Mapping[str, Any]) -> dict[str, Benchmark]:
    return {k: Benchmark.from_dict(v) for k, v in data.get("cards", {}).items()}


__all__ = [
    "CARD_KINDS",
    "ESTIMATED_FLOPS",
    "ESTIMATED_MEM_BANDWIDTH",
    "MAX_SIZE_BYTES",
    "RATED_DTYPES",
    "Benchmark",
    "Card",
    "DtypeRates",
    "Holder",
    "Inventory",
    "benchmarks_from_dict",
    "benchmarks_to_dict",
    "dtype_rates",
    "estimate",
    "fingerprint",
    "parse_size",
]
