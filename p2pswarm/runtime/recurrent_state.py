"""A recurrent model's per-session state, in place of a KV cache (RWKV-7).

Per layer a session holds the time-mix shift vector and the channel-mix shift vector
(hidden numbers each, in the compute dtype) and the WKV matrices (heads x head_size x
head_size, float32). That is all: the state does not grow with the context, so a slot
holds a session of any length. ``max_sessions`` slots are allocated, zero-filled, when
the stage loads, like the KV cache they replace; the interface is the cache's (open,
close, length, set_length, view), so the stage host drives both the same way.
"""

from __future__ import annotations

import torch

from p2pswarm.errors import PlacementError


class RecurrentState:
    """Fixed-size per-session state for the layers of one stage."""

    def __init__(self, *, num_layers: int, hidden_size: int, num_heads: int, head_size: int,
                 max_sessions: int, compute_dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        self.max_sessions = max_sessions
        shift = (num_layers, max_sessions, 1, hidden_size)
        self.att_shift = torch.zeros(shift, dtype=compute_dtype, device=device)
        self.ffn_shift = torch.zeros(shift, dtype=compute_dtype, device=device)
        self.wkv = torch.zeros((num_layers, max_sessions, 1, num_heads, head_size, head_size),
                               dtype=torch.float32, device=device)
        self._slots: dict[str, int] = {}
        self._lengths: dict[str, int] = {}
        self._free = list(range(max_sessions - 1, -1, -1))

    @property
    def sessions(self) -> tuple[str, ...]:
        return tuple(self._slots)

    def open(self, session: str) -> None:
        if session in self._slots:
            return
        if not self._free:
            raise PlacementError(
                f"all {self.max_sessions} session slots of this stage are in use; "
                f"end a session first")
        slot = self._free.pop()
        for store in (self.att_shift, self.ffn_shift, self.wkv):
            store[:, slot].zero_()  # a new session starts from the zero state
        self._slots[session] = slot
        self._lengths[session] = 0

    def close(self, session: str) -> None:
        slot = self._slots.pop(session, None)
        if slot is not None:
            self._lengths.pop(session)
            self._free.append(slot)

    def length(self, session: str) -> int:
        """Tokens ``session`` has consumed (0 for an unknown session)."""
        return self._lengths.get(session, 0)

    def set_length(self, session: str, length: int) -> None:
        self._lengths[session] = length

    def view(self, session: str) -> SessionState:
        return SessionState(self, self._slots[session])

    def allocated_bytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for t in (self.att_shift, self.ffn_shift, self.wkv))

    def release(self) -> None:
        self.att_shift = self.ffn_shift = self.wkv = torch.empty(0)
        self._slots.clear()
        self._lengths.clear()
        self._free = []


class _LayerSlot:
    def __init__(self, store: RecurrentState, layer: int, slot: int) -> None:
        self.att_shift = store.att_shift[layer, slot]
        self.ffn_shift = store.ffn_shift[layer, slot]
        self.wkv = store.wkv[layer, slot]


class SessionState:
    """One session's slot, seen by the layers (implements ``rwkv7.StateCache``)."""

    def __init__(self, store: RecurrentState, slot: int) -> None:
        self.store = store
        self.slot = slot

    def layer(self, layer: int) -> _LayerSlot:
        return _LayerSlot(self.store, layer, self.slot)
