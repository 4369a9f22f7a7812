"""What the W3 false-death figure rests on: the same verdicts judged on stricter terms.

    python simulations/w3_cutoffs.py --seeds 24 --jobs 2

The `w3` scenario excuses a false death if the two fellows were cut apart (a roaming
outage, or a radio fade of 2 s or more: `checks.blackout_min_s`) within 30 s before the
verdict (`checks.excuse_window_s`). This runs seeded W3 hours with real agents at this
code (the scenario and seeds of `bench_harness.py --only w3`: seed s is hour s) and
judges every false-death verdict again with a shorter window and with fades counting as
a cut only from 3 s, the cut-off of the pure machines' `false_dead` figure. It also
counts the hours' false suspicions (of reachable fellows, and all). Each hour's counts
are saved under --out and reused unless --fresh. Prints the totals and one markdown
table.
"""

from __future__ import annotations

import argparse
import json
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from p2pswarm.sim.harness import play_scenario
from p2pswarm.sim.scenario import load_scenario

OUT = Path(__file__).resolve().parent / "results"
WINDOWS_S = (30.0, 5.0)
FADE_CUTS_S = (2.0, 3.0)


def judge_hour(args: tuple[int, str, bool]) -> dict[str, Any]:
    seed, out, fresh = args
    path = Path(out) / f"w3cut-s{seed}.json"
    if path.exists() and not fresh:
        saved = json.loads(path.read_text())
        if "suspicions" in saved:
            return saved
    scenario = load_scenario("w3").with_overrides(duration_s=3660.0, seed=seed)
    oracle = play_scenario(scenario).oracle
    hour: dict[str, Any] = {
        "seed": seed,
        "verdicts": len(oracle.false_deaths),
        "suspicions": len(oracle.false_suspicion_episodes),
        "suspicions_reachable": len(oracle.false_suspicion_episodes
                                    - oracle.excused_suspicion_episodes),
        "judged": {f"{w:g}/{c:g}": oracle.false_deaths_judged(w, c)
                   for w in WINDOWS_S for c in FADE_CUTS_S},
    }
    path.write_text(json.dumps(hour, indent=1))
    return hour


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=24, help="seeded W3 hours (1..N)")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--fresh", action="store_true", help="run again, ignoring saved hours")
    args = ap.parse_args()
    if args.seeds < 1 or args.jobs < 1:
        ap.error("--seeds and --jobs must be at least 1")
    args.out.mkdir(parents=True, exist_ok=True)
    tasks = [(s, str(args.out), args.fresh) for s in range(1, args.seeds + 1)]
    with ProcessPoolExecutor(args.jobs) as pool:
        hours = list(pool.map(judge_hour, tasks))
    print(f"N = 50, W3, ours, {len(hours)} seeded hours: "
          f"{sum(h['verdicts'] for h in hours):,} false-death verdicts in all; false "
          f"suspicions of reachable fellows {sum(h['suspicions_reachable'] for h in hours):,}"
          f" (all {sum(h['suspicions'] for h in hours):,}), per hour "
          f"{min(h['suspicions_reachable'] for h in hours)} to "
          f"{max(h['suspicions_reachable'] for h in hours)}\n")
    print("| excused if cut apart within | radio fades that count as a cut | "
          "unexcused verdicts | unexcused episodes | episodes per hour |")
    print("|---|---|---|---|---|")
    for w in WINDOWS_S:
        for c in FADE_CUTS_S:
            key = f"{w:g}/{c:g}"
            verdicts = sum(h["judged"][key]["verdicts"] for h in hours)
            per_hour = [h["judged"][key]["episodes"] for h in hours]
            print(f"| {w:g} s | >= {c:g} s | {verdicts:,} | {sum(per_hour)} | "
                  f"{', '.join(map(str, per_hour))} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
