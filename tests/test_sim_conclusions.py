"""The report's plain words: what a run's figures mean and what to conclude."""

from __future__ import annotations

import copy

from p2pswarm.sim.conclusions import GLOSSARY, conclusions
from p2pswarm.sim.report import markdown

SMOKE_BOTH = {  # the figures `simulate smoke --baseline --json` gave (seed 1)
    "seed": 1, "nodes": 8, "duration_s": 240.0, "warmup_s": 30.0, "node_hours": 0.4389,
    "profiles": {"W2": 6, "wired": 2}, "ok": True, "failures": [],
}
OURS = {**SMOKE_BOTH, "variant": "ours", "preset": "wifi",
        "crash_to_dead_s": {"p50": 2.798, "p99": 3.714}, "false_suspicions": 9,
        "false_suspicions_unexcused": 1, "false_deaths": 8, "false_deaths_unexcused": 0,
        "false_deaths_per_node_hour": 18.22785}
BASE = {**SMOKE_BOTH, "variant": "baseline", "preset": "memberlist",
        "crash_to_dead_s": {"p50": 5.486, "p99": 5.615}, "false_suspicions": 12,
        "false_suspicions_unexcused": 4, "false_deaths": 5, "false_deaths_unexcused": 0,
        "false_deaths_per_node_hour": 11.39241}


def test_more_false_deaths_than_the_baseline_from_a_faster_detector_is_explained() -> None:
    said = " ".join(conclusions([OURS, BASE]))
    assert "18.2 for ours against 11.4 for the baseline" in said
    assert "ours declares dead sooner" in said and "speed, not error" in said
    assert "all 8 false-death episodes were of fellows cut off" in said
    assert "1 for ours against 4 for the baseline (4.0x fewer)" in said
    assert "`wifi` is the preset for that" in said and "the right one" in said
    assert "rough" in said  # 0.44 node-hours, 17 episodes


def test_a_planted_run_that_passes_says_the_oracle_missed_it() -> None:
    planted = {**OURS, "variant": "ours+never-refutes"}
    assert "the oracle missed it" in conclusions([planted])[0]
    caught = {**planted, "ok": False, "failures": ["1 time(s) ... did not refute"]}
    assert "the oracle caught it" in conclusions([caught])[0]


def test_reachable_false_deaths_and_the_wrong_preset_are_called_out() -> None:
    bad = {**OURS, "preset": "lan", "false_deaths_unexcused": 3}
    said = " ".join(conclusions([bad]))
    assert "3 of 8 false-death episodes were of fellows the others could reach" in said
    assert "This run used `lan`" in said and "thrown out for loss alone" in said
    wired = {**OURS, "profiles": {"wired": 8}, "preset": "lan"}
    assert "`lan` is the preset for that" in " ".join(conclusions([wired]))


def test_the_markdown_report_carries_conclusions_and_the_glossary() -> None:
    r = copy.deepcopy(OURS)
    r.update(scenario={"name": "smoke"}, notes=[], trace_hash="0" * 64)
    text = markdown([r])
    assert "#### What to conclude" in text and "#### What the numbers count" in text
    assert all(g.split("**")[1] in text for g in GLOSSARY)
