"""Checkpoint files without torch: atomic writes, the manifest's names, who holds a shard.

``training.checkpoint`` (torch) writes and reads shards with these; the agent's checkpoint
copies use them directly, so copying shards between fellows never imports torch.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from p2pswarm.errors import ConfigError

MANIFEST = "manifest.json"
LATEST = "LATEST"


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the new, whole."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    fsync_dir(path.parent)


def fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return  # not every platform lets a directory be opened
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def latest_cut(directory: str | Path) -> list[int] | None:
    """The stage cut of the newest complete checkpoint in ``directory`` (None: none there,
    or unreadable)."""
    steps = sorted(d for d in Path(directory).glob("step-*")
                   if d.name[5:].isdigit() and (d / MANIFEST).is_file())
    if not steps:
        return None
    try:
        manifest: Any = json.loads((steps[-1] / MANIFEST).read_text())
        cut = manifest["meta"]["cut"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(cut, list) or not all(type(c) is int for c in cut):
        return None
    return list(cut)


def shard_holders(shards: Sequence[str], fellows: Sequence[str],
                  copies: int = 2) -> dict[str, tuple[str, ...]]:
    """The ``copies`` fellows (distinct, fewer if there are fewer fellows) that keep each
    shard: highest-random-weight hashing, stable when unrelated fellows come or go."""
    if copies < 1:
        raise ConfigError("a shard needs at least one copy")
    holders: dict[str, tuple[str, ...]] = {}
    for shard in shards:
        ranked = sorted(set(fellows), key=lambda f: hashlib.sha256(
            f"{shard}\0{f}".encode()).digest(), reverse=True)
        holders[shard] = tuple(ranked[:copies])
    return holders


__all__ = ["LATEST", "MANIFEST", "atomic_write_bytes", "fsync_dir", "latest_cut",
           "shard_holders"]
