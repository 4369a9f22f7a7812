"""The network model: delays, losses, links and TCP's retransmission timer, as values.

Theory of operation. Everything here is pure: no trio, no clock, no global ``random``.
Time comes in as ``now`` (seconds) and randomness as a generator passed in that makes the
few draws of ``Draws``: the SplitMix64 ``SplitMixRng`` (eight bytes of state, seeded from names:
MemoryNetwork has one per link and per radio), or GossipLab's seeded ``random.Random``
with those draws added (``p2pswarm.sim.gossip_lab.RandomDraws``). Both worlds that
simulate a network, ``MemoryNetwork`` (trio, virtual time) and ``GossipLab`` (the pure
machines on one heap), decide a packet's fate with these models, so they share one
definition of each.

- Delay models (``FixedDelay``, ``UniformDelay``, ``LognormalDelay``, ``ParetoDelay``):
  ``sample_s(rng)`` is one packet's one-way delay.
- Loss models (``Bernoulli``, ``GilbertElliott``) are values; where a loss chain stands is
  state kept beside them, in one of two forms. ``LossState`` with ``is_lost`` advances a
  continuous-time Gilbert-Elliott chain lazily to the instant a packet is sent (one draw
  for an hour of silence); ``FadeTimeline`` draws the same chain ahead as switch times,
  so one can also ask how long the radio was bad around a moment (``longest_outage_s``).
  Both draw each stay with ``GilbertElliott.stay_s``.
- ``LinkModel``: how one directed link treats packets (delay, loss, duplication,
  reordering, bandwidth).
- ``Retransmission``: TCP's retransmission timer. A lost segment is sent again after
  the timer, which doubles up to a cap; ``attempts`` lists when a packet is sent (the
  first time and each retry) until a give-up time, and ``first_arrival`` says when the
  first copy that gets through arrives. The constants are Linux's: ``RTO_MIN_S`` (200 ms)
  for data, ``RTO_SYN_S`` (1 s, RFC 6298's initial timer) for handshake packets, doubling,
  capped at ``RTO_MAX_S`` (60 s).
"""

from __future__ import annotations

import hashlib
import math
from bisect import bisect_right
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Literal, Protocol

from p2pswarm.errors import ConfigError

_MASK64 = (1 << 64) - 1
_TWO_PI = 2.0 * math.pi
_INF = math.inf
RTO_MIN_S = 0.2  # Linux's minimum retransmission timeout: a lost frame goes again then
RTO_SYN_S = 1.0  # ... and a lost handshake packet after this (RFC 6298's initial RTO)
RTO_MAX_S = 60.0  # the timer doubles up to this


class Draws(Protocol):
    """The few draws the models make; ``SplitMixRng`` and gossip_lab's ``RandomDraws`` make them."""

    def random(self) -> float: ...

    def chance(self, probability: float) -> bool: ...

    def exponential(self, mean: float) -> float: ...

    def normal(self) -> float: ...

    def pareto(self, alpha: float) -> float: ...


class SplitMixRng:
    """SplitMix64 with the few distributions the models need."""

    __slots__ = ("_state",)

    def __init__(self, *names: object) -> None:
        key = "\x1f".join(str(name) for name in names).encode()
        self._state = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big")

    def random(self) -> float:
        """Uniform on [0, 1)."""
        self._state = z = (self._state + 0x9E3779B97F4A7C15) & _MASK64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        return ((z ^ (z >> 31)) >> 11) * (1.0 / 9007199254740992.0)

    def chance(self, probability: float) -> bool:
        # No draw for 0 and 1: certain outcomes stay independent of the generator.
        if probability <= 0.0:
            return False
        return probability >= 1.0 or self.random() < probability

    def exponential(self, mean: float) -> float:
        return -mean * math.log(1.0 - self.random())

    def normal(self) -> float:
        radius = math.sqrt(-2.0 * math.log(1.0 - self.random()))
        return radius * math.cos(_TWO_PI * self.random())

    def pareto(self, alpha: float) -> float:
        """Pareto with minimum 1 and tail index ``alpha``."""
        return math.pow(1.0 - self.random(), -1.0 / alpha)


