"""The cards a fellow offers: NVIDIA GPUs through NVML, and the CPU with its RAM.

A card source is a small seam (``CardSource.read() -> tuple[Card, ...]``) so that the agent
reads real cards, while tests and simulations hand in fake ones. Reading never crashes:
a machine without an NVIDIA driver offers its CPU only and says so in one log line.

Memory this agent holds itself counts as free, not as "other programs": a new plan
replaces what the agent holds, and a pinned re-plan after a load must see the same room
it saw before the load.

Inventories refresh every few seconds but are re-gossiped only when a change matters to
planning (``GossipRule``: a card that came or went at once, memory that moved by more
than a band and stayed moved), so the swarm's view does not churn on noise.

This is the hardware side; the values it reads into (``Card``, ``Holder``, ``Inventory``,
``parse_size``) are pure and live in ``p2pswarm.cards``, where the planner finds them.
"""

from __future__ import annotations

import logging
import math
import os
import platform
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from p2pswarm.cards import Card, Holder, Inventory, parse_size
from p2pswarm.errors import ConfigError

log = logging.getLogger(__name__)


class CardSource(Protocol):
    """Anything that can say which cards this machine offers right now."""

    def read(self) -> tuple[Card, ...]: ...


# --- options -------------------------------------------------------------------------


def parse_gpu_list(text: str) -> tuple[int, ...]:
    """``0,2`` -> (0, 2); ``none`` -> () (offer no GPU)."""
    if text.strip().lower() in ("none", ""):
        return ()
    try:
        indexes = tuple(sorted({int(part) for part in text.split(",") if part.strip()}))
    except ValueError:
        raise ConfigError(
            f"cannot read --gpus {text!r}: give GPU indexes separated by commas, e.g. 0,2"
        ) from None
    if any(i < 0 for i in indexes):
        raise ConfigError(f"--gpus {text!r} has a negative index: e.g. --gpus 0,2")
    return indexes


# --- NVIDIA GPUs through NVML ------------------------------------------------------------


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _nvml_errors(nvml: Any) -> tuple[type[BaseException], ...]:
    """What an NVML call may raise: the binding's own error, or ctypes/OS trouble."""
    own = getattr(nvml, "NVMLError", None)
    extra = (own,) if isinstance(own, type) and issubclass(own, BaseException) else ()
    return (*extra, OSError, AttributeError, ValueError)


