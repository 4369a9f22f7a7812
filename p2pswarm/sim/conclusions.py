"""What a simulation report means, in plain words: what each figure counts, and what to
conclude from one run (or ours beside the baseline).

``GLOSSARY`` explains the rows of the report's table. ``conclusions(results)`` reads the
run results (``run_scenario``'s dicts, ours first, the baseline second when asked) and
says what they show: whether the oracle found anything, which false deaths were the
detector working (the fellow really was cut off) and which were mistakes, why ours and
the baseline differ, how far the figures can be trusted at this length, and which
preset fits the network the run simulated.
"""

from __future__ import annotations

import math
from typing import Any

WIRED = frozenset({"wired"})
FEW_EPISODES = 30  # a rate from fewer events than this is rough

WHY_PRESET = {
    "lan": "wired machines on one switch: the fastest detection",
    "wifi": "the same probing, but a fellow must miss acks for longer before it is "
            "declared dead, because a burst of radio loss takes all its confirmations at once",
}

GLOSSARY: tuple[str, ...] = (
    "**verdict**: the oracle knows what really happened (which fellows crashed, which "
    "were cut off and when) and judges every belief against it. `ok` means none of "
    "these happened: two leaders in one term; a crash that some running fellow never "
    "declared dead in time; a running fellow held suspect or dead by others while they "
    "could reach it (it should have refuted, and did not, for longer than the scenario "
    "allows); a plan that changed with nothing changed. `FAIL` lists what did, above.",
    "**crash to dead**: for each crash and each fellow running through it, the seconds "
    "until that fellow declared the crashed one dead (p50: half were faster; p99: all "
    "but 1 in 100). Lower is faster detection.",
    "**false suspicions / false deaths (episodes)**: a fellow whose process was running "
    "was suspected / declared dead; one episode per fellow and incarnation, however many "
    "fellows shared the belief. Many are right: a fellow in a roaming outage, behind a "
    "partition or in a radio fade of 2 s or more really cannot be reached.",
    "**... of reachable fellows**: the episodes left when those are taken out: beliefs "
    "about a fellow the others could reach at the time. These are the detector's own "
    "mistakes. False deaths of reachable fellows should be 0: such a fellow is thrown "
    "out of the swarm (its loads and jobs with it) for nothing.",
    "**per node-hour**: a count divided by the fellows' running time (8 fellows for 3.3 "
    "hours of measurement are 26.4 node-hours), so runs of different sizes and lengths "
    "compare.",
    "**flaps**: episodes that ended with the fellow alive again (it refuted). "
    "**suspicions over the limit**: a fellow held suspect or dead for longer than the "
    "scenario's `max_suspect_s` since the two were last cut apart. **suspect or dead "
    "while reachable, unrefuted**: a fellow held suspect or dead while the two could "
    "reach each other for over `refute_within_s` (60 s) in all, summed across cuts: a "
    "running fellow refutes a suspicion within seconds of hearing it. Both are failures.",
    "**leader failover**: after the leader is killed, the seconds until every running "
    "fellow names the same new leader. **update to all, rounds**: gossip intervals until "
    "a change (a card filling) reached every fellow.",
    "**plan changes / unexplained**: how often the leader's plan for the same request "
    "changed, and how many of those no real change (crash, restart, card) explains. "
    "**pinned loads refused**: how often a load pinned to the previous plan would have "
    "been refused as changed.",
    "**baseline**: memberlist's LAN defaults (the SWIM library under Consul and Serf: "
    "probe every 1 s, 500 ms timeout, suspicion multiplier 4), run by our agent with "
    "every refinement it can switch off switched off: what a standard SWIM does on the "
    "same network, the same faults and the same seed, on any network (memberlist users "
    "mostly keep these defaults).",
)


def _num(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) \
            and math.isfinite(value):
        return float(value)
    return None


def _g(value: float | None, unit: str = "") -> str:
    return "-" if value is None else f"{value:,.3g}{unit}"


def _ratio(a: float, b: float) -> str:
    """``a`` (ours) put against ``b`` (the baseline's), in words."""
    if a == b:
        return "the same"
    if a == 0 or b == 0:
        return "none for ours" if a == 0 else "none for the baseline"
    return f"{b / a:.1f}x fewer" if a < b else f"{a / b:.1f}x more"


def _verdict(r: dict[str, Any]) -> str:
    name = r["variant"]
    planted = "+" in name
    if r["ok"]:
        if planted:
            return (f"`{name}` carries a planted bug, yet the oracle found nothing: the "
                    "oracle missed it (or the run is too short for the bug to show).")
        return (f"`{name}`: the oracle found no failure: no split leadership, every crash "
                "seen, no reachable fellow left suspect or dead, no unexplained plan change.")
    failures = r["failures"]
    if planted:
        return (f"`{name}` carries a planted bug and the oracle caught it ({len(failures)} "
                "failure(s), above): the oracle works.")
    return (f"`{name}` FAILED ({len(failures)} failure(s) above). The same scenario and "
            f"seed replay exactly: `--seed {r['seed']}` reproduces it for tracing.")


