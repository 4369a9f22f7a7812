"""The shape of a Llama-family decoder, read from a Hugging Face ``config.json`` dict.

One ``ModelConfig`` covers Llama 1/2/3, Mistral without a sliding window and Qwen2: they
differ only in RoPE scaling, attention biases, head tying and sizes. RWKV-7 (``rwkv7``)
shares it too: heads, head size and layer sizes mean the same, and four low-rank widths
are its own (see ``p2pswarm.models.rwkv7``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from p2pswarm.errors import ConfigError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "rwkv7")
RECURRENT_MODEL_TYPES = ("rwkv7",)  # a fixed-size state per session, no KV cache
MAX_WHOLE = 2**31 - 1  # beyond any real size or token id: the planner multiplies these
# A recurrent model has no context limit; this stands for it where a number is needed.
UNBOUNDED_CONTEXT_TOKENS = 2**30


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
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"model config: {self.num_heads} heads do not split into "
                f"{self.num_kv_heads} key/value groups"
            )
        if self.head_dim % 2:
            raise ConfigError("model config: head_dim must be even for RoPE")

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
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"model type {model_type!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if model_type == "rwkv7":
            return _rwkv7_from_hf(cls, hf)
        if hf.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"activation {hf['hidden_act']!r} is not supported; need silu")
        if hf.get("use_sliding_window") or (
            model_type == "mistral" and hf.get("sliding_window") is not None
        ):
            raise ConfigError("sliding-window attention is not supported")
        try:
            hidden = _whole(hf, "hidden_size")
            heads = _whole(hf, "num_attention_heads")
            kv_heads = _whole(hf, "num_key_value_heads", heads)
            head_dim = _whole(hf, "head_dim", hidden // heads if heads > 0 else 0)
            eos = hf.get("eos_token_id")
            eos_ids = tuple(_whole({"eos_token_id": i}, "eos_token_id") for i in eos) \
                if isinstance(eos, list) else (() if eos is None else (_whole(hf, "eos_token_id"),))
            theta, scaling = _rope_from_hf(hf)
            attention_bias = bool(hf.get("attention_bias", False))
            return cls(
                vocab_size=_whole(hf, "vocab_size"),
                hidden_size=hidden,
                intermediate_size=_whole(hf, "intermediate_size"),
                num_layers=_whole(hf, "num_hidden_layers"),
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
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                bos_token_id=_optional_int(hf.get("bos_token_id")),
                eos_token_ids=eos_ids,
                pad_token_id=_optional_int(hf.get("pad_token_id")),
                model_type=model_type,
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
            "architectures": ["Qwen2ForCausalLM" if self.model_type == "qwen2"
                              else "LlamaForCausalLM"],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
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
        return hf


def _rwkv7_from_hf(cls: type[ModelConfig], hf: dict[str, Any]) -> ModelConfig:
    """An RWKV-7 ``config.json`` in the flash-linear-attention layout (``RWKV7Config``)."""
    try:
        hidden = _whole(hf, "hidden_size")
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


def _rope_from_hf(hf: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    # transformers 5 writes "rope_parameters" (theta inside); 4.x wrote "rope_theta" and
    # "rope_scaling" with "rope_type" or, older still, "type".
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ConfigError("model config: rope_scaling must be an object")
    theta = _number(params, "rope_theta", _number(hf, "rope_theta", 10000.0), "rope ")
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
    raise ConfigError(f"rope scaling {kind!r} is not supported; use linear or llama3")
