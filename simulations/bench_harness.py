"""The harness's figures: real agents in virtual time, ours against memberlist's defaults.

    python simulations/bench_harness.py                    # every figure, default sizes
    python simulations/bench_harness.py --only speed,w3 --jobs 2
    python simulations/bench_harness.py --w3-hours 24      # the long W3 run
    python simulations/bench_harness.py --only lab1000     # N = 1000 spread, pure machines
    python simulations/bench_harness.py --only flaplab     # 10,000 election safety runs
    sudo python simulations/bench_harness.py --only real-bursts  # namespaces, bursty loss

Each run is a `p2pswarm simulate` run (same scenarios, same seeds); its result is saved
as JSON under --out (default simulations/results/) and reused on the next call unless
--fresh. Prints one markdown table: figure, target, ours, baseline, met, command, machine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import sys
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from p2pswarm.config import preset
from p2pswarm.sim.baseline import memberlist_config
from p2pswarm.sim.election_lab import safety_run
from p2pswarm.sim.gossip_lab import HopLab
from p2pswarm.sim.harness import run_scenario
from p2pswarm.sim.metrics import ks_two_sample, summary
from p2pswarm.sim.report import to_json
from p2pswarm.sim.scenario import load_scenario

OUT = Path(__file__).resolve().parent / "results"


def job_name(scenario: str, variant: str, seed: int, nodes: int | None,
             duration: float | None) -> str:
    return f"{scenario}-{variant}-s{seed}-n{nodes or 'd'}-t{int(duration) if duration else 'd'}"


def run_job(args: tuple[str, str, int, int | None, float | None, str]) -> str:
    scenario, variant, seed, nodes, duration, out = args
    path = Path(out) / (job_name(scenario, variant, seed, nodes, duration) + ".json")
    if path.exists():
        return str(path)
    s = load_scenario(scenario).with_overrides(nodes=nodes, duration_s=duration, seed=seed)
    if variant == "real":
        from p2pswarm.sim.netns import run_real
        result = run_real(s)
    else:
        result = run_scenario(s, variant)
    result.pop("views", None)
    path.write_text(to_json(result))
    return str(path)


def load(path: str) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


def fmt(v: Any, unit: str = "") -> str:
    if v is None:
        return "-"
    if isinstance(v, str):
        return v
    if isinstance(v, float) and not math.isfinite(v):
        return "never"
    return f"{v:,.3g}{unit}" if isinstance(v, float) else f"{v:,}{unit}"


def safety_dict(seed: int) -> dict[str, Any]:
    try:
        return safety_run(seed).as_dict()
    except RuntimeError as e:  # a machine that spins: a failure of the run, not the bench
        return {"seed": seed, "error": str(e), "two_leaders": [], "two_followed": [],
                "elections": 0, "settled": False}


def spread_rounds(args: tuple[str, int, int, float, int, str]) -> dict[str, list[float]]:
    """How fast each of ``updates`` metadata updates reaches 99.99% of ``n`` fellows on
    links losing ``loss`` of datagrams (the pure machines in gossip_lab, no agents), in two
    units: ``rounds``, the time taken over the gossip interval (as the real-agent figure
    counts), and ``generations``, the forwarding hops on the path that reached the last of
    them. ``inf`` when 30 s did not do."""
    variant, seed, n, loss, updates, preset_name = args
    if variant == "ours":
        config = preset(preset_name)
        lab = HopLab(n, seed=seed, config=config, link_loss=loss, election=False)
    else:
        config = memberlist_config(n)
        lab = HopLab(n, seed=seed, config=config, link_loss=loss, election=False)
    interval = config.gossip.gossip_interval_s
    lab.start(converged=True)
    lab.run_until(5.0)
    need = math.ceil(0.9999 * n)
    pick = random.Random(seed)
    out: dict[str, list[float]] = {"rounds": [], "generations": []}
    for _ in range(updates):
        origin = lab.nodes[pick.randrange(n)]
        t0 = lab.now
        lab.hops = {origin.index: 0}
        lab.reached_at = {origin.index: lab.now}
        lab.watch = (origin.node_id, origin.membership.incarnation + 1)
        lab.set_metadata(origin.index, b"inventory %d" % pick.randrange(10**9))
        while lab.now - t0 < 30.0 and len(lab.hops) < need:
            lab.run_for(0.05)
        done = len(lab.hops) >= need
        took = sorted(lab.reached_at.values())[need - 1] - t0 if done else math.inf
        out["rounds"].append(took / interval)
        out["generations"].append(float(sorted(lab.hops.values())[need - 1]) if done
                                  else math.inf)
        lab.watch = None
        lab.run_for(10.0)
    return out


class Bench:
    def __init__(self, out: Path, jobs: int, fresh: bool, w3_hours: float,
                 flap_runs: int, failover_seeds: int = 1, lab_flap_runs: int = 10_000) -> None:
        self.out = out
        self.jobs = jobs
        self.fresh = fresh
        self.w3_hours = w3_hours
        self.flap_runs = flap_runs
        self.failover_seeds = failover_seeds
        self.lab_flap_runs = lab_flap_runs
        self.rows: list[tuple[str, str, str, str, str, str]] = []

    def runs(self, specs: list[tuple[str, str, int, int | None, float | None]]) -> list[dict]:
        tasks = [(*spec, str(self.out)) for spec in specs]
        if self.fresh:
            for t in tasks:
                (self.out / (job_name(*t[:5]) + ".json")).unlink(missing_ok=True)
        if self.jobs > 1 and len(tasks) > 1:
            with ProcessPoolExecutor(self.jobs) as pool:
                paths = list(pool.map(run_job, tasks))
        else:
            paths = [run_job(t) for t in tasks]
        return [load(p) for p in paths]

    def row(self, figure: str, ours: str, base: str, target: str, met: bool | None,
            how: str) -> None:
        self.rows.append((figure, ours, base, target,
                          "-" if met is None else ("yes" if met else "no"), how))
        print(f"  {figure}: ours {ours}, baseline {base}, target {target}", file=sys.stderr)

    # --- figures ------------------------------------------------------------------

    def speed_and_crash(self) -> None:
        ours, base = self.runs([("clean", "ours", 1, None, None),
                                ("clean", "baseline", 1, None, None)])
        self.row("harness speed: N = 100, 1 virtual hour (wall / CPU)",
                 f"{fmt(ours['wall_s'])} s / {fmt(ours['cpu_s'])} s",
                 f"{fmt(base['wall_s'])} s / {fmt(base['cpu_s'])} s", "<= 180 s wall",
                 ours["wall_s"] <= 180, "simulate clean")
        c, b = ours["crash_to_dead_s"], base["crash_to_dead_s"]
        self.row("N = 100 clean: crash to dead p50", fmt(c["p50"], " s"), fmt(b["p50"], " s"),
                 "<= 3.5 s (baseline ~10 s)", c["p50"] is not None and c["p50"] <= 3.5,
                 f"simulate clean --baseline ({c['count']} crash x observer)")
        self.row("N = 100 clean: crash to dead p99", fmt(c["p99"], " s"), fmt(b["p99"], " s"),
                 "<= 6 s", c["p99"] is not None and c["p99"] <= 6.0, "same runs")

    def w3(self) -> None:
        hours = self.w3_hours
        per_run_h = min(hours, 1.0)
        n_runs = max(1, round(hours / per_run_h))
        duration = 60 + per_run_h * 3600
        specs = [("w3", v, seed, None, duration) for seed in range(1, n_runs + 1)
                 for v in ("ours", "baseline")]
        results = self.runs(specs)
        agg: dict[str, dict[str, float]] = {}
        for r in results:
            a = agg.setdefault(r["variant"], dict.fromkeys(
                ("fd", "fdu", "fs", "fsu", "nh", "plan_u", "plan", "fail"), 0.0))
            a["fd"] += r["false_deaths"]
            a["fdu"] += r["false_deaths_unexcused"]
            a["fs"] += r["false_suspicions"]
            a["fsu"] += r["false_suspicions_unexcused"]
            a["nh"] += r["node_hours"]
            a["plan_u"] += r["plan"]["changes_unexplained"]
            a["plan"] += r["plan"]["changes"]
            a["fail"] += 0 if r["ok"] else 1
        o, b = agg["ours"], agg["baseline"]
        how = (f"simulate w3 --baseline, {n_runs} seed(s) x {per_run_h:g} h = "
               f"{n_runs * per_run_h:g} virtual h")
        self.row("N = 50, W3: false deaths, reachable fellows (all, incl. roaming outages)",
                 f"{int(o['fdu'])} ({int(o['fd'])})", f"{int(b['fdu'])} ({int(b['fd'])})",
                 "0", o["fdu"] == 0, how)
        ratio = (b["fsu"] / o["fsu"]) if o["fsu"] else math.inf
        ratio_all = (b["fs"] / o["fs"]) if o["fs"] else math.inf
        self.row("N = 50, W3: false suspicions per node-hour, reachable fellows (all, incl. "
                 "roaming outages)", f"{fmt(o['fsu'] / o['nh'])} ({fmt(o['fs'] / o['nh'])})",
                 f"{fmt(b['fsu'] / b['nh'])} ({fmt(b['fs'] / b['nh'])})",
                 ">= 10x fewer than baseline", ratio >= 10,
                 f"{how}; ratio {fmt(ratio)}x ({fmt(ratio_all)}x counting suspicions of "
                 f"fellows in an outage)")
        self.row("N = 50, W3: plan changes with no card change (of all changes)",
                 f"{int(o['plan_u'])} ({int(o['plan'])})",
                 f"{int(b['plan_u'])} ({int(b['plan'])})", "0", o["plan_u"] == 0,
                 how + "; plan every 60 s")

    def failover(self) -> None:
        seeds = range(1, self.failover_seeds + 1)
        results = self.runs([("w2-failover", v, seed, None, None)
                             for seed in seeds for v in ("ours", "baseline")])
        times: dict[str, list[float]] = {"ours": [], "baseline": []}
        two = {"ours": 0, "baseline": 0}
        for r in results:
            times[r["variant"]] += [math.inf if x["failover_s"] is None else x["failover_s"]
                                    for x in r["_failovers"]]
            two[r["variant"]] += r["terms_with_two_leaders"] + r["terms_with_two_followed"]
        f, g = summary(times["ours"]), summary(times["baseline"])
        how = (f"simulate w2-failover --baseline --seed 1..{len(seeds)} "
               f"({f['count']} kills, {f['missed']} never settled; two leaders in one term: "
               f"{two['ours']} ours, {two['baseline']} baseline)")
        self.row("leader failover under W2: p50", fmt(f["p50"], " s"), fmt(g["p50"], " s"),
                 "<= 2.5 s", f["p50"] is not None and f["p50"] <= 2.5, how)
        self.row("leader failover under W2: p99", fmt(f["p99"], " s"), fmt(g["p99"], " s"),
                 "<= 6 s", f["p99"] is not None and f["p99"] <= 6.0 and not f["missed"],
                 "same runs")

    def flaps(self) -> None:
        specs = [("partition-flap", "ours", seed, None, 600.0)
                 for seed in range(1, self.flap_runs + 1)]
        results = self.runs(specs)
        two = sum(r["terms_with_two_leaders"] + r["terms_with_two_followed"] for r in results)
        parts = sum(r["events"].get("elected", 0) for r in results)
        self.row("two leaders in one term: whole agents, partition and flap", f"{two}", "-",
                 "0", two == 0,
                 f"{len(results)} seeded runs of partition-flap x 600 s ({parts} elections)")

    def flap_lab(self) -> None:
        runs = self.lab_flap_runs
        saved = self.out / f"flaplab-{runs}.json"
        if saved.exists() and not self.fresh:
            results = json.loads(saved.read_text())
        else:
            seeds = list(range(1, runs + 1))
            if self.jobs > 1:
                with ProcessPoolExecutor(self.jobs) as pool:
                    results = list(pool.map(safety_dict, seeds, chunksize=100))
            else:
                results = [safety_dict(s) for s in seeds]
            saved.write_text(json.dumps(results))
        bad = [r["seed"] for r in results if r["two_leaders"] or r["two_followed"]]
        errors = [r["seed"] for r in results if "error" in r]
        elections = sum(r["elections"] for r in results)
        unsettled = sum(1 for r in results if not r["settled"])
        self.row("two leaders in one term: seeded partition and flap runs", f"{len(bad)}",
                 "-", "0 over 10,000 runs", not bad and not errors and len(results) >= 10_000,
                 f"bench_harness.py --only flaplab: {len(results):,} runs of 3-9 fellows "
                 f"(election_lab: membership + election machines, W2 radios, 120 s of "
                 f"partitions, flaps and crashes), {elections:,} elections; "
                 f"{unsettled} runs without one leader 30 s after the calm"
                 + (f"; failing seeds {bad[:5]}" if bad else "")
                 + (f"; runs that spun: {errors[:5]}" if errors else ""))

    def cards(self) -> None:
        ours, base = self.runs([("cards", "ours", 1, None, None),
                                ("cards", "baseline", 1, None, None)])
        p, q = ours["plan"], base["plan"]
        self.row("plan changes with no real card change (cards scenario)",
                 f"{p['changes_unexplained']} of {p['changes']}",
                 f"{q['changes_unexplained']} of {q['changes']}", "0",
                 p["changes_unexplained"] == 0,
                 f"simulate cards --baseline ({p['planned']} plans)")

    def training(self) -> None:
        ours, base, calm = self.runs([("train-w2", "ours", 1, None, None),
                                      ("train-w2", "baseline", 1, None, None),
                                      ("train-calm", "ours", 1, None, None)])

        def fig(r: dict[str, Any]) -> str:
            t = r["training"] or {}
            if t.get("state") != "finished":
                return f"{t.get('state', 'no job')}: {t.get('reason', '')}"
            return (f"{fmt(t['samples_per_s'])} samples/s, loss {fmt(t['loss_first'])} -> "
                    f"{fmt(t['loss_end'])}, {t['rejoins']} rejoins")
        self.row("training under dropouts (train-w2): samples/s, loss at the first step -> "
                 "mean of the last 5", fig(ours), fig(base), "reported", None,
                 f"simulate train-w2 --baseline; with no faults (train-calm): {fig(calm)}")

    def n1000(self, duration: float) -> None:
        (r,) = self.runs([("update-1000", "ours", 1, None, duration)])
        u = r["update_rounds"]
        self.row("N = 1000, 20% loss: one update to 99.99% (rounds)",
                 fmt(r["update_rounds_p9999"]), "-", "<= 11 rounds",
                 r["update_rounds_p9999"] is not None and r["update_rounds_p9999"] <= 11,
                 f"simulate update-1000 --duration {duration:g} ({u['count']} deliveries)")
        self.row("harness speed: N = 1000 (wall / CPU)",
                 f"{fmt(r['wall_s'])} s / {fmt(r['cpu_s'])} s", "-",
                 "10 virtual minutes reported", None,
                 f"{duration:g} virtual s, formed start")

    def lab1000(self, updates: int, preset_name: str) -> None:
        tasks = [(v, 1, 1000, 0.2, updates, preset_name) for v in ("ours", "baseline")]
        saved = self.out / f"lab1000-{preset_name}-u{updates}-rounds.json"
        if saved.exists() and not self.fresh:
            ours, base = json.loads(saved.read_text())
        else:
            if self.jobs > 1:
                with ProcessPoolExecutor(self.jobs) as pool:
                    ours, base = pool.map(spread_rounds, tasks)
            else:
                ours, base = (spread_rounds(t) for t in tasks)
            saved.write_text(json.dumps([ours, base]))
        how = f"bench_harness.py --only lab1000 (gossip_lab, {preset_name} preset; all: "
        self.row(f"N = 1000, 20% loss, pure machines: one update to 99.99% (rounds, worst "
                 f"of {updates})", fmt(max(ours["rounds"])), fmt(max(base["rounds"])),
                 "<= 11 rounds", max(ours["rounds"]) <= 11,
                 how + ", ".join(fmt(r) for r in ours["rounds"]) + ")")
        self.row(f"same runs: forwarding generations to 99.99% (worst of {updates})",
                 fmt(max(ours["generations"])), fmt(max(base["generations"])), "-", None,
                 how + ", ".join(fmt(r) for r in ours["generations"]) + ")")

    def real(self) -> None:
        real, virtual = self.runs([("real-crash", "real", 1, None, None),
                                   ("real-crash", "ours", 1, None, None)])
        ks = ks_two_sample(real["_detect"], virtual["_detect"])
        self.row("real namespaces vs virtual: detection time (p50 real / virtual)",
                 f"{fmt(real['crash_to_dead_s']['p50'], ' s')} / "
                 f"{fmt(virtual['crash_to_dead_s']['p50'], ' s')}", "-",
                 "reported with a two-sample test", None,
                 f"simulate real-crash --real: KS D = {fmt(ks['statistic'])}, "
                 f"p = {fmt(ks['p_value'])} (n = {ks['n']}, m = {ks['m']})")

    def real_bursts(self, seed: int) -> None:
        """Ten `join` processes in namespaces, 1% loss plus Pareto bursts of total loss
        (mean 0.3 s, ~19% of the time) replayed by nft rules, four crashes."""
        (r,) = self.runs([("real-bursts", "real", seed, None, None)])
        b, own = r.get("bursts") or {}, r.get("counted_by_fellows") or {}
        loads = r.get("load_average") or []
        load = (f"load average {min(loads):.1f}-{max(loads):.1f} on {os.cpu_count()} cores"
                if loads else "load not recorded")
        how = (f"bench_harness.py --only real-bursts --real-seed {seed}: "
               f"{r['node_hours']:g} node-h, {b.get('bursts', 0):,} bursts, "
               f"{100 * b.get('time_in_bursts', 0):.1f}% of the time, mean "
               f"{fmt(b.get('mean_burst_s'), ' s')}, switches late p99 "
               f"{fmt((b.get('switch_late_ms') or {}).get('p99'), ' ms')}; {load}")
        fs = r["false_suspicions_per_node_hour"]
        self.row("real namespaces, 10 fellows, 1% + bursty loss: false suspicions per "
                 "node-hour (of reachable fellows; refutations counted by the fellows)",
                 f"{fmt(fs)} ({fmt(r['false_suspicions_unexcused_per_node_hour'])}; "
                 f"{fmt(own.get('refutations_per_node_hour'))})", "-", "<= 50", fs <= 50, how)
        short = r["false_deaths_short_outages"]
        self.row("same run: false deaths after outages under 3 s (all false-death episodes)",
                 f"{short['episodes']} ({r['false_deaths']})", "-", "0",
                 short["episodes"] == 0, "same run")
        c = r["crash_to_dead_s"]
        self.row("same run: crash to dead p50 / p99",
                 f"{fmt(c['p50'], ' s')} / {fmt(c['p99'], ' s')}", "-", "p50 <= 5 s",
                 c["p50"] is not None and c["p50"] <= 5.0,
                 f"same run ({r['crashes']} crashes, {c['count']} crash x observer, "
                 f"{c['missed']} missed)")
        t = r["traffic"]["bytes_out_per_fellow_s"]
        self.row("same run: bytes sent per fellow per second (mean / max)",
                 f"{t['mean']:,.0f} / {t['max']:,.0f} B/s", "-", "no higher than before", None,
                 f"same run ({fmt(r['traffic']['datagrams_out_per_fellow_s']['mean'])} "
                 "datagrams/s)")

    def table(self) -> str:
        where = machine()
        lines = ["| figure | target | ours | baseline | met | command and runs | machine |",
                 "|---|---|---|---|---|---|---|"]
        lines += [f"| {f} | {t} | {o} | {b} | {m} | {h} | {where} |"
                  for f, o, b, t, m, h in self.rows]
        return "\n".join(lines)


def machine() -> str:
    """The machine in a few words: cores, architecture, Python, load when measured."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else math.nan
    return (f"{os.cpu_count()}-core {platform.machine()}, Python "
            f"{platform.python_version()}, load {load:.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only",
                        default="speed,w3,failover,cards,flaps,flaplab,training,lab1000,n1000,"
                                "real")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--fresh", action="store_true", help="Run again, ignoring saved runs.")
    parser.add_argument("--w3-hours", type=float, default=1.0)
    parser.add_argument("--flap-runs", type=int, default=20)
    parser.add_argument("--flaplab-runs", type=int, default=10_000,
                        help="seeded election_lab runs for the two-leaders figure")
    parser.add_argument("--failover-seeds", type=int, default=1,
                        help="seeded w2-failover hours (30 leader kills each)")
    parser.add_argument("--n1000-duration", type=float, default=600.0)
    parser.add_argument("--real-seed", type=int, default=1,
                        help="seed of the real-bursts run (its bursts and crashes)")
    parser.add_argument("--updates", type=int, default=5,
                        help="updates followed by the lab1000 figure")
    parser.add_argument("--lab1000-preset", default="wifi",
                        help="our preset in the lab1000 figure (lan, wifi, local)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    bench = Bench(args.out, args.jobs, args.fresh, args.w3_hours, args.flap_runs,
                  args.failover_seeds, args.flaplab_runs)
    figures: dict[str, Callable[[], None]] = {
        "speed": bench.speed_and_crash, "w3": bench.w3, "failover": bench.failover,
        "cards": bench.cards, "flaps": bench.flaps, "flaplab": bench.flap_lab,
        "training": bench.training,
        "n1000": lambda: bench.n1000(args.n1000_duration),
        "lab1000": lambda: bench.lab1000(args.updates, args.lab1000_preset), "real": bench.real,
        "real-bursts": lambda: bench.real_bursts(args.real_seed)}
    for name in args.only.split(","):
        if name not in figures:
            parser.error(f"unknown figure {name!r}: use {', '.join(figures)}")
        if name in ("real", "real-bursts"):
            from p2pswarm.sim.netns import missing_requirements
            why = missing_requirements()
            if why:
                print(f"  real: skipped ({why})", file=sys.stderr)
                continue
        figures[name]()
    print(bench.table())


if __name__ == "__main__":
    main()
