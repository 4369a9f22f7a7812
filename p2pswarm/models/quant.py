"""Weight-only quantized linears: int8 per output channel, and 4-bit in groups.

Both replace ``nn.Linear`` inside decoder layers; embeddings, norms and the head stay in
the compute dtype. Activations never leave the compute dtype: each forward dequantizes
its weight into one workspace shared by every quantized linear of a stage, then runs an
ordinary ``F.linear``. A stage runs one step at a time, so one workspace suffices.
The bytes each scheme takes are in ``footprint.py``. Unpacking 4-bit weights also makes
two short-lived uint8 temporaries of ``out * in / 2`` bytes each, freed before the matmul.

Quantization is symmetric: int8 stores round(w / s) in [-127, 127] with s = max|w| / 127
per row; int4 stores round(w / s) + 8 in [0, 15] with s = max|w| / 7 per group, two
values per byte (low nibble first).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from p2pswarm.errors import ConfigError
from p2pswarm.shapes.footprint import check_quant


class DequantWorkspace:
    """One flat buffer in the compute dtype, reused by every quantized linear of a stage."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        self.buffer = torch.empty(numel, dtype=dtype, device=device)

    def view(self, out_features: int, in_features: int) -> torch.Tensor:
        return self.buffer[: out_features * in_features].view(out_features, in_features)


class Int8Linear(nn.Module):
    """y = x @ (q * s)^T + b with q int8 of shape (out, in) and s float32 of shape (out,)."""

    qweight: torch.Tensor
    scales: torch.Tensor

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                 workspace: DequantWorkspace) -> None:
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.workspace = workspace

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None,
                   workspace: DequantWorkspace) -> Int8Linear:
        w = weight.float()
        scales = w.abs().amax(dim=1) / 127.0
        scales = torch.where(scales == 0, torch.ones_like(scales), scales)
        q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
        return cls(q, scales, _bias_like(bias, workspace), workspace)

    def dequantize(self) -> torch.Tensor:
        w = self.workspace.view(self.out_features, self.in_features)
        w.copy_(self.qweight)
        return w.mul_(self.scales[:, None])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantize(), self.bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, int8 per row"


class Int4Linear(nn.Module):
    """Symmetric 4-bit weights, one float16 scale per ``group_size`` inputs of a row."""

    packed: torch.Tensor
    scales: torch.Tensor

    def __init__(self, packed: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                 workspace: DequantWorkspace, group_size: int) -> None:
        super().__init__()
        self.out_features = packed.shape[0]
        self.in_features = packed.shape[1] * 2
        self.group_size = group_size
        self.register_buffer("packed", packed)  # uint8 (out, in / 2)
        self.register_buffer("scales", scales)  # float16 (out, in / group)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.workspace = workspace

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None,
                   workspace: DequantWorkspace, group_size: int) -> Int4Linear:
        out_features, in_features = weight.shape
        if in_features % group_size:
            raise ConfigError(
                f"int4 needs in_features ({in_features}) divisible by group size {group_size}"
            )
        groups = weight.float().view(out_features, in_features // group_size, group_size)
        scales = (groups.abs().amax(dim=2) / 7.0).to(torch.float16)
        scales = torch.where(scales == 0, torch.ones_like(scales), scales)
        # quantize against the float16 scale actually stored, so dequantization agrees
        q = torch.round(groups / scales.float()[..., None]).clamp_(-8, 7) + 8
        q = q.to(torch.uint8).view(out_features, in_features // 2, 2)
        packed = q[..., 0] | (q[..., 1] << 4)
        return cls(packed.contiguous(), scales, _bias_like(bias, workspace), workspace, group_size)

    def dequantize(self) -> torch.Tensor:
        w = self.workspace.view(self.out_features, self.in_features)
        pairs = w.view(self.out_features, self.in_features // 2, 2)
        pairs[..., 0].copy_(self.packed & 0x0F)
        pairs[..., 1].copy_(self.packed >> 4)
        groups = w.view(self.out_features, -1, self.group_size)
        groups.sub_(8).mul_(self.scales[..., None])
        return w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantize(), self.bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, int4 group {self.group_size}"


def quantize_linear(weight: torch.Tensor, bias: torch.Tensor | None, *, scheme: str,
                    group_size: int, workspace: DequantWorkspace) -> nn.Module:
    """A quantized stand-in for ``nn.Linear(weight, bias)``."""
    check_quant(scheme, group_size)
    if scheme == "int8":
        return Int8Linear.from_float(weight, bias, workspace)
    if scheme == "int4":
        return Int4Linear.from_float(weight, bias, workspace, group_size)
    raise ConfigError("quantize_linear needs int8 or int4")


def _bias_like(bias: torch.Tensor | None, workspace: DequantWorkspace) -> torch.Tensor | None:
    if bias is None:
        return None
    return bias.to(device=workspace.buffer.device, dtype=workspace.buffer.dtype)
