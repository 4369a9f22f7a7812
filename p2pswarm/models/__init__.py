"""Llama-family decoders in torch, cut into stages, from Hugging Face checkpoints or built in.

Names are imported on first use, so importing one torch-free part pulls no torch in. A
model's shape and byte accounting live below this package, in ``p2pswarm.shapes``, which
the planner imports too; the names of the most used are exported here as well.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "BUILTIN_MODELS": "builtin", "BuiltinModel": "builtin",
    "write_builtin_checkpoint": "builtin",
    "Checkpoint": "checkpoint", "TensorEntry": "checkpoint", "read_tensor_bytes": "checkpoint",
    "save_checkpoint": "checkpoint", "stage_tensor_names": "checkpoint",
    "stage_tensors": "checkpoint", "tensor_sha256": "checkpoint",
    "ModelConfig": "p2pswarm.shapes.model_config", "RopeScaling": "p2pswarm.shapes.model_config",
    "linear_weight_bytes": "p2pswarm.shapes.footprint",
    "layer_bytes": "p2pswarm.shapes.footprint", "kv_cache_bytes": "p2pswarm.shapes.footprint",
    "StageModel": "llama", "hf_tensor_map": "llama",
    "DTYPES": "loader", "TensorSource": "loader", "load_stage_model": "loader",
    "open_model": "loader",
    "DequantWorkspace": "quant", "Int4Linear": "quant", "Int8Linear": "quant",
    "quantize_linear": "quant",
    "ByteTokenizer": "tokenizer", "HFTokenizer": "tokenizer", "Tokenizer": "tokenizer",
    "load_tokenizer": "tokenizer",
}

__all__ = [
    "BUILTIN_MODELS",
    "DTYPES",
    "BuiltinModel",
    "ByteTokenizer",
    "Checkpoint",
    "DequantWorkspace",
    "HFTokenizer",
    "Int4Linear",
    "Int8Linear",
    "ModelConfig",
    "RopeScaling",
    "StageModel",
    "TensorEntry",
    "TensorSource",
    "Tokenizer",
    "hf_tensor_map",
    "kv_cache_bytes",
    "layer_bytes",
    "linear_weight_bytes",
    "load_stage_model",
    "load_tokenizer",
    "open_model",
    "quantize_linear",
    "read_tensor_bytes",
    "save_checkpoint",
    "stage_tensor_names",
    "stage_tensors",
    "tensor_sha256",
    "write_builtin_checkpoint",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    where = module if module.startswith("p2pswarm.") else f"{__name__}.{module}"
    return getattr(importlib.import_module(where), name)


if TYPE_CHECKING:
    from p2pswarm.models.builtin import BUILTIN_MODELS, BuiltinModel, write_builtin_checkpoint
    from p2pswarm.models.checkpoint import (
        Checkpoint,
        TensorEntry,
        read_tensor_bytes,
        save_checkpoint,
        stage_tensor_names,
        stage_tensors,
        tensor_sha256,
    )
    from p2pswarm.models.llama import StageModel, hf_tensor_map
    from p2pswarm.models.loader import DTYPES, TensorSource, load_stage_model, open_model
    from p2pswarm.models.quant import DequantWorkspace, Int4Linear, Int8Linear, quantize_linear
    from p2pswarm.models.tokenizer import (
        ByteTokenizer,
        HFTokenizer,
        Tokenizer,
        load_tokenizer,
    )
    from p2pswarm.shapes.footprint import kv_cache_bytes, layer_bytes, linear_weight_bytes
    from p2pswarm.shapes.model_config import ModelConfig, RopeScaling
