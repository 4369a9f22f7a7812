"""Messages of the data plane: sessions through a pipeline, and stage weights (tags 100-109,
130-131, 145-147).

A session runs over one sealed stream per hop. The first frame on each is an envelope
(``SessionOpen`` from the driver or the stage before, ``SessionReturn`` from the last
stage back to the driver); after it the stream belongs to the session and every frame is
one message: ``StepInput`` forward, ``StepOutput`` from the last stage to the driver,
``SessionEnd`` to finish, ``SessionError`` in either direction when a stage fails or loses
a neighbour. Tensors ride inside these as tensor frames (``p2pswarm.runtime.frame``:
dtype, shape, raw bytes).

Weights travel differently: a ``WeightsRequest`` names tensors; for each the server sends a
``WeightsItem`` header and then the tensor's raw bytes as plain frames (no envelope), since
a stage's weights may be gigabytes and copying them through msgpack would cost as much as
sending them. ``LoadProgress`` is a best-effort datagram from a loading fellow to the
fellow whose ``load`` command is waiting.

Any fellow can also be asked for tensors by their SHA-256 alone, from what it offered or
holds in its weights cache (``p2pswarm.agent.weight_holders``): ``WeightsHeldAsk`` names
hashes and is answered with a ``WeightsHeld`` bitmap of those it holds; a
``WeightsByHash`` request is answered like a ``WeightsRequest``, each ``WeightsItem``
then named by its hash. This is how a stage whose model's source is gone finds its
tensors on the fellows that cached them.

So that such fellows exist, the leader orders a fellow outside a stage to copy the stage's
tensors ahead into its weights cache (``StageCopy``, term-fenced like every order; answered
``StageCopied``): ``p2pswarm.agent.serving.copies``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from p2pswarm.wire.codec import message
from p2pswarm.wire.orders import Doc
from p2pswarm.wire.schema import U16, U32, U64, Addr, Items, Name, Range, Reason, Seconds, Size

Token = Annotated[str, Size(1, 64)]  # session ids, plan ids, load tickets, manifest keys
TensorName = Annotated[str, Size(1, 256)]
Sha256Hex = Annotated[str, Size(64, 64)]
TensorFrame = Annotated[bytes, Size(0, 64 * 1024 * 1024)]
StageTimes = Annotated[tuple[Seconds, ...], Items(256)]  # compute seconds, one per stage so far
Phase = Annotated[str, Size(1, 32)]
StageList = Annotated[tuple[U16, ...], Items(256)]  # stage indexes

MAX_TENSORS_PER_REQUEST = 65536
MAX_HASHES_PER_ASK = 4096  # a stage of a large model reads some hundreds of tensors


@message(100)
@dataclass(frozen=True, slots=True)
class WeightsRequest:
    """Send me these tensors (or small files, e.g. ``tokenizer.json``) of an offered model."""

    model_key: Token  # the manifest key the offering fellow announced
    names: Annotated[tuple[TensorName, ...], Items(MAX_TENSORS_PER_REQUEST)]


@message(101)
@dataclass(frozen=True, slots=True)
class WeightsItem:
    """Header of one tensor; ``nbytes`` of raw frames follow."""

    name: TensorName
    nbytes: U64
    sha256: Sha256Hex  # what the manifest says; the receiver checks the bytes against it


@message(102)
@dataclass(frozen=True, slots=True)
class WeightsRefused:
    reason: Reason


@message(103)
@dataclass(frozen=True, slots=True)
class SessionOpen:
    """Open a session at ``stage`` of load ``plan_id``; the stage opens the next hop."""

    session: Token
    plan_id: Token
    stage: U16
    return_addr: Addr  # where the last stage sends tokens: the driver's agent
    temperature: Annotated[float, Range(0.0, 100.0)] = 0.0
    top_k: U32 = 0
    top_p: Annotated[float, Range(0.0, 1.0)] = 1.0
    seed: U64 = 0
    keep_logits: bool = False  # send the logits each token was drawn from (tests, tools)
    resume_from: U32 = 0  # >0: continue the session's kept cache, cut to these positions
    # a generation resumed after a failover: a stage that still holds the session's cache
    # of at least ``resume_from`` positions continues it; one that does not starts afresh
    # (no error) and adds its index to ``fresh``, which the last stage returns
    recover: bool = False
    fresh: StageList = ()


@message(104)
@dataclass(frozen=True, slots=True)
class SessionReturn:
    """The last stage's stream back to the driver, for ``session``."""

    session: Token
    fresh: StageList = ()  # a recovering session: the stages that must rebuild its cache


