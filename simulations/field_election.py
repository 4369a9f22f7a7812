"""The election on real `p2pswarm join` processes, as users meet it (p2pswarm.sim.field).

1. The seed started last: two fellows point at a seed that boots a few seconds after
   them; whom every fellow followed in each term, from its own log. Target: 0 terms with
   two leaders.
2. A leave, then a leader crash: four fellows, one leaves, the leader is SIGKILLed; the
   time until the two left agree on a new leader (target <= 10 s), then every fellow
   restarted from its home: a leader again.

    python simulations/field_election.py [--seed-last 20] [--leave-crash 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from p2pswarm.sim.field import leave_then_leader_crash, seed_last
from p2pswarm.sim.processes import local_swarm


def one_seed_last(_: int) -> dict[str, Any]:
    with local_swarm(lambda message: None, start_timeout_s=120) as swarm:
        return seed_last(swarm)


def one_leave_crash(_: int) -> dict[str, Any]:
    with local_swarm(lambda message: None, start_timeout_s=120) as swarm:
        return leave_then_leader_crash(swarm)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed-last", type=int, default=20, help="runs of scenario 1")
    parser.add_argument("--leave-crash", type=int, default=3, help="runs of scenario 2")
    parser.add_argument("--parallel", type=int, default=4, help="swarms at a time (1)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with ThreadPoolExecutor(args.parallel) as pool:
        seed_runs = list(pool.map(one_seed_last, range(args.seed_last)))
    crash_runs = [one_leave_crash(i) for i in range(args.leave_crash)]
    split = sum(1 for r in seed_runs + crash_runs if r["two_leaders"])
    failover = [r["new_leader_s"] for r in crash_runs]
    report = {
        "seed_last_runs": len(seed_runs),
        "leave_crash_runs": len(crash_runs),
        "runs_with_two_leaders_in_a_term": split,
        "leave_recorded_as": sorted({r["leave_recorded_as"] for r in crash_runs}),
        "new_leader_after_crash_s": {"median": statistics.median(failover),
                                     "max": max(failover)} if failover else None,
        "leader_after_restart_s": [r["restart_leader_s"] for r in crash_runs],
        "runs": {"seed_last": seed_runs, "leave_crash": crash_runs},
    }
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        print(f"seed started last:   {len(seed_runs)} swarms, "
              f"{sum(1 for r in seed_runs if r['two_leaders'])} with two leaders in a term")
        if failover:
            print(f"leave, leader crash: {len(crash_runs)} runs, new leader after "
                  f"{statistics.median(failover):.2f} s median, {max(failover):.2f} s max; "
                  f"leave recorded as {', '.join(report['leave_recorded_as'])}; "
                  f"{sum(1 for r in crash_runs if r['two_leaders'])} with two leaders")
    return 1 if split else 0


if __name__ == "__main__":
    sys.exit(main())
