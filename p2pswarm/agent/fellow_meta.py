"""What a fellow says about itself, checked where it enters this agent's view.

A fellow's metadata (its cards, their speeds, whether it trains, the stages it serves,
the loads whose orders it keeps) is
signed by that fellow, so no one else can forge it; but the fellow itself may be buggy
or hostile. One malformed entry must not break ``plan``, ``loads``, ``load``, ``cluster
export`` or ``/api/models/loads`` for the whole swarm, so every entry the views read is
checked against the form they expect when the metadata is decoded: a bad entry is
dropped (the fellow's other entries stay) and counted (``bad-metadata`` in the agent's
drop counters, shown by ``status --json``). Keys this agent does not read pass through.

The check decodes the metadata once, at this edge, into a typed ``FellowSays``
(``FellowSays.from_doc``: cards, benchmarks, ``SaidStage`` and ``SaidHop``, kept loads);
the agent reads its fields, and ``to_doc`` gives the checked gossip form back to the
readers that still take a document.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, TypedDict, TypeVar

import msgpack

from p2pswarm.agent.counters import Counters
from p2pswarm.agent.weights import Manifest
from p2pswarm.cards import (
    CARD_KINDS,
    MEMORY_SOURCE_MAX_CHARS,
    Benchmark,
    Card,
    Holder,
    Inventory,
    dtype_rates,
)
from p2pswarm.errors import ConfigError
from p2pswarm.membership.member import Member
from p2pswarm.names import is_hex_digest
from p2pswarm.wire.versions import Release

log = logging.getLogger("p2pswarm.agent")

MAX_CARDS = 64  # cards one fellow may offer
MAX_HOLDERS = 64  # other programs listed per card
MAX_STAGES = 256  # stages one fellow may say it serves
MAX_HOPS = 1024  # stages in one route
MAX_TEXT_CHARS = 1024  # any name, label or address
MAX_BYTES = 1 << 60  # 1 EiB: more than any card or stage holds
MAX_LAYER = 1 << 20
MAX_DOC_DEPTH = 6  # nesting of a model, runtime or adapter block
MAX_KEPT_LOADS = 64  # loads one fellow may say it keeps the orders of
MAX_PLAN_ID_CHARS = 64
_CARD_KEY = re.compile(r"(cuda|cpu):[0-9]{1,4}")
_RUNTIME_COUNTS = ("quant_group_size", "max_context_tokens", "max_sessions",
                   "prefill_chunk_tokens")
T = TypeVar("T")


class Bad(Exception):
    """One entry that does not have the form the views read."""


def _int(value: Any, low: int = 0, high: int = MAX_BYTES) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise Bad(f"{value!r:.40} is not an integer from {low} to {high}")
    return value


def _float(value: Any, low: float = 0.0) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value < low:
        raise Bad(f"{value!r:.40} is not a finite number of at least {low}")
    return float(value)


def _text(value: Any, max_chars: int = MAX_TEXT_CHARS) -> str:
    if not isinstance(value, str) or len(value) > max_chars:
        raise Bad(f"{value!r:.40} is not text of at most {max_chars} characters")
    return value


def _document(value: Any, depth: int = 0) -> Any:
    """A plain document (maps with text keys, lists, text, finite numbers, booleans,
    None), bounded in depth and in the length of its text."""
    if depth > MAX_DOC_DEPTH:
        raise Bad("nested too deep")
    if isinstance(value, dict):
        return {_text(k): _document(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list):
        return [_document(v, depth + 1) for v in value]
    if isinstance(value, str):
        return _text(value, 4 * MAX_TEXT_CHARS)
    if isinstance(value, float) and not math.isfinite(value):
        raise Bad("a number that is not finite")
    if value is None or isinstance(value, (bool, int, float)):
        return value
    raise Bad(f"a {type(value).__name__} in a document")


_NONE: Any = object()  # no default: the field must be there


class _Fields:
    """One map of a fellow's metadata, read field by field, each value checked against
    its bounds as it is read (a missing field: KeyError, unless it has a default)."""

    __slots__ = ("_raw",)

    def __init__(self, raw: Any, not_a_map: str) -> None:
        if not isinstance(raw, dict):
            raise Bad(not_a_map)
        self._raw: dict[Any, Any] = raw

    def has(self, key: str) -> bool:
        return key in self._raw

    def value(self, key: str, default: Any = _NONE) -> Any:
        """The field as it came (``default`` where missing)."""
        if default is _NONE or key in self._raw:
            return self._raw[key]
        return default

    def whole(self, key: str, low: int = 0, high: int = MAX_BYTES, *,
              default: Any = _NONE) -> int:
        return _int(self.value(key, default), low, high)

    def number(self, key: str, low: float = 0.0, *, default: Any = _NONE) -> float:
        return _float(self.value(key, default), low)

    def text(self, key: str, max_chars: int = MAX_TEXT_CHARS, *, default: Any = _NONE) -> str:
        return _text(self.value(key, default), max_chars)

    def maybe_whole(self, key: str, low: int = 0, high: int = MAX_BYTES) -> int | None:
        """The field, or None where it is not said."""
        return self.whole(key, low, high) if key in self._raw else None

    def maybe_text(self, key: str) -> str | None:
        return self.text(key) if key in self._raw else None


Doc = Mapping[str, Any]  # a checked plain document (a model, runtime or adapter block)


@dataclass(frozen=True, slots=True)
class SaidModel:
    """The model block of a stage a fellow serves: a built-in's or a directory's, named
    by ``key`` (None where it names none); ``block``: the checked block as it was said,
    which the stage's readers take whole."""

    kind: str  # "builtin" | "files"
    key: str | None
    block: Doc

    @staticmethod
    def from_doc(block: Any) -> SaidModel:
        f = _Fields(block, "a model is not a built-in's or a directory's")
        kind = f.value("kind", "builtin")
        if kind not in ("builtin", "files"):
            raise Bad("a model is not a built-in's or a directory's")
        if kind == "files":
            # a model directory's identity names its key and small files as a manifest
            # does; a driver fetches those files by them (``Manifest.from_dict`` checks)
            try:
                Manifest.from_dict({**block, "config": {}, "tensors": [],
                                    "path": f.value("path", ""), "files": f.value("files", [])})
            except ConfigError as exc:
                raise Bad(str(exc)) from None
        key = f.value("key", None)
        return SaidModel(kind, key if isinstance(key, str) else None, block)


