"""One decode step for several sessions in one forward pass (batched decode).

Each row is one session at its own position: rotary angles per row, keys and values
written into the row's own cache slot at its position, and attention over the row's
slot up to its position (a mask hides the positions past it, which hold older or no
data). The layers are the stage's own modules, called as the single-session forward
calls them, so quantized layers and their workspace work unchanged. A row gets the same
result as the session run alone (up to the order of float sums in a batched matmul).

Layers that slide a window over a ring of keys or cap their attention scores keep the
single-session path (``batchable``): the stage then steps such sessions one by one.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F

from p2pswarm.models.llama import Block, StageModel, signed_sin
from p2pswarm.runtime.kv_cache import KVCache, SessionKV


def batchable(model: StageModel) -> bool:
    """Whether ``batched_decode`` computes what this stage's own forward does."""
    for module in model.layers:
        attn = cast(Block, module).self_attn
        if attn.window is not None or attn.softcap is not None:
            return False
    return True


def batched_decode(model: StageModel, kv: KVCache, slots: list[int], x: torch.Tensor,
                   positions: list[int]) -> torch.Tensor:
    """``x``: token ids (B,) on a first stage, hidden states (B, hidden) elsewhere.
    Returns hidden states (B, hidden), or float32 logits (B, vocab) on a last stage."""
    h = model.embed_tokens(x) if model.embed_tokens is not None else x
    if model.embed_tokens is not None and model.config.embed_scale:
        h = h * torch.tensor(model.config.hidden_size ** 0.5, dtype=h.dtype)
    h = h.unsqueeze(1)  # (B, 1, hidden)
    B = h.shape[0]
    device = h.device
    pos = torch.tensor(positions, dtype=torch.long, device=device)
    cos, sin = model.rotary(pos, h.dtype)  # (B, D)
    sin = signed_sin(sin)
    length = max(positions) + 1
    visible = torch.arange(length, device=device)[None, :] <= pos[:, None]  # (B, L)
    mask = visible[:, None, None, :]
    slot_index = torch.tensor(slots, dtype=torch.long, device=device)
    for layer, module in enumerate(model.layers):
        block = cast(Block, module)
        if block.local_rope:
            c, s = model.rotary(pos, h.dtype, local=True)
            s = signed_sin(s)
        else:
            c, s = cos, sin
        c, s = c[:, None, None, :], s[:, None, None, :]
        attn = block.self_attn
        q, k, v = attn.project(block.input_layernorm(h), c, s)
        keys, values = _update(kv, layer, slots, slot_index, pos, positions, k, v, length)
        y = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=attn.scale,
                                           enable_gqa=attn.num_kv_heads != attn.num_heads)
        attended = attn.o_proj(y.transpose(1, 2).reshape(B, 1, -1))
        if not block.sandwich:
            h = h + attended
            h = h + block.mlp(block.post_attention_layernorm(h))
        else:
            h = h + block.post_attention_layernorm(attended)
            h = h + block.post_feedforward_layernorm(
                block.mlp(block.pre_feedforward_layernorm(h)))
    if model.norm is None or model.lm_head is None:
        return h[:, 0]
    logits: torch.Tensor = model.lm_head(model.norm(h)).float()
    cap = model.config.final_softcap
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    return logits[:, 0]


def _update(kv: KVCache, layer: int, slots: list[int], slot_index: torch.Tensor,
            pos: torch.Tensor, positions: list[int], k: torch.Tensor, v: torch.Tensor,
            length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Store each row's k, v (B, kv_heads, 1, D) at its slot and position; every row's
    keys and values up to ``length`` (B, kv_heads, L, D)."""
    if kv.k_scale is None:  # float storage: one scatter, one gather
        keys_at, values_at = kv.k[layer], kv.v[layer]
        keys_at[slot_index, :, pos] = k[:, :, 0].to(keys_at.dtype)
        values_at[slot_index, :, pos] = v[:, :, 0].to(values_at.dtype)
        # cut to ``length`` before gathering the rows: a slot's cache spans the whole
        # context, and copying all of it every layer made a batch cost more than its steps
        keys = keys_at[:, :, :length].index_select(0, slot_index)
        values = values_at[:, :, :length].index_select(0, slot_index)
        return keys.to(kv.compute_dtype), values.to(kv.compute_dtype)
    rows_k, rows_v = [], []
    for b, (slot, position) in enumerate(zip(slots, positions)):  # int8: row by row
        keys, values = SessionKV(kv, slot).update(layer, k[b:b + 1], v[b:b + 1], position)
        pad = length - keys.shape[2]
        rows_k.append(F.pad(keys, (0, 0, 0, pad)))
        rows_v.append(F.pad(values, (0, 0, 0, pad)))
    return torch.cat(rows_k), torch.cat(rows_v)
