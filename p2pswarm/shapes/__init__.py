"""A model's shape and the bytes it takes: torch-free values both sides share.

The planner counts a stage's bytes and the runtime allocates them; both import this
package (``model_config``: a decoder's sizes and switches read from a Hugging Face
``config.json``; ``footprint``: the byte accounting), so a plan claims exactly what a
loaded stage holds. It sits below both in the layers and imports no torch.
"""

from __future__ import annotations

from p2pswarm.shapes.footprint import (
    DTYPE_BYTES,
    KV_DTYPE_BYTES,
    QUANT_SCHEMES,
    check_quant,
    kv_cache_bytes,
    layer_bytes,
    linear_weight_bytes,
)
from p2pswarm.shapes.model_config import (
    RECURRENT_MODEL_TYPES,
    SUPPORTED_MODEL_TYPES,
    UNBOUNDED_CONTEXT_TOKENS,
    ModelConfig,
    RopeScaling,
)

__all__ = [
    "DTYPE_BYTES",
    "KV_DTYPE_BYTES",
    "QUANT_SCHEMES",
    "RECURRENT_MODEL_TYPES",
    "SUPPORTED_MODEL_TYPES",
    "UNBOUNDED_CONTEXT_TOKENS",
    "ModelConfig",
    "RopeScaling",
    "check_quant",
    "kv_cache_bytes",
    "layer_bytes",
    "linear_weight_bytes",
]
