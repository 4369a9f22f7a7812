"""What a stage holds in memory, computed from its spec alone (pure: no torch).

This is the claim a plan makes for one stage; ``Stage.allocated_bytes()`` reports what
the loaded stage really holds, and the two are equal by construction (tested). Segments
match the plan's: ``weights`` (decoder layers), ``embeddings_head_buffers`` (embedding
table on the first stage; final norm and head on the last, unless the head is tied to an
embedding the same stage holds; RoPE frequencies; the dequant workspace of a quantized
stage) and ``kv_cache``. Activations are transient and not counted here.
"""

from __future__ import annotations

from dataclasses import dataclass

from p2pswarm.runtime.spec import StageSpec
from p2pswarm.shapes.footprint import (
    DTYPE_BYTES,
    dequant_workspace_bytes,
    layer_bytes,
    recurrent_state_bytes,
    rope_table_bytes,
    rwkv7_layer_bytes,
    stage_kv_cache_bytes,
)
from p2pswarm.shapes.model_config import ModelConfig


@dataclass(frozen=True, slots=True)
class StageMemory:
    weights_bytes: int
    embeddings_head_buffers_bytes: int
    kv_cache_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.embeddings_head_buffers_bytes + self.kv_cache_bytes


def stage_memory(config: ModelConfig, spec: StageSpec) -> StageMemory:
    if config.model_type == "rwkv7":
        return _rwkv7_stage_memory(config, spec)
    db = DTYPE_BYTES[spec.dtype]
    num_layers = spec.end_layer - spec.start_layer
    is_first = spec.start_layer == 0
    is_last = spec.end_layer == config.num_layers
    table = config.vocab_size * config.hidden_size * db
    ends = 0
    if is_first:
        ends += table
    if is_last:
        ends += config.hidden_size * db  # final norm
        if not (config.tie_word_embeddings and is_first):
            ends += table  # head (a tied head on a later stage is its own copy)
    ends += rope_table_bytes(config)  # RoPE inverse frequencies, float32
    if spec.quant != "none" and num_layers:
        ends += dequant_workspace_bytes(config, dtype=spec.dtype)
    return StageMemory(
        weights_bytes=num_layers * layer_bytes(config, dtype=spec.dtype, quant=spec.quant,
                                               group_size=spec.quant_group_size),
        embeddings_head_buffers_bytes=ends,
        kv_cache_bytes=stage_kv_cache_bytes(
            config, spec.start_layer, spec.end_layer, max_context_tokens=spec.max_context_tokens,
            max_sessions=spec.max_sessions, kv_dtype=spec.kv_dtype),
    )


def _rwkv7_stage_memory(config: ModelConfig, spec: StageSpec) -> StageMemory:
    """RWKV-7: layer 0 differs (ln0, no value map), layer norms carry biases, no RoPE, and
    a fixed-size state per session stands in the KV cache segment."""
    db = DTYPE_BYTES[spec.dtype]
    is_first = spec.start_layer == 0
    is_last = spec.end_layer == config.num_layers
    num_layers = spec.end_layer - spec.start_layer
    table = config.vocab_size * config.hidden_size * db
    ends = table if is_first else 0
    if is_last:
        ends += 2 * config.hidden_size * db  # final layer norm
        if not (config.tie_word_embeddings and is_first):
            ends += table
    if spec.quant != "none" and num_layers:
        ends += dequant_workspace_bytes(config, dtype=spec.dtype)
    weights = sum(rwkv7_layer_bytes(config, dtype=spec.dtype, quant=spec.quant,
                                    group_size=spec.quant_group_size, first=i == 0)
                  for i in range(spec.start_layer, spec.end_layer))
    return StageMemory(
        weights_bytes=weights, embeddings_head_buffers_bytes=ends,
        kv_cache_bytes=recurrent_state_bytes(config, num_layers=num_layers,
                                             max_sessions=spec.max_sessions, dtype=spec.dtype),
    )
