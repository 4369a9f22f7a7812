"""Bytes a stage's weights and KV cache take: now ``p2pswarm.shapes.footprint``, below both
the planner and the models; these names stay here for the code that still imports them
from the models."""

from __future__ import annotations

from p2pswarm.shapes.footprint import (
    DTYPE_BYTES,
    INT4_GROUP_SIZES,
    INT4_SCALE_BYTES,
    INT8_SCALE_BYTES,
    KV_DTYPE_BYTES,
    QUANT_SCHEMES,
    check_quant,
    dequant_workspace_bytes,
    kv_cache_bytes,
    layer_bytes,
    layer_linear_shapes,
    linear_weight_bytes,
    recurrent_state_bytes,
    rope_table_bytes,
    rwkv7_layer_bytes,
    stage_kv_cache_bytes,
)

__all__ = ["DTYPE_BYTES", "INT4_GROUP_SIZES", "INT4_SCALE_BYTES", "INT8_SCALE_BYTES",
           "KV_DTYPE_BYTES", "QUANT_SCHEMES", "check_quant", "dequant_workspace_bytes",
           "kv_cache_bytes", "layer_bytes", "layer_linear_shapes", "linear_weight_bytes",
           "recurrent_state_bytes", "rope_table_bytes", "rwkv7_layer_bytes",
           "stage_kv_cache_bytes"]
