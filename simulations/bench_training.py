"""Training across a swarm, measured: bytes to a target loss, churn, heterogeneous speeds.

Real gradients of a small Llama-family model on the package's public-domain corpus;
replicas run in virtual time (``p2pswarm.training.virtual``): each fellow has a speed
factor (a speed-1 fellow takes 1 s per step of 8 x 64 tokens) and all traffic crosses
one shared 20 Mb/s medium with 30 ms round trips. Three seeds by default.

Bytes are counted the same way for every method: each replica sends its vector to the
stage's keeper and receives the update back (for the baseline, its fp32 gradient every
step and the fp32 average every step, i.e. 8 bytes per parameter per replica per step;
a ring all-reduce would move 2(K-1)/K of that, 6 instead of 8 for K=4).

Scenarios (per seed):

full      4 equal fellows. Baseline: data parallelism with an fp32 all-reduce every
          step, 300 steps; target = its final held-out loss x 1.01; its bytes to target
          are counted to the first evaluation (every 10 steps) at or below the target.
          DiLoCo: local steps, qsgd-4bit deltas and updates, plain averaging
          (outer lr 1, no momentum: Nesterov 0.7/0.9 overshoots in runs this short),
          bytes until the global model first evaluates at or below the target.
lora      a base pre-trained on the Constitution, fine-tuned on the Declaration with
          rank-4 adapters on q_proj and v_proj. Target = 1.01 x the final loss of LoRA
          with fp32 every-step sync. Compared against full fine-tuning with fp32
          every-step sync reaching the same target (and, second figure, against the
          same number of steps of full-parameter fp32 sync).
churn     3 fellows, each offline for a round with p = 0.3 (nothing sent, updates
          missed and fetched on return), one of them (a third) killed at 35% of the run
          and rejoining at 55% as a fresh process; against the same run without churn,
          at an equal number of samples trained on.
hetero    speeds 1, 1, 2, 10; speed-aware step budgets; useful samples/s (samples in
          deltas the keeper applied, per virtual second) against the sum of each
          fellow's solo samples/s; synchronous data parallelism given for comparison.

Run:  python simulations/bench_training.py [--seeds 0 1 2] [--jobs 2] [--quick]
About three minutes on two free cores: five minutes of CPU in twelve scenario runs, two at
a time.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from p2pswarm.models.checkpoint import Checkpoint
from p2pswarm.models.tokenizer import ByteTokenizer
from p2pswarm.training.data import TokenData, corpus_files
from p2pswarm.training.job import JobConfig
from p2pswarm.training.run import LocalRun
from p2pswarm.training.source import ScratchModel
from p2pswarm.training.virtual import FellowPlan, LinkModel, VirtualSwarm

MODEL = {"model_type": "llama", "vocab_size": 259, "hidden_size": 64, "intermediate_size": 192,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 16, "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
         "tie_word_embeddings": True, "bos_token_id": 256, "eos_token_id": 257,
         "pad_token_id": 258}
SEQ_LEN, MICRO_BATCH = 64, 8
LINK = LinkModel(bandwidth_bps=20e6, rtt_s=0.030)
EVAL_EVERY_STEPS = 10


def job(steps: int, seed: int, **overrides: Any) -> JobConfig:
    data: dict[str, Any] = {
        "model": {"config": MODEL}, "seq_len": SEQ_LEN, "micro_batch": MICRO_BATCH,
        "steps": steps, "lr": {"peak": 3e-3, "min": 3e-4, "warmup_steps": 20}, "seed": seed,
    }
    data.update(overrides)
    return JobConfig.from_dict(data)


def tokens_of(paths: list[Path]) -> torch.Tensor:
    tok = ByteTokenizer()
    return torch.cat([torch.tensor(tok.encode(p.read_text(encoding="utf-8")))
                      for p in paths])


def corpus_data(holdout: float = 0.05) -> TokenData:
    return TokenData.split(tokens_of(corpus_files()), holdout, SEQ_LEN)


# --- baselines: data parallelism with fp32 sync every step --------------------------------


def data_parallel(config: JobConfig, replicas: int, data: TokenData, source: Any,
                  target: float | None = None) -> tuple[float, list[tuple[int, float]]]:
    """K replicas averaging gradients every step is one model on K micro-batches: run
    it so. Returns the final held-out loss and (step, loss) every EVAL_EVERY_STEPS."""
    dp = replace(config, micro_batches=replicas)
    run = LocalRun(dp, replicas=1, source=source, data=data)
    batches = data.holdout_batches(SEQ_LEN, MICRO_BATCH)
    curve: list[tuple[int, float]] = []
    for step in range(EVAL_EVERY_STEPS, config.steps + 1, EVAL_EVERY_STEPS):
        run.run(until_step=step)
        loss = run.replicas[0].evaluate(batches)
        curve.append((step, loss))
        if target is not None and loss <= target:
            break
    return curve[-1][1], curve


def first_at_or_below(curve: list[tuple[int, float]], target: float) -> int | None:
    return next((step for step, loss in curve if loss <= target), None)


def diloco_to_target(config: JobConfig, replicas: int, data: TokenData, source: Any,
                     target: float, seed: int) -> tuple[int | None, int, float]:
    """(bytes when the global model first reached ``target`` or None, steps per
    replica by then, best loss)."""
    batches = data.holdout_batches(SEQ_LEN, MICRO_BATCH)
    swarm = VirtualSwarm(config, source, data, [FellowPlan(f"f{i}") for i in range(replicas)],
                         rng=random.Random(seed), link=LINK, eval_batches=batches)
    hit: list[Any] = []

    def reached(record: Any) -> bool:
        if record.eval_loss is not None and record.eval_loss <= target:
            hit.append(record)
            return True
        return False

    report = swarm.run(until_samples=config.steps * replicas * MICRO_BATCH, stop_when=reached)
    best = min([r.eval_loss for r in report.rounds if r.eval_loss is not None]
               + [report.final_loss or float("inf")])
    if not hit:
        return None, report.computed_samples // (replicas * MICRO_BATCH), best
    return hit[0].bytes_sent, hit[0].computed_samples // (replicas * MICRO_BATCH), best


# --- scenarios -----------------------------------------------------------------------------


def scenario_full(seed: int, quick: bool) -> dict[str, Any]:
    replicas, steps = 4, (200 if quick else 300)
    data = corpus_data()
    source = ScratchModel(MODEL, seed)
    base = job(steps, seed)
    final, curve = data_parallel(base, replicas, data, source)
    target = final * 1.01
    params = sum(p.numel() for p in LocalRun(base, source=source, data=data)
                 .replicas[0].stages[0].trainable)
    base_steps = first_at_or_below(curve, target) or steps
    base_bytes = base_steps * 8 * replicas * params
    diloco = job(2 * steps, seed, sync={"inner_steps": 100, "codec": "qsgd",
                                        "codec_options": {"bits": 4}, "outer_lr": 1.0,
                                        "outer_momentum": 0.0, "round_deadline_s": 150.0})
    got, at_steps, best = diloco_to_target(diloco, replicas, data, source, target, seed)
    return {"params": params, "baseline_loss": final, "target": target,
            "baseline_steps": base_steps, "baseline_bytes": base_bytes,
            "diloco_bytes": got, "diloco_steps": at_steps, "diloco_best": best,
            "ratio": base_bytes / got if got else None}


def pretrained_base(directory: Path, seed: int, quick: bool) -> Checkpoint:
    """The bench model trained on the Constitution alone, exported as a model directory."""
    files = [p for p in corpus_files() if "constitution" in p.name]
    data = TokenData.split(tokens_of(files), 0.05, SEQ_LEN)
    run = LocalRun(replace(job(150 if quick else 300, seed), micro_batches=4),
                   source=ScratchModel(MODEL, seed), data=data)
    run.run()
    return Checkpoint(run.export(directory))


def scenario_lora(seed: int, quick: bool, base_dir: Path) -> dict[str, Any]:
    replicas, steps = 4, (100 if quick else 150)
    source = Checkpoint(base_dir)
    files = [p for p in corpus_files() if "declaration" in p.name]
    data = TokenData.split(tokens_of(files), 0.10, SEQ_LEN)
    lora = {"mode": "lora", "lora": {"rank": 4, "alpha": 8, "targets": ["q_proj", "v_proj"]}}
    lora_job = job(steps, seed, **lora)
    start_loss = LocalRun(lora_job, source=source, data=data).evaluate(None)
    final, _ = data_parallel(lora_job, replicas, data, source)
    target = final * 1.01
    adapters = sum(p.numel() for p in LocalRun(lora_job, source=source, data=data)
                   .replicas[0].stages[0].trainable)
    params = sum(p.numel() for p in LocalRun(job(steps, seed), source=source, data=data)
                 .replicas[0].stages[0].trainable)
    _, full_curve = data_parallel(job(steps, seed), replicas, data, source, target=target)
    full_steps = first_at_or_below(full_curve, target)
    full_bytes = (full_steps or steps) * 8 * replicas * params
    diloco = job(2 * steps, seed, **lora, sync={
        "inner_steps": 50, "codec": "qsgd", "codec_options": {"bits": 4}, "outer_lr": 1.0,
        "outer_momentum": 0.0, "round_deadline_s": 75.0})
    got, at_steps, best = diloco_to_target(diloco, replicas, data, source, target, seed)
    same_steps_bytes = at_steps * 8 * replicas * params
    return {"adapter_params": adapters, "params": params, "start_loss": start_loss,
            "lora_fp32_loss": final, "target": target, "full_ft_steps": full_steps,
            "full_ft_bytes": full_bytes, "diloco_bytes": got, "diloco_steps": at_steps,
            "diloco_best": best, "ratio": full_bytes / got if got else None,
            "ratio_same_steps": same_steps_bytes / got if got else None}


def scenario_churn(seed: int, quick: bool) -> dict[str, Any]:
    n, steps, inner = 3, (120 if quick else 200), 20
    data = corpus_data()
    source = ScratchModel(MODEL, seed)
    batches = data.holdout_batches(SEQ_LEN, MICRO_BATCH)
    deadline = 1.5 * inner
    config = job(steps, seed, sync={"inner_steps": inner, "codec": "qsgd",
                                    "codec_options": {"bits": 4}, "outer_lr": 1.0,
                                    "outer_momentum": 0.0, "round_deadline_s": deadline})
    samples = n * steps * MICRO_BATCH
    calm = VirtualSwarm(config, source, data, [FellowPlan(f"f{i}") for i in range(n)],
                        rng=random.Random(seed), link=LINK, eval_batches=batches
                        ).run(until_samples=samples)
    span = steps  # virtual seconds a no-churn fellow needs (speed 1)
    rng = random.Random(seed)
    killed = set(rng.sample(range(n), n // 3))
    fellows = [FellowPlan(f"f{i}", miss_probability=0.3,
                          kill_at_s=0.35 * span if i in killed else None,
                          rejoin_at_s=0.55 * span if i in killed else None)
               for i in range(n)]
    churn = VirtualSwarm(config, source, data, fellows, rng=random.Random(seed + 1000),
                         link=LINK, eval_batches=batches).run(until_samples=samples)
    assert calm.final_loss is not None and churn.final_loss is not None
    return {"calm_loss": calm.final_loss, "churn_loss": churn.final_loss,
            "gap": churn.final_loss / calm.final_loss - 1, "restarts": churn.global_restarts,
            "rejoins": churn.rejoins, "max_round_gap_s": churn.max_round_gap_s,
            "max_delta_wait_s": churn.max_delta_wait_s, "deadline_s": deadline,
            "rejoin_to_training_s": list(churn.rejoin_to_training_s),
            "rejoin_to_useful_s": list(churn.rejoin_to_useful_s),
            "round_s": inner, "calm_s": calm.duration_s, "churn_s": churn.duration_s}


def scenario_hetero(seed: int, quick: bool) -> dict[str, Any]:
    speeds = [1.0, 1.0, 2.0, 10.0]
    inner = 50
    round_s = inner / max(speeds)
    rounds = 5 if quick else 8
    data = corpus_data()
    source = ScratchModel(MODEL, seed)
    config = job(rounds * inner, seed, sync={
        "inner_steps": inner, "codec": "qsgd", "codec_options": {"bits": 4}, "outer_lr": 1.0,
        "outer_momentum": 0.0, "round_deadline_s": 1.5 * round_s})
    fellows = [FellowPlan(f"f{i}", speed=s) for i, s in enumerate(speeds)]
    swarm = VirtualSwarm(config, source, data, fellows, rng=random.Random(seed), link=LINK)
    report = swarm.run(until_s=rounds * round_s + 0.5)
    closed = [r for r in report.rounds[:-1]]  # the last is the final flush
    useful = sum(r.applied_samples for r in closed)
    useful_rate = useful / closed[-1].closed_at_s
    solo = sum(speeds) * MICRO_BATCH
    params = sum(p.numel() for p in swarm.fellows["f0"].replica.stages[0].trainable)  # type: ignore[union-attr]
    dp_compute = len(speeds) * MICRO_BATCH / (1 / min(speeds))
    allreduce_s = 8 * len(speeds) * params * 8 / LINK.bandwidth_bps + LINK.rtt_s
    dp_link = len(speeds) * MICRO_BATCH / (1 / min(speeds) + allreduce_s)
    return {"useful_per_s": useful_rate, "solo_sum_per_s": solo,
            "utilisation": useful_rate / solo, "sync_dp_compute": dp_compute / solo,
            "sync_dp_link": dp_link / solo, "dropped": report.computed_samples - useful}


SCENARIOS = ("full", "lora", "churn", "hetero")


def run_scenario(name: str, seed: int, quick: bool, base_dir: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    began = time.perf_counter()
    if name == "full":
        out = scenario_full(seed, quick)
    elif name == "lora":
        out = scenario_lora(seed, quick, Path(base_dir))
    elif name == "churn":
        out = scenario_churn(seed, quick)
    else:
        out = scenario_hetero(seed, quick)
    out["wall_s"] = time.perf_counter() - began
    return out


# --- report --------------------------------------------------------------------------------


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def fmt_ratio(x: float | None) -> str:
    return "not reached" if x is None else f"{x:,.0f}x"


def table(results: list[dict[str, Any]]) -> str:
    rows = [("| seed | full: fp32 DP bytes | DiLoCo bytes | fewer | LoRA: full-FT fp32 bytes "
             "| LoRA DiLoCo bytes | fewer | churn loss gap | restarts | longest delta wait "
             "| hetero useful/solo | sync DP |"),
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        f, lo, c, h = r["full"], r["lora"], r["churn"], r["hetero"]
        rows.append(
            f"| {r['seed']} | {fmt_bytes(f['baseline_bytes'])} | {fmt_bytes(f['diloco_bytes'])} "
            f"| {fmt_ratio(f['ratio'])} | {fmt_bytes(lo['full_ft_bytes'])} "
            f"| {fmt_bytes(lo['diloco_bytes'])} | {fmt_ratio(lo['ratio'])} "
            f"| {c['gap']:+.2%} | {c['restarts']} | {c['max_delta_wait_s']:.1f} s "
            f"| {h['utilisation']:.1%} | {h['sync_dp_compute']:.1%} "
            f"({h['sync_dp_link']:.1%} with its all-reduce) |")
    return "\n".join(rows)


def summary(results: list[dict[str, Any]]) -> str:
    def worst(values: list[float | None], pick: Any = min) -> str:
        known = [v for v in values if v is not None]
        if len(known) < len(values):
            return "not reached on every seed"
        return fmt_ratio(pick(known))

    full = [r["full"]["ratio"] for r in results]
    lora = [r["lora"]["ratio"] for r in results]
    lora_steps = [r["lora"]["ratio_same_steps"] for r in results]
    gaps = [abs(r["churn"]["gap"]) for r in results]
    util = [r["hetero"]["utilisation"] for r in results]
    waits = [r["churn"]["max_delta_wait_s"] for r in results]
    gaps_s = [r["churn"]["max_round_gap_s"] for r in results]
    pull_s = max(max(r["churn"]["rejoin_to_training_s"] or [0]) for r in results)
    rejoin_s = max(max(r["churn"]["rejoin_to_useful_s"] or [0]) for r in results)
    lines = [
        f"full, bytes to target, fewest-fold over seeds: {worst(full)} (goal >= 500x)",
        (f"LoRA vs full fine-tuning with fp32 sync: {worst(lora)} (goal >= 10,000x); vs the "
         f"same steps of full-parameter fp32 sync: {worst(lora_steps)}"),
        (f"churn: largest final-loss gap {max(gaps):.2%} (goal < 2%), global restarts "
         f"{sum(r['churn']['restarts'] for r in results)}; no fellow ever waits (they train "
         f"on while deltas travel); a delivered delta waited at most {max(waits):.1f} s for "
         f"its round to close (deadline {results[0]['churn']['deadline_s']:.0f} s; goal: "
         f"no stall past the deadline + 5 s); "
         f"the global model went at most {max(gaps_s):.0f} s without an update (longer than "
         f"a deadline only while every live fellow was offline); a rejoining fellow trained "
         f"on the current model {pull_s:.2f} s after rejoining and had its first delta "
         f"accepted within {rejoin_s:.1f} s (a round is {results[0]['churn']['round_s']} s; "
         f"more when it missed that round too)"),
        (f"heterogeneous 1:1:2:10: useful samples/s {min(util):.1%} to {max(util):.1%} of "
         f"the solo sum (goal >= 90%); synchronous DP "
         f"{results[0]['hetero']['sync_dp_compute']:.1%} on compute alone, "
         f"{results[0]['hetero']['sync_dp_link']:.1%} with its fp32 all-reduce on this link"),
    ]
    detail = []
    for r in results:
        f, lo = r["full"], r["lora"]
        detail.append(
            f"seed {r['seed']}: full target {f['target']:.4f} (DP {f['baseline_loss']:.4f} at "
            f"{f['baseline_steps']} steps), DiLoCo reached it at {f['diloco_steps']} steps per "
            f"replica (best {f['diloco_best']:.4f}); LoRA {lo['start_loss']:.3f} -> "
            f"{lo['lora_fp32_loss']:.4f} with fp32 sync, full fine-tuning reached the target "
            f"at {lo['full_ft_steps']} steps, LoRA DiLoCo at {lo['diloco_steps']} "
            f"({lo['adapter_params']:,} adapter vs {lo['params']:,} parameters); churn loss "
            f"{r['churn']['churn_loss']:.4f} vs {r['churn']['calm_loss']:.4f}; "
            f"{sum(r[s]['wall_s'] for s in SCENARIOS):.0f} s of CPU")
    return "\n".join(lines + [""] + detail)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                        help="scenarios run in parallel, one CPU thread each")
    parser.add_argument("--quick", action="store_true", help="shorter runs (a smoke test)")
    parser.add_argument("--json", type=Path, help="also write every figure here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    began = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        base_dir = Path(tmp) / "base"
        pretrained_base(base_dir, 0, args.quick)
        # the longest first, so two workers finish together
        tasks = [(name, seed) for name in SCENARIOS for seed in args.seeds]
        names, seeds = [t[0] for t in tasks], [t[1] for t in tasks]
        quick, base = [args.quick] * len(tasks), [str(base_dir)] * len(tasks)
        if args.jobs > 1:
            with ProcessPoolExecutor(max_workers=args.jobs) as pool:
                outs = list(pool.map(run_scenario, names, seeds, quick, base))
        else:
            outs = [run_scenario(*task) for task in zip(names, seeds, quick, base)]
    results = [{"seed": seed, **{name: out for (name, s), out in zip(tasks, outs) if s == seed}}
               for seed in args.seeds]
    print(table(results))
    print()
    print(summary(results))
    print(f"\n{len(args.seeds)} seeds in {time.perf_counter() - began:.0f} s "
          f"(model {results[0]['full']['params']:,} parameters, seq_len {SEQ_LEN}, "
          f"micro-batch {MICRO_BATCH}, link 20 Mb/s shared, 30 ms RTT)")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    mean_util = statistics.mean(r["hetero"]["utilisation"] for r in results)
    return 0 if mean_util > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
