"""Membership and election figures, measured in virtual time with gossip_lab.

    python simulations/bench_membership.py             # every figure, default sizes
    python simulations/bench_membership.py --full      # the false-dead figure over 24 h
    python simulations/bench_membership.py --only crash_clean,failover --jobs 2
    python simulations/bench_membership.py --only join_wave --certificates

Prints one table row per figure: the value, the target, whether it is met, and the
scenario. Every run is seeded; the same arguments print the same table.
"""

from __future__ import annotations

import argparse
import logging
import math
import random
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from p2pswarm.config import lan, wifi
from p2pswarm.sim.gossip_lab import SEAL_OVERHEAD_BYTES, GossipLab, HopLab, proposed
from p2pswarm.transport.memory import GilbertElliott

BURSTY_20 = GilbertElliott(bad_fraction=0.2, mean_burst_s=0.3)
BURSTY_5 = GilbertElliott(bad_fraction=0.05, mean_burst_s=0.3)


def pct(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


# --- crash to dead ------------------------------------------------------------------------


def crash_trials(args: tuple[int, str, bool, int, int]) -> list[float]:
    """Crash a random fellow, wait, restart it; return every (crash, observer) latency."""
    seed, preset, bursty, n, trials = args
    config = wifi() if preset == "wifi" else lan()
    lab = GossipLab(n, seed=seed, config=config, radio=BURSTY_20 if bursty else None,
                    election=False)
    lab.start(converged=True)
    lab.run_until(60.0)
    rng = random.Random(seed)
    latencies: list[float] = []
    for _ in range(trials):
        i = rng.randrange(n)
        observers = len(lab.live()) - 1
        crashed_at = lab.now
        lab.crash(i)
        lab.run_for(30.0)
        seen = [v for (s, t, _), v in lab.oracle.dead_learned.items()
                if s == i and t == crashed_at]
        latencies += seen + [math.inf] * (observers - len(seen))  # never learned: infinite
        lab.restart(i)
        lab.run_for(20.0)
    return latencies


def crash_figure(preset: str, bursty: bool, n: int, trials: int, jobs: int,
                 seed: int) -> tuple[float, float, int]:
    per_job = max(1, trials // jobs)
    tasks = [(seed + j, preset, bursty, n, per_job) for j in range(jobs)]
    latencies: list[float] = []
    for part in _map(crash_trials, tasks, jobs):
        latencies.extend(part)
    return pct(latencies, 0.5), pct(latencies, 0.99), len(latencies)


# --- false dead, false suspect ----------------------------------------------------------


def calm_run(args: tuple[int, str, float, float, int, float]) -> dict[str, Any]:
    seed, preset, link_loss, bad_fraction, n, hours = args
    config = wifi() if preset == "wifi" else lan()
    radio = GilbertElliott(bad_fraction, 0.3) if bad_fraction > 0 else None
    lab = GossipLab(n, seed=seed, config=config, radio=radio, link_loss=link_loss,
                    election=False)
    lab.start(converged=True)
    lab.run_until(hours * 3600.0)
    suspicions = sum(node.membership.counters()["suspicions_raised"] for node in lab.nodes)
    return {"false_dead": list(lab.oracle.false_dead), "node_hours": n * hours,
            "first_hand_false_suspects": lab.oracle.false_suspect_first_hand,
            "suspicions": suspicions}


def calm_figure(preset: str, link_loss: float, bad_fraction: float, n: int, hours: float,
                jobs: int, seed: int) -> dict[str, Any]:
    slices = max(1, jobs)
    tasks = [(seed + j, preset, link_loss, bad_fraction, n, hours / slices)
             for j in range(slices)]
    total: dict[str, Any] = {"false_dead": [], "node_hours": 0.0,
                             "first_hand_false_suspects": 0, "suspicions": 0}
    for part in _map(calm_run, tasks, jobs):
        total["false_dead"] += part["false_dead"]
        total["node_hours"] += part["node_hours"]
        total["first_hand_false_suspects"] += part["first_hand_false_suspects"]
        total["suspicions"] += part["suspicions"]
    return total


# --- dissemination ------------------------------------------------------------------------


def dissemination(seed: int, n: int, loss: float, updates: int) -> list[tuple[int, float]]:
    """(gossip rounds, seconds) until an update reaches 99.99% of n fellows. A round is
    one generation of forwarding: the update reached at round r came from a fellow that
    got it at round r - 1."""
    config = wifi()
    lab = HopLab(n, seed=seed, config=config, link_loss=loss, election=False)
    lab.start(converged=True)
    lab.run_until(5.0)
    need = math.ceil(0.9999 * n)  # fellows, the origin included
    rng = random.Random(seed)
    out: list[tuple[int, float]] = []
    for _ in range(updates):
        origin = lab.nodes[rng.randrange(n)]
        t0 = lab.now
        lab.hops = {origin.index: 0}
        lab.reached_at = {origin.index: t0}
        lab.watch = (origin.node_id, origin.membership.incarnation + 1)
        lab.set_metadata(origin.index, b"inventory %d" % rng.randrange(10**9))
        while lab.now - t0 < 30.0 and len(lab.hops) < need:
            lab.run_for(0.05)
        if len(lab.hops) >= need:
            ranked = sorted(lab.hops.values())
            last = sorted(lab.reached_at.values())[need - 1]
            out.append((ranked[need - 1], last - t0))
        else:
            out.append((10**9, math.inf))
        lab.watch = None
        lab.run_for(10.0)
    return out


# --- traffic ------------------------------------------------------------------------------


def traffic(seed: int, n: int, warm_s: float, measure_s: float,
            certificates: bool = False) -> dict[str, float]:
    lab = GossipLab(n, seed=seed, config=proposed("lan"), measure_bytes=True,
                    admission=certificates)
    lab.start(converged=True)
    lab.run_until(warm_s)
    d0 = sum(x.sent_datagrams for x in lab.nodes)
    b0 = sum(x.sent_bytes for x in lab.nodes)
    s0 = sum(x.stream_bytes for x in lab.nodes)
    lab.run_until(warm_s + measure_s)
    d = sum(x.sent_datagrams for x in lab.nodes) - d0
    b = sum(x.sent_bytes for x in lab.nodes) - b0
    s = sum(x.stream_bytes for x in lab.nodes) - s0
    per = n * measure_s
    return {"datagrams_per_s": d / per, "datagram_bytes_per_s": b / per,
            "stream_bytes_per_s": s / per, "bytes_per_s": (b + s) / per}


# --- leader failover ----------------------------------------------------------------------


def failover_trials(args: tuple[int, int, int, bool]) -> list[float]:
    """Crash the leader; time until every live fellow names the same new leader."""
    seed, n, trials, certificates = args
    lab = GossipLab(n, seed=seed, config=proposed("wifi"), radio=BURSTY_5,
                    admission=certificates)
    lab.start(converged=True)
    lab.run_until(30.0)
    out: list[float] = []
    for _ in range(trials):
        leader_ids = {lab.leader_seen(x.index) for x in lab.live()}
        if len(leader_ids) != 1 or None in leader_ids:
            lab.run_for(10.0)
            continue
        (leader_id,) = leader_ids
        old = lab.node_by_id(leader_id)
        assert old is not None
        t0 = lab.now
        lab.crash(old.index)
        done = math.inf
        while lab.now - t0 < 30.0:
            lab.run_for(0.05)
            seen = {lab.leader_seen(x.index) for x in lab.live()}
            if len(seen) == 1 and None not in seen and leader_id not in seen:
                done = lab.now - t0
                break
        out.append(done)
        lab.restart(old.index)
        lab.run_for(20.0)
    return out


def failover_figure(n: int, trials: int, jobs: int, seed: int,
                    certificates: bool = False) -> tuple[float, float, int]:
    per_job = max(1, trials // jobs)
    times: list[float] = []
    for part in _map(failover_trials, [(seed + j, n, per_job, certificates)
                                       for j in range(jobs)], jobs):
        times.extend(part)
    return pct(times, 0.5), pct(times, 0.99), len(times)


# --- a join wave -------------------------------------------------------------------------


def join_wave_run(args: tuple[int, int, bool]) -> float:
    """``n`` fellows join through one seed at the same instant: seconds until every one
    sees every one alive (inf: not within 60 s)."""
    seed, n, certificates = args
    lab = GossipLab(n, seed=seed, config=proposed("lan"), admission=certificates)
    lab.start(stagger_s=0.0)
    while lab.now < 60.0:
        lab.run_for(0.05)
        if all(sum(1 for m in x.membership.members() if m.state == "alive") == n
               for x in lab.nodes):
            return lab.now
    return math.inf


def join_wave_figure(n: int, runs: int, jobs: int, seed: int,
                     certificates: bool = False) -> list[float]:
    return sorted(_map(join_wave_run, [(seed + j, n, certificates) for j in range(runs)],
                       jobs))


# --- real agents in virtual time --------------------------------------------------------


def agents_speed(n: int, virtual_s: float, seed: int) -> dict[str, float]:
    """Wall time of ``n`` real trio agents on MemoryNetwork under a jumping clock: form the
    swarm, then run ``virtual_s`` of steady gossip with one crash in the middle."""
    import trio

    from p2pswarm.sim.virtual import JumpClock, VirtualSwarm, seeded_scheduler, wait_until

    out: dict[str, float] = {}

    async def main() -> None:
        swarm = VirtualSwarm(n, seed=seed, config=lan())
        async with trio.open_nursery() as nursery:
            await nursery.start(swarm.run)
            await swarm.start_all()
            out["formed_s"] = await wait_until(swarm.converged, timeout_s=300.0, step_s=0.5)
            began_wall, began_cpu = time.perf_counter(), time.process_time()
            began = trio.current_time()
            await trio.sleep(virtual_s / 2)
            swarm.crash(n - 1)
            out["crash_to_dead_all_s"] = await wait_until(
                lambda: swarm.states_seen_by_all(n - 1) == {"dead"}, timeout_s=60.0,
                step_s=0.05)
            await trio.sleep(max(0.0, began + virtual_s - trio.current_time()))
            out["wall_s"] = time.perf_counter() - began_wall
            out["cpu_s"] = time.process_time() - began_cpu
            out["virtual_s"] = trio.current_time() - began
            nursery.cancel_scope.cancel()

    with seeded_scheduler(seed):
        trio.run(main, clock=JumpClock())
    out["speedup"] = out["virtual_s"] / out["wall_s"]
    out["cpu_speedup"] = out["virtual_s"] / out["cpu_s"]  # what an idle machine would see
    return out


# --- plumbing -----------------------------------------------------------------------------


def _map(fn: Callable[[Any], Any], tasks: list[Any], jobs: int) -> list[Any]:
    if jobs <= 1:
        return [fn(t) for t in tasks]
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(fn, tasks))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help="false dead over 24 virtual hours")
    ap.add_argument("--hours", type=float, default=None, help="hours for the false-dead run")
    ap.add_argument("--only", default="", help="comma-separated figure names")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--certificates", action="store_true",
                    help="every fellow admitted by certificate, checked by every other")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--trials", type=int, default=60, help="crashes per crash figure")
    ap.add_argument("--agent-seconds", type=float, default=600.0,
                    help="virtual seconds for the real-agent speed figure")
    args = ap.parse_args(argv)
    logging.disable(logging.WARNING)  # the agents' event lines would drown the table
    only = set(filter(None, args.only.split(",")))
    hours = args.hours if args.hours is not None else (24.0 if args.full else 2.0)
    rows: list[tuple[str, str, str, str, str]] = []

    def want(name: str) -> bool:
        return not only or name in only

    def row(name: str, value: str, target: str, met: bool, scenario: str) -> None:
        rows.append((name, value, target, "yes" if met else "NO", scenario))
        print(f"{name:28} {value:28} {target:22} {'yes' if met else 'NO':4} {scenario}",
              flush=True)

    print(f"{'figure':28} {'value':28} {'target':22} {'met':4} scenario")
    started = time.time()
    if want("crash_clean"):
        p50, p99, k = crash_figure("lan", False, 100, args.trials, args.jobs, args.seed)
        row("crash_clean", f"p50 {p50:.2f} s, p99 {p99:.2f} s", "p50<=3.5 p99<=6",
            p50 <= 3.5 and p99 <= 6.0, f"N=100 lan clean, {k} fellow-crash pairs")
    if want("crash_bursty"):
        p50, p99, k = crash_figure("wifi", True, 100, args.trials, args.jobs, args.seed)
        row("crash_bursty", f"p50 {p50:.2f} s, p99 {p99:.2f} s", "p50<=6 p99<=10",
            p50 <= 6.0 and p99 <= 10.0,
            f"N=100 wifi, GE 20% bad, 0.3 s bursts, {k} pairs")
    if want("false_dead"):
        r = calm_figure("wifi", 0.0, 0.2, 50, hours, args.jobs, args.seed)
        short = [x for x in r["false_dead"] if x[3] < 3.0]
        verdicts = len({(x[2], round(x[0])) for x in short})  # one per fellow and moment
        longer = len({(x[2], round(x[0])) for x in r["false_dead"] if x[3] >= 3.0})
        row("false_dead", f"{verdicts} ({len(short)} views; {longer} after fades >= 3 s)",
            "0 under 3 s outages", not short,
            f"N=50 wifi, GE 20%/0.3 s, {hours:g} h ({r['node_hours']:.0f} node-h); "
            "outage = longest single fade")
    if want("false_suspect"):
        r = calm_figure("wifi", 0.2, 0.0, 50, 1.0, args.jobs, args.seed)
        rate = r["first_hand_false_suspects"] / r["node_hours"]
        row("false_suspect", f"{rate:.1f} per node-hour", "<=25", rate <= 25.0,
            "N=50 wifi, 20% independent loss, 1 h")
    if want("dissemination"):
        runs = dissemination(args.seed, 1000, 0.2, 5)
        interval = wifi().gossip.gossip_interval_s
        slowest = max(t for _, t in runs)
        rounds = math.ceil(slowest / interval - 1e-9)  # gossip intervals elapsed
        row("dissemination", f"{rounds} rounds ({slowest:.2f} s; {max(h for h, _ in runs)} "
            "hops)", "<=11", rounds <= 11,
            f"N=1000 wifi, 20% loss, worst of {len(runs)} updates to 99.99%; a round is "
            f"one {interval:g} s gossip interval, a hop one forwarding")
    if want("traffic"):
        t = traffic(args.seed, 100, 120.0, 300.0, args.certificates)
        ok = t["bytes_per_s"] <= 300.0 and t["datagrams_per_s"] <= 3.0
        row("traffic", f"{t['bytes_per_s']:.0f} B/s, {t['datagrams_per_s']:.2f} dgram/s",
            "<=300 B/s <=3 dgram/s", ok,
            f"N=100 lan clean, steady, sent per fellow (+{SEAL_OVERHEAD_BYTES} B seal); "
            f"streams {t['stream_bytes_per_s']:.0f} B/s of it")
    if want("failover"):
        p50, p99, k = failover_figure(50, args.trials, args.jobs, args.seed,
                                      args.certificates)
        row("failover", f"p50 {p50:.2f} s, p99 {p99:.2f} s", "p50<=2.5 p99<=6",
            p50 <= 2.5 and p99 <= 6.0, f"N=50 wifi, GE 5%/0.3 s, {k} leader crashes")
    if want("join_wave"):
        times = join_wave_figure(50, 12, args.jobs, args.seed, args.certificates)
        late = sum(1 for t in times if t > 5.0)
        row("join_wave", f"p50 {pct(times, 0.5):.2f} s, max {max(times):.2f} s",
            "all <=5 s", late == 0,
            f"N=50 lan, all join one seed at once, {len(times)} seeds, {late} over 5 s")
    if want("agents_speed"):
        r = agents_speed(100, args.agent_seconds, args.seed)
        row("agents_speed", f"{r['speedup']:.0f}x real time ({r['cpu_speedup']:.0f}x per "
            "CPU second)", ">=20x", r["speedup"] >= 20.0,
            f"N=100 trio agents, MemoryNetwork, lan, {r['virtual_s']:.0f} virtual s in "
            f"{r['wall_s']:.0f} s wall, {r['cpu_s']:.0f} s CPU; one crash, dead everywhere in "
            f"{r['crash_to_dead_all_s']:.1f} s")
    print(f"# {time.time() - started:.0f} s wall", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
