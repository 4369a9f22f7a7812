"""Idle gossip per fellow: real agents in virtual time whose free RAM wanders as an idle
laptop's does, and the bytes each sends per second once the swarm has settled.

    python simulations/bench_idle_gossip.py                  # 10 fellows, 10 virtual minutes
    python simulations/bench_idle_gossip.py --rule step64    # the old rule: any 64 MiB move
    python simulations/bench_idle_gossip.py --quiet          # no RAM noise at all
    python simulations/bench_idle_gossip.py --fellows 8 --churn 20   # one fellow crashed
                                             # and restarted every 20 s, the rest measured

Each fellow offers one 16 GB CPU card. Every inventory read, its free memory takes a
random step (normal, 96 MB standard deviation) and is pulled back toward 12 GB, so it
wanders a few hundred MB either way, with now and then a 600 MB spike for one read (a
program that starts and exits). Prints bytes and datagrams per fellow per second after a
minute of warm-up, and how many times each fellow republished its cards. Seeded: the
same arguments print the same figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import sys
from pathlib import Path

import trio
import trio.testing

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from p2pswarm.cards import Card  # noqa: E402
from p2pswarm.config import InventoryConfig, local  # noqa: E402
from p2pswarm.sim.virtual import VirtualSwarm, wait_until  # noqa: E402

GB = 10**9
MB = 10**6


class WanderingRam:
    """A CPU card whose free memory wanders around ``mean`` (one step per read)."""

    def __init__(self, rng: random.Random, name: str, noise: bool) -> None:
        self.rng, self.name, self.noise = rng, name, noise
        self.mean = 12 * GB
        self.free = float(self.mean)
        self.reads = 0

    def read(self) -> tuple[Card, ...]:
        self.reads += 1
        if self.noise:
            self.free += self.rng.gauss(0, 96 * MB) - 0.1 * (self.free - self.mean)
        spike = 600 * MB if self.noise and self.rng.random() < 0.02 else 0
        free = int(min(16 * GB, max(0, self.free - spike)))
        return (Card(index=0, kind="cpu", name=self.name, uuid=self.name,
                     total_bytes=16 * GB, free_bytes=free),)


def inventory_config(rule: str) -> InventoryConfig:
    base = InventoryConfig()
    if rule == "step64":  # what every agent did before: republish on any 64 MiB move
        fields = {f.name for f in dataclasses.fields(base)}
        old = {"gossip_step_bytes": 64 * 2**20, "gossip_step_fraction": 0.0,
               "gossip_settle_reads": 1, "gossip_urgent_fraction": 0.0}
        return dataclasses.replace(base, **{k: v for k, v in old.items() if k in fields})
    return base


async def run(n: int, minutes: float, rule: str, noise: bool, seed: int,
              churn_s: float = 0.0, certificates: bool = False) -> dict[str, float]:
    config = dataclasses.replace(local(), inventory=inventory_config(rule))
    swarm = VirtualSwarm(n, seed=seed, config=config, admission=certificates)
    rng = random.Random(seed)
    for fellow in swarm.fellows:
        fellow.cards = WanderingRam(random.Random(rng.random()), f"{fellow.name} CPU", noise)  # type: ignore[assignment]
    async with trio.open_nursery() as nursery:
        await nursery.start(swarm.run)
        for i in range(n):
            await swarm.start(i)
        await wait_until(lambda: swarm.converged(), timeout_s=120)
        await trio.sleep(60.0)  # warm-up: joins and the first inventories spread
        agents = swarm.live()[:-1] if churn_s else swarm.live()  # the last one churns
        bytes0 = [a.counters.bytes_out for a in agents]
        grams0 = [a.counters.datagrams_out for a in agents]
        versions0 = [a.membership.meta_version for a in agents]  # type: ignore[union-attr]
        began = trio.current_time()
        if churn_s:  # news to spread: suspicions, a death, a rejoin, each time
            while trio.current_time() - began < minutes * 60.0:
                await trio.sleep(churn_s / 2)
                swarm.crash(n - 1)
                await trio.sleep(churn_s / 2)
                await swarm.start(n - 1)
        else:
            await trio.sleep(minutes * 60.0)
        elapsed = trio.current_time() - began
        per_s = [(a.counters.bytes_out - b) / elapsed for a, b in zip(agents, bytes0)]
        grams = [(a.counters.datagrams_out - g) / elapsed for a, g in zip(agents, grams0)]
        republished = [a.membership.meta_version - v  # type: ignore[union-attr]
                       for a, v in zip(agents, versions0)]
        nursery.cancel_scope.cancel()
    return {"bytes_per_s": statistics.mean(per_s), "datagrams_per_s": statistics.mean(grams),
            "republished_per_min": statistics.mean(republished) / minutes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fellows", type=int, default=10)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--rule", choices=("default", "step64"), default="default")
    parser.add_argument("--quiet", action="store_true", help="no RAM noise")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--churn", type=float, default=0.0, metavar="S",
                        help="crash and restart one fellow every S seconds; the others "
                        "are measured")
    parser.add_argument("--certificates", action="store_true",
                        help="every fellow admitted by certificate, checked by every other")
    args = parser.parse_args()
    figures = trio.run(run, args.fellows, args.minutes, args.rule, not args.quiet, args.seed,
                       args.churn, args.certificates,
                       clock=trio.testing.MockClock(autojump_threshold=0))
    print(f"{args.fellows} idle fellows, {args.minutes:g} virtual minutes, rule {args.rule}, "
          f"{'no RAM noise' if args.quiet else 'RAM noise'}"
          f"{f', one fellow crashed and restarted every {args.churn:g} s' if args.churn else ''}:")
    print(f"  {figures['bytes_per_s']:,.0f} B/s and {figures['datagrams_per_s']:.2f} "
          f"datagrams/s sent per fellow; cards republished {figures['republished_per_min']:.2f} "
          "times a minute per fellow")


if __name__ == "__main__":
    main()
