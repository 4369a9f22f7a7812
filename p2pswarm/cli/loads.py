"""Serving placements: load a model across the swarm as planned (with per-fellow progress),
show what is loaded, unload."""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any, Optional

import typer

from p2pswarm.cli.app import HomeOption, JsonOption, app, home_dir, print_json
from p2pswarm.cli.exits import EXIT_FAILURE, EXIT_INTERRUPTED, exits_on
from p2pswarm.cli.local_agent import agent_answer, stream_agent
from p2pswarm.cli.plan_changed import explain_plan_changed
from p2pswarm.cli.plan_request import (
    ContextOption,
    ExcludeOption,
    FloorOption,
    KvDtypeOption,
    SequencesOption,
    StagesOption,
    WeightsDtypeOption,
    floors,
)
from p2pswarm.control.requests import request_map
from p2pswarm.wire.control import (
    LoadCancelRequest,
    LoadMoveRequest,
    LoadRequest,
    LoadsRequest,
    UnloadRequest,
)
from p2pswarm.wire.orders import pack_doc

_PLAN_HELP_MODEL_SERVE = ("Model directory (config.json and *.safetensors) or a name with "
                          "weights (tiny-llama, small-llama, tiny-rwkv7, demo-llama).")

_LOAD_TIMEOUT_S = 600.0  # the most a `load` waits between two words from its agent
_CANCEL_TIMEOUT_S = 60.0  # the most an interrupted `load` waits for its cancel


def _serve_message(model: str, context: Optional[int], sequences: int, stages: Optional[int],
                   weights_dtype: Optional[str], kv_dtype: str, maximize: Optional[str],
                   exclude: list[str], floor: list[str]) -> tuple[dict[str, Any], Optional[str]]:
    """The plan request a load sends, and the model's directory when MODEL is one."""
    from p2pswarm.models.files import model_directory, read_model_config
    from p2pswarm.planner import profile_from_config, request_from_dict

    request: dict[str, Any] = {
        "kind": "serve", "stages": stages, "kv_dtype": kv_dtype, "weights_dtype": weights_dtype,
        "maximize": maximize, "exclude": list(exclude), "floors_bytes": floors(floor),
        "context": context, "sequences": sequences,
    }
    name, config = read_model_config(model)
    profile_from_config(config, name)
    request_from_dict(request)
    path = model_directory(model)
    return {"model": {"name": name, "config": config}, **request}, path


class _LoadProgress:
    """Per-fellow progress of a load: bars on a terminal, a line per step elsewhere."""

    def __init__(self, console: Any) -> None:
        from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn

        self.console = console
        self.bars = Progress(TextColumn("{task.description}"), BarColumn(),
                             DownloadColumn(), TextColumn("{task.fields[phase]}"),
                             console=console, transient=False) if console.is_terminal else None
        self.tasks: dict[tuple[int, str], Any] = {}
        self.said: dict[tuple[int, str], tuple[str, int]] = {}

    def __enter__(self) -> _LoadProgress:
        if self.bars is not None:
            self.bars.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bars is not None:
            self.bars.stop()

    def __call__(self, event: dict[str, Any]) -> None:
        p = event.get("progress")
        if not isinstance(p, dict):
            return
        key = (int(p.get("stage", 0)), str(p.get("fellow", "?")))
        phase, done, total = str(p.get("phase")), int(p.get("done_bytes", 0)), \
            int(p.get("total_bytes", 0))
        if self.bars is not None:
            if key not in self.tasks:
                self.tasks[key] = self.bars.add_task(f"stage {key[0]} on {key[1]}",
                                                     total=total or None, phase=phase)
            self.bars.update(self.tasks[key], completed=done, total=total or None, phase=phase)
            return
        quarter = 4 * done // total if total else 0
        if self.said.get(key) == (phase, quarter):
            return
        self.said[key] = (phase, quarter)
        words = {"checked": "checked, memory reserved", "loading": "loading",
                 "fetching": f"fetching weights {done / 1e6:,.1f} / {total / 1e6:,.1f} MB",
                 "ready": f"ready, {done / 1e6:,.1f} MB allocated "
                          f"(plan claimed {total / 1e6:,.1f} MB)"}
        self.console.print(f"  stage {key[0]} on {key[1]}: {words.get(phase, phase)}",
                           markup=False)


