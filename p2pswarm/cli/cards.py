"""This machine's cards: `cards` (memory, programs holding it, speed) and `bench` (measure
each card's speed and cache it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer

from p2pswarm.cli.app import HomeOption, JsonOption, app, home_dir, print_json
from p2pswarm.cli.exits import exits_on, fail


def _local_cards(gpus: Optional[str], cpu_memory: Optional[str], no_cpu: bool) -> Any:
    from p2pswarm.inventory import local_card_source, read_inventory

    return read_inventory(local_card_source(gpus=gpus, cpu_memory=cpu_memory,
                                            no_cpu=no_cpu)).cards


GpusOption = typer.Option(None, "--gpus", help="Offer only these GPUs, e.g. 0,2 (none: no GPU).")
CpuMemoryOption = typer.Option(None, "--cpu-memory", help="Cap on the RAM offered, e.g. 6GB.")
NoCpuOption = typer.Option(False, "--no-cpu", help="Do not offer the CPU as a card.")


@app.command()
@exits_on()
def cards(
    gpus: Optional[str] = GpusOption,
    cpu_memory: Optional[str] = CpuMemoryOption,
    no_cpu: bool = NoCpuOption,
    home: Optional[Path] = HomeOption,
    as_json: bool = JsonOption,
) -> None:
    """Show the cards this machine offers: memory, programs holding it, measured speed."""
    from p2pswarm.bench import BenchmarkCache, benchmarks_for

    found = _local_cards(gpus, cpu_memory, no_cpu)
    speeds = benchmarks_for(found, BenchmarkCache(home_dir(home)))
    if as_json:
        print_json({"cards": [{**c.to_dict(), "benchmark": speeds[c.key].to_dict()}
                              for c in found]})
        return
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from p2pswarm.planner.wording import card_label, gb
    table = Table(title=f"{len(found)} card{'s' if len(found) != 1 else ''} on this machine")
    for column in ("card", "total", "free", "held by others", "TFLOP/s", "GB/s", "speed"):
        table.add_column(column)
    for c in found:
        bench = speeds[c.key]
        held = ", ".join(f"{h.name} {gb(h.held_bytes)}" for h in c.held_by_others) or "-"
        # program names like "[kworker]" are text, not markup
        table.add_row(Text(card_label(c.kind, c.index, c.name)), gb(c.total_bytes),
                      gb(c.free_bytes), Text(held), f"{bench.flops / 1e12:.2f}",
                      f"{bench.mem_bandwidth / 1e9:.0f}",
                      "measured" if bench.measured else "estimate (run `p2pswarm bench`)")
    Console().print(table)


def quantized_linear(weight: Any, scheme: str) -> Any:
    """The runtime's quantised linear of ``weight`` (``bench`` times it per dtype)."""
    import torch

    from p2pswarm.models.quant import DequantWorkspace, quantize_linear

    workspace = DequantWorkspace(weight.numel(), torch.float16, weight.device)
    return quantize_linear(weight, None, scheme=scheme, group_size=32, workspace=workspace)


@app.command()
@exits_on()
def bench(
    seconds: float = typer.Option(2.0, "--seconds", help="Seconds of measuring per card."),
    gpus: Optional[str] = GpusOption,
    cpu_memory: Optional[str] = CpuMemoryOption,
    no_cpu: bool = NoCpuOption,
    home: Optional[Path] = HomeOption,
    as_json: bool = JsonOption,
) -> None:
    """Measure each local card's matmul FLOP/s and memory bandwidth, and cache them."""
    from p2pswarm.bench import BenchmarkCache, benchmarks_for

    if seconds <= 0 or seconds > 60:
        fail(f"--seconds {seconds:g} must be more than 0 and at most 60, e.g. --seconds 2")
    found = _local_cards(gpus, cpu_memory, no_cpu)
    speeds = benchmarks_for(found, BenchmarkCache(home_dir(home)), rerun=True,
                            seconds=seconds, quantized=quantized_linear)
    if as_json:
        print_json({"benchmarks": {k: v.to_dict() for k, v in sorted(speeds.items())}})
        return
    from p2pswarm.planner.wording import card_label
    for c in found:
        b = speeds[c.key]
        rates = ", ".join(f"{d} {r:,.0f}" for d, r in b.dtype_tokens_per_s)
        typer.echo(f"{card_label(c.kind, c.index, c.name)}: {b.flops / 1e12:.3f} TFLOP/s "
                   f"({b.dtype} matmul), {b.mem_bandwidth / 1e9:.1f} GB/s"
                   + (f"; reference linear tokens/s: {rates}" if rates else ""))
    typer.echo(f"saved in {BenchmarkCache(home_dir(home)).path}; an agent running on this "
               "state directory gossips them at its next inventory read (within 5 s)")
