"""Messages of training jobs: a replica's pipeline and its sync (tags 110-129, 180-199).

``PartDelta`` and ``PartUpdate`` carry the sharded all-reduce between replicas
(``agent.training.allreduce``): a part of a delta to that part's keeper, a part's
update to every replica.

A job's driver (the leader) opens one sealed stream to every stage of every replica; its
first frame is ``TrainOpen`` with role ``control``. Stage ``s`` opens one to stage
``s + 1`` of its replica with role ``data``: activations go down it, their gradients
come back up it. After the envelope every frame is one message: ``TrainTensor`` (inputs
and targets from the driver, activations, gradients, the tied-embedding gradient), or one
of the driver's commands, each its own type, and the stage's answer:

- ``StepRun`` (run step ``step`` with ``micro_batches`` micro-batches at learning rate
  ``lr``) -> ``StepReport`` (its squared gradient norm without a tied copy, whether a
  tied-embedding gradient follows, the sum of its micro-batch losses on the last stage);
  then ``StepApply`` (take the optimizer step with clip coefficient ``clip``) -> ``Ack``;
- ``TakeDelta`` -> ``Delta``: the stage's pseudo-gradient, an encoded vector anchored on
  ``version``; ``Update``: the keeper's update to ``version`` -> ``Ack``;
- ``ParamsAsk`` -> ``Params``: the stage's synced parameters (the keeper starts there);
- ``StateAsk`` -> ``StateHead`` and ``StatePart`` frames / ``StateLoadHead`` and
  ``StatePart`` frames -> ``Ack``: a stage's state (``torch.save`` bytes, read back
  weights-only) for checkpoints and resume, of any size: the head announces its size and
  SHA-256, the parts (at most ``SHARD_CHUNK_BYTES`` each) follow in order;
- ``TiedAsk`` -> ``Tied`` / ``TiedWeight`` -> ``Ack``: the first stage's embedding for a
  last stage holding a tied head, after a sync round;
- ``Reset``: a replica placed again takes the keeper's global parameters at ``version``
  -> ``Ack``; ``Stop`` ends the stream. ``Ack`` also answers the control stream's open.

``TrainError`` names the stage and fellow that failed and why, in either direction.
A blob or tensor longer than one part (``TrainTensor``, ``Delta``, ``Update``,
``Params``, ``Reset``, ``Tied``, ``TiedWeight``) carries its first ``SHARD_CHUNK_BYTES``
and says in ``more`` how many bytes follow as ``StatePart`` frames (protocol 2.1), so no
frame cap limits a stage's size either.
Tag 112 (the untyped ``TrainCtl``) is retired and never reused, and so are 125 and 126
(``State``, ``StateLoad``: a stage's whole state in one frame, capped at 64 MiB).

Job data (the text and token files a job trains on, read where the job was submitted)
travels on streams of its own too: ``DataPut`` and its parts store a file under its
SHA-256 on the fellow that drives the job; ``DataFetch`` asks a fellow for one.

Checkpoint copies travel on streams of their own. ``TrainShard`` opens one from the
leader to a holder: the shard ``name`` of checkpoint ``step`` of ``job_id`` with its
SHA-256, as frames of at most ``SHARD_CHUNK_BYTES`` (``offset`` into ``total``); the
holder answers ``Ack`` once it has the whole shard on disk, or ``TrainError``.
``TrainFetch`` asks a holder for a shard (``step`` 0: the newest step it holds whole);
it answers the shard as ``TrainShard`` frames, or ``TrainError``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from p2pswarm.wire.codec import message
from p2pswarm.wire.schema import F64, U16, U32, U64, Items, Name, Reason, Size
from p2pswarm.wire.versions import ALLREDUCE

Token = Annotated[str, Size(1, 64)]
Word = Annotated[str, Size(1, 32)]
Blob = Annotated[bytes, Size(0, 64 * 1024 * 1024)]
Hex = Annotated[str, Size(0, 64)]
Hex128 = Annotated[str, Size(0, 128)]  # an address, or "" for none
SHARD_CHUNK_BYTES = 16 * 1024 * 1024
Chunk = Annotated[bytes, Size(0, SHARD_CHUNK_BYTES)]


@message(110)
@dataclass(frozen=True, slots=True)
class TrainOpen:
    """Open stage ``stage`` of replica ``replica`` of job ``job_id`` as ``role``
    (``control`` from the driver, ``data`` from the stage before)."""

    job_id: Token
    replica: U16
    stage: U16
    role: Word


@message(111)
@dataclass(frozen=True, slots=True)
class TrainTensor:
    """``kind``: input | target | activation | gradient | tied; one tensor frame."""

    kind: Word
    step: U32
    micro: U16
    tensor: Blob
    more: U64 = 0  # bytes past ``tensor`` that follow as StatePart frames


@message(113)
@dataclass(frozen=True, slots=True)
class TrainError:
    stage: U16
    fellow: Name
    reason: Reason


@message(114)
@dataclass(frozen=True, slots=True)
class TrainShard:
    job_id: Token
    step: U32
    name: Token
    sha256: Hex
    offset: U64
    total: U64
    data: Chunk


@message(115)
@dataclass(frozen=True, slots=True)
class TrainFetch:
    job_id: Token
    step: U32  # 0: the newest complete step the holder has
    name: Token


# --- the driver's commands and the stage's answers (tag 112, TrainCtl, is retired) --------


@message(116)
@dataclass(frozen=True, slots=True)
class StepRun:
    """Run step ``step``: ``micro_batches`` forwards and backwards at learning rate ``lr``."""

    step: U32
    micro_batches: U32
    lr: F64


@message(117)
@dataclass(frozen=True, slots=True)
class StepReport:
    """A stage's step done: its squared gradient norm (less a tied copy), whether a
    tied-embedding gradient follows as ``TrainTensor("tied")``, its micro-batch losses'
    sum (the last stage; 0 elsewhere)."""

    step: U32
    has_tied_grad: bool
    grad_sq: F64
    loss_sum: F64


@message(118)
@dataclass(frozen=True, slots=True)
class StepApply:
    """Take the optimizer step of ``step`` with gradient clip coefficient ``clip``."""

    step: U32
    clip: F64


@message(119)
@dataclass(frozen=True, slots=True)
class TakeDelta:
    """Send the stage's pseudo-gradient since the last one."""