def print_load(record: dict[str, Any], console: Any) -> None:
    from rich.markup import escape
    from rich.table import Table
    from rich.text import Text

    stages = record.get("stages", [])
    load_s = record.get("load_s")
    # model, adapter, fellow and card names come from fellows: text, never markup
    console.print(f"loaded plan [bold]{escape(str(record['plan_id']))}[/] "
                  f"({escape(str(record['model'].get('name')))}): "
                  f"{len(stages)} stages" + (f" in {load_s:.1f} s" if load_s else ""))
    adapter = record.get("adapter")
    if isinstance(adapter, dict):
        console.print(f"  with LoRA adapter {adapter.get('name')} (rank {adapter.get('rank')}, "
                      f"{', '.join(map(str, adapter.get('targets') or []))}; sha256 "
                      f"{str(adapter.get('sha256', ''))[:16]}), merged into the weights",
                      markup=False)
    from p2pswarm.cli.render import amount

    table = Table()
    # at 80 columns: names fold rather than lose their ends; figures never wrap
    for column in ("stage", "fellow", "card", "layers", "allocated", "claimed", "fetched",
                   "state"):
        figure = column in ("allocated", "claimed", "fetched")
        table.add_column(column, overflow="fold", no_wrap=figure or column == "layers",
                         justify="right" if figure else "left")
    for s in stages:
        a, b = s["layers"]
        table.add_row(str(s["stage"]), Text(str(s["fellow"])), Text(str(s.get("card", ""))),
                      f"{a}-{b - 1}", amount(int(s.get("allocated_bytes", 0))),
                      amount(int(s.get("claim_bytes", 0))),
                      amount(int(s.get("fetched_bytes", 0))) if "fetched_bytes" in s else "-",
                      Text(str(s.get("state", "alive"))))
    console.print(table)
    _print_moves(record, console)


def _print_moves(record: dict[str, Any], console: Any) -> None:
    """A load a new leader took over, each stage the leader moved (failover), and what a
    load waits for."""
    import datetime

    adopted = record.get("adopted")
    if isinstance(adopted, dict):
        when = datetime.datetime.fromtimestamp(float(adopted.get("at", 0.0)))
        console.print(f"  led by {adopted.get('leader')} since {when:%H:%M:%S} (taken over "
                      f"in term {adopted.get('term')} from its fellows' stage orders)",
                      markup=False, highlight=False)
    for move in record.get("moves") or []:
        when = datetime.datetime.fromtimestamp(float(move.get("at", 0.0)))
        if move.get("recut"):
            console.print(f"  re-cut at {when:%H:%M:%S} from plan {move.get('from_plan')} "
                          f"({move.get('stages_before')} stages) into "
                          f"{_new_cut(move.get('stages'))} in "
                          f"{float(move.get('took_s', 0.0)):.1f} s: {move.get('why')}",
                          markup=False, highlight=False)
            continue
        console.print(f"  moved stage {move.get('stage')} at {when:%H:%M:%S} from "
                      f"{move.get('from')} to {move.get('to')} ({move.get('card')}) in "
                      f"{float(move.get('took_s', 0.0)):.1f} s: {move.get('why')}",
                      markup=False, highlight=False)
    copies = copies_line(record.get("copies"))
    if copies:
        console.print(f"  copies: {copies}", markup=False, highlight=False)
    if record.get("waiting"):
        console.print(f"  waiting: {record['waiting']}", markup=False, highlight=False)
    faster = record.get("faster")
    if isinstance(faster, dict) and faster.get("plan_id"):
        console.print(f"  faster: plan {faster['plan_id']}, {_new_cut(faster.get('stages'))}, "
                      f"would take a token from {faster.get('ms_per_token_now')} to "
                      f"{faster.get('ms_per_token_after')} ms (estimated); move it live: "
                      f"p2pswarm load --move {faster['plan_id']}", markup=False,
                      highlight=False)
    elif isinstance(faster, dict):
        where = ", ".join(f"stage {m.get('stage')} to {m.get('to')} ({m.get('card')})"
                          for m in faster.get("moves") or [])
        console.print(f"  faster: {where} would take a token from "
                      f"{faster.get('ms_per_token_now')} to {faster.get('ms_per_token_after')} "
                      f"ms (estimated); move it live: p2pswarm load --move "
                      f"{record['plan_id']}", markup=False, highlight=False)


def copies_line(copies: Any) -> str:
    """Which fellow outside each stage holds a copy of its tensors (failover fetches them
    there when the stage's fellow and the model's offerer are both gone)."""
    parts = []
    for c in copies if isinstance(copies, list) else []:
        if isinstance(c, dict):
            state = "" if c.get("state") == "held" else f" ({c.get('state')})"
            parts.append(f"stage {c.get('stage')} on {c.get('fellow')}{state}")
    return ", ".join(parts)


