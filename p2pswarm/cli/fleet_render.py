"""Printing a fleet training plan: every replica with its stages and batch, the round,
and each card left out with its reason."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rich.console import Console
from rich.text import Text


def _rate(x: float) -> str:
    return f"{x:,.0f}" if x >= 10 else f"{x:.2f}"


def _seconds(t: float) -> str:
    return f"{t:,.0f} s" if t >= 10 else f"{t:.2f} s"


def _card(card: Mapping[str, Any]) -> str:
    kind, name = card.get("kind"), str(card.get("name") or "")
    label = (f"CPU ({name})" if name not in ("", "CPU") else "CPU") if kind == "cpu" \
        else f"{name} #{card.get('index')}"
    return f"{card.get('fellow')}'s {label}"


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:,.1f} MB"


def _memory(r: Mapping[str, Any], seq_len: Any) -> str:
    """Why the replica holds its batch: its tightest card's memory per sample."""
    mem = r.get("memory")
    if not isinstance(mem, Mapping):
        return ""
    return (f"  memory: {mem['fellow']} has {_gb(mem['free_bytes'])} free; weights, "
            f"gradients and optimizer take {_gb(mem['fixed_bytes'])}; each sequence of "
            f"{seq_len} tokens a micro-batch adds {_gb(mem['sample_bytes'])} "
            f"(x{r['micro_batches']} in flight): room for {mem['holds']} a micro-batch")


def fleet_lines(plan: Mapping[str, Any]) -> list[Text]:
    fleet = plan["fleet"]
    out = [Text(fleet["sentence"], style="bold" if plan.get("fits") else "bold red")]
    for r in plan.get("replicas", []):
        out.append(Text(
            f"replica {r['replica']}: micro-batch {r['micro_batch']} x {r['micro_batches']} "
            f"a step (its cards hold {r['memory_micro_batch']}), "
            f"{_rate(r['tokens_per_s'])} tokens/s, {_seconds(r['step_s'])} a step, "
            f"{_gb(r['sync_bytes_per_round'])} sent a round", style="bold"))
        memory = _memory(r, (plan.get("request") or {}).get("seq_len"))
        if memory:
            out.append(Text(memory))
        for s in r["stages"]:
            out.append(Text(f"  stage {s['stage']}: layers {s['layers'][0]}-"
                            f"{s['layers'][1] - 1} on {_card(s)}"))
    rnd = fleet.get("round")
    if rnd:
        sized = (" (sized so its communication is at most a third of its compute)"
                 if rnd.get("inner_steps_auto") else "")
        out.append(Text(
            f"round: {rnd['inner_steps']} steps of the fastest replica{sized}, "
            f"{_seconds(rnd['compute_s'])} of compute; sharded all-reduce, no hub: "
            f"{_gb(rnd['bytes'])} in all ({rnd['codec']} deltas, {rnd['update_codec']} "
            f"updates) in {_seconds(rnd['comm_s'])}, set by {rnd['limit'] or 'no link'} "
            f"({rnd['comm_fraction']:.2f} of the compute); busiest fellow "
            f"{rnd['busiest_fellow'] or '-'} sends {_gb(rnd['busiest_bytes'])} "
            f"({rnd['busiest_over_delta']:.1f}x one replica's compressed delta of "
            f"{_gb(rnd['delta_bytes'])})"))
        for ap in rnd.get("access_points") or ():
            out.append(Text(f"  access point {ap['name']}: {_gb(ap['air_bytes'])} over the "
                            f"air a round, {_seconds(ap['seconds'])}"))
    left = [c for c in plan.get("cards", []) if not c.get("used")]
    if left:
        out.append(Text(f"left out ({len(left)}):", style="bold"))
        out += [Text(f"  {_card(c)}: {c.get('reason')}") for c in left]
    out.append(Text(f"plan_id {plan['plan_id']}", style="bold"))
    return out


def _stage_key(s: Mapping[str, Any]) -> tuple[Any, Any, Any]:
    return (s.get("fellow_id"), s.get("kind"), s.get("index"))


def job_lines(plan: Mapping[str, Any]) -> list[Text]:
    """A job plan of several replicas, each one pipeline on its own request: every
    replica with its stages, then only the cards no replica uses, with their reasons.
    (The first replica's own bars and table would call the others' cards left out.)"""
    replicas = list(plan.get("replicas") or [])
    # the summary's own account of replica 0 counts the others' cards as left out
    head = str(plan.get("summary") or "").split(" Replica 0: ")[0]
    out = [Text(head, style="bold" if plan.get("fits") else "bold red")]
    used: dict[tuple[Any, Any, Any], int] = {}
    for r in replicas:
        out.append(Text(f"replica {r['replica']}: micro-batch {r.get('micro_batch')} x "
                        f"{r.get('micro_batches')} a step", style="bold"))
        for s in r.get("stages") or ():
            used[_stage_key(s)] = r["replica"]
            out.append(Text(f"  stage {s['stage']}: layers {s['layers'][0]}-"
                            f"{s['layers'][1] - 1} on {_card(s)}"))
    left = [c for c in plan.get("cards", []) if _stage_key(c) not in used]
    if left:
        out.append(Text(f"left out ({len(left)}):", style="bold"))
        out += [Text(f"  {_card(c)}: {c.get('reason')}") for c in left]
    out.append(Text(f"plan_id {plan['plan_id']}", style="bold"))
    return out


def print_job_plan(plan: Mapping[str, Any], console: Console | None = None) -> None:
    """A fleet plan, a job plan of several replicas, or one pipeline's plan."""
    console = console or Console()
    if "fleet" in plan:
        print_fleet(plan, console)
        return
    if len(plan.get("replicas") or ()) > 1:
        for line in job_lines(plan):
            console.print(line, soft_wrap=True)
        return
    from p2pswarm.cli.render import print_plan

    print_plan(plan, console)


def print_fleet(plan: Mapping[str, Any], console: Console | None = None) -> None:
    console = console or Console()
    for line in fleet_lines(plan):
        console.print(line, soft_wrap=True)


__all__ = ["fleet_lines", "job_lines", "print_fleet", "print_job_plan"]