class _SaidHopSaid(TypedDict):
    """What a gossiped route hop always says."""

    stage: int
    fellow_id: str
    fellow: str
    addr: str
    layers: list[int]


class SaidHopDoc(_SaidHopSaid, total=False):
    """A route hop in gossip form (``SaidHop.to_doc``): what it said besides."""

    card: str
    claim_bytes: int
    allocated_bytes: int


class _SaidStageSaid(TypedDict):
    """What a gossiped stage always says."""

    plan_id: str
    stage: int
    layers: list[int]
    model: Doc
    runtime: Doc


class SaidStageDoc(_SaidStageSaid, total=False):
    """A stage in gossip form (``SaidStage.to_doc``): what it said besides, in this order."""

    n_stages: int
    card: str
    claim_bytes: int
    allocated_bytes: int
    adapter: Doc
    route: list[SaidHopDoc]


@dataclass(frozen=True, slots=True)
class SaidHop:
    """One hop of the route a fellow says a load of its stage takes (``records.route_hop``
    reads all of it)."""

    stage: int
    fellow_id: str
    fellow: str
    addr: str
    layers: tuple[int, int]
    card: str | None = None
    claim_bytes: int | None = None
    allocated_bytes: int | None = None

    def to_doc(self) -> SaidHopDoc:
        """The hop in gossip form, as the fellow said it (what it left out, left out)."""
        doc: SaidHopDoc = {"stage": self.stage, "fellow_id": self.fellow_id,
                           "fellow": self.fellow, "addr": self.addr,
                           "layers": list(self.layers)}
        if self.card is not None:
            doc["card"] = self.card
        if self.claim_bytes is not None:
            doc["claim_bytes"] = self.claim_bytes
        if self.allocated_bytes is not None:
            doc["allocated_bytes"] = self.allocated_bytes
        return doc