@message(120)
@dataclass(frozen=True, slots=True)
class Delta:
    """An encoded pseudo-gradient anchored on global version ``version``."""

    version: U32
    blob: Blob
    more: U64 = 0  # bytes past ``blob`` that follow as StatePart frames


@message(121)
@dataclass(frozen=True, slots=True)
class Update:
    """The keeper's encoded update that takes the stage to version ``version``."""

    version: U32
    blob: Blob
    more: U64 = 0  # bytes past ``blob`` that follow as StatePart frames


@message(122)
@dataclass(frozen=True, slots=True)
class ParamsAsk:
    """Send the stage's synced parameters."""


@message(123)
@dataclass(frozen=True, slots=True)
class Params:
    """The stage's synced parameters as one flat tensor frame."""

    blob: Blob
    more: U64 = 0  # bytes past ``blob`` that follow as StatePart frames


@message(124)
@dataclass(frozen=True, slots=True)
class StateAsk:
    """Send the stage's checkpoint shard."""


@message(127)
@dataclass(frozen=True, slots=True)
class Reset:
    """Start over from the keeper's global parameters (a tensor frame) at ``version``."""

    version: U32
    blob: Blob
    more: U64 = 0  # bytes past ``blob`` that follow as StatePart frames


@message(128)
@dataclass(frozen=True, slots=True)
class TiedAsk:
    """Send the first stage's (tied) input embedding."""


@message(129)
@dataclass(frozen=True, slots=True)
class Tied:
    """The first stage's input embedding as a tensor frame."""

    blob: Blob
    more: U64 = 0  # bytes past ``blob`` that follow as StatePart frames


@message(180)
@dataclass(frozen=True, slots=True)
class TiedWeight:
    """The last stage's tied head takes this embedding (a tensor frame)."""

    blob: Blob
    more: U64 = 0  # bytes past ``blob`` that follow as StatePart frames


@message(181)
@dataclass(frozen=True, slots=True)
class Ack:
    """Done (``step``: the step or version done, where there is one)."""

    step: U32 = 0


@message(182)
@dataclass(frozen=True, slots=True)
class Stop:
    """The driver is done with the stage: end the stream."""


@message(190)
@dataclass(frozen=True, slots=True)
class StateHead:
    """The stage's state (answering ``StateAsk``): ``total`` bytes with SHA-256 ``sha256``
    follow as ``StatePart`` frames."""

    total: U64
    sha256: Hex


@message(191)
@dataclass(frozen=True, slots=True)
class StateLoadHead:
    """Load this state into the stage: ``total`` bytes with SHA-256 ``sha256`` follow as
    ``StatePart`` frames; the stage answers ``Ack`` once it holds them."""

    total: U64
    sha256: Hex


@message(192)
@dataclass(frozen=True, slots=True)
class StatePart:
    """``data`` at ``offset`` of the bytes a head announced (``StateHead``,
    ``StateLoadHead``, ``DataPut``): parts come in order, none empty."""

    offset: U64
    data: Chunk


@message(193)
@dataclass(frozen=True, slots=True)
class DataPut:
    """A job's data file, ``total`` bytes with SHA-256 ``sha256`` (its name in the store),
    follows as ``StatePart`` frames; answered ``Ack`` once stored, or ``TrainError``. Also
    the answer to ``DataFetch``."""

    sha256: Hex
    total: U64


@message(194)
@dataclass(frozen=True, slots=True)
class DataFetch:
    """Send the job data file named ``sha256`` (as ``DataPut``), or ``TrainError``."""

    sha256: Hex


