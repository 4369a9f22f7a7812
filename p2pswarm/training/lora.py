"""LoRA: low-rank adapters on a frozen base (Hu et al. 2021).

A target linear ``W`` becomes ``y = W x + (alpha / rank) * B (A x)`` with ``A`` (rank,
in) drawn like PEFT draws it (Kaiming-uniform) and ``B`` (out, rank) at zero, so training
starts from the base model exactly. Only ``A`` and ``B`` learn and travel; the base may
be float or the models' int8/int4 quantized linears. A quantized base is dequantized
into the stage's shared workspace in the forward pass and again in the backward pass
(instead of keeping a float copy alive for autograd), so it costs no more memory than
serving does.

Adapters are saved on their own in PEFT's layout (``adapter_config.json`` and
``adapter_model.safetensors`` with ``base_model.model.model.layers.{i}...`` names), so
they can be loaded on top of the base for serving.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from p2pswarm.errors import ConfigError
from p2pswarm.models.families import AnyStageModel as StageModel
from p2pswarm.models.lora_targets import family_targets, proj_parents
from p2pswarm.models.quant import Int4Linear, Int8Linear
from p2pswarm.training.job import LoraConfig

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


class _QuantizedLinearFn(torch.autograd.Function):
    """A quantized linear's own kernel forward; the backward pass (the input's gradient
    only: the base is frozen) dequantizes the weight into the stage's workspace."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, module: Any) -> torch.Tensor:
        ctx.module = module
        with torch.no_grad():
            out: torch.Tensor = module(x)
            return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, None]:
        with torch.no_grad():
            weight: torch.Tensor = ctx.module.dequantize()
            return grad_out @ weight, None


def _quantized_linear(x: torch.Tensor, module: nn.Module) -> torch.Tensor:
    out: torch.Tensor = _QuantizedLinearFn.apply(x, module)  # type: ignore[no-untyped-call]
    return out


class FrozenQuantizedLinear(nn.Module):
    """A quantized linear that gradients can flow through (to the layers before it)."""

    def __init__(self, base: nn.Module) -> None:
        super().__init__()
        self.base: Any = base

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _quantized_linear(x, self.base)


class LoRALinear(nn.Module):
    def __init__(self, base: Any, rank: int, alpha: float,
                 generator: torch.Generator) -> None:
        super().__init__()
        self.base: Any = base  # nn.Linear, Int8Linear or Int4Linear
        self.in_features = int(base.in_features)
        self.out_features = int(base.out_features)
        self.rank = rank
        self.scale = alpha / rank
        self.quantized = isinstance(base, (Int8Linear, Int4Linear))
        like = _base_tensor(base)
        a = torch.empty(rank, self.in_features)
        # nn.Linear's default init (kaiming uniform, a = sqrt(5)), as PEFT uses for A; drawn
        # on the CPU so every card draws the same numbers
        bound = 1 / math.sqrt(self.in_features)
        a.uniform_(-bound, bound, generator=generator)
        self.lora_A = nn.Parameter(a.to(device=like.device, dtype=like.dtype))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, rank, dtype=like.dtype,
                                               device=like.device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base_out = _quantized_linear(x, self.base) if self.quantized else self.base(x)
        out: torch.Tensor = base_out + F.linear(F.linear(x, self.lora_A), self.lora_B) * self.scale
        return out

    def merged_weight(self) -> torch.Tensor:
        """The float weight ``W + scale * B A`` (dequantized first if the base is)."""
        with torch.no_grad():
            weight: torch.Tensor = (self.base.dequantize().clone() if self.quantized
                                    else self.base.weight.detach().clone())
            return weight + (self.lora_B @ self.lora_A * self.scale).to(weight.dtype)

    def extra_repr(self) -> str:
        return f"rank={self.rank}, scale={self.scale:g}"


def _base_tensor(base: Any) -> torch.Tensor:
    """A tensor in the dtype and on the device the adapter should take."""
    if isinstance(base, (Int8Linear, Int4Linear)):
        return base.workspace.buffer
    weight: torch.Tensor = base.weight
    return weight


