"""One replica of a job in one process: its pipeline, its data stream, its side of sync.

The network layer spreads a replica's stages over fellows; everything a stage owns
(``TrainStage``, ``LocalSync``) is per stage here too, so each fellow can hold its own.
The data stream is the replica's: the first stage reads inputs from it and the last
stage targets, at the same position.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from p2pswarm.errors import ConfigError
from p2pswarm.models.loader import TensorSource
from p2pswarm.training.codec import Encoded
from p2pswarm.training.data import SampleStream
from p2pswarm.training.job import JobConfig
from p2pswarm.training.lora import apply_lora
from p2pswarm.training.pipeline import LocalTrainPipeline
from p2pswarm.training.source import trainable_stage
from p2pswarm.training.stage import TrainStage
from p2pswarm.training.sync import JoinState, LocalSync


def stage_bounds(num_layers: int, cut: Sequence[int]) -> list[tuple[int, int]]:
    """[(start, end)] of each stage for layer boundaries ``cut`` (e.g. [3, 6] of 8)."""
    bounds = [0, *cut, num_layers]
    if any(a >= b for a, b in itertools.pairwise(bounds)):
        raise ConfigError(f"stage cut {list(cut)} must be increasing layer boundaries "
                          f"strictly between 0 and {num_layers}")
    return list(itertools.pairwise(bounds))


def build_stages(job: JobConfig, source: TensorSource, cut: Sequence[int], *,
                 devices: Sequence[str] | None = None) -> list[TrainStage]:
    """Trainable stages of ``source`` for the job's mode (LoRA: frozen base + adapters),
    stage i on ``devices[i]`` (all on the CPU by default)."""
    stages = []
    bounds = stage_bounds(source.config.num_layers, cut)
    for i, (start, end) in enumerate(bounds):
        device = devices[i] if devices is not None else "cpu"
        model = job_stage_model(source, job, start, end, device)
        stages.append(TrainStage(model, job.optimizer))
    return stages


def job_stage_model(source: Any, job: JobConfig, start: int, end: int,
                    device: str = "cpu") -> Any:
    """Layers ``start:end`` of the job's model, ready to train: the whole stage for full
    training, or a frozen (perhaps quantised) base with LoRA adapters."""
    if job.lora is None:
        return trainable_stage(source, start, end, dtype=job.weights_dtype, device=device)
    quant = job.lora.base_dtype if job.lora.base_dtype in ("int8", "int4") else "none"
    dtype = "f32" if quant != "none" else job.lora.base_dtype
    model = trainable_stage(source, start, end, dtype=dtype, quant=quant, device=device)
    apply_lora(model, job.lora, job.seed)
    return model


def synced_tensors(stage: TrainStage) -> list[torch.Tensor]:
    """What a stage syncs: its trainable tensors, less a tied head (synced on stage 0)."""
    return [p for n, p in stage.named_trainable if not (stage.is_last and n == stage.tied_name)]


@dataclass(frozen=True, slots=True)
class Contribution:
    replica: str
    samples: int
    stages: tuple[tuple[Encoded, torch.Tensor, int], ...]  # per stage: sent, decoded, version

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e, _, _ in self.stages)


class Replica:
    def __init__(self, name: str, job: JobConfig, stages: Sequence[TrainStage],
                 stream: SampleStream, *, schedule: str = "1f1b",
                 micro_batch: int | None = None, micro_batches: int | None = None) -> None:
        self.name = name
        self.job = job
        # this replica's own (a fleet plan sizes each to its cards), else the job's
        self.micro_batch = micro_batch or job.micro_batch
        self.micro_batches = micro_batches or job.micro_batches
        self.pipeline = LocalTrainPipeline(stages, lr=job.lr, grad_clip=job.optimizer.grad_clip,
                                           schedule=schedule)
        self.stream = stream
        self.syncs = [LocalSync(synced_tensors(s), job.sync,
                                noise_seed=(job.seed * 1_000_003 + stream.stream) * 64 + i)
                      for i, s in enumerate(stages)]
        self.samples_unsent = 0
        self.steps_unsent = 0

    @classmethod
    def build(cls, name: str, job: JobConfig, source: TensorSource, tokens: torch.Tensor,
              cut: Sequence[int], *, stream: int = 0, micro_batch: int | None = None,
              micro_batches: int | None = None) -> Replica:
        stages = build_stages(job, source, cut)
        sample_stream = SampleStream(tokens, job.seq_len, seed=job.seed, stream=stream)
        return cls(name, job, stages, sample_stream, micro_batch=micro_batch,
                   micro_batches=micro_batches)

    @property
    def stages(self) -> tuple[TrainStage, ...]:
        return self.pipeline.stages

    @property
    def version(self) -> int:
        return min(s.version for s in self.syncs)

    def train_step(self, lr: float | None = None) -> float:
        batch = self.stream.next_micro_batches(self.micro_batches, self.micro_batch)
        loss = self.pipeline.train_step(batch, lr)
        self.samples_unsent += self.micro_batches * self.micro_batch
        self.steps_unsent += 1
        return loss

    def take_contribution(self) -> Contribution:
        stages = tuple(sync.take_delta() for sync in self.syncs)
        contribution = Contribution(self.name, self.samples_unsent, stages)
        self.samples_unsent = 0
        self.steps_unsent = 0
        return contribution

    def apply(self, updates: Sequence[Encoded | torch.Tensor], version: int) -> None:
        """Each stage's update to ``version``, in stage order."""
        for sync, update in zip(self.syncs, updates, strict=True):
            sync.apply(update, version)
        self.pipeline.copy_tied_weight()

    def reset(self, states: Sequence[JoinState]) -> None:
        """Start over from the keepers' states (joining, or rejoining after a crash)."""
        for sync, state in zip(self.syncs, states, strict=True):
            sync.reset(state)
        self.pipeline.copy_tied_weight()
        self.samples_unsent = 0
        self.steps_unsent = 0

    @torch.no_grad()
    def evaluate(self, batches: Sequence[torch.Tensor]) -> float:
        return self.pipeline.evaluate(batches)

    def shard_state(self, index: int) -> dict[str, Any]:
        """Everything stage ``index`` of this replica needs to resume exactly."""
        return {"stage": self.stages[index].state_dict(), "sync": self.syncs[index].state_dict(),
                "data_position": self.stream.position, "pipeline_steps": self.pipeline.steps,
                "samples_unsent": self.samples_unsent, "steps_unsent": self.steps_unsent}

    def load_shard_state(self, index: int, state: dict[str, Any]) -> None:
        self.stages[index].load_state_dict(state["stage"])
        self.syncs[index].load_state_dict(state["sync"])
        self.stream.position = int(state["data_position"])
        self.pipeline.steps = int(state["pipeline_steps"])
        self.samples_unsent = int(state["samples_unsent"])
        self.steps_unsent = int(state["steps_unsent"])
