"""Bytes a stage's weights and KV cache take: the accounting plans are made of.

Pure arithmetic on sizes (no torch): the planner and the runtime import this same
accounting, so the runtime allocates exactly what a plan counts.
``p2pswarm.runtime.memory.stage_memory`` adds it up per stage and a test checks it against
what a loaded stage really holds.

Weights (per linear of ``in`` inputs and ``out`` outputs; biases stay in the compute dtype):

    scheme  weight bytes                        scale bytes
    none    out * in * dtype_bytes              -
    int8    up(in, 512) * up(out, 8)            12 * out          scale, zero point, column sum
    int4    ceil(out / g) * in * g / 2          4 * ceil(out / g) * in   float16 scale, offset

int8 is what fbgemm's prepacked weight allocates on AVX2 (``models/quant.py``; inputs
round up to 512, outputs to 8, measured with malloc's counters in tests/test_models.py);
int4 is fbgemm's 4-bit embedding-bag rows of g outputs (0.625 B/weight at g = 32, 0.5625
at 64), outputs padded up to a multiple of g.
A quantized stage also holds one dequant workspace: its largest decoder-layer linear in
the compute dtype, ``max(out * in) * dtype_bytes``.

KV cache, per position per layer: ``2 * kv_heads * head_dim * kv_dtype_bytes``; int8 adds
a float32 scale per kv head: ``2 * kv_heads * (head_dim + 4)``. A sliding-window layer
keeps ``min(window, context)`` positions, a full layer the whole context.

Norms: two of ``hidden`` a layer (four with Gemma's sandwich norms), plus two of
``head_dim`` with q/k norms. RoPE tables: ``head_dim / 2`` float32 numbers, twice with a
local base (Gemma 3).

RWKV-7 keeps no KV cache but a state per session and layer, whatever the context:
two shift vectors of ``hidden`` numbers (compute dtype) and ``heads * head_size**2``
float32 WKV numbers (``recurrent_state_bytes``).
"""

from __future__ import annotations

from p2pswarm.errors import ConfigError
from p2pswarm.shapes.model_config import ModelConfig

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
KV_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1}
INT8_SCALE_BYTES = 4  # float32 per kv head and position (cache)
INT8_ROW_BYTES = 12  # packed int8 weights: float32 scale, int32 zero point and column sum
INT8_PACK_IN, INT8_PACK_OUT = 512, 8  # fbgemm's AVX2 blocks: inputs and outputs round up
INT4_SCALE_BYTES = 4  # float16 scale and float16 offset per group
QUANT_SCHEMES = ("none", "int8", "int4")
INT4_GROUP_SIZES = (32, 64)


def check_quant(scheme: str, group_size: int) -> None:
    if scheme not in QUANT_SCHEMES:
        raise ConfigError(f"unknown quantization {scheme!r}; use one of {QUANT_SCHEMES}")
    if scheme == "int4" and group_size not in INT4_GROUP_SIZES:
        raise ConfigError(f"int4 group size must be one of {INT4_GROUP_SIZES}, got {group_size}")


