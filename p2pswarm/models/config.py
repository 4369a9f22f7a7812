"""The shape of a decoder, read from a Hugging Face ``config.json``: now
``p2pswarm.shapes.model_config``, below both the planner and the models; these names
stay here for the code that still imports them from the models."""

from __future__ import annotations

from p2pswarm.shapes.model_config import (
    ACTIVATIONS,
    ARCHITECTURES,
    GEMMA_TYPES,
    MAX_WHOLE,
    RECURRENT_MODEL_TYPES,
    SUPPORTED_MODEL_TYPES,
    UNBOUNDED_CONTEXT_TOKENS,
    ModelConfig,
    RopeScaling,
)

__all__ = ["ACTIVATIONS", "ARCHITECTURES", "GEMMA_TYPES", "MAX_WHOLE", "RECURRENT_MODEL_TYPES",
           "SUPPORTED_MODEL_TYPES", "UNBOUNDED_CONTEXT_TOKENS", "ModelConfig", "RopeScaling"]
