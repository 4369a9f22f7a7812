"""The seam between serving and compute: ``StageRuntime``, a few methods that build a
stage, run a chunk through it and turn token ids and logits into tensor frames.

Serving's orchestration (orders, streams, sessions) never touches torch; it asks a
``StageRuntime``. The one the agent uses is torch's (``torch_runtime.TorchRuntime``),
reached through ``TorchOnFirstUse`` so that importing the agent (and ``p2pswarm
--help``) does not import torch: it is imported by the first call, or ahead by
``warm_up`` on a worker thread beside startup.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from p2pswarm.agent.serving.records import StageOrder, WeightSource
    from p2pswarm.agent.weights import Manifest

log = logging.getLogger("p2pswarm.serving")


class LoadedStage(Protocol):
    """A stage built on its card, holding its sessions' KV caches."""

    @property
    def is_last(self) -> bool: ...

    @property
    def sessions(self) -> tuple[str, ...]: ...

    def allocated_bytes(self) -> int: ...

    def end_session(self, session: str) -> None: ...

    def keep_session(self, session: str) -> None: ...

    def resume_session(self, session: str, length: int) -> bool: ...

    def has_room(self, session: str) -> bool: ...

    def unload(self) -> None: ...


@dataclass(frozen=True, slots=True)
class Stepped:
    """What one chunk through a stage gave: hidden states for the next stage, or (on the
    last stage, at a step's final chunk) the token drawn; nothing for an earlier chunk."""

    frame: bytes = b""  # the tensor frame for the next stage
    token: int | None = None
    logits: bytes = b""  # the logits the token was drawn from, when kept
    forward_s: float = 0.0  # the forward pass alone
    tokens: int = 0  # positions the chunk ran through the stage


@dataclass(frozen=True, slots=True)
class BatchStep:
    """One session's decode step in a batch: its input frame (one token id or one row of
    hidden states), its position, and on a last stage its sampler."""

    session: str
    frame: bytes
    position: int
    sampler: Any | None
    keep_logits: bool


@dataclass(frozen=True, slots=True)
class AdapterPart:
    """This stage's part of a LoRA adapter, read once from its order's adapter block:
    the manifest of its tensors and the scale its ``B @ A`` is merged with."""

    manifest: Manifest
    scale: float  # alpha / rank
    local: bool  # this fellow offered the adapter: its tensors are read from its directory


@dataclass(frozen=True, slots=True)
class AdapterWeights:
    """An adapter part's tensors, read and verified by the runtime: opaque here (torch's
    tensors by name, for the torch runtime), handed back to its ``build``."""

    part: AdapterPart
    tensors: Any


class StageRuntime(Protocol):
    def build(self, order: StageOrder, source: WeightSource,
              adapter: AdapterWeights | None) -> LoadedStage:
        """The stage ``order`` asks for, built from ``source`` with ``adapter``'s tensors
        (by name, verified) merged in; PlacementError when the card cannot hold it."""

    def sampler(self, temperature: float, top_k: int, top_p: float, seed: int) -> Any:
        """A seeded sampler for one session at a last stage."""

    def step(self, stage: LoadedStage, session: str, frame: bytes, position: int,
             sampler: Any | None, keep_logits: bool) -> Stepped:
        """Run the chunk in ``frame`` (token ids or hidden states) at ``position``; a last
        stage given a ``sampler`` draws the next token."""

    def step_batch(self, stage: LoadedStage, steps: Sequence[BatchStep]) -> list[Stepped]:
        """One decode step of each of several sessions, in one forward pass; a result
        per step, in order (``forward_s`` is the whole batch's)."""

    def token_frame(self, ids: Sequence[int]) -> bytes:
        """Token ids as the tensor frame stage 0 takes."""

    def read_logits(self, frame: bytes) -> Any:
        """The logits a last stage kept, as a tensor."""

    def adapter_tensors(self, part: AdapterPart, cache: Any) -> AdapterWeights:
        """This stage's adapter tensors, read and verified against their SHA-256."""


class TorchOnFirstUse:
    """The torch runtime, imported on first use (see the module's comment)."""

    def __init__(self) -> None:
        self._real: StageRuntime | None = None

    def _runtime(self) -> StageRuntime:
        if self._real is None:
            module = importlib.import_module("p2pswarm.agent.serving.torch_runtime")
            self._real = module.TorchRuntime()
        return self._real

    def warm_up(self) -> None:
        """Import torch now (on a worker thread): a fellow that offers cards will likely
        host a stage, and importing torch takes seconds on a small machine."""
        try:
            self._runtime()
        except Exception:  # the load that needs it will say what is wrong
            log.debug("importing the runtime ahead failed", exc_info=True)

    def build(self, order: StageOrder, source: WeightSource,
              adapter: AdapterWeights | None) -> LoadedStage:
        return self._runtime().build(order, source, adapter)

    def sampler(self, temperature: float, top_k: int, top_p: float, seed: int) -> Any:
        return self._runtime().sampler(temperature, top_k, top_p, seed)

    def step(self, stage: LoadedStage, session: str, frame: bytes, position: int,
             sampler: Any | None, keep_logits: bool) -> Stepped:
        return self._runtime().step(stage, session, frame, position, sampler, keep_logits)

    def step_batch(self, stage: LoadedStage, steps: Sequence[BatchStep]) -> list[Stepped]:
        return self._runtime().step_batch(stage, steps)

    def token_frame(self, ids: Sequence[int]) -> bytes:
        return self._runtime().token_frame(ids)

    def read_logits(self, frame: bytes) -> Any:
        return self._runtime().read_logits(frame)

    def adapter_tensors(self, part: AdapterPart, cache: Any) -> AdapterWeights:
        return self._runtime().adapter_tensors(part, cache)


__all__ = ["AdapterPart", "AdapterWeights", "BatchStep", "LoadedStage", "StageRuntime", "Stepped",
           "TorchOnFirstUse"]
