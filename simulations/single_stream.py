"""Single-stream speed against `transformers`' own `generate`, side by side in one run.

The model: a 6-layer, hidden-1024, GQA 16/4, vocab 384 float32 Llama (68 M parameters,
random weights, seeded), written once as a Hugging Face directory. Three ways to decode
128 new tokens after the same prompt, runs alternating so that all see the same load on
a shared machine:

- ``transformers``: ``LlamaForCausalLM.generate`` (greedy) in a worker process with
  every core (``torch.set_num_threads(os.cpu_count())``);
- one `p2pswarm join` fellow holding the whole model (all cores);
- two `join` fellows, one stage each: one torch thread each (as ``LocalSwarm`` starts
  fellows that share a machine's cores), and every core each;
- with ``--spinning``, also two fellows with every core each whose idle OpenMP threads
  spin as libgomp's default has them (``GOMP_SPINCOUNT=300000``; `join` otherwise lets
  them sleep, ``OMP_WAIT_POLICY=PASSIVE``): what the fellows did before.

Speed is decode tokens/s from the median time between two tokens of a run. The greedy
tokens of all three must be equal. Imported by ``bench_serving.py``; runs alone too:

    python simulations/single_stream.py [--runs 5] [--tokens 128] [--spinning]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

CONFIG: dict[str, Any] = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 1024,
    "intermediate_size": 2816, "num_hidden_layers": 6, "num_attention_heads": 16,
    "num_key_value_heads": 4, "head_dim": 64, "hidden_act": "silu",
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "tie_word_embeddings": False, "vocab_size": 384, "bos_token_id": 256,
    "eos_token_id": 257, "pad_token_id": 258, "torch_dtype": "float32",
}
PROMPT_TEXT = "The swarm " * 4
PROMPT = [256, *PROMPT_TEXT.encode()]  # the byte tokenizer's ids: bos, then the bytes
SPINNING = "2 fellows, all cores each, threads spinning"

# the worker: loads the model with transformers, then decodes once per line on stdin and
# answers with the token times as JSON
_WORKER = r"""
import json, os, sys, time, torch
from transformers import LlamaForCausalLM
from transformers.generation.streamers import BaseStreamer
torch.set_num_threads(os.cpu_count())
model = LlamaForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
prompt = torch.tensor([json.loads(sys.argv[2])])
class Times(BaseStreamer):
    def __init__(self):
        self.times, self.ids = [], []
    def put(self, value):
        self.times.append(time.perf_counter()); self.ids.append(value.flatten().tolist())
    def end(self):
        pass
def decode(tokens):
    times = Times()
    with torch.no_grad():
        model.generate(prompt, max_new_tokens=tokens, min_new_tokens=tokens,
                       do_sample=False, streamer=times, pad_token_id=258)
    return times
decode(4)
print(json.dumps({"ready": torch.get_num_threads()}), flush=True)
for line in sys.stdin:
    times = decode(int(line))
    # the streamer's first put is the prompt itself
    print(json.dumps({"times": times.times[1:], "ids": [i[0] for i in times.ids[1:]]}),
          flush=True)
"""


def write_model(out: Path) -> Path:
    """The model's directory: config.json and seeded random float32 weights."""
    import torch

    from p2pswarm.models.checkpoint import save_checkpoint

    gen = torch.Generator().manual_seed(0)
    h, i, v = CONFIG["hidden_size"], CONFIG["intermediate_size"], CONFIG["vocab_size"]
    kv = CONFIG["num_key_value_heads"] * CONFIG["head_dim"]

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.02

    tensors = [("model.embed_tokens.weight", w(v, h))]
    for n in range(CONFIG["num_hidden_layers"]):
        p = f"model.layers.{n}."
        tensors += [(p + "input_layernorm.weight", torch.ones(h)),
                    (p + "post_attention_layernorm.weight", torch.ones(h)),
                    (p + "self_attn.q_proj.weight", w(h, h)),
                    (p + "self_attn.k_proj.weight", w(kv, h)),
                    (p + "self_attn.v_proj.weight", w(kv, h)),
                    (p + "self_attn.o_proj.weight", w(h, h)),
                    (p + "mlp.gate_proj.weight", w(i, h)), (p + "mlp.up_proj.weight", w(i, h)),
                    (p + "mlp.down_proj.weight", w(h, i))]
    tensors += [("model.norm.weight", torch.ones(h)), ("lm_head.weight", w(v, h))]
    return save_checkpoint(CONFIG, tensors, out)


def per_s(runs: list[list[float]]) -> float:
    steps = [b - a for times in runs for a, b in itertools.pairwise(times)]
    return 1.0 / statistics.median(steps)


