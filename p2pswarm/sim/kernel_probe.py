"""What this machine's torch offers for quantized linears: which kernels exist, whether
each runs, how far its output is from the float32 linear, and its time per call.

    python -m p2pswarm.sim.kernel_probe [--json] [--in 1024] [--out 2816] [--group 32]

Run on the card it describes (``simulations/arm64.py`` runs it inside the arm64 root, so
the aarch64 wheel answers). Under emulation the times say nothing of a real CPU; the
presence and the errors do. The kernels:

- ``f32``: ``F.linear``, the reference;
- ``dynamic_int8[ENGINE]``: ``torch.ao``'s dynamic int8 linear (int8 weights per row,
  activations quantized per call) on each of ``torch.backends.quantized.supported_engines``
  (``x86``/``fbgemm``/``onednn`` on x86, ``qnnpack`` on Arm);
- ``weight_int8pack_mm``: ``aten._weight_int8pack_mm`` (int8 weights, float activations);
- ``weight_int4pack_mm_for_cpu``: ``aten._weight_int4pack_mm_for_cpu`` (4-bit groups);
- ``dyn_quant_matmul_4bit``: ``aten._dyn_quant_matmul_4bit`` (4-bit groups, activations
  quantized per call; KleidiAI's kernels on aarch64 builds that have them).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

ROUNDS = 5
BUILD_FLAGS = ("BUILD_TYPE=", "USE_MKLDNN", "USE_KLEIDIAI", "USE_ACL", "CPU capability")


def _timed(call: Callable[[], Any]) -> tuple[Any, float]:
    """The call's result and its least time in ms over a few rounds (after one warm-up)."""
    out = call()
    times = []
    for _ in range(ROUNDS):
        t0 = time.perf_counter()
        call()
        times.append((time.perf_counter() - t0) * 1000.0)
    return out, min(times)  # the least: other work on the machine only adds


def _error(torch: Any, got: Any, want: Any) -> float:
    """Largest absolute difference, relative to the largest reference value."""
    scale = float(want.abs().max()) or 1.0
    return round(float((got.float() - want).abs().max()) / scale, 5)


def _try(name: str, results: dict[str, Any], run: Callable[[], dict[str, Any]]) -> None:
    try:
        results[name] = {"ok": True, **run()}
    except Exception as e:  # a missing kernel is an answer, not a failure of the probe
        results[name] = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:200]}"}


def probe(in_features: int, out_features: int, group: int, seed: int = 0) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    warnings.filterwarnings("ignore")  # torch.ao's deprecation notes: this probes it anyway
    torch.manual_seed(seed)
    x = torch.randn(1, in_features)
    w = torch.randn(out_features, in_features) * 0.02
    want, f32_ms = _timed(lambda: F.linear(x, w))
    kernels: dict[str, Any] = {"f32": {"ok": True, "ms": round(f32_ms, 3), "error": 0.0}}
    engines = list(torch.backends.quantized.supported_engines)

    for engine in engines:
        if engine == "none":
            continue

        def dynamic(engine: str = engine) -> dict[str, Any]:
            torch.backends.quantized.engine = engine
            lin = torch.nn.Linear(in_features, out_features, bias=False)
            lin.weight.data.copy_(w)
            q = torch.ao.quantization.quantize_dynamic(  # type: ignore[no-untyped-call]
                torch.nn.Sequential(lin), {torch.nn.Linear}, dtype=torch.qint8)
            with torch.no_grad():
                got, ms = _timed(lambda: q(x))
            return {"ms": round(ms, 3), "error": _error(torch, got, want)}

        _try(f"dynamic_int8[{engine}]", kernels, dynamic)

    def int8pack() -> dict[str, Any]:
        scales = w.abs().amax(dim=1) / 127.0
        q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
        got, ms = _timed(lambda: torch.ops.aten._weight_int8pack_mm(x, q, scales))
        return {"ms": round(ms, 3), "error": _error(torch, got, want)}

    _try("weight_int8pack_mm", kernels, int8pack)

    def grouped_int4() -> tuple[Any, Any, Any]:
        """4-bit values in [0, 15] (zero point 8) and one scale per group of a row."""
        g = w.reshape(out_features, in_features // group, group)
        scales = g.abs().amax(dim=2, keepdim=True).clamp(min=1e-8) / 7.0
        q = (torch.round(g / scales) + 8).clamp(0, 15).to(torch.uint8)
        return q.reshape(out_features, in_features), scales.reshape(out_features, -1), g

    def int4pack() -> dict[str, Any]:
        q, scales, _ = grouped_int4()
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
        # (groups, out, 2): scale and a float zero, w = (q - 8) * s + zero; symmetric: 0
        s = scales.t().contiguous()
        sz = torch.stack([s, torch.zeros_like(s)], dim=2).contiguous()
        got, ms = _timed(lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, sz))
        return {"ms": round(ms, 3), "error": _error(torch, got, want)}

    _try("weight_int4pack_mm_for_cpu", kernels, int4pack)

    def dyn4() -> dict[str, Any]:
        q, scales, _ = grouped_int4()
        # two 4-bit values per byte, low nibble first, as aten's own test packs them
        q8 = q.to(torch.uint8)
        packed_u8 = (q8[:, 1::2] << 4 | q8[:, ::2]).contiguous()
        packed = torch.ops.aten._dyn_quant_pack_4bit_weight(
            packed_u8, scales.reshape(-1).contiguous(), None, group, in_features,
            out_features)
        got, ms = _timed(lambda: torch.ops.aten._dyn_quant_matmul_4bit(
            x, packed, group, in_features, out_features))
        return {"ms": round(ms, 3), "error": _error(torch, got, want)}

    _try("dyn_quant_matmul_4bit", kernels, dyn4)

    config = torch.__config__.show()
    kleidiai = getattr(getattr(torch.backends, "kleidiai", None), "is_available", None)
    return {
        "machine": platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_built": torch.version.cuda,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "quantized_engines": engines,
        "kleidiai_available": bool(kleidiai()) if callable(kleidiai) else None,
        # as torch's own build summary words them (a flag left out is not shown there)
        "build_flags": sorted({t.strip() for t in config.replace("\n", ",").split(",")
                               if t.strip().startswith(BUILD_FLAGS)}),
        "threads": torch.get_num_threads(),
        "shape": {"in": in_features, "out": out_features, "group": group, "batch": 1},
        "kernels": kernels,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--in", dest="in_features", type=int, default=1024)
    p.add_argument("--out", dest="out_features", type=int, default=2816)
    p.add_argument("--group", type=int, default=32)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.in_features % args.group or args.in_features % 2 or args.group < 2:
        print(f"error: --in {args.in_features} must be a multiple of --group {args.group} "
              "(an even number of 2 or more)", file=sys.stderr)
        return 2
    report = probe(args.in_features, args.out_features, args.group)
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"{report['machine']}, torch {report['torch']}, {report['cpu_capability']}, "
          f"engines {', '.join(report['quantized_engines'])}, "
          f"KleidiAI {report['kleidiai_available']}")
    for name, k in report["kernels"].items():
        if k["ok"]:
            print(f"  {name:30s} {k['ms']:9.3f} ms  error {k['error']}")
        else:
            print(f"  {name:30s} unavailable: {k['error']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
