"""Serving's values: a stage order, a stage a fellow hosts, a generation's result, and how
loads and routes look in records, gossip and on the wire.

A ``StageOrder`` is what the leader asks one fellow to host; on the wire it is a typed
``StageAssignment`` (``p2pswarm.wire.loads``), whose model identity and adapter block
travel as documents, and whose runtime block (``RuntimeBlock``, what ``StageSpec`` is
built from) is one value from the plan to the stage. A route is the load's stages in
pipeline order, typed ``RouteHop``s inside (a hosted stage's route, a driver's
``LoadRecord``); records and gossip show it as plain maps (``route_dict``,
``route_entry``), read back with ``LoadRecord.from_doc``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias, TypedDict

import trio

from p2pswarm.agent.serving.doc_fields import DocFields
from p2pswarm.errors import ConfigError, RemoteProtocolError
from p2pswarm.runtime.spec import StageSpec
from p2pswarm.wire.loads import RouteHop, RuntimeBlock, StageAssignment
from p2pswarm.wire.orders import pack_doc, unpack_doc

if TYPE_CHECKING:
    from p2pswarm.agent.serving.runtime import LoadedStage
    from p2pswarm.agent.weights import Manifest, WeightsCache

ROUTE_KEYS = ("stage", "fellow_id", "fellow", "addr", "layers", "card", "claim_bytes",
              "allocated_bytes")
_SPEC_FIELDS = ("dtype", "quant", "quant_group_size", "kv_dtype", "max_context_tokens",
                "max_sessions", "prefill_chunk_tokens")


@dataclass(frozen=True, slots=True)
class StageOrder:
    """What the leader asks one fellow to host: a stage of a plan, on one of its cards."""

    plan_id: str
    stage: int
    n_stages: int
    fellow_id: str  # the fellow the plan puts it on (hex node id)
    layers: tuple[int, int]
    card_kind: str
    card_index: int
    card_name: str
    claim_bytes: int  # what the stage allocates: weights, embeddings/head/buffers, KV cache
    need_bytes: int  # what must be free: the claim plus activations and workspace
    runtime: RuntimeBlock  # what every stage of the plan allocates (``runtime_block``)
    model: dict[str, Any]  # identity: {"kind": "builtin", "name"} or {"kind": "files", ...}
    progress_addr: str = ""
    ticket: str = ""
    adapter: dict[str, Any] = field(default_factory=dict)  # LoRA on top: this stage's part
    generation: str = ""  # the bring-up it is of (kept across moves; ``tombstones``)

    @property
    def card_key(self) -> str:
        return f"{self.card_kind}:{self.card_index}"

    @property
    def device(self) -> str:
        return "cpu" if self.card_kind == "cpu" else f"cuda:{self.card_index}"

    def spec(self) -> StageSpec:
        r = self.runtime
        return StageSpec(self.layers[0], self.layers[1], dtype=r.dtype, quant=r.quant,
                         quant_group_size=r.quant_group_size, kv_dtype=r.kv_dtype,
                         max_context_tokens=r.max_context_tokens, max_sessions=r.max_sessions,
                         prefill_chunk_tokens=r.prefill_chunk_tokens, device=self.device)

    def to_wire(self) -> StageAssignment:
        return StageAssignment(
            self.plan_id, self.stage, self.n_stages, self.fellow_id, self.layers[0],
            self.layers[1], self.card_kind, self.card_index, self.card_name,
            self.claim_bytes, self.need_bytes, self.runtime, pack_doc(self.model),
            self.progress_addr, self.ticket, pack_doc(self.adapter) if self.adapter else b"",
            self.generation)

    @staticmethod
    def from_wire(order: StageAssignment) -> StageOrder:
        try:
            model = unpack_doc(order.model)
            adapter = unpack_doc(order.adapter) if order.adapter else {}
        except RemoteProtocolError as exc:
            raise ConfigError(f"malformed stage order ({exc})") from None
        return StageOrder(
            plan_id=order.plan_id, stage=order.stage, n_stages=order.n_stages,
            fellow_id=order.fellow_id, layers=(order.start_layer, order.end_layer),
            card_kind=order.card_kind, card_index=order.card_index,
            card_name=order.card_name, claim_bytes=order.claim_bytes,
            need_bytes=order.need_bytes,
            runtime=order.runtime, model=model,
            progress_addr=order.progress_addr, ticket=order.ticket, adapter=adapter,
            generation=order.generation)


@dataclass(frozen=True, slots=True)
class WeightsOrigin:
    """Where a model's or an adapter's tensors come from, read once from its identity
    document (``StageOrder.model``, ``StageOrder.adapter``, a record's ``model``). The
    fields keep what the document says, unchecked: it may come from the network."""

    kind: object  # "builtin" or "files" for a model (anything else is refused)
    name: object
    source_id: str  # the fellow that offered the tensors (hex id; "": none named)
    source: str | None  # its name, None when the document names none
    manifest: Any  # the manifest's document, for files (checked by Manifest.from_dict)
    path: str | None  # the directory it was offered from, on its source (None: unnamed)

    @staticmethod
    def of(doc: Mapping[str, Any]) -> WeightsOrigin:
        f = DocFields(doc, "a model's identity")
        return WeightsOrigin(f.value("kind", None), f.value("name", None),
                             str(f.value("source_id", "")),
                             str(f.value("source")) if f.has("source") else None,
                             f.value("manifest", None),
                             str(f.value("path")) if f.has("path") else None)

    def source_name(self, default: str = "the source") -> str:
        """The source's name as messages show it (``default`` when none is named)."""
        return (self.source if self.source is not None else default)[:64]

    def offered_by(self, node_hex: str) -> bool:
        """Whether the fellow whose id is ``node_hex`` offered the tensors."""
        return self.source_id == node_hex


def runtime_block(doc: Mapping[str, Any]) -> RuntimeBlock:
    """A plan's runtime document (``Plan.runtime``) as the one value stage orders, the wire
    and ``StageSpec`` share; a field it leaves out is ``StageSpec``'s default."""
    defaults = StageSpec(0, 0)
    return RuntimeBlock(**{k: doc.get(k, getattr(defaults, k)) for k in _SPEC_FIELDS})


class RuntimeDoc(TypedDict):
    """A runtime block as records and gossip show it (``runtime_doc``)."""

    dtype: str
    quant: str
    quant_group_size: int
    kv_dtype: str
    max_context_tokens: int
    max_sessions: int
    prefill_chunk_tokens: int


def planned_runtime_doc(block: RuntimeBlock) -> RuntimeDoc:
    """The block as a serving plan's document lists it (``Plan.runtime``): the record of
    a load brought up from a plan shows it so."""
    return {"dtype": block.dtype, "quant": block.quant,
            "quant_group_size": block.quant_group_size,
            "prefill_chunk_tokens": block.prefill_chunk_tokens, "kv_dtype": block.kv_dtype,
            "max_context_tokens": block.max_context_tokens,
            "max_sessions": block.max_sessions}


def runtime_doc(block: RuntimeBlock) -> RuntimeDoc:
    """The block as gossip shows it, and the record of a load adopted from its fellows."""
    return {"dtype": block.dtype, "quant": block.quant,
            "quant_group_size": block.quant_group_size, "kv_dtype": block.kv_dtype,
            "max_context_tokens": block.max_context_tokens,
            "max_sessions": block.max_sessions,
            "prefill_chunk_tokens": block.prefill_chunk_tokens}


@dataclass(frozen=True, slots=True)
class CachedWeights:
    """A stage's weight source: its tensors of ``manifest`` in this fellow's verified
    cache (the other sources are a built-in model's name and a model directory)."""

    manifest: Manifest
    cache: WeightsCache


WeightSource: TypeAlias = "str | Path | CachedWeights"  # a built-in's name, a directory


class RouteEntryDoc(TypedDict):
    """A route hop as a fellow gossips it with its stages (``route_entry``: ``ROUTE_KEYS``)."""

    stage: int
    fellow_id: str
    fellow: str
    addr: str
    layers: list[int]
    card: str
    claim_bytes: int
    allocated_bytes: int


class RouteDoc(RouteEntryDoc):
    """A route hop as records keep it (``route_dict``): what it fetched, besides."""

    fetched_bytes: int
    fetch_s: float


def route_dict(hop: RouteHop) -> RouteDoc:
    """A ``RouteHop`` as records keep it."""
    return {"stage": hop.stage, "fellow_id": hop.fellow_id, "fellow": hop.fellow,
            "addr": hop.addr, "layers": [hop.start_layer, hop.end_layer], "card": hop.card,
            "claim_bytes": hop.claim_bytes, "allocated_bytes": hop.allocated_bytes,
            "fetched_bytes": hop.fetched_bytes, "fetch_s": hop.fetch_s}


def public_adapter(adapter: dict[str, Any]) -> dict[str, Any]:
    """What records and gossip show of an adapter (no tensor list)."""
    keys = ("name", "path", "sha256", "base", "rank", "alpha", "targets", "source")
    return {k: adapter[k] for k in keys if k in adapter}


def public_model(model: dict[str, Any]) -> dict[str, Any]:
    """What records and gossip show of a model's identity (no manifest)."""
    return {k: v for k, v in model.items() if k != "manifest"}


def former_plan_ids(record: Any) -> list[str]:
    """The plan_ids a load went by before live moves re-cut it (``recut``), read from
    its record's document (checked: a map, or ConfigError)."""
    before = DocFields(record, "a load's record").value("recut_from", None)
    return [p for p in before if isinstance(p, str)] if isinstance(before, list) else []


# A recurrent model's state does not grow with its tokens, so its generations are not held
# to the load's context. One generation (prompt and new tokens) is bounded all the same:
# the driver keeps every id to replay them after a failover, and positions travel as u32.
RECURRENT_GENERATION_TOKENS = 1 << 20


def generation_tokens(record: Any) -> tuple[int, str]:
    """How many tokens (prompt and new) one generation on this load may reach, and what
    bounds them in words; 0 when the record names no bound. A record that claims a
    recurrent model wrongly gains nothing: each stage holds a non-recurrent model to its
    context itself."""
    f = DocFields(record, "a load's record")
    model = f.value("model", None)
    recurrent = isinstance(model, dict) and DocFields(model, "its model").flag("recurrent")
    runtime = DocFields(f.value("runtime", None) or {}, "its runtime")
    return _generation_tokens(recurrent, int(runtime.value("max_context_tokens", 0)))


def _generation_tokens(recurrent: bool, context: int) -> tuple[int, str]:
    if recurrent:  # what the asker said
        return (RECURRENT_GENERATION_TOKENS, f"the {RECURRENT_GENERATION_TOKENS:,} tokens one "
                "generation of a recurrent model may reach (its state does not grow)")
    return context, f"the load's context of {context} tokens"


MAX_ROUTE_STAGES = 1024  # a route from the network longer than this is not believed


def route_hop(doc: Any, i: int) -> RouteHop:
    """Route entry ``i`` of a record: its stage, its fellow's id (hex), name and address
    checked, and every field within what the wire's ``RouteHop`` carries; ConfigError
    otherwise."""
    try:
        f = DocFields(doc, f"stage {i} of the load's route")
        fid = f.text("fellow_id", max_chars=64)
        bytes.fromhex(fid)
        if f.whole("stage", high=MAX_ROUTE_STAGES) != i:
            raise ConfigError("not in its place")
        start, end = f.pair("layers", [0, 0])
        return RouteHop(i, fid, f.text("fellow", max_chars=64), f.text("addr", max_chars=128),
                        start, end, f.text("card", "", max_chars=320),
                        f.whole("claim_bytes", 0), f.whole("allocated_bytes", 0),
                        f.whole("fetched_bytes", 0), f.number("fetch_s", 0.0))
    except (ConfigError, ValueError):
        raise ConfigError(f"stage {i} of the load's route is malformed") from None


@dataclass(frozen=True, slots=True)
class LoadRecord:
    """A load as a driver runs sessions through it: its route, and what of its runtime
    and model a generation needs. Read from the document a leader answers or a fellow's
    view shows (``from_doc``, checked: it may come from the network)."""

    plan_id: str
    stages: tuple[RouteHop, ...]  # in pipeline order
    model: dict[str, Any]  # the model's public identity (``public_model``), a document
    max_sessions: int  # sessions the load's stages hold at once
    prefill_chunk_tokens: int
    context_tokens: int  # 0: the record names no context
    recurrent: bool  # the model's state does not grow with its tokens (what the asker said)
    recut_from: tuple[str, ...] = ()  # the plan_ids it went by before live moves re-cut it

    @property
    def fellow_ids(self) -> tuple[str, ...]:
        return tuple(h.fellow_id for h in self.stages)

    def continues(self, record: LoadRecord) -> bool:
        """Whether this record (a heal's answer) is ``record``'s load with as many stages,
        or its new cut after a live move that re-cut it: a session may resume on it."""
        if self.plan_id != record.plan_id:
            return record.plan_id in self.recut_from
        return len(self.stages) == len(record.stages)

    def generation_tokens(self) -> tuple[int, str]:
        """As ``generation_tokens`` of the record's document."""
        return _generation_tokens(self.recurrent, self.context_tokens)

    @staticmethod
    def from_doc(doc: Any) -> LoadRecord:
        """A record a leader answers or a view shows, checked; ConfigError otherwise."""
        f = DocFields(doc, "a load's record")
        if not isinstance(f.value("plan_id", None), str):
            raise ConfigError("a load's record names no plan_id")
        hops = f.value("stages", None)
        if not isinstance(hops, list) or not 0 < len(hops) <= MAX_ROUTE_STAGES:
            raise ConfigError("a load's record has no route, or too long a one")
        runtime, model = f.fields("runtime", None), f.fields("model", {})
        sessions = runtime.whole("max_sessions", 1, high=1 << 32)
        chunk = runtime.whole("prefill_chunk_tokens", 256, high=1 << 32)
        context = runtime.whole("max_context_tokens", 0, high=1 << 32)
        return LoadRecord(f.text("plan_id", max_chars=64),
                          tuple(route_hop(h, i) for i, h in enumerate(hops)),
                          f.value("model", {}), sessions, chunk, context,
                          model.flag("recurrent"), tuple(former_plan_ids(doc)))


def route_entry(hop: RouteHop) -> RouteEntryDoc:
    """A route hop as a fellow gossips it with its stages (``ROUTE_KEYS``)."""
    return {"stage": hop.stage, "fellow_id": hop.fellow_id, "fellow": hop.fellow,
            "addr": hop.addr, "layers": [hop.start_layer, hop.end_layer], "card": hop.card,
            "claim_bytes": hop.claim_bytes, "allocated_bytes": hop.allocated_bytes}


class HostedStage:
    """One stage this fellow holds, from reservation to release."""

    def __init__(self, order: StageOrder, term: int, expires_s: float) -> None:
        self.order = order
        self.term = term
        self.state = "reserved"  # -> loading -> loaded -> active; released when dropped
        self.expires_s = expires_s
        self.stage: LoadedStage | None = None
        self.limiter = trio.CapacityLimiter(1)  # torch calls of one stage run one at a time
        self.allocated_bytes = 0
        self.decode_s = math.inf  # smoothed compute time of one decode step
        self.route: tuple[RouteHop, ...] = ()
        self.sessions: set[str] = set()
        # every stage's order of the load and the term of the StageStart that brought
        # them: what a new leader asks for to take the load over (``adoption``)
        self.kept_orders: tuple[StageAssignment, ...] = ()
        self.started_term = 0
        self.kept_asked = b""  # what the load was asked as (``StageStart.asked``)

    @property
    def next_hop(self) -> RouteHop | None:
        i = self.order.stage + 1
        return self.route[i] if i < len(self.route) else None

    @property
    def previous_hop(self) -> RouteHop | None:
        i = self.order.stage - 1
        return self.route[i] if 0 <= i < len(self.route) else None


class GenerationHopDoc(TypedDict):
    """A stage of a generation's route as its result shows it."""

    stage: int
    fellow: str
    layers: list[int]
    card: str


class GenerationStageDoc(GenerationHopDoc):
    """A stage of a generation's route with its timings, as the result shows it."""

    ms_per_token: float
    prefill_ms: float


class GenerationDoc(TypedDict):
    """A generation's result as the control API and the CLI show it."""

    plan_id: str
    prompt_tokens: int
    cached_tokens: int
    token_ids: list[int]
    text: str
    stop_reason: str
    time_to_first_token_s: float
    decode_s: float
    decode_tokens_per_s: float
    stages: list[GenerationStageDoc]
    network_ms_per_token: float
    hops: int
    resumes: int
    replayed_stages: list[int]


@dataclass(frozen=True, slots=True)
class GenerationResult:
    plan_id: str
    prompt_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    text: str
    stop_reason: str  # "stop_token" | "max_tokens"
    time_to_first_token_s: float
    decode_s: float
    stage_decode_s: tuple[float, ...]  # compute per stage over the decode steps
    route: tuple[GenerationHopDoc, ...]  # its stages, as the result shows them
    logits: tuple[Any, ...] = ()  # (vocab,) float32 tensors, one per token, with keep_logits
    cached_tokens: int = 0  # prompt tokens a kept session's cache held (not prefilled)
    resumes: int = 0  # sessions re-opened on a healed load (a stage moved, or came back)
    stage_prefill_s: tuple[float, ...] = ()  # compute per stage of the prompt's last chunk
    # per resume, how many stages (from stage 0) replayed the past tokens; 0: none did
    replayed_stages: tuple[int, ...] = ()

    @property
    def decode_steps(self) -> int:
        return max(len(self.token_ids) - 1, 0)  # the first token comes out of the prefill

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_steps / self.decode_s if self.decode_steps and self.decode_s else 0.0

    def to_dict(self) -> GenerationDoc:
        steps = self.decode_steps
        per_token = self.decode_s / steps if steps else 0.0
        compute = sum(self.stage_decode_s) / steps if steps else 0.0
        prefill = [*self.stage_prefill_s[:len(self.route)],
                   *[0.0] * (len(self.route) - len(self.stage_prefill_s))]
        return {
            "plan_id": self.plan_id, "prompt_tokens": len(self.prompt_ids),
            "cached_tokens": self.cached_tokens,
            "token_ids": list(self.token_ids), "text": self.text,
            "stop_reason": self.stop_reason,
            "time_to_first_token_s": self.time_to_first_token_s, "decode_s": self.decode_s,
            "decode_tokens_per_s": self.decode_tokens_per_s,
            "stages": [GenerationStageDoc(**r, ms_per_token=1e3 * s / steps if steps else 0.0,
                                          prefill_ms=1e3 * p)
                       for r, s, p in zip(self.route, self.stage_decode_s, prefill)],
            "network_ms_per_token": max(per_token - compute, 0.0) * 1e3,
            "hops": len(self.route) + 1,
            "resumes": self.resumes, "replayed_stages": list(self.replayed_stages),
        }


__all__ = [
    "ROUTE_KEYS",
    "CachedWeights",
    "GenerationHopDoc",
    "GenerationResult",
    "HostedStage",
    "LoadRecord",
    "MAX_ROUTE_STAGES",
    "StageOrder",
    "WeightSource",
    "WeightsOrigin",
    "RECURRENT_GENERATION_TOKENS",
    "former_plan_ids",
    "generation_tokens",
    "public_adapter",
    "public_model",
    "route_dict",
    "planned_runtime_doc",
    "route_entry",
    "route_hop",
    "runtime_block",
    "runtime_doc",
    "RouteDoc",
    "RouteEntryDoc",
    "RuntimeDoc",
]