@dataclass(frozen=True, slots=True)
class SaidStage:
    """One stage a fellow says it serves: the plan it belongs to, its place and layers,
    its model and runtime blocks (checked documents), and what else the fellow said."""

    plan_id: str
    stage: int
    layers: tuple[int, int]
    model: SaidModel
    runtime: Doc
    n_stages: int | None = None
    card: str | None = None
    claim_bytes: int | None = None
    allocated_bytes: int | None = None
    adapter: Doc | None = None
    route: tuple[SaidHop, ...] | None = None

    def to_doc(self) -> SaidStageDoc:
        """The stage in gossip form, as the fellow said it (what it left out, left out)."""
        doc: SaidStageDoc = {"plan_id": self.plan_id, "stage": self.stage,
                             "layers": list(self.layers), "model": self.model.block,
                             "runtime": self.runtime}
        if self.n_stages is not None:
            doc["n_stages"] = self.n_stages
        if self.card is not None:
            doc["card"] = self.card
        if self.claim_bytes is not None:
            doc["claim_bytes"] = self.claim_bytes
        if self.allocated_bytes is not None:
            doc["allocated_bytes"] = self.allocated_bytes
        if self.adapter is not None:
            doc["adapter"] = self.adapter
        if self.route is not None:
            doc["route"] = [h.to_doc() for h in self.route]
        return doc


class _Cleaner:
    """Checks one fellow's metadata, counting what it drops."""

    def __init__(self) -> None:
        self.dropped = 0

    def each(self, values: Any, check: Callable[[Any], T], limit: int) -> list[T]:
        """The items of the list ``values`` that pass ``check`` (at most ``limit``)."""
        if not isinstance(values, list):
            raise Bad("not a list")
        out = []
        for value in values[:limit]:
            try:
                out.append(check(value))
            except (Bad, ValueError, TypeError, KeyError):
                self.dropped += 1
        self.dropped += max(0, len(values) - limit)
        return out

    # --- cards and their speed --------------------------------------------------------

    def holder(self, raw: Any) -> Holder:
        f = _Fields(raw, "a holder is not a map")
        return Holder(f.whole("pid", 0, 1 << 32, default=0), f.text("name", default=""),
                      f.whole("bytes"))

    def card(self, raw: Any) -> Card:
        f = _Fields(raw, "a card is not a map")
        kind = f.value("kind", "cuda")
        if kind not in CARD_KINDS:
            raise Bad("unknown card kind")
        total = f.whole("total_bytes", 1)
        holders = self.each(f.value("held_by_others", []), self.holder, MAX_HOLDERS)
        index = f.whole("index", 0, 4095, default=0)
        name, uuid = f.text("name", default=""), f.text("uuid", default="")
        free = f.whole("free_bytes", 0, total)
        source = f.text("memory_source", default="")[:MEMORY_SOURCE_MAX_CHARS]
        # the order ``Card.from_dict`` keeps them in: the largest first
        held = tuple(sorted(holders, key=lambda h: (-h.held_bytes, h.pid, h.name)))
        return Card(index=index, kind=kind, name=name, uuid=uuid, total_bytes=total,
                    free_bytes=free, held_by_others=held, memory_source=source)

    def cards(self, raw: Any) -> tuple[Card, ...]:
        out: list[Card] = []
        seen: set[tuple[str, int]] = set()
        for card in self.each(raw, self.card, MAX_CARDS):
            key = (card.kind, card.index)
            if key in seen:  # two cards under one key: the planner could not tell them apart
                self.dropped += 1
                continue
            seen.add(key)
            out.append(card)
        return tuple(out)

    def benchmarks(self, raw: Any) -> dict[str, Benchmark]:
        said = _Fields(raw, "benchmarks are not a map").value("cards", {})
        if not isinstance(said, dict):
            raise Bad("benchmarks are not a map of cards")
        out = {}
        for key, value in list(said.items())[:MAX_CARDS]:
            try:
                if not isinstance(key, str) or not _CARD_KEY.fullmatch(key):
                    raise Bad("not a card's benchmark")
                f = _Fields(value, "not a card's benchmark")
                out[key] = Benchmark(
                    f.number("flops", 1e-9), f.number("mem_bandwidth", 1e-9),
                    f.text("dtype", 16, default="f32"), bool(f.value("measured", True)),
                    f.text("fingerprint", 64, default=""), f.number("seconds", default=0.0),
                    dtype_rates(f.value("dtype_tokens_per_s", None)))  # bounded, checked
            except (Bad, KeyError, ConfigError):
                self.dropped += 1
        self.dropped += max(0, len(said) - MAX_CARDS)
        return out

    # --- the stages a fellow serves ---------------------------------------------------------

    @staticmethod
    def layers(raw: Any) -> tuple[int, int]:
        if not isinstance(raw, list) or len(raw) != 2:
            raise Bad("layers are not [start, end]")
        start, end = _int(raw[0], 0, MAX_LAYER), _int(raw[1], 0, MAX_LAYER)
        if start > end:
            raise Bad("layers run backwards")
        return start, end

    def hop(self, raw: Any) -> SaidHop:
        f = _Fields(raw, "a route hop is not a map")
        fellow_id = f.value("fellow_id")
        if not isinstance(fellow_id, str) or not fellow_id or len(fellow_id) > 128 \
                or len(fellow_id) % 2 or not is_hex_digest(fellow_id, len(fellow_id)):
            raise Bad("a fellow id is not hex")
        # what a route hop must say (``records.route_hop`` reads all of it)
        stage, fellow, addr = f.whole("stage", 0, MAX_HOPS), f.text("fellow"), f.text("addr")
        layers = self.layers(f.value("layers"))
        return SaidHop(stage, fellow_id, fellow, addr, layers, f.maybe_text("card"),
                       f.maybe_whole("claim_bytes"), f.maybe_whole("allocated_bytes"))

    def stage(self, raw: Any) -> SaidStage:
        f = _Fields(raw, "a stage is not a map")
        plan_id = f.value("plan_id")
        if not is_hex_digest(plan_id, 16):
            raise Bad("a plan id is not 16 hex digits")
        model = SaidModel.from_doc(_document(f.value("model", {})))
        runtime = _document(f.value("runtime", {}))
        if not isinstance(runtime, dict):
            raise Bad("a runtime block is not a map")
        for key in _RUNTIME_COUNTS:  # a driver does arithmetic with these
            if runtime.get(key) is not None:
                _int(runtime[key], 0, MAX_BYTES)
        stage, layers = f.whole("stage", 0, MAX_HOPS), self.layers(f.value("layers"))
        n_stages = f.maybe_whole("n_stages", 1, MAX_HOPS)
        card, claim, held = f.maybe_text("card"), f.maybe_whole("claim_bytes"), \
            f.maybe_whole("allocated_bytes")
        adapter = None
        if f.has("adapter"):
            adapter = _document(f.value("adapter"))
            if not isinstance(adapter, dict):
                raise Bad("an adapter block is not a map")
        route = None
        if f.has("route"):
            hops = f.value("route")
            if not isinstance(hops, list) or len(hops) > MAX_HOPS:
                raise Bad("a route is not a list of hops")
            route = tuple(self.hop(h) for h in hops)  # one bad hop: the stage
        return SaidStage(str(plan_id), stage, layers, model, runtime, n_stages, card, claim,
                         held, adapter, route)

    def stages(self, raw: Any) -> tuple[SaidStage, ...]:
        return tuple(self.each(raw, self.stage, MAX_STAGES))

    def kept_loads(self, raw: Any) -> tuple[str, ...]:
        """The plan ids of the loads a fellow keeps the orders of without serving them."""
        def plan_id(value: Any) -> str:
            if not _text(value, MAX_PLAN_ID_CHARS):
                raise Bad("an empty plan id")
            return str(value)

        return tuple(self.each(raw, plan_id, MAX_KEPT_LOADS))

    @staticmethod
    def training(raw: Any) -> bool:
        if not isinstance(raw, bool):
            raise Bad("not a boolean")
        return raw


