"""Which module builds a model type: the Llama-family decoder or RWKV-7.

Everything that makes stages or names a checkpoint's tensors asks here, so one switch
on ``ModelConfig.model_type`` stands for all of them.
"""

from __future__ import annotations

from p2pswarm.models import llama, rwkv7
from p2pswarm.shapes.model_config import ModelConfig

AnyStageModel = llama.StageModel | rwkv7.StageModel


def stage_model(config: ModelConfig, start_layer: int, end_layer: int) -> AnyStageModel:
    if config.model_type == "rwkv7":
        return rwkv7.StageModel(config, start_layer, end_layer)
    return llama.StageModel(config, start_layer, end_layer)


def tensor_map(config: ModelConfig, start_layer: int,
               end_layer: int) -> dict[str, tuple[str, ...]]:
    """Checkpoint tensor name -> the stage parameter names it fills."""
    if config.model_type == "rwkv7":
        return rwkv7.hf_tensor_map(config, start_layer, end_layer)
    return llama.hf_tensor_map(config, start_layer, end_layer)


def tensor_shape(config: ModelConfig, name: str) -> tuple[int, ...]:
    if config.model_type == "rwkv7":
        return rwkv7.hf_tensor_shape(config, name)
    return llama.hf_tensor_shape(config, name)


def block_linears(config: ModelConfig) -> tuple[str, ...]:
    """The names, inside a layer, of the linears that are quantized or adapted."""
    return rwkv7.BLOCK_LINEARS if config.model_type == "rwkv7" else llama.BLOCK_LINEARS


def hidden_width(config: ModelConfig) -> int:
    """Numbers per token that pass from one stage to the next: RWKV-7 sends its hidden
    state and layer 0's value (v_first) side by side."""
    return 2 * config.hidden_size if config.model_type == "rwkv7" else config.hidden_size
