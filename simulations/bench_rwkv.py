"""RWKV-7 on this machine: decode speed against the ``rwkv`` package, memory per session.

1. Decode tokens/s of one process serving an RWKV-7 (our ``Stage``, its recurrent state
   per session) against the ``rwkv`` package's own CPU inference (``RWKV_V7_ON=1``,
   ``cpu fp32``) on the same random checkpoint (a ``.pth`` in the authors' layout) and
   the same number of torch threads; runs alternate, the figure is the median time per
   token of each, and the ratio ours / theirs is the number that matters.
2. Memory per extra session: what a stage allocates with one session slot more, and the
   stage's bytes after a session has consumed 1K and after 16K tokens of context (a
   recurrent state does not grow), next to what a Llama of the same width would need
   for its KV cache at those lengths.
3. ``--train``: a training job of a small RWKV-7 from scratch as one pipeline of three
   stages on three ``p2pswarm join`` processes on loopback (one torch thread each), its
   samples/s from the job's tokens/s, against the same model, batch and steps trained
   in this process with three torch threads.

The machine may be shared: the load average is printed beside the figures.

    python simulations/bench_rwkv.py [--hidden 768] [--layers 12] [--vocab 65536]
                                     [--threads 1] [--tokens 64] [--runs 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from p2pswarm.models import ModelConfig
from p2pswarm.models.rwkv7 import hf_tensor_map, hf_tensor_shape
from p2pswarm.models.rwkv7_pth import PthCheckpoint, save_pth
from p2pswarm.runtime import Stage, StageSpec
from p2pswarm.shapes.footprint import kv_cache_bytes


def rwkv7_config(hidden: int, layers: int, vocab: int) -> ModelConfig:
    """The RWKV-7 0.1B shape at ``hidden`` = 768: head size 64, ffn 4x, its ranks."""
    return ModelConfig.from_hf({
        "model_type": "rwkv7", "vocab_size": vocab, "hidden_size": hidden, "head_dim": 64,
        "num_hidden_layers": layers, "intermediate_size": 4 * hidden,
        "decay_low_rank_dim": 64, "a_low_rank_dim": 64, "v_low_rank_dim": 32,
        "gate_low_rank_dim": 128})


def write_random_pth(config: ModelConfig, path: Path) -> Path:
    generator = torch.Generator().manual_seed(0)
    tensors = {}
    for name in hf_tensor_map(config, 0, config.num_layers):
        shape = hf_tensor_shape(config, name)
        noise = torch.randn(shape, generator=generator)
        tensors[name] = (1 + 0.1 * noise if name.endswith("norm.weight") else
                         0.5 * noise if len(shape) == 1 else noise / shape[-1] ** 0.5)
    return save_pth(tensors, True, path)


def package_model(pth: Path) -> Any:
    os.environ.update(RWKV_V7_ON="1", RWKV_JIT_ON="1", RWKV_CUDA_ON="0")
    from rwkv.model import RWKV

    return RWKV(str(pth.with_suffix("")), "cpu fp32")


def time_per_token(step: Any, tokens: int) -> float:
    token = 1
    times = []
    for _ in range(tokens):
        start = time.perf_counter()
        token = step(token)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def decode_speed(pth: Path, tokens: int, runs: int) -> dict[str, Any]:
    theirs_model = package_model(pth)
    source = PthCheckpoint(pth)
    ours_stage = Stage.load(source, StageSpec(0, source.config.num_layers, max_sessions=1))
    prompt = list(range(1, 17))

    def ours() -> float:
        ours_stage.end_session("s")
        ours_stage.prefill("s", prompt)
        return time_per_token(
            lambda t: int(ours_stage.decode("s", t).argmax()) % source.config.vocab_size,
            tokens)

    def theirs() -> float:
        _, state = theirs_model.forward(prompt, None)
        box = [state]

        def step(t: int) -> int:
            logits, box[0] = theirs_model.forward([t], box[0])
            return int(logits.argmax())
        return time_per_token(step, tokens)

    ours_s, theirs_s = [], []
    with torch.no_grad():
        for _ in range(runs):
            ours_s.append(ours())
            theirs_s.append(theirs())
    a, b = statistics.median(ours_s), statistics.median(theirs_s)
    return {"ours_tokens_per_s": 1 / a, "rwkv_package_tokens_per_s": 1 / b, "ratio": b / a}


def session_memory(pth: Path, contexts: tuple[int, ...]) -> dict[str, Any]:
    source = PthCheckpoint(pth)
    config = source.config
    n = config.num_layers
    one = Stage.load(source, StageSpec(0, n, max_sessions=1, prefill_chunk_tokens=256))
    two = Stage.load(source, StageSpec(0, n, max_sessions=2, prefill_chunk_tokens=256))
    per_session = two.allocated_bytes() - one.allocated_bytes()
    two.unload()
    after: dict[int, int] = {}
    consumed = 0
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for context in contexts:
            ids = torch.randint(0, config.vocab_size, (context - consumed,), generator=generator)
            one.prefill("s", ids)
            consumed = context
            assert one.session_length("s") == context
            after[context] = one.allocated_bytes()
    llama_kv = {c: kv_cache_bytes(num_layers=n, num_kv_heads=config.num_heads,
                                  head_dim=config.head_dim, max_context_tokens=c,
                                  max_sessions=1, kv_dtype="float32") for c in contexts}
    return {"bytes_per_extra_session": per_session,
            "stage_bytes_after_context": after,
            "llama_same_width_kv_bytes_per_session": llama_kv}


TRAIN_MODEL: dict[str, Any] = {
    "model_type": "rwkv7", "vocab_size": 259, "hidden_size": 128, "head_dim": 32,
    "num_hidden_layers": 6, "intermediate_size": 512, "decay_low_rank_dim": 16,
    "a_low_rank_dim": 16, "v_low_rank_dim": 8, "gate_low_rank_dim": 32,
    "bos_token_id": 256, "eos_token_id": 257, "pad_token_id": 258}
TRAIN_SEQ, TRAIN_BATCH = 128, 4


def train_job(steps: int, checkpoint_dir: Path) -> dict[str, Any]:
    # the step's TRAIN_BATCH samples as that many micro-batches of one, so the three
    # stages work on different samples at once, as a pipeline is run
    return {"model": {"config": TRAIN_MODEL}, "seq_len": TRAIN_SEQ, "micro_batch": 1,
            "micro_batches": TRAIN_BATCH, "steps": steps, "replicas": 1,
            "lr": {"peak": 4e-3, "min": 4e-4, "warmup_steps": min(10, steps - 1)},
            "checkpoint": {"dir": str(checkpoint_dir), "interval_steps": steps, "keep": 1,
                           "copies": 1}, "seed": 0}


def train_three_processes(steps: int) -> float:
    """Samples/s of the job as one pipeline over three ``join`` processes."""
    from p2pswarm.control.client import request, stream
    from p2pswarm.demo import DEMO_TRAIN_MEMORY, form_swarm
    from p2pswarm.sim.processes import local_swarm
    from p2pswarm.training.job import JobConfig

    names = ["fellow-1", "fellow-2", "fellow-3"]
    cap = ("--cpu-memory", DEMO_TRAIN_MEMORY, "--log-level", "warning")
    with local_swarm(lambda line: None, False) as swarm:
        form_swarm(swarm, names, cap, DEMO_TRAIN_MEMORY, lambda line: None, time.monotonic())
        home = swarm.homes[names[0]]
        job = JobConfig.from_dict(train_job(steps, swarm.root / "checkpoints")).to_dict()
        plan = request(home, {"op": "job_plan", "config": job, "stages": 3}, timeout_s=60)
        if not plan["fits"] or len(plan["stages"]) != 3:
            raise SystemExit(f"the job does not fit in 3 stages: "
                             f"{plan['layout']['limit']['sentence']}")
        began = time.monotonic()
        record = stream(home, {"op": "job_submit", "config": job, "plan_id": plan["plan_id"],
                               "stages": 3}, lambda event: None, timeout_s=1800)
        if record["state"] != "finished":
            raise SystemExit(f"the job ended {record['state']}: {record.get('reason')}")
        print(f"  three processes: {steps} steps in {time.monotonic() - began:.1f} s, "
              f"{record['tokens_per_s']:,.0f} tokens/s", file=sys.stderr)
        return float(record["tokens_per_s"]) / TRAIN_SEQ


def train_one_process(steps: int, threads: int) -> float:
    """Samples/s of the same model, batch and steps trained whole in this process."""
    from p2pswarm.training.job import LrSchedule, OptimizerConfig
    from p2pswarm.training.pipeline import LocalTrainPipeline
    from p2pswarm.training.source import ScratchModel, trainable_stage
    from p2pswarm.training.stage import TrainStage

    torch.set_num_threads(threads)
    stage = TrainStage(trainable_stage(ScratchModel(TRAIN_MODEL, 0), 0, 6), OptimizerConfig())
    pipeline = LocalTrainPipeline([stage], lr=LrSchedule(peak_lr=4e-3, min_lr=4e-4,
                                                         warmup_steps=10, total_steps=steps))
    generator = torch.Generator().manual_seed(0)
    batch = torch.randint(0, 256, (1, TRAIN_BATCH, TRAIN_SEQ + 1), generator=generator)
    pipeline.train_step(batch)  # warm up
    began = time.monotonic()
    for _ in range(steps):
        pipeline.train_step(batch)
    return steps * TRAIN_BATCH / (time.monotonic() - began)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=65536)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--memory-hidden", type=int, default=256,
                        help="width of the model whose sessions run to 16K tokens")
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--train", action="store_true",
                        help="also train on three join processes against one process")
    parser.add_argument("--train-steps", type=int, default=40)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    result: dict[str, Any] = {"threads": args.threads,
                              "load_average_before": os.getloadavg()}
    with tempfile.TemporaryDirectory() as tmp:
        if not args.skip_speed:
            try:
                import rwkv  # noqa: F401
            except ImportError:
                print("the rwkv package is not installed: pip install 'rwkv>=0.8.29'",
                      file=sys.stderr)
                return 2
            config = rwkv7_config(args.hidden, args.layers, args.vocab)
            pth = write_random_pth(config, Path(tmp) / "speed.pth")
            result["decode"] = {"model": f"rwkv7 hidden {args.hidden}, {args.layers} layers, "
                                         f"vocab {args.vocab}", "tokens": args.tokens,
                                **decode_speed(pth, args.tokens, args.runs)}
        small = rwkv7_config(args.memory_hidden, 6, 1024)
        pth = write_random_pth(small, Path(tmp) / "memory.pth")
        result["memory"] = {"model": f"rwkv7 hidden {args.memory_hidden}, 6 layers",
                            **session_memory(pth, (1024, 16384))}
    if args.train:
        three = train_three_processes(args.train_steps)
        one = train_one_process(args.train_steps, 3)
        result["train"] = {"three_processes_samples_per_s": three,
                           "one_process_samples_per_s": one, "ratio": three / one}
        torch.set_num_threads(args.threads)
    result["load_average_after"] = os.getloadavg()
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    if "decode" in result:
        d = result["decode"]
        print(f"decode ({d['model']}, {args.threads} thread(s)): ours "
              f"{d['ours_tokens_per_s']:.1f} tokens/s, rwkv package "
              f"{d['rwkv_package_tokens_per_s']:.1f} tokens/s: {d['ratio']:.2f}x")
    m = result["memory"]
    after = m["stage_bytes_after_context"]
    print(f"memory ({m['model']}): {m['bytes_per_extra_session']:,} bytes per extra session; "
          f"stage bytes after 1K tokens {after[1024]:,}, after 16K {after[16384]:,}; "
          f"a Llama of that width would hold "
          f"{m['llama_same_width_kv_bytes_per_session'][1024]:,} / "
          f"{m['llama_same_width_kv_bytes_per_session'][16384]:,} bytes of KV per session")
    if "train" in result:
        t = result["train"]
        print(f"training (rwkv7 128 wide, 6 layers, seq {TRAIN_SEQ}, batch {TRAIN_BATCH}): "
              f"3 join processes {t['three_processes_samples_per_s']:.2f} samples/s, one "
              f"process with 3 threads {t['one_process_samples_per_s']:.2f}: "
              f"{t['ratio']:.2f}x")
    print(f"load average before {result['load_average_before']}, "
          f"after {result['load_average_after']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
