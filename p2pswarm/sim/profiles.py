"""Radio profiles: how a fellow's link to the swarm behaves, wired or on WiFi.

A profile is a plain value: the fellow's radio (one loss model for everything the fellow
sends and hears, so a fade hits all of its traffic at once), the one-way delay of the
links it is on, and roaming outages (the fellow drops off the network entirely for a
few seconds, as when a laptop moves to another access point).

The WiFi profiles, as the harness defines them:

| profile | radio loss | bad-state dwell | delay (one way) | outages |
|---|---|---|---|---|
| ``wired`` | none | - | uniform 0.2-0.6 ms | none |
| ``W1`` | 1% | exponential, mean 20 ms | median 2 ms, p99 10 ms | none |
| ``W2`` | 5% | exponential, mean 100 ms | 5 +- 3 ms, p99 50 ms | none |
| ``W3`` | 20% | Pareto (tail 1.5), mean 300 ms | median 10 ms, p99 100 ms | 2-10 s every 10 min |
| ``bursty`` | as W3 | as W3 | as W3 | none |
| ``L20`` | 20% per packet on the link, independent | - | uniform 0.5-2 ms | none |

W2's delay: median 5, quartiles ~3 and ~8. W3's radio loss: 20% (1% outside bursts).

Loss is Gilbert-Elliott in time: the fraction of time in the bad state and the mean
length of a stay there are what the table gives; in the bad state every packet is lost,
in the good state ``loss_in_good`` of them. For W3 the bad fraction is chosen so that
the long-run loss is 20% including the 1% background: f + (1 - f) * 0.01 = 0.20.
Delays are a base plus a Lomax (shifted Pareto) tail, fitted to the median and p99.
A link between two fellows takes the delay of the worse of the two profiles (a wired
fellow talking to a W3 laptop sees the laptop's radio); loss applies at both radios.
Roaming outages come once per ``outage_every_s`` per fellow, at a random phase, each
lasting uniformly between ``outage_min_s`` and ``outage_max_s``.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from p2pswarm.errors import ConfigError
from p2pswarm.transport.memory import (
    DelayModel,
    GilbertElliott,
    LossModel,
    ParetoDelay,
    UniformDelay,
)


def pareto_delay(base_s: float, median_s: float, p99_s: float) -> ParetoDelay:
    """A ``ParetoDelay`` with the given minimum, median and 99th percentile."""
    if not base_s < median_s < p99_s:
        raise ConfigError("a delay needs base < median < p99")
    ratio = (p99_s - base_s) / (median_s - base_s)

    def spread(alpha: float) -> float:  # p99 extra over median extra, falls with alpha
        return float((100.0 ** (1.0 / alpha) - 1.0) / (2.0 ** (1.0 / alpha) - 1.0))

    lo, hi = 0.05, 200.0
    if not spread(hi) < ratio < spread(lo):
        raise ConfigError(f"no Pareto tail has p99/median extra ratio {ratio:.2f}")
    for _ in range(200):
        mid = math.sqrt(lo * hi)
        if spread(mid) > ratio:
            lo = mid
        else:
            hi = mid
    alpha = math.sqrt(lo * hi)
    scale_s = (median_s - base_s) / (2.0 ** (1.0 / alpha) - 1.0)
    return ParetoDelay(base_s=base_s, scale_s=scale_s, alpha=alpha)


def delay_quantile_s(delay: DelayModel, q: float) -> float:
    """The q-quantile of a delay model (Pareto and uniform; others: not needed here)."""
    if isinstance(delay, ParetoDelay):
        return float(delay.base_s + delay.scale_s * ((1.0 - q) ** (-1.0 / delay.alpha) - 1.0))
    if isinstance(delay, UniformDelay):
        return delay.min_s + q * (delay.max_s - delay.min_s)
    raise ConfigError(f"no quantile for {type(delay).__name__}")


@dataclass(frozen=True, slots=True)
class Profile:
    name: str
    radio: LossModel | None  # None: a wire, no radio loss
    delay: DelayModel
    rank: int  # links take the delay of the higher-ranked end
    link_loss: float = 0.0  # independent loss per packet on the links, beside the radio
    outage_every_s: float = 0.0  # 0: no roaming outages
    outage_min_s: float = 0.0
    outage_max_s: float = 0.0
    description: str = ""

    @property
    def mean_loss(self) -> float:
        """The radio's long-run loss (each packet crosses the radios at both ends)."""
        if self.radio is None:
            return 0.0
        if isinstance(self.radio, GilbertElliott):
            return self.radio.mean_loss
        return self.radio.loss

    def outages(self, rng: random.Random, start_s: float, end_s: float
                ) -> list[tuple[float, float]]:
        """(begin, end) of this fellow's roaming outages in [start_s, end_s)."""
        if self.outage_every_s <= 0.0:
            return []
        out = []
        t = start_s + rng.uniform(0.0, self.outage_every_s)
        while t < end_s:
            length = rng.uniform(self.outage_min_s, self.outage_max_s)
            out.append((t, t + length))
            t += self.outage_every_s
        return out

    def to_dict(self) -> dict[str, object]:
        radio: dict[str, object] | None = None
        if isinstance(self.radio, GilbertElliott):
            r = self.radio
            radio = {"model": "gilbert-elliott", "bad_fraction": round(r.bad_fraction, 5),
                     "mean_burst_s": r.mean_burst_s, "loss_in_good": r.loss_in_good,
                     "loss_in_bad": r.loss_in_bad, "burst_shape": r.burst_shape,
                     "burst_tail": r.burst_tail, "mean_loss": round(r.mean_loss, 5)}
        return {
            "name": self.name, "description": self.description, "radio": radio,
            "delay_p50_ms": round(delay_quantile_s(self.delay, 0.5) * 1e3, 3),
            "delay_p99_ms": round(delay_quantile_s(self.delay, 0.99) * 1e3, 3),
            "link_loss": self.link_loss,
            "outage_every_s": self.outage_every_s,
            "outage_s": [self.outage_min_s, self.outage_max_s],
        }


