"""Loading: the leader's calls and the stage orders it sends (tags 77-99, 132-134).

A fellow asks the leader to ``LoadAsk`` a plan request (answered ``LoadDone`` with the
load's record), to show ``LoadsAsk`` what is loaded (``LoadsShown``), to ``UnloadAsk``
(``Unloaded``) and to ``LoadCancel`` a load its CLI gave up on (``LoadCancelled``). The
leader brings a load up with three rounds of orders, one per stage: ``StagePrepare``
(check and reserve, ``StagePrepared``), ``StageLoad`` (fetch and build, ``StageLoaded``),
``StageStart`` (learn the route and go live, ``StageStarted``; every stage also keeps all
the load's orders, so that a later leader can ask any of them with ``StageOrdersAsk``,
``StageOrdersKept``), and takes it down with ``StageRelease`` (``StageReleased``),
handing every fellow a tombstone of it (``LoadUnloaded``) that a later leader asks for
before it adopts a load (``UnloadsAsk``, ``UnloadsKnown``). A refusal travels as
``CallFailed`` (``p2pswarm.wire.orders``) with its text, e.g. ``refuses stage 1: it is
training``.

Every call and order carries ``term`` as its last field (stamped by the leadership
layer). The stage order is a typed struct, so the codec bounds every field; the model's
identity (its manifest: files and tensors), an adapter's block and the load records the
leader shows are open-ended planner documents and travel as ``Doc``, checked by the
receiver.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from p2pswarm.wire.codec import earlier_order, message, struct
from p2pswarm.wire.orders import Doc
from p2pswarm.wire.schema import U16, U32, U64, Addr, Items, Name, Reason, Seconds, Size

PlanId = Annotated[str, Size(1, 64)]
MaybePlanId = Annotated[str, Size(0, 64)]  # "" when none is named
Ticket = Annotated[str, Size(0, 64)]  # "" when nobody waits for progress
MaybeAddr = Annotated[str, Size(0, 128)]
FellowHex = Annotated[str, Size(1, 64)]  # a fellow's node id in hex, as plans name it
CardKind = Annotated[str, Size(1, 16)]  # "cpu" | "cuda"
CardName = Annotated[str, Size(0, 256)]
CardLabel = Annotated[str, Size(0, 320)]
Word = Annotated[str, Size(1, 32)]  # a dtype or quantisation name
Generation = Annotated[str, Size(0, 16)]  # one bring-up of a plan: 64 random bits in hex
MAX_TOMBSTONES_SHOWN = 16  # an answer names at most this many unloads of one plan

MAX_STAGES = 256
MAX_LOADS = 1024


@struct
@dataclass(frozen=True, slots=True)
class RuntimeBlock:
    """The plan's runtime block: what every stage allocates (``StageSpec``'s fields besides
    the layer range and the device)."""

    dtype: Word
    quant: Word
    quant_group_size: U32
    kv_dtype: Word
    max_context_tokens: U32
    max_sessions: U32
    prefill_chunk_tokens: U32


@struct
@dataclass(frozen=True, slots=True)
class StageAssignment:
    """One stage of a plan, on one of the ordered fellow's cards."""

    plan_id: PlanId
    stage: U16
    n_stages: U16
    fellow_id: FellowHex  # the fellow the plan puts it on
    start_layer: U32
    end_layer: U32
    card_kind: CardKind
    card_index: U16
    card_name: CardName
    claim_bytes: U64  # what the stage allocates: weights, embeddings/head/buffers, KV cache
    need_bytes: U64  # what must be free: the claim plus activations and workspace
    runtime: RuntimeBlock
    model: Doc  # identity: {"kind": "builtin", "name"} or {"kind": "files", ...}
    progress_addr: MaybeAddr = ""
    ticket: Ticket = ""
    adapter: Doc = b""  # this stage's part of a LoRA adapter; b"" for none
    # the bring-up this order is of (random hex, kept across moves): an unload's
    # tombstone names it, so a later load of the same plan is not covered; "" before it
    generation: Generation = ""


@struct
@dataclass(frozen=True, slots=True)
class RouteHop:
    """One stage of a load as every stage learns it when the load starts."""

    stage: U16
    fellow_id: FellowHex
    fellow: Name
    addr: Addr
    start_layer: U32
    end_layer: U32
    card: CardLabel
    claim_bytes: U64
    allocated_bytes: U64
    fetched_bytes: U64
    fetch_s: Seconds


