"""A Llama-family decoder, cut into stages.

A ``StageModel`` holds layers [start, end) of one model: the token embedding too if it
is the first stage, the final norm and the head if it is the last. Chained, the stages
compute exactly what the whole model computes. Module names follow Hugging Face's, so a
checkpoint's ``model.layers.{i}.self_attn.q_proj.weight`` lands in
``layers.{i - start}.self_attn.q_proj.weight`` here.

The other families are switches on the same blocks (see ``ModelConfig``): q/k norms,
Gemma's (1 + w) norms around both halves of a layer, scaled embeddings, soft-capping,
sliding-window layers (a query sees the last ``window`` keys, itself included: key
positions ``> query - window``, transformers' rule for Gemma 2, Gemma 3 and Mistral alike)
and a second RoPE base for Gemma 3's sliding layers. Phi-3's fused ``qkv_proj`` and
``gate_up_proj`` are split into our q, k, v and gate, up as they are read.

Shapes: B batch, T new tokens, L tokens attended to (cache plus new), D head_dim.
A cache returns the keys that end at the new tokens; a sliding layer's cache may return
only the last ones, so key positions are counted back from the end.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from p2pswarm.models.quant import DequantWorkspace, fuse
from p2pswarm.shapes.model_config import ModelConfig

# attention masks of one forward by (new tokens, keys, window, soft-capped)
Masks = dict[tuple[int, int, int | None, bool], torch.Tensor]


class LayerCache(Protocol):
    """Where a stage keeps keys and values between calls (one session's view)."""

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor,
               start_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (1, kv_heads, T, D) at [start_pos, start_pos + T) of stage-local
        ``layer`` and return every key and value up to start_pos + T."""
        ...


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.unit_offset = unit_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32 \
                and not self.unit_offset:
            # one fused op, the same numbers as the steps below give in float32
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # normalise in float32 whatever the compute dtype, as the reference does
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:  # Gemma scales by (1 + w) in float32, then casts
            return (h * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * h.to(x.dtype)


def norm(config: ModelConfig, dim: int | None = None) -> RMSNorm:
    return RMSNorm(config.hidden_size if dim is None else dim, config.rms_norm_eps,
                   config.unit_offset_norms)


def rope_inv_freq(config: ModelConfig, device: torch.device | str = "cpu", *,
                  local: bool = False) -> torch.Tensor:
    """Inverse frequencies (D / 2,) in float32, with the config's scaling applied; with
    ``local``, those of Gemma 3's sliding layers (their own base, no scaling)."""
    dim = config.head_dim
    theta = config.local_rope_theta if local and config.local_rope_theta else config.rope_theta
    inv_freq = 1.0 / (theta ** (
        torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))
    scaling = config.rope_scaling
    if scaling is None or local:
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
    """cos and sin tables for the positions at hand, computed on the fly (no max-length table).
    A model with a local RoPE base (Gemma 3) keeps a second set for its sliding layers."""

    inv_freq: torch.Tensor
    local_inv_freq: torch.Tensor | None

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)
        local = rope_inv_freq(config, local=True) if config.local_rope_theta else None
        self.register_buffer("local_inv_freq", local, persistent=False)

    def materialize(self, device: torch.device | str) -> None:
        """Compute the tables on ``device`` (a stage is first built on ``meta``)."""
        self.inv_freq = rope_inv_freq(self.config, device)
        if self.local_inv_freq is not None:
            self.local_inv_freq = rope_inv_freq(self.config, device, local=True)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype,
                local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self.local_inv_freq if local and self.local_inv_freq is not None \
            else self.inv_freq
        freqs = positions.float()[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)  # (T, D)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return rope(x, cos, signed_sin(sin))


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """``sin`` with its first half negated: rotating a vector by its halves is then a
    swap of the halves times this (once per forward, not per layer and tensor)."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, where rotate_half(x) = (-x2, x1): the same
    numbers, as (-a) * b == a * (-b) exactly, in four ops instead of seven."""
    half = x.shape[-1] // 2
    swapped = x.view(*x.shape[:-1], 2, half).flip(-2).flatten(-2)
    out: torch.Tensor = x * cos + swapped * sin_signed
    return out


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int = 0) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.window = config.layer_window(layer_index)
        self.scale = config.attn_scale
        self.softcap = config.attn_softcap
        self.q_norm = norm(config, config.head_dim) if config.qk_norm else None
        self.k_norm = norm(config, config.head_dim) if config.qk_norm else None
        self.q_proj = nn.Linear(config.hidden_size, config.q_dim, bias=config.qkv_bias)
        self.k_proj = nn.Linear(config.hidden_size, config.kv_dim, bias=config.qkv_bias)
        self.v_proj = nn.Linear(config.hidden_size, config.kv_dim, bias=config.qkv_bias)
        self.o_proj = nn.Linear(config.q_dim, config.hidden_size, bias=config.o_bias)
        # q, k and v as one linear (``fuse_linears``, serving only): one matmul, not three
        self.qkv_proj: nn.Module | None = None

    def project(self, x: torch.Tensor, cos: torch.Tensor,
                sin_signed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (B, heads, T, D), and k, v (B, kv_heads, T, D), rotated (``rope``)."""
        B, T, _ = x.shape
        H, KV, D = self.num_heads, self.num_kv_heads, self.head_dim
        if self.qkv_proj is not None:
            qkv = self.qkv_proj(x).view(B, T, H + 2 * KV, D).transpose(1, 2)
            if self.q_norm is None:  # q and k rotated together
                qk = rope(qkv[:, :H + KV], cos, sin_signed)
                return qk[:, :H], qk[:, H:], qkv[:, H + KV:]
            q, k, v = qkv[:, :H], qkv[:, H:H + KV], qkv[:, H + KV:]
        else:
            q = self.q_proj(x).view(B, T, H, D).transpose(1, 2)
            k = self.k_proj(x).view(B, T, KV, D).transpose(1, 2)
            v = self.v_proj(x).view(B, T, KV, D).transpose(1, 2)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return rope(q, cos, sin_signed), rope(k, cos, sin_signed), v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, start_pos: int,
                cache: LayerCache | None, layer: int, masks: Masks | None = None
                ) -> torch.Tensor:
        """``sin`` as ``signed_sin`` gives it."""
        B, T, _ = x.shape
        q, k, v = self.project(x, cos, sin)
        if cache is not None:
            k, v = cache.update(layer, k, v, start_pos)
        L = k.shape[2]
        mask = None
        windowed = self.window is not None and L > self.window
        if windowed or self.softcap is not None or 1 < T < L:
            mask = self._mask(T, L, q, masks)
        if self.softcap is not None:
            y = self._softcapped(q, k, v, mask)
        else:
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=(mask is None and T > 1 and T == L),
                scale=self.scale, enable_gqa=self.num_kv_heads != self.num_heads,
            )
        out: torch.Tensor = self.o_proj(y.transpose(1, 2).reshape(B, T, -1))
        return out

    def _mask(self, T: int, L: int, q: torch.Tensor, masks: Masks | None) -> torch.Tensor:
        """Which keys each query may see: queries sit at the end of the keys, so query i
        sees keys 0 .. L - T + i, and on a sliding layer only the last ``window`` of those.
        The soft-capped path takes it as booleans; SDPA as 0 / -inf in the query's dtype,
        which is what it would turn booleans into on every call. Layers of one forward
        with the same shape share one mask (``masks``), built once instead of per layer."""
        key = (T, L, self.window, self.softcap is not None)
        if masks is not None and key in masks:
            return masks[key]
        query_pos = torch.arange(L - T, L, device=q.device)[:, None]
        key_pos = torch.arange(L, device=q.device)[None, :]
        mask = key_pos <= query_pos
        if self.window is not None:
            mask = mask & (key_pos > query_pos - self.window)
        if self.softcap is None:
            mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(
                ~mask, float("-inf"))
        if masks is not None:
            masks[key] = mask
        return mask

    def _softcapped(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    mask: torch.Tensor | None) -> torch.Tensor:
        """Attention with Gemma 2's tanh cap on the scores (no fused kernel has it): the
        scaled scores are capped, then masked, on sliding and full layers alike, as in
        transformers' eager attention."""
        assert self.softcap is not None
        groups = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        scale = self.scale if self.scale is not None else self.head_dim ** -0.5
        scores = torch.tanh(q @ k.transpose(2, 3) * scale / self.softcap) * self.softcap
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return weights @ v


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        bias = config.mlp_bias
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)
        self.gelu = config.hidden_act == "gelu_tanh"
        self.gate_up_proj: nn.Module | None = None  # gate and up as one (``fuse_linears``)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        gate = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        out: torch.Tensor = self.down_proj(gate * up)
        return out


