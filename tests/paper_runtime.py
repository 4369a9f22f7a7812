"""A stage runtime that builds no tensors: each stage "allocates" exactly its claim. For
tests of placement and pins, where building a model would only cost seconds."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from p2pswarm.agent.serving.runtime import AdapterPart, AdapterWeights, Stepped


class PaperStage:
    def __init__(self, claim_bytes: int, is_last: bool) -> None:
        self._claim_bytes = claim_bytes
        self._is_last = is_last
        self.unloaded = False

    @property
    def is_last(self) -> bool:
        return self._is_last

    @property
    def sessions(self) -> tuple[str, ...]:
        return ()

    def allocated_bytes(self) -> int:
        return 0 if self.unloaded else self._claim_bytes

    def end_session(self, session: str) -> None:
        pass

    def unload(self) -> None:
        self.unloaded = True


class PaperRuntime:
    """Builds ``PaperStage``s; running one is not what it is for."""

    def __init__(self) -> None:
        self.built: list[PaperStage] = []

    def build(self, order: Any, source: Any, adapter: AdapterWeights | None) -> PaperStage:
        stage = PaperStage(order.claim_bytes, order.stage == order.n_stages - 1)
        self.built.append(stage)
        return stage

    def sampler(self, temperature: float, top_k: int, top_p: float, seed: int) -> Any:
        raise NotImplementedError("a paper stage runs nothing")

    def step(self, stage: Any, session: str, frame: bytes, position: int,
             sampler: Any | None, keep_logits: bool) -> Stepped:
        raise NotImplementedError("a paper stage runs nothing")

    def token_frame(self, ids: Sequence[int]) -> bytes:
        raise NotImplementedError("a paper stage runs nothing")

    def read_logits(self, frame: bytes) -> Any:
        raise NotImplementedError("a paper stage runs nothing")

    def adapter_tensors(self, part: AdapterPart, cache: Any) -> AdapterWeights:
        return AdapterWeights(part, {})