def _check_probability(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ConfigError(f"{name} must be a probability in [0, 1], not {value}")


def _check_non_negative(name: str, value: float) -> None:
    if not value >= 0.0 or math.isinf(value):
        raise ConfigError(f"{name} must be a finite number >= 0, not {value}")


# --- delay models ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FixedDelay:
    """Every packet takes exactly ``delay_s``."""

    delay_s: float = 0.001

    def __post_init__(self) -> None:
        _check_non_negative("delay_s", self.delay_s)

    def sample_s(self, rng: Draws) -> float:
        return self.delay_s


@dataclass(frozen=True, slots=True)
class UniformDelay:
    """Uniform jitter: a delay between ``min_s`` and ``max_s``."""

    min_s: float
    max_s: float

    def __post_init__(self) -> None:
        _check_non_negative("min_s", self.min_s)
        if not self.max_s >= self.min_s:
            raise ConfigError(f"max_s ({self.max_s}) must be >= min_s ({self.min_s})")

    def sample_s(self, rng: Draws) -> float:
        return self.min_s + (self.max_s - self.min_s) * rng.random()


@dataclass(frozen=True, slots=True)
class LognormalDelay:
    """``base_s`` plus a lognormal extra with median ``median_extra_s``: a WiFi-like tail.

    Quantile q is ``base_s + median_extra_s * exp(sigma * z_q)`` (z_q: normal quantile).
    """

    base_s: float
    median_extra_s: float
    sigma: float = 1.0

    def __post_init__(self) -> None:
        _check_non_negative("base_s", self.base_s)
        _check_non_negative("median_extra_s", self.median_extra_s)
        _check_non_negative("sigma", self.sigma)

    def sample_s(self, rng: Draws) -> float:
        return self.base_s + self.median_extra_s * math.exp(self.sigma * rng.normal())


@dataclass(frozen=True, slots=True)
class ParetoDelay:
    """``base_s`` plus a Lomax (shifted Pareto) extra: rare, very late packets.

    Quantile q is ``base_s + scale_s * ((1 - q) ** (-1 / alpha) - 1)``; the mean is finite
    for ``alpha > 1``.
    """

    base_s: float
    scale_s: float
    alpha: float = 2.0

    def __post_init__(self) -> None:
        _check_non_negative("base_s", self.base_s)
        _check_non_negative("scale_s", self.scale_s)
        if not self.alpha > 0.0:
            raise ConfigError(f"alpha must be > 0, not {self.alpha}")

    def sample_s(self, rng: Draws) -> float:
        return self.base_s + self.scale_s * (rng.pareto(self.alpha) - 1.0)


DelayModel = FixedDelay | UniformDelay | LognormalDelay | ParetoDelay


# --- loss models -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Bernoulli:
    """Each packet is lost independently with probability ``loss``."""

    loss: float

    def __post_init__(self) -> None:
        _check_probability("loss", self.loss)


BurstShape = Literal["exponential", "pareto", "lognormal"]


@dataclass(frozen=True, slots=True)
class GilbertElliott:
    """Bursty loss: a good and a bad state, with times (not packet counts) in each.

    ``bad_fraction`` is the long-run fraction of time spent in the bad state and
    ``mean_burst_s`` the mean time of one stay there; the mean time between bursts
    follows (``mean_gap_s``) and is exponential. A packet is lost with ``loss_in_bad``
    in the bad state and ``loss_in_good`` in the good one, so with the defaults (1 and 0)
    the packet loss rate equals ``bad_fraction``. ``burst_shape`` makes bursts heavy
    tailed with the same mean: ``"pareto"`` with tail index ``burst_tail`` (> 1), or
    ``"lognormal"`` with sigma ``burst_tail``.
    """

    bad_fraction: float
    mean_burst_s: float
    loss_in_good: float = 0.0
    loss_in_bad: float = 1.0
    burst_shape: BurstShape = "exponential"
    burst_tail: float = 1.5

    def __post_init__(self) -> None:
        _check_probability("bad_fraction", self.bad_fraction)
        _check_probability("loss_in_good", self.loss_in_good)
        _check_probability("loss_in_bad", self.loss_in_bad)
        if not self.mean_burst_s > 0.0 or math.isinf(self.mean_burst_s):
            raise ConfigError(f"mean_burst_s must be > 0, not {self.mean_burst_s}")
        if self.burst_shape not in ("exponential", "pareto", "lognormal"):
            raise ConfigError(f"burst_shape must be exponential, pareto or lognormal, "
                              f"not {self.burst_shape!r}")
        if self.burst_shape == "pareto" and not self.burst_tail > 1.0:
            raise ConfigError(f"a pareto burst_tail must be > 1 (finite mean), "
                              f"not {self.burst_tail}")
        if self.burst_shape == "lognormal":
            _check_non_negative("burst_tail", self.burst_tail)

    @property
    def mean_gap_s(self) -> float:
        """Mean time in the good state between two bursts."""
        if self.bad_fraction <= 0.0:
            return math.inf
        return self.mean_burst_s * (1.0 - self.bad_fraction) / self.bad_fraction

    @property
    def mean_loss(self) -> float:
        """The long-run packet loss rate (for packets sent independently of the state)."""
        f = self.bad_fraction
        return f * self.loss_in_bad + (1.0 - f) * self.loss_in_good

    def stay_s(self, bad: bool, rng: Draws) -> float:
        """One stay drawn whole: a burst (bad) or the gap between two (good)."""
        if bad:
            return self._burst_s(rng)
        gap = self.mean_gap_s
        return _INF if gap == _INF else rng.exponential(gap)

    def _burst_s(self, rng: Draws) -> float:
        mean = self.mean_burst_s
        if self.burst_shape == "pareto":
            return mean * (self.burst_tail - 1.0) / self.burst_tail * rng.pareto(self.burst_tail)
        if self.burst_shape == "lognormal":
            sigma = self.burst_tail
            return mean * math.exp(sigma * rng.normal() - 0.5 * sigma * sigma)
        return rng.exponential(mean)


LossModel = Bernoulli | GilbertElliott


@dataclass(frozen=True, slots=True)
class LinkModel:
    """How one directed link treats packets. The default is a clean 1 ms wire.

    ``reorder_probability``: the fraction of datagrams held back by an extra
    ``reorder_extra_s``, so later ones overtake them. ``duplicate_probability``: the
    fraction delivered twice, the copy with its own delay. ``bandwidth_bytes_per_s``:
    packets and frames queue behind each other for ``size / bandwidth``; None: no limit.
    Streams see the same loss, as retransmissions (``Retransmission``).
    """

    delay: DelayModel = field(default_factory=FixedDelay)
    loss: LossModel | None = None
    duplicate_probability: float = 0.0
    reorder_probability: float = 0.0
    reorder_extra_s: float = 0.005
    bandwidth_bytes_per_s: float | None = None

    def __post_init__(self) -> None:
        _check_probability("duplicate_probability", self.duplicate_probability)
        _check_probability("reorder_probability", self.reorder_probability)
        _check_non_negative("reorder_extra_s", self.reorder_extra_s)
        if self.bandwidth_bytes_per_s is not None and not self.bandwidth_bytes_per_s > 0:
            raise ConfigError(f"bandwidth_bytes_per_s must be > 0 or None, "
                              f"not {self.bandwidth_bytes_per_s}")


# --- state behind the models -------------------------------------------------------------


class LossState:
    """Where a loss chain stands; shared shape for links and radios."""

    __slots__ = ("bad", "chain_model", "on_bad_stay", "until_s")

    def __init__(self) -> None:
        self.chain_model: LossModel | None = None
        self.bad = False
        self.until_s = math.nan  # the current stay ends then; nan: not started
        self.on_bad_stay: Callable[[float, float], None] | None = None  # (start, end)


def is_lost(state: LossState, model: LossModel, rng: Draws, now: float) -> bool:
    """Does a packet sent at ``now`` fall to ``model``? Advances the chain to ``now``."""
    if isinstance(model, Bernoulli):
        return rng.chance(model.loss)
    f = model.bad_fraction
    if state.chain_model is not model:
        state.chain_model = model
        state.until_s = math.nan
    if f <= 0.0:
        bad = False
    elif f >= 1.0:
        bad = True
    elif math.isnan(state.until_s):
        # Start in the stationary law. A heavy-tailed stay is drawn whole, not as the
        # residual of a stay in progress: close enough for a start.
        bad = state.bad = rng.random() < f
        state.until_s = now + model.stay_s(bad, rng)
        if bad and state.on_bad_stay is not None:
            state.on_bad_stay(now, state.until_s)
    elif now < state.until_s:
        bad = state.bad
    elif model.burst_shape == "exponential":
        # The stay that ended at until_s flipped the state; from there the chain is
        # Markov, so draw the state at `now` from its transition law, then a fresh stay.
        flipped_bad = not state.bad
        rate = 1.0 / model.mean_burst_s + 1.0 / model.mean_gap_s
        p_bad = f + (float(flipped_bad) - f) * math.exp(-rate * (now - state.until_s))
        bad = state.bad = rng.random() < p_bad
        state.until_s = now + (rng.exponential(model.mean_burst_s) if bad
                               else rng.exponential(model.mean_gap_s))
        if bad and state.on_bad_stay is not None:
            state.on_bad_stay(now, state.until_s)
    else:
        while now >= state.until_s:
            state.bad = not state.bad
            start = state.until_s
            state.until_s += model.stay_s(state.bad, rng)
            if state.bad and state.on_bad_stay is not None:
                state.on_bad_stay(start, state.until_s)
        bad = state.bad
    return rng.chance(model.loss_in_bad if bad else model.loss_in_good)




class FadeTimeline:
    """A Gilbert-Elliott radio in continuous time, drawn ahead as switch times.

    The same chain as ``is_lost`` advances lazily, kept as the list of instants it flips,
    so a verdict can be judged against the radio's past (``bad_runs``,
    ``longest_outage_s``). Asked about a later time, it draws the stays up to it."""

    __slots__ = ("_bad0", "_flips", "_horizon", "model", "rng")

    def __init__(self, model: GilbertElliott, rng: Draws) -> None:
        self.model = model
        self.rng = rng
        self._bad0 = rng.random() < model.bad_fraction  # state before the first flip
        self._flips: list[float] = []
        self._horizon = 0.0
        self._extend(0.0, self._bad0)

    def _extend(self, t: float, bad: bool) -> None:
        self._horizon = t + self.model.stay_s(bad, self.rng)
        self._flips.append(self._horizon)

    def _state_after_last(self) -> bool:
        return self._bad0 ^ (len(self._flips) % 2 == 1)

    def bad_at(self, t: float) -> bool:
        while self._horizon <= t and self._horizon < _INF:
            self._extend(self._horizon, self._state_after_last())
        return self._bad0 ^ (bisect_right(self._flips, t) % 2 == 1)

    def lost_at(self, t: float) -> bool:
        """Does a packet crossing this radio at ``t`` fall to it?"""
        m = self.model
        return self.rng.chance(m.loss_in_bad if self.bad_at(t) else m.loss_in_good)

    def prune(self, before: float) -> None:
        """Forget most switches before ``before`` (keeps memory bounded on long runs)."""
        i = bisect_right(self._flips, before)
        if i > 4096:
            drop = i - 1024
            self._bad0 ^= drop % 2 == 1
            del self._flips[:drop]

    def bad_runs(self, t0: float, t1: float) -> list[tuple[float, float]]:
        """The fades overlapping [t0, t1], clipped to it."""
        self.bad_at(t1)
        runs: list[tuple[float, float]] = []
        i = bisect_right(self._flips, t0)
        bad = self._bad0 ^ (i % 2 == 1)
        start = t0
        while True:
            end = self._flips[i] if i < len(self._flips) else _INF
            if bad:
                runs.append((start, min(end, t1)))
            if end >= t1:
                break
            start, bad, i = end, not bad, i + 1
        return runs

    def longest_outage_s(self, t0: float, t1: float, merge_gap_s: float = 0.0) -> float:
        """The longest fade in [t0, t1]; fades separated by less than ``merge_gap_s`` of
        good radio count as one."""
        best = 0.0
        cur: tuple[float, float] | None = None
        for a, b in self.bad_runs(t0, t1):
            if cur is not None and a - cur[1] < merge_gap_s:
                cur = (cur[0], b)
            else:
                cur = (a, b)
            best = max(best, cur[1] - cur[0])
        return best


# --- retransmission ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Retransmission:
    """TCP's retransmission timer: a lost packet goes again after ``first_rto_s``, then
    after twice that, and so on, the timer capped at ``max_rto_s``."""

    first_rto_s: float = RTO_MIN_S
    max_rto_s: float = RTO_MAX_S

    def __post_init__(self) -> None:
        if not 0.0 < self.first_rto_s <= self.max_rto_s or math.isinf(self.max_rto_s):
            raise ConfigError(f"a retransmission timer needs 0 < first_rto_s "
                              f"({self.first_rto_s}) <= max_rto_s ({self.max_rto_s}), finite")

    def next_rto_s(self, rto_s: float) -> float:
        """The timer after one that ran out: doubled, capped."""
        return min(2.0 * rto_s, self.max_rto_s)

    def retry(self, lost_at_s: float, rto_s: float,
              give_up_at_s: float = _INF) -> tuple[float, float] | None:
        """A packet sent at ``lost_at_s`` under timer ``rto_s`` was lost: (when it goes
        again, the timer then), or None if that would be at or after ``give_up_at_s``."""
        again_at = lost_at_s + rto_s
        if again_at >= give_up_at_s:
            return None
        return again_at, self.next_rto_s(rto_s)

    def attempts(self, sent_at_s: float, give_up_at_s: float = _INF) -> Iterator[float]:
        """When a packet first sent at ``sent_at_s`` is sent, each time it is lost: the
        first send and each retry, all before ``give_up_at_s``."""
        t, rto = sent_at_s, self.first_rto_s
        if t >= give_up_at_s:
            return
        while True:
            yield t
            nxt = self.retry(t, rto, give_up_at_s)
            if nxt is None:
                return
            t, rto = nxt

    def first_arrival(self, sent_at_s: float, give_up_at_s: float,
                      attempt: Callable[[float], float | None]) -> float | None:
        """When the first copy that gets through arrives: ``attempt(t)`` sends one copy
        at ``t`` and returns its arrival, or None if it is lost. None: every copy sent
        before ``give_up_at_s`` was lost."""
        for t in self.attempts(sent_at_s, give_up_at_s):
            arrives = attempt(t)
            if arrives is not None:
                return arrives
        return None


DATA_RETRANSMISSION = Retransmission(RTO_MIN_S)
HANDSHAKE_RETRANSMISSION = Retransmission(RTO_SYN_S)


__all__ = [
    "DATA_RETRANSMISSION",
    "HANDSHAKE_RETRANSMISSION",
    "RTO_MAX_S",
    "RTO_MIN_S",
    "RTO_SYN_S",
    "Bernoulli",
    "BurstShape",
    "DelayModel",
    "Draws",
    "FadeTimeline",
    "FixedDelay",
    "GilbertElliott",
    "LinkModel",
    "LognormalDelay",
    "LossModel",
    "ParetoDelay",
    "Retransmission",
    "UniformDelay",
]
