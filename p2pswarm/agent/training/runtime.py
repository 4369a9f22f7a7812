"""The seam between the agent's training and torch: ``TrainRuntime`` and what it builds.

The agent moves bytes and decides; torch computes. Everything the agent asks of torch
goes through these protocols, in tensor frames and checkpoint bytes, so no agent module
imports torch and a test or a simulation may hand ``Training`` another runtime.
``torch_runtime.TorchRuntime`` is the real one, loaded on first use.

- ``StageCompute``: one stage a fellow hosts (model, optimizer, its side of sync):
  forward, backward, step; its delta, updates, parameters, checkpoint shard, tied weight.
- ``ReplicaData``: a replica's data stream, one step's micro-batches at a time.
- ``StageKeeper``: the driver's keeper of one stage's global parameters (``OuterSync``).
- ``TrainRuntime``: builds those, and reads and writes checkpoints and exports.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypedDict

if TYPE_CHECKING:
    import torch  # for the keeper state's types only: no agent module runs torch

    from p2pswarm.agent.training.allreduce import PartSync
    from p2pswarm.training.checkpoint import CheckpointStore
    from p2pswarm.training.job import JobConfig
    from p2pswarm.training.sync import RoundResult, Verdict
    from p2pswarm.wire.jobs import TrainPrepare


class StageCompute(Protocol):
    """One hosted stage; tensors come and go as tensor frames (``runtime.frame``)."""

    is_first: bool
    is_last: bool
    stage: Any  # the ``training.TrainStage`` (for inspection)

    def forward(self, micro: int, x: bytes, target: bytes | None) -> bytes | float:
        """The activation frame for the next stage, or on the last stage the loss."""

    def backward(self, micro: int, grad: bytes | None, loss_scale: float) -> bytes | None:
        """The gradient frame for the stage before (None on the first stage)."""

    def finish(self) -> tuple[bytes | None, float]:
        """After the backwards: the tied-embedding gradient frame (None without one) and
        the squared gradient norm without it."""

    def apply(self, lr: float, clip: float, tied_total: bytes | None, step: int) -> None:
        """Take the replica's optimizer step ``step`` (with the summed tied gradient, when
        there is one); a stage built anew mid-job ramps its learning rate up
        (``training.stage.fresh_ramp``)."""

    def take_delta(self) -> tuple[int, bytes]:
        """(the version it is anchored on, the encoded pseudo-gradient)."""

    def apply_update(self, version: int, update: bytes) -> None: ...

    def parted(self, parts: int) -> PartSync:
        """This stage's side of the all-reduce, its parameters split in ``parts``."""

    def params(self) -> bytes:
        """The synced parameters as one flat tensor frame."""

    def state(self) -> bytes:
        """The stage's checkpoint shard (stage and sync state)."""

    def load_state(self, shard: bytes) -> None: ...

    def moments(self) -> bytes:
        """The optimizer's moments (``training.TrainStage.moments``) as shard bytes."""

    def borrow_moments(self, shard: bytes) -> int:
        """Take the same stage's moments from another replica (``moments``); how many
        parameters took them."""

    def reset(self, version: int, params: bytes) -> None:
        """Start over from the keeper's global parameters at ``version``."""

    def tied(self) -> bytes:
        """The tied embedding (first stage) as a tensor frame."""

    def set_tied(self, weight: bytes) -> None: ...


class ReplicaData(Protocol):
    position: int

    def next_step(self, micro_batches: int, micro_batch: int
                  ) -> tuple[list[bytes], list[bytes]]:
        """One optimizer step's inputs and targets, one tensor frame per micro-batch."""


class KeeperState(TypedDict):
    """A keeper's state (``OuterSync.state_dict``): what its checkpoint shard holds and, with
    no history, the outer state a job copy carries to a new leader."""

    version: int
    params: torch.Tensor  # the global parameters, flat
    momentum: torch.Tensor  # the outer momentum, flat
    compressor: dict[str, torch.Tensor | dict[str, torch.Tensor]]  # residual, codec's own
    history: dict[int, bytes]  # the recent updates' frames, by version


class StageKeeper(Protocol):
    """One stage's global parameters, rounds and outer optimizer (``OuterSync``)."""

    @property
    def members(self) -> set[str]: ...

    @property
    def version(self) -> int: ...

    def ready(self, now: float) -> bool: ...

    def next_deadline(self) -> float: ...

    def restart_deadline(self, now: float) -> None: ...

    def join(self, replica: str) -> None:
        """Count ``replica`` in for the rounds to come."""

    def join_state(self, replica: str) -> tuple[int, bytes, int]:
        """Count ``replica`` in; (the version, the global parameters as a tensor frame,
        their size in bytes as the traffic counts them)."""

    def leave(self, replica: str) -> None: ...

    def contribute(self, replica: str, version: int, delta: bytes, samples: int,
                   now: float) -> Verdict: ...

    def close_round(self, now: float) -> RoundResult | None: ...

    def updates_since(self, version: int) -> list[bytes] | None: ...

    def adopt_parts(self, version: int, blobs: list[bytes]) -> None:
        """Take the all-reduce's update to ``version`` (from ``version - 1``), one blob a
        part: a job that syncs by the all-reduce keeps its global parameters here."""

    def outer_parts(self, parts: int) -> dict[int, bytes]:
        """The outer state of each of ``parts`` parts (none when it is all zero)."""

    def take_outer_parts(self, states: dict[int, bytes], parts: int) -> None:
        """Parts' outer states (gathered from their keepers) into this keeper's."""

    def state_dict(self) -> KeeperState: ...

    def load_state_dict(self, state: KeeperState, now: float) -> None: ...


class TrainRuntime(Protocol):
    def build_stage(self, order: TrainPrepare, job: JobConfig) -> StageCompute:
        """The stage ``order`` asks for, on its card (PlacementError when it cannot be)."""

    def replica_data(self, job: JobConfig, replicas: int) -> list[ReplicaData]:
        """Each replica's data stream (reads and tokenizes the job's data)."""

    def keeper(self, params: bytes, job: JobConfig) -> StageKeeper: ...

    def tied_total(self, a: bytes, b: bytes) -> tuple[bytes, float]:
        """Two tied-gradient frames summed, and the sum's squared norm."""

    def clip_coefficient(self, sq_norms: list[float], max_norm: float) -> float:
        """The gradient clip coefficient from every stage's squared gradient norm."""

    def pack_outer(self, states: dict[int, bytes]) -> bytes:
        """Parts' outer states as one blob (``training.allreduce.pack_outer``)."""

    def unpack_outer(self, blob: bytes, parts: int) -> dict[int, bytes]:
        """What ``pack_outer`` wrote; RemoteProtocolError when it is not that."""

    def read_shard(self, shard: bytes) -> KeeperState:
        """``torch.save`` bytes of a keeper's outer state back, weights only."""

    def shard_bytes(self, state: KeeperState) -> bytes:
        """A keeper's outer state as ``torch.save`` bytes (a job copy's outer state)."""

    def checkpoint_store(self, directory: str | Path, keep: int) -> CheckpointStore: ...

    def reshard(self, store: CheckpointStore, step: int, cut: list[int]) -> CheckpointStore:
        """Checkpoint ``step`` re-sharded onto ``cut``, as a scratch store of its own."""

    def export(self, store: CheckpointStore, out_dir: Path, step: int) -> Any:
        """Export checkpoint ``step`` into ``out_dir`` (``job_export.Exported``)."""

    def check_out_dir(self, out: str) -> Path: ...


__all__ = ["ReplicaData", "StageCompute", "StageKeeper", "TrainRuntime"]
