"""A Llama-family decoder, cut into stages.

A ``StageModel`` holds layers [start, end) of one model: the token embedding too if it
is the first stage, the final norm and the head if it is the last. Chained, the stages
compute exactly what the whole model computes. Module names follow Hugging Face's, so a
checkpoint's ``model.layers.{i}.self_attn.q_proj.weight`` lands in
``layers.{i - start}.self_attn.q_proj.weight`` here.

Shapes: B batch, T new tokens, L tokens attended to (cache plus new), D head_dim.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from p2pswarm.models.config import ModelConfig
from p2pswarm.models.quant import DequantWorkspace


class LayerCache(Protocol):
    """Where a stage keeps keys and values between calls (one session's view)."""

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor,
               start_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (1, kv_heads, T, D) at [start_pos, start_pos + T) of stage-local
        ``layer`` and return every key and value up to start_pos + T."""
        ...


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalise in float32 whatever the compute dtype, as the reference does
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_inv_freq(config: ModelConfig, device: torch.device | str = "cpu") -> torch.Tensor:
    """Inverse frequencies (D / 2,) in float32, with the config's scaling applied."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (
        torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    # llama3: long wavelengths are slowed by `factor`, short ones kept, the middle blended
    low_freq_wavelen = scaling.original_max_context_tokens / scaling.low_freq_factor
    high_freq_wavelen = scaling.original_max_context_tokens / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_context_tokens / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


class Rotary(nn.Module):
    """cos and sin tables for the positions at hand, computed on the fly (no max-length table)."""

    inv_freq: torch.Tensor

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)

    def forward(self, positions: torch.Tensor,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)  # (T, D)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, config.q_dim, bias=config.qkv_bias)
        self.k_proj = nn.Linear(config.hidden_size, config.kv_dim, bias=config.qkv_bias)
        self.v_proj = nn.Linear(config.hidden_size, config.kv_dim, bias=config.qkv_bias)
        self.o_proj = nn.Linear(config.q_dim, config.hidden_size, bias=config.o_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, start_pos: int,
                cache: LayerCache | None, layer: int) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(layer, k, v, start_pos)
        L = k.shape[2]
        # queries sit at the end of the keys: query i may see keys 0 .. L - T + i
        mask = None
        if 1 < T < L:
            mask = torch.ones(T, L, dtype=torch.bool, device=x.device).tril(diagonal=L - T)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=(T > 1 and T == L),
            enable_gqa=self.num_kv_heads != self.num_heads,
        )
        out: torch.Tensor = self.o_proj(y.transpose(1, 2).reshape(B, T, -1))
        return out


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        bias = config.mlp_bias
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out


class Block(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, start_pos: int,
                cache: LayerCache | None, layer: int) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, start_pos, cache, layer)
        out: torch.Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return out


class StageModel(nn.Module):
    """Layers [start_layer, end_layer) of a decoder, plus embedding and/or head at the ends."""

    def __init__(self, config: ModelConfig, start_layer: int, end_layer: int) -> None:
        super().__init__()
        if not 0 <= start_layer <= end_layer <= config.num_layers:
            raise ValueError(f"bad layer range [{start_layer}, {end_layer}) "
                             f"for a {config.num_layers}-layer model")
        self.config = config
        self.start_layer = start_layer
        self.end_layer = end_layer
        self.is_first = start_layer == 0
        self.is_last = end_layer == config.num_layers
        self.embed_tokens = (
            nn.Embedding(config.vocab_size, config.hidden_size) if self.is_first else None)
        self.layers = nn.ModuleList(Block(config) for _ in range(end_layer - start_layer))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if self.is_last else None
        self.lm_head = (
            nn.Linear(config.hidden_size, config.vocab_size, bias=False) if self.is_last else None)
        self.rotary = Rotary(config)
        self.workspace: DequantWorkspace | None = None  # set when layers are quantized

    def forward(self, x: torch.Tensor, start_pos: int = 0, cache: LayerCache | None = None,
                *, last_logits_only: bool = False) -> torch.Tensor:
        """Token ids (B, T) on the first stage, hidden states (B, T, hidden) elsewhere.

        Returns hidden states (B, T, hidden), or float32 logits (B, T or 1, vocab) on the
        last stage.
        """
        h = self.embed_tokens(x) if self.embed_tokens is not None else x
        positions = torch.arange(start_pos, start_pos + h.shape[1], device=h.device)
        cos, sin = self.rotary(positions, h.dtype)
        for i, block in enumerate(self.layers):
            h = block(h, cos, sin, start_pos, cache, i)
        if self.norm is None or self.lm_head is None:
            return h
        if last_logits_only:
            h = h[:, -1:]
        logits: torch.Tensor = self.lm_head(self.norm(h))
        return logits.float()

    def largest_linear_numel(self) -> int:
        """Elements of the largest decoder-layer weight: the size of a dequant workspace."""
        if not self.layers:
            return 0
        c = self.config
        return max(c.q_dim * c.hidden_size, c.kv_dim * c.hidden_size,
                   c.intermediate_size * c.hidden_size)