def _adapter_generator(seed: int, global_name: str) -> torch.Generator:
    digest = hashlib.sha256(f"lora/{seed}/{global_name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def apply_lora(model: StageModel, config: LoraConfig, seed: int) -> list[str]:
    """Freeze ``model`` and put adapters on its target linears; returns the adapter
    parameter names. Adapters are drawn per global layer, so any stage cut gets the same."""
    for p in model.parameters():
        p.requires_grad_(False)
    parents = proj_parents(model.config.model_type)
    targets = family_targets(model.config.model_type, config.targets)
    for i, block in enumerate(model.layers):
        layer = model.start_layer + i
        for proj, parent_name in parents.items():
            parent = block.get_submodule(parent_name)
            base = getattr(parent, proj)
            if proj not in config.targets and isinstance(base, (Int8Linear, Int4Linear)):
                setattr(parent, proj, FrozenQuantizedLinear(base))
        for target in targets:
            if target not in parents:
                raise ConfigError(f"LoRA target {target!r} is not a linear map of a "
                                  f"{model.config.model_type} layer; use {', '.join(parents)}")
            parent = block.get_submodule(parents[target])
            base = getattr(parent, target)
            if isinstance(base, LoRALinear):
                raise ConfigError(f"layer {layer} {target} already has an adapter")
            generator = _adapter_generator(seed, f"layers.{layer}.{parents[target]}.{target}")
            setattr(parent, target, LoRALinear(base, config.rank, config.alpha, generator))
    return [name for name, p in model.named_parameters() if p.requires_grad]


def lora_modules(model: nn.Module) -> list[tuple[str, LoRALinear]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, LoRALinear)]


def adapter_tensors(model: StageModel) -> dict[str, torch.Tensor]:
    """PEFT names -> adapter weights of this stage (global layer numbers)."""
    out: dict[str, torch.Tensor] = {}
    for name, module in lora_modules(model):
        # "layers.{i}.self_attn.q_proj" -> global layer start + i
        _, local, rest = name.split(".", 2)
        prefix = f"base_model.model.model.layers.{model.start_layer + int(local)}.{rest}"
        out[f"{prefix}.lora_A.weight"] = module.lora_A.detach().float().cpu().contiguous()
        out[f"{prefix}.lora_B.weight"] = module.lora_B.detach().float().cpu().contiguous()
    return out


def save_adapters(stages: Iterable[StageModel], config: LoraConfig, out_dir: str | Path, *,
                  base_model: str) -> Path:
    """Every stage's adapters into one PEFT-style directory (adapters only, no base)."""
    from safetensors.torch import save_file

    from p2pswarm.training.checkpoint import atomic_write_bytes

    tensors: dict[str, torch.Tensor] = {}
    for model in stages:
        tensors.update(adapter_tensors(model))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".{ADAPTER_WEIGHTS}.tmp"
    save_file(tensors, str(tmp))
    atomic_write_bytes(out / ADAPTER_WEIGHTS, tmp.read_bytes())
    tmp.unlink()
    adapter_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": config.rank,
        "lora_alpha": config.alpha, "target_modules": list(config.targets),
        "lora_dropout": 0.0, "bias": "none", "base_model_name_or_path": base_model,
        "p2pswarm_base_dtype": config.base_dtype,
    }
    atomic_write_bytes(out / ADAPTER_CONFIG,
                       json.dumps(adapter_config, indent=2, sort_keys=True).encode())
    return out


def read_adapter_config(adapter_dir: str | Path) -> LoraConfig:
    path = Path(adapter_dir) / ADAPTER_CONFIG
    try:
        raw = json.loads(path.read_text())
        return LoraConfig(rank=int(raw["r"]), alpha=float(raw["lora_alpha"]),
                          targets=tuple(raw["target_modules"]),
                          base_dtype=str(raw.get("p2pswarm_base_dtype", "f32")))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from exc


def load_adapters(model: StageModel, adapter_dir: str | Path, *, seed: int = 0) -> StageModel:
    """Put the saved adapters of this stage's layers on ``model`` (for serving or resuming)."""
    from safetensors.torch import load_file

    config = read_adapter_config(adapter_dir)
    if not lora_modules(model):
        apply_lora(model, config, seed)
    saved = load_file(str(Path(adapter_dir) / ADAPTER_WEIGHTS))
    wanted = adapter_tensors(model)
    missing = [n for n in wanted if n not in saved]
    if missing:
        raise ConfigError(f"{adapter_dir} lacks adapters for this stage: {missing[0]} ...")
    for name, module in lora_modules(model):
        _, local, rest = name.split(".", 2)
        prefix = f"base_model.model.model.layers.{model.start_layer + int(local)}.{rest}"
        with torch.no_grad():
            module.lora_A.copy_(saved[f"{prefix}.lora_A.weight"])
            module.lora_B.copy_(saved[f"{prefix}.lora_B.weight"])
    return model


def base_tensors(model: nn.Module) -> Sequence[tuple[str, torch.Tensor]]:
    """Every tensor of the frozen base (parameters and buffers, adapters excluded)."""
    named = [*model.named_parameters(), *model.named_buffers()]
    return [(n, t) for n, t in named if ".lora_" not in n and not n.startswith("rotary.")]
