"""Quantized linears that compute on packed weights: int8 per output row, 4-bit in groups.

Both replace ``nn.Linear`` inside decoder layers; embeddings, norms and the head stay in
the compute dtype. The kernel is chosen per CPU, by measurement (docs/serving.md has the
figures; ``simulations/bench_quant.py`` measures them again):

    scheme  x86-64 (fbgemm in PyTorch's wheels)        aarch64 / anything else
    int8    ``quantized::linear_dynamic`` (fbgemm:       qnnpack's dynamic linear where
            int8 activations x int8 weights, int32      PyTorch has it, else ``reference``
            accumulation), 2-3x faster than f32
    int4    ``native`` (``q4_kernel``: a C kernel        ``native``, else ``reference``
            built on first use) up to 8 rows, else
            fbgemm's 4-bit embedding-bag kernel as a
            matrix-vector product (below); unpack
            once per call at prefill

``reference`` dequantizes the weight into a workspace and runs ``F.linear``: correct
everywhere, slow; it is the fallback and what the kernels are tested against.

int8: symmetric, round(w / s) in [-127, 127] with s = max|w| / 127 per output row.
4-bit: the weight's transpose is cut into rows of ``group_size`` consecutive outputs for
one input; each row keeps 4-bit codes and a float16 scale and offset (min/max, fbgemm's
``embedding_bag_4bit`` layout). Then ``y[b, j*g:(j+1)*g] = sum_k x[b, k] * row(j, k)`` is
one embedding bag per (b, j) with the inputs as per-sample weights: fbgemm reads the
4-bit codes directly. The native kernel reads the same bytes: per (j, k) it multiplies
the row's codes by ``x[k] * scale`` into the group's sums, and adds ``sum_k x[k] * offset``
to every output of the group at the end. Outputs are padded up to a multiple of the group
with zero rows.

Bytes (``shapes/footprint.py``): the packed int8 weight is fbgemm's PackBMatrix, inputs
rounded up to 512 and outputs to 8 on AVX2, plus three 4-byte numbers per output row
(scale, zero point, column offset); 4-bit is ``ceil(out / g) * in * (g / 2 + 4)``.
A layer whose quantized weight differs from the float one by more than ``ERROR_BOUND``
(relative Frobenius norm) is refused: serving it would be serving garbage.
"""

from __future__ import annotations

import functools
import platform
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from p2pswarm.errors import ConfigError
from p2pswarm.models import q4_kernel
from p2pswarm.shapes.footprint import check_quant, linear_weight_bytes

# relative Frobenius error of a layer's dequantized weight against the float weight;
# Gaussian weights give about 0.005 (int8) and 0.08 (4-bit, groups of 32)
ERROR_BOUND = {"int8": 0.05, "int4": 0.25}
KERNELS = ("fbgemm", "qnnpack", "reference")
INT4_KERNELS = ("native", "fbgemm", "reference")
# at more rows than this a 4-bit call unpacks its weight once and runs one float matmul
# (prefill); the native and bag kernels' cost grows with the rows, the unpack's does not
INT4_BAG_MAX_ROWS = q4_kernel.MAX_ROWS
# up to this many rows (a decode batch) an int8 call quantizes each row's activations
# alone; prefill chunks share one scale per call
INT8_ROWWISE_MAX_ROWS = 8
# torch runs an elementwise op on several threads past this many elements (its grain)
PARALLEL_GRAIN = 32768


