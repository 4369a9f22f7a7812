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


def fleet_lines(plan: Mapping[str, Any]) -> list[Text]:
    fleet = plan["fleet"]
    out = [Text(fleet["sentence"], style="bold" if plan.get("fits") else "bold red")]
    for r in plan.get("replicas", []):
        out.append(Text(
            f"replica {r['replica']}: micro-batch {r['micro_batch']} x {r['micro_batches']} "
            f"a step (its cards hold {r['memory_micro_batch']}), "
            f"{_rate(r['tokens_per_s'])} tokens/s, {_seconds(r['step_s'])} a step, "
            f"{r['sync_bytes_per_round'] / 1e9:.2f} GB of sync a round", style="bold"))
        for s in r["stages"]:
            out.append(Text(f"  stage {s['stage']}: layers {s['layers'][0]}-"
                            f"{s['layers'][1] - 1} on {_card(s)}"))
    rnd = fleet.get("round")
    if rnd:
        out.append(Text(
            f"round: {rnd['inner_steps']} steps of the fastest replica, "
            f"{_seconds(rnd['compute_s'])} of compute; {rnd['bytes'] / 1e9:.2f} GB "
            f"({rnd['codec']} up, {rnd['update_codec']} down) in {_seconds(rnd['comm_s'])} "
            f"through {rnd['keeper_fellow']} ({rnd['comm_fraction']:.2f} of the compute)"))
    left = [c for c in plan.get("cards", []) if not c.get("used")]
    if left:
        out.append(Text(f"left out ({len(left)}):", style="bold"))
        out += [Text(f"  {_card(c)}: {c.get('reason')}") for c in left]
    out.append(Text(f"plan_id {plan['plan_id']}", style="bold"))
    return out


def print_fleet(plan: Mapping[str, Any], console: Console | None = None) -> None:
    console = console or Console()
    for line in fleet_lines(plan):
        console.print(line, soft_wrap=True)


__all__ = ["fleet_lines", "print_fleet"]
