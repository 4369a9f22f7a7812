"""The WiFi profiles do what they say: loss, bursts, delay and roaming outages.

Two levels. The long statistics run the very loss chain and delay draws MemoryNetwork
uses (``is_lost`` with its SplitMix generator, ``DelayModel.sample_s``) over millions of
steps, fast. The end-to-end check sends datagrams through a MemoryNetwork wired by the
harness from the profiles, under an autojump clock, and reads the network's own trace.
Bounds are stated per check; every run is seeded, so a pass is a pass every time.
"""

from __future__ import annotations

import itertools
import random

import pytest
import trio
import trio.testing

from p2pswarm.errors import ConfigError
from p2pswarm.sim.harness import ScenarioRun, variant_for
from p2pswarm.sim.metrics import percentile
from p2pswarm.sim.profiles import L20, W1, W2, W3, WIRED, delay_quantile_s, pareto_delay
from p2pswarm.sim.scenario import scenario_from_dict
from p2pswarm.transport.memory import DELIVERED, LOST_LINK, LOST_RADIO
from p2pswarm.transport.netmodel import LossState, SplitMixRng, is_lost


def chain_stats(profile, step_s: float, steps: int, seed: str = "t"):
    """Sample the radio every ``step_s``: loss fraction and the bad runs (seconds)."""
    state, rng, model = LossState(), SplitMixRng(seed, profile.name), profile.radio
    lost_n, runs, run = 0, [], 0
    t = 0.0
    for _ in range(steps):
        t += step_s
        if is_lost(state, model, rng, t):
            lost_n += 1
            run += 1
        elif run:
            runs.append(run * step_s)
            run = 0
    return lost_n / steps, runs


@pytest.mark.parametrize("profile, step_s, loss_bounds, burst_bounds", [
    # W1: 1% loss, exponential 20 ms bursts (sampled every 2 ms, so a run is
    # counted in 2 ms steps and bursts under 2 ms are missed: a few % high)
    (W1, 0.002, (0.009, 0.011), (0.018, 0.024)),
    # W2: 5% loss, exponential 100 ms bursts
    (W2, 0.010, (0.047, 0.053), (0.090, 0.115)),
])
def test_exponential_bursts_have_the_stated_loss_and_length(profile, step_s, loss_bounds,
                                                           burst_bounds) -> None:
    loss, runs = chain_stats(profile, step_s, 1_500_000)
    assert loss_bounds[0] <= loss <= loss_bounds[1]
    mean_burst = sum(runs) / len(runs)
    assert burst_bounds[0] <= mean_burst <= burst_bounds[1]
    # exponential dwell: about e^-2 of the bursts last over twice the mean
    over = sum(1 for r in runs if r > 2 * profile.radio.mean_burst_s) / len(runs)
    assert 0.09 <= over <= 0.18


def test_w3_is_twenty_percent_with_heavy_tailed_bursts_of_300_ms() -> None:
    # 1% background loss muddies runs: count runs of >= 2 lost samples 30 ms apart as
    # bursts (a background loss next to a burst lengthens it by a step at most)
    loss, runs = chain_stats(W3, 0.030, 1_500_000)
    assert 0.185 <= loss <= 0.215  # 20% (heavy tails converge slowly: +-1.5 points)
    bursts = [r for r in runs if r >= 0.06]
    mean_burst = sum(bursts) / len(bursts)
    assert 0.25 <= mean_burst <= 0.36  # 300 ms
    # Pareto with tail 1.5 and mean 0.3 s: minimum 0.1 s, P(> 1 s) = 0.1 ** 1.5 = 3.2%,
    # where an exponential with the same mean would give e^(-1/0.3) = 3.6%... and
    # P(> 3 s) = 0.6% against 0.0005%: the tail is what differs
    over_1s = sum(1 for r in bursts if r > 1.0) / len(bursts)
    over_3s = sum(1 for r in bursts if r > 3.0) / len(bursts)
    assert 0.02 <= over_1s <= 0.05
    assert 0.003 <= over_3s <= 0.012
    # and the background: outside bursts about 1 packet in 100 is lost
    lone = sum(1 for r in runs if r < 0.06)
    assert 0.006 <= lone / (1_500_000 * 0.8) <= 0.014


