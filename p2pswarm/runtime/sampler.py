"""Pick the next token from logits: greedy, or temperature with top-k and top-p, seeded.

The draw is an explicit inverse-CDF lookup with a uniform number from a seeded CPU
``torch.Generator``, done in float64 on the CPU: the same seed gives the same tokens
whatever card produced the logits.

Given the position the drawn token will take, the uniform number comes from the seed
and that position alone, not from how many draws came before: a session resumed on a
healed route (its tokens replayed as a prompt), or continued from a kept cache, draws
at each position what the undisturbed run drew there.
"""

from __future__ import annotations

import torch

from p2pswarm.errors import ConfigError


class Sampler:
    """``temperature == 0`` is greedy (lowest id among equal maxima); ``top_k == 0`` and
    ``top_p == 1`` switch those filters off."""

    def __init__(self, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 seed: int = 0) -> None:
        if temperature < 0:
            raise ConfigError(f"temperature must be >= 0, got {temperature}")
        if top_k < 0:
            raise ConfigError(f"top_k must be >= 0, got {top_k}")
        if not 0 < top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {top_p}")
        self.temperature = temperature
        self.top_k = top_k
        self.top_p = top_p
        self.seed = seed
        self._generator = torch.Generator(device="cpu").manual_seed(seed)
        self._at_position = torch.Generator(device="cpu")

    @classmethod
    def greedy(cls) -> Sampler:
        return cls()

    def reset(self) -> None:
        """Start the random sequence over, as a fresh sampler with this seed would."""
        self._generator.manual_seed(self.seed)

    def sample(self, logits: torch.Tensor, position: int | None = None) -> int:
        """One token id from logits of shape (vocab,) or (1, vocab); with ``position``
        (where the drawn token goes in the sequence) its draw depends on the seed and
        that position only, else on the draws before it."""
        if logits.dim() > 2 or (logits.dim() == 2 and logits.shape[0] != 1):
            raise ValueError(f"sample takes one row of logits, got {tuple(logits.shape)}")
        logits = logits.detach().reshape(-1).to(device="cpu", dtype=torch.float64)
        if self.temperature == 0:
            return int(torch.argmax(logits))
        logits = logits / self.temperature
        if 0 < self.top_k < logits.numel():
            kth = torch.topk(logits, self.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=0)
        if self.top_p < 1:
            sorted_probs, order = torch.sort(probs, descending=True, stable=True)
            # keep the smallest prefix whose mass reaches top_p (always the first token)
            before = torch.cumsum(sorted_probs, dim=0) - sorted_probs
            sorted_probs = sorted_probs.masked_fill(before >= self.top_p, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        cdf = torch.cumsum(probs, dim=0)
        generator = self._generator
        if position is not None:
            generator = self._at_position
            generator.manual_seed(position_seed(self.seed, position))
        u = torch.rand((), generator=generator, dtype=torch.float64) * cdf[-1]
        index = int(torch.searchsorted(cdf, u, right=True))
        return min(index, probs.numel() - 1)


_MASK64 = (1 << 64) - 1


def _mix64(z: int) -> int:
    """splitmix64's finaliser: nearby inputs give unrelated 64-bit outputs."""
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def position_seed(seed: int, position: int) -> int:
    """The generator seed of the draw at ``position`` of a session seeded ``seed``."""
    if position < 0:
        raise ValueError(f"a position is never negative, got {position}")
    return _mix64(_mix64(seed & _MASK64) ^ (position & _MASK64)) >> 1
