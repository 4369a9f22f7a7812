"""A whole job in one process, round by round: replicas, keepers, checkpoints, export.

This is the job as the swarm runs it with every fellow on one machine and every round
synchronous (each replica takes ``inner_steps`` steps, then every stage's round closes
with all contributions): what the demo runs, and what ``--resume`` must continue
exactly. A lone replica needs no sync and takes none. The asynchronous, speed-aware
version over a simulated network is ``virtual.VirtualSwarm``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from p2pswarm.errors import ConfigError
from p2pswarm.models.loader import TensorSource
from p2pswarm.training.checkpoint import CheckpointStore
from p2pswarm.training.data import TokenData, load_tokens
from p2pswarm.training.export import export_hf
from p2pswarm.training.job import JobConfig
from p2pswarm.training.lora import save_adapters
from p2pswarm.training.replica import Replica, synced_tensors
from p2pswarm.training.source import job_tokenizer, open_job_model
from p2pswarm.training.sync import OuterSync, flatten


@dataclass(frozen=True, slots=True)
class Progress:
    step: int  # optimizer steps each replica has taken
    loss: float  # mean training loss of this step over the replicas
    version: int  # sync rounds closed
    replicas: int
    samples: int  # sequences trained on, all replicas together
    bytes_sent: int  # sync traffic so far (contributions up, updates down)


def job_data(job: JobConfig) -> TokenData:
    tokens = load_tokens(job.data, job_tokenizer(job.model))
    return TokenData.split(tokens, job.data.holdout_fraction, job.seq_len)


class LocalRun:
    def __init__(self, job: JobConfig, *, cut: Sequence[int] = (), replicas: int | None = None,
                 source: TensorSource | None = None, data: TokenData | None = None,
                 batches: Sequence[tuple[int, int]] | None = None) -> None:
        """``batches``: each replica's (micro-batch, micro-batches a step), as a fleet
        plan gives them (``micro_batch: "auto"``); default the job's for every one."""
        self.job = job
        self.cut = list(cut)
        self.source = source if source is not None else open_job_model(job.model, job.seed)
        self.data = data if data is not None else job_data(job)
        n = replicas if replicas is not None else (
            len(batches) if batches else job.replicas or 1)
        if n < 1:
            raise ConfigError("a run needs at least one replica")
        shapes = list(batches) if batches else [(job.micro_batch, job.micro_batches)] * n
        if len(shapes) != n:
            raise ConfigError(f"{len(shapes)} batch sizes for {n} replicas")
        self.replicas = [Replica.build(f"replica-{i}", job, self.source, self.data.train,
                                       self.cut, stream=i, micro_batch=b, micro_batches=m)
                         for i, (b, m) in enumerate(shapes)]
        self.keepers = [OuterSync(flatten(synced_tensors(stage)), job.sync)
                        for stage in self.replicas[0].stages]
        for keeper in self.keepers:
            for replica in self.replicas:
                keeper.join(replica.name)
        self.step = 0
        self.samples = 0
        self.bytes_sent = 0
        self.losses: list[float] = []

    @property
    def synced(self) -> bool:
        return len(self.replicas) > 1

    def run(self, until_step: int | None = None,
            on_progress: Callable[[Progress], None] | None = None) -> list[float]:
        """Train to ``until_step`` (default: the job's steps); the new steps' losses.
        Checkpoints on the job's interval when it names a directory."""
        target = self.job.steps if until_step is None else min(until_step, self.job.steps)
        first = len(self.losses)
        store = self._store()
        while self.step < target:
            losses = [r.train_step() for r in self.replicas]
            self.step += 1
            self.samples += sum(r.micro_batch * r.micro_batches for r in self.replicas)
            self.losses.append(sum(losses) / len(losses))
            if self.synced and (self.step % self.job.sync.inner_steps == 0
                                or self.step == self.job.steps):
                self.sync_round()
            if store is not None and self.step % self.job.checkpoint.interval_steps == 0:
                self.save_checkpoint(store)
            if on_progress is not None:
                on_progress(Progress(self.step, self.losses[-1], self.keepers[0].version,
                                     len(self.replicas), self.samples, self.bytes_sent))
        return self.losses[first:]

    def sync_round(self) -> None:
        """Every replica sends its deltas; every stage's round closes; all apply."""
        contributions = [r.take_contribution() for r in self.replicas]
        updates = []
        for s, keeper in enumerate(self.keepers):
            for c in contributions:
                _, decoded, version = c.stages[s]
                keeper.contribute(c.replica, version, decoded, c.samples)
            result = keeper.close_round(float(self.step))
            assert result is not None
            updates.append(result)
        self.bytes_sent += sum(c.nbytes for c in contributions)
        self.bytes_sent += len(self.replicas) * sum(u.update.nbytes for u in updates)
        for replica in self.replicas:
            replica.apply([u.update for u in updates], updates[0].version)

    def evaluate(self, max_batches: int | None = 8) -> float:
        batches = self.data.holdout_batches(self.job.seq_len, self.job.micro_batch, max_batches)
        if not batches:
            raise ConfigError("no held-out data to evaluate on: raise data.holdout_fraction")
        return self.replicas[0].evaluate(batches)

    # --- checkpoints ---------------------------------------------------------------------

    def _store(self) -> CheckpointStore | None:
        if self.job.checkpoint.dir is None:
            return None
        return CheckpointStore(self.job.checkpoint.dir, keep=self.job.checkpoint.keep)

    def save_checkpoint(self, store: CheckpointStore | None = None) -> Path:
        store = store or self._store()
        if store is None:
            raise ConfigError("the job names no checkpoint.dir")
        shards: dict[str, dict[str, Any]] = {}
        for i, replica in enumerate(self.replicas):
            for s in range(len(replica.stages)):
                shards[f"replica-{i}.stage-{s}"] = replica.shard_state(s)
        for s, keeper in enumerate(self.keepers):
            shards[f"keeper.stage-{s}"] = keeper.state_dict()
        meta = {"step": self.step, "samples": self.samples, "bytes_sent": self.bytes_sent,
                "losses": self.losses, "cut": self.cut, "replicas": len(self.replicas),
                "job": self.job.to_dict()}
        return store.write(self.step, shards, meta)

    @classmethod
    def resume(cls, job: JobConfig, *, step: int | None = None,
               source: TensorSource | None = None, data: TokenData | None = None) -> LocalRun:
        """The run as it was at checkpoint ``step`` (default: the latest complete one)."""
        if job.checkpoint.dir is None:
            raise ConfigError("the job names no checkpoint.dir to resume from")
        store = CheckpointStore(job.checkpoint.dir, keep=job.checkpoint.keep)
        step = store.latest() if step is None else step
        if step is None:
            raise ConfigError(f"no complete checkpoint in {job.checkpoint.dir}")
        meta = store.manifest(step)["meta"]
        if _comparable(meta["job"]) != _comparable(job.to_dict()):
            raise ConfigError("the checkpoint was written by a different job.json; resume "
                              "with the job it was trained with")
        run = cls(job, cut=meta["cut"], replicas=meta["replicas"], source=source, data=data)
        positions = meta.get("positions") or {}  # written by the swarm (or re-sharded)
        for i, replica in enumerate(run.replicas):
            for s in range(len(replica.stages)):
                name = f"replica-{i}.stage-{s}"
                replica.load_shard_state(s, {**store.read(step, name),
                                             **positions.get(name, {})})
            replica.pipeline.copy_tied_weight()
        for s, keeper in enumerate(run.keepers):
            keeper.load_state_dict(store.read(step, f"keeper.stage-{s}"), float(step))
        for i, replica in enumerate(run.replicas):
            # a replica the swarm had paused when it wrote the checkpoint: another's shards
            # stand in for its own, and it starts from the global parameters
            if positions.get(f"replica-{i}.stage-0", {}).get("global_state"):
                for sync, keeper in zip(replica.syncs, run.keepers):
                    sync.reset(keeper.join(replica.name))
                replica.pipeline.copy_tied_weight()
        run.step = int(meta["step"])
        run.samples = int(meta["samples"])
        run.bytes_sent = int(meta["bytes_sent"])
        run.losses = [float(x) for x in meta["losses"]]
        return run

    # --- results -------------------------------------------------------------------------

    def export(self, out_dir: str | Path) -> Path:
        """The trained model as a Hugging Face directory recording the stage cut
        (adapters merged in LoRA mode)."""
        hf_config = getattr(self.source, "hf_config", None)
        if hf_config is None:
            hf_config = self.source.config.to_hf()
        with torch.no_grad():
            return export_hf([s.model for s in self.replicas[0].stages], hf_config, out_dir)

    def save_adapters(self, out_dir: str | Path) -> Path:
        if self.job.lora is None:
            raise ConfigError("adapters exist in mode lora only")
        base = self.job.model.name or "scratch"
        return save_adapters([s.model for s in self.replicas[0].stages], self.job.lora,
                             out_dir, base_model=base)


def _comparable(job: dict[str, Any]) -> dict[str, Any]:
    # where checkpoints live may change between runs; what is trained may not
    return {k: v for k, v in job.items() if k != "checkpoint"}
