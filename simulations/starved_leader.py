"""Does leadership hold while training starves the fellows' CPUs? A calm swarm of real
`p2pswarm join` fellows on loopback, tiny-llama loaded and a DiLoCo job training, no
event at all: how many terms it goes through, and (at the end) how long a new leader
takes after the leader is killed (SIGKILL).

    python simulations/starved_leader.py [--fellows 6] [--minutes 5] [--seed 1] [--json]
    python simulations/starved_leader.py --twin /work/main   # side by side with that checkout

``--twin DIR`` starts a second swarm of the same size beside the first, running the
package from ``DIR`` (another checkout, e.g. before a change): both load, both train
the same job, both are counted over the same minutes, so the two figures share the
machine's load. ``--compute-nice N`` is handed to this checkout's fellows,
``--twin-compute-nice N`` to the twin's (a checkout that has the option).

Counted: the terms some fellow followed a leader in (from every fellow's log) that
began during the window, per minute and in all; the load average (``uptime``) at each
minute. The machine's other work is part of the measurement: report it beside the
figures.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from p2pswarm.errors import SwarmError  # noqa: E402
from p2pswarm.sim.chaos import FELLOW_MEMORY, Field, _form, _load, job_config  # noqa: E402
from p2pswarm.sim.field import followed_per_term, free_address  # noqa: E402
from p2pswarm.sim.processes import local_swarm  # noqa: E402


def uptime() -> str:
    text = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    return text[text.find("load average"):] if "load average" in text else text


def terms(swarm: Field) -> set[int]:
    return set(followed_per_term(swarm.swarm))


def loop_lags(swarm: Field) -> dict[str, Any]:
    """Each running fellow's own loop lag (``status``'s ``loop_lag``: how late its
    timers rang); a checkout that does not measure it reports none."""
    lags = {}
    for name in swarm.running():
        try:
            lags[name] = swarm.swarm.status(name).get("loop_lag")
        except SwarmError:
            lags[name] = "no answer"
    return lags


def late_in_window(before: dict[str, Any], after: dict[str, Any]) -> dict[str, int] | None:
    """Timers that rang more than 0.1 s and 1 s late during the window, all fellows."""
    late = {"over_0_1_s": 0, "over_1_s": 0}
    for name, lag in after.items():
        if not isinstance(lag, dict) or not isinstance(before.get(name), dict):
            return None
        for key in late:
            late[key] += int(lag[key]) - int(before[name][key])
    return late


def leader_kill(swarm: Field, timeout_s: float = 60.0) -> dict[str, Any]:
    """SIGKILL the leader every fellow names; seconds until the others name a new one."""
    first = swarm.leader_now()
    deadline = time.monotonic() + 30
    while first is None and time.monotonic() < deadline:
        time.sleep(0.2)
        first = swarm.leader_now()
    if first is None:
        return {"killed": None, "new_leader_s": None}
    swarm.swarm.processes[first].send_signal(signal.SIGKILL)
    swarm.swarm.processes[first].wait()
    killed_at = time.monotonic()
    swarm.up[first] = False
    swarm.told_to_stop.add(first)
    while time.monotonic() < killed_at + timeout_s:
        now = swarm.leader_now()
        if now is not None and now != first:
            return {"killed": first, "new_leader": now,
                    "new_leader_s": round(time.monotonic() - killed_at, 2)}
        time.sleep(0.1)
    return {"killed": first, "new_leader_s": None}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fellows", type=int, default=6)
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--twin", type=Path, default=None,
                        help="another checkout whose package a twin swarm runs")
    parser.add_argument("--compute-nice", type=int, default=None,
                        help="--compute-nice for this checkout's fellows")
    parser.add_argument("--twin-compute-nice", type=int, default=None,
                        help="--compute-nice for the twin's fellows")
    parser.add_argument("--no-kill", action="store_true", help="skip the leader kill")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--keep", action="store_true", help="keep state and logs")
    args = parser.parse_args()
    def say(line: str) -> None:
        if not args.json:
            print(line, flush=True)
    names = [f"f{i}" for i in range(args.fellows)]
    extra = ("--cpu-memory", FELLOW_MEMORY, "--log-level", "info")
    here = extra + (("--compute-nice", str(args.compute_nice))
                    if args.compute_nice is not None else ())
    # long enough to train through the window and the kill
    job = job_config(model="tiny-llama", steps=100_000, seed=args.seed, seq_len=64,
                     checkpoint_dir=Path("checkpoints"))
    labels = ["this"] + (["twin"] if args.twin else [])
    report: dict[str, Any] = {"fellows": args.fellows, "minutes": args.minutes,
                              "uptime_before": uptime(), "swarms": {}}
    with local_swarm(say, keep=args.keep, start_timeout_s=180) as this_swarm, \
            local_swarm(say, keep=args.keep, start_timeout_s=180) as twin_swarm:
        if args.twin:
            twin = str(args.twin.resolve())  # (`python -m` imports from its directory)
            twin_swarm.env, twin_swarm.cwd = {"PYTHONPATH": twin}, Path(twin)
        swarms = {"this": Field(this_swarm, names, random.Random(args.seed),
                                {n: free_address() for n in names}, {n: False for n in names},
                                extra=here)}
        if args.twin:
            swarms["twin"] = Field(twin_swarm, names, random.Random(args.seed),
                                   {n: free_address() for n in names},
                                   {n: False for n in names},
                                   extra=extra + (("--compute-nice", str(args.twin_compute_nice))
                                                  if args.twin_compute_nice is not None else ()))
        try:
            began = time.monotonic()
            _form(tuple(swarms.values()), 600.0, say)
            say(f"formed in {time.monotonic() - began:.0f} s [{uptime()}]")
            for label, swarm in swarms.items():
                _load(swarm, "tiny-llama")
                config = {**job, "checkpoint": {**job["checkpoint"],
                                                "dir": str(swarm.swarm.root / "checkpoints")}}
                swarm.ask({"op": "job_submit", "config": config}, timeout_s=120)
                say(f"{label}: tiny-llama loaded, job submitted ({time.monotonic() - began:.0f} s)")
            time.sleep(20.0)  # the job's stages build and start training before counting
            at_start = {label: terms(s) for label, s in swarms.items()}
            lags_at_start = {label: loop_lags(s) for label, s in swarms.items()}
            seen = dict(at_start)
            per_minute: dict[str, list[int]] = {label: [] for label in labels}
            loads = []
            window_began = time.monotonic()
            for minute in range(int(args.minutes + 0.999)):
                time.sleep(max(0.0, window_began + 60 * (minute + 1) - time.monotonic()))
                loads.append(uptime())
                line = []
                for label, swarm in swarms.items():
                    now = terms(swarm)
                    per_minute[label].append(len(now - seen[label]))
                    seen[label] = now
                    job_state = swarm.ask({"op": "jobs"}, timeout_s=10)
                    step = job_state[0].get("step") if job_state else None
                    line.append(f"{label} {per_minute[label][-1]} new terms, job step {step}")
                say(f"minute {minute + 1}: {'; '.join(line)} [{loads[-1]}]")
            window_s = time.monotonic() - window_began
            for label, swarm in swarms.items():
                entry: dict[str, Any] = {
                    "terms_in_window": len(seen[label] - at_start[label]),
                    "terms_per_5_min": round(len(seen[label] - at_start[label])
                                             * 300.0 / window_s, 1),
                    "per_minute": per_minute[label], "terms_before_window": len(at_start[label]),
                    "loop_lag": loop_lags(swarm),
                    "late_wakes_in_window": late_in_window(lags_at_start[label],
                                                           loop_lags(swarm))}
                report["swarms"][label] = entry
            report["window_s"] = round(window_s, 1)
            report["uptime_each_minute"] = loads
            if not args.no_kill:
                for label, swarm in swarms.items():
                    report["swarms"][label]["leader_kill"] = leader_kill(swarm)
                    say(f"{label}: leader kill {report['swarms'][label]['leader_kill']}")
        except SwarmError as exc:
            report["failed"] = str(exc).splitlines()[0]
            say(f"ended early: {report['failed']}")
    report["uptime_after"] = uptime()
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for label, entry in report["swarms"].items():
            who = "this checkout" if label == "this" else f"twin ({args.twin})"
            print(f"{who}: {entry['terms_in_window']} new terms in {report['window_s']:g} s "
                  f"({entry['terms_per_5_min']:g} per 5 min; per minute "
                  f"{entry['per_minute']}); leader kill: {entry.get('leader_kill')}; "
                  f"late timers in the window: {entry.get('late_wakes_in_window')}")
            for name, lag in entry.get("loop_lag", {}).items():
                print(f"  {name} loop lag: {lag}")
        print(f"load: before [{report['uptime_before']}], after [{report['uptime_after']}]")
    return 1 if report.get("failed") else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
