"""Training in torch (no sockets): job config, pipeline stages and schedules, DiLoCo-style
sync with compressed pseudo-gradients, LoRA, checkpoints and export.

The network layer drives these pieces: ``TrainStage`` per stage and fellow, the schedule's
op lists, ``LocalSync`` per stage replica and ``OuterSync`` per stage keeper. In one
process, ``LocalRun`` runs a whole job round by round and ``VirtualSwarm`` plays
replicas asynchronously in virtual time.

Names are imported on first use, so ``job`` (torch-free apart from codec checks) stays
cheap to import.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "JobConfig": "job", "LrSchedule": "job", "SyncConfig": "job", "LoraConfig": "job",
    "OptimizerConfig": "job", "DataConfig": "job", "CheckpointConfig": "job",
    "ModelSpec": "job",
    "Encoded": "codec", "ErrorFeedback": "codec", "make_codec": "codec",
    "SampleStream": "data", "TokenData": "data", "load_tokens": "data",
    "corpus_text": "data",
    "Op": "schedule", "stage_ops": "schedule",
    "TrainStage": "stage",
    "LocalTrainPipeline": "pipeline",
    "LoRALinear": "lora", "apply_lora": "lora", "save_adapters": "lora",
    "load_adapters": "lora",
    "OuterSync": "sync", "LocalSync": "sync", "RoundResult": "sync", "JoinState": "sync",
    "step_budgets": "sync",
    "Replica": "replica", "build_stages": "replica",
    "CheckpointStore": "checkpoint", "atomic_write_bytes": "checkpoint",
    "shard_holders": "checkpoint",
    "export_hf": "export",
    "LocalRun": "run", "Progress": "run",
    "VirtualSwarm": "virtual", "FellowPlan": "virtual", "LinkModel": "virtual",
    "ScratchModel": "source", "open_job_model": "source",
}

__all__ = [
    "CheckpointConfig",
    "CheckpointStore",
    "DataConfig",
    "Encoded",
    "ErrorFeedback",
    "FellowPlan",
    "JobConfig",
    "JoinState",
    "LinkModel",
    "LoRALinear",
    "LocalRun",
    "LocalSync",
    "LocalTrainPipeline",
    "LoraConfig",
    "LrSchedule",
    "ModelSpec",
    "Op",
    "OptimizerConfig",
    "OuterSync",
    "Progress",
    "Replica",
    "RoundResult",
    "SampleStream",
    "ScratchModel",
    "SyncConfig",
    "TokenData",
    "TrainStage",
    "VirtualSwarm",
    "apply_lora",
    "atomic_write_bytes",
    "build_stages",
    "corpus_text",
    "export_hf",
    "load_adapters",
    "load_tokens",
    "make_codec",
    "open_job_model",
    "save_adapters",
    "shard_holders",
    "stage_ops",
    "step_budgets",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


if TYPE_CHECKING:
    from p2pswarm.training.checkpoint import CheckpointStore, atomic_write_bytes, shard_holders
    from p2pswarm.training.codec import Encoded, ErrorFeedback, make_codec
    from p2pswarm.training.data import SampleStream, TokenData, corpus_text, load_tokens
    from p2pswarm.training.export import export_hf
    from p2pswarm.training.job import (
        CheckpointConfig,
        DataConfig,
        JobConfig,
        LoraConfig,
        LrSchedule,
        ModelSpec,
        OptimizerConfig,
        SyncConfig,
    )
    from p2pswarm.training.lora import LoRALinear, apply_lora, load_adapters, save_adapters
    from p2pswarm.training.pipeline import LocalTrainPipeline
    from p2pswarm.training.replica import Replica, build_stages
    from p2pswarm.training.run import LocalRun, Progress
    from p2pswarm.training.schedule import Op, stage_ops
    from p2pswarm.training.source import ScratchModel, open_job_model
    from p2pswarm.training.stage import TrainStage
    from p2pswarm.training.sync import JoinState, LocalSync, OuterSync, RoundResult, step_budgets
    from p2pswarm.training.virtual import FellowPlan, LinkModel, VirtualSwarm