@dataclass(frozen=True, slots=True)
class FellowSays:
    """What a fellow says about itself, checked: its cards (in the order it listed them),
    their measured speeds by card key, whether it trains, the stages it serves, the loads
    whose orders it keeps; ``said``: the checked entries it said well, in its order, and
    ``others``: the entries this agent does not read, passed through as they came.
    ``dropped``: how many entries the check dropped."""

    cards: tuple[Card, ...] = ()
    benchmarks: Mapping[str, Benchmark] = field(default_factory=dict)
    training: bool = False
    stages: tuple[SaidStage, ...] = ()
    kept_loads: tuple[str, ...] = ()
    said: tuple[str, ...] = ()
    others: Mapping[str, Any] = field(default_factory=dict)
    dropped: int = 0

    @classmethod
    def from_doc(cls, meta: Mapping[Any, Any]) -> FellowSays:
        """Check a fellow's decoded metadata: every entry a view reads in the form it
        expects, a bad one dropped (the fellow's other entries stay) and counted; keys
        this agent does not read pass through."""
        cleaner = _Cleaner()
        says = cls()
        others: dict[str, Any] = {}
        order: list[str] = []
        for key, value in meta.items():
            if not isinstance(key, str):
                cleaner.dropped += 1
                continue
            try:
                match key:
                    case "cards":
                        says = replace(says, cards=cleaner.cards(value))
                    case "benchmarks":
                        says = replace(says, benchmarks=cleaner.benchmarks(value))
                    case "training":
                        says = replace(says, training=cleaner.training(value))
                    case "stages":
                        says = replace(says, stages=cleaner.stages(value))
                    case "kept_loads":
                        says = replace(says, kept_loads=cleaner.kept_loads(value))
                    case _:
                        others[key] = value
            except (Bad, ValueError, TypeError, KeyError):
                cleaner.dropped += 1
                continue
            order.append(key)
        return replace(says, said=tuple(order), others=others, dropped=cleaner.dropped)

    @classmethod
    def of(cls, meta: Mapping[str, Any]) -> FellowSays:
        """From metadata checked before (or ``{}``: nothing said yet)."""
        return cls.from_doc(meta)

    @property
    def inventory(self) -> Inventory:
        """Its cards in canonical order, as the planner reads them."""
        return Inventory(self.cards)

    def to_doc(self) -> dict[str, Any]:
        """The checked metadata in gossip form: what ``from_doc`` kept, in the fellow's
        order (what a fellow that said nothing bad published, exactly)."""
        return {key: self._entry(key) for key in self.said}

    def _entry(self, key: str) -> Any:
        """The entry ``key`` in gossip form."""
        match key:
            case "cards":
                return [c.to_dict() for c in self.cards]
            case "benchmarks":
                return {"cards": {k: b.to_dict() for k, b in self.benchmarks.items()}}
            case "training":
                return self.training
            case "stages":
                return [s.to_doc() for s in self.stages]
            case "kept_loads":
                return list(self.kept_loads)
        return self.others[key]

    @property
    def release(self) -> Release:
        """Its protocol and the capabilities it speaks (``wire.versions``; protocol 1,
        speaking nothing new, when it says neither)."""
        return Release.from_doc(self.others)

    @property
    def plan_ids(self) -> frozenset[str]:
        """The plan ids of the loads it says it serves a stage of."""
        return frozenset(s.plan_id for s in self.stages)

    def serves_model(self, model_key: str) -> bool:
        """Whether it says it serves a stage of a load of the model ``model_key``."""
        return any(s.model.key == model_key for s in self.stages)


