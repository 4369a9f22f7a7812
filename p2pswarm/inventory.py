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
import os
import platform
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
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
                    held_by_others=tuple(holders))


# --- the CPU and its RAM ---------------------------------------------------------------


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


class CpuCardSource:
    """The CPU as one card: total and available RAM (psutil), capped by ``--cpu-memory``.

    A capped CPU is offered as a card of the cap's size, so the plan's bar shows what
    p2pswarm may use rather than RAM it was told to leave alone.
    """

    def __init__(self, psutil_module: Any = None, cap_bytes: int | None = None,
                 name: str | None = None) -> None:
        self._psutil = psutil_module
        self._cap_bytes = cap_bytes
        self._name = name

    def read(self) -> tuple[Card, ...]:
        if self._psutil is None:
            import psutil
            self._psutil = psutil
        memory = self._psutil.virtual_memory()
        total, free = int(memory.total), int(memory.available)
        if self._cap_bytes is not None:
            total, free = min(total, self._cap_bytes), min(free, self._cap_bytes)
        name = self._name or _cpu_name()
        uuid = f"cpu-{platform.node()}-{os.cpu_count() or 0}"
        return (Card(index=0, kind="cpu", name=name, uuid=uuid, total_bytes=total,
                     free_bytes=free),)


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
                      nvml_module: Any = None, psutil_module: Any = None) -> CombinedCardSource:
    """The source ``join``/``cards`` use, built from their options (ConfigError if bad)."""
    if no_cpu and cpu_memory is not None:
        raise ConfigError("--no-cpu and --cpu-memory contradict each other: drop one of them")
    selected = None if gpus is None else parse_gpu_list(gpus)
    sources: list[CardSource] = []
    if selected != ():
        sources.append(NvmlCardSource(nvml_module=nvml_module, own_pids=own_pids, gpus=selected))
    if not no_cpu:
        cap = None if cpu_memory is None else parse_size(cpu_memory)
        sources.append(CpuCardSource(psutil_module=psutil_module, cap_bytes=cap))
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
    "CombinedCardSource",
    "CpuCardSource",
    "FakeCardSource",
    "GossipRule",
    "NvmlCardSource",
    "changed_enough",
    "local_card_source",
    "parse_gpu_list",
    "read_inventory",
]
