"""The shape of a Llama-family decoder, read from a Hugging Face ``config.json`` dict.

One ``ModelConfig`` covers Llama 1/2/3, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3 (text) and
Phi-3: they share the decoder's skeleton and differ by a few named switches:

    family     switches beyond Llama's
    mistral    sliding_window on every layer (when the config sets one)
    qwen2      biases on q, k, v
    qwen3      qk_norm (an RMSNorm over each head of q and k, before RoPE)
    gemma2     unit_offset_norms ((1 + w) RMSNorm), sandwich_norms (a norm after attention
               and after the MLP too), embed_scale (embeddings times sqrt(hidden)),
               gelu_tanh MLP, attn_scale from query_pre_attn_scalar, soft-capped attention
               and final logits, sliding_window on every other layer
    gemma3     gemma2's, less the soft-capping, plus qk_norm, a sliding window on five
               layers of six, and local_rope_theta (unscaled RoPE) on the sliding layers
    phi3       fused_qkv and fused_gate_up: how the checkpoint stores the linears (they
               are split into q, k, v and gate, up on loading), all layers sliding if set
RWKV-7 (``rwkv7``) shares it too: heads, head size and layer sizes mean the same, and
four low-rank widths are its own (see ``p2pswarm.models.rwkv7``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from p2pswarm.errors import ConfigError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3",
                         "rwkv7")
GEMMA_TYPES = ("gemma2", "gemma3_text")
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "mistral": "MistralForCausalLM", "gemma2": "Gemma2ForCausalLM",
                 "gemma3_text": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM"}
RECURRENT_MODEL_TYPES = ("rwkv7",)  # a fixed-size state per session, no KV cache
MAX_WHOLE = 2**31 - 1  # beyond any real size or token id: the planner multiplies these
# A recurrent model has no context limit; this stands for it where a number is needed.
UNBOUNDED_CONTEXT_TOKENS = 2**30


@dataclass(frozen=True, slots=True)
class SizeBound:
    """The most a model config may say for one size, and why that is enough."""

    most: int
    why: str


# What a config may ask before anything is sized from it: a config comes from a fellow's
# ``PlanAsk`` as well as from a local directory, and the planner's work and memory grow
# with these (its search is layers x cards x stages; the per-layer tables are as long as
# the model is deep). Each bound is several times the largest published model's.
SIZE_BOUNDS: dict[str, SizeBound] = {
    "num_layers": SizeBound(512, "the deepest published decoders have 126 layers (Llama "
                            "3.1 405B), 118 (PaLM 540B), 105 (Megatron-Turing NLG 530B) and 61 "
                            "(DeepSeek-V3, MoE)"),
    "hidden_size": SizeBound(131_072, "the widest published decoders have 20,480 (Megatron-"
                             "Turing NLG), 18,432 (PaLM 540B) and 16,384 (Llama 3.1 405B)"),
    "intermediate_size": SizeBound(524_288, "the largest published MLPs are 73,728 wide "
                                   "(PaLM 540B) and 53,248 (Llama 3.1 405B)"),
    "vocab_size": SizeBound(2_097_152, "the largest published vocabularies have 262,144 "
                            "tokens (Gemma 3) and 256,000 (Gemma 2, PaLM)"),
    "num_heads": SizeBound(1024, "the most attention heads a published decoder has is 128 "
                           "(Llama 3.1 405B, DeepSeek-V3)"),
    "num_kv_heads": SizeBound(1024, "no published decoder has more key/value heads than 128"),
    "head_dim": SizeBound(4096, "published heads are 64 to 256 wide (Gemma: 256)"),
    "max_context_tokens": SizeBound(UNBOUNDED_CONTEXT_TOKENS, "the longest published "
                                    "context is 10,485,760 tokens (Llama 4 Scout)"),
    "sliding_window": SizeBound(UNBOUNDED_CONTEXT_TOKENS, "a window is at most the context"),
    "low_rank_dim": SizeBound(131_072, "RWKV-7's low-rank maps are at most 256 wide"),
    "eos_token_ids": SizeBound(64, "published configs list at most a handful of stop tokens"),
}


def check_size(name: str, value: int) -> int:
    """``value`` if within ``SIZE_BOUNDS[name]``; ConfigError naming the bound and why."""
    bound = SIZE_BOUNDS[name]
    if value > bound.most:
        raise ConfigError(f"model config: {name} {value:,} is over the {bound.most:,} "
                          f"p2pswarm plans for: {bound.why}")
    return value


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """How RoPE frequencies are stretched for longer contexts.

    ``linear`` divides every frequency by ``factor``. ``llama3`` divides only the low
    frequencies (wavelength above ``original_max_context_tokens / low_freq_factor``),
    keeps the high ones and blends smoothly in between.
    """

    kind: str  # "linear" | "llama3"
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_context_tokens: int = 8192

    def __post_init__(self) -> None:
        if self.kind not in ("linear", "llama3"):
            raise ConfigError(f"unsupported rope scaling {self.kind!r}; use linear or llama3")
        if not math.isfinite(self.factor) or self.factor <= 0:
            raise ConfigError(f"rope scaling factor must be positive, got {self.factor}")
        if self.kind == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ConfigError("llama3 rope scaling needs high_freq_factor > low_freq_factor")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Sizes and switches of one decoder; everything the stage runtime needs."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_context_tokens: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    qkv_bias: bool = False  # Qwen2 has biases on q, k, v only
    o_bias: bool = False  # Llama's attention_bias puts one on o_proj as well
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default=())
    pad_token_id: int | None = None
    model_type: str = "llama"
    hidden_act: str = "silu"  # "silu" | "gelu_tanh"
    qk_norm: bool = False
    unit_offset_norms: bool = False  # Gemma: a norm scales by (1 + weight)
    sandwich_norms: bool = False  # Gemma: four norms a layer, around attention and MLP
    embed_scale: bool = False  # Gemma: embeddings times sqrt(hidden_size)
    attn_scale: float | None = None  # softmax scale; None: 1 / sqrt(head_dim)
    attn_softcap: float | None = None  # tanh soft-cap on attention scores
    final_softcap: float | None = None  # tanh soft-cap on the logits
    sliding_window: int | None = None  # keys a sliding layer's query sees, itself included
    sliding_layers: tuple[bool, ...] = ()  # per layer: whether it slides; () for none
    local_rope_theta: float | None = None  # Gemma 3: RoPE base of sliding layers (unscaled)
    fused_qkv: bool = False  # Phi-3 checkpoints: one qkv_proj
    fused_gate_up: bool = False  # Phi-3 checkpoints: one gate_up_proj
    # RWKV-7 only: widths of the low-rank decay, in-context rate, value and gate maps
    decay_low_rank_dim: int = 0
    a_low_rank_dim: int = 0
    v_low_rank_dim: int = 0
    gate_low_rank_dim: int = 0

    def __post_init__(self) -> None:
        positive = ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                    "num_heads", "num_kv_heads", "head_dim", "max_context_tokens")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"model config: {name} must be positive")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_context_tokens"):
            check_size(name, getattr(self, name))
        if self.sliding_window is not None:
            check_size("sliding_window", self.sliding_window)
        check_size("eos_token_ids", len(self.eos_token_ids))
        for name in ("decay_low_rank_dim", "a_low_rank_dim", "v_low_rank_dim",
                     "gate_low_rank_dim"):
            check_size("low_rank_dim", getattr(self, name))
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"model config: {self.num_heads} heads do not split into "
                f"{self.num_kv_heads} key/value groups"
            )
        if self.head_dim % 2:
            raise ConfigError("model config: head_dim must be even for RoPE")
        if self.hidden_act not in ("silu", "gelu_tanh"):
            raise ConfigError(f"activation {self.hidden_act!r} is not supported")
        if self.sliding_layers and len(self.sliding_layers) != self.num_layers:
            raise ConfigError(f"model config: {len(self.sliding_layers)} layer types for "
                              f"{self.num_layers} layers")
        if any(self.sliding_layers) and (self.sliding_window is None
                                         or self.sliding_window <= 0):
            raise ConfigError("model config: sliding layers need a positive sliding_window")

    def layer_window(self, layer: int) -> int | None:
        """Keys a query of ``layer`` (a global index) may see, itself included; None: all."""
        if self.sliding_layers and self.sliding_layers[layer]:
            return self.sliding_window
        return None

    def kv_positions(self, layer: int, context_tokens: int) -> int:
        """Positions the KV cache keeps for ``layer``: the context, or just the window."""
        window = self.layer_window(layer)
        return context_tokens if window is None else min(window, context_tokens)

    def norms_per_layer(self) -> int:
        return 4 if self.sandwich_norms else 2

    @property
    def recurrent(self) -> bool:
        """True for a model that keeps a fixed-size state per session instead of a cache."""
        return self.model_type in RECURRENT_MODEL_TYPES

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Read a Hugging Face ``config.json`` dict (transformers 4.x or 5.x layout)."""
        model_type = hf.get("model_type", "llama")
        if model_type == "gemma3":  # the multimodal checkpoint nests its text model
            raise ConfigError("Gemma 3 with vision (model_type gemma3) is not supported; its "
                              "text-only models (model_type gemma3_text, e.g. gemma-3-1b) are")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"model type {model_type!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if model_type == "rwkv7":
            return _rwkv7_from_hf(cls, hf)
        gemma = model_type in GEMMA_TYPES
        act = hf.get("hidden_activation") or hf.get("hidden_act") or "silu"
        if act not in ACTIVATIONS or (not gemma and act != "silu"):
            raise ConfigError(f"activation {str(act)[:40]!r} is not supported for "
                              f"{model_type}; need {'gelu_pytorch_tanh' if gemma else 'silu'}")
        if hf.get("use_sliding_window"):  # Qwen's windows on the top layers only
            raise ConfigError("sliding-window attention is not supported for "
                              f"{model_type} (use_sliding_window)")
        if float(_number(hf, "partial_rotary_factor", 1.0)) != 1.0:
            raise ConfigError("partial rotary embeddings are not supported")
        try:
            hidden = check_size("hidden_size", _whole(hf, "hidden_size"))
            heads = check_size("num_heads", _whole(hf, "num_attention_heads"))
            kv_heads = _whole(hf, "num_key_value_heads", heads)
            head_dim = _whole(hf, "head_dim", hidden // heads if heads > 0 else 0)
            eos = hf.get("eos_token_id")
            if isinstance(eos, list):
                check_size("eos_token_ids", len(eos))
            eos_ids = tuple(_whole({"eos_token_id": i}, "eos_token_id") for i in eos) \
                if isinstance(eos, list) else (() if eos is None else (_whole(hf, "eos_token_id"),))
            layers = check_size("num_layers", _whole(hf, "num_hidden_layers"))
            theta, scaling, local_theta = _rope_from_hf(hf, model_type)
            attention_bias = bool(hf.get("attention_bias", False))
            window, sliding = _sliding_from_hf(hf, model_type, layers)
            pre_attn = _number(hf, "query_pre_attn_scalar", 256.0) if gemma else None
            return cls(
                vocab_size=_whole(hf, "vocab_size"),
                hidden_size=hidden,
                intermediate_size=_whole(hf, "intermediate_size"),
                num_layers=layers,
                num_heads=heads,
                num_kv_heads=kv_heads,
                head_dim=head_dim,
                max_context_tokens=_whole(hf, "max_position_embeddings", 2048),
                rms_norm_eps=_number(hf, "rms_norm_eps", 1e-6),
                rope_theta=theta,
                rope_scaling=scaling,
                qkv_bias=model_type == "qwen2" or attention_bias,
                o_bias=model_type != "qwen2" and attention_bias,
                mlp_bias=bool(hf.get("mlp_bias", False)),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", gemma)),
                bos_token_id=_optional_int(hf.get("bos_token_id")),
                eos_token_ids=eos_ids,
                pad_token_id=_optional_int(hf.get("pad_token_id")),
                model_type=model_type,
                hidden_act=ACTIVATIONS[act],
                qk_norm=model_type in ("qwen3", "gemma3_text"),
                unit_offset_norms=gemma,
                sandwich_norms=gemma,
                embed_scale=gemma,
                attn_scale=None if pre_attn is None else pre_attn ** -0.5,
                attn_softcap=_softcap(hf, "attn_logit_softcapping") if gemma else None,
                final_softcap=_softcap(hf, "final_logit_softcapping") if gemma else None,
                sliding_window=window,
                sliding_layers=sliding,
                local_rope_theta=local_theta,
                fused_qkv=model_type == "phi3",
                fused_gate_up=model_type == "phi3",
            )
        except KeyError as exc:
            raise ConfigError(f"model config lacks {exc.args[0]!r}") from exc
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"model config has a bad value: {exc}") from exc

    def to_hf(self) -> dict[str, Any]:
        """The ``config.json`` dict transformers would read back into this model."""
        if self.model_type == "rwkv7":
            return _rwkv7_to_hf(self)
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            rope = {"rope_type": self.rope_scaling.kind, "rope_theta": self.rope_theta,
                    "factor": self.rope_scaling.factor}
            if self.rope_scaling.kind == "llama3":
                rope.update(
                    low_freq_factor=self.rope_scaling.low_freq_factor,
                    high_freq_factor=self.rope_scaling.high_freq_factor,
                    original_max_position_embeddings=self.rope_scaling.original_max_context_tokens,
                )
        eos: int | list[int] | None = (
            None if not self.eos_token_ids
            else self.eos_token_ids[0] if len(self.eos_token_ids) == 1
            else list(self.eos_token_ids)
        )
        hf: dict[str, Any] = {
            "model_type": self.model_type,
            "architectures": [ARCHITECTURES.get(self.model_type, "LlamaForCausalLM")],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu" if self.hidden_act == "silu" else "gelu_pytorch_tanh",
            "max_position_embeddings": self.max_context_tokens,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": rope,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
            "pad_token_id": self.pad_token_id,
        }
        if self.model_type != "qwen2":
            hf["attention_bias"] = self.o_bias
            hf["mlp_bias"] = self.mlp_bias
        if self.sliding_window is not None:
            hf["sliding_window"] = self.sliding_window
            hf["layer_types"] = ["sliding_attention" if s else "full_attention"
                                 for s in self.sliding_layers]
        if self.model_type in GEMMA_TYPES:
            hf["hidden_activation"] = hf["hidden_act"]
            hf["query_pre_attn_scalar"] = (
                self.head_dim if self.attn_scale is None else round(self.attn_scale ** -2, 6))
            hf["attn_logit_softcapping"] = self.attn_softcap
            hf["final_logit_softcapping"] = self.final_softcap
        if self.model_type == "gemma3_text":
            hf["rope_parameters"] = {
                "full_attention": rope,
                "sliding_attention": {"rope_type": "default",
                                      "rope_theta": self.local_rope_theta or 10000.0}}
        return hf


