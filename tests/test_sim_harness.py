"""The simulation harness: seeded replay, the oracle, scenarios, reports and the CLI."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
from typer.testing import CliRunner

from p2pswarm.cli import app
from p2pswarm.errors import ConfigError
from p2pswarm.sim.baseline import memberlist_config, memberlist_min_suspicion_s
from p2pswarm.sim.harness import build_timeline, run_scenario
from p2pswarm.sim.metrics import ks_two_sample, percentile, summary
from p2pswarm.sim.oracle import Oracle
from p2pswarm.sim.profiles import profile
from p2pswarm.sim.report import markdown, write_reports
from p2pswarm.sim.scenario import (
    Checks,
    available_scenarios,
    load_scenario,
    scenario_from_dict,
)
from tests.training_swarm import SMALL_LLAMA

SMALL = {"name": "small", "nodes": 6, "duration_s": 150, "warmup_s": 20,
         "preset": "wifi", "fellows": [{"profile": "wired", "count": 2, "leader_priority": 5},
                                       {"profile": "W2"}],
         "events": [{"at_s": 40, "kind": "crash", "fellow": 4, "restart_after_s": 50},
                    {"at_s": 60, "kind": "leader_kill", "restart_after_s": 40},
                    {"at_s": 70, "kind": "card_fill", "fellow": 2, "free_gb": 2}],
         "plan": {"every_s": 15}, "sample_every_s": 10}


@pytest.fixture(scope="module")
def small_run() -> dict:
    return run_scenario(scenario_from_dict(SMALL))


def test_the_same_seed_replays_exactly_and_another_seed_does_not(small_run) -> None:
    scenario = scenario_from_dict(SMALL)
    again = run_scenario(scenario)
    assert again["trace_hash"] == small_run["trace_hash"]
    assert again["events"] == small_run["events"]
    other = run_scenario(replace(scenario, seed=2))
    assert other["trace_hash"] != small_run["trace_hash"]


def test_a_small_run_is_judged_and_measured(small_run) -> None:
    r = small_run
    assert r["ok"], r["failures"]
    assert r["crashes"] == 2  # the follower and the leader
    assert r["crash_to_dead_s"]["missed"] == 0 and r["crash_to_dead_s"]["count"] >= 8
    assert 0 < r["crash_to_dead_s"]["p50"] < 10
    assert r["terms_with_two_leaders"] == 0
    (failover,) = r["_failovers"]
    assert failover["failover_s"] is not None and failover["failover_s"] < 10
    assert r["plan"]["planned"] >= 5 and r["plan"]["changes_unexplained"] == 0
    assert r["updates"] >= 1 and r["update_rounds"]["missed"] == 0
    assert r["traffic"]["datagrams_out_per_fellow_s"]["mean"] > 0
    assert r["views"] and 0.5 < r["views"][-1]["alive"] <= 1.0


def test_the_oracle_catches_a_fellow_that_never_refutes() -> None:
    # 10 minutes of W3 after the warm-up: every fellow roams off the network once (2-10 s),
    # long enough to be suspected or declared dead; an honest fellow refutes when it is
    # back, one that never refutes stays suspect or dead while it runs on.
    scenario = scenario_from_dict({
        "name": "planted", "nodes": 6, "duration_s": 620, "warmup_s": 20, "formed": True,
        "preset": "wifi", "fellows": [{"profile": "W3"}], "checks": {"max_suspect_s": 30},
        "sample_every_s": 0})
    honest = run_scenario(scenario)
    assert honest["ok"], honest["failures"]
    planted = run_scenario(scenario, planted="never-refutes")
    assert not planted["ok"]
    assert "held suspect or dead" in planted["failures"][0]


def test_the_oracle_flags_two_leaders_in_one_term_and_judges_deaths() -> None:
    oracle = Oracle(4, Checks(detect_within_s=10.0))
    for i in range(4):
        oracle.started(i, 0.0)
    oracle.event(1.0, 0, "elected", 0, 0, 1)
    oracle.event(1.5, 1, "elected", 1, 0, 1)  # a second winner of term 1
    oracle.crashed(3, 5.0)
    oracle.event(7.0, 0, "dead", 3, 0, 0)
    oracle.event(8.0, 1, "dead", 3, 0, 0)
    oracle.event(9.0, 2, "dead", 1, 0, 0)  # 1 is running: a false death
    oracle.cut(2, 20.0)
    oracle.event(25.0, 0, "dead", 2, 0, 0)  # while 2's link is down: excused
    r = oracle.finish(30.0)
    assert not r["ok"]
    assert r["terms_with_two_leaders"] == 1
    assert any("two leaders in one term" in f for f in r["failures"])
    assert r["crash_to_dead_s"]["p50"] == 3.0 and r["crash_to_dead_s"]["missed"] == 1  # 2, 3, never
    assert any("never saw a crash as dead" in f for f in r["failures"])
    assert r["false_deaths"] == 2 and r["false_deaths_unexcused"] == 1


def test_suspecting_a_fellow_cut_off_is_excused_and_a_reachable_one_is_not() -> None:
    oracle = Oracle(3, Checks())
    for i in range(3):
        oracle.started(i, 0.0)
    oracle.event(2.0, 0, "suspect", 1, 0, 0)  # 1 is reachable: a false suspicion
    oracle.cut(2, 10.0)
    oracle.event(12.0, 0, "suspect", 2, 0, 0)  # during 2's outage: excused
    oracle.uncut(2, 14.0)
    oracle.event(16.0, 1, "suspect", 2, 0, 0)  # the same episode, however far it spreads
    oracle.event(30.0, 0, "suspect", 2, 1, 0)  # long after the outage: false again
    oracle.blackout(1, 35.0, 39.0)  # 1's radio passes nothing for 4 s: as good as cut
    oracle.event(38.0, 2, "dead", 1, 1, 0)
    r = oracle.finish(40.0)
    assert r["false_suspicions"] == 3 and r["false_suspicions_unexcused"] == 2
    assert r["false_deaths"] == 1 and r["false_deaths_unexcused"] == 0


def test_false_deaths_can_be_judged_again_on_stricter_terms() -> None:
    oracle = Oracle(3, Checks(blackout_min_s=2.0))
    for i in range(3):
        oracle.started(i, 0.0)
    oracle.blackout(1, 10.0, 12.5)  # a 2.5 s fade: a cut at 2 s, not at 3 s
    oracle.event(14.0, 0, "dead", 1, 4, 0)
    oracle.event(14.2, 2, "dead", 1, 4, 0)  # the same episode, seen by another
    oracle.cut(2, 40.0)
    oracle.uncut(2, 48.0)
    oracle.event(58.0, 0, "dead", 2, 7, 0)  # 10 s after a roaming outage
    r = oracle.finish(60.0)
    assert r["false_deaths"] == 2 and r["false_deaths_unexcused"] == 0
    assert oracle.false_deaths_judged(30.0, 2.0) == {"verdicts": 0, "episodes": 0}
    assert oracle.false_deaths_judged(30.0, 3.0) == {"verdicts": 2, "episodes": 1}
    assert oracle.false_deaths_judged(5.0, 2.0) == {"verdicts": 1, "episodes": 1}
    with pytest.raises(ConfigError, match="blackout_min_s"):
        oracle.false_deaths_judged(30.0, 1.0)


def test_plan_changes_without_a_real_change_fail() -> None:
    oracle = Oracle(2, Checks(), plan_grace_s=10.0)
    oracle.started(0, 0.0)
    oracle.started(1, 0.0)
    oracle.plan_sample(30.0, 0, "aaaa")
    oracle.plan_sample(40.0, 0, "bbbb")  # nothing changed since 0 s
    oracle.card_changed(1, 45.0)
    oracle.plan_sample(50.0, 0, "cccc")  # explained by the card
    r = oracle.finish(60.0)
    assert r["plan"]["changes"] == 2 and r["plan"]["changes_unexplained"] == 1
    assert any("plan change" in f for f in r["failures"])


def test_scenarios_in_the_repository_load_and_bad_ones_say_why() -> None:
    names = available_scenarios()
    for name in ("clean", "w1", "w2", "w3", "w2-failover", "smoke", "real-small"):
        assert name in names
    for name in names:
        load_scenario(name)
    bad = [({**SMALL, "nodes": 1}, "nodes"),
           ({**SMALL, "colour": 1}, "unknown keys"),
           ({**SMALL, "events": [{"at_s": 1, "kind": "explode"}]}, "unknown event kind"),
           ({**SMALL, "events": [{"at_s": 1, "kind": "crash", "fellow": 9}]}, "names fellow 9"),
           ({**SMALL, "fellows": [{"profile": "W9"}]}, "profile"),
           ({**SMALL, "fellows": [{"profile": "W1", "count": 9}]}, "count"),
           ({**SMALL, "training": {"jobs": {}}}, "training takes job"),
           ({**SMALL, "training": {"job": {}, "step_s": 0}}, "step_s")]
    for d, words in bad:
        with pytest.raises(ConfigError, match=words):
            scenario_from_dict(d)
    with pytest.raises(ConfigError, match="no scenario"):
        load_scenario("no-such-scenario")


def test_a_training_job_runs_through_a_crash_and_is_measured() -> None:
    job = {"model": {"config": SMALL_LLAMA}, "seq_len": 16, "micro_batch": 2,
           "micro_batches": 1,
           "steps": 16, "lr": {"peak": 0.001, "schedule": "constant"}, "seed": 3,
           "replicas": "auto", "sync": {"inner_steps": 2, "codec": "int8"}}
    d = {"name": "train-small", "nodes": 3, "duration_s": 90, "warmup_s": 20,
         "formed": True, "preset": "wifi",
         "fellows": [{"profile": "wired", "count": 1, "leader_priority": 5},
                     {"profile": "W1"}],
         "events": [{"at_s": 23, "kind": "crash", "fellow": 2, "restart_after_s": 6}],
         "training": {"job": job, "step_s": 1.0}, "sample_every_s": 1}
    result = run_scenario(scenario_from_dict(d))
    t = result["training"]
    assert result["ok"] and t["leader"] == 0 and t["state"] == "finished", t
    assert t["steps"] == t["of"] == 16 and t["rejoins"] >= 1  # never restarted
    replicas = [r[4] for r in t["timeline"] if r[1] > 0]
    assert min(replicas) == 2 < t["replicas"] == 3  # lost one, got it back
    # its whole length (16 steps of 3 replicas of 2), the lost replica's share trained
    # by the others
    assert 0 < t["samples_per_s"] and t["samples"] >= 16 * 3 * 2
    assert t["loss_end"] < t["loss_first"]
    cut_short = run_scenario(scenario_from_dict({**d, "duration_s": 28}))["training"]
    assert cut_short["state"] == "running" and cut_short["reason"] == "the run ended first"
    assert 0 < cut_short["steps"] < 16 and cut_short["samples_per_s"] > 0
    assert run_scenario(scenario_from_dict({**d, "training": {}}))["training"] is None


def test_rates_and_outages_make_a_seeded_timeline() -> None:
    s = scenario_from_dict({**SMALL, "events": [], "duration_s": 3600,
                            "fellows": [{"profile": "W3"}],
                            "rates": {"crash_per_hour": 20, "card_change_per_hour": 10}})
    profiles = [profile(p) for p, _, _ in s.profiles()]
    a = build_timeline(s, profiles, s.nodes)
    assert a == build_timeline(s, profiles, s.nodes)
    kinds = [x.kind for x in a]
    assert 8 <= kinds.count("rate_crash") <= 40
    assert kinds.count("outage_begin") == s.nodes * 6 - kinds.count("outage_begin") % 6 \
        or kinds.count("outage_begin") >= s.nodes * 5
    assert a != build_timeline(replace(s, seed=9), profiles, s.nodes)


def test_the_baseline_is_memberlists_lan_defaults() -> None:
    config = memberlist_config(100)
    g = config.gossip
    assert (g.probe_interval_s, g.probe_timeout_s, g.indirect_checks) == (1.0, 0.5, 3)
    assert (g.gossip_interval_s, g.gossip_nodes, g.retransmit_mult) == (0.2, 3, 4)
    assert g.push_pull_interval_s == 30.0 and g.suspicion_max_timeout_mult == 6.0
    assert memberlist_min_suspicion_s(100) == pytest.approx(8.0)
    t = g.tuning
    assert t.suspicion_floor_clean_s == t.suspicion_floor_lossy_s == pytest.approx(8.0)
    assert t.confirmations_expected == 2 and t.confirm_fanout == 0 and t.refute_by_stream is False


def test_statistics() -> None:
    assert percentile([3, 1, 2, 4], 0.5) == 2
    assert summary([1.0, math.inf])["missed"] == 1
    same = ks_two_sample([0.1 * k for k in range(100)], [0.1 * k + 0.01 for k in range(100)])
    assert same["statistic"] <= 0.02 and same["p_value"] > 0.9
    apart = ks_two_sample([float(k) for k in range(100)], [50.5 + k for k in range(100)])
    assert apart["statistic"] == pytest.approx(0.51) and apart["p_value"] < 1e-4


def test_reports_are_written(small_run, tmp_path) -> None:
    notes = write_reports([small_run, small_run], tmp_path)
    assert json.loads((tmp_path / "result.json").read_text())[0]["variant"] == "ours"
    table = (tmp_path / "report.md").read_text()
    assert "crash to dead p50" in table and table == markdown([small_run, small_run])
    pngs = {p.name for p in tmp_path.glob("*.png")}
    assert notes or pngs == {"detection_cdf.png", "false_suspicions.png",
                             "bytes_per_fellow.png", "membership_view.png"}


def test_cli_simulate_runs_and_refuses_bad_arguments(tmp_path) -> None:
    runner = CliRunner()
    result = runner.invoke(app, ["simulate", "smoke", "--duration", "60", "--json",
                                 "--no-progress"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["ok"] and doc["scenario"]["name"] == "smoke" and doc["duration_s"] == 60
    for args, words in ((["simulate", "nope"], "no scenario"),
                        (["simulate", "smoke", "--nodes", "1"], "at least 2"),
                        (["simulate", "smoke", "--duration", "0"], "> 0"),
                        (["simulate", "smoke", "--plant", "gremlin"], "planted bug")):
        bad = runner.invoke(app, args)
        assert bad.exit_code == 2, bad.output
        assert words in bad.output and len(bad.output.strip().splitlines()) == 1