def _false_deaths(r: dict[str, Any]) -> str | None:
    n, unexcused = r.get("false_deaths", 0), r.get("false_deaths_unexcused", 0)
    if not n:
        return None
    name = r["variant"]
    if not unexcused:
        return (f"`{name}`: all {n} false-death episodes were of fellows cut off at the "
                "time (a partition, a roaming outage, a link down or a long radio fade). "
                "Declaring such a fellow dead is the detector doing its job, so these "
                "count against nothing; the figure to watch is 'of reachable fellows' (0).")
    said = (f"`{name}`: {unexcused} of {n} false-death episodes were of fellows the others "
            "could reach: the detector threw out fellows that were there.")
    if "+" in name:
        return said + " Here that is the planted bug's doing."
    return said + (" On a radio network that says the preset's timeouts are too short for "
                   "it (see below).")


def _side_by_side(ours: dict[str, Any], base: dict[str, Any]) -> list[str]:
    out: list[str] = []
    oc, bc = ours["crash_to_dead_s"], base["crash_to_dead_s"]
    op50, bp50 = _num(oc.get("p50")), _num(bc.get("p50"))
    faster = op50 is not None and bp50 is not None and op50 < bp50
    if op50 is not None and bp50 is not None:
        out.append(f"Detection: a crash was declared dead in {_g(op50, ' s')} (p50) by ours "
                   f"against {_g(bp50, ' s')} by the baseline; p99 "
                   f"{_g(_num(oc.get('p99')), ' s')} against {_g(_num(bc.get('p99')), ' s')}.")
    of, bf = ours.get("false_deaths_per_node_hour"), base.get("false_deaths_per_node_hour")
    ou, bu = ours.get("false_deaths_unexcused", 0), base.get("false_deaths_unexcused", 0)
    if of is not None and bf is not None and of != bf:
        if not ou and not bu:
            why = ("ours declares dead sooner, so more cut-offs last long enough to end in "
                   "a verdict" if faster else
                   "the two detectors take different times to a verdict, so different "
                   "numbers of cut-offs last long enough to end in one")
            out.append(f"False deaths per node-hour: {_g(of)} for ours against {_g(bf)} for "
                       "the baseline. Both count only fellows that really were cut off "
                       f"(0 of reachable fellows on either side): {why}. That difference is "
                       "speed, not error; neither threw out a fellow it could reach.")
        else:
            out.append(f"False deaths of reachable fellows: {ou} for ours against {bu} for "
                       "the baseline: these are the mistakes; the per-node-hour rates above "
                       "also count fellows that were really cut off.")
    osu = ours.get("false_suspicions_unexcused")
    bsu = base.get("false_suspicions_unexcused")
    if osu is not None and bsu is not None:
        out.append(f"False suspicions of reachable fellows: {osu} for ours against {bsu} "
                   f"for the baseline ({_ratio(osu, bsu)}). Each costs gossip and, if not "
                   "refuted in time, a fellow wrongly declared dead: fewer is better.")
    return out


def _confidence(r: dict[str, Any]) -> str | None:
    hours = _num(r.get("node_hours")) or 0.0
    events = r.get("false_suspicions", 0) + r.get("false_deaths", 0)
    if events >= FEW_EPISODES:
        return None
    return (f"This run measured {hours:.3g} node-hours with {events} false suspicion and "
            "death episodes in all: rates from so few are rough (a count of k is "
            f"uncertain by about the square root of k: {events} +- {math.sqrt(events):.0f}). "
            "For figures to compare, run longer (`--duration`) or several seeds (`--seed`).")


def _preset_advice(r: dict[str, Any]) -> str:
    profiles = set(r.get("profiles", {}))
    preset = r.get("preset", "")
    radio = sorted(profiles - WIRED)
    if not radio:
        fits = "lan"
        network = "every fellow is wired"
    else:
        fits = "wifi"
        network = f"fellows on radio ({', '.join(radio)})"
    why = WHY_PRESET[fits]
    advice = (f"Preset: here {network}; `{fits}` is the preset for that ({why}). `local` "
              "is for several fellows on one machine.")
    if preset == "memberlist":
        return advice
    if preset != fits and preset in ("lan", "wifi"):
        advice += (f" This run used `{preset}`: "
                   + ("expect fellows on radio to be suspected and thrown out for loss "
                      "alone." if preset == "lan" else
                      "safe, but crashes are found later than `lan` would find them."))
    elif preset == fits:
        advice += f" This run used `{preset}`: the right one."
    return advice


def conclusions(results: list[dict[str, Any]]) -> list[str]:
    """Plain sentences on what ``results`` (ours first, then the baseline) show."""
    out = [_verdict(r) for r in results]
    for r in results:
        line = _false_deaths(r)
        if line is not None:
            out.append(line)
    if len(results) > 1:
        out.extend(_side_by_side(results[0], results[1]))
    line = _confidence(results[0])
    if line is not None:
        out.append(line)
    out.append(_preset_advice(results[0]))
    return out


__all__ = ["GLOSSARY", "conclusions"]
