"""RWKV-7 "Goose" (x070), cut into stages like any decoder.

Each layer is a time-mix (the WKV-7 state recurrence) and a channel-mix (a squared-ReLU
MLP), each reading the token before through a "token shift". Per head of size N the
time-mix keeps a matrix state S (N x N, value rows by key columns), updated per token t:

    S_t = S_{t-1} (diag(w_t) - kk_t (kk_t * a_t)^T) + v_t k_t^T,    y_t = S_t r_t

with w_t in (exp(-0.6065), 1) a per-channel decay, kk_t the normalised key, a_t the
in-context learning rate. Layer 0's value v_first feeds every later layer's value (the
"value residual"), so it travels with the hidden state between stages: a stage that is
not the first takes and a stage that is not the last gives (B, T, 2 * hidden), the hidden
state and v_first side by side.

Two forms compute the recurrence. ``wkv_chunked`` runs a whole chunk of tokens at once
(training and prefill): within a chunk the state's history is a lower-triangular solve,
exact up to rounding. ``wkv_step`` is the token-by-token form (decode). A session's state
(time-mix shift, WKV matrices, channel-mix shift) lives in a ``RecurrentState``.

Module names follow the flash-linear-attention layout of the Hugging Face checkpoints
(``model.layers.{i}.attn.r_proj.weight``, ``attn.w_lora.lora.0.weight``, ...); the RWKV
authors' ``.pth`` names (``blocks.{i}.att.receptance.weight``, ``att.w1``, ...) are mapped
onto them in ``p2pswarm.models.rwkv7_pth``.

Shapes: B batch, T tokens, C hidden, H heads, N head size (C = H * N).
"""

from __future__ import annotations

from typing import Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from p2pswarm.models.quant import DequantWorkspace
from p2pswarm.shapes.model_config import ModelConfig

DECAY_SCALE = 0.606531  # exp(-0.5): w = exp(-DECAY_SCALE * sigmoid(.)), in (0.545, 1)
GROUP_NORM_EPS = 64e-5  # the authors' ln_x epsilon (1e-5 * head_size_divisor 8 squared)
CHUNK_TOKENS = 16  # decay over a chunk stays above 0.545**16: 1 / that is safe in float32


class LayerState(Protocol):
    """One session's state of one layer (tensors of batch 1, updated in place)."""

    att_shift: torch.Tensor  # (1, C) the last token's input to the time-mix
    wkv: torch.Tensor  # (1, H, N, N) float32
    ffn_shift: torch.Tensor  # (1, C) the last token's input to the channel-mix


class StateCache(Protocol):
    """Where a stage keeps its sessions' recurrent state (one session's view)."""

    def layer(self, layer: int) -> LayerState:
        """The state of stage-local ``layer``."""
        ...


class LoRA(nn.Module):
    """x -> up(act(down(x))), the low-rank maps that make w, a, v and g."""

    def __init__(self, width: int, rank: int, activation: str | None, bias: bool) -> None:
        super().__init__()
        act: nn.Module = {"tanh": nn.Tanh(), "sigmoid": nn.Sigmoid()}.get(
            activation or "", nn.Identity())
        self.lora = nn.Sequential(nn.Linear(width, rank, bias=False), act,
                                  nn.Linear(rank, width, bias=bias))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.lora(x)
        return out


def lora_vector(lora: LoRA, x: torch.Tensor) -> torch.Tensor:
    """``lora(x)`` for one token's vector, without the module calls."""
    down, act, up = lora.lora
    assert isinstance(down, nn.Linear) and isinstance(up, nn.Linear)
    return F.linear(act(F.linear(x, down.weight)), up.weight, up.bias)


def token_shift(x: torch.Tensor, previous: torch.Tensor | None) -> torch.Tensor:
    """x (B, T, C) moved one token later, ``previous`` (B, C) or zeros in front."""
    before = previous.unsqueeze(1) if previous is not None else torch.zeros_like(x[:, :1])
    if x.shape[1] == 1:  # one token (decode): nothing to concatenate
        return before.to(x.dtype)
    return torch.cat((before.to(x.dtype), x[:, :-1]), dim=1)