class NvmlCardSource:
    """NVIDIA GPUs through NVML (``nvidia-ml-py``'s ``pynvml`` or anything shaped like it).

    ``own_pids`` are this agent's processes: what they hold counts as free. ``gpus`` keeps
    only those indexes (``--gpus 0,2``); None offers them all.
    """

    def __init__(self, nvml_module: Any = None, own_pids: Iterable[int] | None = None,
                 gpus: Sequence[int] | None = None) -> None:
        self._nvml = nvml_module
        self._own_pids = frozenset(own_pids) if own_pids is not None else frozenset({os.getpid()})
        self._gpus = None if gpus is None else frozenset(gpus)
        self._ready = False
        self._said_no_driver = False

    def _start(self) -> Any:
        if self._ready:
            return self._nvml
        try:
            if self._nvml is None:
                import pynvml  # the real NVML binding (nvidia-ml-py)
                self._nvml = pynvml
            self._nvml.nvmlInit()
        except (ImportError, *_nvml_errors(self._nvml)) as exc:  # type: ignore[misc]
            # no driver, no library, no permission: offer the CPU only
            if not self._said_no_driver:
                log.info("no NVIDIA driver here (%s): offering the CPU only", exc)
                self._said_no_driver = True
            return None
        self._ready = True
        return self._nvml

    def close(self) -> None:
        if self._ready:
            self._ready = False
            try:
                self._nvml.nvmlShutdown()
            except _nvml_errors(self._nvml) as exc:  # a library already gone is fine
                log.debug("NVML shutdown: %s", exc)

    def read(self) -> tuple[Card, ...]:
        nvml = self._start()
        if nvml is None:
            return ()
        errors = _nvml_errors(nvml)
        try:
            count = int(nvml.nvmlDeviceGetCount())
        except errors as exc:
            log.warning("NVML could not count GPUs (%s): offering the CPU only", exc)
            return ()
        if self._gpus is not None:
            for missing in sorted(self._gpus - set(range(count))):
                log.warning("--gpus names GPU %d but this machine has %d", missing, count)
        cards = []
        for index in range(count):
            if self._gpus is not None and index not in self._gpus:
                continue
            try:
                cards.append(self._read_one(nvml, index))
            except errors as exc:  # one lost GPU must not hide the others
                log.warning("GPU %d could not be read (%s): leaving it out", index, exc)
        return tuple(cards)

    def _read_one(self, nvml: Any, index: int) -> Card:
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        errors = _nvml_errors(nvml)
        used_by_pid: dict[int, int] = {}
        for getter in ("nvmlDeviceGetComputeRunningProcesses",
                       "nvmlDeviceGetGraphicsRunningProcesses"):
            try:
                processes = getattr(nvml, getter)(handle)
            except errors as exc:  # not supported on this card or driver: skip that list
                log.debug("GPU %d: %s unavailable (%s)", index, getter, exc)
                continue
            for proc in processes:
                used = getattr(proc, "usedGpuMemory", None)  # None under WDDM
                pid = int(proc.pid)
                # a process with both contexts is listed twice with the same total
                used_by_pid[pid] = max(used_by_pid.get(pid, 0), int(used or 0))
        own_bytes = sum(b for pid, b in used_by_pid.items() if pid in self._own_pids)
        holders = []
        for pid, used in used_by_pid.items():
            if pid in self._own_pids:
                continue
            try:
                name = _text(nvml.nvmlSystemGetProcessName(pid))
            except errors:  # gone meanwhile, or not ours to see
                name = f"pid {pid}"
            holders.append(Holder(pid=pid, name=name, held_bytes=used))
        holders.sort(key=lambda h: (-h.held_bytes, h.pid))
        total = int(memory.total)
        return Card(index=index, kind="cuda", name=_text(nvml.nvmlDeviceGetName(handle)),
                    uuid=_text(nvml.nvmlDeviceGetUUID(handle)), total_bytes=total,
                    free_bytes=min(total, int(memory.free) + own_bytes),
                    held_by_others=tuple(holders), memory_source="NVML")


# --- the CPU's name --------------------------------------------------------------------


def _cpu_name() -> str:
    """x86: "model name"; a Raspberry Pi: its "Model" line (its cores have no name)."""
    found: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                found.setdefault(key.strip().lower(), value.strip())
    except OSError:
        pass
    for key in ("model name", "model", "hardware"):
        if found.get(key):
            return found[key]
    return platform.processor() or platform.machine() or "CPU"


# --- what a container (or a systemd unit) may use: its cgroup's limits -------------------

CGROUP_ROOT = "/sys/fs/cgroup"
PROC_SELF_CGROUP = "/proc/self/cgroup"
# cgroup v1 writes "no limit" as the largest page-aligned counter, ~ 2^63; no machine has
# 2^60 bytes, so anything above that is no limit at all.
_NO_LIMIT_ABOVE = 1 << 60
_CGROUP_FILE_MAX_BYTES = 64 * 1024  # memory.stat is a few KB; nothing there is bigger


@dataclass(frozen=True, slots=True)
class CgroupLimits:
    """What this process's cgroup allows: memory (bytes) and CPU (cores), None if no limit.

    ``memory_used_bytes`` is what the cgroup holds now, less the page cache it may drop
    (inactive files), as ``docker stats`` counts it; ``memory_from`` names the file the
    limit came from (``cgroup memory.max``), for ``status``.
    """

    memory_limit_bytes: int | None = None
    memory_used_bytes: int | None = None
    memory_from: str = ""
    cpu_limit_cores: float | None = None
    cpu_from: str = ""


def _read_small(path: Path) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read(_CGROUP_FILE_MAX_BYTES).decode("ascii", errors="replace")
    except OSError:
        return None


def _read_int(path: Path) -> int | None:
    text = _read_small(path)
    if text is None:
        return None
    try:
        return int(text.split()[0])
    except (ValueError, IndexError):  # "max", empty: no number, no limit
        return None


def _stat_value(path: Path, key: str) -> int:
    for line in (_read_small(path) or "").splitlines():
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value)
    return 0


