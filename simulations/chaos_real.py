"""Churn on real `p2pswarm join` processes while a model is loaded and a job trains:
random leaves, crashes, restarts, freezes (SIGSTOP/SIGCONT) and leader kills on
loopback, beside a calm swarm of the same size that loads and trains the same (see
``p2pswarm.sim.chaos`` for the events and what is measured).

    python simulations/chaos_real.py [--fellows 8] [--minutes 20] [--seed 1] [--json]
    python simulations/chaos_real.py --idle [--fellows 8] [--minutes 2]   # no events
    python simulations/chaos_real.py --short [--fellows 4] [--seed 2] [--json]

The job (tiny-llama, two DiLoCo replicas, a checkpoint every 8 steps) is sized to last
about ``--minutes`` on a quiet two-core machine (``--steps`` overrides); the events stop
when the minutes are up or the job has ended. Exit status 1 when a target is missed.

``--keep`` keeps the state directories and logs, and ends by saying what they hold: the
total, each fellow's home with its stores (checkpoint copies, a leader's own
checkpoints, ...), the logs.

``--short`` runs the default suite's version instead (``p2pswarm.sim.chaos_short``): a
few fellows, one leave, freeze, crash and leader kill each, no model and no job.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from p2pswarm.sim import chaos_short  # noqa: E402
from p2pswarm.sim.chaos import LOSS_TOLERANCE, idle, job_config, run, verdict  # noqa: E402

STEPS_PER_MINUTE = 12  # tiny-llama, seq 64, two replicas beside a twin swarm, 2 cores


def verdict_table(report: dict[str, Any]) -> str:
    """One row per target: what was measured, the target, and whether it was met."""
    w, jobs = report["leader_within_s"], report["job"]
    chaos, calm = jobs["chaos"], jobs["calm"]
    reference = report["idle_gossip_reference_b_s"]
    idle = report["idle_window"]
    gossip = ", ".join(f"{label} {v['b_s']:g} ({v['suspicions']} suspicions, "
                       f"{v['refutations']} refutations in {v['window_s']:g} s)"
                       for label, v in idle.items()) or "not measured"
    rows = [
        ("run completed", report["failed"] or "yes", "yes", not report["failed"]),
        ("terms with two leaders", f"{report['terms_with_two_leaders'] or 0} of "
         f"{report['terms']} terms", "0", not report["terms_with_two_leaders"]),
        ("leader within, majority up", f"p50 {w['p50']} s, p99 {w['p99']} s, max "
         f"{w['max']} s ({report['leaderless_spells']} spells)", "p99 <= 10 s",
         w["p99"] <= 10.0),
        ("chaos job", f"{chaos['state']} at step {chaos['step']}, {chaos['restarts']} "
         "restarts", "finished, 0 restarts",
         chaos["state"] == "finished" and not chaos["restarts"]),
        ("calm job", f"{calm['state']} at step {calm['step']}", "finished",
         calm["state"] == "finished"),
        ("final held-out loss, chaos vs calm", f"{_num(chaos['final_loss'])} vs "
         f"{_num(calm['final_loss'])} (steps {chaos['final_step']}, {calm['final_step']}): "
         f"gap {_num(report['loss_gap'])}; training loss {_num(chaos['train_loss'])} vs "
         f"{_num(calm['train_loss'])}; samples {chaos.get('samples')} vs "
         f"{calm.get('samples')}",
         f"<= {LOSS_TOLERANCE:g}", report["loss_gap"] is not None
         and report["loss_gap"] <= LOSS_TOLERANCE),
        ("checkpoints lost", str(report["checkpoints_lost"] or 0), "0",
         not report["checkpoints_lost"]),
        ("agents crashed", str(report["agents_crashed"] or 0), "0",
         not report["agents_crashed"]),
        ("idle gossip per fellow (B/s)", gossip, f"{reference:g} +- 10 %",
         bool(idle) and all(abs(v["b_s"] - reference) <= 0.1 * reference
                            for v in idle.values())),
        ("served at the end", str(report["served_at_end"] or "not asked"), "", True),
    ]
    width = max(len(r[0]) for r in rows)
    return "\n".join(f"  {'ok  ' if ok else 'MISS'} {name:<{width}}  {measured}  "
                     f"[target {target}]" if target else
                     f"       {name:<{width}}  {measured}"
                     for name, measured, target, ok in rows)


def _num(x: float | None) -> str:
    return "none" if x is None else f"{x:.4g}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fellows", type=int, default=8)
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--steps", type=int, default=0, help="job steps (default: "
                        f"{STEPS_PER_MINUTE} a minute)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--keep", action="store_true", help="keep state and logs")
    parser.add_argument("--form-timeout", type=float, default=600.0,
                        help="seconds the two swarms may take to form")
    parser.add_argument("--idle", action="store_true", help="only the idle gossip of one "
                        "swarm of --fellows, over --minutes, with no events, job or load")
    parser.add_argument("--short", action="store_true", help="the default suite's short "
                        "version: one event of each kind, no model or job")
    args = parser.parse_args()
    if args.short:
        return short(args)
    if args.idle:
        before = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
        quiet = idle(fellows=args.fellows, window_s=args.minutes * 60, say=print)
        after = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
        if args.json:
            print(json.dumps({**quiet, "uptime_before": before, "uptime_after": after}))
        else:
            print(f"{quiet['fellows']} idle fellows, {quiet['window_s']:g} s: "
                  f"{quiet['b_s']:g} B/s per fellow ({quiet['suspicions']} suspicions, "
                  f"{quiet['refutations']} refutations); virtual figure for this size "
                  f"{quiet['reference_b_s']:g}")
            print(f"load: before [{before}], after [{after}]")
        return 0
    steps = args.steps or max(16, int(STEPS_PER_MINUTE * args.minutes))
    job = job_config(model="tiny-llama", steps=steps, seed=args.seed, seq_len=64,
                     checkpoint_dir=Path("checkpoints"))
    say = (lambda m: None) if args.json else (lambda m: print(m, flush=True))
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    report = run(fellows=args.fellows, minutes=args.minutes, seed=args.seed, say=say,
                 job=job, job_timeout_s=180.0, keep=args.keep,
                 form_timeout_s=args.form_timeout)
    report["uptime_before"] = load
    report["uptime_after"] = subprocess.run(["uptime"], capture_output=True,
                                            text=True).stdout.strip()
    misses = verdict(report)
    if args.json:
        print(json.dumps({**report, "misses": misses}, indent=2))
    else:
        print(f"{report['fellows']} fellows, {report['events_s']:.0f} s of events, "
              f"{report['run_s']:.0f} s in all: {report['events']} {report['events_by_kind']}")
        for label in ("chaos", "calm"):
            for move in report["job"][label]["moves"]:
                print(f"  {label} job: {move}")
        print(verdict_table(report))
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
