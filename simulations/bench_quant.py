"""Decode speed of quantized stages against float32 and against distributed-llama.

The model is ``single_stream.py``'s: a 6-layer, hidden-1024, GQA 16/4, intermediate-2816
Llama (68 M parameters in its layers, random weights, seeded). 128 greedy tokens after
the same prompt, 2 threads in all, runs alternating in one window so every system sees the
same load on a shared machine:

- p2pswarm, 1 `join` fellow (2 threads) holding the model in f32, int8 and int4;
- p2pswarm, 2 fellows on loopback (1 thread each), one stage each, f32, int8 and int4;
- distributed-llama (``--dllama DIR``: its source tree with ``dllama`` built), q40
  weights and q80 activations, 1 process with 2 threads and 2 nodes (a root and a
  worker on loopback, 1 thread each); the model is converted with its own
  ``converter/convert-hf.py``. Without ``--dllama`` those rows say "skipped".

Decode tokens/s is p2pswarm's median time between two tokens of a run, and
distributed-llama's own "Prediction tokens/s". Each row reports the range over the runs.

    python simulations/bench_quant.py [--runs 3] [--tokens 128] [--json]
        [--dllama /work/scratch/dllama] [--dtypes f32,int4] [--fellows 1]

``--dtypes`` and ``--fellows`` measure fewer systems while iterating; a figure whose
systems were skipped says "skipped".
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from single_stream import CONFIG, PROMPT_TEXT, Fellows, write_model  # noqa: E402

DTYPES = ("f32", "int8", "int4")
TARGETS = {"int8 / f32, 1 fellow": 1.5, "int4 / f32, 1 fellow": 1.8,
           "fastest / dllama q40, 1 process": 0.8, "fastest / dllama q40, 2 nodes": 0.8}


def run_speed(times: list[float]) -> float:
    steps = [b - a for a, b in itertools.pairwise(times)]
    return 1.0 / statistics.median(steps)


class P2pswarm:
    def __init__(self, stack: ExitStack, model_dir: Path, fellows: int, dtype: str) -> None:
        threads = 2 // fellows
        self.fellows = Fellows(stack, model_dir, fellows, threads, weights_dtype=dtype)

    def decode(self, tokens: int) -> tuple[float, list[int]]:
        times, ids = self.fellows.decode(tokens)
        return run_speed(times), ids


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Dllama:
    """distributed-llama's ``dllama inference``, one process or a root and one worker."""

    def __init__(self, stack: ExitStack, root: Path, source: Path, model_dir: Path,
                 nodes: int) -> None:
        self.binary = source / "dllama"
        self.model = root / "dllama_model_llama68m_q40.m"
        self.tokenizer = root / "dllama_tokenizer.t"
        if not self.model.exists():
            subprocess.run([sys.executable, str(source / "converter" / "convert-hf.py"),
                            str(model_dir), "q40", "llama68m"], cwd=root, check=True,
                           capture_output=True)
            write_tokenizer(source, self.tokenizer)
        self.threads = 2 // nodes
        self.workers: list[str] = []
        for _ in range(nodes - 1):
            port = _free_port()
            worker = subprocess.Popen([str(self.binary), "worker", "--port", str(port),
                                       "--nthreads", str(self.threads)],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            stack.callback(_stop, worker)
            self.workers.append(f"127.0.0.1:{port}")
        time.sleep(0.5)  # a benchmark, not a test: let the worker open its port

    def decode(self, tokens: int) -> tuple[float, list[int]]:
        args = [str(self.binary), "inference", "--model", str(self.model), "--tokenizer",
                str(self.tokenizer), "--buffer-float-type", "q80", "--prompt", PROMPT_TEXT,
                "--steps", str(tokens + 16), "--nthreads", str(self.threads),
                "--temperature", "0", "--max-seq-len", "1024"]
        if self.workers:
            args += ["--workers", *self.workers]
        out = subprocess.run(args, capture_output=True, text=True, timeout=600).stdout
        match = re.search(r"Prediction\s+nTokens:\s*\d+\s+tokens/s:\s*([\d.]+)", out)
        if match is None:
            raise RuntimeError(f"dllama printed no prediction speed:\n{out[-2000:]}")
        return float(match.group(1)), []


def _stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    process.wait(timeout=30)


def write_tokenizer(source: Path, out: Path) -> None:
    """A tokenizer in distributed-llama's format for the model's byte vocabulary."""
    sys.path.insert(0, str(source / "converter"))
    from importlib import import_module

    writer = import_module("tokenizer-writer")
    vocab = CONFIG["vocab_size"]
    tokens = [bytes([i]) for i in range(256)] + [f"<s{i}>".encode() for i in range(vocab - 256)]
    with out.open("wb") as f, contextlib.redirect_stdout(io.StringIO()):  # it chats
        writer.writeTokenizer(f, tokens, [0.0] * vocab, None, CONFIG["bos_token_id"], True,
                              [CONFIG["eos_token_id"]])


def measure(runs: int, tokens: int, dllama: Path | None, dtypes: tuple[str, ...] = DTYPES,
            fellow_counts: tuple[int, ...] = (1, 2)) -> dict[str, Any]:
    with ExitStack() as stack:
        root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="p2ps-quant-")))
        model_dir = write_model(root / "llama-68m")
        systems: dict[str, Any] = {}
        for fellows in fellow_counts:
            for dtype in dtypes:
                name = f"p2pswarm {dtype}, {fellows} fellow{'s' if fellows > 1 else ''}"
                systems[name] = P2pswarm(stack, model_dir, fellows, dtype)
        if dllama is not None:
            for nodes in fellow_counts:
                label = "1 process" if nodes == 1 else "2 nodes"
                systems[f"dllama q40, {label}"] = Dllama(stack, root, dllama, model_dir, nodes)
        speeds: dict[str, list[float]] = {k: [] for k in systems}
        ids: dict[str, list[int]] = {}
        load: list[float] = []
        for _ in range(runs):
            for name, system in systems.items():
                speed, got = system.decode(tokens)
                speeds[name].append(speed)
                if got:
                    ids[name] = got
            load.append(os.getloadavg()[0])
    return {"tokens_per_s": speeds, "ratios": ratios(speeds), "targets": TARGETS,
            "same_tokens_across_stage_counts": {
                dtype: ids[f"p2pswarm {dtype}, 1 fellow"] == ids[f"p2pswarm {dtype}, 2 fellows"]
                for dtype in dtypes if len(fellow_counts) == 2},
            "load_average": [min(load), max(load)], "runs": runs, "tokens": tokens,
            "dllama": "skipped" if dllama is None else str(dllama)}


