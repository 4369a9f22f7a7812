"""Harness speed: virtual seconds per CPU second of one seeded scenario, with and without
the memory of signature checks that passed (``p2pswarm.security.verified``), side by side.

    python simulations/harness_speed.py                          # clean, N = 100, 300 s
    python simulations/harness_speed.py --duration 600 --rounds 2
    python simulations/harness_speed.py --scenario smoke --nodes 100 --only cached

Each round runs the scenario once with the memory off (every signature checked each time
it arrives: the code before) and once with it on, alternating, in this one process, so
both see the same machine load. Both runs must give the same trace hash (the memory
changes no verdict); the script exits 1 if they do not. Prints one JSON line per run and
a summary line: the median virtual s per CPU s of each, over the whole run and after the
warm-up (the formed start, where every fellow checks 99 records, is then over: what a
long run converges to), and the target (>= 20 at N = 100). CPU seconds are this
process's; on a shared machine they still grow with the load (cores and caches shared),
so compare sides of one call, not calls made at different times.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

from p2pswarm.security.identity import VERIFIED
from p2pswarm.security.verified import DEFAULT_CAPACITY_BYTES
from p2pswarm.sim.harness import run_scenario
from p2pswarm.sim.scenario import load_scenario

TARGET_VIRTUAL_PER_CPU_S = 20.0


def one_run(scenario: str, nodes: int | None, duration_s: float, cached: bool
            ) -> dict[str, Any]:
    VERIFIED.clear()
    VERIFIED.resize(DEFAULT_CAPACITY_BYTES if cached else 0)
    chosen = load_scenario(scenario).with_overrides(nodes=nodes, duration_s=duration_s)
    warm: list[float] = []  # CPU seconds when the warm-up (the formed start) was over

    def progress(now_s: float, end_s: float) -> None:
        if not warm and now_s >= chosen.warmup_s:
            warm.append(time.process_time())

    result = run_scenario(chosen, progress=progress)
    steady_cpu_s = time.process_time() - warm[0] if warm else None
    steady_s = chosen.duration_s - chosen.warmup_s
    return {"code": "cached" if cached else "uncached", "scenario": chosen.name,
            "nodes": chosen.nodes, "virtual_s": chosen.duration_s,
            "cpu_s": result["cpu_s"], "wall_s": result["wall_s"],
            "virtual_per_cpu_s": result["virtual_per_cpu_s"],
            "after_warmup_virtual_per_cpu_s": round(steady_s / steady_cpu_s, 2)
            if steady_cpu_s else None, "ok": result["ok"],
            "trace_hash": result["trace_hash"][:16],
            "load_average_1min": round(os.getloadavg()[0], 2),
            "signature_checks_remembered": VERIFIED.hits,
            "signature_checks_made": VERIFIED.misses}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenario", default="clean")
    ap.add_argument("--nodes", type=int, default=100)
    ap.add_argument("--duration", type=float, default=300.0, help="virtual seconds a run")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--only", choices=("cached", "uncached"), default=None,
                    help="run one side only")
    args = ap.parse_args(argv)
    sides = [False, True] if args.only is None else [args.only == "cached"]
    runs: list[dict[str, Any]] = []
    try:
        for _ in range(max(1, args.rounds)):
            for cached in sides:
                run = one_run(args.scenario, args.nodes, args.duration, cached)
                runs.append(run)
                print(json.dumps(run), flush=True)
    finally:
        VERIFIED.resize(DEFAULT_CAPACITY_BYTES)
        VERIFIED.clear()
    def medians(key: str) -> dict[str, float]:
        by_side: dict[str, list[float]] = {}
        for r in runs:
            if r[key] is not None:
                by_side.setdefault(r["code"], []).append(r[key])
        return {side: round(statistics.median(v), 2) for side, v in by_side.items()}

    print(json.dumps({"virtual_per_cpu_s_median": medians("virtual_per_cpu_s"),
                      "after_warmup_median": medians("after_warmup_virtual_per_cpu_s"),
                      "target": f">= {TARGET_VIRTUAL_PER_CPU_S:g} at N = 100"}))
    hashes = {r["trace_hash"] for r in runs}
    if len(hashes) > 1:
        print(f"the runs differ: trace hashes {sorted(hashes)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
