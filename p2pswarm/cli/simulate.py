"""`p2pswarm simulate`: a WiFi-dropout scenario on real agents in virtual time (or in
network namespaces with --real), judged against the truth, with reports."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

import typer

from p2pswarm.cli.app import JsonOption, app
from p2pswarm.cli.exits import EXIT_FAILURE, EXIT_USAGE, exits_on, fail


def _sim_progress(enabled: Optional[bool], label: str) -> Any:
    """A rich progress bar on stderr for one run (virtual seconds), or None."""
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:
        return None
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("{task.description}"), BarColumn(),
                    TextColumn("{task.completed:,.0f}/{task.total:,.0f} s"),
                    TimeElapsedColumn(), transient=True,
                    console=__import__("rich.console").console.Console(stderr=True))


def _sim_run(run: Any, bar: Any, label: str) -> Any:
    if bar is None:
        return run(None)
    task = bar.add_task(label, total=1.0)

    def progress(now_s: float, end_s: float) -> None:
        bar.update(task, completed=now_s, total=end_s)

    try:
        return run(progress)
    finally:
        bar.remove_task(task)


def _simulate_fleet(cluster: Optional[Path], bandwidth: Optional[float], steps: int,
                    seed: int, out: Optional[Path], as_json: bool) -> None:
    """The fleet rehearsal: the plan's replicas training in virtual time against the
    best single pipeline, with and without W3 drops."""
    import json

    import p2pswarm
    from p2pswarm.errors import ConfigError

    if cluster is None:
        cluster = Path(p2pswarm.__file__).resolve().parent.parent / "simulations" / \
            "clusters" / "fleet.json"
        if not cluster.is_file():
            fail("no fleet file here: give one with --cluster FILE")
    if steps < 2 or steps > 10_000:
        fail(f"--steps must be from 2 to 10000, got {steps}", EXIT_USAGE)
    if bandwidth is not None and not 0 < bandwidth < 1e12:
        fail(f"--bandwidth must be a positive number of bytes/s, got {bandwidth}", EXIT_USAGE)
    try:
        data = json.loads(cluster.expanduser().read_text())
    except (OSError, ValueError) as exc:
        fail(f"cannot read --cluster {cluster}: {exc}", EXIT_USAGE)
    from p2pswarm.sim.fleet_rehearsal import markdown, rehearse, write_plot

    with exits_on(EXIT_USAGE, prefix=f"--cluster {cluster}: ", errors=(ConfigError,)):
        result = rehearse(data, bandwidth=bandwidth, single_steps=steps, seed=seed)
    notes: list[str] = []
    if out is not None:
        where = out.expanduser()
        where.mkdir(parents=True, exist_ok=True)
        (where / "result.json").write_text(json.dumps(result, indent=2) + "\n")
        (where / "report.md").write_text(markdown(result))
        note = write_plot(result, where / "loss.png")
        notes += [note] if note else []
    if as_json:
        typer.echo(json.dumps(result, indent=2))
    else:
        typer.echo(markdown(result), nl=False)
        if out is not None:
            typer.echo(f"wrote {out}/result.json, report.md" + ("" if notes else ", loss.png"))
    for note in notes:
        typer.echo(note, err=True)


@app.command()
@exits_on()
def simulate(
    scenario: str = typer.Argument(..., help="A scenario file, or a name in "
                                   "the scenario folder (e.g. w3, clean, smoke, real-bursts); "
                                   "fleet: the fleet training rehearsal."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Seed (default: the scenario's); "
                                       "the same seed replays exactly."),
    nodes: Optional[int] = typer.Option(None, "--nodes", help="How many fellows "
                                        "(default: the scenario's)."),
    duration: Optional[float] = typer.Option(None, "--duration", help="Virtual seconds to "
                                             "run (default: the scenario's)."),
    baseline: bool = typer.Option(False, "--baseline", help="Also run memberlist's LAN "
                                  "defaults and report both side by side."),
    out: Optional[Path] = typer.Option(None, "--out", help="Write result.json, report.md "
                                       "and PNG plots into this directory."),
    real: bool = typer.Option(False, "--real", help="Run real agent processes in network "
                              "namespaces (root, Linux), then the same scenario in virtual "
                              "time, and compare detection times."),
    plant: Optional[str] = typer.Option(None, "--plant", help="Plant a known bug "
                                        "(never-refutes, never-declares-dead) to see the "
                                        "oracle catch it: the run must FAIL."),
    progress: Optional[bool] = typer.Option(None, "--progress/--no-progress",
                                            help="Progress bar (default: on a terminal)."),
    cluster: Optional[Path] = typer.Option(None, "--cluster", help="fleet: the fleet "
                                           "file (default: simulations/clusters/fleet.json)."),
    bandwidth: Optional[float] = typer.Option(None, "--bandwidth", help="fleet: bytes/s of "
                                              "every link between two fellows, e.g. 1.25e6."),
    steps: int = typer.Option(40, "--steps", help="fleet: steps of the single pipeline; "
                              "its final loss is the target."),
    as_json: bool = JsonOption,
) -> None:
    """Run a WiFi-dropout scenario on real agents in virtual time, judge it against the
    truth, and report (exit 1 if the oracle finds a failure). `simulate fleet` rehearses
    the fleet training plan instead (see docs/training.md)."""
    if scenario == "fleet":
        _simulate_fleet(cluster, bandwidth, steps, seed or 0, out, as_json)
        return
    from p2pswarm.sim.harness import run_scenario, variant_for
    from p2pswarm.sim.metrics import ks_two_sample
    from p2pswarm.sim.report import markdown, public, to_json, write_reports
    from p2pswarm.sim.scenario import load_scenario

    with exits_on(EXIT_USAGE):
        chosen = load_scenario(scenario).with_overrides(nodes=nodes, duration_s=duration,
                                                        seed=seed)
        variant_for(chosen, "ours", plant)
        if real:
            from p2pswarm.sim.netns import MAX_FELLOWS, missing_requirements
            why = missing_requirements()
            if why is not None:
                fail(why)
            if chosen.nodes > MAX_FELLOWS:
                fail(f"real mode runs at most {MAX_FELLOWS} fellows; this scenario has "
                     f"{chosen.nodes} (use --nodes)")
    bar = _sim_progress(progress, chosen.name)
    results: list[dict[str, Any]] = []
    comparison: Optional[dict[str, Any]] = None
    try:
        if bar is not None:
            bar.start()
        with exits_on(EXIT_FAILURE):
            if real:
                from p2pswarm.sim.netns import run_real
                results.append(_sim_run(lambda p: run_real(chosen, p), bar, "real"))
            results.append(_sim_run(lambda p: run_scenario(chosen, "ours", planted=plant,
                                                           progress=p), bar, "ours"))
            if baseline:
                results.append(_sim_run(lambda p: run_scenario(chosen, "baseline",
                                                               planted=plant, progress=p),
                                        bar, "baseline"))
    except KeyboardInterrupt:
        fail("interrupted", EXIT_FAILURE)
    finally:
        if bar is not None:
            bar.stop()
    if real:
        comparison = {"detection_ks": ks_two_sample(results[0]["_detect"],
                                                    results[1]["_detect"])}
    notes: list[str] = []
    if out is not None:
        notes = write_reports(results, out.expanduser())
    if as_json:
        doc: Any = [public(r) for r in results] if len(results) > 1 else public(results[0])
        if comparison is not None:
            doc = {"runs": doc, "comparison": comparison}
        typer.echo(to_json(doc))
    else:
        typer.echo(markdown(results), nl=False)
        if comparison is not None:
            ks = comparison["detection_ks"]
            typer.echo(f"detection time, real against virtual: two-sample KS D = "
                       f"{ks['statistic']:.3f}, p = {ks['p_value']:.3g} "
                       f"(n = {ks['n']}, m = {ks['m']}; {ks['method']})")
        if out is not None:
            written = "result.json, report.md" + ("" if notes else " and plots")
            typer.echo(f"wrote {out}/{written}")
    for note in notes:
        typer.echo(note, err=True)
    if not all(r["ok"] for r in results):
        raise typer.Exit(EXIT_FAILURE)