def _span(layers: Any) -> str:
    """Layers [a, b) as people count them: ``a-(b-1)``."""
    if isinstance(layers, list) and len(layers) == 2 and all(isinstance(x, int)
                                                            for x in layers):
        return f"{layers[0]}-{layers[1] - 1}"
    return "?"


def _new_cut(stages: Any) -> str:
    """A cut in words: ``1 stage: layers 0-7 on gpu-box (RTX 3060)``."""
    stages = stages if isinstance(stages, list) else []
    parts = [f"layers {_span(s.get('layers'))} on {s.get('fellow')} ({s.get('card')})"
             for s in stages if isinstance(s, dict)]
    return f"{len(stages)} stage{'s' if len(stages) != 1 else ''}: " + "; ".join(parts)


def print_moved(doc: dict[str, Any], console: Any) -> None:
    """What ``load --move`` did: the new cut, or one line per stage moved."""
    moved = [m for m in doc.get("moved") or [] if isinstance(m, dict)]
    if not moved:
        print_load(doc, console)
        return
    say = {"markup": False, "highlight": False}
    if moved[0].get("recut"):
        m = moved[0]
        console.print(f"moved plan {m.get('from_plan')} live to plan {m.get('to_plan')} in "
                      f"{float(m.get('took_s', 0.0)):.1f} s: {m.get('stages_before')} stages "
                      f"-> {len(m.get('stages') or [])}, {m.get('ms_per_token_now')} -> "
                      f"{m.get('ms_per_token_after')} ms a token (estimated)", **say)
        for s in [s for s in m.get("stages") or [] if isinstance(s, dict)]:
            console.print(f"  stage {s.get('stage')}: layers {_span(s.get('layers'))} on "
                          f"{s.get('fellow')} ({s.get('card')})", **say)
        return
    console.print(f"moved {len(moved)} stage{'s' if len(moved) != 1 else ''} of plan "
                  f"{doc.get('plan_id')} live:", **say)
    for m in moved:
        console.print(f"  stage {m.get('stage')} (layers {_span(m.get('layers'))}): "
                      f"{m.get('from')} -> {m.get('to')} ({m.get('card')}) in "
                      f"{float(m.get('took_s', 0.0)):.1f} s", **say)


@app.command()
@exits_on()
def load(
    model: Optional[str] = typer.Argument(None, help=_PLAN_HELP_MODEL_SERVE),
    show_plan: bool = typer.Option(False, "--plan", help="Print the plan and its plan_id; "
                                   "load nothing (the same as `p2pswarm plan`)."),
    plan_id: Optional[str] = typer.Option(None, "--plan-id", help="Load exactly this plan, or "
                                          "refuse with what changed (plan-changed, 409)."),
    context: Optional[int] = ContextOption,
    sequences: int = SequencesOption,
    stages: Optional[int] = StagesOption,
    weights_dtype: Optional[str] = WeightsDtypeOption,
    kv_dtype: str = KvDtypeOption,
    maximize: Optional[str] = typer.Option(None, "--maximize", help="speed or context."),
    exclude: list[str] = ExcludeOption,
    floor: list[str] = FloorOption,
    adapter: Optional[Path] = typer.Option(None, "--adapter", help="Serve LoRA adapters on "
                                           "top of MODEL: a directory `p2pswarm jobs export` "
                                           "wrote (adapter_config.json and "
                                           "adapter_model.safetensors)."),
    move: Optional[str] = typer.Option(None, "--move", help="Move the running load PLAN_ID "
                                       "live to the faster placement `p2pswarm loads` "
                                       "shows; sessions go on."),
    home: Optional[Path] = HomeOption,
    as_json: bool = JsonOption,
) -> None:
    """Load MODEL across the swarm as planned, all or nothing (--plan-id: exactly that plan)."""
    from rich.console import Console

    from p2pswarm.errors import ConfigError, PlanChanged

    if move is not None:
        if not 1 <= len(move) <= 64:
            raise ConfigError("--move needs the plan_id of the load to move, as "
                              "`p2pswarm loads` shows it")
        moved = agent_answer(home, request_map("load_move", LoadMoveRequest(move)), "",
                             _LOAD_TIMEOUT_S)
        if as_json:
            print_json(moved)
        else:
            print_moved(moved, Console())
        return
    if model is None:
        raise ConfigError("load needs a MODEL (a model directory or a built-in name), or "
                          "--move PLAN_ID")
    from p2pswarm.models.pth_cache import PTH_DIR, offered_model

    model = offered_model(model, home_dir(home) / PTH_DIR)  # an RWKV .pth: converted once
    if not show_plan:
        from p2pswarm.models.files import weights_directory

        weights_directory(model)  # a shape-only name: what to give instead, before asking
    message, path = _serve_message(model, context, sequences, stages, weights_dtype, kv_dtype,
                                   maximize, exclude, floor)
    adapter_dir: Optional[str] = None
    if adapter is not None:
        from p2pswarm.agent.adapter import check_adapter, read_adapter

        found = read_adapter(adapter)
        check_adapter(found, message["model"]["config"], message["model"]["name"], path)
        adapter_dir = found.path
        message["adapter"] = found.sha256  # the plan, and its plan_id, name the adapter
    if show_plan:
        result = agent_answer(home, {"op": "plan", "request": message}, "")
        if as_json:
            print_json(result)
        else:
            from p2pswarm.cli.render import print_plan
            print_plan(result, Console())
        if not result.get("fits", False):
            raise typer.Exit(EXIT_FAILURE)
        return
    console = Console(stderr=as_json)
    load_id = secrets.token_hex(8)  # what an interrupted load is cancelled by
    try:
        with _LoadProgress(console) as progress:
            asked = LoadRequest(pack_doc(message), plan_id or "", path or "",
                                adapter_dir or "", load_id)
            record = stream_agent(home, request_map("load", asked), progress,
                                  _LOAD_TIMEOUT_S)
    except PlanChanged as exc:
        explain_plan_changed(exc, model, as_json)
    except KeyboardInterrupt:
        _cancel_load(home, load_id, console)
    if as_json:
        print_json(record)
        return
    print_load(record, console)
    console.print("generate with: p2pswarm generate \"Once upon a time\"")