W3_BACKGROUND_LOSS = 0.01
W3_LOSS = 0.20

WIRED = Profile("wired", None, UniformDelay(0.0002, 0.0006), rank=0,
                description="switched Ethernet")
W1 = Profile("W1", GilbertElliott(bad_fraction=0.01, mean_burst_s=0.020),
             pareto_delay(0.001, 0.002, 0.010), rank=1,
             description="good WiFi: 1% loss in 20 ms bursts")
W2 = Profile("W2", GilbertElliott(bad_fraction=0.05, mean_burst_s=0.100),
             pareto_delay(0.002, 0.005, 0.050), rank=2,
             description="busy WiFi: 5% loss in 100 ms bursts, 5 +- 3 ms, p99 50 ms")
W3 = Profile("W3", GilbertElliott(
                 bad_fraction=(W3_LOSS - W3_BACKGROUND_LOSS) / (1.0 - W3_BACKGROUND_LOSS),
                 mean_burst_s=0.300, loss_in_good=W3_BACKGROUND_LOSS, loss_in_bad=1.0,
                 burst_shape="pareto", burst_tail=1.5),
             pareto_delay(0.003, 0.010, 0.100), rank=3,
             outage_every_s=600.0, outage_min_s=2.0, outage_max_s=10.0,
             description="bad WiFi: 20% loss, heavy-tailed 300 ms bursts, 1% background, "
                         "a 2-10 s roaming outage every 10 minutes")

BURSTY = Profile("bursty", W3.radio, W3.delay, rank=3,
                 description="W3's radio without roaming outages: 1% loss plus Pareto bursts "
                             "of total loss (mean 300 ms, tail 1.5) about 19% of the time")

L20 = Profile("L20", None, UniformDelay(0.0005, 0.002), rank=1, link_loss=0.20,
              description="independent 20% loss on every packet (no bursts)")

PROFILES: dict[str, Profile] = {p.name: p for p in (WIRED, W1, W2, W3, BURSTY, L20)}


def profile(name: str) -> Profile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ConfigError(f"unknown profile {name!r}: use one of "
                          f"{', '.join(PROFILES)}") from None


def link_delay(a: Profile, b: Profile) -> DelayModel:
    """The delay of a link between fellows with profiles ``a`` and ``b``."""
    return (a if a.rank >= b.rank else b).delay


def link_loss(a: Profile, b: Profile) -> float:
    return max(a.link_loss, b.link_loss)


__all__ = [
    "BURSTY",
    "L20",
    "PROFILES",
    "W1",
    "W2",
    "W3",
    "WIRED",
    "Profile",
    "delay_quantile_s",
    "link_delay",
    "link_loss",
    "pareto_delay",
    "profile",
]