@dataclass(frozen=True, slots=True)
class _View:
    """One version of a fellow's metadata: its bytes, and what it says."""

    metadata: bytes
    says: FellowSays


class MetadataViews:
    """Each fellow's metadata as last checked: its bytes, the clean view of them, and
    that view as a ``FellowSays``, so a fellow's metadata is decoded and checked once per
    version it publishes."""

    def __init__(self, name: str, counters: Counters) -> None:
        self._name = name
        self._counters = counters
        self._views: dict[bytes, _View] = {}

    def says(self, member: Member, fellows: Callable[[], list[Member]]) -> FellowSays:
        """What ``member`` says about itself (nothing if not pulled yet or unreadable),
        every entry checked: bad ones dropped and counted once per version.
        ``fellows``: the fellows known now (views of the others are let go)."""
        return self._view(member, fellows).says

    def _view(self, member: Member, fellows: Callable[[], list[Member]]) -> _View:
        if not member.metadata:
            return _View(b"", FellowSays())
        known = self._views.get(member.node_id)
        if known is not None and known.metadata == member.metadata:
            return known
        try:
            raw = msgpack.unpackb(member.metadata, raw=False, strict_map_key=False)
        except Exception:  # signed by the fellow, but still only bytes to us
            raw = None
        says, dropped = (FellowSays.from_doc(raw), 0) if isinstance(raw, dict) \
            else (FellowSays(), 1)
        dropped += says.dropped
        if dropped:
            self._counters.drops["bad-metadata"] += dropped
            log.info("%s: dropped %d malformed metadata entries of %s", self._name, dropped,
                     member.name)
        views = self._views
        if len(views) >= 64 and len(views) > 2 * len(fellows()):  # fellows long gone
            present = {m.node_id for m in fellows()}
            for node_id in [n for n in views if n not in present]:
                del views[node_id]
        view = views[member.node_id] = _View(member.metadata, says)
        return view


__all__ = ["MAX_CARDS", "MAX_STAGES", "FellowSays", "MetadataViews", "SaidHop", "SaidHopDoc",
           "SaidStage", "SaidStageDoc"]
