"""The fleet rehearsal: the fleet training plan on a fleet file, trained in virtual time,
against the best single pipeline (``p2pswarm.sim.fleet_rehearsal``; the same as
``p2pswarm simulate fleet``).

    python simulations/fleet_rehearsal.py                              # the shipped file
    python simulations/fleet_rehearsal.py --bandwidth 1.25e6 --out DIR # slower links, files
    python simulations/fleet_rehearsal.py --model simulations/models/rwkv7-1b --seq-len 256

The plan is made for ``--model`` (its step times, batches and bytes); the learning is the
small Llama's, scaled as ``p2pswarm.sim.fleet_rehearsal`` says.

Prints the report: rounds closed, time to the single pipeline's final held-out loss (and
how much faster than that pipeline), the longest gap between two round closes against
the round deadline, the time lost to W3 drops, and the busiest fellow's bytes. With
``--out``: result.json, report.md and loss.png (loss against virtual time).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from p2pswarm.errors import ConfigError  # noqa: E402
from p2pswarm.models.files import read_model_config  # noqa: E402
from p2pswarm.sim.fleet_rehearsal import (  # noqa: E402
    AVERAGE,
    DILOCO,
    PEAK_LR,
    WEIGHTINGS,
    markdown,
    rehearse,
    write_plot,
)

OUTER = {"average": AVERAGE, "diloco": DILOCO}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cluster", type=Path,
                        default=ROOT / "simulations" / "clusters" / "fleet.json")
    parser.add_argument("--model", help="the model the plan is made for: a directory, "
                        "config.json or known name (default: the 1.1B Llama shape)")
    parser.add_argument("--bandwidth", type=float, help="bytes/s of every link, e.g. 1.25e6")
    parser.add_argument("--latency", type=float, help="seconds of every link's latency")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=40,
                        help="steps of the single pipeline (its final loss is the target)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-drops", action="store_true", help="skip the W3 run")
    parser.add_argument("--outer", choices=sorted(OUTER), default="average",
                        help="the fleet's outer optimizer: plain averaging (outer lr 1, no "
                        "momentum) or DiLoCo's (outer lr 0.7, Nesterov 0.9)")
    parser.add_argument("--stages-kept", action="store_true",
                        help="what if a fellow back after its suspicion time kept its stage "
                        "(the agent re-places the replica instead): its step goes on")
    parser.add_argument("--lr", type=float, default=PEAK_LR,
                        help="both arms' inner learning rate (constant)")
    parser.add_argument("--fleet-lr", type=float, help="the fleet's alone (default: --lr)")
    parser.add_argument("--single-batch", type=int,
                        help="the single pipeline's samples a step as rehearsed (default: "
                        "its plan's / 8); its step time scales in proportion")
    parser.add_argument("--weighting", choices=WEIGHTINGS, default="samples",
                        help="how the keeper weighs each delta: by samples (the product), "
                        "or, as what-ifs, by local steps or samples x steps")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    model = read_model_config(args.model)[1] if args.model else None
    try:
        result = rehearse(json.loads(args.cluster.read_text()), model=model,
                          seq_len=args.seq_len,
                          bandwidth=args.bandwidth, latency=args.latency,
                          single_steps=args.steps, seed=args.seed, drops=not args.no_drops,
                          outer=OUTER[args.outer], stages_kept=args.stages_kept,
                          lr=args.lr, fleet_lr=args.fleet_lr,
                          single_batch=args.single_batch, weighting=args.weighting)
    except ConfigError as exc:
        parser.error(str(exc))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
        (args.out / "report.md").write_text(markdown(result))
        note = write_plot(result, args.out / "loss.png")
        if note:
            print(note, file=sys.stderr)
    print(json.dumps(result, indent=2) if args.json else markdown(result), end="")


if __name__ == "__main__":
    main()
