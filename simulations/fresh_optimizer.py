"""What a fresh optimizer costs mid-training, and what a short learning-rate ramp saves.

A replica placed again on a fellow that lost its stage starts with an AdamW state of no
moments; its first steps then move every weight by about the learning rate whatever the
gradient's noise. This trains the benchmark's small Llama on the corpus as one two-stage
pipeline (constant lr 3e-3, AdamW) four ways per seed: undisturbed, with every stage's
optimizer made anew every ``--reset-every`` steps, the same with the learning rate
ramped over ``FRESH_RAMP_STEPS`` steps after each reset (what a stage built anew mid-job
does where no replica is training, ``training.stage.fresh_ramp``), and the same with
each new optimizer borrowing the moments through bf16 (``TrainStage.borrow_moments``:
here its own old ones, so this measures what their bf16 trip costs; a stage placed
again borrows another replica's), and reports each run's held-out loss.

    python simulations/fresh_optimizer.py [--seeds 0 1] [--steps 600] [--reset-every 25] [--json]

About 40 s per seed on one core.
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
from p2pswarm.training.stage import FRESH_RAMP_STEPS, fresh_ramp, make_optimizer

LR, BATCH = 3e-3, 4


def train(data: TokenData, seed: int, steps: int, reset_every: int, ramp: bool,
          borrow: bool = False) -> float:
    """Held-out loss after ``steps`` steps; optimizers made anew every ``reset_every``."""
    torch.manual_seed(seed)
    config = JobConfig.from_dict({"model": {"config": MODEL}, "seq_len": SEQ_LEN,
                                  "micro_batch": BATCH, "steps": steps, "seed": seed,
                                  "lr": {"peak": LR, "schedule": "constant"}})
    stages = build_stages(config, ScratchModel(MODEL, seed), [1])
    pipeline = LocalTrainPipeline(stages, lr=config.lr)
    draw = torch.Generator().manual_seed(seed)
    since = None  # steps since the last reset
    for step in range(steps):
        if reset_every and step and step % reset_every == 0:
            for stage in stages:
                lent = stage.moments()
                stage.optimizer = make_optimizer(stage.named_trainable, config.optimizer)
                if borrow:
                    stage.borrow_moments(lent)
            since = None if borrow else 0
        starts = torch.randint(0, len(data.train) - SEQ_LEN - 1, (BATCH,), generator=draw)
        batch = torch.stack([data.train[i:i + SEQ_LEN + 1] for i in starts]).unsqueeze(0)
        factor = fresh_ramp(since) if ramp and since is not None else 1.0
        pipeline.train_step(batch, lr=LR * factor)
        since = None if since is None else since + 1
    return pipeline.evaluate(data.holdout_batches(SEQ_LEN, 8))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--reset-every", type=int, default=25)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    data = corpus_data()
    rows: list[dict[str, Any]] = []
    for seed in args.seeds:
        calm = train(data, seed, args.steps, 0, False)
        reset = train(data, seed, args.steps, args.reset_every, False)
        ramped = train(data, seed, args.steps, args.reset_every, True)
        borrowed = train(data, seed, args.steps, args.reset_every, True, borrow=True)
        rows.append({"seed": seed, "calm": calm, "reset": reset, "reset_ramped": ramped,
                     "reset_borrowed": borrowed, "reset_gap": reset / calm - 1,
                     "ramped_gap": ramped / calm - 1, "borrowed_gap": borrowed / calm - 1})
        if not args.json:
            print(f"seed {seed}: undisturbed {calm:.4f}; optimizers anew every "
                  f"{args.reset_every} steps {reset:.4f} ({reset / calm - 1:+.2%}); the same "
                  f"with a {FRESH_RAMP_STEPS}-step ramp {ramped:.4f} "
                  f"({ramped / calm - 1:+.2%}); the moments borrowed through bf16 "
                  f"{borrowed:.4f} ({borrowed / calm - 1:+.2%})", flush=True)
    if args.json:
        print(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
