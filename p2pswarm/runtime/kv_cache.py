"""Keys and values of a stage's layers, per session, allocated once up front.

The cache holds ``max_sessions`` slots of ``max_context_tokens`` positions for every layer
of the stage, as the plan sized it; a session takes a free slot on its first token and
gives it back when it ends. Storage is zero-filled at allocation so the memory is really
committed when the stage loads, not discovered missing mid-generation.

int8 storage keeps one float32 scale per (layer, slot, kv head, position): each key or
value vector of ``head_dim`` numbers is stored as round(x / s) with s = max|x| / 127.
Bytes per position per layer: 2 * kv_heads * head_dim * dtype_bytes, or for int8
2 * kv_heads * (head_dim + 4).

A session that ends may be *kept*: its slot and positions stay as they are, idle, so the
next turn of a chat can continue from them (``resume``) instead of prefilling the whole
conversation again. Kept slots are the first to go when a new session finds no free slot:
the least recently kept is evicted. The plan's KV budget (its slots) is never exceeded.
"""

from __future__ import annotations

import torch

from p2pswarm.errors import PlacementError

_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16,
                 "bfloat16": torch.bfloat16, "int8": torch.int8}


class KVCache:
    """Fixed-size per-session KV storage for the layers of one stage."""

    def __init__(self, *, num_layers: int, num_kv_heads: int, head_dim: int,
                 max_context_tokens: int, max_sessions: int, kv_dtype: str,
                 compute_dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        self.max_context_tokens = max_context_tokens
        self.max_sessions = max_sessions
        self.kv_dtype = kv_dtype
        self.compute_dtype = compute_dtype
        shape = (num_layers, max_sessions, num_kv_heads, max_context_tokens, head_dim)
        store = _TORCH_DTYPES[kv_dtype]
        self.k = torch.zeros(shape, dtype=store, device=device)
        self.v = torch.zeros(shape, dtype=store, device=device)
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None
        if kv_dtype == "int8":
            self.k_scale = torch.zeros(shape[:-1], dtype=torch.float32, device=device)
            self.v_scale = torch.zeros(shape[:-1], dtype=torch.float32, device=device)
        self._slots: dict[str, int] = {}
        self._lengths: dict[str, int] = {}
        self._free = list(range(max_sessions - 1, -1, -1))  # pop() hands out slot 0 first
        self._kept: dict[str, None] = {}  # idle kept sessions, least recently kept first

    @property
    def sessions(self) -> tuple[str, ...]:
        """The sessions in use (kept ones are not: they wait for their next turn)."""
        return tuple(s for s in self._slots if s not in self._kept)

    @property
    def kept(self) -> tuple[str, ...]:
        return tuple(self._kept)

    def has_room(self, session: str) -> bool:
        """Whether ``session`` can run now: it holds a slot, or one is free or kept."""
        return session in self._slots or bool(self._free) or bool(self._kept)

    def open(self, session: str) -> None:
        if session in self._slots:
            self._kept.pop(session, None)
            return
        if not self._free and self._kept:
            self.close(next(iter(self._kept)))  # evict the least recently kept
        if not self._free:
            raise PlacementError(
                f"all {self.max_sessions} session slots of this stage are in use; "
                f"end a session first")
        self._slots[session] = self._free.pop()
        self._lengths[session] = 0

    def close(self, session: str) -> None:
        slot = self._slots.pop(session, None)
        self._kept.pop(session, None)
        if slot is not None:
            self._lengths.pop(session)
            self._free.append(slot)

    def keep(self, session: str) -> None:
        """Leave ``session``'s positions in place for a later turn (evictable)."""
        if session in self._slots:
            self._kept.pop(session, None)
            self._kept[session] = None

    def resume(self, session: str, length: int) -> bool:
        """Take a kept ``session`` back, its first ``length`` positions reused; False
        when it was evicted or holds fewer positions."""
        if session not in self._kept or self._lengths[session] < length:
            return False
        del self._kept[session]
        self._lengths[session] = length
        return True

    def length(self, session: str) -> int:
        """Positions already cached for ``session`` (0 for an unknown session)."""
        return self._lengths.get(session, 0)

    def set_length(self, session: str, length: int) -> None:
        self._lengths[session] = length

    def view(self, session: str) -> SessionKV:
        return SessionKV(self, self._slots[session])

    def slot(self, session: str) -> int:
        return self._slots[session]

    def allocated_bytes(self) -> int:
        tensors = [self.k, self.v, self.k_scale, self.v_scale]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def release(self) -> None:
        empty = torch.empty(0)
        self.k = self.v = empty
        self.k_scale = self.v_scale = None
        self._slots.clear()
        self._lengths.clear()
        self._kept.clear()
        self._free = []


class SessionKV:
    """One session's slot, seen by the attention layers (implements ``LayerCache``)."""

    def __init__(self, cache: KVCache, slot: int) -> None:
        self.cache = cache
        self.slot = slot

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor,
               start_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        end = start_pos + k.shape[2]
        c = self.cache
        if c.k_scale is None or c.v_scale is None:
            c.k[layer, self.slot, :, start_pos:end] = k[0]
            c.v[layer, self.slot, :, start_pos:end] = v[0]
            keys, values = c.k[layer, self.slot, :, :end], c.v[layer, self.slot, :, :end]
            return (keys.unsqueeze(0).to(c.compute_dtype),
                    values.unsqueeze(0).to(c.compute_dtype))
        _store_int8(c.k[layer, self.slot], c.k_scale[layer, self.slot], k[0], start_pos, end)
        _store_int8(c.v[layer, self.slot], c.v_scale[layer, self.slot], v[0], start_pos, end)
        keys = _load_int8(c.k[layer, self.slot], c.k_scale[layer, self.slot], end,
                          c.compute_dtype)
        values = _load_int8(c.v[layer, self.slot], c.v_scale[layer, self.slot], end,
                            c.compute_dtype)
        return keys.unsqueeze(0), values.unsqueeze(0)


def _store_int8(q: torch.Tensor, scale: torch.Tensor, x: torch.Tensor, start: int,
                end: int) -> None:
    x = x.float()
    s = x.abs().amax(dim=-1) / 127.0
    s = torch.where(s == 0, torch.ones_like(s), s)
    q[:, start:end] = torch.round(x / s[..., None]).clamp_(-127, 127).to(torch.int8)
    scale[:, start:end] = s


def _load_int8(q: torch.Tensor, scale: torch.Tensor, end: int,
               dtype: torch.dtype) -> torch.Tensor:
    return (q[:, :end].float() * scale[:, :end, None]).to(dtype)