def ratios(speeds: dict[str, list[float]]) -> dict[str, float | str]:
    """Ratios of medians."""
    med = {k: statistics.median(v) for k, v in speeds.items()}
    f32 = med.get("p2pswarm f32, 1 fellow")
    out: dict[str, float | str] = {}
    for dtype in ("int8", "int4"):
        ours = med.get(f"p2pswarm {dtype}, 1 fellow")
        out[f"{dtype} / f32, 1 fellow"] = ours / f32 if ours and f32 else "skipped"
    for label, ours, theirs in (("1 process", "1 fellow", "dllama q40, 1 process"),
                                ("2 nodes", "2 fellows", "dllama q40, 2 nodes")):
        measured = [med[f"p2pswarm {d}, {ours}"] for d in DTYPES
                    if f"p2pswarm {d}, {ours}" in med]
        out[f"fastest / dllama q40, {label}"] = (max(measured) / med[theirs]
                                                 if theirs in med and measured else "skipped")
    fastest = {ours: max((d for d in DTYPES if f"p2pswarm {d}, {ours}" in med),
                         key=lambda d: med[f"p2pswarm {d}, {ours}"], default="")
               for ours in ("1 fellow", "2 fellows")}
    out.update({f"fastest dtype, {ours}": d for ours, d in fastest.items() if d})
    return out


def table(result: dict[str, Any]) -> str:
    lines = [f"decode tokens/s, {result['tokens']} greedy tokens, 2 threads, "
             f"{result['runs']} runs alternating, load {result['load_average'][0]:.1f}-"
             f"{result['load_average'][1]:.1f}", "",
             f"{'system':<34} {'tokens/s (min-max)':>20}"]
    for name, values in result["tokens_per_s"].items():
        lines.append(f"{name:<34} {min(values):>9.1f} - {max(values):<8.1f}")
    if result["dllama"] == "skipped":
        lines.append(f"{'dllama q40':<34} {'skipped (no --dllama)':>20}")
    lines += ["", f"{'figure':<36} {'measured':>9} {'target':>7}"]
    for name, value in result["ratios"].items():
        shown = f"{value:.2f}" if isinstance(value, float) else value
        target = f">= {TARGETS[name]}" if name in TARGETS else ""
        lines.append(f"{name:<36} {shown:>9} {target:>7}")
    lines.append(f"same greedy tokens, 1 vs 2 fellows: {result['same_tokens_across_stage_counts']}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--dllama", type=Path, default=None,
                        help="distributed-llama's source tree, with `dllama` built in it")
    parser.add_argument("--json", action="store_true", help="print JSON, not a table")
    parser.add_argument("--dtypes", default=",".join(DTYPES),
                        help=f"p2pswarm's weight dtypes to measure, of {','.join(DTYPES)}")
    parser.add_argument("--fellows", default="1,2",
                        help="fellow (and distributed-llama node) counts to measure: 1, 2 or 1,2")
    args = parser.parse_args()
    if args.runs < 1 or args.tokens < 2:
        parser.error("--runs must be at least 1 and --tokens at least 2")
    dtypes = tuple(d for d in DTYPES if d in args.dtypes.split(","))
    if not dtypes or set(args.dtypes.split(",")) - set(DTYPES):
        parser.error(f"--dtypes takes some of {','.join(DTYPES)}, comma-separated")
    counts = tuple(n for n in (1, 2) if str(n) in args.fellows.split(","))
    if not counts or set(args.fellows.split(",")) - {"1", "2"}:
        parser.error("--fellows takes 1, 2 or 1,2")
    if args.dllama is not None and not (args.dllama / "dllama").is_file():
        parser.error(f"{args.dllama}/dllama is not there: build it with `make dllama` "
                     f"in distributed-llama's source tree, or leave out --dllama")
    result = measure(args.runs, args.tokens, args.dllama, dtypes, counts)
    print(json.dumps(result, indent=2) if args.json else table(result))


if __name__ == "__main__":
    main()