def linear_weight_bytes(in_features: int, out_features: int, *, scheme: str,
                        dtype_bytes: int, group_size: int = 32) -> int:
    """Bytes one linear's weight takes under ``scheme``, scales included, bias not."""
    check_quant(scheme, group_size)
    if scheme == "none":
        return out_features * in_features * dtype_bytes
    if scheme == "int8":  # fbgemm's packed layout (AVX2 blocks), see the table above
        padded = _round_up(in_features, INT8_PACK_IN) * _round_up(out_features, INT8_PACK_OUT)
        return padded + INT8_ROW_BYTES * out_features
    groups = -(-out_features // group_size)
    return groups * in_features * (group_size // 2 + INT4_SCALE_BYTES)


def _round_up(n: int, block: int) -> int:
    return -(-n // block) * block


def layer_linear_shapes(config: ModelConfig) -> list[tuple[int, int]]:
    """(in, out) of the seven linears of a decoder layer: q, k, v, o, gate, up, down."""
    h, q, kv, i = config.hidden_size, config.q_dim, config.kv_dim, config.intermediate_size
    return [(h, q), (h, kv), (h, kv), (q, h), (h, i), (h, i), (i, h)]


def layer_bytes(config: ModelConfig, *, dtype: str, quant: str = "none",
                group_size: int = 32) -> int:
    """One decoder layer: seven linears (maybe quantized), their biases, two norms."""
    if config.model_type == "rwkv7":
        return rwkv7_layer_bytes(config, dtype=dtype, quant=quant, group_size=group_size)
    db = DTYPE_BYTES[dtype]
    total = sum(linear_weight_bytes(n_in, n_out, scheme=quant, dtype_bytes=db,
                                    group_size=group_size)
                for n_in, n_out in layer_linear_shapes(config))
    h, q, kv, i = config.hidden_size, config.q_dim, config.kv_dim, config.intermediate_size
    if config.qkv_bias:
        total += (q + 2 * kv) * db
    if config.o_bias:
        total += h * db
    if config.mlp_bias:
        total += (2 * i + h) * db
    if config.qk_norm:
        total += 2 * config.head_dim * db
    return total + config.norms_per_layer() * h * db


def rope_table_bytes(config: ModelConfig) -> int:
    """A stage's RoPE inverse frequencies (float32), a second set for a local base."""
    return config.head_dim // 2 * 4 * (2 if config.local_rope_theta else 1)


def stage_kv_cache_bytes(config: ModelConfig, start_layer: int, end_layer: int, *,
                         max_context_tokens: int, max_sessions: int, kv_dtype: str) -> int:
    """KV bytes of layers [start_layer, end_layer): a sliding layer holds its window only."""
    return sum(kv_cache_bytes(num_layers=1, num_kv_heads=config.num_kv_heads,
                              head_dim=config.head_dim,
                              max_context_tokens=config.kv_positions(i, max_context_tokens),
                              max_sessions=max_sessions, kv_dtype=kv_dtype)
               for i in range(start_layer, end_layer))


def rwkv7_layer_bytes(config: ModelConfig, *, dtype: str, quant: str = "none",
                      group_size: int = 32, first: bool = False) -> int:
    """One RWKV-7 layer: six square-ish linears (maybe quantized); the low-rank maps,
    vectors and norms in the compute dtype. Layer 0 (``first``) has ``ln0`` and no value
    map of its own."""
    db = DTYPE_BYTES[dtype]
    C, inner = config.hidden_size, config.intermediate_size
    shapes = [(C, C)] * 4 + [(C, inner), (inner, C)]
    total = sum(linear_weight_bytes(n_in, n_out, scheme=quant, dtype_bytes=db,
                                    group_size=group_size) for n_in, n_out in shapes)
    ranks = [config.decay_low_rank_dim, config.a_low_rank_dim, config.gate_low_rank_dim]
    lora_biases = 2 * C
    if not first:
        ranks.append(config.v_low_rank_dim)
        lora_biases += C
    # norms ln1, ln2, ln_x (weight and bias each), 8 mixing vectors, r_k, the ffn's x_k
    vectors = 6 * C + 8 * C + C + C + (2 * C if first else 0)
    return total + (sum(2 * C * r for r in ranks) + lora_biases + vectors) * db


def recurrent_state_bytes(config: ModelConfig, *, num_layers: int, max_sessions: int,
                          dtype: str) -> int:
    """Bytes an RWKV-7 stage's session states hold (``runtime.recurrent_state``)."""
    per_layer = (2 * config.hidden_size * DTYPE_BYTES[dtype]
                 + 4 * config.num_heads * config.head_dim ** 2)
    return num_layers * max_sessions * per_layer


def dequant_workspace_bytes(config: ModelConfig, *, dtype: str) -> int:
    if config.model_type == "rwkv7":
        C, inner = config.hidden_size, config.intermediate_size
        return max(C * C, C * inner) * DTYPE_BYTES[dtype]
    return max(n_in * n_out for n_in, n_out in layer_linear_shapes(config)) * DTYPE_BYTES[dtype]


def kv_cache_bytes(*, num_layers: int, num_kv_heads: int, head_dim: int,
                   max_context_tokens: int, max_sessions: int, kv_dtype: str) -> int:
    """Bytes a KV cache of this size holds: keys and values, and int8 scales."""
    per_vector = head_dim * KV_DTYPE_BYTES[kv_dtype]
    if kv_dtype == "int8":
        per_vector += INT8_SCALE_BYTES
    return 2 * num_layers * max_sessions * num_kv_heads * max_context_tokens * per_vector
