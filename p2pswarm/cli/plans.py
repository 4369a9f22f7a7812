"""Planning: `plan` (where a model would run, online or offline against a cluster file)
and `cluster export` / `cluster check` (the cluster view as a file)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import typer

from p2pswarm.cli.app import HomeOption, JsonOption, app, home_dir, print_json
from p2pswarm.cli.exits import EXIT_FAILURE, exits_on, fail
from p2pswarm.cli.local_agent import agent_answer
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
from p2pswarm.errors import ConfigError

_PLAN_HELP_MODEL = "Model directory, config.json path, or built-in name (e.g. tiny-llama)."


def _read_cluster_file(path: Path) -> Any:
    from p2pswarm.planner import cluster_from_dict

    try:
        data = json.loads(path.expanduser().read_text())
    except OSError as exc:
        fail(f"cannot read --cluster {path}: {exc.strerror}; export one with "
             f"`p2pswarm cluster export --out FILE`")
    except (ValueError, RecursionError) as exc:  # RecursionError: nested too deep
        fail(f"--cluster {path} is not JSON ({exc}): see docs/planner.md for the format")
    with exits_on(prefix=f"--cluster {path}: ", errors=(ConfigError,)):
        return cluster_from_dict(data)


@app.command()
@exits_on()
def plan(
    model: str = typer.Argument(..., help=_PLAN_HELP_MODEL),
    context: Optional[int] = ContextOption,
    sequences: int = SequencesOption,
    stages: Optional[int] = StagesOption,
    weights_dtype: Optional[str] = WeightsDtypeOption,
    kv_dtype: str = KvDtypeOption,
    maximize: Optional[str] = typer.Option(None, "--maximize",
                                           help="speed, context (serve) or seq_len (train)."),
    exclude: list[str] = ExcludeOption,
    floor: list[str] = FloorOption,
    train: bool = typer.Option(False, "--train", help="Plan a training job, not serving."),
    seq_len: Optional[int] = typer.Option(None, "--seq-len", help="Training sequence length."),
    micro_batch: str = typer.Option("auto", "--micro-batch", help="Sequences per "
                                    "micro-batch, or auto (the default): each replica's "
                                    "from its cards' memory and speed."),
    replicas: str = typer.Option("auto", "--replicas", help="Training: DiLoCo replicas, "
                                 "auto (as many as raise the fleet's tokens/s) or a number."),
    inner_steps: str = typer.Option("auto", "--inner-steps", help="Training: local steps "
                                    "of the fastest replica per sync round, or auto (the "
                                    "default): enough that a round's sync is at most a "
                                    "third of its compute on the links."),
    codec: str = typer.Option("int8", "--codec", help="Training: how replicas' deltas "
                              "travel: fp32, fp16, int8, topk or qsgd."),
    micro_batches: int = typer.Option(1, "--micro-batches", help="Micro-batches per step."),
    steps: int = typer.Option(1000, "--steps", help="Training steps (for the time estimate)."),
    optimizer: str = typer.Option("adamw", "--optimizer", help="adamw or sgd."),
    lora_rank: Optional[int] = typer.Option(None, "--lora-rank", help="Train LoRA adapters "
                                            "of this rank instead of all weights."),
    lora_targets: str = typer.Option("q_proj,v_proj", "--lora-targets",
                                     help="Modules LoRA adapts, comma-separated."),
    no_checkpointing: bool = typer.Option(False, "--no-checkpointing",
                                          help="Keep all activations (no recomputation)."),
    cluster: Optional[Path] = typer.Option(None, "--cluster", help="Plan offline against a "
                                           "cluster file instead of asking the agent."),
    home: Optional[Path] = HomeOption,
    as_json: bool = JsonOption,
) -> None:
    """Show where MODEL would run: which fellow runs which layers on which card, and what
    each card then holds. Exits 1 when the plan does not fit."""
    from p2pswarm.models.files import read_model_config
    from p2pswarm.models.pth_cache import PTH_DIR, offered_model
    from p2pswarm.planner import plan as make_plan
    from p2pswarm.planner import plan_fleet, profile_from_config, request_from_dict
    from p2pswarm.planner.fleet import fleet_request_from_dict

    request: dict[str, Any] = {
        "kind": "train" if train else "serve", "stages": stages, "kv_dtype": kv_dtype,
        "weights_dtype": weights_dtype, "maximize": maximize, "exclude": list(exclude),
        "floors_bytes": floors(floor),
    }
    if train:
        request.update(seq_len=seq_len, micro_batch=_batch_option(micro_batch),
                       micro_batches=micro_batches, replicas=_replicas_option(replicas),
                       inner_steps=_auto_or_number(inner_steps, "--inner-steps"),
                       codec=codec,
                       steps=steps, optimizer=optimizer, checkpointing=not no_checkpointing,
                       method="lora" if lora_rank is not None else "full")
        if lora_rank is not None:
            request.update(lora_rank=lora_rank,
                           lora_targets=[t.strip() for t in lora_targets.split(",") if t.strip()])
    else:
        if seq_len is not None or lora_rank is not None:
            fail("--seq-len and --lora-rank are training options: add --train")
        request.update(context=context, sequences=sequences)
    model = offered_model(model, home_dir(home) / PTH_DIR)  # an RWKV .pth: converted once
    name, config = read_model_config(model)
    profile = profile_from_config(config, name)
    if train:
        fleet, rest = fleet_request_from_dict(request)
        checked = request_from_dict(rest)
    else:
        checked = request_from_dict(request)
    if cluster is not None:
        view = _read_cluster_file(cluster)
        result = (plan_fleet(profile, view, checked, fleet) if train
                  else make_plan(profile, view, checked)).to_dict()
    else:
        message = {"model": {"name": name, "config": config}, **request}
        result = agent_answer(home, {"op": "plan", "request": message},
                              ", or plan offline with --cluster FILE")
    if as_json:
        print_json(result)
    else:
        from rich.console import Console

        from p2pswarm.cli.render import print_any_plan
        print_any_plan(result, Console())
    if not result.get("fits", False):
        raise typer.Exit(EXIT_FAILURE)


def _batch_option(value: str) -> Any:
    """``--micro-batch``: a whole number or auto."""
    if value == "auto":
        return value
    if not value.isdigit():
        fail(f"--micro-batch must be a whole number or auto, got {value[:40]!r}")
    return int(value)


def _auto_or_number(value: str, flag: str) -> Any:
    """A flag that takes auto or a whole number."""
    if value == "auto":
        return value
    if not value.isdigit() or int(value) < 1:
        fail(f"{flag} must be auto or a whole number from 1, got {value[:40]!r}")
    return int(value)


def _replicas_option(value: str) -> Any:
    """``--replicas``: auto or a whole number."""
    if value == "auto":
        return value
    if not value.isdigit():
        fail(f"--replicas must be auto or a whole number, got {value[:40]!r}")
    return int(value)


cluster_app = typer.Typer(help="The cluster view the planner plans on, as a file.",
                          no_args_is_help=True)
app.add_typer(cluster_app, name="cluster")


@cluster_app.command("export")
@exits_on()
def cluster_export(
    out: Optional[Path] = typer.Option(None, "--out", help="Write here (default: stdout)."),
    home: Optional[Path] = HomeOption,
) -> None:
    """Write the agent's current view of the swarm as a cluster file (for `plan --cluster`)."""
    data = agent_answer(home, {"op": "cluster"}, "")
    text = json.dumps(data, indent=2)
    if out is None:
        typer.echo(text)
        return
    try:
        out.expanduser().write_text(text + "\n")
    except OSError as exc:
        fail(f"cannot write --out {out}: {exc.strerror}")
    typer.echo(f"wrote {out}", err=True)


@cluster_app.command("check")
@exits_on()
def cluster_check(path: Path = typer.Argument(..., help="A cluster file."),
                  as_json: bool = JsonOption) -> None:
    """Read a cluster file, say what is wrong with it, or print it back in canonical form."""
    view = _read_cluster_file(path)
    if as_json:
        print_json(view.to_dict())
        return
    n_cards = sum(len(f.cards) for f in view.fellows)
    typer.echo(f"{path}: {len(view.fellows)} fellows, {n_cards} cards")
