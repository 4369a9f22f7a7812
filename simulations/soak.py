"""A soak run on real `p2pswarm join` processes: a small swarm serves a steady stream of
generations against a loaded model and trains a small job, while one fellow is killed
(SIGKILL) and started again every ``--restart-every`` minutes, for ``--minutes``. Each
fellow's RSS, open files, threads (from /proc), the disk use of its home and its loop
lag (``status``'s ``self_watch``) are sampled; the report (JSON, markdown, plots when
matplotlib is installed) gives a verdict per series of the longest-lived fellow: the
mean of the run's last third against its first third.

    nice -n 10 python simulations/soak.py [--fellows 4] [--minutes 15] [--restart-every 3]
        [--settle-min 5] [--out soak-report] [--keep]

The first ``--settle-min`` minutes (loading, the job's first checkpoints filling the
stores) are left out of the verdicts. A series "grows" when its last third passes its
first third by more than its tolerance
(RSS 5 %, threads and open files 2 more, disk 10 %); anything that grows without bound
is a bug. Exit status 1 when a series grows, a generation failed or a disk passed its
cap.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from p2pswarm.control.client import request  # noqa: E402
from p2pswarm.errors import SwarmError  # noqa: E402
from p2pswarm.sim.chaos import FELLOW_MEMORY, Field, JobWatch, _form, _load, job_config  # noqa: E402
from p2pswarm.sim.field import free_address  # noqa: E402
from p2pswarm.sim.processes import local_swarm  # noqa: E402

SERIES = ("rss_bytes", "open_files", "threads", "home_bytes", "loop_lag_ms")
# how far the last third may pass the first before the series "grows"
TOLERANCE: dict[str, tuple[float, float]] = {  # (relative, absolute)
    "rss_bytes": (0.05, 0.0), "open_files": (0.0, 2.0), "threads": (0.0, 2.0),
    "home_bytes": (0.10, 0.0), "loop_lag_ms": (1.0, 50.0)}
STEPS_PER_MINUTE = 10  # tiny-llama, seq 64, two replicas, on a busy two-core machine


def proc_sample(pid: int) -> dict[str, int] | None:
    """RSS, threads and open files of process ``pid`` from /proc; None once it is gone
    (or exiting: a zombie's status has no memory lines)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    if "VmRSS" not in fields:
        return None
    return {"rss_bytes": int(fields["VmRSS"].split()[0]) * 1024,
            "threads": int(fields["Threads"]), "open_files": fds}


def tree_bytes(root: Path) -> int:
    """Bytes of the files under ``root`` (a file that vanishes while walking is skipped)."""
    total = 0
    for directory, _, files in os.walk(root):
        for name in files:
            try:
                total += os.lstat(os.path.join(directory, name)).st_size
            except OSError:
                pass
    return total


@dataclass
class Traffic:
    """The steady stream of generations, from a thread of this process."""

    done: int = 0
    failed: int = 0
    failures: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self, swarm: Field, gap_s: float) -> None:
        while not self.stop.is_set():
            try:
                swarm.ask({"op": "generate", "prompt": "The swarm", "max_tokens": 8},
                          timeout_s=60, streamed=True)
                self.done += 1
            except SwarmError as exc:
                self.failed += 1
                self.failures.append(f"{time.strftime('%H:%M:%S')} "
                                     f"{str(exc).splitlines()[0] if str(exc) else exc!r}")
            self.stop.wait(gap_s)


def sample(swarm: Field, t_s: float) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for name in swarm.running():
        process = swarm.swarm.processes[name]
        proc = proc_sample(process.pid)
        if proc is None:
            continue
        row: dict[str, Any] = {"t_s": round(t_s, 1), "pid": process.pid, **proc,
                               "home_bytes": tree_bytes(swarm.swarm.homes[name])}
        try:
            status = request(swarm.swarm.homes[name], {"op": "status"}, timeout_s=5)
            row["loop_lag_ms"] = float(status["self_watch"]["loop_lag_ms"])
            row["disks"] = status.get("disks")
            row["role"] = status.get("role")
        except (SwarmError, KeyError, TypeError):
            row["loop_lag_ms"] = None
        out[name] = row
    return out


def verdict(values: list[float], series: str) -> dict[str, Any]:
    """Flat or growing: the mean of the last third against the first third."""
    if len(values) < 3:
        return {"verdict": "too short", "samples": len(values)}
    third = len(values) // 3
    first, last = statistics.fmean(values[:third]), statistics.fmean(values[-third:])
    relative, absolute = TOLERANCE[series]
    grows = last > first * (1 + relative) + absolute
    return {"verdict": "growing" if grows else "flat", "first_third": round(first, 1),
            "last_third": round(last, 1),
            "change_pct": round(100 * (last - first) / first, 1) if first else None,
            "max": max(values), "samples": len(values)}