@message(105)
@dataclass(frozen=True, slots=True)
class StepInput:
    """Token ids (to stage 0) or hidden states (to the others) for positions
    ``position``..; ``final``: the last chunk of this step, so the last stage samples."""

    step: U32
    position: U32
    final: bool
    stage_s: StageTimes
    tensor: TensorFrame
    # >0: a chunk replayed to rebuild caches after a failover, through stages 0 ..
    # replay_stages - 1 only (the later stages still hold those positions); 0: every stage
    replay_stages: U16 = 0


@message(106)
@dataclass(frozen=True, slots=True)
class StepOutput:
    """The token the last stage drew for ``step``, and what each stage spent on it."""

    step: U32
    token: U32
    stage_s: StageTimes
    logits: TensorFrame = b""  # float32 (vocab,), only with keep_logits


@message(107)
@dataclass(frozen=True, slots=True)
class SessionEnd:
    steps: U32  # steps the driver ran: a check, and a reason for the log
    keep: bool = False  # keep the session's cache for its next turn (a chat)


@message(108)
@dataclass(frozen=True, slots=True)
class SessionError:
    """A stage failed, or lost a neighbour: names the stage and fellow to blame."""

    stage: U16
    fellow: Name
    reason: Reason
    evicted: bool = False  # the kept cache to resume is gone: start the session afresh


@message(109)
@dataclass(frozen=True, slots=True)
class LoadProgress:
    """How far one fellow is with its stage of a load (best effort, a datagram)."""

    ticket: Token
    stage: U16
    fellow: Name
    phase: Phase  # "checked" | "fetching" | "loading" | "ready"
    done_bytes: U64
    total_bytes: U64


@message(130)
@dataclass(frozen=True, slots=True)
class StageCopy:
    """Fetch the tensors of stage ``stage`` (layers ``start_layer``..``end_layer - 1``) of
    load ``plan_id`` into your weights cache, from whichever fellow holds them: ``model``
    is the stage order's model block (its manifest), checked against what the load's
    stages gossip. An order of the leader's; nothing is built."""

    plan_id: Token
    stage: U16
    start_layer: U32
    end_layer: U32
    model: Doc
    term: U64 = 0


@message(131)
@dataclass(frozen=True, slots=True)
class StageCopied:
    fetched_bytes: U64  # what came over the network for this order
    held_bytes: U64  # what the stage's tensors take in the cache now
    fetch_s: Seconds


@message(145)
@dataclass(frozen=True, slots=True)
class WeightsHeldAsk:
    """Which of these tensors or files (by SHA-256) do you hold?"""

    hashes: Annotated[tuple[Sha256Hex, ...], Items(MAX_HASHES_PER_ASK)]


@message(146)
@dataclass(frozen=True, slots=True)
class WeightsHeld:
    """Bit ``i`` (``held[i // 8] >> (i % 8) & 1``) set: the asked hash ``i`` is held."""

    held: Annotated[bytes, Size(0, MAX_HASHES_PER_ASK // 8)]


@message(147)
@dataclass(frozen=True, slots=True)
class WeightsByHash:
    """Send me these tensors or files by SHA-256: a ``WeightsItem`` (named by the hash)
    and raw frames for each, or ``WeightsRefused`` at the first one not held."""

    hashes: Annotated[tuple[Sha256Hex, ...], Items(MAX_HASHES_PER_ASK)]


__all__ = [
    "LoadProgress", "SessionEnd", "SessionError", "SessionOpen", "SessionReturn", "StageCopied",
    "StageCopy", "StepInput", "StepOutput", "WeightsByHash", "WeightsHeld", "WeightsHeldAsk",
    "WeightsItem", "WeightsRefused", "WeightsRequest",
]
