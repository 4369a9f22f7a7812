"""What a fresh optimizer costs mid-training, and what a ramp or borrowed moments save.

A replica placed again on a fellow that lost its stage starts with an AdamW state of no
moments; its first steps then move every weight by about the learning rate whatever the
gradient's noise. This trains the benchmark's small Llama on the corpus as one two-stage
pipeline (constant lr 3e-3, AdamW) five ways per seed, every stage's optimizer made anew
every ``--reset-every`` steps but in the first:

- undisturbed;
- anew: no moments after each reset;
- ramped: the same, the learning rate ramped over ``FRESH_RAMP_STEPS`` steps after each
  reset (what a stage built anew does where no replica trains, ``fresh_ramp``);
- borrowed: each new optimizer borrows the moments through bf16
  (``TrainStage.borrow_moments``; here its own old ones, so this measures what their
  bf16 trip costs; a stage placed again borrows another replica's);
- jittered: the moments kept in fp32, each multiplied by a random factor within
  1 +- 2^-9, the size of bf16's rounding: how far any tiny change to the trajectory
  moves the final loss (the noise floor the borrowed row is read against).

It reports each run's held-out loss against the undisturbed one, and the mean per way.

    python simulations/fresh_optimizer.py [--seeds 0 1 2 3 4 5] [--steps 600] \
        [--reset-every 25] [--json]

About 90 s per seed on one core.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch
from bench_training import MODEL, SEQ_LEN, corpus_data

from p2pswarm.training.data import TokenData
from p2pswarm.training.job import JobConfig
from p2pswarm.training.pipeline import LocalTrainPipeline
from p2pswarm.training.replica import build_stages
from p2pswarm.training.source import ScratchModel
from p2pswarm.training.stage import FRESH_RAMP_STEPS, TrainStage, fresh_ramp, make_optimizer

LR, BATCH = 3e-3, 4


def jittered(stage: TrainStage, draw: torch.Generator) -> dict[str, Any]:
    """``stage.moments()`` in fp32, each value off by a random factor within 1 +- 2^-9."""
    lent = {"start_layer": stage.start_layer, "end_layer": stage.end_layer,
            "optimizer": stage.optimizer_config.name, "moments": {}}
    for name, p in stage.named_trainable:
        state = {k: v.detach().clone() for k, v in stage.optimizer.state.get(p, {}).items()}
        for key, value in state.items():
            if key != "step":
                noise = torch.rand(value.shape, generator=draw) * 2 - 1
                state[key] = value * (1 + noise * 2.0 ** -9)
        if state:
            lent["moments"][name] = state
    return lent


def train(data: TokenData, seed: int, steps: int, reset_every: int, way: str) -> float:
    """Held-out loss after ``steps`` steps, optimizers made anew every ``reset_every``
    the ``way`` named (``WAYS``)."""
    torch.manual_seed(seed)
    config = JobConfig.from_dict({"model": {"config": MODEL}, "seq_len": SEQ_LEN,
                                  "micro_batch": BATCH, "steps": steps, "seed": seed,
                                  "lr": {"peak": LR, "schedule": "constant"}})
    stages = build_stages(config, ScratchModel(MODEL, seed), [1])
    pipeline = LocalTrainPipeline(stages, lr=config.lr)
    draw = torch.Generator().manual_seed(seed)
    jitter = torch.Generator().manual_seed(seed + 1000)
    since = None  # steps since the last reset without moments
    for step in range(steps):
        if way != "undisturbed" and step and step % reset_every == 0:
            for stage in stages:
                lent = jittered(stage, jitter) if way == "jittered" else stage.moments()
                stage.optimizer = make_optimizer(stage.named_trainable, config.optimizer)
                if way in ("borrowed", "jittered"):
                    stage.borrow_moments(lent)
            since = 0 if way in ("anew", "ramped") else None
        starts = torch.randint(0, len(data.train) - SEQ_LEN - 1, (BATCH,), generator=draw)
        batch = torch.stack([data.train[i:i + SEQ_LEN + 1] for i in starts]).unsqueeze(0)
        factor = fresh_ramp(since) if way == "ramped" and since is not None else 1.0
        pipeline.train_step(batch, lr=LR * factor)
        since = None if since is None else since + 1
    return pipeline.evaluate(data.holdout_batches(SEQ_LEN, 8))


WAYS = ("undisturbed", "anew", "ramped", "borrowed", "jittered")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4, 5])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--reset-every", type=int, default=25)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    data = corpus_data()
    rows: list[dict[str, Any]] = []
    if not args.json:
        print(f"held-out loss, moments reset every {args.reset_every} of {args.steps} steps "
              f"({FRESH_RAMP_STEPS}-step ramp); vs undisturbed")
        print("seed  undisturbed      anew    ramped  borrowed  jittered", flush=True)
    for seed in args.seeds:
        row: dict[str, Any] = {"seed": seed}
        for way in WAYS:
            row[way] = train(data, seed, args.steps, args.reset_every, way)
        for way in WAYS[1:]:
            row[f"{way}_gap"] = row[way] / row["undisturbed"] - 1
        rows.append(row)
        if not args.json:
            print(f"{seed:>4}  {row['undisturbed']:11.4f}" + "".join(
                f"  {row[f'{way}_gap']:+8.2%}" for way in WAYS[1:]), flush=True)
    means = {way: sum(r[f"{way}_gap"] for r in rows) / len(rows) for way in WAYS[1:]}
    if args.json:
        print(json.dumps({"seeds": rows, "mean_gap": means}, indent=2))
    else:
        print("mean" + " " * 13 + "".join(f"  {means[way]:+8.2%}" for way in WAYS[1:]))


if __name__ == "__main__":
    main()