def wkv_step(state: torch.Tensor, r: torch.Tensor, log_w: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor, a: torch.Tensor, b: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token. state (B, H, N, N); the rest (B, T, H, N), float32.
    Returns y (B, T, H, N) and the final state."""
    w = log_w.exp()
    if r.shape[1] == 1:  # decode: one update, no list to stack
        state = (state * w[:, 0, :, None, :] + (state @ a[:, 0, :, :, None]) @ b[:, 0, :, None, :]
                 + v[:, 0, :, :, None] @ k[:, 0, :, None, :])
        return (state @ r[:, 0, :, :, None]).squeeze(-1).unsqueeze(1), state
    ys = []
    for t in range(r.shape[1]):
        sa = state @ a[:, t, :, :, None]  # (B, H, N, 1)
        state = (state * w[:, t, :, None, :] + sa @ b[:, t, :, None, :]
                 + v[:, t, :, :, None] @ k[:, t, :, None, :])
        ys.append((state @ r[:, t, :, :, None]).squeeze(-1))
    return torch.stack(ys, dim=1), state


def wkv_chunked(state: torch.Tensor, r: torch.Tensor, log_w: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                chunk: int = CHUNK_TOKENS) -> tuple[torch.Tensor, torch.Tensor]:
    """The same recurrence, a chunk of tokens at a time.

    Within a chunk, with c_t the cumulative log decay (c_0 = 0) and u_t = S_{t-1} a_t:

        S_t = S_0 e^{c_t} + sum_{s<=t} (u_s b_s^T + v_s k_s^T) e^{c_t - c_s}

    u_t itself depends on the u_s before it, a unit lower-triangular system solved at
    once; then every y_t = S_t r_t and the chunk's final state follow by matrix products.
    """
    B, T, H, N = r.shape
    pad = -T % chunk
    if pad:  # padded tokens leave the state alone: no decay, nothing written
        r, k, v, a, b, log_w = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (r, k, v, a, b, log_w))
    L = chunk
    n = r.shape[1] // L

    def chunks(t: torch.Tensor) -> torch.Tensor:  # (B, n, H, L, N)
        return t.view(B, n, L, H, N).transpose(2, 3)

    r, log_w, k, v, a, b = (chunks(t) for t in (r, log_w, k, v, a, b))
    c = log_w.cumsum(dim=-2)  # inclusive: c_t
    c_before = c - log_w  # exclusive: c_{t-1}
    decay_in, decay_before = c.exp(), c_before.exp()
    undo = (-c).exp()  # bounded by 0.545**-chunk
    strict = torch.ones(L, L, dtype=torch.bool, device=r.device).tril(-1)
    causal = torch.ones(L, L, dtype=torch.bool, device=r.device).tril()
    eye = torch.eye(L, dtype=r.dtype, device=r.device)
    b_undo, k_undo = b * undo, k * undo
    ys = []
    for i in range(n):
        ri, ai, vi = r[:, i], a[:, i], v[:, i]
        a_before = ai * decay_before[:, i]  # (B, H, L, N)
        r_in = ri * decay_in[:, i]
        # u = S0 a_before + M_ab u + M_ak v, M strictly lower-triangular
        m_ab = (a_before @ b_undo[:, i].transpose(-1, -2)).masked_fill(~strict, 0)
        m_ak = (a_before @ k_undo[:, i].transpose(-1, -2)).masked_fill(~strict, 0)
        rhs = a_before @ state.transpose(-1, -2) + m_ak @ vi  # (B, H, L, N)
        u = torch.linalg.solve_triangular(eye - m_ab, rhs, upper=False, unitriangular=True)
        q_ab = (r_in @ b_undo[:, i].transpose(-1, -2)).masked_fill(~causal, 0)
        q_ak = (r_in @ k_undo[:, i].transpose(-1, -2)).masked_fill(~causal, 0)
        ys.append(r_in @ state.transpose(-1, -2) + q_ab @ u + q_ak @ vi)
        # the chunk's last state: decay to its end, then add what it wrote
        to_end = (c[:, i, :, -1:] - c[:, i]).exp()  # (B, H, L, N)
        state = (state * decay_in[:, i, :, -1, None, :]
                 + u.transpose(-1, -2) @ (b[:, i] * to_end)
                 + vi.transpose(-1, -2) @ (k[:, i] * to_end))
    y = torch.stack(ys, dim=1).transpose(2, 3).reshape(B, n * L, H, N)
    return y[:, :T], state


class TimeMix(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        C = config.hidden_size
        self.layer = layer
        self.num_heads = config.num_heads
        self.head_size = config.head_dim
        for name in ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g", "k_k", "k_a"):
            setattr(self, name, nn.Parameter(torch.zeros(C)))
        self.r_k = nn.Parameter(torch.zeros(config.num_heads, config.head_dim))
        self.r_proj = nn.Linear(C, C, bias=False)
        self.k_proj = nn.Linear(C, C, bias=False)
        self.v_proj = nn.Linear(C, C, bias=False)
        self.o_proj = nn.Linear(C, C, bias=False)
        self.w_lora = LoRA(C, config.decay_low_rank_dim, "tanh", bias=True)
        self.a_lora = LoRA(C, config.a_low_rank_dim, None, bias=True)
        # layer 0 makes v_first rather than mixing it in: no value map of its own
        self.v_lora = LoRA(C, config.v_low_rank_dim, None, bias=True) if layer else None
        self.g_lora = LoRA(C, config.gate_low_rank_dim, "sigmoid", bias=False)
        self.g_norm = nn.GroupNorm(config.num_heads, C, eps=GROUP_NORM_EPS)

    x_r: nn.Parameter
    x_w: nn.Parameter
    x_k: nn.Parameter
    x_v: nn.Parameter
    x_a: nn.Parameter
    x_g: nn.Parameter
    k_k: nn.Parameter
    k_a: nn.Parameter

    def forward(self, x: torch.Tensor, v_first: torch.Tensor | None,
                state: LayerState | None) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, T, C) normed. Returns the time-mix output and v_first."""
        B, T, C = x.shape
        H, N = self.num_heads, self.head_size
        xx = token_shift(x, state.att_shift if state is not None else None) - x
        xr, xw, xk = (torch.addcmul(x, xx, m) for m in (self.x_r, self.x_w, self.x_k))
        xv, xa, xg = (torch.addcmul(x, xx, m) for m in (self.x_v, self.x_a, self.x_g))
        r, k, v = self.r_proj(xr), self.k_proj(xk), self.v_proj(xv)
        log_w = -DECAY_SCALE * torch.sigmoid(self.w_lora(xw).float())
        a = torch.sigmoid(self.a_lora(xa))
        g = self.g_lora(xg)
        kk = F.normalize((k * self.k_k).view(B, T, H, N), dim=-1, p=2.0).view(B, T, C)
        k = k * (1 + (a - 1) * self.k_a)
        if self.v_lora is None:
            v_first = v
        else:
            assert v_first is not None
            v = v + (v_first - v) * torch.sigmoid(self.v_lora(xv))
        heads = (r, log_w, k, v, -kk, kk * a)
        r4, w4, k4, v4, a4, b4 = (t.float().view(B, T, H, N) for t in heads)
        wkv0 = state.wkv if state is not None else x.new_zeros(B, H, N, N, dtype=torch.float32)
        form = wkv_step if T == 1 else wkv_chunked
        y, wkv = form(wkv0, r4, w4, k4, v4, a4, b4)
        if state is not None:
            state.wkv.copy_(wkv)
            state.att_shift.copy_(x[:, -1])
        y = self.g_norm(y.to(x.dtype).reshape(B * T, C)).view(B, T, C)
        bonus = (r * k * self.r_k.view(C)).view(B, T, H, N).sum(-1, keepdim=True)
        y = y + (bonus * v.view(B, T, H, N)).view(B, T, C)
        out: torch.Tensor = self.o_proj(y * g)
        return out, v_first


    def step(self, x: torch.Tensor, v_first: torch.Tensor | None,
             state: LayerState) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` for one token of one session, x (C,) normed: the decode path on
        vectors, with the calls the arithmetic needs and no batch or time axes."""
        H, N = self.num_heads, self.head_size
        xx = state.att_shift[0] - x
        state.att_shift[0].copy_(x)
        mixes = torch.stack((self.x_r, self.x_w, self.x_k, self.x_v, self.x_a, self.x_g))
        xr, xw, xk, xv, xa, xg = torch.addcmul(x, xx, mixes).unbind(0)
        r, k, v = self.r_proj(xr), self.k_proj(xk), self.v_proj(xv)  # adapters wrap these
        w = torch.exp(-DECAY_SCALE * torch.sigmoid(lora_vector(self.w_lora, xw).float()))
        a = torch.sigmoid(lora_vector(self.a_lora, xa))
        g = lora_vector(self.g_lora, xg)
        kk = F.normalize((k * self.k_k).view(H, N), dim=-1, p=2.0).view(-1)
        k = k * (1 + (a - 1) * self.k_a)
        if self.v_lora is None:
            v_first = v
        else:
            assert v_first is not None
            v = v + (v_first - v) * torch.sigmoid(lora_vector(self.v_lora, xv))
        wkv = state.wkv[0]  # (H, N, N) float32
        new = (wkv * w.view(H, 1, N) + (wkv @ (-kk).float().view(H, N, 1))
               @ (kk * a).float().view(H, 1, N) + v.float().view(H, N, 1) @ k.float().view(H, 1, N))
        wkv.copy_(new)
        y = (new @ r.float().view(H, N, 1)).to(x.dtype).view(1, -1)
        y = F.group_norm(y, H, self.g_norm.weight, self.g_norm.bias, self.g_norm.eps).view(-1)
        y = y + ((r * k * self.r_k.view(-1)).view(H, N).sum(-1, keepdim=True)
                 * v.view(H, N)).view(-1)
        out: torch.Tensor = self.o_proj(y * g)
        return out, v_first


class ChannelMix(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.x_k = nn.Parameter(torch.zeros(config.hidden_size))
        self.key = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.value = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, state: LayerState | None) -> torch.Tensor:
        xx = token_shift(x, state.ffn_shift if state is not None else None) - x
        if state is not None:
            state.ffn_shift.copy_(x[:, -1])
        out: torch.Tensor = self.value(torch.relu(self.key(x + xx * self.x_k)) ** 2)
        return out

    def step(self, x: torch.Tensor, state: LayerState) -> torch.Tensor:
        """``forward`` for one token of one session, x (C,)."""
        xx = state.ffn_shift[0] - x
        state.ffn_shift[0].copy_(x)
        hidden = torch.relu(self.key(torch.addcmul(x, xx, self.x_k)))
        out: torch.Tensor = self.value(hidden * hidden)
        return out


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        C, eps = config.hidden_size, config.rms_norm_eps
        self.pre_norm = nn.LayerNorm(C, eps=eps) if layer == 0 else None  # the authors' ln0
        self.attn_norm = nn.LayerNorm(C, eps=eps)
        self.attn = TimeMix(config, layer)
        self.ffn_norm = nn.LayerNorm(C, eps=eps)
        self.ffn = ChannelMix(config)

    def forward(self, x: torch.Tensor, v_first: torch.Tensor | None,
                state: LayerState | None) -> tuple[torch.Tensor, torch.Tensor]:
        if self.pre_norm is not None:
            x = self.pre_norm(x)
        mixed, v_first = self.attn(self.attn_norm(x), v_first, state)
        x = x + mixed
        x = x + self.ffn(self.ffn_norm(x), state)
        return x, v_first

    def step(self, x: torch.Tensor, v_first: torch.Tensor | None,
             state: LayerState) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` for one token of one session, x (C,)."""
        if self.pre_norm is not None:
            x = self.pre_norm(x)
        mixed, v_first = self.attn.step(self.attn_norm(x), v_first, state)
        x = x + mixed
        return x + self.ffn.step(self.ffn_norm(x), state), v_first


class StageModel(nn.Module):
    """Layers [start_layer, end_layer) of an RWKV-7, plus embedding and/or head at the ends.

    Same calling convention as ``p2pswarm.models.llama.StageModel``; ``cache`` is a
    ``StateCache`` and ``start_pos`` is not needed (the state knows where it is).
    """

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
        C = config.hidden_size
        self.embeddings = nn.Embedding(config.vocab_size, C) if self.is_first else None
        self.layers = nn.ModuleList(Block(config, i) for i in range(start_layer, end_layer))
        self.norm = nn.LayerNorm(C, eps=config.rms_norm_eps) if self.is_last else None
        self.lm_head = nn.Linear(C, config.vocab_size, bias=False) if self.is_last else None
        self.workspace: DequantWorkspace | None = None  # set when layers are quantized

    def forward(self, x: torch.Tensor, start_pos: int = 0, cache: StateCache | None = None,
                *, last_logits_only: bool = False) -> torch.Tensor:
        """Token ids (B, T) on the first stage, (B, T, 2 * hidden) elsewhere.

        Returns (B, T, 2 * hidden) (hidden state and v_first), or float32 logits
        (B, T or 1, vocab) on the last stage.
        """
        C = self.config.hidden_size
        v_first: torch.Tensor | None
        if self.embeddings is not None:
            h, v_first = self.embeddings(x), None
        else:
            h, v_first = x[..., :C], x[..., C:]
        if (cache is not None and h.shape[:2] == (1, 1) and self.workspace is None
                and not torch.is_grad_enabled()):
            # one token of one session (decode): the vector path, about half the calls
            h, v_first = h.view(C), None if v_first is None else v_first.reshape(C)
            for i, block in enumerate(self.layers):
                h, v_first = cast(Block, block).step(h, v_first, cache.layer(i))
            h = h.view(1, 1, C)
            v_first = None if v_first is None else v_first.view(1, 1, C)
        else:
            for i, block in enumerate(self.layers):
                h, v_first = block(h, v_first, cache.layer(i) if cache is not None else None)
        if self.norm is None or self.lm_head is None:
            assert v_first is not None
            return torch.cat((h, v_first), dim=-1)
        if last_logits_only:
            h = h[:, -1:]
        logits: torch.Tensor = self.lm_head(self.norm(h))
        return logits.float()

    def largest_linear_numel(self) -> int:
        """Elements of the largest decoder-layer weight: the size of a dequant workspace."""
        if not self.layers:
            return 0
        c = self.config
        return max(c.hidden_size * c.hidden_size, c.intermediate_size * c.hidden_size)


BLOCK_LINEARS = ("attn.r_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj",
                 "ffn.key", "ffn.value")
_VECTORS = ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g", "k_k", "k_a")


def layer_tensor_names(config: ModelConfig, layer: int) -> list[str]:
    """Stage-local-free names of one layer's tensors, relative to ``layers.{i}.``."""
    names: list[str] = []
    if layer == 0:
        names += ["pre_norm.weight", "pre_norm.bias"]
    names += ["attn_norm.weight", "attn_norm.bias"]
    names += [f"attn.{v}" for v in _VECTORS] + ["attn.r_k"]
    names += [f"attn.{p}.weight" for p in ("r_proj", "k_proj", "v_proj", "o_proj")]
    for lora, biased in (("w_lora", True), ("a_lora", True), ("v_lora", True),
                         ("g_lora", False)):
        if lora == "v_lora" and layer == 0:
            continue
        names += [f"attn.{lora}.lora.0.weight", f"attn.{lora}.lora.2.weight"]
        if biased:
            names.append(f"attn.{lora}.lora.2.bias")
    names += ["attn.g_norm.weight", "attn.g_norm.bias"]
    names += ["ffn_norm.weight", "ffn_norm.bias", "ffn.x_k", "ffn.key.weight",
              "ffn.value.weight"]
    return names


def hf_tensor_map(config: ModelConfig, start_layer: int,
                  end_layer: int) -> dict[str, tuple[str, ...]]:
    """Checkpoint tensor name (Hugging Face layout) -> the StageModel parameters it fills."""
    names: dict[str, tuple[str, ...]] = {}
    if start_layer == 0:
        names["model.embeddings.weight"] = ("embeddings.weight",)
    for i in range(start_layer, end_layer):
        for rest in layer_tensor_names(config, i):
            names[f"model.layers.{i}.{rest}"] = (f"layers.{i - start_layer}.{rest}",)
    if end_layer == config.num_layers:
        names["model.norm.weight"] = ("norm.weight",)
        names["model.norm.bias"] = ("norm.bias",)
        if config.tie_word_embeddings:
            head = names.get("model.embeddings.weight", ())
            names["model.embeddings.weight"] = (*head, "lm_head.weight")
        else:
            names["lm_head.weight"] = ("lm_head.weight",)
    return names


def hf_tensor_shape(config: ModelConfig, name: str) -> tuple[int, ...]:
    """The shape ``config`` gives the checkpoint tensor ``name``."""
    C, V = config.hidden_size, config.vocab_size
    if name in ("model.embeddings.weight", "lm_head.weight"):
        return (V, C)
    tail = name.split(".attn.", 1)[-1].split(".ffn.", 1)[-1]
    if name.endswith(("norm.weight", "norm.bias")) or tail in (*_VECTORS, "x_k"):
        return (C,)
    if tail == "r_k":
        return (config.num_heads, config.head_dim)
    if tail in ("r_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"):
        return (C, C)
    if tail == "key.weight":
        return (config.intermediate_size, C)
    if tail == "value.weight":
        return (C, config.intermediate_size)
    ranks = {"w_lora": config.decay_low_rank_dim, "a_lora": config.a_low_rank_dim,
             "v_lora": config.v_low_rank_dim, "g_lora": config.gate_low_rank_dim}
    lora, _, part = tail.partition(".lora.")
    if lora in ranks:
        rank = ranks[lora]
        if part == "0.weight":
            return (rank, C)
        if part == "2.weight":
            return (C, rank)
        if part == "2.bias":
            return (C,)
    raise ValueError(f"an rwkv7 model has no tensor {name!r}")


def state_bytes_per_layer(config: ModelConfig, dtype_bytes: int) -> int:
    """One session's state in one layer: two shift vectors (compute dtype) and the WKV
    matrices (float32)."""
    return 2 * config.hidden_size * dtype_bytes + 4 * config.num_heads * config.head_dim ** 2