class Transformers:
    """The worker process; ``decode`` times one run of ``tokens`` new tokens."""

    def __init__(self, model_dir: Path) -> None:
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS",
                                                                 "MKL_NUM_THREADS")}
        self.process = subprocess.Popen(
            [sys.executable, "-c", _WORKER, str(model_dir), json.dumps(PROMPT)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.threads = json.loads(self._line())["ready"]

    def _line(self) -> str:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError("the transformers worker died")
        return line

    def decode(self, tokens: int) -> tuple[list[float], list[int]]:
        assert self.process.stdin is not None
        self.process.stdin.write(f"{tokens}\n")
        self.process.stdin.flush()
        answer = json.loads(self._line())
        return answer["times"], answer["ids"]

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        self.process.wait(timeout=30)


class Fellows:
    """``n`` `join` processes holding the model in ``n`` stages (one per fellow)."""

    def __init__(self, stack: ExitStack, model_dir: Path, n: int, threads: int,
                 env: dict[str, str] | None = None, weights_dtype: str = "f32") -> None:
        from p2pswarm.control.client import request, stream
        from p2pswarm.models.files import read_model_config
        from p2pswarm.sim.processes import local_swarm

        swarm = stack.enter_context(local_swarm(lambda text: None, threads=threads,
                                                   start_timeout_s=120.0))
        names = [f"fellow-{i + 1}" for i in range(n)]
        saved = dict(os.environ)
        os.environ.update(env or {})  # the fellows inherit this process's environment
        try:
            seed = swarm.start(names[0], extra=("--log-level", "warning"))
            for name in names[1:]:
                swarm.start(name, seeds=(seed,), extra=("--log-level", "warning"))
        finally:
            os.environ.clear()
            os.environ.update(saved)
        for name in names:
            swarm.wait_for(name, lambda s: s["leader"] is not None and sum(
                m["state"] == "alive" for m in s["members"]) == n, timeout_s=60,
                what="the swarm")
        name, config = read_model_config(str(model_dir))
        message = {"model": {"name": name, "config": config}, "kind": "serve", "stages": n,
                   "weights_dtype": weights_dtype, "kv_dtype": "f32", "context": 1024,
                   "floors_bytes": {"cpu": "100MB"}}
        home = swarm.homes[names[0]]
        plan = request(home, {"op": "plan", "request": message}, timeout_s=30)
        stream(home, {"op": "load", "request": message, "plan_id": plan["plan_id"],
                      "path": str(model_dir)}, lambda e: None, timeout_s=300)
        self.driver = swarm.homes[plan["stages"][0]["fellow"]]
        self.request, self.stream = request, stream
        self.decode(4)

    def decode(self, tokens: int) -> tuple[list[float], list[int]]:
        times: list[float] = []

        def token(event: dict[str, Any]) -> None:
            if "token" in event:
                times.append(time.perf_counter())

        result = self.stream(self.driver, {"op": "generate", "prompt": PROMPT_TEXT,
                                           "max_tokens": tokens, "stop_token_ids": []},
                             token, timeout_s=300)
        return times, list(result["token_ids"])


def measure(runs: int = 5, tokens: int = 128, spinning: bool = False) -> dict[str, Any]:
    """Decode tokens/s of transformers, one fellow and two fellows, runs alternating;
    ``spinning`` adds two all-core fellows whose idle threads spin (libgomp's default)."""
    with ExitStack() as stack:
        root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="p2ps-speed-")))
        model_dir = write_model(root / "llama-68m")
        worker = Transformers(model_dir)
        stack.callback(worker.close)
        cores = os.cpu_count() or 1
        # a lone fellow takes every core; two fellows sharing the machine's cores either
        # one thread each (as `LocalSwarm` starts fellows) or every core each: in a single
        # stream only one stage computes at a time
        ways: dict[str, Any] = {"transformers": worker,
                                "1 fellow": Fellows(stack, model_dir, 1, cores),
                                "2 fellows": Fellows(stack, model_dir, 2, 1),
                                "2 fellows, all cores each": Fellows(stack, model_dir, 2, cores)}
        if spinning:
            ways[SPINNING] = Fellows(stack, model_dir, 2, cores,
                                     env={"GOMP_SPINCOUNT": "300000"})
        times: dict[str, list[list[float]]] = {k: [] for k in ways}
        ids: dict[str, list[int]] = {}
        load = []
        for _ in range(runs):
            for name, way in ways.items():
                t, got = way.decode(tokens)
                times[name].append(t)
                ids[name] = got
            load.append(os.getloadavg()[0])
    speeds = {name: per_s(t) for name, t in times.items()}
    return {"tokens_per_s": speeds, "transformers_threads": worker.threads,
            "ratio_2_fellows": speeds["2 fellows"] / speeds["transformers"],
            "ratio_2_fellows_all_cores": (speeds["2 fellows, all cores each"]
                                          / speeds["transformers"]),
            "ratio_1_fellow": speeds["1 fellow"] / speeds["transformers"],
            **({"ratio_2_fellows_spinning": speeds[SPINNING] / speeds["transformers"]}
               if spinning else {}),
            "same_tokens": len({tuple(v) for v in ids.values()}) == 1,
            "load_average": statistics.mean(load), "runs": runs, "tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--spinning", action="store_true",
                        help="also two all-core fellows whose idle threads spin")
    args = parser.parse_args()
    out = measure(args.runs, args.tokens, args.spinning)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
