"""What a fellow says about itself, checked where it enters this agent's view.

A fellow's metadata (its cards, their speeds, whether it trains, the stages it serves,
the loads whose orders it keeps) is
signed by that fellow, so no one else can forge it; but the fellow itself may be buggy
or hostile. One malformed entry must not break ``plan``, ``loads``, ``load``, ``cluster
export`` or ``/api/models/loads`` for the whole swarm, so every entry the views read is
checked against the form they expect when the metadata is decoded: a bad entry is
dropped (the fellow's other entries stay) and counted (``bad-metadata`` in the agent's
drop counters, shown by ``status --json``). Keys this agent does not read pass through.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack

from p2pswarm.agent.counters import Counters
from p2pswarm.agent.weights import Manifest
from p2pswarm.cards import CARD_KINDS, Benchmark, Card, Holder, Inventory, benchmarks_from_dict
from p2pswarm.errors import ConfigError
from p2pswarm.membership.member import Member
from p2pswarm.names import is_hex_digest

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


class _Cleaner:
    """Checks one fellow's metadata, counting what it drops."""

    def __init__(self) -> None:
        self.dropped = 0

    def each(self, values: Any, check: Callable[[Any], Any], limit: int) -> list[Any]:
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

    def holder(self, raw: Any) -> dict[str, Any]:
        if not isinstance(raw, dict):
            raise Bad("a holder is not a map")
        return Holder(_int(raw.get("pid", 0), 0, 1 << 32), _text(raw.get("name", "")),
                      _int(raw["bytes"])).to_dict()

    def card(self, raw: Any) -> dict[str, Any]:
        if not isinstance(raw, dict):
            raise Bad("a card is not a map")
        if raw.get("kind", "cuda") not in CARD_KINDS:
            raise Bad("unknown card kind")
        total = _int(raw["total_bytes"], 1)
        holders = self.each(raw.get("held_by_others", []), self.holder, MAX_HOLDERS)
        card = Card.from_dict({
            "kind": raw.get("kind", "cuda"), "index": _int(raw.get("index", 0), 0, 4095),
            "name": _text(raw.get("name", "")), "uuid": _text(raw.get("uuid", "")),
            "total_bytes": total, "free_bytes": _int(raw["free_bytes"], 0, total),
            "held_by_others": holders, "memory_source": _text(raw.get("memory_source", ""))})
        return card.to_dict()

    def cards(self, raw: Any) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        seen: set[tuple[str, int]] = set()
        for card in self.each(raw, self.card, MAX_CARDS):
            key = (card["kind"], card["index"])
            if key in seen:  # two cards under one key: the planner could not tell them apart
                self.dropped += 1
                continue
            seen.add(key)
            out.append(card)
        return out

    def benchmarks(self, raw: Any) -> dict[str, Any]:
        if not isinstance(raw, dict) or not isinstance(raw.get("cards", {}), dict):
            raise Bad("benchmarks are not a map of cards")
        out = {}
        for key, value in list(raw.get("cards", {}).items())[:MAX_CARDS]:
            try:
                if not isinstance(key, str) or not _CARD_KEY.fullmatch(key) \
                        or not isinstance(value, dict):
                    raise Bad("not a card's benchmark")
                out[key] = Benchmark(
                    _float(value["flops"], 1e-9), _float(value["mem_bandwidth"], 1e-9),
                    _text(value.get("dtype", "f32"), 16),
                    bool(value.get("measured", True)),
                    _text(value.get("fingerprint", ""), 64),
                    _float(value.get("seconds", 0.0))).to_dict()
            except (Bad, KeyError):
                self.dropped += 1
        self.dropped += max(0, len(raw.get("cards", {})) - MAX_CARDS)
        return {"cards": out}

    # --- the stages a fellow serves ---------------------------------------------------------

    @staticmethod
    def layers(raw: Any) -> list[int]:
        if not isinstance(raw, list) or len(raw) != 2:
            raise Bad("layers are not [start, end]")
        start, end = _int(raw[0], 0, MAX_LAYER), _int(raw[1], 0, MAX_LAYER)
        if start > end:
            raise Bad("layers run backwards")
        return [start, end]

    def hop(self, raw: Any) -> dict[str, Any]:
        if not isinstance(raw, dict):
            raise Bad("a route hop is not a map")
        fellow_id = raw["fellow_id"]
        if not isinstance(fellow_id, str) or not fellow_id or len(fellow_id) > 128 \
                or len(fellow_id) % 2 or not is_hex_digest(fellow_id, len(fellow_id)):
            raise Bad("a fellow id is not hex")
        # what a route hop must say (``records.route_hop`` reads all of it)
        hop: dict[str, Any] = {"stage": _int(raw["stage"], 0, MAX_HOPS),
                               "fellow_id": fellow_id, "fellow": _text(raw["fellow"]),
                               "addr": _text(raw["addr"]), "layers": self.layers(raw["layers"])}
        if "card" in raw:
            hop["card"] = _text(raw["card"])
        for key in ("claim_bytes", "allocated_bytes"):
            if key in raw:
                hop[key] = _int(raw[key])
        return hop

    def stage(self, raw: Any) -> dict[str, Any]:
        if not isinstance(raw, dict):
            raise Bad("a stage is not a map")
        if not is_hex_digest(raw["plan_id"], 16):
            raise Bad("a plan id is not 16 hex digits")
        model = _document(raw.get("model", {}))
        if not isinstance(model, dict) or model.get("kind", "builtin") not in ("builtin",
                                                                               "files"):
            raise Bad("a model is not a built-in's or a directory's")
        if model.get("kind") == "files":
            self.files_model(model)
        runtime = _document(raw.get("runtime", {}))
        if not isinstance(runtime, dict):
            raise Bad("a runtime block is not a map")
        for key in _RUNTIME_COUNTS:  # a driver does arithmetic with these
            if runtime.get(key) is not None:
                _int(runtime[key], 0, MAX_BYTES)
        entry: dict[str, Any] = {"plan_id": raw["plan_id"],
                                 "stage": _int(raw["stage"], 0, MAX_HOPS),
                                 "layers": self.layers(raw["layers"]),
                                 "model": model, "runtime": runtime}
        if "n_stages" in raw:
            entry["n_stages"] = _int(raw["n_stages"], 1, MAX_HOPS)
        if "card" in raw:
            entry["card"] = _text(raw["card"])
        for key in ("claim_bytes", "allocated_bytes"):
            if key in raw:
                entry[key] = _int(raw[key])
        if "adapter" in raw:
            adapter = _document(raw["adapter"])
            if not isinstance(adapter, dict):
                raise Bad("an adapter block is not a map")
            entry["adapter"] = adapter
        if "route" in raw:
            if not isinstance(raw["route"], list) or len(raw["route"]) > MAX_HOPS:
                raise Bad("a route is not a list of hops")
            entry["route"] = [self.hop(h) for h in raw["route"]]  # one bad hop: the stage
        return entry

    @staticmethod
    def files_model(model: dict[str, Any]) -> None:
        """A model directory's identity names its key and small files as a manifest
        does; a driver fetches those files by them (``Manifest.from_dict`` checks)."""
        try:
            Manifest.from_dict({**model, "config": {}, "tensors": [],
                                "path": model.get("path", ""), "files": model.get("files", [])})
        except ConfigError as exc:
            raise Bad(str(exc)) from None

    def stages(self, raw: Any) -> list[dict[str, Any]]:
        return self.each(raw, self.stage, MAX_STAGES)

    def kept_loads(self, raw: Any) -> list[str]:
        """The plan ids of the loads a fellow keeps the orders of without serving them."""
        def plan_id(value: Any) -> str:
            if not _text(value, MAX_PLAN_ID_CHARS):
                raise Bad("an empty plan id")
            return str(value)

        return self.each(raw, plan_id, MAX_KEPT_LOADS)


