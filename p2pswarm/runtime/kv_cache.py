"""Keys and values of a stage's layers, per session, allocated once up front.

The cache holds ``max_sessions`` slots of ``max_context_tokens`` positions for every layer
of the stage, as the plan sized it; a session takes a free slot on its first token and
gives it back when it ends. Storage is zero-filled at allocation so the memory is really
committed when the stage loads, not discovered missing mid-generation.

A sliding-window layer keeps only its window: ``min(window, max_context_tokens)``
positions, a ring where position p lives at p mod that size. Its update returns the
keys its queries may see (the window before the new tokens, then the new ones).

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

from collections.abc import Sequence

import torch

from p2pswarm.errors import PlacementError

_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16,
                 "bfloat16": torch.bfloat16, "int8": torch.int8}


class KVCache:
    """Fixed-size per-session KV storage for the layers of one stage."""

    def __init__(self, *, num_layers: int, num_kv_heads: int, head_dim: int,
                 max_context_tokens: int, max_sessions: int, kv_dtype: str,
                 compute_dtype: torch.dtype, device: torch.device | str = "cpu",
                 layer_windows: Sequence[int | None] = ()) -> None:
        self.max_context_tokens = max_context_tokens
        self.max_sessions = max_sessions
        self.kv_dtype = kv_dtype
        self.compute_dtype = compute_dtype
        windows = list(layer_windows) or [None] * num_layers
        if len(windows) != num_layers:
            raise ValueError("one window (or None) per layer")
        # positions each layer keeps: the context, or a sliding layer's window
        self.capacity = [max_context_tokens if w is None else min(w, max_context_tokens)
                         for w in windows]
        self.windows = windows
        store = _TORCH_DTYPES[kv_dtype]
        shapes = [(max_sessions, num_kv_heads, cap, head_dim) for cap in self.capacity]
        self.k = [torch.zeros(shape, dtype=store, device=device) for shape in shapes]
        self.v = [torch.zeros(shape, dtype=store, device=device) for shape in shapes]
        self.k_scale: list[torch.Tensor] | None = None
        self.v_scale: list[torch.Tensor] | None = None
        if kv_dtype == "int8":
            self.k_scale = [torch.zeros(s[:-1], dtype=torch.float32, device=device)
                            for s in shapes]
            self.v_scale = [torch.zeros(s[:-1], dtype=torch.float32, device=device)
                            for s in shapes]
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
        tensors = [*self.k, *self.v, *(self.k_scale or ()), *(self.v_scale or ())]
        return sum(t.numel() * t.element_size() for t in tensors)

    def release(self) -> None:
        self.k, self.v = [], []
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
        c = self.cache
        end = start_pos + k.shape[2]
        capacity = c.capacity[layer]
        if c.windows[layer] is None or end <= capacity:
            # every position fits in place (position p at index p)
            where: slice | torch.Tensor = slice(start_pos, end)
            seen: slice | torch.Tensor = slice(0, end)
            self._store(layer, where, k[0], v[0])
            return self._load(layer, seen)
        # a ring: the window's earlier positions are read before new ones overwrite them
        earlier = min(start_pos, capacity - 1)
        before = torch.arange(start_pos - earlier, start_pos, device=k.device) % capacity
        old_k, old_v = self._load(layer, before)
        kept = min(k.shape[2], capacity)  # of the new positions, the ring keeps the last
        new = torch.arange(end - kept, end, device=k.device) % capacity
        self._store(layer, new, k[0, :, -kept:], v[0, :, -kept:])
        # the new positions as storage rounds them, as the in-place path reads them back:
        # otherwise a step past the window's edge sees its own key at another precision
        return (torch.cat([old_k, self._stored(k)], dim=2),
                torch.cat([old_v, self._stored(v)], dim=2))

    def _stored(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (1, kv_heads, n, D) rounded as the cache would hold it, in compute dtype."""
        c = self.cache
        if c.k_scale is None:
            return x.to(c.k[0].dtype).to(c.compute_dtype)
        q, scale = _int8(x)
        return (q.float() * scale[..., None]).to(c.compute_dtype)

    def _store(self, layer: int, where: slice | torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> None:
        c = self.cache
        if c.k_scale is None or c.v_scale is None:
            c.k[layer][self.slot, :, where] = k.to(c.k[layer].dtype)
            c.v[layer][self.slot, :, where] = v.to(c.v[layer].dtype)
            return
        _store_int8(c.k[layer][self.slot], c.k_scale[layer][self.slot], k, where)
        _store_int8(c.v[layer][self.slot], c.v_scale[layer][self.slot], v, where)

    def _load(self, layer: int,
              where: slice | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(1, kv_heads, n, D) keys and values at ``where``, in the compute dtype."""
        c = self.cache
        if c.k_scale is None or c.v_scale is None:
            return (c.k[layer][self.slot, :, where].unsqueeze(0).to(c.compute_dtype),
                    c.v[layer][self.slot, :, where].unsqueeze(0).to(c.compute_dtype))
        keys = _load_int8(c.k[layer][self.slot], c.k_scale[layer][self.slot], where,
                          c.compute_dtype)
        values = _load_int8(c.v[layer][self.slot], c.v_scale[layer][self.slot], where,
                            c.compute_dtype)
        return keys.unsqueeze(0), values.unsqueeze(0)


def _int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 values, a float scale per vector of the last dimension)."""
    x = x.float()
    s = x.abs().amax(dim=-1) / 127.0
    s = torch.where(s == 0, torch.ones_like(s), s)
    return torch.round(x / s[..., None]).clamp_(-127, 127).to(torch.int8), s


def _store_int8(q: torch.Tensor, scale: torch.Tensor, x: torch.Tensor,
                where: slice | torch.Tensor) -> None:
    q[:, where], scale[:, where] = _int8(x)


def _load_int8(q: torch.Tensor, scale: torch.Tensor, where: slice | torch.Tensor,
               dtype: torch.dtype) -> torch.Tensor:
    return (q[:, where].float() * scale[:, where, None]).to(dtype)
