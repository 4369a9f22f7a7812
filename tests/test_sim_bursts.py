"""Bursts of total loss drawn ahead for the namespace world: seeded, the profile's share
of time and mean length; the nft rules that carry them (a namespace only as root)."""

from __future__ import annotations

import subprocess
import time
from dataclasses import replace
from pathlib import Path

import pytest

from p2pswarm.sim.bursts import burst_schedule, replayable, time_in_bursts
from p2pswarm.sim.profiles import BURSTY, L20, W1, W3, profile
from p2pswarm.sim.scenario import load_scenario
from p2pswarm.transport.netmodel import GilbertElliott


def _radio() -> GilbertElliott:
    assert isinstance(BURSTY.radio, GilbertElliott)
    return BURSTY.radio


def test_a_schedule_is_a_function_of_seed_and_fellow() -> None:
    a = burst_schedule(_radio(), 1, 3, 600.0)
    assert a == burst_schedule(_radio(), 1, 3, 600.0)
    assert a != burst_schedule(_radio(), 1, 4, 600.0)
    assert a != burst_schedule(_radio(), 2, 3, 600.0)
    assert all(0.0 <= x < y <= 600.0 for x, y in a)
    assert all(a[k][1] < a[k + 1][0] for k in range(len(a) - 1))  # sorted, disjoint


def test_bursts_cover_19_percent_with_a_mean_of_300_ms() -> None:
    end = 20_000.0
    spans = [s for fellow in range(4) for s in burst_schedule(_radio(), 7, fellow, end)]
    share = sum(time_in_bursts(burst_schedule(_radio(), 7, fellow, end), 0.0, end)
                for fellow in range(4)) / 4
    mean = sum(b - a for a, b in spans) / len(spans)
    assert len(spans) > 40_000
    assert 0.17 <= share <= 0.21, share  # W3's 19.2% of the time
    assert 0.26 <= mean <= 0.34, mean  # Pareto, tail 1.5, mean 0.3 s
    longest = max(b - a for a, b in spans)
    assert longest > 3.0  # heavy tailed: some bursts outlast the dead-verdict floor


def test_which_radios_are_replayed() -> None:
    assert replayable(BURSTY.radio) and replayable(W3.radio)
    assert not replayable(W1.radio)  # 20 ms bursts: as short as a rule change
    assert not replayable(L20.radio)  # no radio: independent loss on the link
    assert profile("bursty").outage_every_s == 0.0  # no roaming outages, only bursts
    assert BURSTY.mean_loss == pytest.approx(0.20, abs=0.005)


def test_time_in_bursts_clips_to_the_window() -> None:
    assert time_in_bursts([(0.0, 1.0), (2.0, 4.0)], 0.5, 3.0) == pytest.approx(1.5 / 2.5)
    assert time_in_bursts([], 0.0, 10.0) == 0.0
    assert time_in_bursts([(1.0, 2.0)], 5.0, 5.0) == 0.0


def test_the_real_bursts_scenario_ships_with_the_package() -> None:
    import p2pswarm.sim

    s = load_scenario("real-bursts")
    assert s.nodes == 10 and s.preset == "wifi"
    assert [p for p, _, _ in s.profiles()] == ["bursty"] * 10
    node_hours = s.nodes * (s.duration_s - s.warmup_s) / 3600.0
    assert node_hours >= 1.0
    assert [e.kind for e in s.events].count("crash") >= 3
    folder = Path(p2pswarm.sim.__file__).parent / "scenarios"
    assert (folder / "real-bursts.json").is_file()
    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    assert '"p2pswarm.sim" = ["scenarios/*.json"' in pyproject


def test_the_random_rule_drops_only_the_background_when_bursts_are_replayed() -> None:
    from p2pswarm.sim.netns import RealFellow, ruleset

    def fellow(name: str) -> RealFellow:
        return RealFellow(0, "f000", "ns", "veth", "10.0.0.1", Path("."), profile(name))

    bursty = ruleset(fellow("bursty"))
    assert "numgen random mod 100 < 1 drop" in bursty  # 1%: the bursts come on top
    assert "< 20 drop" not in bursty
    w2 = ruleset(fellow("W2"))  # 100 ms bursts: replayed too (5% in bursts, none between)
    assert "numgen" not in w2
    w1 = ruleset(fellow("W1"))  # not replayed: independent loss at the mean rate
    assert "numgen random mod 100 < 1 drop" in w1
    blocked = ruleset(replace(fellow("wired"), blocked=["10.0.0.9"]))
    assert "ip saddr 10.0.0.9 drop" in blocked and "numgen" not in blocked


def test_a_burst_switches_the_namespace_rule_on_and_off(tmp_path: Path) -> None:
    from p2pswarm.sim.netns import BurstDriver, Netns, missing_requirements

    why = missing_requirements()
    if why is not None:
        pytest.skip(why)
    netns = Netns(2, [BURSTY, profile("wired")], [0, 0], tmp_path, tag="%05d" % (
        int(time.time() * 1000) % 90000 + 10000))
    with netns:
        burst_fellow = netns.fellows[0]
        burst_fellow.bursts = [(0.3, 1.2)]
        driver = BurstDriver(netns)

        def in_burst() -> bool:
            out = subprocess.run(["ip", "netns", "exec", burst_fellow.ns, "nft", "list",
                                  "set", "inet", "p2pswarm_burst", "on"],
                                 capture_output=True, text=True, check=True).stdout
            return '"eth0"' in out

        t0 = time.monotonic()
        driver.start(t0)
        try:
            assert not in_burst()
            seen_on = seen_off_after = False
            while time.monotonic() - t0 < 10.0 and not seen_off_after:
                on = in_burst()
                seen_on = seen_on or on
                seen_off_after = seen_on and not on
                time.sleep(0.05)
        finally:
            driver.close()
        assert seen_on and seen_off_after
        report = driver.report(0.0, 2.0)
        assert report["bursts"] == 1 and report["fellows"] == 1
        assert 0.3 <= report["time_in_bursts"] <= 0.7
    assert netns.leftovers() == []