class Block(nn.Module):
    """One decoder layer. Llama: x + attn(norm(x)), then x + mlp(norm(x)), where
    ``post_attention_layernorm`` is the MLP's input norm. Gemma (sandwich norms):
    x + post_attention(attn(input(x))), then x + post_feedforward(mlp(pre_feedforward(x)))."""

    def __init__(self, config: ModelConfig, layer_index: int = 0) -> None:
        super().__init__()
        self.input_layernorm = norm(config)
        self.self_attn = Attention(config, layer_index)
        self.post_attention_layernorm = norm(config)
        self.mlp = MLP(config)
        self.sandwich = config.sandwich_norms
        self.local_rope = (config.local_rope_theta is not None
                           and config.layer_window(layer_index) is not None)
        if self.sandwich:
            self.pre_feedforward_layernorm = norm(config)
            self.post_feedforward_layernorm = norm(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, start_pos: int,
                cache: LayerCache | None, layer: int, masks: Masks | None = None
                ) -> torch.Tensor:
        if not self.sandwich:
            x = x + self.self_attn(self.input_layernorm(x), cos, sin, start_pos, cache, layer,
                                   masks)
            out: torch.Tensor = x + self.mlp(self.post_attention_layernorm(x))
            return out
        attended = self.self_attn(self.input_layernorm(x), cos, sin, start_pos, cache, layer,
                                  masks)
        x = x + self.post_attention_layernorm(attended)
        mlp_out = self.mlp(self.pre_feedforward_layernorm(x))
        out = x + self.post_feedforward_layernorm(mlp_out)
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
        self.layers = nn.ModuleList(Block(config, i) for i in range(start_layer, end_layer))
        self.norm = norm(config) if self.is_last else None
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
        if self.embed_tokens is not None and self.config.embed_scale:
            # the scale rounded to the compute dtype first, as Gemma's reference does
            h = h * torch.tensor(self.config.hidden_size ** 0.5, dtype=h.dtype)
        positions = torch.arange(start_pos, start_pos + h.shape[1], device=h.device)
        cos, sin = self.rotary(positions, h.dtype)
        sin = signed_sin(sin)
        if self.rotary.local_inv_freq is not None:
            local_cos, local_sin = self.rotary(positions, h.dtype, local=True)
            local = (local_cos, signed_sin(local_sin))
        else:
            local = (cos, sin)
        masks: Masks = {}  # one attention mask per shape, shared by the layers
        for i, block in enumerate(self.layers):
            c, s = local if block.local_rope else (cos, sin)
            h = block(h, c, s, start_pos, cache, i, masks)
        if self.norm is None or self.lm_head is None:
            return h
        if last_logits_only:
            h = h[:, -1:]
        logits: torch.Tensor = self.lm_head(self.norm(h)).float()
        cap = self.config.final_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def largest_linear_numel(self) -> int:
        """Elements of the largest decoder-layer weight: the size of a dequant workspace."""
        if not self.layers:
            return 0
        c = self.config
        return max(c.q_dim * c.hidden_size, c.kv_dim * c.hidden_size,
                   c.intermediate_size * c.hidden_size)


