"""``TrainRuntime`` in torch: the only agent module that imports torch for training.

``Training`` loads it on first use (``torch_runtime.TorchRuntime()``), so importing the
agent stays torch-free. Tensors cross the seam as tensor frames (``runtime.frame``), and
checkpoint shards as ``torch.save`` bytes read back weights-only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import torch

from p2pswarm.agent.training.runtime import KeeperState, ReplicaData, TrainRuntime
from p2pswarm.errors import PlacementError, RemoteProtocolError
from p2pswarm.runtime.frame import decode_tensor, encode_tensor
from p2pswarm.training.allreduce import (
    PartedSync,
    merge_outer,
    pack_outer,
    split_outer,
    unpack_outer,
)
from p2pswarm.training.checkpoint import CheckpointStore, read_shard_bytes, shard_bytes
from p2pswarm.training.codec import Encoded, make_codec
from p2pswarm.training.data import SampleStream
from p2pswarm.training.job import JobConfig
from p2pswarm.training.job_export import check_out_dir, export_checkpoint
from p2pswarm.training.replica import job_stage_model, synced_tensors
from p2pswarm.training.reshard import reshard_checkpoint
from p2pswarm.training.run import job_data
from p2pswarm.training.source import open_job_model
from p2pswarm.training.stage import TrainStage, clip_coefficient, fresh_ramp
from p2pswarm.training.sync import (
    JoinState,
    LocalSync,
    OuterSync,
    RoundResult,
    Verdict,
    flatten,
)
from p2pswarm.wire.jobs import TrainPrepare


def tensor_bytes(t: torch.Tensor) -> bytes:
    return bytes(encode_tensor(t.detach().contiguous().cpu()))


def tensor(blob: bytes) -> torch.Tensor:
    return decode_tensor(bytearray(blob))


class TorchStage:
    """One hosted stage: ``TrainStage`` and its ``LocalSync``."""

    def __init__(self, stage: TrainStage, sync: LocalSync) -> None:
        self.stage = stage
        self.sync = sync
        self.is_first = stage.is_first
        self.is_last = stage.is_last
        # the replica's step at which this stage's optimizer started without moments past
        # the job's first step (-1: it did not; None: not known until its first step)
        self._fresh_from: int | None = None

    def forward(self, micro: int, x: bytes, target: bytes | None) -> bytes | float:
        out = self.stage.forward(micro, tensor(x), None if target is None else tensor(target))
        return float(out) if self.is_last else tensor_bytes(out)

    def backward(self, micro: int, grad: bytes | None, loss_scale: float) -> bytes | None:
        g = None if grad is None else tensor(grad)
        grad_in = self.stage.backward(micro, g, loss_scale=loss_scale)
        if self.is_first:
            return None
        assert grad_in is not None
        return tensor_bytes(grad_in)

    def finish(self) -> tuple[bytes | None, float]:
        tied = self.stage.tied_grad()
        total = 0.0
        for name, p in self.stage.named_trainable:
            if p.grad is None or name == self.stage.tied_name:
                continue
            total += float(p.grad.detach().float().pow(2).sum())
        return (None if tied is None else tensor_bytes(tied)), total

    def apply(self, lr: float, clip: float, tied_total: bytes | None, step: int) -> None:
        if tied_total is not None:
            self.stage.set_tied_grad(tensor(tied_total))
        if self._fresh_from is None:  # built anew mid-job, nothing loaded: ramp up
            fresh = step > 0 and not self.stage.optimizer.state
            self._fresh_from = step if fresh else -1
        ramp = 1.0 if self._fresh_from < 0 else fresh_ramp(step - self._fresh_from)
        self.stage.step(lr * ramp, clip)

    def take_delta(self) -> tuple[int, bytes]:
        encoded, _, version = self.sync.take_delta()
        return version, encoded.to_bytes()

    def apply_update(self, version: int, update: bytes) -> None:
        self.sync.apply(Encoded.from_bytes(update), version)

    def parted(self, parts: int) -> PartedSync:
        return PartedSync(self.sync, parts)

    def params(self) -> bytes:
        return tensor_bytes(flatten(self.sync.tensors))

    def state(self) -> bytes:
        return shard_bytes({"stage": self.stage.state_dict(), "sync": self.sync.state_dict()})

    def load_state(self, shard: bytes) -> None:
        state = read_shard_bytes(shard)
        self.stage.load_state_dict(state["stage"])
        self.sync.load_state_dict(state["sync"])

    def moments(self) -> bytes:
        return shard_bytes(self.stage.moments())

    def borrow_moments(self, shard: bytes) -> int:
        return self.stage.borrow_moments(read_shard_bytes(shard))

    def reset(self, version: int, params: bytes) -> None:
        self.sync.reset(JoinState(version, tensor(params).float(), torch.zeros(0)))

    def _tied_weight(self) -> torch.Tensor:
        assert self.stage.tied_name is not None
        return dict(self.stage.named_trainable)[self.stage.tied_name]

    def tied(self) -> bytes:
        return tensor_bytes(self._tied_weight())

    def set_tied(self, weight: bytes) -> None:
        w = self._tied_weight()
        value = tensor(weight)
        with torch.no_grad():
            w.copy_(value.to(w.device, w.dtype))


class TorchData:
    """A replica's ``SampleStream``."""

    def __init__(self, stream: SampleStream) -> None:
        self.stream = stream

    @property
    def position(self) -> int:
        return self.stream.position

    @position.setter
    def position(self, value: int) -> None:
        self.stream.position = value

    def next_step(self, micro_batches: int, micro_batch: int
                  ) -> tuple[list[bytes], list[bytes]]:
        batch = self.stream.next_micro_batches(micro_batches, micro_batch)
        inputs, targets = batch[..., :-1], batch[..., 1:]
        return ([tensor_bytes(inputs[m]) for m in range(batch.shape[0])],
                [tensor_bytes(targets[m]) for m in range(batch.shape[0])])


