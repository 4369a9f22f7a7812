"""Measured speed of a card: matmul FLOP/s in its compute dtype, memory bandwidth, and
tokens/s of one reference linear in each serving weights dtype (f16, int8, int4).

The planner's cost model is a roofline, so two numbers per card are enough for f16;
a quantised stage's speed depends on its kernels far more than on its bytes, so the
planner scales the f16 roofline by the measured ratio of the dtypes' tokens/s
(``REFERENCE_LINEAR``, batch 1). The quantised linears come from the caller
(``QuantizedLinear``: the CLI's ``bench`` hands in ``p2pswarm.models.quant``'s public
``quantize_linear``, which sits above this module), so the figure follows whatever
kernels the runtime runs. A
measurement takes a few seconds; it is cached in the state directory under a
fingerprint of the hardware and re-run with ``p2pswarm bench``. A card never measured
gets a conservative estimate flagged ``measured=False``, so the plan can say its speed
is a guess.

This is the measuring side (torch, the cache file); the numbers themselves
(``Benchmark``, the estimates, ``fingerprint`` and the gossip form) are pure and live in
``p2pswarm.cards``, where the planner finds them.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from p2pswarm.cards import Benchmark, Card, estimate, fingerprint
from p2pswarm.errors import ConfigError

CACHE_FILE = "benchmarks.json"
CACHE_VERSION = 1
# (out, in) of the linear each weights dtype is timed on: a 68M Llama's MLP projection
REFERENCE_LINEAR = (2816, 1024)
SMALL_LINEAR = (256, 256)  # a short run's (tests, ``--seconds`` under 0.5)
MEASURED_DTYPES = ("f16", "int8", "int4")
INT4_GROUP_SIZE = 32  # the runtime's default group
# (f32 weight of shape (out, in), "int8" | "int4") -> the runtime's quantised linear
QuantizedLinear = Callable[[Any, str], Callable[[Any], Any]]


def _torch_device(torch: Any, card: Card) -> Any:
    if card.kind == "cpu":
        return torch.device("cpu")
    # NVML counts GPUs in PCI order, CUDA fastest first unless told otherwise: match UUIDs
    for i in range(torch.cuda.device_count()):
        uuid = str(getattr(torch.cuda.get_device_properties(i), "uuid", ""))
        if uuid and uuid in card.uuid:
            return torch.device(f"cuda:{i}")
    return torch.device(f"cuda:{card.index}")


def compute_dtype(torch: Any, card: Card) -> str:
    """f16 on GPUs with fast half precision (compute capability 7.0+), else f32."""
    if card.kind == "cuda":
        major, _ = torch.cuda.get_device_capability(_torch_device(torch, card))
        return "f16" if major >= 7 else "f32"
    return "f32"


def measure(card: Card, seconds: float = 2.0, torch_module: Any = None,
            clock: Callable[[], float] | None = None,
            quantized: QuantizedLinear | None = None) -> Benchmark:
    """Run the matmul and copy loops on ``card`` for about ``seconds`` in all, and time
    the reference linear in f16 and, given ``quantized``, in int8 and int4."""
    if clock is None:
        clock = time.perf_counter
    if seconds <= 0:
        raise ConfigError(f"--seconds {seconds} must be more than zero: e.g. --seconds 2")
    torch = torch_module
    if torch is None:
        import torch
    device = _torch_device(torch, card)
    dtype_name = compute_dtype(torch, card)
    dtype = {"f32": torch.float32, "f16": torch.float16}[dtype_name]
    sync = (lambda: torch.cuda.synchronize(device)) if card.kind == "cuda" else (lambda: None)
    started = clock()

    # small sizes when asked for a short run, so a test's 0.1 s stays 0.1 s on a Pi
    n = 256 if seconds < 0.5 else (1024 if card.kind == "cpu" else 4096)
    pair: list[Any] = [torch.randn(n, n, device=device, dtype=dtype),
                       torch.randn(n, n, device=device, dtype=dtype)]
    flops = _rate(lambda: torch.mm(*pair), 2.0 * n**3, seconds * 0.35, sync, clock)
    pair.clear()  # free the matrices before the copy buffers

    # larger than any cache (CPU L3, GPU L2), or the copy measures the cache
    copy_bytes = (256 if card.kind == "cuda" else 64) * 2**20
    src = torch.empty(copy_bytes // 4, device=device, dtype=torch.float32)
    dst = torch.empty_like(src)
    bandwidth = _rate(lambda: dst.copy_(src), 2.0 * copy_bytes, seconds * 0.35, sync, clock)
    shape = SMALL_LINEAR if seconds < 0.5 else REFERENCE_LINEAR
    rates = dtype_tokens_per_s(torch, device, shape, seconds * 0.3, sync, clock, quantized)
    return Benchmark(flops=flops, mem_bandwidth=bandwidth, dtype=dtype_name, measured=True,
                     fingerprint=fingerprint(card), seconds=round(clock() - started, 3),
                     dtype_tokens_per_s=rates)


def dtype_tokens_per_s(torch: Any, device: Any, shape: tuple[int, int], budget_s: float,
                       sync: Callable[[], None], clock: Callable[[], float],
                       quantized: QuantizedLinear | None = None
                       ) -> tuple[tuple[str, float], ...]:
    """Tokens/s of one linear of ``shape`` (out, in) at batch 1 in each of
    ``MEASURED_DTYPES``, as the runtime builds it: f16 an ``nn.Linear`` in f16, int8 and
    int4 by ``quantized`` (f16 activations; left out without it). A dtype this torch
    cannot run on the card is left out (the planner then takes its stated default)."""
    out_features, in_features = shape
    weight = torch.randn(out_features, in_features, device=device, dtype=torch.float32)
    x = torch.randn(1, in_features, device=device, dtype=torch.float16)
    rates = []
    for dtype in MEASURED_DTYPES:
        try:
            linear: Any
            if dtype == "f16":
                linear = torch.nn.Linear(in_features, out_features, bias=False, device=device,
                                         dtype=torch.float16)
                linear.weight.data.copy_(weight)
            elif quantized is not None:
                linear = quantized(weight, dtype)
            else:
                continue
            with torch.no_grad():
                rate = _rate(lambda: linear(x), 1.0, budget_s / len(MEASURED_DTYPES), sync,
                             clock)
        except (RuntimeError, NotImplementedError):  # no such kernel for this card
            continue
        rates.append((dtype, rate))
    return tuple(rates)


def _rate(work: Callable[[], Any], units: float, budget_s: float, sync: Callable[[], None],
          clock: Callable[[], float], windows: int = 4) -> float:
    """Units per second of ``work``: a warm-up of a fifth of ``budget_s`` (thread pools,
    page faults, kernel selection), then the best of ``windows`` equal windows, so a
    burst of other work on the machine does not stick to the card."""
    def run_for(seconds: float, least: int = 1) -> float:
        count, start = 0, clock()
        while True:
            work()
            count += 1
            sync()
            elapsed = clock() - start
            if elapsed >= seconds and count >= least:
                return units * count / elapsed

    run_for(budget_s / 5, least=3)  # the first calls start thread pools and pick kernels
    return max(run_for(budget_s * 4 / 5 / windows) for _ in range(windows))


class BenchmarkCache:
    """``benchmarks.json`` in the state directory, keyed by hardware fingerprint."""

    def __init__(self, home: Path) -> None:
        self.path = Path(home) / CACHE_FILE

    def load(self) -> dict[str, Benchmark]:
        try:
            data = json.loads(self.path.read_text())
            return {k: Benchmark.from_dict(v) for k, v in data.get("benchmarks", {}).items()}
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ConfigError(
                f"cannot read {self.path} ({exc}): delete it and run `p2pswarm bench`"
            ) from exc

    def save(self, benchmarks: Mapping[str, Benchmark]) -> None:
        data = {"version": CACHE_VERSION,
                "benchmarks": {k: benchmarks[k].to_dict() for k in sorted(benchmarks)}}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(data, indent=2))
            os.replace(tmp, self.path)  # atomic: a crash never leaves half a file
        except OSError as exc:
            raise ConfigError(
                f"cannot write {self.path} ({exc}): check that --home is writable"
            ) from exc


def benchmarks_for(cards: Sequence[Card], cache: BenchmarkCache, rerun: bool = False,
                   seconds: float = 2.0,
                   measure_fn: Callable[[Card, float], Benchmark] | None = None,
                   quantized: QuantizedLinear | None = None) -> dict[str, Benchmark]:
    """Each card's benchmark by card key (``cuda:0``): cached, measured, or estimated.

    With ``rerun`` every card is measured now and the cache updated; without it, a card
    missing from the cache gets the conservative estimate (measuring is for `bench`).
    """
    run = measure_fn or (lambda card, s: measure(card, s, quantized=quantized))
    cached = cache.load()
    result: dict[str, Benchmark] = {}
    for card in cards:
        fp = fingerprint(card)
        if rerun:
            cached[fp] = run(card, seconds)
        result[card.key] = cached.get(fp) or estimate(card)
    if rerun:
        cache.save(cached)
    return result


__all__ = [
    "BenchmarkCache",
    "QuantizedLinear",
    "benchmarks_for",
    "compute_dtype",
    "dtype_tokens_per_s",
    "measure",
]
