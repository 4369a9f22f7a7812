"""What this fellow tells the swarm about its cards and their speed, and when.

Theory of operation. Every ``refresh_interval_s`` the agent reads its cards. What it
gossiped last is the reference, in two parts:

- the machine's own memory, judged by ``GossipRule`` (``p2pswarm.inventory``): a card
  that came, went or changed is news at once; free memory (or another program's
  holding) is news once it has moved past a band around the value last gossiped and
  stayed there for a few reads, or at once when it moved by a large share of the card;
- what this fellow's own stages hold (``Serving.less_live_stages``): it changes only when
  a stage loads or unloads, which every later plan must see, so it is news at once.

An idle swarm therefore republishes nothing while free RAM wanders by a few hundred MB
(``simulations/bench_idle_gossip.py`` measures it), and a plan still sees every change
that could decide whether something fits.

The benchmark cache ``p2pswarm bench`` writes (``benchmarks.json`` in the state
directory) is watched as well: when the file changed, the speeds are read again and
gossiped, so measuring on a machine whose agent runs takes effect without a restart.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from p2pswarm.bench import BenchmarkCache
from p2pswarm.cards import Benchmark, Card, Inventory, benchmarks_to_dict, fingerprint
from p2pswarm.errors import ConfigError, SwarmError
from p2pswarm.inventory import CardSource, GossipRule, read_inventory

if TYPE_CHECKING:
    from p2pswarm.agent.ports import Publishes
    from p2pswarm.config import InventoryConfig

log = logging.getLogger("p2pswarm.agent")

Stamp = tuple[int, int] | None  # (mtime ns, size) of the benchmark cache; None: no file
# the cards as offered: less what this fellow's own stages hold (Serving.less_live_stages)
Offered = Callable[[tuple[Card, ...]], tuple[Card, ...]]


def cached_benchmarks(home: Path, inventory: Inventory | None) -> dict[str, Benchmark]:
    """The measured speeds of this fellow's cards (``p2pswarm bench``), by card key
    (``benchmarks_to_dict`` gives their gossip form).

    Cards never measured are left out: the planner then uses its conservative estimate
    and says so, rather than gossiping a guess as if it were a measurement.
    """
    if inventory is None:
        return {}
    try:
        cached = BenchmarkCache(home).load()
    except ConfigError as exc:
        log.warning("%s", exc)
        return {}
    return {card.key: cached[fingerprint(card)] for card in inventory.cards
            if fingerprint(card) in cached}


def _stamp(path: Path) -> Stamp:
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size)


def _own_bytes(raw: Inventory, offered: Inventory) -> tuple[int, ...]:
    return tuple(a.free_bytes - b.free_bytes for a, b in zip(raw.cards, offered.cards))


class CardNews:
    """Reads this fellow's cards now and then and gossips them when they are news."""

    def __init__(self, says: Publishes, name: str, config: InventoryConfig,
                 home: Path | None, card_source: CardSource | None, offered: Offered) -> None:
        self.says = says  # where the benchmarks go, and who gossips them
        self.name = name
        self.config = config
        self.card_source = card_source
        self.offered = offered
        self.rule = GossipRule(config.gossip_step_bytes, config.gossip_step_fraction,
                               config.gossip_settle_reads, config.gossip_urgent_fraction)
        self.inventory: Inventory | None = None  # the cards as last read (as offered)
        self.gossiped_inventory: Inventory | None = None  # ... as last told the swarm
        self._gossiped_raw: Inventory | None = None  # the machine's cards, as last gossiped
        self._gossiped_own: tuple[int, ...] = ()  # what our stages held, as last gossiped
        self._bench_path = None if home is None else BenchmarkCache(home).path
        self._bench_stamp: Stamp = None
        self.published = 0  # times the cards were gossiped again (for status and tests)

    def _read(self) -> tuple[Inventory, Inventory] | None:
        """(the machine's cards, the cards as offered: less what our stages hold)."""
        if self.card_source is None:
            return None
        try:
            raw = read_inventory(self.card_source)
        except (SwarmError, OSError) as exc:  # OSError: /proc unreadable, out of descriptors
            log.warning("reading cards failed: %s; keeping the last reading", exc)
            return None
        offered = dataclasses.replace(raw, cards=self.offered(tuple(raw.cards)))
        return raw, offered

    def start(self) -> None:
        """The first read, gossiped from the start."""
        read = self._read()
        if read is not None:
            raw, offered = read
            self._gossiped_raw, self._gossiped_own = raw, _own_bytes(raw, offered)
            self.inventory = self.gossiped_inventory = offered
        if self._bench_path is not None:
            self._bench_stamp = _stamp(self._bench_path)

    def refresh(self) -> bool:
        """Read the cards (and look at the benchmark cache); gossip them when they are
        news. Whether they were gossiped."""
        read = self._read()
        if read is None:
            return False
        raw, offered = read
        self.inventory = offered
        own = _own_bytes(raw, offered)
        news = self.rule.decide(self._gossiped_raw, raw) or own != self._gossiped_own
        if self._bench_path is not None:
            stamp = _stamp(self._bench_path)
            if stamp != self._bench_stamp:
                self._bench_stamp = stamp
                self.says.extra_metadata["benchmarks"] = benchmarks_to_dict(
                    cached_benchmarks(self._bench_path.parent, offered))
                log.info("%s: benchmarks changed on disk; gossiping them", self.name)
                news = True
        if not news:
            return False
        self._gossiped_raw, self._gossiped_own = raw, own
        self.gossiped_inventory = offered
        self.published += 1
        self.says.publish_metadata()
        return True

    async def run(self) -> None:
        while True:
            await trio.sleep(self.config.refresh_interval_s)
            self.refresh()


__all__ = ["CardNews", "cached_benchmarks"]