Route = Annotated[tuple[RouteHop, ...], Items(MAX_STAGES)]
Orders = Annotated[tuple[StageAssignment, ...], Items(MAX_STAGES)]
Stages = Annotated[tuple[U16, ...], Items(MAX_STAGES)]


# --- the leader's stage orders ----------------------------------------------------------


@message(77)
@dataclass(frozen=True, slots=True)
class StagePrepare:
    """Check your own live view and reserve this stage, or refuse with a reason."""

    order: StageAssignment
    term: U64 = 0


@message(78)
@dataclass(frozen=True, slots=True)
class StagePrepared:
    reserved_bytes: U64


@message(79)
@dataclass(frozen=True, slots=True)
class StageLoad:
    """Fetch what you lack of the reserved stage and build it on its card."""

    plan_id: PlanId
    stage: U16
    term: U64 = 0


@message(80)
@dataclass(frozen=True, slots=True)
class StageLoaded:
    allocated_bytes: U64
    fetched_bytes: U64
    fetch_s: Seconds
    load_s: Seconds


@message(81)
@dataclass(frozen=True, slots=True)
class StageStart:
    """Your loaded stages of ``plan_id`` go live on ``route``; keep ``orders`` (every
    stage's order, in route order) for a later leader to ask for (``StageOrdersAsk``)."""

    plan_id: PlanId
    route: Route
    orders: Orders = ()
    # what the load was asked as (request, adapter), for a re-cut; b"" when unknown
    asked: Doc = b""
    term: U64 = 0


@message(82)
@dataclass(frozen=True, slots=True)
class StageStarted:
    stages: Stages


@message(83)
@dataclass(frozen=True, slots=True)
class StageRelease:
    """Drop whatever you hold of ``plan_id``."""

    plan_id: PlanId
    term: U64 = 0


@message(84)
@dataclass(frozen=True, slots=True)
class StageReleased:
    stages: Stages


# --- calls the leader answers -----------------------------------------------------------


@message(85)
@dataclass(frozen=True, slots=True)
class LoadAsk:
    """Load ``request`` (a plan request), pinned to ``plan_id`` when one is named, from
    ``model`` (its identity) with ``adapter`` (b"" for none); progress goes to
    ``progress_addr`` under ``ticket``."""

    request: Doc
    plan_id: MaybePlanId
    model: Doc
    adapter: Doc = b""
    progress_addr: MaybeAddr = ""
    ticket: Ticket = ""
    term: U64 = 0


@message(86)
@dataclass(frozen=True, slots=True)
class LoadDone:
    record: Doc  # the load: plan id, model, runtime, stages (the route), load time


@message(87)
@dataclass(frozen=True, slots=True)
class LoadsAsk:
    term: U64 = 0


@message(88)
@dataclass(frozen=True, slots=True)
class LoadsShown:
    loads: Annotated[tuple[Doc, ...], Items(MAX_LOADS)]


@message(89)
@dataclass(frozen=True, slots=True)
class UnloadAsk:
    """Unload ``plan_id``; or, with none named, the only load, or every load with ``all``."""

    plan_id: MaybePlanId = ""
    all: bool = False
    term: U64 = 0


@message(90)
@dataclass(frozen=True, slots=True)
class Unloaded:
    plan_ids: Annotated[tuple[PlanId, ...], Items(MAX_LOADS)]


@message(91)
@dataclass(frozen=True, slots=True)
class LoadCancel:
    """The load asked for under ``ticket`` is no longer wanted (its CLI was interrupted):
    stop bringing it up and release every stage, or unload it if it is already up."""

    ticket: Annotated[str, Size(1, 64)]
    term: U64 = 0


LOAD_CANCEL_OUTCOMES = ("cancelled", "unloaded", "unknown")


@message(92)
@dataclass(frozen=True, slots=True)
class LoadCancelled:
    """``cancelled``: stopped mid-way, everything released; ``unloaded``: it had just come
    up and is unloaded; ``unknown``: no load under that ticket (a late ask is refused)."""

    outcome: Annotated[str, Size(1, 16)]
    plan_id: MaybePlanId = ""


# --- a new leader takes over the loads (``p2pswarm.agent.serving.adoption``) --------------


@message(93)
@dataclass(frozen=True, slots=True)
class StageOrdersAsk:
    """Which route and stage orders of ``plan_id`` do you keep? (a new leader adopting
    the loads its predecessor led)"""

    plan_id: PlanId
    term: U64 = 0


