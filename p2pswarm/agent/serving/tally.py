"""What this fellow's generations produced: tokens per load and times to first token.

Plain counts kept where a token arrives (``Generation``), read by ``/metrics`` and the
dashboard, which turn them into rates between two looks. Bounded: one entry per load
this fellow generated from, the oldest dropped past ``LOADS_KEPT``.
"""

from __future__ import annotations

from collections import OrderedDict

LOADS_KEPT = 64


class GenerationTally:
    __slots__ = ("first_token_s_sum", "first_tokens", "tokens")

    def __init__(self) -> None:
        self.tokens: OrderedDict[str, int] = OrderedDict()  # plan_id -> tokens generated
        self.first_tokens = 0  # generations (and resumes) that produced a first token
        self.first_token_s_sum = 0.0

    def first_token(self, took_s: float) -> None:
        self.first_tokens += 1
        self.first_token_s_sum += max(0.0, took_s)

    def token(self, plan_id: str) -> None:
        self.tokens[plan_id] = self.tokens.get(plan_id, 0) + 1
        self.tokens.move_to_end(plan_id)
        while len(self.tokens) > LOADS_KEPT:
            self.tokens.popitem(last=False)

    @property
    def total_tokens(self) -> int:
        return sum(self.tokens.values())


__all__ = ["LOADS_KEPT", "GenerationTally"]