BLOCK_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                 "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def hf_tensor_map(config: ModelConfig, start_layer: int,
                  end_layer: int) -> dict[str, tuple[str, ...]]:
    """Checkpoint tensor name -> the StageModel parameter names it fills, in reading order.

    A tied head reads ``model.embed_tokens.weight``; a stage with both ends and a tied head
    reads it once for both.
    """
    names: dict[str, tuple[str, ...]] = {}
    is_first = start_layer == 0
    is_last = end_layer == config.num_layers
    if is_first:
        names["model.embed_tokens.weight"] = ("embed_tokens.weight",)
    biased = {
        "self_attn.q_proj": config.qkv_bias, "self_attn.k_proj": config.qkv_bias,
        "self_attn.v_proj": config.qkv_bias, "self_attn.o_proj": config.o_bias,
        "mlp.gate_proj": config.mlp_bias, "mlp.up_proj": config.mlp_bias,
        "mlp.down_proj": config.mlp_bias,
    }
    for i in range(start_layer, end_layer):
        local, hf = f"layers.{i - start_layer}", f"model.layers.{i}"
        names[f"{hf}.input_layernorm.weight"] = (f"{local}.input_layernorm.weight",)
        for linear in BLOCK_LINEARS:
            if biased[linear]:  # bias first, so a quantized linear gets it with its weight
                names[f"{hf}.{linear}.bias"] = (f"{local}.{linear}.bias",)
            names[f"{hf}.{linear}.weight"] = (f"{local}.{linear}.weight",)
        names[f"{hf}.post_attention_layernorm.weight"] = (
            f"{local}.post_attention_layernorm.weight",)
    if is_last:
        names["model.norm.weight"] = ("norm.weight",)
        if config.tie_word_embeddings:
            head = names.get("model.embed_tokens.weight", ())
            names["model.embed_tokens.weight"] = (*head, "lm_head.weight")
        else:
            names["lm_head.weight"] = ("lm_head.weight",)
    return names


def hf_tensor_shape(config: ModelConfig, name: str) -> tuple[int, ...]:
    """The shape ``config`` gives the checkpoint tensor ``name``."""
    hidden = config.hidden_size
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return (config.vocab_size, hidden)
    if name.endswith("norm.weight"):
        return (hidden,)
    out_in = {
        "q_proj": (config.q_dim, hidden), "k_proj": (config.kv_dim, hidden),
        "v_proj": (config.kv_dim, hidden), "o_proj": (hidden, config.q_dim),
        "gate_proj": (config.intermediate_size, hidden),
        "up_proj": (config.intermediate_size, hidden),
        "down_proj": (hidden, config.intermediate_size),
    }
    module, _, kind = name.rpartition(".")
    proj = module.rsplit(".", 1)[-1]
    if proj not in out_in or kind not in ("weight", "bias"):
        raise ValueError(f"a {config.model_type} model has no tensor {name!r}")
    out_features, in_features = out_in[proj]
    return (out_features,) if kind == "bias" else (out_features, in_features)
