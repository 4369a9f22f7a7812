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
from p2pswarm.models.hub import cached_snapshot, is_hub_id
from p2pswarm.models.llama import (
    BLOCK_LINEARS,
    StageModel,
    hf_tensor_map,
    hf_tensor_shape,
    is_fused,
)
from p2pswarm.models.quant import DequantWorkspace, quantize_linear
from p2pswarm.models.rwkv7 import BLOCK_LINEARS as RWKV7_LINEARS
from p2pswarm.models.rwkv7 import StageModel as Rwkv7StageModel
from p2pswarm.models.rwkv7 import hf_tensor_map as rwkv7_tensor_map
from p2pswarm.models.rwkv7_pth import PthCheckpoint, find_pth
from p2pswarm.shapes.footprint import check_quant
from p2pswarm.shapes.model_config import ModelConfig

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
    """A built-in model by name, else the model directory (or RWKV ``.pth``) at that path,
    else a hub id's snapshot in the local Hugging Face cache."""
    if isinstance(model, str) and model in BUILTIN_MODELS:
        return BuiltinModel(model)
    pth = find_pth(Path(model).expanduser())
    if pth is not None:
        return PthCheckpoint(pth)
    if isinstance(model, str) and is_hub_id(model) and not Path(model).expanduser().exists():
        return Checkpoint(cached_snapshot(model))
    return Checkpoint(model)


def compute_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ConfigError(f"unknown dtype {name!r}; use one of {', '.join(DTYPES)}") from None


def load_stage_model(source: TensorSource, start_layer: int, end_layer: int, *,
                     dtype: str = "float32", device: torch.device | str = "cpu",
                     quant: str = "none", group_size: int = 32
                     ) -> StageModel | Rwkv7StageModel:
    """Layers [start_layer, end_layer) of ``source`` on ``device``, ready for inference."""
    torch_dtype = compute_dtype(dtype)
    check_quant(quant, group_size)
    device = torch.device(device)
    if source.config.model_type == "rwkv7":
        return _load_rwkv7(source, start_layer, end_layer, torch_dtype, device, quant,
                           group_size)
    with torch.device("meta"):
        model = StageModel(source.config, start_layer, end_layer)
    if quant != "none" and model.largest_linear_numel():
        model.workspace = DequantWorkspace(model.largest_linear_numel(), torch_dtype, device)
    tensor_map = hf_tensor_map(source.config, start_layer, end_layer)
    for name, tensor in source.read(list(tensor_map), device):
        expected = hf_tensor_shape(source.config, name)
        if tuple(tensor.shape) != expected:
            raise ConfigError(f"{source.name}: {name} has shape {tuple(tensor.shape)}, "
                              f"the config says {expected}")
        tensor = tensor.to(device)
        locals_ = tensor_map[name]
        if is_fused(name):  # Phi-3: rows of q, k, v (gate, up) stacked in one tensor
            rows = [_expected_shape(model, local)[0] for local in locals_]
            for local, part in zip(locals_, torch.split(tensor, rows), strict=True):
                _put(model, local, part, torch_dtype, quant, group_size)
            del tensor
            continue
        cast: nn.Parameter | None = None  # one copy even when it fills two places (tied)
        for local in locals_:
            if quant != "none" and _is_block_linear_weight(local):
                _quantize_into(model, local, tensor, quant, group_size)
                continue
            if cast is None:
                cast = nn.Parameter(tensor.to(torch_dtype), requires_grad=False)
            module_name, _, attr = local.rpartition(".")
            setattr(model.get_submodule(module_name), attr, cast)
        del tensor, cast
    model.rotary.materialize(device)
    missing = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if missing:
        raise ConfigError(f"{source.name}: stage [{start_layer}, {end_layer}) did not receive "
                          f"{', '.join(missing[:5])}")
    return model.eval().requires_grad_(False)


def _load_rwkv7(source: TensorSource, start_layer: int, end_layer: int,
                torch_dtype: torch.dtype, device: torch.device, quant: str,
                group_size: int) -> Rwkv7StageModel:
    with torch.device("meta"):
        model = Rwkv7StageModel(source.config, start_layer, end_layer)
    if quant != "none" and model.largest_linear_numel():
        model.workspace = DequantWorkspace(model.largest_linear_numel(), torch_dtype, device)
    names = rwkv7_tensor_map(source.config, start_layer, end_layer)
    for name, tensor in source.read(list(names), device):
        expected = _expected_shape(model, names[name][0])
        if len(expected) == 1 and tensor.numel() == expected[0]:
            tensor = tensor.reshape(expected)  # RWKV vectors are stored (1, 1, C) or (C,)
        if tuple(tensor.shape) != expected:
            raise ConfigError(f"{source.name}: {name} has shape {tuple(tensor.shape)}, "
                              f"the config says {expected}")
        tensor = tensor.to(device)
        cast: nn.Parameter | None = None
        for local in names[name]:
            if quant != "none" and _is_block_linear_weight(local, RWKV7_LINEARS):
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
    missing = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if missing:
        raise ConfigError(f"{source.name}: stage [{start_layer}, {end_layer}) did not receive "
                          f"{', '.join(missing[:5])}")
    return model.eval().requires_grad_(False)


def _stored_transposed(model: Rwkv7StageModel, locals_: tuple[str, ...]) -> bool:
    """RWKV-7 keeps its linear weights as (in, out) in memory, seen as (out, in): one
    token's x @ W then reads W row by row, which CPUs do about twice as fast as the dot
    products of W x (the RWKV authors' own layout). Numbers and bytes are the same."""
    return all(local.endswith(".weight") and isinstance(
        model.get_submodule(local.rpartition(".")[0]), nn.Linear) for local in locals_)


def _put(model: StageModel, local: str, tensor: torch.Tensor, dtype: torch.dtype,
         quant: str, group_size: int) -> None:
    """One of our tensors in place: quantized if it is a decoder linear's weight and the
    stage is quantized, else cast (a copy, so a split part frees its fused tensor)."""
    if quant != "none" and _is_block_linear_weight(local):
        _quantize_into(model, local, tensor.contiguous(), quant, group_size)
        return
    module_name, _, attr = local.rpartition(".")
    setattr(model.get_submodule(module_name), attr,
            nn.Parameter(tensor.to(dtype).clone(), requires_grad=False))


def _expected_shape(model: StageModel | Rwkv7StageModel, local: str) -> tuple[int, ...]:
    module_name, _, attr = local.rpartition(".")
    return tuple(getattr(model.get_submodule(module_name), attr).shape)


def _is_block_linear_weight(local: str, linears: tuple[str, ...] = BLOCK_LINEARS) -> bool:
    # "layers.3.self_attn.q_proj.weight" -> "self_attn.q_proj"
    parts = local.split(".")
    return parts[0] == "layers" and parts[-1] == "weight" and ".".join(parts[2:-1]) in linears


def _quantize_into(model: StageModel | Rwkv7StageModel, local: str, weight: torch.Tensor,
                   quant: str, group_size: int) -> None:
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