def fuse_linears(model: StageModel) -> None:
    """Each layer's q, k, v as one linear and its gate, up as one (float, int8 and 4-bit
    alike, the same numbers and bytes): a decode step then makes five matmul calls per
    layer instead of seven. Serving only, once its weights are in place: LoRA and the
    checkpoint's names want the separate linears, and layers wrapped by LoRA stay so."""
    for module in model.layers:
        block = module if isinstance(module, Block) else None
        if block is None:
            continue
        attn, mlp = block.self_attn, block.mlp
        if attn.qkv_proj is None:
            qkv = fuse([attn.q_proj, attn.k_proj, attn.v_proj])
            if qkv is not None:
                attn.qkv_proj = qkv
                del attn.q_proj, attn.k_proj, attn.v_proj
        if mlp.gate_up_proj is None:
            gate_up = fuse([mlp.gate_proj, mlp.up_proj])
            if gate_up is not None:
                mlp.gate_up_proj = gate_up
                del mlp.gate_proj, mlp.up_proj


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
    fused = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
             "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}
    stored: list[tuple[str, tuple[str, ...]]] = []  # checkpoint linear -> our linears
    for linear in BLOCK_LINEARS:
        if config.fused_qkv and linear in fused["self_attn.qkv_proj"]:
            if linear == "self_attn.q_proj":
                stored.append(("self_attn.qkv_proj", fused["self_attn.qkv_proj"]))
        elif config.fused_gate_up and linear in fused["mlp.gate_up_proj"]:
            if linear == "mlp.gate_proj":
                stored.append(("mlp.gate_up_proj", fused["mlp.gate_up_proj"]))
        else:
            stored.append((linear, (linear,)))
    norms = ["post_attention_layernorm"]
    if config.sandwich_norms:
        norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
    if config.qk_norm:
        norms += ["self_attn.q_norm", "self_attn.k_norm"]
    for i in range(start_layer, end_layer):
        local, hf = f"layers.{i - start_layer}", f"model.layers.{i}"
        names[f"{hf}.input_layernorm.weight"] = (f"{local}.input_layernorm.weight",)
        for linear, ours in stored:
            if biased[ours[0]]:  # bias first, so a quantized linear gets it with its weight
                names[f"{hf}.{linear}.bias"] = tuple(f"{local}.{o}.bias" for o in ours)
            names[f"{hf}.{linear}.weight"] = tuple(f"{local}.{o}.weight" for o in ours)
        for name in norms:
            names[f"{hf}.{name}.weight"] = (f"{local}.{name}.weight",)
    if is_last:
        names["model.norm.weight"] = ("norm.weight",)
        if config.tie_word_embeddings:
            head = names.get("model.embed_tokens.weight", ())
            names["model.embed_tokens.weight"] = (*head, "lm_head.weight")
        else:
            names["lm_head.weight"] = ("lm_head.weight",)
    return names


def is_fused(name: str) -> bool:
    """Whether checkpoint tensor ``name`` holds several of our linears stacked by rows."""
    return name.endswith((".qkv_proj.weight", ".qkv_proj.bias", ".gate_up_proj.weight",
                          ".gate_up_proj.bias"))


def hf_tensor_shape(config: ModelConfig, name: str) -> tuple[int, ...]:
    """The shape ``config`` gives the checkpoint tensor ``name``."""
    hidden = config.hidden_size
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return (config.vocab_size, hidden)
    if name.endswith(("q_norm.weight", "k_norm.weight")):
        return (config.head_dim,)
    if name.endswith("norm.weight"):
        return (hidden,)
    out_in = {
        "qkv_proj": (config.q_dim + 2 * config.kv_dim, hidden),
        "gate_up_proj": (2 * config.intermediate_size, hidden),
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