class TorchKeeper:
    """``OuterSync`` with deltas, updates and parameters as bytes."""

    def __init__(self, params: bytes, job: JobConfig) -> None:
        self.outer = OuterSync(tensor(params), job.sync)
        self.codec = make_codec(job.sync.codec, **job.sync.codec_kwargs())

    @property
    def members(self) -> set[str]:
        return self.outer.members

    @property
    def version(self) -> int:
        return self.outer.version

    def ready(self, now: float) -> bool:
        return self.outer.ready(now)

    def next_deadline(self) -> float:
        return self.outer.next_deadline()

    def restart_deadline(self, now: float) -> None:
        self.outer.deadline = now + self.outer.config.round_deadline_s

    def join(self, replica: str) -> None:
        self.outer.join(replica)

    def join_state(self, replica: str) -> tuple[int, bytes, int]:
        state = self.outer.join(replica)
        return state.version, tensor_bytes(state.params), state.nbytes

    def leave(self, replica: str) -> None:
        self.outer.leave(replica)

    def contribute(self, replica: str, version: int, delta: bytes, samples: int,
                   now: float) -> Verdict:
        decoded = self.codec.decode(Encoded.from_bytes(delta))
        return self.outer.contribute(replica, version, decoded, samples, now)

    def close_round(self, now: float) -> RoundResult | None:
        return self.outer.close_round(now)

    def updates_since(self, version: int) -> list[bytes] | None:
        updates = self.outer.updates_since(version)
        return None if updates is None else [u.to_bytes() for u in updates]

    def adopt_parts(self, version: int, blobs: list[bytes]) -> None:
        if version != self.outer.version + 1:
            raise RemoteProtocolError("sync-gap", f"update to version {version} for a "
                                      f"keeper at version {self.outer.version}")
        decode = self.outer.compressor.codec.decode
        update = torch.cat([decode(Encoded.from_bytes(b)) for b in blobs]) if blobs \
            else torch.zeros(0)
        self.outer.advance(update)

    def outer_parts(self, parts: int) -> dict[int, bytes]:
        momentum, residual = self.outer.momentum, self.outer.compressor.residual
        if not bool(momentum.any()) and not bool(residual.any()):
            return {}
        return split_outer(momentum, residual, parts,
                           self.outer.compressor.codec.state_dict())

    def take_outer_parts(self, states: dict[int, bytes], parts: int) -> None:
        merge_outer(self.outer.momentum, self.outer.compressor.residual, states, parts)

    def state_dict(self) -> KeeperState:
        # OuterSync's state has exactly these keys (torch's side types it loosely)
        return cast(KeeperState, self.outer.state_dict())

    def load_state_dict(self, state: KeeperState, now: float) -> None:
        self.outer.load_state_dict(dict(state), now)


class TorchRuntime:
    def build_stage(self, order: TrainPrepare, job: JobConfig) -> TorchStage:
        device = "cpu" if order.card_kind == "cpu" else f"cuda:{order.card_index}"
        source = open_job_model(job.model, job.seed)
        try:
            model = job_stage_model(source, job, order.layer_start, order.layer_end, device)
        except (RuntimeError, MemoryError) as exc:  # torch's out-of-memory and kin
            raise PlacementError(f"stage {order.stage} could not be built on {device}: "
                                 f"{exc}") from exc
        stage = TrainStage(model, job.optimizer)
        sync = LocalSync(synced_tensors(stage), job.sync,
                         noise_seed=(job.seed * 1_000_003 + order.replica) * 64 + order.stage)
        return TorchStage(stage, sync)

    def replica_data(self, job: JobConfig, replicas: int) -> list[ReplicaData]:
        data = job_data(job)
        return [TorchData(SampleStream(data.train, job.seq_len, seed=job.seed, stream=i))
                for i in range(replicas)]

    def keeper(self, params: bytes, job: JobConfig) -> TorchKeeper:
        return TorchKeeper(params, job)

    def tied_total(self, a: bytes, b: bytes) -> tuple[bytes, float]:
        total = tensor(a) + tensor(b)
        return tensor_bytes(total), float(total.float().pow(2).sum())

    def clip_coefficient(self, sq_norms: list[float], max_norm: float) -> float:
        return clip_coefficient(sq_norms, max_norm)

    def pack_outer(self, states: dict[int, bytes]) -> bytes:
        return pack_outer(states)

    def unpack_outer(self, blob: bytes, parts: int) -> dict[int, bytes]:
        return unpack_outer(blob, parts)

    def read_shard(self, shard: bytes) -> KeeperState:
        return cast(KeeperState, read_shard_bytes(shard))

    def shard_bytes(self, state: KeeperState) -> bytes:
        return shard_bytes(state)

    def checkpoint_store(self, directory: str | Path, keep: int) -> CheckpointStore:
        return CheckpointStore(directory, keep=keep)

    def reshard(self, store: CheckpointStore, step: int, cut: list[int]) -> CheckpointStore:
        return reshard_checkpoint(store, step, cut)

    def export(self, store: CheckpointStore, out_dir: Path, step: int) -> Any:
        return export_checkpoint(store, out_dir, step=step)

    def check_out_dir(self, out: str) -> Path:
        return check_out_dir(out)


__all__ = ["TorchRuntime", "tensor", "tensor_bytes"]


def _conforms(runtime: TorchRuntime) -> TrainRuntime:
    """(for mypy: ``TorchRuntime`` is a ``TrainRuntime``)"""
    return runtime