class DequantWorkspace:
    """One flat buffer in the compute dtype, reused by every quantized linear of a stage:
    the reference kernel, prefill of 4-bit layers, LoRA's backward pass and export."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        self.buffer = torch.empty(numel, dtype=dtype, device=device)

    def view(self, out_features: int, in_features: int) -> torch.Tensor:
        return self.buffer[: out_features * in_features].view(out_features, in_features)


def _is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")


def _is_arm() -> bool:
    return platform.machine().lower() in ("aarch64", "arm64")


@functools.cache
def default_kernel(scheme: str) -> str:
    """The kernel this CPU runs ``scheme`` on (see the module docstring's table); for
    4-bit, the first call builds the native kernel (or finds it in the cache)."""
    if scheme == "int4" and q4_kernel.native() is not None:
        return "native"
    engines = torch.backends.quantized.supported_engines
    if _is_x86() and "fbgemm" in engines:
        return "fbgemm"
    if scheme == "int8" and _is_arm() and "qnnpack" in engines:
        return "qnnpack"
    return "reference"


def _kernel_for(scheme: str, asked: str | None, workspace: DequantWorkspace) -> str:
    if workspace.buffer.device.type != "cpu":
        return "reference"  # the packed kernels are CPU kernels
    return asked or default_kernel(scheme)


def _refuse_if_far(scheme: str, weight: torch.Tensor, approx: torch.Tensor) -> None:
    norm = float(weight.norm())
    error = float((approx - weight).norm()) / norm if norm > 0 else 0.0
    if not error <= ERROR_BOUND[scheme]:  # NaN (a weight that is not finite) too
        raise ConfigError(
            f"{scheme} would change a {weight.shape[0]}x{weight.shape[1]} layer's weight by "
            f"{error:.1%} (bound {ERROR_BOUND[scheme]:.0%}); serve this model unquantized or "
            f"in int8")


def _bias_like(bias: torch.Tensor | None, workspace: DequantWorkspace) -> nn.Parameter | None:
    if bias is None:
        return None
    return nn.Parameter(bias.to(device=workspace.buffer.device, dtype=workspace.buffer.dtype),
                        requires_grad=False)


class Int8Linear(nn.Module):
    """y = x @ (q * s)^T + b with q int8 (out, in) and s float32 (out,), packed for the
    kernel (fbgemm/qnnpack: an opaque prepacked weight, no plain copy kept)."""

    qweight: torch.Tensor  # the reference kernel's only
    scales: torch.Tensor

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                 workspace: DequantWorkspace, kernel: str) -> None:
        super().__init__()
        if kernel not in KERNELS:
            raise ConfigError(f"unknown kernel {kernel!r}; use one of {KERNELS}")
        self.out_features, self.in_features = q.shape
        self.kernel = kernel
        self.bias = _bias_like(bias, workspace)
        self.workspace = workspace
        self._packed: Any = None
        if kernel == "reference":
            self.register_buffer("qweight", q)
            self.register_buffer("scales", scales)
        else:
            self._packed = _prepack_int8(q, scales, kernel)

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None,
                   workspace: DequantWorkspace, kernel: str | None = None) -> Int8Linear:
        w = weight.float()
        scales = w.abs().amax(dim=1) / 127.0
        scales = torch.where(scales == 0, torch.ones_like(scales), scales)
        q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
        _refuse_if_far("int8", w, q.float() * scales[:, None])
        return cls(q, scales, bias, workspace, _kernel_for("int8", kernel, workspace))

    def packed_bytes(self) -> int:
        """Bytes the prepacked weight holds outside any tensor (0 for the reference)."""
        if self._packed is None:
            return 0
        return linear_weight_bytes(self.in_features, self.out_features, scheme="int8",
                                   dtype_bytes=1)

    def dequantize(self) -> torch.Tensor:
        w = self.workspace.view(self.out_features, self.in_features)
        if self._packed is None:
            w.copy_(self.qweight)
            return w.mul_(self.scales[:, None])
        qweight, _ = torch.ops.quantized.linear_unpack(self._packed)
        return w.copy_(qweight.dequantize())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed is None:
            return F.linear(x, self.dequantize(), self.bias)
        flat = x.reshape(-1, self.in_features)
        if flat.dtype != torch.float32 or not flat.is_contiguous():
            flat = flat.float().contiguous()
        # fbgemm without VNNI saturates 8-bit x 8-bit pair sums unless activations keep 7 bits
        reduce_range = self.kernel == "fbgemm"
        if 1 < flat.shape[0] <= INT8_ROWWISE_MAX_ROWS:
            # one activation scale per call: a decode batch calls per row, so a session's
            # tokens do not depend on which others share its batch
            y = torch.cat([torch.ops.quantized.linear_dynamic(row, self._packed, reduce_range)
                           for row in torch.split(flat, 1)])
        else:
            y = torch.ops.quantized.linear_dynamic(flat, self._packed, reduce_range)
        y = y.to(x.dtype).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    @classmethod
    def fused(cls, parts: Sequence[Int8Linear]) -> Int8Linear | None:
        """One packed linear for ``parts`` (same inputs), outputs stacked in order: the
        same numbers (weights are per row, activations are quantized per call either
        way), or None where it would not hold the same bytes or has no packed weight."""
        first = parts[0]
        if (first._packed is None or any(p.kernel != first.kernel or p._packed is None
                                         or p.in_features != first.in_features
                                         for p in parts)
                or len({p.bias is None for p in parts}) != 1):
            return None
        out = sum(p.out_features for p in parts)
        if linear_weight_bytes(first.in_features, out, scheme="int8", dtype_bytes=1) != sum(
                p.packed_bytes() for p in parts):
            return None  # padded differently: the plan's bytes would no longer hold
        qs, scales = [], []
        for p in parts:
            qweight, _ = torch.ops.quantized.linear_unpack(p._packed)
            qs.append(qweight.int_repr())
            scales.append(qweight.q_per_channel_scales().float())
        bias = None if first.bias is None else torch.cat([p.bias for p in parts
                                                          if p.bias is not None])
        return cls(torch.cat(qs), torch.cat(scales), bias, first.workspace, first.kernel)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, int8 per row, {self.kernel}"


def _prepack_int8(q: torch.Tensor, scales: torch.Tensor, kernel: str) -> Any:
    previous = torch.backends.quantized.engine
    torch.backends.quantized.engine = kernel
    try:
        with warnings.catch_warnings():  # quantized tensors are deprecated; the op is not
            warnings.simplefilter("ignore")
            qtensor = torch._make_per_channel_quantized_tensor(
                q.cpu(), scales.double().cpu(), torch.zeros(q.shape[0], dtype=torch.long), 0)
            return torch.ops.quantized.linear_prepack(qtensor, None)
    finally:
        torch.backends.quantized.engine = previous


class Int4Linear(nn.Module):
    """4-bit weights in fbgemm's embedding-bag layout: rows of ``group_size`` outputs for
    one input, each with a float16 scale and offset (see the module docstring)."""

    packed: torch.Tensor

    def __init__(self, packed: torch.Tensor, out_features: int, in_features: int,
                 bias: torch.Tensor | None, workspace: DequantWorkspace, group_size: int,
                 kernel: str, parts: tuple[int, ...] = ()) -> None:
        super().__init__()
        if kernel not in INT4_KERNELS + KERNELS:
            raise ConfigError(f"unknown kernel {kernel!r}; use one of {INT4_KERNELS}")
        if kernel == "native" and q4_kernel.native() is None:
            kernel = "fbgemm" if default_kernel("int8") == "fbgemm" else "reference"
        self.out_features, self.in_features = out_features, in_features
        # the outputs of the linears fused into this one (``fused``): a float weight is
        # made one part at a time, so the workspace of the largest unfused linear holds it
        self.parts = parts or (out_features,)
        self.group_size = group_size
        self.groups = -(-out_features // group_size)  # padded outputs / group
        self.kernel = kernel if kernel in ("native", "fbgemm") else "reference"
        if packed.shape != (self.groups * in_features, group_size // 2 + 4) or (
                packed.dtype != torch.uint8):
            raise ConfigError(f"a 4-bit weight of {out_features}x{in_features} in groups of "
                              f"{group_size} has packed shape {tuple(packed.shape)}")
        self.register_buffer("packed", packed.contiguous())  # uint8 (groups * in, group / 2 + 4)
        self.bias = _bias_like(bias, workspace)
        self.workspace = workspace
        self._bags: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None,
                   workspace: DequantWorkspace, group_size: int,
                   kernel: str | None = None) -> Int4Linear:
        out_features, in_features = weight.shape
        check_quant("int4", group_size)
        groups = -(-out_features // group_size)
        w = torch.zeros(groups * group_size, in_features)
        w[:out_features] = weight.float()
        rows = (w.t().reshape(in_features, groups, group_size).transpose(0, 1)
                .reshape(groups * in_features, group_size).contiguous())
        packed = torch.ops.quantized.embedding_bag_4bit_prepack(rows)
        layer = cls(packed, out_features, in_features, bias, workspace, group_size,
                    _kernel_for("int4", kernel, workspace))
        _refuse_if_far("int4", weight.float(), layer._unpacked())
        return layer

    def _unpacked(self, first_group: int = 0, out_features: int | None = None
                  ) -> torch.Tensor:
        """The float32 weight (out, in) of ``out_features`` outputs from group
        ``first_group`` on (default: all of them), a fresh tensor."""
        out = self.out_features if out_features is None else out_features
        groups = -(-out // self.group_size)
        packed = self.packed[first_group * self.in_features:
                             (first_group + groups) * self.in_features]
        rows: torch.Tensor = torch.ops.quantized.embedding_bag_4bit_unpack(packed)
        w = rows.view(groups, self.in_features, self.group_size).permute(0, 2, 1)
        return w.reshape(groups * self.group_size, self.in_features)[:out]

    def dequantize(self) -> torch.Tensor:
        if len(self.parts) > 1:
            raise ConfigError("a fused 4-bit linear is dequantized one part at a time")
        w = self.workspace.view(self.out_features, self.in_features)
        return w.copy_(self._unpacked())

    def _float_forward(self, x: torch.Tensor) -> torch.Tensor:
        """Through the float weight, made in the workspace (one part at a time)."""
        if len(self.parts) == 1:
            return F.linear(x, self.dequantize(), self.bias)
        outs, first, start = [], 0, 0
        for n in self.parts:
            w = self.workspace.view(n, self.in_features)
            w.copy_(self._unpacked(first, n))
            bias = None if self.bias is None else self.bias[start:start + n]
            outs.append(F.linear(x, w, bias))
            first, start = first + n // self.group_size, start + n
        return torch.cat(outs, dim=-1)

    @classmethod
    def fused(cls, parts: Sequence[Int4Linear]) -> Int4Linear | None:
        """One 4-bit linear for ``parts`` (same inputs), outputs stacked in order: their
        groups one after the other (the same numbers, the same bytes), or None where a
        part's outputs are not whole groups."""
        first = parts[0]
        if any(p.kernel != first.kernel or p.group_size != first.group_size
               or p.in_features != first.in_features or p.out_features % p.group_size
               or len(p.parts) != 1 for p in parts) or len({p.bias is None for p in parts}) != 1:
            return None
        bias = None if first.bias is None else torch.cat([p.bias for p in parts
                                                          if p.bias is not None])
        return cls(torch.cat([p.packed for p in parts]), sum(p.out_features for p in parts),
                   first.in_features, bias, first.workspace, first.group_size, first.kernel,
                   tuple(p.out_features for p in parts))

    def _bag(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Indices and offsets for ``batch`` rows of input (a few sizes, kept)."""
        if batch not in self._bags:
            n = self.groups * self.in_features
            indices = torch.arange(n, dtype=torch.int32).repeat(batch)
            offsets = torch.arange(0, batch * n + 1, self.in_features, dtype=torch.int32)
            self._bags[batch] = (indices, offsets)
        return self._bags[batch]

    def _bag_weights(self, flat: torch.Tensor) -> torch.Tensor:
        """The inputs once per group of outputs (the bags' per-sample weights), copied in
        pieces below torch's parallel grain: one copy of them all goes to every thread,
        and on a loaded machine waking a second thread for a 0.1 ms copy costs a time
        slice (measured: 20 ms at 2 threads)."""
        batch = flat.shape[0]
        weights = torch.empty(batch, self.groups, self.in_features)
        step = max(1, PARALLEL_GRAIN // (batch * self.in_features))
        rows = flat.float().unsqueeze(1)
        for first in range(0, self.groups, step):
            weights[:, first:first + step] = rows
        return weights.view(-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        batch = flat.shape[0]
        if self.kernel == "reference" or batch > INT4_BAG_MAX_ROWS or x.device.type != "cpu":
            return self._float_forward(x)
        kernel = q4_kernel.native() if self.kernel == "native" else None
        if kernel is not None:
            rows = flat.detach()
            if rows.dtype != torch.float32 or not rows.is_contiguous():
                rows = rows.float().contiguous()
            return self._finish(kernel.gemv(self.packed, self.groups, self.in_features,
                                            self.group_size, rows, torch.get_num_threads()), x)
        indices, offsets = self._bag(batch)
        weights = self._bag_weights(flat)
        y: torch.Tensor = torch.ops.quantized.embedding_bag_4bit_rowwise_offsets(
            self.packed, indices, offsets, False, 0, False, weights, None, True)
        return self._finish(y.view(batch, self.groups * self.group_size), x)

    def _finish(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The padded outputs (rows, groups * g) as the linear's output for ``x``."""
        y = y[:, : self.out_features].to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, 4-bit group "
                f"{self.group_size}, {self.kernel}")


def quantize_linear(weight: torch.Tensor, bias: torch.Tensor | None, *, scheme: str,
                    group_size: int, workspace: DequantWorkspace,
                    kernel: str | None = None) -> nn.Module:
    """A quantized stand-in for ``nn.Linear(weight, bias)``."""
    check_quant(scheme, group_size)
    if scheme == "int8":
        return Int8Linear.from_float(weight, bias, workspace, kernel)
    if scheme == "int4":
        return Int4Linear.from_float(weight, bias, workspace, group_size, kernel)
    raise ConfigError("quantize_linear needs int8 or int4")


def fuse(parts: Sequence[nn.Module]) -> nn.Module | None:
    """One linear computing ``parts`` (linears of the same input) with their outputs
    stacked in order, holding the same bytes: plain, int8 or 4-bit alike. None where they
    cannot be fused so (mixed kinds, a LoRA-wrapped linear, a reference int8 kernel)."""
    if all(type(p) is nn.Linear for p in parts):
        linears = [p for p in parts if isinstance(p, nn.Linear)]
        if len({p.bias is None for p in linears}) != 1:
            return None
        first = linears[0]
        out = nn.Linear(first.in_features, sum(p.out_features for p in linears),
                        bias=first.bias is not None, device="meta")
        with torch.no_grad():
            out.weight = nn.Parameter(torch.cat([p.weight for p in linears]),
                                      requires_grad=False)
            if first.bias is not None:
                out.bias = nn.Parameter(torch.cat([p.bias for p in linears
                                                   if p.bias is not None]),
                                        requires_grad=False)
        return out
    if all(type(p) is Int8Linear for p in parts):
        return Int8Linear.fused([p for p in parts if isinstance(p, Int8Linear)])
    if all(type(p) is Int4Linear for p in parts):
        return Int4Linear.fused([p for p in parts if isinstance(p, Int4Linear)])
    return None


def packed_bytes(model: nn.Module) -> int:
    """Bytes a model's prepacked int8 weights hold outside its tensors."""
    return sum(m.packed_bytes() for m in model.modules() if isinstance(m, Int8Linear))
