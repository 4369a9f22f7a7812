"""What a stage is asked to be: the plan's order for one card, as a value."""

from __future__ import annotations

from dataclasses import dataclass

from p2pswarm.errors import ConfigError
from p2pswarm.shapes.footprint import DTYPE_BYTES, KV_DTYPE_BYTES, check_quant


@dataclass(frozen=True, slots=True)
class StageSpec:
    """Layers [start_layer, end_layer) on ``device``, in ``dtype``, with a KV cache of
    ``max_sessions`` sessions of ``max_context_tokens`` each, stored as ``kv_dtype``."""

    start_layer: int
    end_layer: int
    dtype: str = "float32"  # compute dtype: float32 | float16 | bfloat16
    quant: str = "none"  # decoder-layer weights: none | int8 | int4
    quant_group_size: int = 32  # int4 only: 32 or 64
    kv_dtype: str = "float32"  # float32 | float16 | bfloat16 | int8
    max_context_tokens: int = 2048
    max_sessions: int = 1
    prefill_chunk_tokens: int = 256
    device: str = "cpu"

    def __post_init__(self) -> None:
        if not 0 <= self.start_layer <= self.end_layer:
            raise ConfigError(f"bad layer range [{self.start_layer}, {self.end_layer})")
        if self.dtype not in DTYPE_BYTES:
            raise ConfigError(
                f"unknown dtype {self.dtype!r}; use one of {', '.join(DTYPE_BYTES)}")
        if self.kv_dtype not in KV_DTYPE_BYTES:
            raise ConfigError(
                f"unknown KV dtype {self.kv_dtype!r}; use one of {', '.join(KV_DTYPE_BYTES)}")
        check_quant(self.quant, self.quant_group_size)
        for name in ("max_context_tokens", "max_sessions", "prefill_chunk_tokens"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"stage spec: {name} must be positive")