def _rwkv7_from_hf(cls: type[ModelConfig], hf: dict[str, Any]) -> ModelConfig:
    """An RWKV-7 ``config.json`` in the flash-linear-attention layout (``RWKV7Config``)."""
    try:
        hidden = check_size("hidden_size", _whole(hf, "hidden_size"))
        head_size = _whole(hf, "head_dim", 64)
        if head_size <= 0 or hidden % head_size:
            raise ConfigError(f"model config: hidden_size {hidden} does not split into heads "
                              f"of {head_size}")
        heads = _whole(hf, "num_heads", hidden // head_size)
        if heads * head_size != hidden:
            raise ConfigError("model config: num_heads * head_dim must equal hidden_size")
        if hf.get("hidden_act", "sqrelu") != "sqrelu":
            raise ConfigError(f"activation {hf['hidden_act']!r} is not supported; need sqrelu")
        eos = _optional_int(hf.get("eos_token_id"))
        config = cls(
            vocab_size=_whole(hf, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_whole(hf, "intermediate_size", 4 * hidden),
            num_layers=_whole(hf, "num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=heads,
            head_dim=head_size,
            max_context_tokens=UNBOUNDED_CONTEXT_TOKENS,
            rms_norm_eps=_number(hf, "norm_eps", 1e-5),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            bos_token_id=_optional_int(hf.get("bos_token_id")),
            eos_token_ids=() if eos is None else (eos,),
            pad_token_id=_optional_int(hf.get("pad_token_id")),
            model_type="rwkv7",
            decay_low_rank_dim=_whole(hf, "decay_low_rank_dim"),
            a_low_rank_dim=_whole(hf, "a_low_rank_dim"),
            v_low_rank_dim=_whole(hf, "v_low_rank_dim"),
            gate_low_rank_dim=_whole(hf, "gate_low_rank_dim"),
        )
    except KeyError as exc:
        raise ConfigError(f"model config lacks {exc.args[0]!r}") from exc
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"model config has a bad value: {exc}") from exc
    for name in ("decay_low_rank_dim", "a_low_rank_dim", "v_low_rank_dim", "gate_low_rank_dim"):
        if getattr(config, name) <= 0:
            raise ConfigError(f"model config: {name} must be positive")
    return config


def _rwkv7_to_hf(config: ModelConfig) -> dict[str, Any]:
    return {
        "model_type": "rwkv7", "architectures": ["RWKV7ForCausalLM"],
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers, "head_dim": config.head_dim,
        "num_heads": config.num_heads, "hidden_act": "sqrelu", "norm_eps": config.rms_norm_eps,
        "decay_low_rank_dim": config.decay_low_rank_dim,
        "a_low_rank_dim": config.a_low_rank_dim, "v_low_rank_dim": config.v_low_rank_dim,
        "gate_low_rank_dim": config.gate_low_rank_dim,
        "tie_word_embeddings": config.tie_word_embeddings,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_ids[0] if config.eos_token_ids else None,
        "pad_token_id": config.pad_token_id,
    }


def _whole(hf: dict[str, Any], key: str, default: int | None = None) -> int:
    """``hf[key]`` as a whole number; a fraction, a string, a bool or a size beyond
    ``MAX_WHOLE`` is refused, never truncated. Missing or null: ``default``."""
    value = hf.get(key)
    if value is None:
        if default is None:
            raise KeyError(key)
        return default
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)  # 32.0 is 32; 1.5 is not a layer count
    if isinstance(value, bool) or not isinstance(value, int) or abs(value) > MAX_WHOLE:
        raise ConfigError(f"model config: {key} must be a whole number up to {MAX_WHOLE:,}, "
                          f"got {_shown(value)}")
    return value


def _number(raw: dict[str, Any], key: str, default: float | None, where: str = "") -> float:
    """``raw[key]`` as a finite number (not a string, not infinite or NaN); missing or
    null: ``default`` (KeyError without one)."""
    value = raw.get(key)
    if value is None:
        if default is None:
            raise KeyError(key)
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or abs(value) > 1e300:
        raise ConfigError(f"model config: {where}{key} must be a finite number, "
                          f"got {_shown(value)}")
    return float(value)


def _shown(value: Any) -> str:
    """``value`` for an error line: short, whatever it is."""
    text = repr(value) if not isinstance(value, int) or abs(value) < 10**30 \
        else f"a {len(str(abs(value)))}-digit number"
    return text if len(text) <= 60 else text[:57] + "..."


def _optional_int(value: Any) -> int | None:
    if isinstance(value, list):  # some configs list several; the first is the one used
        value = value[0] if value else None
    return None if value is None else _whole({"token id": value}, "token id")


def _softcap(hf: dict[str, Any], key: str) -> float | None:
    value = hf.get(key)
    if value is None:
        return None
    cap = _number(hf, key, None)
    if cap <= 0:
        raise ConfigError(f"model config: {key} must be positive, got {cap}")
    return cap


def _sliding_from_hf(hf: dict[str, Any], model_type: str,
                     layers: int) -> tuple[int | None, tuple[bool, ...]]:
    """(window, per-layer sliding flags) as each family's transformers config derives them."""
    window = hf.get("sliding_window")
    if window is None or model_type not in ("mistral", "phi3", *GEMMA_TYPES):
        return None, ()
    size = _whole(hf, "sliding_window")
    if size <= 0:
        raise ConfigError(f"model config: sliding_window must be positive, got {size}")
    types = hf.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != layers or not all(
                t in ("sliding_attention", "full_attention") for t in types):
            raise ConfigError(f"model config: layer_types must list {layers} of "
                              "sliding_attention or full_attention")
        return size, tuple(t == "sliding_attention" for t in types)
    if model_type in ("mistral", "phi3"):
        return size, (True,) * layers
    # Gemma 2 alternates (sliding first); Gemma 3 has one global layer in six
    every = 2 if model_type == "gemma2" else _whole(hf, "sliding_window_pattern", 6)
    if every <= 0:
        raise ConfigError("model config: sliding_window_pattern must be positive")
    return size, tuple(bool((i + 1) % every) for i in range(layers))


def _rope_from_hf(hf: dict[str, Any],
                  model_type: str = "llama") -> tuple[float, RopeScaling | None, float | None]:
    """(theta, scaling, local theta): Gemma 3 gives its sliding layers their own base."""
    params = hf.get("rope_parameters")
    if model_type == "gemma3_text":
        # transformers 5: rope_parameters per layer type; 4.x: rope_theta, rope_scaling
        # for the global layers and rope_local_base_freq for the sliding ones
        if isinstance(params, dict) and "full_attention" in params:
            local = params.get("sliding_attention") or {}
            if not isinstance(local, dict) or local.get("rope_type", "default") != "default":
                raise ConfigError("model config: sliding layers' RoPE must be plain")
            local_theta = _number(local, "rope_theta", 10000.0, "local rope ")
            theta, scaling = _rope_params(hf, params["full_attention"], 1_000_000.0)
            return theta, scaling, local_theta
        local_theta = _number(hf, "rope_local_base_freq", 10000.0)
        theta, scaling = _rope_params(hf, hf.get("rope_scaling") or {}, 1_000_000.0)
        return theta, scaling, local_theta
    theta, scaling = _rope_params(hf, params or hf.get("rope_scaling") or {}, 10000.0)
    return theta, scaling, None


def _rope_params(hf: dict[str, Any], params: Any,
                 default_theta: float) -> tuple[float, RopeScaling | None]:
    # transformers 5 writes "rope_parameters" (theta inside); 4.x wrote "rope_theta" and
    # "rope_scaling" with "rope_type" or, older still, "type".
    if not isinstance(params, dict):
        raise ConfigError("model config: rope_scaling must be an object")
    theta = _number(params, "rope_theta", _number(hf, "rope_theta", default_theta), "rope ")
    if theta <= 0:
        raise ConfigError(f"model config: rope_theta must be positive, got {theta}")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind == "linear":
        return theta, RopeScaling(kind="linear", factor=_number(params, "factor", None, "rope "))
    if kind == "llama3":
        return theta, RopeScaling(
            kind="llama3",
            factor=_number(params, "factor", None, "rope "),
            low_freq_factor=_number(params, "low_freq_factor", None, "rope "),
            high_freq_factor=_number(params, "high_freq_factor", None, "rope "),
            original_max_context_tokens=_whole(params, "original_max_position_embeddings"),
        )
    raise ConfigError(f"rope scaling {str(kind)[:30]!r} is not supported; use linear or llama3")
