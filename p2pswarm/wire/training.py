"""Messages of training jobs: a replica's pipeline and its sync (tags 110-129).

A job's driver (the leader) opens one sealed stream to every stage of every replica; its
first frame is ``TrainOpen`` with role ``control``. Stage ``s`` opens one to stage
``s + 1`` of its replica with role ``data``: activations go down it, their gradients
come back up it. After the envelope every frame is one message: ``TrainTensor`` (inputs
and targets from the driver, activations, gradients, the tied-embedding gradient) or
``TrainCtl``, the driver's commands and the stage's answers, whose ``op`` says which:

- ``step`` (driver): run step ``step`` with ``count`` micro-batches at learning rate
  ``value``; the stage answers ``report`` (``value`` its squared gradient norm without a
  tied copy, ``value2`` the sum of its micro-batch losses on the last stage);
- ``apply`` (driver): take the optimizer step with clip coefficient ``value``;
- ``take`` / ``delta``: the stage's pseudo-gradient, an encoded vector in ``blob``
  anchored on version ``step``; ``update``: the keeper's update to version ``step``;
- ``state`` / ``load``: a stage's shard (``torch.save`` bytes, read back weights-only)
  for checkpoints and resume; ``tied`` / ``tied-weight``: the first stage's embedding
  for a last stage holding a tied head, after a sync round; ``reset``: a replica placed
  again takes the keeper's global parameters (``blob``) at version ``step``;
- ``ok`` acknowledges, ``stop`` ends the stream.

``TrainError`` names the stage and fellow that failed and why, in either direction.

Checkpoint copies travel on streams of their own. ``TrainShard`` opens one from the
leader to a holder: the shard ``name`` of checkpoint ``step`` of ``job_id`` with its
SHA-256, as frames of at most ``SHARD_CHUNK_BYTES`` (``offset`` into ``total``); the
holder answers ``TrainCtl("ok")`` once it has the whole shard on disk, or ``TrainError``.
``TrainFetch`` asks a holder for a shard (``step`` 0: the newest step it holds whole);
it answers the shard as ``TrainShard`` frames, or ``TrainError``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from p2pswarm.wire.codec import message
from p2pswarm.wire.schema import F64, U16, U32, U64, Name, Reason, Size

Token = Annotated[str, Size(1, 64)]
Word = Annotated[str, Size(1, 32)]
Blob = Annotated[bytes, Size(0, 64 * 1024 * 1024)]
Hex = Annotated[str, Size(0, 64)]
SHARD_CHUNK_BYTES = 16 * 1024 * 1024


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


@message(112)
@dataclass(frozen=True, slots=True)
class TrainCtl:
    op: Word
    step: U32 = 0
    count: U32 = 0
    value: F64 = 0.0
    value2: F64 = 0.0
    blob: Blob = b""


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
    data: Blob


@message(115)
@dataclass(frozen=True, slots=True)
class TrainFetch:
    job_id: Token
    step: U32  # 0: the newest complete step the holder has
    name: Token


__all__ = ["SHARD_CHUNK_BYTES", "TrainCtl", "TrainError", "TrainFetch", "TrainOpen",
           "TrainShard", "TrainTensor"]
