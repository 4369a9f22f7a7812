"""Cards through the seam: a fake NVML, a fake psutil, sizes, the gossip rule."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from p2pswarm.cards import Card, Holder, Inventory, parse_size
from p2pswarm.errors import ConfigError
from p2pswarm.inventory import (
    CpuCardSource,
    FakeCardSource,
    NvmlCardSource,
    changed_enough,
    local_card_source,
    parse_gpu_list,
    read_inventory,
)

GB = 10**9
GiB = 2**30


class FakeNVMLError(Exception):
    pass


@dataclass
class FakeGpu:
    name: str
    uuid: str
    total: int
    free: int
    compute: list[tuple[int, int | None]] = field(default_factory=list)  # (pid, bytes)
    graphics: list[tuple[int, int | None]] = field(default_factory=list)
    broken: bool = False


class FakeNvml:
    """Shaped like pynvml (nvidia-ml-py): handles, memory info, processes, names."""

    NVMLError = FakeNVMLError

    def __init__(self, gpus: list[FakeGpu], names: dict[int, str] | None = None,
                 driver: bool = True, bytes_names: bool = False) -> None:
        self.gpus = gpus
        self.names = names or {}
        self.driver = driver
        self.bytes_names = bytes_names
        self.inits = 0
        self.shutdowns = 0

    def nvmlInit(self) -> None:
        if not self.driver:
            raise FakeNVMLError("Driver Not Loaded")
        self.inits += 1

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeGpu:
        return self.gpus[index]

    def nvmlDeviceGetName(self, handle: FakeGpu) -> str | bytes:
        if handle.broken:
            raise FakeNVMLError("GPU is lost")
        return handle.name.encode() if self.bytes_names else handle.name

    def nvmlDeviceGetUUID(self, handle: FakeGpu) -> str:
        return handle.uuid

    def nvmlDeviceGetMemoryInfo(self, handle: FakeGpu) -> SimpleNamespace:
        if handle.broken:
            raise FakeNVMLError("GPU is lost")
        return SimpleNamespace(total=handle.total, free=handle.free,
                               used=handle.total - handle.free)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: FakeGpu) -> list[SimpleNamespace]:
        return [SimpleNamespace(pid=p, usedGpuMemory=b) for p, b in handle.compute]

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: FakeGpu) -> list[SimpleNamespace]:
        return [SimpleNamespace(pid=p, usedGpuMemory=b) for p, b in handle.graphics]

    def nvmlSystemGetProcessName(self, pid: int) -> str | bytes:
        if pid not in self.names:
            raise FakeNVMLError("Not Found")
        return self.names[pid].encode() if self.bytes_names else self.names[pid]


def fake_psutil(total: int, available: int) -> SimpleNamespace:
    return SimpleNamespace(virtual_memory=lambda: SimpleNamespace(total=total,
                                                                  available=available))


def two_gpus() -> FakeNvml:
    return FakeNvml(
        [FakeGpu("NVIDIA GeForce RTX 3090", "GPU-aaaa", 24 * GiB, 0 * GiB + 300_000_000,
                 compute=[(4242, 23_400_000_000)], graphics=[(1312, 60_000_000)]),
         FakeGpu("NVIDIA GeForce GTX 1050 Ti", "GPU-bbbb", 4 * GiB, 2 * GiB,
                 compute=[(777, 1 * GiB)])],
        names={4242: "/app/llama-server", 1312: "/usr/lib/xorg/Xorg", 777: "p2pswarm"},
    )


def test_fake_nvml_two_gpus_and_a_foreign_process() -> None:
    nvml = two_gpus()
    cards = NvmlCardSource(nvml_module=nvml, own_pids={777}).read()
    assert [c.key for c in cards] == ["cuda:0", "cuda:1"]
    big, small = cards
    assert (big.name, big.uuid, big.total_bytes, big.free_bytes) == \
        ("NVIDIA GeForce RTX 3090", "GPU-aaaa", 24 * GiB, 300_000_000)
    assert big.held_by_others == (Holder(4242, "/app/llama-server", 23_400_000_000),
                                  Holder(1312, "/usr/lib/xorg/Xorg", 60_000_000))
    # this agent's own 1 GiB is free for p2pswarm, not "another program"
    assert small.held_by_others == ()
    assert small.free_bytes == 3 * GiB
    assert nvml.inits == 1


def test_process_in_both_lists_counts_once_and_unknown_names_use_the_pid() -> None:
    nvml = FakeNvml([FakeGpu("GPU", "GPU-c", 8 * GB, 4 * GB, compute=[(5, 2 * GB), (6, None)],
                             graphics=[(5, 2 * GB)])], names={}, bytes_names=True)
    (card,) = NvmlCardSource(nvml_module=nvml, own_pids=()).read()
    assert card.held_by_others == (Holder(5, "pid 5", 2 * GB), Holder(6, "pid 6", 0))


def test_bytes_names_are_decoded() -> None:
    nvml = FakeNvml([FakeGpu("GTX 1050 Ti", "GPU-d", 4 * GB, 3 * GB, compute=[(9, GB)])],
                    names={9: "/usr/bin/python3"}, bytes_names=True)
    (card,) = NvmlCardSource(nvml_module=nvml, own_pids=()).read()
    assert card.name == "GTX 1050 Ti"
    assert card.held_by_others[0].name == "/usr/bin/python3"


def test_gpu_selection_and_a_lost_gpu(caplog: pytest.LogCaptureFixture) -> None:
    nvml = two_gpus()
    assert [c.index for c in NvmlCardSource(nvml, own_pids=(), gpus=[1]).read()] == [1]
    assert NvmlCardSource(two_gpus(), own_pids=(), gpus=[]).read() == ()
    nvml.gpus[0].broken = True
    with caplog.at_level(logging.WARNING):
        cards = NvmlCardSource(nvml, own_pids=(), gpus=[0, 1, 5]).read()
    assert [c.index for c in cards] == [1]
    assert "GPU 0 could not be read" in caplog.text
    assert "--gpus names GPU 5" in caplog.text


def test_no_driver_means_cpu_only_with_one_log_line(caplog: pytest.LogCaptureFixture) -> None:
    nvml = FakeNvml([], driver=False)
    source = local_card_source(nvml_module=nvml, psutil_module=fake_psutil(16 * GB, 9 * GB),
                               cgroup_reader=None)
    with caplog.at_level(logging.INFO, logger="p2pswarm.inventory"):
        first = read_inventory(source)
        second = read_inventory(source)
    assert first == second
    assert [c.key for c in first.cards] == ["cpu:0"]
    assert first.cards[0].total_bytes == 16 * GB and first.cards[0].free_bytes == 9 * GB
    assert sum("no NVIDIA driver" in r.message for r in caplog.records) == 1


def test_real_pynvml_without_a_driver_does_not_crash() -> None:
    pynvml = pytest.importorskip("pynvml")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        assert NvmlCardSource(own_pids=()).read() == ()
    else:  # a machine with a driver: the real source reads real cards
        pynvml.nvmlShutdown()
        cards = NvmlCardSource().read()
        assert all(c.kind == "cuda" and 0 <= c.free_bytes <= c.total_bytes for c in cards)


def test_cpu_cap_and_no_cpu() -> None:
    capped = CpuCardSource(psutil_module=fake_psutil(16 * GB, 10 * GB), cap_bytes=6 * GB,
                           name="Intel Core i7", cgroup_reader=None).read()
    assert (capped[0].total_bytes, capped[0].free_bytes, capped[0].name) == \
        (6 * GB, 6 * GB, "Intel Core i7")
    tight = CpuCardSource(psutil_module=fake_psutil(16 * GB, 2 * GB), cap_bytes=6 * GB,
                          cgroup_reader=None).read()
    assert (tight[0].total_bytes, tight[0].free_bytes) == (6 * GB, 2 * GB)
    source = local_card_source(gpus="none", no_cpu=True)
    assert source.read() == ()
    with pytest.raises(ConfigError, match="contradict"):
        local_card_source(no_cpu=True, cpu_memory="6GB")
    with_cap = local_card_source(gpus="none", cpu_memory="6GB",
                                 psutil_module=fake_psutil(16 * GB, 10 * GB), cgroup_reader=None)
    assert with_cap.read()[0].total_bytes == 6 * GB


@pytest.mark.parametrize("text, expected", [
    ("6GB", 6 * 10**9), ("6gb", 6 * 10**9), ("1.5GB", 1_500_000_000), ("512MiB", 512 * 2**20),
    ("4096", 4096), ("2 GiB", 2 * 2**30), ("64MB", 64 * 10**6), ("1TB", 10**12), ("8G", 8 * 10**9),
])
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GB", "6XB", "-1GB", "0", "0GB", "six GB", "1e9"])
def test_parse_size_refuses_with_how_to_fix(text: str) -> None:
    with pytest.raises(ConfigError, match="e.g."):
        parse_size(text)


def test_parse_gpu_list() -> None:
    assert parse_gpu_list("0,2") == (0, 2)
    assert parse_gpu_list("2, 0,2") == (0, 2)
    assert parse_gpu_list("none") == ()
    with pytest.raises(ConfigError, match="e.g. 0,2"):
        parse_gpu_list("zero")


def card(free: int, held: tuple[Holder, ...] = (), index: int = 0, kind: str = "cuda") -> Card:
    return Card(index=index, kind=kind, name="GPU", uuid=f"u{index}", total_bytes=24 * GB,
                free_bytes=free, held_by_others=held)


STEP = 64 * 2**20


@pytest.mark.parametrize("old, new, expected", [
    (None, Inventory((card(10 * GB),)), True),
    (Inventory((card(10 * GB),)), Inventory((card(10 * GB + STEP),)), False),
    (Inventory((card(10 * GB),)), Inventory((card(10 * GB + STEP + 1),)), True),
    (Inventory((card(10 * GB),)), Inventory((card(10 * GB - STEP - 1),)), True),
    (Inventory((card(10 * GB),)), Inventory((card(10 * GB), card(5 * GB, index=1))), True),
    (Inventory((card(10 * GB),)), Inventory((card(10 * GB, (Holder(1, "x", 1000),)),)), False),
    (Inventory((card(10 * GB),)), Inventory((card(10 * GB, (Holder(1, "x", 2 * GB),)),)), True),
])
def test_changed_enough(old: Inventory | None, new: Inventory, expected: bool) -> None:
    assert changed_enough(old, new, STEP) is expected


@given(st.integers(0, 20 * GB), st.integers(-STEP * 3, STEP * 3))
def test_changed_enough_is_exactly_the_step(free: int, move: int) -> None:
    old = Inventory((card(free),))
    new = Inventory((card(free + move),))
    assert changed_enough(old, new, STEP) is (abs(move) > STEP)


holders = st.builds(Holder, pid=st.integers(1, 10**6), name=st.text(max_size=20),
                    held_bytes=st.integers(0, 80 * GB))
cards = st.builds(Card, index=st.integers(0, 7), kind=st.sampled_from(["cuda", "cpu"]),
                  name=st.text(max_size=20), uuid=st.text(max_size=20),
                  total_bytes=st.integers(1, 80 * GB), free_bytes=st.integers(0, 80 * GB),
                  held_by_others=st.lists(holders, max_size=3).map(
                      lambda hs: tuple(sorted(hs, key=lambda h: (-h.held_bytes, h.pid, h.name)))))


@given(st.lists(cards, max_size=5))
def test_inventory_dict_round_trip_and_canonical_order(items: list[Card]) -> None:
    unique = list({(c.kind, c.index): c for c in items}.values())
    inventory = Inventory(tuple(unique))
    assert Inventory.from_dict(inventory.to_dict()) == inventory
    assert Inventory(tuple(reversed(unique))) == inventory


def test_fake_source_can_change_between_reads() -> None:
    source = FakeCardSource((card(10 * GB),))
    before = read_inventory(source)
    source.cards = (replace(card(10 * GB), free_bytes=1 * GB),)
    assert read_inventory(source).cards[0].free_bytes == 1 * GB
    assert before.cards[0].free_bytes == 10 * GB


def test_card_from_dict_refuses_unknown_kind() -> None:
    with pytest.raises(ConfigError, match="cuda, cpu"):
        Card.from_dict({"kind": "tpu", "total_bytes": 1, "free_bytes": 1})
