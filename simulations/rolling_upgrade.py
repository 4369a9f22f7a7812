"""A rolling upgrade of real `join` fellows, previous release to this one, one at a time
while a client generates and a job trains (``p2pswarm.sim.rolling_upgrade``).

The previous release (``PREVIOUS_RELEASE``) is built from this repository's history into
a folder of its own; ``--fellows`` fellows start, all but ``--new-at-start`` of them on
the previous release; once the mixed swarm serves and trains, each previous-release
fellow is stopped (SIGTERM) and started again on this release from its state directory,
as `docker service update --update-order stop-first --update-parallelism 1` does.

Figures (target: 0 and 0): client errors (a generation that failed, or answered other
tokens than the first), job restarts. Beside them: each replacement's timings, the
generations served and resumed, the steps a takeover went back to its last round.

    python simulations/rolling_upgrade.py [--fellows 6] [--new-at-start 1] \
        [--out rolling_upgrade] [--keep]

writes ``OUT.json`` and ``OUT.md`` and prints the markdown. Several minutes on two
busy cores.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from p2pswarm.sim.rolling_upgrade import (
    PREVIOUS_RELEASE,
    previous_release,
    repository_root,
    run,
    verdict,
)


def markdown(report: dict[str, Any], misses: list[str]) -> str:
    job = report.get("job") or {}
    lines = [
        f"# Rolling upgrade of {report['fellows']} fellows, {report['previous']} to this "
        "release, one at a time, while serving and training",
        "",
        "| figure | value | target |",
        "|---|---|---|",
        f"| client errors | {report['client_errors']} of {report['generations']} "
        "generations | 0 |",
        f"| job restarts | {job.get('restarts', '-')} | 0 |",
        f"| terms with two leaders | {len(report['terms_with_two_leaders'])} | 0 |",
        f"| generations resumed across a stop | {report['resumes']} | |",
        f"| steps a takeover went back (to its last round) | {job.get('steps_back', '-')} | |",
        f"| upgrade, first stop to last settled | {report.get('upgrade_s', '-')} s | |",
        f"| whole run | {report['run_s']} s | |",
        "",
        f"Mixed swarm: {len(report['old_fellows'])} previous and "
        f"{len(report['new_fellows'])} current fellows, leader "
        f"{(report.get('mixed_leader') or {}).get('name', '-')} "
        f"({(report.get('mixed_leader') or {}).get('release', '-')}); the load's stages "
        + ("only on the fellows of this release from the start." if report["serve_on_new"]
           else "where the planner put them.")
        + f" Protocols as {report['new_fellows'][0]} saw them: "
        f"{report.get('mixed_protocols', '-')}.",
        "",
        "| fellow | led | held a stage | trained | left cleanly | stop s | member again s | "
        "settled s | job step | client errors |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for step in report.get("replaced", []):
        trained = step["fellow"] in step["replica_fellows"]
        lines.append(f"| {step['fellow']} | {'yes' if step['was_leader'] else ''} | "
                     f"{'yes' if step['held_stage'] else ''} | {'yes' if trained else ''} | "
                     f"{'yes' if step['left_cleanly'] else 'killed'} | {step['stop_s']} | "
                     f"{step['member_again_s']} | {step['settled_s']} | {step['job_step']} | "
                     f"{step['error_count']} |")
    lines += ["", f"Job: {job.get('state', '-')} at step {job.get('step', '-')}, round "
              f"{job.get('round', '-')}; moves: {job.get('moves', [])}", ""]
    lines.append("Every target met." if not misses else
                 "Missed: " + "; ".join(misses))
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fellows", type=int, default=6)
    parser.add_argument("--new-at-start", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("rolling_upgrade"))
    parser.add_argument("--keep", action="store_true", help="keep the fellows' state and logs")
    parser.add_argument("--serve-on-new", action="store_true",
                        help="place the load's stages only on the fellows of this release "
                             "from the start (never stopped)")
    args = parser.parse_args()
    if not 0 < args.new_at_start < args.fellows:
        parser.error("--new-at-start must be at least 1 and less than --fellows")
    repo = repository_root()
    if repo is None:
        print("error: not in a git checkout: the previous release is built from its history",
              file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="p2pswarm-previous-") as scratch:
        previous = previous_release(repo, Path(scratch) / PREVIOUS_RELEASE)
        report = run(previous=previous, fellows=args.fellows, new_at_start=args.new_at_start,
                     seed=args.seed, keep=args.keep, serve_on_new=args.serve_on_new,
                     say=lambda line: print(line, flush=True))
    misses = verdict(report)
    report["verdict"] = misses
    text = markdown(report, misses)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(text)
    print(text)
    return 1 if misses else 0


if __name__ == "__main__":
    sys.exit(main())