@pytest.mark.parametrize("profile, p50_s, p99_s", [
    (W1, 0.002, 0.010), (W2, 0.005, 0.050), (W3, 0.010, 0.100)])
def test_delays_have_the_stated_median_and_p99(profile, p50_s, p99_s) -> None:
    assert delay_quantile_s(profile.delay, 0.5) == pytest.approx(p50_s, rel=1e-6)
    assert delay_quantile_s(profile.delay, 0.99) == pytest.approx(p99_s, rel=1e-6)
    rng = SplitMixRng("delay", profile.name)
    samples = [profile.delay.sample_s(rng) for _ in range(200_000)]
    assert percentile(samples, 0.5) == pytest.approx(p50_s, rel=0.03)
    assert percentile(samples, 0.99) == pytest.approx(p99_s, rel=0.08)


def test_w2_delay_is_five_plus_minus_three_ms() -> None:
    # 5 +- 3 ms: the middle half of the delays lies within 2..8 ms, give or take a ms
    assert 0.002 <= delay_quantile_s(W2.delay, 0.25) <= 0.004
    assert 0.007 <= delay_quantile_s(W2.delay, 0.75) <= 0.009
    with pytest.raises(ConfigError):
        pareto_delay(0.005, 0.004, 0.01)


def test_w3_roams_off_the_network_for_2_to_10_s_every_10_minutes() -> None:
    outages = W3.outages(random.Random(3), 0.0, 86_400.0)
    assert 143 <= len(outages) <= 144
    lengths = [b - a for a, b in outages]
    assert min(lengths) >= 2.0 and max(lengths) <= 10.0
    assert 5.0 <= sum(lengths) / len(lengths) <= 7.0
    gaps = [b[0] - a[0] for a, b in itertools.pairwise(outages)]
    assert all(g == pytest.approx(600.0) for g in gaps)
    assert W1.outages(random.Random(3), 0.0, 86_400.0) == []
    assert WIRED.radio is None and W2.outages(random.Random(1), 0, 1e5) == []


async def test_profiles_wired_into_a_memory_network_lose_and_delay_as_defined(
        autojump_clock: trio.testing.MockClock) -> None:
    """End to end: the harness wires a W2 fellow, a W3 fellow, an L20 fellow and a wired
    sink; each sends to the sink every 20 ms for 300 virtual s. A short window: the
    bounds are wide (heavy-tailed W3 most), the long statistics above are the tight ones."""
    scenario = scenario_from_dict({
        "name": "wiring", "nodes": 4, "duration_s": 10,
        "fellows": [{"profile": "W2", "count": 1}, {"profile": "W3", "count": 1},
                    {"profile": "L20", "count": 1}, {"profile": "wired", "count": 1}]})
    run = ScenarioRun(scenario, variant_for(scenario, "ours"))
    net = run.net
    net.trace = []
    addrs = [f.addr for f in run.swarm.fellows]
    transports = [net.transport(a) for a in addrs]
    sink = addrs[3]

    async def drain() -> None:
        while True:
            await transports[3].receive_datagram()

    async with trio.open_nursery() as nursery:
        await nursery.start(net.run)
        nursery.start_soon(drain)
        for _ in range(15_000):
            for k in range(3):
                await transports[k].send_datagram(sink, b"x" * 40)
            await trio.sleep(0.020)
        await trio.sleep(1.0)
        nursery.cancel_scope.cancel()
    for k, prof, loss_bounds, outcome in (
            (0, W2, (0.035, 0.065), LOST_RADIO), (1, W3, (0.13, 0.29), LOST_RADIO),
            (2, L20, (0.185, 0.215), LOST_LINK)):
        records = [r for r in net.trace if r.src == addrs[k]]
        lost = sum(1 for r in records if r.outcome == outcome)
        assert loss_bounds[0] <= lost / len(records) <= loss_bounds[1], prof.name
        delays = [r.at_s - r.sent_at_s for r in records if r.outcome == DELIVERED]
        assert percentile(delays, 0.5) == pytest.approx(
            delay_quantile_s(prof.delay, 0.5), rel=0.06), prof.name