def clean_metadata(meta: dict[Any, Any]) -> tuple[dict[str, Any], int]:
    """``meta`` with every entry a view reads in the form it expects (bad ones dropped),
    and how many entries were dropped."""
    cleaner = _Cleaner()
    checks: dict[str, Callable[[Any], Any]] = {
        "cards": cleaner.cards, "benchmarks": cleaner.benchmarks,
        "stages": cleaner.stages, "kept_loads": cleaner.kept_loads,
        "training": lambda v: v if isinstance(v, bool) else _no()}
    out: dict[str, Any] = {}
    for key, value in meta.items():
        if not isinstance(key, str):
            cleaner.dropped += 1
            continue
        check = checks.get(key)
        if check is None:
            out[key] = value
            continue
        try:
            out[key] = check(value)
        except (Bad, ValueError, TypeError, KeyError):
            cleaner.dropped += 1
    return out, cleaner.dropped


def _no() -> Any:
    raise Bad("not a boolean")


@dataclass(frozen=True, slots=True)
class FellowSays:
    """The entries of a fellow's cleaned metadata the agent's views read, as one value:
    its cards, their measured speeds by card key, whether it trains, and the stages it
    serves (in gossip form: serving reads them)."""

    inventory: Inventory = field(default_factory=Inventory)
    benchmarks: Mapping[str, Benchmark] = field(default_factory=dict)
    training: bool = False
    stages: tuple[dict[str, Any], ...] = ()

    @classmethod
    def of(cls, meta: Mapping[str, Any]) -> FellowSays:
        """From metadata ``clean_metadata`` checked (or ``{}``: nothing said yet)."""
        return cls(Inventory.from_dict(meta), benchmarks_from_dict(meta.get("benchmarks", {})),
                   bool(meta.get("training", False)), tuple(meta.get("stages") or ()))

    def serves_model(self, model_key: str) -> bool:
        """Whether it says it serves a stage of a load of the model ``model_key``."""
        return any(isinstance(s.get("model"), dict) and s["model"].get("key") == model_key
                   for s in self.stages)


