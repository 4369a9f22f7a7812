"""Model profiles: what a model costs per layer, in bytes and FLOPs, for each dtype.

A profile is read from a Hugging Face ``config.json`` of the Llama family (Llama 2/3,
Mistral, Qwen2, TinyLlama, SmolLM) or from a built-in definition. ``BUILTIN_MODELS``
are the HF-style configs of the models p2pswarm builds itself (the runtime's
``p2pswarm.models.builtin`` holds the same dicts; a test keeps the two equal);
``REFERENCE_CONFIGS`` holds the shapes of well-known models for planning on paper (no
weights ship with them).

Every layer of these models has the same shape, so a profile describes one layer plus
the pieces around the stack: input embeddings, final norm and head (tied or not).

Bytes come from the runtime's own accounting (``p2pswarm.shapes.footprint``, pure
arithmetic), so what a plan claims for a stage is what the loaded stage allocates:
weights ``f32``/``f16``/``bf16`` as such; ``int8`` one byte a weight plus an f32 scale
per output row; ``int4`` half a byte plus an f16 scale per group of 32 inputs, a
dequantisation workspace (the largest layer matrix in f16) on each quantised stage;
quantised models keep embeddings, head, norms and biases in f16. KV cache per token
per layer is ``2 * n_kv_heads * head_dim * bytes(kv dtype)``, plus an f32 scale per
head for ``int8``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from p2pswarm.errors import ConfigError
from p2pswarm.shapes import footprint
from p2pswarm.shapes.model_config import ModelConfig

WEIGHT_DTYPES = ("f32", "f16", "bf16", "int8", "int4")
# ``auto`` (serving's default): each stage keeps the serving dtype where its card holds
# it, else takes the next of ``AUTO_LADDER`` that fits, stage by stage
AUTO = "auto"
WEIGHT_CHOICES = (AUTO, *WEIGHT_DTYPES)
SERVING_DTYPE = "f16"
AUTO_LADDER = (SERVING_DTYPE, "int8", "int4")
QUANTIZED = ("int8", "int4")
KV_DTYPES = ("f32", "f16", "bf16", "int8")
DTYPE_ALIASES = {
    "float32": "f32", "fp32": "f32", "float16": "f16", "fp16": "f16", "half": "f16",
    "bfloat16": "bf16", "q4": "int4", "4bit": "int4", "4-bit": "int4", "q8": "int8",
}
DTYPE_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "int8": 1}
# weights dtype -> the runtime's (compute dtype, quantisation scheme)
RUNTIME_WEIGHTS = {"f32": ("float32", "none"), "f16": ("float16", "none"),
                   "bf16": ("bfloat16", "none"), "int8": ("float16", "int8"),
                   "int4": ("float16", "int4")}
RUNTIME_KV = {"f32": "float32", "f16": "float16", "bf16": "bfloat16", "int8": "int8"}
INT4_GROUP = 32  # inputs per f16 scale in int4 (the runtime's default)
SUPPORTED_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3")

LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# RWKV-7's linear maps that LoRA may target (the time-mix's four, the channel-mix's two)
RWKV7_LORA_MODULES = ("r_proj", "k_proj", "v_proj", "o_proj", "key", "value")

_BYTE_TOKENS = {"vocab_size": 259, "bos_token_id": 256, "eos_token_id": 257,
                "pad_token_id": 258}  # bytes 0..255, then bos, eos, pad

# Models p2pswarm builds and trains from scratch (byte-level vocabulary).
BUILTIN_MODELS: dict[str, dict[str, Any]] = {
    "tiny-llama": {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 256,
        "intermediate_size": 768, "num_hidden_layers": 8, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 64, "hidden_act": "silu",
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": True, **_BYTE_TOKENS,
    },
    "small-llama": {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 512,
        "intermediate_size": 1536, "num_hidden_layers": 12, "num_attention_heads": 8,
        "num_key_value_heads": 4, "head_dim": 64, "hidden_act": "silu",
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": False, **_BYTE_TOKENS,
    },
    "tiny-rwkv7": {
        "model_type": "rwkv7", "architectures": ["RWKV7ForCausalLM"], "hidden_size": 256,
        "intermediate_size": 1024, "num_hidden_layers": 6, "head_dim": 64,
        "hidden_act": "sqrelu", "norm_eps": 1e-5, "decay_low_rank_dim": 32,
        "a_low_rank_dim": 32, "v_low_rank_dim": 16, "gate_low_rank_dim": 64,
        "tie_word_embeddings": False, **_BYTE_TOKENS,
    },
}


def _hf(model_type: str, vocab: int, hidden: int, intermediate: int, layers: int, heads: int,
        kv_heads: int, max_context: int, tied: bool, **extra: Any) -> dict[str, Any]:
    config = {"model_type": model_type, "vocab_size": vocab, "hidden_size": hidden,
              "intermediate_size": intermediate, "num_hidden_layers": layers,
              "num_attention_heads": heads, "num_key_value_heads": kv_heads,
              "max_position_embeddings": max_context, "tie_word_embeddings": tied,
              "hidden_act": "silu", "torch_dtype": "bfloat16"}
    config.update(extra)
    return config


# Shapes of well-known models (from their published config.json), to plan on paper.
REFERENCE_CONFIGS: dict[str, dict[str, Any]] = {
    "llama-2-7b": _hf("llama", 32000, 4096, 11008, 32, 32, 32, 4096, False),
    "llama-2-13b": _hf("llama", 32000, 5120, 13824, 40, 40, 40, 4096, False),
    "llama-3-8b": _hf("llama", 128256, 4096, 14336, 32, 32, 8, 8192, False),
    "llama-3-70b": _hf("llama", 128256, 8192, 28672, 80, 64, 8, 8192, False),
    "llama-3.1-8b": _hf("llama", 128256, 4096, 14336, 32, 32, 8, 131072, False),
    "llama-3.1-70b": _hf("llama", 128256, 8192, 28672, 80, 64, 8, 131072, False),
    "mistral-7b": _hf("mistral", 32768, 4096, 14336, 32, 32, 8, 32768, False,
                      sliding_window=None),  # v0.3: no sliding window
    "qwen2-0.5b": _hf("qwen2", 151936, 896, 4864, 24, 14, 2, 131072, True),
    "qwen2-7b": _hf("qwen2", 152064, 3584, 18944, 28, 28, 4, 32768, False),
    "tinyllama-1.1b": _hf("llama", 32000, 2048, 5632, 22, 32, 4, 2048, False),
    "smollm-135m": _hf("llama", 49152, 576, 1536, 30, 9, 3, 2048, True),
    "mistral-7b-v0.1": _hf("mistral", 32000, 4096, 14336, 32, 32, 8, 32768, False,
                           sliding_window=4096),
    "qwen3-0.6b": _hf("qwen3", 151936, 1024, 3072, 28, 16, 8, 40960, True, head_dim=128),
    "qwen3-8b": _hf("qwen3", 151936, 4096, 12288, 36, 32, 8, 40960, False, head_dim=128),
    "gemma-2-2b": _hf("gemma2", 256000, 2304, 9216, 26, 8, 4, 8192, True, head_dim=256,
                      hidden_act="gelu_pytorch_tanh", sliding_window=4096,
                      query_pre_attn_scalar=256, attn_logit_softcapping=50.0,
                      final_logit_softcapping=30.0),
    "gemma-3-1b": _hf("gemma3_text", 262144, 1152, 6912, 26, 4, 1, 32768, True, head_dim=256,
                      hidden_act="gelu_pytorch_tanh", sliding_window=512,
                      sliding_window_pattern=6, query_pre_attn_scalar=256,
                      rope_theta=1_000_000.0, rope_local_base_freq=10_000.0),
    "phi-3-mini-4k": _hf("phi3", 32064, 3072, 8192, 32, 32, 32, 4096, False,
                         sliding_window=2047),
}


def known_names() -> tuple[str, ...]:
    return tuple(BUILTIN_MODELS) + tuple(REFERENCE_CONFIGS)


def normalize_dtype(name: str, allowed: tuple[str, ...], option: str) -> str:
    key = DTYPE_ALIASES.get(str(name).lower(), str(name).lower())
    if key not in allowed:
        raise ConfigError(f"{option} {name!r} is not known: use one of {', '.join(allowed)}")
    return key


def compute_bytes(weights_dtype: str) -> int:
    """Bytes of an activation element: f32 for f32 weights, else 16-bit."""
    return 4 if weights_dtype == "f32" else 2


@dataclass(frozen=True, slots=True)
class ModelProfile:
    name: str
    model_type: str
    n_layers: int
    hidden: int
    intermediate: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab: int
    tied: bool  # the head reuses the input embeddings
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    max_context: int
    trained_cut: tuple[int, ...] | None = None  # stage boundaries the model was trained with
    # family switches that change bytes (see ModelConfig); left out of to_dict at defaults
    sandwich_norms: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    sliding_layers: tuple[bool, ...] = ()
    local_rope_theta: float | None = None
    # RWKV-7 only: low-rank widths of the decay, in-context rate, value and gate maps
    decay_rank: int = 0
    a_rank: int = 0
    v_rank: int = 0
    gate_rank: int = 0

    @property
    def recurrent(self) -> bool:
        """A fixed-size state per sequence instead of a KV cache that grows (RWKV-7)."""
        return self.model_type == "rwkv7"

    @property
    def hop_width(self) -> int:
        """Numbers per token sent between stages: RWKV-7 adds layer 0's value."""
        return 2 * self.hidden if self.recurrent else self.hidden

    def model_config(self) -> ModelConfig:
        """The runtime's view of the same shape (for its byte accounting)."""
        return ModelConfig(
            vocab_size=self.vocab, hidden_size=self.hidden, intermediate_size=self.intermediate,
            num_layers=self.n_layers, num_heads=self.n_heads, num_kv_heads=self.n_kv_heads,
            head_dim=self.head_dim, max_context_tokens=self.max_context, qkv_bias=self.qkv_bias,
            o_bias=self.o_bias, mlp_bias=self.mlp_bias, tie_word_embeddings=self.tied,
            model_type=self.model_type, sandwich_norms=self.sandwich_norms,
            qk_norm=self.qk_norm, sliding_window=self.sliding_window,
            sliding_layers=self.sliding_layers, local_rope_theta=self.local_rope_theta,
            decay_low_rank_dim=self.decay_rank, a_low_rank_dim=self.a_rank,
            v_low_rank_dim=self.v_rank, gate_low_rank_dim=self.gate_rank)

    def kv_tokens_per_layer(self, tokens: int) -> int:
        """Positions the most demanding layer caches at ``tokens`` of context: the window
        when every layer slides, else the context (exact per stage: ``kv_tokens_of``)."""
        if self.sliding_window is not None and self.sliding_layers and all(self.sliding_layers):
            return min(self.sliding_window, tokens)
        return tokens

    def kv_tokens_of(self, start: int, n: int, tokens: int) -> int:
        """Positions layers [start, start + n) cache together at ``tokens`` of context."""
        if not self.sliding_layers or self.sliding_window is None:
            return n * tokens
        return sum(min(self.sliding_window, tokens) if self.sliding_layers[i] else tokens
                   for i in range(start, start + n))

    # --- shapes ---------------------------------------------------------------------

    def layer_matrices(self) -> tuple[tuple[str, int, int], ...]:
        """(name, rows, cols) of each weight matrix in one layer (torch Linear layout)."""
        if self.recurrent:
            h, i = self.hidden, self.intermediate
            lora = tuple((f"{name}.{part}", *shape)
                         for name, rank in (("w_lora", self.decay_rank), ("a_lora", self.a_rank),
                                            ("v_lora", self.v_rank), ("g_lora", self.gate_rank))
                         for part, shape in (("down", (rank, h)), ("up", (h, rank))))
            return (("r_proj", h, h), ("k_proj", h, h), ("v_proj", h, h), ("o_proj", h, h),
                    ("key", i, h), ("value", h, i), *lora)
        q_dim, kv_dim = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        return (("q_proj", q_dim, self.hidden), ("k_proj", kv_dim, self.hidden),
                ("v_proj", kv_dim, self.hidden), ("o_proj", self.hidden, q_dim),
                ("gate_proj", self.intermediate, self.hidden),
                ("up_proj", self.intermediate, self.hidden),
                ("down_proj", self.hidden, self.intermediate))

    def layer_vector_params(self) -> int:
        """Norm weights and biases of one layer (kept in the compute dtype)."""
        if self.recurrent:  # 3 norms with biases, 8 mixing vectors, r_k, x_k, 3 lora biases
            return 19 * self.hidden
        q_dim, kv_dim = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        count = (4 if self.sandwich_norms else 2) * self.hidden  # RMSNorms around the halves
        if self.qk_norm:
            count += 2 * self.head_dim
        if self.qkv_bias:
            count += q_dim + 2 * kv_dim
        if self.o_bias:
            count += self.hidden
        if self.mlp_bias:
            count += 2 * self.intermediate + self.hidden
        return count

    def layer_params(self) -> int:
        return sum(r * c for _, r, c in self.layer_matrices()) + self.layer_vector_params()

    def embed_params(self) -> int:
        return self.vocab * self.hidden

    def head_params(self) -> int:
        """Parameters of the head itself: none when tied to the embeddings."""
        return 0 if self.tied else self.vocab * self.hidden

    def total_params(self) -> int:
        return (self.n_layers * self.layer_params() + self.embed_params() + self.head_params()
                + self.hidden)  # + final norm

    # --- bytes (the runtime's accounting) ---------------------------------------------

    def layer_weight_bytes(self, dtype: str) -> int:
        compute, quant = RUNTIME_WEIGHTS[dtype]
        return footprint.layer_bytes(self.model_config(), dtype=compute, quant=quant,
                                     group_size=INT4_GROUP)

    def first_layer_weight_delta(self, dtype: str) -> int:
        """How much layer 0's weights differ from any other layer's: an RWKV-7's layer 0
        has ``ln0`` and no value map of its own (a Llama's layers are all alike)."""
        if not self.recurrent:
            return 0
        compute, quant = RUNTIME_WEIGHTS[dtype]
        config = self.model_config()
        return (footprint.rwkv7_layer_bytes(config, dtype=compute, quant=quant,
                                            group_size=INT4_GROUP, first=True)
                - footprint.rwkv7_layer_bytes(config, dtype=compute, quant=quant,
                                              group_size=INT4_GROUP))

    def embed_bytes(self, dtype: str) -> int:
        return self.vocab * self.hidden * compute_bytes(dtype)

    def head_bytes(self, dtype: str, shares_embeddings: bool) -> int:
        """Final norm and head; a tied head on another card than stage 0 needs a copy."""
        norm = (2 if self.recurrent else 1) * self.hidden * compute_bytes(dtype)
        if self.tied and shares_embeddings:
            return norm
        return norm + self.vocab * self.hidden * compute_bytes(dtype)

    def head_read_bytes(self, dtype: str) -> int:
        """Bytes the head's matmul reads per step, tied or not."""
        return self.vocab * self.hidden * compute_bytes(dtype)

    def stage_buffer_bytes(self, dtype: str) -> int:
        """Every stage's own buffers: RoPE frequencies (f32), the dequant workspace."""
        compute, quant = RUNTIME_WEIGHTS[dtype]
        rope = 0 if self.recurrent else footprint.rope_table_bytes(self.model_config())
        if quant == "none":
            return rope
        return rope + footprint.dequant_workspace_bytes(self.model_config(), dtype=compute)

    def kv_bytes_per_token_layer(self, kv_dtype: str) -> int:
        """``2 * n_kv_heads * head_dim * bytes(kv dtype)`` (+ int8 scales): K and V.
        None for a recurrent model: its state does not grow with the context."""
        if self.recurrent:
            return 0
        return footprint.kv_cache_bytes(num_layers=1, num_kv_heads=self.n_kv_heads,
                                        head_dim=self.head_dim, max_context_tokens=1,
                                        max_sessions=1, kv_dtype=RUNTIME_KV[kv_dtype])

    def state_bytes_per_sequence_layer(self, weights_dtype: str) -> int:
        """A recurrent model's state of one sequence in one layer, whatever its length:
        two shift vectors in the compute dtype and the float32 WKV matrices."""
        if not self.recurrent:
            return 0
        return footprint.recurrent_state_bytes(
            self.model_config(), num_layers=1, max_sessions=1,
            dtype=RUNTIME_WEIGHTS[weights_dtype][0])

    def train_activation_bytes_per_token_layer(self, act_bytes: int) -> int:
        """What backward needs of one layer per token, without checkpointing.

        Saved tensors of a Llama block with a fused attention kernel: the residual
        stream and norm outputs, q/k/v and the attention output, the MLP's gate, up,
        SiLU and product, and per-head softmax statistics (f32).
        """
        if self.recurrent:  # mixes, r k v w a g kk, WKV out (f32), norms; relu and square
            return (20 * self.hidden + 2 * self.intermediate) * act_bytes + 4 * self.hidden
        q_dim, kv_dim = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        elements = 8 * self.hidden + 2 * q_dim + 2 * kv_dim + 4 * self.intermediate
        return elements * act_bytes + self.n_heads * 4

    # --- FLOPs ----------------------------------------------------------------------

    def flops_per_token_layer(self, context: int) -> int:
        """Forward FLOPs of one token through one layer attending to ``context`` tokens."""
        matmul = 2 * sum(r * c for _, r, c in self.layer_matrices())
        if self.recurrent:  # the WKV update and readout: a few head_size**2 per head
            return matmul + 8 * self.n_heads * self.head_dim ** 2
        attention = 4 * self.n_heads * self.head_dim * context
        return matmul + attention

    def head_flops_per_token(self) -> int:
        return 2 * self.hidden * self.vocab

    # --- LoRA -----------------------------------------------------------------------

    def lora_params_layer(self, rank: int, targets: tuple[str, ...]) -> int:
        return sum(rank * (r + c) for name, r, c in self.layer_matrices() if name in targets)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["trained_cut"] = list(self.trained_cut) if self.trained_cut else None
        for key, default in FAMILY_DEFAULTS.items():  # a Llama's plan_id stays as it was
            if data[key] == default:
                del data[key]
        data["sliding_layers"] = list(self.sliding_layers) if self.sliding_layers else None
        if data["sliding_layers"] is None:
            del data["sliding_layers"]
        return data


