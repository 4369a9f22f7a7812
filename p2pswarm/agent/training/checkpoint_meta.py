"""What a checkpoint's manifest says besides its shards, as values: where the job stood
(``CheckpointMeta``) and where each stage's replica stood (``StagePosition``).

``to_doc`` writes the manifest's ``meta`` exactly as it always was; ``from_doc`` reads it
back, and reads the positions of checkpoints written before they moved to the manifest
(each stage's shard carried its own, with the version under ``sync``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypedDict

from p2pswarm.errors import ConfigError
from p2pswarm.training.job import JobConfig


def _damaged(what: str) -> ConfigError:
    return ConfigError(f"the checkpoint's manifest is damaged: {what}")


def _int_at(doc: Mapping[str, Any], key: str) -> int:
    try:
        return int(doc[key])
    except (KeyError, TypeError, ValueError):
        raise _damaged(key) from None


@dataclass(frozen=True, slots=True)
class StagePosition:
    """Where one stage's replica stood when the checkpoint was written."""

    data_position: int
    pipeline_steps: int
    samples_unsent: int
    steps_unsent: int
    version: int
    # a paused replica's stand-in (a copy of a present replica's shard): resumed, it
    # takes the keepers' global state
    global_state: bool = False

    def to_doc(self) -> dict[str, int]:
        doc = {"data_position": self.data_position, "pipeline_steps": self.pipeline_steps,
               "samples_unsent": self.samples_unsent, "steps_unsent": self.steps_unsent,
               "version": self.version}
        if self.global_state:
            doc["global_state"] = 1
        return doc

    @classmethod
    def from_doc(cls, doc: Mapping[str, Any]) -> StagePosition:
        sync = doc.get("sync")
        version = doc["version"] if "version" in doc else (
            sync.get("version") if isinstance(sync, Mapping) else None)
        try:
            v = int(version)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise _damaged("version") from None
        return cls(_int_at(doc, "data_position"), _int_at(doc, "pipeline_steps"),
                   _int_at(doc, "samples_unsent"), _int_at(doc, "steps_unsent"), v,
                   bool(doc.get("global_state")))


class CheckpointMetaDoc(TypedDict):
    """A ``CheckpointMeta``'s document: the ``meta`` of a checkpoint's manifest on disk."""

    step: int
    samples: int
    bytes_sent: int
    losses: list[float]
    cut: list[int]
    replicas: int
    job: object  # ``JobConfig.to_dict``: its job.json
    job_id: str
    positions: dict[str, dict[str, int]]


@dataclass(frozen=True, slots=True)
class CheckpointMeta:
    """Where the job stood at a checkpoint, and what it was."""

    step: int
    samples: int
    bytes_sent: int
    losses: tuple[float, ...]
    cut: tuple[int, ...]  # the first layer of every stage but the first
    replicas: int
    job: JobConfig  # the job that wrote it (its job.json in the document)
    job_id: str
    positions: dict[str, StagePosition]  # by shard name, "replica-R.stage-S"

    def to_doc(self) -> CheckpointMetaDoc:
        return {"step": self.step, "samples": self.samples, "bytes_sent": self.bytes_sent,
                "losses": list(self.losses), "cut": list(self.cut), "replicas": self.replicas,
                "job": self.job.to_dict(), "job_id": self.job_id,
                "positions": {name: p.to_doc() for name, p in self.positions.items()}}

    def same_training(self, job: JobConfig) -> bool:
        """Whether ``job`` trains as the job.json that wrote this checkpoint: all of it
        but where checkpoints live must match."""
        saved = {k: v for k, v in self.job.to_dict().items() if k != "checkpoint"}
        return saved == {k: v for k, v in job.to_dict().items() if k != "checkpoint"}

    @classmethod
    def from_doc(cls, doc: Mapping[str, Any]) -> CheckpointMeta:
        try:
            losses = tuple(float(x) for x in doc["losses"])
            cut = tuple(int(x) for x in doc["cut"])
            job = JobConfig.from_dict(doc["job"])
        except (KeyError, TypeError, ValueError, AttributeError, ConfigError):
            raise _damaged("its job's record") from None
        raw = doc.get("positions") or {}
        if not isinstance(raw, Mapping):
            raise _damaged("positions")
        positions = {str(name): StagePosition.from_doc(p) for name, p in raw.items()
                     if isinstance(p, Mapping)}
        return cls(_int_at(doc, "step"), _int_at(doc, "samples"), _int_at(doc, "bytes_sent"),
                   losses, cut, _int_at(doc, "replicas"), job, str(doc.get("job_id", "")),
                   positions)

    @classmethod
    def of_manifest(cls, manifest: Mapping[str, Any]) -> CheckpointMeta:
        """The ``meta`` of a checkpoint's manifest (``CheckpointStore.manifest``)."""
        meta = manifest.get("meta")
        if not isinstance(meta, Mapping):
            raise _damaged("its job's record")
        return cls.from_doc(meta)


def shard_digests(manifest: Mapping[str, Any]) -> dict[str, str]:
    """A checkpoint manifest's shards: each one's name and SHA-256 (KeyError or TypeError
    when it has none; the caller checks each name and digest where it uses them)."""
    shards = manifest["shards"]
    if not isinstance(shards, Mapping):
        raise TypeError("the manifest's shards are not a map")
    return dict(shards)


__all__ = ["CheckpointMeta", "StagePosition", "shard_digests"]