class MetadataViews:
    """Each fellow's metadata as last checked: its bytes, the clean view of them, and
    that view as a ``FellowSays``, so a fellow's metadata is decoded and checked once per
    version it publishes."""

    def __init__(self, name: str, counters: Counters) -> None:
        self._name = name
        self._counters = counters
        self._views: dict[bytes, tuple[bytes, dict[str, Any], FellowSays]] = {}

    def of(self, member: Member, fellows: Callable[[], list[Member]]) -> dict[str, Any]:
        """``member``'s metadata as a dict ({} if not pulled yet or unreadable), every
        entry the views read checked: bad ones dropped and counted once per version.
        ``fellows``: the fellows known now (views of the others are let go)."""
        return self._view(member, fellows)[1]

    def says(self, member: Member, fellows: Callable[[], list[Member]]) -> FellowSays:
        """What ``member`` says about itself (``of``), as one value."""
        return self._view(member, fellows)[2]

    def _view(self, member: Member, fellows: Callable[[], list[Member]]
              ) -> tuple[bytes, dict[str, Any], FellowSays]:
        if not member.metadata:
            return b"", {}, FellowSays()
        known = self._views.get(member.node_id)
        if known is not None and known[0] == member.metadata:
            return known
        try:
            raw = msgpack.unpackb(member.metadata, raw=False, strict_map_key=False)
        except Exception:  # signed by the fellow, but still only bytes to us
            raw = None
        meta: dict[str, Any]
        if isinstance(raw, dict):
            meta, dropped = clean_metadata(raw)
        else:
            meta, dropped = {}, 1
        if dropped:
            self._counters.drops["bad-metadata"] += dropped
            log.info("%s: dropped %d malformed metadata entries of %s", self._name, dropped,
                     member.name)
        views = self._views
        if len(views) >= 64 and len(views) > 2 * len(fellows()):  # fellows long gone
            present = {m.node_id for m in fellows()}
            for node_id in [n for n in views if n not in present]:
                del views[node_id]
        view = views[member.node_id] = (member.metadata, meta, FellowSays.of(meta))
        return view


__all__ = ["MAX_CARDS", "MAX_STAGES", "FellowSays", "MetadataViews", "clean_metadata"]