FAMILY_DEFAULTS: dict[str, Any] = {"sandwich_norms": False, "qk_norm": False,
                                   "sliding_window": None, "local_rope_theta": None,
                                   "decay_rank": 0, "a_rank": 0, "v_rank": 0, "gate_rank": 0}


def profile_from_config(config: Mapping[str, Any], name: str) -> ModelProfile:
    """A profile from a Hugging Face ``config.json`` dict of the Llama family, checked
    exactly as the runtime checks it (a model it cannot run is refused here too)."""
    if not isinstance(config, Mapping):
        raise ConfigError(f"{name}: config.json must hold a JSON object")
    try:
        shape = ModelConfig.from_hf(dict(config))
    except ConfigError as exc:
        raise ConfigError(f"{name}: {exc}") from None
    layers = shape.num_layers
    cut = config.get("p2pswarm_stage_cut")
    trained_cut = None
    if cut is not None:
        if (not isinstance(cut, list) or not all(isinstance(c, int) for c in cut)
                or list(cut) != sorted(set(cut)) or not cut or cut[0] <= 0 or cut[-1] >= layers):
            raise ConfigError(f"{name}: p2pswarm_stage_cut must list increasing layer "
                              f"boundaries strictly between 0 and {layers}, e.g. [16]")
        trained_cut = tuple(cut)
    return ModelProfile(
        name=name, model_type=shape.model_type, n_layers=layers, hidden=shape.hidden_size,
        intermediate=shape.intermediate_size, n_heads=shape.num_heads,
        n_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim, vocab=shape.vocab_size,
        tied=shape.tie_word_embeddings, qkv_bias=shape.qkv_bias, o_bias=shape.o_bias,
        mlp_bias=shape.mlp_bias, max_context=shape.max_context_tokens, trained_cut=trained_cut,
        sandwich_norms=shape.sandwich_norms, qk_norm=shape.qk_norm,
        sliding_window=shape.sliding_window if any(shape.sliding_layers) else None,
        sliding_layers=shape.sliding_layers if any(shape.sliding_layers) else (),
        local_rope_theta=shape.local_rope_theta,
        decay_rank=shape.decay_low_rank_dim, a_rank=shape.a_low_rank_dim,
        v_rank=shape.v_low_rank_dim, gate_rank=shape.gate_low_rank_dim,
    )


def builtin_config(name: str) -> dict[str, Any] | None:
    """The HF-style config of a built-in or reference model, or None."""
    config = BUILTIN_MODELS.get(name) or REFERENCE_CONFIGS.get(name)
    return dict(config) if config is not None else None


__all__ = [
    "BUILTIN_MODELS",
    "DTYPE_BYTES",
    "INT4_GROUP",
    "KV_DTYPES",
    "LORA_MODULES",
    "RWKV7_LORA_MODULES",
    "REFERENCE_CONFIGS",
    "AUTO",
    "AUTO_LADDER",
    "QUANTIZED",
    "RUNTIME_KV",
    "RUNTIME_WEIGHTS",
    "SERVING_DTYPE",
    "WEIGHT_CHOICES",
    "WEIGHT_DTYPES",
    "ModelProfile",
    "builtin_config",
    "compute_bytes",
    "known_names",
    "normalize_dtype",
    "profile_from_config",
]
