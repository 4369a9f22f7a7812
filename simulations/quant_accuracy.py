"""Perplexity and greedy agreement of quantized stages against float32.

Two trained models: the shipped demo model (``p2pswarm/models/demo-llama``, trained on the
shipped corpus) and a small byte Llama trained here from scratch (as the training tests
train one; ``--train-steps``). Each is loaded as one stage in float32, int8 and 4-bit
(groups of 32 and 64), on this CPU's kernels (``p2pswarm.models.quant``). Reported:

- perplexity on held-out text (the corpus's last 5 %, windows of 128 tokens), prefill path;
- greedy agreement: of 32 tokens generated greedily after each of a few prompts (the
  decode kernels), the share equal to float32's, position by position.

    python simulations/quant_accuracy.py [--train-steps 150] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from pathlib import Path
from typing import Any

import torch

from p2pswarm.demo import DEMO_MODEL_DIR
from p2pswarm.models.loader import load_stage_model, open_model
from p2pswarm.models.tokenizer import ByteTokenizer
from p2pswarm.runtime import LocalPipeline, Sampler, Stage, StageSpec
from p2pswarm.training.data import TokenData, load_tokens
from p2pswarm.training.job import DataConfig, JobConfig
from p2pswarm.training.run import LocalRun

SCHEMES = (("f32", "none", 32), ("int8", "int8", 32), ("int4 g32", "int4", 32),
           ("int4 g64", "int4", 64))
PROMPTS = ("We the People", "Congress shall", "The right of the", "No State shall")
SEQ = 128
TOKENS = 32


def held_out() -> torch.Tensor:
    return TokenData.split(load_tokens(DataConfig(), ByteTokenizer()), 0.05, SEQ).holdout


def perplexity(model_dir: Path, quant: str, group: int, tokens: torch.Tensor) -> float:
    model = load_stage_model(open_model(model_dir), 0, _layers(model_dir), quant=quant,
                             group_size=group)
    windows = [tokens[i:i + SEQ + 1] for i in range(0, tokens.numel() - SEQ - 1, SEQ)]
    total, count = 0.0, 0
    with torch.no_grad():
        for w in windows:
            logits = model(w[:-1].unsqueeze(0)).float()
            loss = torch.nn.functional.cross_entropy(logits[0], w[1:], reduction="sum")
            total, count = total + float(loss), count + SEQ
    return math.exp(total / count)


def greedy(model_dir: Path, quant: str, group: int) -> list[list[int]]:
    spec = StageSpec(0, _layers(model_dir), quant=quant, quant_group_size=group,
                     max_context_tokens=256)
    pipeline = LocalPipeline([Stage.load(model_dir, spec)])
    tokenizer = ByteTokenizer()
    return [pipeline.generate(tokenizer.encode(p, add_bos=True), TOKENS, Sampler.greedy(),
                              stop_token_ids=()).token_ids for p in PROMPTS]


def _layers(model_dir: Path) -> int:
    return int(json.loads((model_dir / "config.json").read_text())["num_hidden_layers"])


def train_small(out: Path, steps: int) -> Path:
    """A byte Llama (4 layers, width 128) trained from scratch on the corpus."""
    job = JobConfig.from_dict({
        "model": {"config": {"model_type": "llama", "vocab_size": 259, "hidden_size": 128,
                             "intermediate_size": 256, "num_hidden_layers": 4,
                             "num_attention_heads": 4, "num_key_value_heads": 2,
                             "head_dim": 32, "max_position_embeddings": 256,
                             "tie_word_embeddings": True, "bos_token_id": 256,
                             "eos_token_id": 257}},
        "seq_len": SEQ, "micro_batch": 4, "steps": steps, "seed": 0,
        "lr": {"peak": 4e-3, "min": 4e-4, "warmup_steps": 10}})
    run = LocalRun(job, replicas=1)
    run.run()
    return run.export(out)


def measure(model_dir: Path, tokens: torch.Tensor) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    reference: list[list[int]] = []
    for name, quant, group in SCHEMES:
        ppl = perplexity(model_dir, quant, group, tokens)
        ids = greedy(model_dir, quant, group)
        if name == "f32":
            reference = ids
        same = sum(a == b for r, g in zip(reference, ids) for a, b in zip(r, g))
        rows[name] = {"perplexity": ppl,
                      "greedy_agreement": same / sum(len(r) for r in reference)}
    base = rows["f32"]["perplexity"]
    for row in rows.values():
        row["perplexity_ratio"] = row["perplexity"] / base
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train-steps", type=int, default=150)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.train_steps < 1:
        parser.error("--train-steps must be at least 1")
    torch.manual_seed(0)
    tokens = held_out()
    with tempfile.TemporaryDirectory(prefix="p2ps-quant-acc-") as tmp:
        result = {"demo-llama": measure(DEMO_MODEL_DIR, tokens),
                  f"byte llama trained {args.train_steps} steps":
                      measure(train_small(Path(tmp) / "small", args.train_steps), tokens)}
    if args.json:
        print(json.dumps(result, indent=2))
        return
    for model, rows in result.items():
        print(f"\n{model}: held-out perplexity ({tokens.numel()} tokens), greedy agreement "
              f"over {len(PROMPTS)} x {TOKENS} tokens")
        print(f"{'weights':<10} {'perplexity':>10} {'/ f32':>7} {'greedy same':>12}")
        for name, row in rows.items():
            print(f"{name:<10} {row['perplexity']:>10.3f} {row['perplexity_ratio']:>7.4f} "
                  f"{row['greedy_agreement']:>11.0%}")


if __name__ == "__main__":
    main()
