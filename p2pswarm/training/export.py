"""A trained model out as a plain Hugging Face directory, recording the cut it trained with.

``config.json`` gains ``p2pswarm_stage_cut`` (the layer boundaries between stages), which
the planner reads to serve on the same cut by default. Weights are float32 safetensors
named as Hugging Face names them; LoRA adapters are merged into their base weights (a
quantized base is dequantized first); a tied head is written once, as the embedding.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from p2pswarm.errors import ConfigError
from p2pswarm.models.checkpoint import save_checkpoint
from p2pswarm.models.families import AnyStageModel as StageModel
from p2pswarm.models.families import tensor_map as hf_tensor_map
from p2pswarm.models.llama import is_fused
from p2pswarm.training.lora import FrozenQuantizedLinear, LoRALinear

STAGE_CUT_KEY = "p2pswarm_stage_cut"


def stage_hf_tensors(model: StageModel) -> list[tuple[str, torch.Tensor]]:
    """(Hugging Face name, float32 tensor) for every weight of one stage."""
    out: list[tuple[str, torch.Tensor]] = []
    for hf_name, locals_ in hf_tensor_map(model.config, model.start_layer,
                                          model.end_layer).items():
        if is_fused(hf_name):  # Phi-3's qkv_proj / gate_up_proj: ours stacked by rows
            tensor = torch.cat([_local_tensor(model, local) for local in locals_])
        else:  # one tensor, or a tied head that repeats the embedding
            tensor = _local_tensor(model, locals_[0])
        out.append((hf_name, tensor.float().cpu().contiguous()))
    return out


def _local_tensor(model: StageModel, local: str) -> torch.Tensor:
    """Our parameter ``local`` as a plain tensor: LoRA merged, quantization undone."""
    module_name, _, attr = local.rpartition(".")
    module: Any = model.get_submodule(module_name)
    if isinstance(module, LoRALinear) and attr == "weight":
        merged: torch.Tensor = module.merged_weight()
        return merged
    if isinstance(module, (LoRALinear, FrozenQuantizedLinear)):
        module = module.base
    if attr == "weight" and hasattr(module, "dequantize"):
        plain: torch.Tensor = module.dequantize().clone()
        return plain
    tensor: torch.Tensor = getattr(module, attr).detach()
    return tensor


def export_hf(stages: Sequence[StageModel], hf_config: Mapping[str, Any],
              out_dir: str | Path, *, max_shard_bytes: int | None = None) -> Path:
    """Write ``config.json`` (with the stage cut) and ``model.safetensors`` of the
    chained ``stages``."""
    if not stages or not stages[0].is_first or not stages[-1].is_last:
        raise ConfigError("export needs every stage of one replica, from layer 0 to the last")
    seen: dict[str, torch.Tensor] = {}
    for model in stages:
        for name, tensor in stage_hf_tensors(model):
            seen.setdefault(name, tensor)  # a tied head repeats the embedding's name
    config = dict(hf_config)
    cut = [m.start_layer for m in stages[1:]]
    if cut:
        config[STAGE_CUT_KEY] = cut
    else:
        config.pop(STAGE_CUT_KEY, None)  # one stage: no cut to keep (the planner wants >= 1)
    config["torch_dtype"] = "float32"
    return save_checkpoint(config, list(seen.items()), out_dir, max_shard_bytes=max_shard_bytes)