def _cancel_load(home: Optional[Path], load_id: str, console: Any) -> None:
    """Ctrl-C during `load`: cancel it all or nothing, say what became of it, exit 130."""
    console.print("interrupted: cancelling the load, releasing every stage ...")
    try:
        result = agent_answer(home, request_map("load_cancel", LoadCancelRequest(load_id)),
                              "", _CANCEL_TIMEOUT_S)
    except KeyboardInterrupt:  # again: stop waiting; the agent goes on cancelling
        console.print("not waiting: the agent goes on cancelling it; `p2pswarm loads` shows "
                      "what is loaded")
        raise typer.Exit(EXIT_INTERRUPTED) from None
    plan, outcome = result.get("plan_id"), result.get("outcome")
    if outcome == "unloaded":
        console.print(f"load cancelled: plan {plan} had just come up, and is unloaded again; "
                      "nothing stays loaded")
    elif outcome == "unconfirmed":
        console.print("the leader did not confirm the cancel: see `p2pswarm loads` (fellows "
                      "drop stages that never start by themselves within 2 minutes)")
    else:
        console.print("load cancelled" + (f" (plan {plan})" if plan else "")
                      + ": nothing stays loaded")
    raise typer.Exit(EXIT_INTERRUPTED)


@app.command()
@exits_on()
def loads(home: Optional[Path] = HomeOption, as_json: bool = JsonOption) -> None:
    """Show what is loaded in the swarm: each load's plan_id, model, and where its stages run."""
    result = agent_answer(home, request_map("loads", LoadsRequest()), "")
    records = result.get("loads", [])
    if as_json:
        print_json(records)
        return
    from rich.console import Console

    console = Console()
    if not records:
        console.print("nothing is loaded; load a model with `p2pswarm load MODEL`")
        return
    for record in records:
        print_load(record, console)
        if not record.get("complete", True) and not record.get("waiting"):
            console.print("[bold red]incomplete:[/] a stage is missing or its fellow is gone; "
                          "the leader moves a lost stage to a spare card when one has room, "
                          f"else `p2pswarm unload {record['plan_id']}` and load again")


@app.command()
@exits_on()
def unload(
    plan_id: Optional[str] = typer.Argument(None, help="The load to drop (default: the only one)."),
    all_loads: bool = typer.Option(False, "--all", help="Unload everything."),
    home: Optional[Path] = HomeOption,
    as_json: bool = JsonOption,
) -> None:
    """Free the stages of a load on every fellow."""
    result = agent_answer(home, request_map("unload", UnloadRequest(plan_id or "", all_loads)),
                          "")
    if as_json:
        print_json(result)
        return
    gone = result.get("unloaded", [])
    typer.echo(f"unloaded {', '.join(gone)}" if gone else "nothing was loaded")