def plot(samples: list[dict[str, Any]], names: list[str], path: Path,
         restarts: list[dict[str, Any]], settle_s: float) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plots skipped: matplotlib is not installed (pip install matplotlib)"
    scale = {"rss_bytes": 2**20, "home_bytes": 2**20}
    labels = {"rss_bytes": "RSS (MiB)", "home_bytes": "home on disk (MiB)",
              "open_files": "open files", "threads": "threads", "loop_lag_ms": "loop lag (ms)"}
    fig, axes = plt.subplots(len(SERIES), 1, figsize=(8, 2.2 * len(SERIES)), sharex=True)
    for ax, series in zip(axes, SERIES):
        for name in names:
            points = [(s["t_s"] / 60, s["fellows"][name][series] / scale.get(series, 1))
                      for s in samples if name in s["fellows"]
                      and s["fellows"][name].get(series) is not None]
            if points:
                ax.plot(*zip(*points), marker=".", markersize=3, linewidth=1, label=name)
        ax.set_ylabel(labels[series])
        for r in restarts:  # a kill and restart: a dotted line
            ax.axvline(r["t_s"] / 60, color="grey", linestyle=":", linewidth=0.8)
        ax.axvspan(0, settle_s / 60, color="grey", alpha=0.1)  # left out of the verdicts
    axes[0].legend(ncol=len(names), fontsize="small")
    axes[-1].set_xlabel("minutes")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return None


def markdown(report: dict[str, Any]) -> str:
    lines = [f"# Soak: {report['fellows']} fellows, {report['minutes']:g} min, a fellow "
             f"killed every {report['restart_every_min']:g} min", "",
             f"longest-lived fellow: {report['longest_lived']}; restarts: "
             f"{len(report['restarts'])}; generations: {report['generations']['done']} done, "
             f"{report['generations']['failed']} failed; job: {report['job'].get('state')} "
             f"at step {report['job'].get('step')}, restarts {report['job_restarts']}", "",
             f"verdicts on the longest-lived fellow after the first {report['settle_min']:g} "
             "min: the mean of the last third against the first third", "",
             "| series | first third | last third | change | verdict |", "|---|---|---|---|---|"]
    for series, v in report["verdicts"].items():
        lines.append(f"| {series} | {v.get('first_third')} | {v.get('last_third')} | "
                     f"{v.get('change_pct')} % | {v['verdict']} |")
    lines += ["", "disk use of each fellow's home at the end (bytes), and its stores "
              "against their caps as status last gave them:", ""]
    last = report["samples"][-1]["fellows"] if report["samples"] else {}
    for name, used in report["home_bytes_end"].items():
        stores = ", ".join(f"{d['store']} {d['used_bytes'] / 1e6:,.0f}"
                           + (f"/{d['cap_bytes'] / 1e6:,.0f}" if d.get("cap_bytes") else "")
                           + " MB" for d in (last.get(name, {}).get("disks") or []))
        lines.append(f"- {name}: {used:,}" + (f" ({stores})" if stores else ""))
    if report["disk_over_cap"]:
        lines += ["", "stores over their cap: " + "; ".join(report["disk_over_cap"])]
    if report["generations"]["failures"]:
        lines += ["", "failed generations:", ""]
        lines += [f"- {f}" for f in report["generations"]["failures"][:20]]
    return "\n".join(lines) + "\n"


def over_cap(samples: list[dict[str, Any]]) -> list[str]:
    """Stores that status showed above their cap, once each."""
    seen: set[str] = set()
    for s in samples:
        for name, row in s["fellows"].items():
            for store in row.get("disks") or []:
                if store.get("cap_bytes") and store["used_bytes"] > store["cap_bytes"]:
                    seen.add(f"{name} {store['store']}")
    return sorted(seen)