def _own_cgroup_paths(proc_self_cgroup: Path) -> dict[str, str]:
    """This process's cgroup path per controller ("" for the v2 hierarchy)."""
    paths: dict[str, str] = {}
    for line in (_read_small(proc_self_cgroup) or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        for controller in parts[1].split(",") if parts[1] else [""]:
            paths[controller] = parts[2].strip()
    return paths


def _dirs_up(mount: Path, cgroup_path: str) -> list[Path]:
    """The cgroup's directory and each ancestor's up to ``mount``, those that exist.

    Inside a container the mount is the container's own cgroup, while /proc/self/cgroup
    may still name the host's path: that path then does not exist, and the mount's own
    files are the container's limits."""
    parts = [p for p in cgroup_path.split("/") if p and p not in (".", "..")]
    dirs = [mount.joinpath(*parts[:depth]) for depth in range(len(parts), -1, -1)]
    return [d for d in dirs if d.is_dir()]


def _tightest(dirs: list[Path], limit_file: str) -> tuple[int, Path] | None:
    """The lowest memory limit on the way up (a parent's limit binds its children)."""
    found: tuple[int, Path] | None = None
    for directory in dirs:
        value = _read_int(directory / limit_file)
        if value is not None and 0 < value < _NO_LIMIT_ABOVE \
                and (found is None or value < found[0]):
            found = (value, directory)
    return found


def _cpu_v2(dirs: list[Path]) -> float | None:
    cores = None
    for directory in dirs:
        quota, _, period = (_read_small(directory / "cpu.max") or "").partition(" ")
        if quota.strip().isdigit() and period.strip().isdigit() and int(period) > 0:
            here = int(quota) / int(period)
            cores = here if cores is None else min(cores, here)
    return cores


def _cpu_v1(dirs: list[Path]) -> float | None:
    cores = None
    for directory in dirs:
        quota = _read_int(directory / "cpu.cfs_quota_us")
        period = _read_int(directory / "cpu.cfs_period_us")
        if quota is not None and quota > 0 and period:  # -1: no quota
            cores = quota / period if cores is None else min(cores, quota / period)
    return cores


def _used(memory: tuple[int, Path] | None, usage_file: str, inactive_key: str) -> int | None:
    """What the cgroup holding the tightest memory limit uses, less reclaimable page cache
    (``inactive_key`` in its ``memory.stat``); None without a limit or a reading."""
    if memory is None:
        return None
    usage = _read_int(memory[1] / usage_file)
    if usage is None:
        return None
    return max(0, usage - _stat_value(memory[1] / "memory.stat", inactive_key))


def read_cgroup_limits(root: str | Path = CGROUP_ROOT,
                       proc_self_cgroup: str | Path = PROC_SELF_CGROUP) -> CgroupLimits:
    """This process's memory and CPU limits from cgroup v2 (``memory.max``, ``cpu.max``)
    or v1 (``memory.limit_in_bytes``, ``cpu.cfs_quota_us``); no limit where none is set
    or nothing can be read. ``root`` is where cgroups are mounted (a test hands in a
    fake tree)."""
    root = Path(root)
    paths = _own_cgroup_paths(Path(proc_self_cgroup))
    if (root / "cgroup.controllers").exists():  # v2: one unified hierarchy
        dirs = _dirs_up(root, paths.get("", ""))
        memory = _tightest(dirs, "memory.max")
        used = _used(memory, "memory.current", "inactive_file")
        cores = _cpu_v2(dirs)
        return CgroupLimits(memory_limit_bytes=memory[0] if memory else None,
                            memory_used_bytes=used,
                            memory_from="cgroup memory.max" if memory else "",
                            cpu_limit_cores=cores,
                            cpu_from="" if cores is None else "cgroup cpu.max")
    memory_dirs = _dirs_up(root / "memory", paths.get("memory", ""))  # v1: one per controller
    memory = _tightest(memory_dirs, "memory.limit_in_bytes")
    used = _used(memory, "memory.usage_in_bytes", "total_inactive_file")
    cpu_mount = next((root / name for name in ("cpu,cpuacct", "cpu") if (root / name).is_dir()),
                     root / "cpu")
    cores = _cpu_v1(_dirs_up(cpu_mount, paths.get("cpu", "")))
    return CgroupLimits(memory_limit_bytes=memory[0] if memory else None, memory_used_bytes=used,
                        memory_from="cgroup memory.limit_in_bytes" if memory else "",
                        cpu_limit_cores=cores,
                        cpu_from="" if cores is None else "cgroup cpu.cfs_quota_us")


def cpu_threads(limits: CgroupLimits) -> int | None:
    """Compute threads for a CPU quota (1.5 CPUs: 2), or None where there is no quota."""
    if limits.cpu_limit_cores is None:
        return None
    return max(1, math.ceil(limits.cpu_limit_cores))


# --- the CPU and its RAM ---------------------------------------------------------------


class CpuCardSource:
    """The CPU as one card: total and available RAM (psutil), within the cgroup's memory
    limit (a container's ``--memory``, a unit's ``MemoryMax``) when that is lower, and
    capped by ``--cpu-memory``.

    A capped CPU is offered as a card of the cap's size, so the plan's bar shows what
    p2pswarm may use rather than RAM it was told to leave alone. Free memory inside a
    cgroup is the limit less what the cgroup holds (it counts every process in the
    container), never more than the host has free. The card says where its size came
    from (``memory_source``), and ``status`` shows it.
    """

    def __init__(self, psutil_module: Any = None, cap_bytes: int | None = None,
                 name: str | None = None,
                 cgroup_reader: Callable[[], CgroupLimits] | None = read_cgroup_limits) -> None:
        self._psutil = psutil_module
        self._cap_bytes = cap_bytes
        self._name = name
        self._cgroup_reader = cgroup_reader
        self._said_limits: tuple[int | None, float | None] = (None, None)

    def read(self) -> tuple[Card, ...]:
        if self._psutil is None:
            import psutil
            self._psutil = psutil
        memory = self._psutil.virtual_memory()
        total, free = int(memory.total), int(memory.available)
        source = "/proc/meminfo"
        limits = self._cgroup_reader() if self._cgroup_reader is not None else CgroupLimits()
        limit = limits.memory_limit_bytes
        if limit is not None and limit < total:
            total, source = limit, limits.memory_from
            used = limits.memory_used_bytes or 0
            free = min(free, max(0, limit - used))
        if self._cap_bytes is not None and self._cap_bytes < total:
            source = "--cpu-memory"
        if self._cap_bytes is not None:
            total, free = min(total, self._cap_bytes), min(free, self._cap_bytes)
        self._say_limits(limits)
        name = self._name or _cpu_name()
        uuid = f"cpu-{platform.node()}-{os.cpu_count() or 0}"
        return (Card(index=0, kind="cpu", name=name, uuid=uuid, total_bytes=total,
                     free_bytes=free, memory_source=source),)

    def _say_limits(self, limits: CgroupLimits) -> None:
        """One log line when a cgroup limit is first seen, and again if it changes."""
        said = (limits.memory_limit_bytes, limits.cpu_limit_cores)
        if said == (None, None) or said == self._said_limits:
            return
        self._said_limits = said
        memory = ("no memory limit" if limits.memory_limit_bytes is None else
                  f"{limits.memory_limit_bytes / 1e9:.1f} GB by {limits.memory_from}")
        cpu = ("no CPU quota" if limits.cpu_limit_cores is None else
               f"{limits.cpu_limit_cores:g} CPUs by {limits.cpu_from}")
        log.info("this fellow runs in a cgroup: %s, %s", memory, cpu)


@dataclass(slots=True)
class FakeCardSource:
    """Cards given by a test or a simulation; assign ``cards`` to change what it offers."""

    cards: tuple[Card, ...] = ()

    def read(self) -> tuple[Card, ...]:
        return tuple(self.cards)


@dataclass(slots=True)
class CombinedCardSource:
    """Several sources read as one (the GPUs, then the CPU)."""

    sources: tuple[CardSource, ...] = field(default_factory=tuple)

    def read(self) -> tuple[Card, ...]:
        cards: list[Card] = []
        for source in self.sources:
            cards.extend(source.read())
        return tuple(cards)


def local_card_source(gpus: str | None = None, cpu_memory: str | None = None,
                      no_cpu: bool = False, own_pids: Iterable[int] | None = None,
                      nvml_module: Any = None, psutil_module: Any = None,
                      cgroup_reader: Callable[[], CgroupLimits] | None = read_cgroup_limits,
                      ) -> CombinedCardSource:
    """The source ``join``/``cards`` use, built from their options (ConfigError if bad)."""
    if no_cpu and cpu_memory is not None:
        raise ConfigError("--no-cpu and --cpu-memory contradict each other: drop one of them")
    selected = None if gpus is None else parse_gpu_list(gpus)
    sources: list[CardSource] = []
    if selected != ():
        sources.append(NvmlCardSource(nvml_module=nvml_module, own_pids=own_pids, gpus=selected))
    if not no_cpu:
        cap = None if cpu_memory is None else parse_size(cpu_memory)
        sources.append(CpuCardSource(psutil_module=psutil_module, cap_bytes=cap,
                                     cgroup_reader=cgroup_reader))
    return CombinedCardSource(tuple(sources))


def read_inventory(source: CardSource) -> Inventory:
    return Inventory(cards=source.read())


# --- gossip rule -----------------------------------------------------------------------


def _layout(inventory: Inventory) -> list[tuple[str, str, str, int]]:
    return [(c.key, c.name, c.uuid, c.total_bytes) for c in inventory.cards]


def _moves(old: Inventory, new: Inventory) -> list[tuple[int, int]]:
    """(bytes moved, the card's total) for each card's free memory and each program's
    holding on it; a program that comes or goes moves its bytes from or to zero."""
    out = []
    for before, after in zip(old.cards, new.cards):
        out.append((abs(before.free_bytes - after.free_bytes), after.total_bytes))
        held_before = {(h.pid, h.name): h.held_bytes for h in before.held_by_others}
        held_after = {(h.pid, h.name): h.held_bytes for h in after.held_by_others}
        for holder in sorted(held_before.keys() | held_after.keys()):
            out.append((abs(held_before.get(holder, 0) - held_after.get(holder, 0)),
                        after.total_bytes))
    return out


def changed_enough(old: Inventory | None, new: Inventory, step_bytes: int,
                   step_fraction: float = 0.0) -> bool:
    """Whether ``new`` differs materially from the inventory last gossiped: a card came,
    went or changed, or memory moved by more than ``max(step_bytes, step_fraction x the
    card's total)``.

    Compare against the last *gossiped* inventory, not the last read one, or a slow
    drift of many small steps would never be announced.
    """
    if old is None or _layout(old) != _layout(new):
        return True
    return any(moved > max(step_bytes, int(step_fraction * total))
               for moved, total in _moves(old, new))


@dataclass(slots=True)
class GossipRule:
    """When a fellow's cards are news (hysteresis, so that an idle swarm stays quiet).

    - a card appearing, going, or changing its name, uuid or total: at once;
    - memory that moved past the band (``changed_enough`` with the step and fraction)
      and stayed past it for ``settle_reads`` reads in a row: a program that started;
      one read past it and back is a spike, and not news;
    - memory that moved past ``urgent_fraction`` of the card: at once.

    The band is around the value last *gossiped*, so a drift is announced once it adds
    up, and the value then announced is the new centre. ``decide`` is called once per
    read with the last gossiped inventory and the one just read.
    """

    step_bytes: int
    step_fraction: float = 0.0
    settle_reads: int = 1
    urgent_fraction: float = 0.0
    pending_reads: int = 0  # reads in a row that were past the band

    def decide(self, gossiped: Inventory | None, read: Inventory) -> bool:
        """Whether to gossip ``read`` now."""
        if gossiped is None or _layout(gossiped) != _layout(read):
            self.pending_reads = 0
            return True
        if not changed_enough(gossiped, read, self.step_bytes, self.step_fraction):
            self.pending_reads = 0
            return False
        self.pending_reads += 1
        urgent = self.urgent_fraction > 0 and any(
            moved > self.urgent_fraction * total for moved, total in _moves(gossiped, read))
        if urgent or self.pending_reads >= self.settle_reads:
            self.pending_reads = 0
            return True
        return False


__all__ = [
    "CardSource",
    "CgroupLimits",
    "CombinedCardSource",
    "CpuCardSource",
    "FakeCardSource",
    "GossipRule",
    "NvmlCardSource",
    "changed_enough",
    "cpu_threads",
    "local_card_source",
    "parse_gpu_list",
    "read_cgroup_limits",
    "read_inventory",
]
