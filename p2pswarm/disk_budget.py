"""How many bytes each store a fellow keeps on disk may hold: a share of the filesystem
the store lives on (inside a container, its volume), never more than the old fixed
default and never more than the disk has.

The rule (docs/operations.md, "Disk caps"): a store's cap is ``fraction`` of the disk's
size, where the size is ``used + free`` of ``shutil.disk_usage`` on the store's directory
(the blocks a user may fill; root's reserved blocks left out), at most ``ceiling_bytes``.
A value set in ``StorageConfig`` wins over the share, but is still cut to the disk's size.
On a 32 GB SD card (30.4 GB usable) the weights cache gets 35 % (10.6 GB), checkpoint
copies 15 % (4.6 GB), leaders' own checkpoints 10 % (3.0 GB), job data 10 % (3.0 GB): 70 %
in all, the rest left to the OS, the logs and the stores bounded by count."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from p2pswarm.config import StorageConfig


class DiskUsage(NamedTuple):
    total: int
    used: int
    free: int


# the seam tests fake: ``shutil.disk_usage``'s signature
Usage = Callable[[str], DiskUsage]


def _disk_usage(path: str) -> DiskUsage:
    total, used, free = shutil.disk_usage(path)
    return DiskUsage(total, used, free)


@dataclass(frozen=True, slots=True)
class StoreShare:
    """One store under a fellow's home: its directory, the ``StorageConfig`` field that
    overrides its share, the share of its disk, and the most it gets whatever the disk."""

    store: str
    config_field: str
    fraction: float
    ceiling_bytes: int


JOB_CHECKPOINTS = "job-checkpoints"
SHARES: tuple[StoreShare, ...] = (
    StoreShare("weights", "weights_cache_bytes", 0.35, 64 << 30),
    StoreShare("checkpoint-copies", "checkpoint_copies_bytes", 0.15, 64 << 30),
    StoreShare(JOB_CHECKPOINTS, "job_checkpoints_bytes", 0.10, 64 << 30),
    StoreShare("job-data", "job_data_bytes", 0.10, 4 << 30),
)
# stores bounded by count rather than bytes: shown in status with their use, no cap
COUNTED_STORES = ("job-copies", "loads")


def share(store: str) -> StoreShare:
    for s in SHARES:
        if s.store == store:
            return s
    raise KeyError(store)


def disk_bytes(directory: Path, usage: Usage = _disk_usage) -> int | None:
    """The size (used + free) of the filesystem ``directory`` is on, or would be on once
    made (its nearest existing parent); None when none can be read."""
    for candidate in (directory, *directory.parents):
        try:
            found = usage(str(candidate))
        except OSError:
            continue
        return found.used + found.free
    return None


def cap_bytes(store: str, directory: Path, storage: StorageConfig,
              usage: Usage = _disk_usage) -> int:
    """The most ``store`` (kept in ``directory``) may hold: see the module."""
    rule = share(store)
    configured: int | None = getattr(storage, rule.config_field)
    size = disk_bytes(directory, usage)
    if configured is not None:
        return configured if size is None else min(configured, size)
    if size is None:
        return rule.ceiling_bytes
    return min(rule.ceiling_bytes, int(size * rule.fraction))


def default_caps(size_bytes: int) -> dict[str, int]:
    """Every store's default cap on a disk of ``size_bytes`` (the docs' table)."""
    return {s.store: min(s.ceiling_bytes, int(size_bytes * s.fraction)) for s in SHARES}


def tree_bytes(root: Path) -> int:
    """Bytes of the files under ``root`` (0 when missing; a file that vanishes while
    walking is skipped: stores evict while this reads)."""
    return sum(_sizes(root))


def _sizes(root: Path) -> Iterator[int]:
    for directory, _, files in os.walk(root):
        for name in files:
            try:
                yield os.lstat(os.path.join(directory, name)).st_size
            except OSError:
                pass


def is_leftover(name: str) -> bool:
    """A temporary file of an unfinished write (``.NAME.tmp-PID``, ``.NAME.PID-ID.tmp``,
    ``.part-XXXX``): renamed into place when whole, so one still there when an agent starts
    was left by a process killed mid-write."""
    return name.startswith(".") and (".tmp-" in name or name.endswith(".tmp")
                                      or name.startswith(".part-"))


def sweep_leftovers(home: Path, before_s: float) -> tuple[int, int]:
    """Delete what killed agents left in the stores under ``home``: temporary files of
    unfinished writes, and stage states that never reached their stage (``.incoming``),
    written before ``before_s`` (wall clock: this agent's start, so its own writes are
    safe); (files, bytes) deleted. Without it a fellow killed mid-write every few
    minutes fills its disk a temporary file at a time (none is counted against a cap)."""
    files = removed = 0
    for store in (*(s.store for s in SHARES), *COUNTED_STORES):
        for directory, _, names in os.walk(home / store):
            incoming = Path(directory).name == ".incoming" or "/.incoming/" in directory
            for name in names:
                if not (incoming or is_leftover(name)):
                    continue
                path = os.path.join(directory, name)
                try:
                    stat = os.lstat(path)
                    if stat.st_mtime >= before_s:
                        continue
                    os.unlink(path)
                except OSError:
                    continue
                files += 1
                removed += stat.st_size
    return files, removed


@dataclass(frozen=True, slots=True)
class StoreUse:
    """One store's use against its cap (None: bounded by count, not bytes)."""

    store: str
    used_bytes: int
    cap_bytes: int | None

    def to_dict(self) -> dict[str, str | int | None]:
        return {"store": self.store, "used_bytes": self.used_bytes, "cap_bytes": self.cap_bytes}


def store_uses(home: Path, storage: StorageConfig, usage: Usage = _disk_usage) -> list[StoreUse]:
    """Every store under ``home``: its use and cap (``status``'s ``disks``). Reads the
    disk: run it off the event loop."""
    out = [StoreUse(s.store, tree_bytes(home / s.store),
                    cap_bytes(s.store, home / s.store, storage, usage)) for s in SHARES]
    out += [StoreUse(name, tree_bytes(home / name), None) for name in COUNTED_STORES]
    return out


__all__ = ["COUNTED_STORES", "JOB_CHECKPOINTS", "SHARES", "DiskUsage", "StoreShare",
           "StoreUse", "Usage", "cap_bytes", "default_caps", "disk_bytes", "is_leftover",
           "share", "store_uses", "sweep_leftovers", "tree_bytes"]
