"""Churn on real `p2pswarm join` processes while a model is loaded and a job trains:
random leaves, crashes, restarts, freezes (SIGSTOP/SIGCONT) and leader kills on
loopback, beside a calm swarm of the same size that loads and trains the same (see
``p2pswarm.sim.chaos`` for the events and what is measured).

    python simulations/chaos_real.py [--fellows 8] [--minutes 20] [--seed 1] [--json]
    python simulations/chaos_real.py --short [--fellows 4] [--seed 2] [--json]

The job (tiny-llama, two DiLoCo replicas, a checkpoint every 8 steps) is sized to last
about ``--minutes`` on a quiet two-core machine (``--steps`` overrides); the events stop
when the minutes are up or the job has ended. Exit status 1 when a target is missed.

``--short`` runs the default suite's version instead (``p2pswarm.sim.chaos_short``): a
few fellows, one leave, freeze, crash and leader kill each, no model and no job.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from p2pswarm.sim import chaos_short  # noqa: E402
from p2pswarm.sim.chaos import job_config, run, verdict  # noqa: E402

STEPS_PER_MINUTE = 12  # tiny-llama, seq 64, two replicas beside a twin swarm, 2 cores


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fellows", type=int, default=8)
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--steps", type=int, default=0, help="job steps (default: "
                        f"{STEPS_PER_MINUTE} a minute)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--keep", action="store_true", help="keep state and logs")
    parser.add_argument("--short", action="store_true", help="the default suite's short "
                        "version: one event of each kind, no model or job")
    args = parser.parse_args()
    if args.short:
        return short(args)
    steps = args.steps or max(16, int(STEPS_PER_MINUTE * args.minutes))
    job = job_config(model="tiny-llama", steps=steps, seed=args.seed, seq_len=64,
                     checkpoint_dir=Path("checkpoints"))
    say = (lambda m: None) if args.json else print
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    report = run(fellows=args.fellows, minutes=args.minutes, seed=args.seed, say=say,
                 job=job, job_timeout_s=180.0, keep=args.keep)
    report["uptime_before"] = load
    report["uptime_after"] = subprocess.run(["uptime"], capture_output=True,
                                            text=True).stdout.strip()
    misses = verdict(report)
    if args.json:
        print(json.dumps({**report, "misses": misses}, indent=2))
    else:
        w, jobs = report["leader_within_s"], report["job"]
        print(f"{report['fellows']} fellows, {report['events_s']:.0f} s of events: "
              f"{report['events']} {report['events_by_kind']}")
        print(f"terms: {report['terms']}, with two leaders: "
              f"{report['terms_with_two_leaders'] or 'none'}")
        print(f"leaderless spells with a majority up: {report['leaderless_spells']}; "
              f"leader within p50 {w['p50']} s, p99 {w['p99']} s, max {w['max']} s")
        for label in ("chaos", "calm"):
            j = jobs[label]
            print(f"job ({label}): {j['state']} at step {j['step']}, final loss "
                  f"{j['final_loss']}, restarts {j['restarts']}, checkpoints "
                  f"{j['checkpoints_seen']}")
            for move in j["moves"]:
                print(f"  {move}")
        print(f"final loss gap: {report['loss_gap']}; checkpoints lost: "
              f"{report['checkpoints_lost'] or 'none'}; agents crashed: "
              f"{report['agents_crashed'] or 'none'}; served at the end: "
              f"{report['served_at_end']}")
        print(f"idle gossip per fellow (B/s): {report['idle_gossip_b_s']} against "
              f"{report['idle_gossip_reference_b_s']:g}")
        print(f"load: before [{report['uptime_before']}], after [{report['uptime_after']}]")
        print("targets: " + ("all met" if not misses else "MISSED: " + "; ".join(misses)))
    return 1 if misses else 0


def short(args: argparse.Namespace) -> int:
    say = (lambda m: None) if args.json else print
    fellows = 4 if args.fellows == 8 else args.fellows  # (8 is the long run's default)
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    report = chaos_short.run(fellows=fellows, seed=args.seed, say=say, keep=args.keep)
    report["uptime_before"] = load
    report["uptime_after"] = subprocess.run(["uptime"], capture_output=True,
                                            text=True).stdout.strip()
    misses = chaos_short.verdict(report)
    if args.json:
        print(json.dumps({**report, "misses": misses}, indent=2))
    else:
        kill = report["events"][0] if report["events"] else {}
        print(f"{report['fellows']} fellows formed in {report['formed_s']} s; "
              f"{len(report['events'])} events in {report['run_s']} s in all")
        print(f"terms: {report['terms']}, with two leaders: "
              f"{report['terms_with_two_leaders'] or 'none'}; new leader "
              f"{kill.get('new_leader_s')} s after the leader kill")
        print(f"leaderless spells with a majority up (s): {report['leaderless_s']}; started "
              f"again to naming the leader (s): {report['joined_s']}; agents "
              f"crashed: {report['agents_crashed'] or 'none'}")
        print(f"load: before [{report['uptime_before']}], after [{report['uptime_after']}]")
        print("targets: " + ("all met" if not misses else "MISSED: " + "; ".join(misses)))
    return 1 if misses else 0


if __name__ == "__main__":
    sys.exit(main())
