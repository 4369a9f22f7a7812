"""Build one stage of a model from a tensor source, reading only that stage's tensors.

The stage's modules are first made on the ``meta`` device (shapes, no memory). Then each
tensor is read alone, cast to the planned dtype on the target device and put in place;
decoder-layer linears are quantized as they arrive. So the peak is the stage itself plus
one tensor in flight, never the whole model.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from p2pswarm.errors import ConfigError
from p2pswarm.models.builtin import BUILTIN_MODELS, BuiltinModel
from p2pswarm.models.checkpoint import Checkpoint
from p2pswarm.models.config import ModelConfig
from p2pswarm.models.families import AnyStageModel, block_linears, stage_model, tensor_map
from p2pswarm.models.footprint import check_quant
from p2pswarm.models.llama import StageModel, rope_inv_freq
from p2pswarm.models.quant import DequantWorkspace, quantize_linear
from p2pswarm.models.rwkv7_pth import PthCheckpoint, find_pth

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
}


class TensorSource(Protocol):
    """Anything that hands out a model's tensors by checkpoint name."""

    @property
    def name(self) -> str: ...

    @property
    def config(self) -> ModelConfig: ...

    def read(self, names: Sequence[str],
             device: torch.device | str) -> Iterator[tuple[str, torch.Tensor]]: ...


def open_model(model: str | Path) -> Checkpoint | BuiltinModel | PthCheckpoint:
    """A built-in model by name, else the model directory (or RWKV ``.pth``) at that path."""
    if isinstance(model, str) and model in BUILTIN_MODELS:
        return BuiltinModel(model)
    pth = find_pth(Path(model))
    if pth is not None:
        return PthCheckpoint(pth)
    return Checkpoint(model)


def compute_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ConfigError(f"unknown dtype {name!r}; use one of {', '.join(DTYPES)}") from None


def load_stage_model(source: TensorSource, start_layer: int, end_layer: int, *,
                     dtype: str = "float32", device: torch.device | str = "cpu",
                     quant: str = "none", group_size: int = 32) -> AnyStageModel:
    """Layers [start_layer, end_layer) of ``source`` on ``device``, ready for inference."""
    torch_dtype = compute_dtype(dtype)
    check_quant(quant, group_size)
    device = torch.device(device)
    with torch.device("meta"):
        model = stage_model(source.config, start_layer, end_layer)
    if quant != "none" and model.largest_linear_numel():
        model.workspace = DequantWorkspace(model.largest_linear_numel(), torch_dtype, device)
    names = tensor_map(source.config, start_layer, end_layer)
    linears = block_linears(source.config)
    for name, tensor in source.read(list(names), device):
        expected = _expected_shape(model, names[name][0])
        if len(expected) == 1 and tensor.numel() == expected[0]:
            tensor = tensor.reshape(expected)  # RWKV vectors are stored (1, 1, C) or (C,)
        if tuple(tensor.shape) != expected:
            raise ConfigError(f"{source.name}: {name} has shape {tuple(tensor.shape)}, "
                              f"the config says {expected}")
        tensor = tensor.to(device)
        cast: nn.Parameter | None = None  # one copy even when it fills two places (tied)
        for local in names[name]:
            if quant != "none" and _is_block_linear_weight(local, linears):
                _quantize_into(model, local, tensor, quant, group_size)
                continue
            if cast is None:
                value = tensor.to(torch_dtype)
                if _stored_transposed(model, names[name]):
                    value = value.t().contiguous().t()
                cast = nn.Parameter(value, requires_grad=False)
            module_name, _, attr = local.rpartition(".")
            setattr(model.get_submodule(module_name), attr, cast)
        del tensor, cast
    if isinstance(model, StageModel):
        model.rotary.inv_freq = rope_inv_freq(source.config, device)
    missing = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if missing:
        raise ConfigError(f"{source.name}: stage [{start_layer}, {end_layer}) did not receive "
                          f"{', '.join(missing[:5])}")
    return model.eval().requires_grad_(False)


def _stored_transposed(model: AnyStageModel, locals_: tuple[str, ...]) -> bool:
    """RWKV-7 keeps its linear weights as (in, out) in memory, seen as (out, in): one
    token's x @ W then reads W row by row, which CPUs do about twice as fast as the dot
    products of W x (the RWKV authors' own layout). Numbers and bytes are the same."""
    if model.config.model_type != "rwkv7":
        return False
    return all(local.endswith(".weight") and isinstance(
        model.get_submodule(local.rpartition(".")[0]), nn.Linear) for local in locals_)


def _expected_shape(model: AnyStageModel, local: str) -> tuple[int, ...]:
    module_name, _, attr = local.rpartition(".")
    return tuple(getattr(model.get_submodule(module_name), attr).shape)


def _is_block_linear_weight(local: str, linears: tuple[str, ...]) -> bool:
    # "layers.3.self_attn.q_proj.weight" -> "self_attn.q_proj"
    parts = local.split(".")
    return parts[0] == "layers" and parts[-1] == "weight" and ".".join(parts[2:-1]) in linears


def _quantize_into(model: AnyStageModel, local: str, weight: torch.Tensor, quant: str,
                   group_size: int) -> None:
    assert model.workspace is not None
    module_name = local.rpartition(".")[0]
    parent_name, _, child_name = module_name.rpartition(".")
    linear = model.get_submodule(module_name)
    # biases are listed before weights; one still on meta comes later (another shard)
    bias = getattr(linear, "bias", None)
    if bias is not None and bias.is_meta:
        bias = None
    quantized = quantize_linear(weight, bias, scheme=quant, group_size=group_size,
                                workspace=model.workspace)
    setattr(model.get_submodule(parent_name), child_name, quantized)
