"""Checkpoints that survive: atomic files, complete sets, shards on more than one fellow.

A checkpoint is a directory ``step-NNNNNNNN`` holding one file per shard (a stage of a
replica, or a stage's keeper state) and a ``manifest.json`` naming every shard with its
SHA-256. Each file is written atomically: a temporary file in the same directory,
flushed and fsynced, renamed over the final name, and the directory fsynced. The
manifest goes last, and the ``LATEST`` pointer after it, so a crash at any moment leaves
either the previous complete checkpoint or the new one, never a mix.

Shard files are ``torch.save`` dicts of tensors and plain values, read back with
``weights_only=True``: a shard from another fellow is data, never code.

``shard_holders`` says which fellows keep a copy of each shard (rendezvous hashing, so
the choice is stable as fellows come and go): with two copies on distinct fellows,
losing any one fellow loses no shard.
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from p2pswarm.errors import ConfigError
from p2pswarm.training.checkpoint_files import (
    LATEST,
    MANIFEST,
)
from p2pswarm.training.checkpoint_files import atomic_write_bytes as atomic_write_bytes
from p2pswarm.training.checkpoint_files import shard_holders as shard_holders

FORMAT = 1


def shard_bytes(state: Mapping[str, Any]) -> bytes:
    buffer = io.BytesIO()
    torch.save(dict(state), buffer)
    return buffer.getvalue()


def read_shard_bytes(data: bytes) -> dict[str, Any]:
    try:
        state: dict[str, Any] = torch.load(io.BytesIO(data), weights_only=True)
    except Exception as exc:  # torch raises several kinds for a damaged file
        raise ConfigError(f"checkpoint shard is unreadable: {exc}") from exc
    return state


class CheckpointStore:
    """Complete checkpoints under one directory, the newest ``keep`` kept."""

    def __init__(self, directory: str | Path, keep: int = 3) -> None:
        self.directory = Path(directory)
        self.keep = keep

    def step_dir(self, step: int) -> Path:
        return self.directory / f"step-{step:08d}"

    def write(self, step: int, shards: Mapping[str, Mapping[str, Any]],
              meta: Mapping[str, Any] | None = None,
              files: Mapping[str, str] | None = None) -> Path:
        """Write every shard, then the manifest, then move ``LATEST``; prune old ones.
        ``files``: shards already written in the step's directory (received in parts,
        verified), by name, with their SHA-256."""
        target = self.step_dir(step)
        target.mkdir(parents=True, exist_ok=True)
        digests: dict[str, str] = {}
        for name, sha256 in sorted((files or {}).items()):
            _check_name(name)
            if not (target / f"{name}.pt").is_file():
                raise ConfigError(f"checkpoint step {step}: shard {name} was never written")
            digests[name] = sha256
        for name in sorted(shards):
            _check_name(name)
            data = shard_bytes(shards[name])
            atomic_write_bytes(target / f"{name}.pt", data)
            digests[name] = hashlib.sha256(data).hexdigest()
        manifest = {"format": FORMAT, "step": step, "shards": digests, "meta": dict(meta or {})}
        atomic_write_bytes(target / MANIFEST,
                           json.dumps(manifest, indent=2, sort_keys=True).encode())
        atomic_write_bytes(self.directory / LATEST, target.name.encode())
        self._prune()
        return target

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints here (a manifest present), oldest first."""
        if not self.directory.is_dir():
            return []
        found = []
        for entry in self.directory.glob("step-*"):
            if (entry / MANIFEST).is_file() and entry.name[5:].isdigit():
                found.append(int(entry.name[5:]))
        return sorted(found)

    def latest(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def manifest(self, step: int) -> dict[str, Any]:
        path = self.step_dir(step) / MANIFEST
        try:
            manifest: dict[str, Any] = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read {path}: {exc}") from exc
        if manifest.get("format") != FORMAT:
            raise ConfigError(f"{path}: checkpoint format {manifest.get('format')!r} is not "
                              f"{FORMAT}")
        return manifest

    def read(self, step: int, name: str) -> dict[str, Any]:
        """One shard, checked against the manifest's digest."""
        manifest = self.manifest(step)
        if name not in manifest["shards"]:
            raise ConfigError(f"checkpoint step {step} has no shard {name!r}")
        return self.read_verified(self.step_dir(step) / f"{name}.pt", manifest["shards"][name])

    @staticmethod
    def read_verified(path: Path, sha256: str) -> dict[str, Any]:
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise ConfigError(f"cannot read shard {path}: {exc.strerror}") from exc
        if hashlib.sha256(data).hexdigest() != sha256:
            raise ConfigError(f"shard {path} does not match its manifest (damaged or partial)")
        return read_shard_bytes(data)

    def _prune(self) -> None:
        for step in self.steps()[: -self.keep]:
            shutil.rmtree(self.step_dir(step), ignore_errors=True)


def _check_name(name: str) -> None:
    if not name or "/" in name or name.startswith(".") or name in (MANIFEST, LATEST):
        raise ConfigError(f"bad shard name {name!r}")