@message(195)
@dataclass(frozen=True, slots=True)
class MomentsAsk:
    """Send the stage's optimizer moments (``StateHead``, then ``StatePart`` frames): a
    stage of another replica, built anew, borrows them."""


@message(196)
@dataclass(frozen=True, slots=True)
class MomentsLoadHead:
    """Take these optimizer moments (another replica's of the same stage): ``total`` bytes
    with SHA-256 ``sha256`` follow as ``StatePart`` frames; answered ``Ack``."""

    total: U64
    sha256: Hex


# --- the sharded all-reduce between a job's replicas (agent.training.allreduce) ------------


@message(183)
@dataclass(frozen=True, slots=True)
class PartDelta:
    """Part ``part`` of replica ``replica``'s delta of stage ``stage``, anchored on global
    version ``version``, for that part's keeper (the reduce-scatter)."""

    stage: U16
    part: U16
    version: U32
    replica: Name
    samples: U64
    blob: Blob


@message(184)
@dataclass(frozen=True, slots=True)
class PartUpdate:
    """Part ``part``'s update of stage ``stage`` to version ``version``, from its keeper to
    every replica (the all-gather), or passed on to a part's new keeper."""

    stage: U16
    part: U16
    version: U32
    blob: Blob


@message(185)
@dataclass(frozen=True, slots=True)
class PartState:
    """Part ``part``'s outer state at version ``version`` (momentum and the error feedback
    of its update, ``torch.save`` bytes read back weights-only), from its keeper to the
    fellow that keeps the part if the keeper vanishes."""

    stage: U16
    part: U16
    version: U32
    blob: Blob


# --- the all-reduce in a real job (agent.training.ring): tags 186-189, 197, 198 --------------

MAX_RING = 256  # replicas of one job in one ring


@message(186, needs=ALLREDUCE)
@dataclass(frozen=True, slots=True)
class RingRound:
    """A driver's command to a stage of a job that syncs by the all-reduce: apply the
    previous round's update (waiting for it at most ``wait_s``), send this round's delta
    (``samples`` trained since the last) part by part, and answer ``Ack`` with the version
    it now stands at; ``last``: wait for this round's update too. ``addrs`` and
    ``fellows`` name each replica's fellow of this stage ("" for a replica out of the
    rounds), ``owners`` which replica keeps each part."""

    samples: U64
    wait_s: F64
    addrs: Annotated[tuple[Hex128, ...], Items(MAX_RING)]
    fellows: Annotated[tuple[Hex, ...], Items(MAX_RING)]
    owners: Annotated[tuple[U16, ...], Items(MAX_RING)]
    last: bool = False


@message(198, needs=ALLREDUCE)
@dataclass(frozen=True, slots=True)
class RingDone:
    """A stage's answer to ``RingRound``: the version it stands at, and the bytes of part
    messages its ring sent and received so far (the job counts its traffic)."""

    version: U32
    sent_bytes: U64
    received_bytes: U64


@message(187, needs=ALLREDUCE)
@dataclass(frozen=True, slots=True)
class PartOpen:
    """Opens a stream between two fellows of one stage's ring: the next frame is one
    ``PartDelta``, ``PartUpdate`` or ``PartState`` from replica ``sender``'s stage to
    replica ``replica``'s stage ``stage`` of job ``job_id``."""

    job_id: Token
    stage: U16
    replica: U16
    sender: U16


@message(188, needs=ALLREDUCE)
@dataclass(frozen=True, slots=True)
class PartUpdateAsk:
    """Send part ``part``'s update to version ``version`` (a ``PartUpdate``) as this stage
    applied it: the driver keeps the global parameters for checkpoints and rejoins."""

    version: U32
    part: U16


@message(189, needs=ALLREDUCE)
@dataclass(frozen=True, slots=True)
class OuterAsk:
    """Send the outer state of the parts this stage keeps (``StateHead``, then
    ``StatePart`` frames): a checkpoint holds what the keepers hold."""


@message(197, needs=ALLREDUCE)
@dataclass(frozen=True, slots=True)
class OuterLoadHead:
    """Keep these parts' outer state (``total`` bytes with SHA-256 ``sha256`` follow as
    ``StatePart`` frames; answered ``Ack``): a job resumed from a checkpoint or a copy."""

    total: U64
    sha256: Hex


__all__ = ["MAX_RING", "SHARD_CHUNK_BYTES", "Ack", "DataFetch", "DataPut", "Delta",
           "MomentsAsk", "MomentsLoadHead", "OuterAsk", "OuterLoadHead", "Params", "ParamsAsk",
           "PartDelta", "PartOpen", "PartState", "PartUpdate", "PartUpdateAsk", "Reset",
           "RingDone", "RingRound",
           "StateAsk", "StateHead", "StateLoadHead", "StatePart", "StepApply", "StepReport",
           "StepRun", "Stop", "TakeDelta", "Tied", "TiedAsk", "TiedWeight", "TrainError",
           "TrainFetch", "TrainOpen", "TrainShard", "TrainTensor", "Update"]