@message(94)
@dataclass(frozen=True, slots=True)
class StageOrdersKept:
    """The route and orders of the last ``StageStart`` this fellow obeyed for the plan, and
    that order's term; empty when it keeps none."""

    started_term: U64
    route: Route
    orders: Orders
    asked: Doc = b""  # as ``StageStart``'s


@message(95)
@dataclass(frozen=True, slots=True)
class LoadKeep:
    """Keep ``route`` and ``orders`` of load ``plan_id``, of which you host no stage, for a
    later leader to ask for (``StageOrdersAsk``): a keeper, answered ``StageStarted``
    with no stages."""

    plan_id: PlanId
    route: Route
    orders: Orders
    asked: Doc = b""  # as ``StageStart``'s
    term: U64 = 0


# --- an unload remembered across leaders (``p2pswarm.agent.serving.tombstones``) --------


@struct
@dataclass(frozen=True, slots=True)
class UnloadRecord:
    """Load ``plan_id``, brought up as ``generation``, was unloaded in ``unloaded_term``."""

    plan_id: PlanId
    generation: Annotated[str, Size(1, 16)]
    unloaded_term: U64


@message(132)
@dataclass(frozen=True, slots=True)
class LoadUnloaded:
    """Load ``unload.plan_id`` of ``unload.generation`` was unloaded: remember it for a
    while, and drop what you hold and keep of that bring-up (answered
    ``StageReleased``)."""

    unload: UnloadRecord
    term: U64 = 0


@message(133)
@dataclass(frozen=True, slots=True)
class UnloadsAsk:
    """Which unloads of ``plan_id`` do you remember? (a leader, before it adopts it)"""

    plan_id: PlanId
    term: U64 = 0


@message(134)
@dataclass(frozen=True, slots=True)
class UnloadsKnown:
    unloads: Annotated[tuple[UnloadRecord, ...], Items(MAX_TOMBSTONES_SHOWN)]


# --- failover and live moves (``p2pswarm.agent.serving.failover``) -----------------------


@message(96)
@dataclass(frozen=True, slots=True)
class StageCheck:
    """Do you still hold stage ``stage`` of ``plan_id``, live? (the leader, deciding
    whether a fellow whose stream broke is lost or back)"""

    plan_id: PlanId
    stage: U16
    term: U64 = 0


@message(97)
@dataclass(frozen=True, slots=True)
class StageChecked:
    state: Annotated[str, Size(1, 16)]  # the stage's state there: "active", ..., "none"


@message(98)
@dataclass(frozen=True, slots=True)
class StageLost:
    """A driver lost stage ``stage`` (its fellow ``fellow_id``) of ``plan_id``: heal the
    load (the fellow back within the grace window, or its stage re-placed) and answer
    ``LoadDone`` with the load's record as it now stands."""

    plan_id: PlanId
    stage: U16
    fellow_id: Annotated[str, Size(0, 64)]
    reason: Reason
    term: U64 = 0


@message(99)
@dataclass(frozen=True, slots=True)
class LoadMove:
    """Re-place load ``plan_id`` live on the plan the swarm now gives (``LoadDone``)."""

    plan_id: PlanId
    term: U64 = 0


# ``asked`` was added in the middle of these two (before ``term``, in commit ffe6bf5):
# releases before it send [plan_id, route, orders, term]. It stays where it is, since
# protocol 1 (675ee12) sends it there; the earlier order still decodes.
earlier_order(StageStart, ("plan_id", "route", "orders", "term"))
earlier_order(LoadKeep, ("plan_id", "route", "orders", "term"))

__all__ = [
    "LOAD_CANCEL_OUTCOMES", "LoadKeep", "LoadUnloaded", "UnloadRecord", "UnloadsAsk",
    "UnloadsKnown", "LoadMove", "StageCheck", "StageChecked", "StageLost", "LoadAsk", "LoadCancel",
    "LoadCancelled", "LoadDone", "LoadsAsk",
    "LoadsShown", "RouteHop", "RuntimeBlock", "StageAssignment", "StageLoad", "StageLoaded",
    "StagePrepare", "StagePrepared", "StageRelease", "StageReleased", "StageStart",
    "StageOrdersAsk", "StageOrdersKept", "StageStarted", "UnloadAsk", "Unloaded",
]
