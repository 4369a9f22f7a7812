"""When a fellow tells the swarm its cards again: the gossip rule (band, settle, urgent),
an idle swarm that stays quiet under RAM noise, and benchmarks picked up from disk."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import trio

from p2pswarm.agent import Agent
from p2pswarm.agent.world import AgentWorld
from p2pswarm.bench import BenchmarkCache
from p2pswarm.cards import Benchmark, Card, Inventory, fingerprint
from p2pswarm.config import InventoryConfig, local
from p2pswarm.inventory import FakeCardSource, GossipRule
from p2pswarm.security import Identity, Keyring, SwarmSecret
from p2pswarm.sim.virtual import VirtualSwarm, cpu_card, wait_until
from p2pswarm.transport.memory import MemoryNetwork

GB = 10**9
MB = 10**6
CARD_GB = 16.0


def inventory(free_gb: float, *, extra: bool = False) -> Inventory:
    cards = [cpu_card(CARD_GB, free_gb=free_gb)]
    if extra:
        cards.append(Card(index=0, kind="cuda", name="GPU", uuid="g0", total_bytes=8 * GB,
                          free_bytes=8 * GB))
    return Inventory(tuple(cards))


def rule() -> GossipRule:
    config = InventoryConfig()
    return GossipRule(config.gossip_step_bytes, config.gossip_step_fraction,
                      config.gossip_settle_reads, config.gossip_urgent_fraction)


def test_a_move_inside_the_band_is_never_news() -> None:
    r, gossiped = rule(), inventory(12.0)
    band = CARD_GB * GB / 16  # 1 GB on a 16 GB card
    for free in (12.0 + band / GB * 0.99, 12.0 - band / GB * 0.99, 12.3, 11.5) * 5:
        assert not r.decide(gossiped, inventory(free))


def test_a_spike_is_not_news_a_settled_move_is() -> None:
    r, gossiped = rule(), inventory(12.0)
    assert not r.decide(gossiped, inventory(10.5))  # one read 1.5 GB down
    assert not r.decide(gossiped, inventory(12.1))  # and back: a spike
    assert not r.decide(gossiped, inventory(10.5))  # down again: the first read of it
    assert r.decide(gossiped, inventory(10.4))  # still down on the next: news


def test_a_large_move_or_a_card_coming_is_news_at_once() -> None:
    assert rule().decide(inventory(12.0), inventory(7.0))  # more than a quarter of the card
    assert rule().decide(inventory(12.0), inventory(12.0, extra=True))
    assert rule().decide(inventory(12.0, extra=True), inventory(12.0))
    assert rule().decide(None, inventory(12.0))


def test_a_slow_drift_is_announced_once_it_adds_up() -> None:
    r, gossiped, free, said = rule(), inventory(12.0), 12.0, 0
    for _ in range(40):  # 100 MB a read, always the same way
        free -= 0.1
        if r.decide(gossiped, inventory(free)):
            said += 1
            gossiped = inventory(free)  # the new centre of the band
    assert 2 <= said <= 4  # 4 GB drifted: a few announcements, not forty


class Wandering:
    """A 16 GB CPU whose free memory wanders by a few hundred MB around 12 GB."""

    def __init__(self, rng: random.Random, name: str) -> None:
        self.rng, self.name, self.free, self.drop = rng, name, 12.0 * GB, 0

    def read(self) -> tuple[Card, ...]:
        self.free += self.rng.gauss(0, 96 * MB) - 0.1 * (self.free - 12 * GB)
        free = int(self.free) - self.drop
        return (cpu_card(CARD_GB, free_gb=free / GB, name=self.name),)


async def test_an_idle_swarm_stays_quiet_under_ram_noise(autojump_clock) -> None:
    swarm = VirtualSwarm(3, seed=7)
    sources = [Wandering(random.Random(i), f"{f.name} CPU") for i, f in enumerate(swarm.fellows)]
    for fellow, source in zip(swarm.fellows, sources):
        fellow.cards = source  # type: ignore[assignment]
    async with trio.open_nursery() as nursery:
        await nursery.start(swarm.run)
        for i in range(3):
            await swarm.start(i)
        await wait_until(swarm.converged, timeout_s=60)
        # six idle minutes: 72 reads of each fellow's RAM (the old rule, any 64 MiB move,
        # republished about six times a minute under this noise)
        await trio.sleep(6 * 60.0)
        assert [a.card_news.published for a in swarm.live()] == [0, 0, 0]
        # a real change (a program took 3 GB) reaches every fellow's view within seconds
        sources[2].drop = 3 * GB
        began = trio.current_time()
        name = swarm.fellows[2].name

        def everyone_sees_it() -> bool:
            return all(c.free_bytes < 10 * GB for a in swarm.live()
                       for f in a.planning.view().fellows if f.name == name for c in f.cards)

        await wait_until(everyone_sees_it, timeout_s=60)
        assert trio.current_time() - began <= 3 * swarm.config.inventory.refresh_interval_s
        assert swarm.live()[2].card_news.published == 1
        nursery.cancel_scope.cancel()


def lone_agent(home: Path, source: FakeCardSource) -> Agent:
    net = MemoryNetwork(seed=1)
    return Agent(AgentWorld(
        name="solo", transport=net.transport("10.0.0.1:7946"),
        keyring=Keyring([SwarmSecret(bytes(32))]),
        identity=Identity.from_private_bytes(bytes(range(32))),
        config=replace(local(), inventory=InventoryConfig()), epoch=1,
        rng=random.Random(1), home=home, card_source=source))


def test_benchmarks_written_by_bench_are_gossiped_without_a_restart(tmp_path: Path) -> None:
    card = cpu_card(CARD_GB, free_gb=12.0)
    agent = lone_agent(tmp_path, FakeCardSource((card,)))
    agent.card_news.start()
    assert not agent.card_news.refresh()  # nothing changed: no news
    measured = Benchmark(flops=5e11, mem_bandwidth=2e10, dtype="f32", measured=True,
                         fingerprint=fingerprint(card))
    BenchmarkCache(tmp_path).save({fingerprint(card): measured})  # what `bench` writes
    assert agent.card_news.refresh()
    assert agent.extra_metadata["benchmarks"]["cards"]["cpu:0"]["flops"] == 5e11
    assert not agent.card_news.refresh()  # read once, not at every refresh