def run(args: argparse.Namespace, say: Any) -> dict[str, Any]:
    names = [f"f{i}" for i in range(args.fellows)]
    extra = ("--cpu-memory", FELLOW_MEMORY, "--log-level", "info")
    samples: list[dict[str, Any]] = []
    restarts: list[dict[str, Any]] = []
    traffic = Traffic()
    steps = args.steps or max(16, int(STEPS_PER_MINUTE * args.minutes))
    with local_swarm(say, keep=args.keep, start_timeout_s=120) as local:
        swarm = Field(local, names, random.Random(args.seed),
                      {n: free_address() for n in names}, {n: False for n in names},
                      extra=extra)
        _form((swarm,), 600.0, say)
        say("swarm formed; loading tiny-llama")
        _load(swarm, "tiny-llama")
        job = job_config(model="tiny-llama", steps=steps, seed=args.seed, seq_len=64,
                         checkpoint_dir=local.root / "checkpoints")
        watch = JobWatch(str(swarm.ask({"op": "job_submit", "config": job},
                                       timeout_s=120)["job_id"]))
        say(f"job {watch.job_id} submitted ({steps} steps); serving and sampling")
        worker = threading.Thread(target=traffic.run, args=(swarm, args.request_gap),
                                  daemon=True)
        worker.start()
        args.out.mkdir(parents=True, exist_ok=True)
        streamed = args.out / "samples.jsonl"
        streamed.unlink(missing_ok=True)
        began = time.monotonic()
        next_kill = began + args.restart_every * 60
        victims = names[1:]  # f0 is never killed: the longest-lived fellow
        killed = 0
        try:
            while (now := time.monotonic()) < began + args.minutes * 60:
                samples.append({"t_s": now - began, "fellows": sample(swarm, now - began)})
                with open(streamed, "a") as f:  # what a run cut short still leaves
                    f.write(json.dumps(samples[-1]) + "\n")
                watch.poll(swarm)
                if now >= next_kill and victims:
                    victim = victims[killed % len(victims)]
                    killed += 1
                    local.processes[victim].send_signal(signal.SIGKILL)
                    local.processes[victim].wait()
                    swarm.up[victim] = False
                    time.sleep(args.down_s)
                    swarm.start(victim)
                    restarts.append({"t_s": round(now - began, 1), "fellow": victim})
                    say(f"  {(now - began) / 60:.1f} min: {victim} killed and started again; "
                        f"{traffic.done} generations, {traffic.failed} failed; job step "
                        f"{watch.last.get('step')}")
                    next_kill += args.restart_every * 60
                time.sleep(args.sample_s)
        finally:
            traffic.stop.set()
            worker.join(timeout=70)
        watch.poll(swarm)
        home_end = {n: tree_bytes(local.homes[n]) for n in names}
        if args.keep:
            for n in names:
                say(f"  {n}: {home_end[n]:,} bytes in {local.homes[n]}")
    settled = [x for x in samples if x["t_s"] >= args.settle_min * 60]
    series = {s: [x["fellows"]["f0"][s] for x in settled
                  if "f0" in x["fellows"] and x["fellows"]["f0"].get(s) is not None]
              for s in SERIES}
    return {"fellows": args.fellows, "minutes": args.minutes,
            "restart_every_min": args.restart_every, "longest_lived": "f0",
            "settle_min": args.settle_min,
            "restarts": restarts,
            "generations": {"done": traffic.done, "failed": traffic.failed,
                            "failures": traffic.failures},
            "job": {k: watch.last.get(k) for k in ("job_id", "state", "step", "reason")},
            "job_restarts": watch.restarts(),
            "verdicts": {s: verdict(v, s) for s, v in series.items()},
            "disk_over_cap": over_cap(samples), "home_bytes_end": home_end,
            "samples": samples}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fellows", type=int, default=4)
    parser.add_argument("--minutes", type=float, default=15.0)
    parser.add_argument("--restart-every", type=float, default=3.0, help="minutes between "
                        "kills (SIGKILL) of a fellow, started again --down-s later")
    parser.add_argument("--down-s", type=float, default=5.0)
    parser.add_argument("--sample-s", type=float, default=10.0)
    parser.add_argument("--request-gap", type=float, default=1.0,
                        help="seconds between one generation's end and the next's start")
    parser.add_argument("--steps", type=int, default=0)
    parser.add_argument("--settle-min", type=float, default=5.0, help="minutes left out of "
                        "the verdicts: the model loading, the job's first steps and "
                        "checkpoints filling the stores (the plots show them, shaded)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("soak-report"))
    parser.add_argument("--keep", action="store_true", help="keep state and logs")
    args = parser.parse_args()
    if args.fellows < 3 or args.minutes <= 0 or args.restart_every <= 0:
        parser.error("--fellows must be 3 or more, --minutes and --restart-every above 0")
    if not 0 <= args.settle_min < args.minutes:
        parser.error("--settle-min must be at least 0 and under --minutes")
    report = run(args, lambda m: print(m, flush=True))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "soak.json").write_text(json.dumps(report, indent=1))
    (args.out / "soak.md").write_text(markdown(report))
    note = plot(report["samples"], [f"f{i}" for i in range(args.fellows)],
                args.out / "soak.png", report["restarts"], args.settle_min * 60)
    print(markdown(report))
    print(note or f"report in {args.out}/ (soak.json, soak.md, soak.png)")
    bad = (any(v["verdict"] == "growing" for k, v in report["verdicts"].items()
               if k != "loop_lag_ms")
           or report["generations"]["failed"] or report["disk_over_cap"])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
