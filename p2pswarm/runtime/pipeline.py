"""Stages chained in one process: the reference the swarm's pipeline must equal.

The network driver does the same walk across fellows: prompt ids into stage 0, hidden
states from stage to stage, logits out of the last, sample, and the token back to stage 0.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from p2pswarm.errors import ConfigError, PlacementError
from p2pswarm.runtime.sampler import Sampler
from p2pswarm.runtime.stage import Stage, StageInput
from p2pswarm.shapes.model_config import UNBOUNDED_CONTEXT_TOKENS


@dataclass(frozen=True, slots=True)
class Generation:
    token_ids: tuple[int, ...]  # generated tokens, prompt excluded
    logits: tuple[torch.Tensor, ...]  # (vocab,) float32 each token was drawn from, if kept
    stop_reason: str  # "stop_token" | "max_tokens"
    prefill_s: float
    decode_s: float
    stage_s: tuple[float, ...]  # time inside each stage, prefill and decode together

    @property
    def decode_tokens_per_s(self) -> float:
        steps = len(self.token_ids) - 1  # the first token comes out of the prefill
        return steps / self.decode_s if steps > 0 and self.decode_s > 0 else 0.0


class LocalPipeline:
    def __init__(self, stages: Sequence[Stage]) -> None:
        if not stages:
            raise ConfigError("a pipeline needs at least one stage")
        if not stages[0].is_first or not stages[-1].is_last:
            raise ConfigError("a pipeline must start at layer 0 and end at the last layer")
        for before, after in itertools.pairwise(stages):
            if before.end_layer != after.start_layer or before.config != after.config:
                raise ConfigError(
                    f"stages [{before.start_layer}, {before.end_layer}) and "
                    f"[{after.start_layer}, {after.end_layer}) do not chain")
        self.stages = tuple(stages)
        self._stage_s = [0.0] * len(stages)

    def forward(self, session: str, inputs: StageInput, *, all_logits: bool = False,
                decode: bool = False) -> torch.Tensor:
        """Token ids through every stage; the last stage's logits."""
        x: StageInput = inputs
        for i, stage in enumerate(self.stages):
            began = time.perf_counter()
            if decode:
                x = stage.decode(session, x)
            else:
                x = stage.prefill(session, x, all_logits=all_logits)
            self._stage_s[i] += time.perf_counter() - began
        assert isinstance(x, torch.Tensor)
        return x

    def end_session(self, session: str) -> None:
        for stage in self.stages:
            stage.end_session(session)

    def generate(self, prompt_ids: Sequence[int], max_tokens: int, sampler: Sampler, *,
                 session: str = "local", stop_token_ids: Sequence[int] | None = None,
                 keep_logits: bool = False,
                 on_token: Callable[[int], None] | None = None) -> Generation:
        """Up to ``max_tokens`` new tokens after ``prompt_ids``; stops early on a stop token
        (by default the model's eos ids). ``on_token`` sees each token as it comes."""
        if not prompt_ids:
            raise ConfigError("the prompt is empty")
        if max_tokens <= 0:
            raise ConfigError("max_tokens must be positive")
        context = min(stage.spec.max_context_tokens for stage in self.stages)
        if self.stages[0].config.recurrent:  # the state does not grow: no context to fill
            context = UNBOUNDED_CONTEXT_TOKENS
        if len(prompt_ids) + max_tokens - 1 > context:
            raise PlacementError(
                f"{len(prompt_ids)} prompt tokens and {max_tokens} new ones exceed the "
                f"pipeline's context of {context} tokens")
        stops = set(self.stages[0].config.eos_token_ids if stop_token_ids is None
                    else stop_token_ids)
        self._stage_s = [0.0] * len(self.stages)
        tokens: list[int] = []
        kept: list[torch.Tensor] = []
        stop_reason = "max_tokens"
        try:
            began = time.perf_counter()
            logits = self.forward(session, list(prompt_ids))
            prefill_s = time.perf_counter() - began
            began = time.perf_counter()
            while True:
                token = sampler.sample(logits[-1], len(prompt_ids) + len(tokens))
                tokens.append(token)
                if keep_logits:
                    kept.append(logits[-1].clone())
                if on_token is not None:
                    on_token(token)
                if token in stops:
                    stop_reason = "stop_token"
                    break
                if len(tokens) == max_tokens:
                    break
                logits = self.forward(session, [token], decode=True)
            decode_s = time.perf_counter() - began
        finally:
            self.end_session(session)
        return Generation(tuple(tokens), tuple(kept), stop_reason, prefill_s, decode_s,
                          tuple(self._stage_s))
