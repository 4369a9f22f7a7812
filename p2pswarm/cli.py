"""The `p2pswarm` command line (typer).

The only place that reads environment variables and turns errors into exit codes and
human text. Every command that prints data takes `--json`.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, NoReturn, Optional

import logging
import socket

import trio
import typer

from p2pswarm import __version__
from p2pswarm.agent.node import NodeSettings, run_node
from p2pswarm.config import DEFAULT_PORT, preset, split_addr
from p2pswarm.control.client import request as control_request
from p2pswarm.errors import ConfigError, ControlError, SwarmError
from p2pswarm.home import Home
from p2pswarm.inventory import local_card_source
from p2pswarm.security import SwarmSecret

app = typer.Typer(
    name="p2pswarm",
    help="Pool mismatched machines into one swarm that serves and trains models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

EXIT_USAGE = 2  # bad argument or configuration: the message says how to fix it
EXIT_FAILURE = 1  # the swarm could not do what was asked


def fail(message: str, code: int = EXIT_USAGE) -> NoReturn:
    """One line on stderr, no traceback."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def home_dir(home: Optional[Path]) -> Path:
    """--home, else $P2PSWARM_HOME, else ~/.p2pswarm."""
    if home is not None:
        return home.expanduser()
    env = os.environ.get("P2PSWARM_HOME")
    return Path(env).expanduser() if env else Path.home() / ".p2pswarm"


def print_json(data: Any) -> None:
    typer.echo(json.dumps(data, indent=2, sort_keys=False))


HomeOption = typer.Option(None, "--home", help="State directory (default $P2PSWARM_HOME or ~/.p2pswarm).")
JsonOption = typer.Option(False, "--json", help="Print machine-readable JSON.")


def _version(value: bool) -> None:
    if value:
        typer.echo(f"p2pswarm {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                 help="Print the version and exit."),
) -> None:
    """Pool mismatched machines into one swarm that serves and trains models."""


def seed_list(seeds: list[str]) -> tuple[str, ...]:
    out = []
    for seed in seeds:
        host, port = split_addr(seed)
        out.append(f"{host}:{port}")
    return tuple(out)


def read_token(token: Optional[str]) -> Optional[str]:
    """--token, else $P2PSWARM_TOKEN, else the file named by $P2PSWARM_TOKEN_FILE."""
    if token:
        return token
    if os.environ.get("P2PSWARM_TOKEN"):
        return os.environ["P2PSWARM_TOKEN"]
    path = os.environ.get("P2PSWARM_TOKEN_FILE")
    if path:
        try:
            return Path(path).read_text().strip()
        except OSError as exc:
            fail(f"cannot read P2PSWARM_TOKEN_FILE {path}: {exc.strerror}")
    return None


@app.command()
def init(
    home: Optional[Path] = HomeOption,
    force: bool = typer.Option(False, "--force", help="Replace a swarm already in --home."),
    as_json: bool = JsonOption,
) -> None:
    """Make a new swarm: a secret in the state directory, and a join token to share."""
    directory = home_dir(home)
    try:
        secret = Home(directory).init(force=force)
    except SwarmError as exc:
        fail(str(exc))
    token = secret.token()
    if as_json:
        print_json({"home": str(directory), "token": token})
        return
    typer.echo(f"New swarm in {directory}.\nJoin token (keep it secret; anyone holding it "
               f"can join):\n\n  {token}\n\nOn every machine:  p2pswarm join SEED:7946 "
               f"--token {token}")


@app.command()
def join(
    seeds: list[str] = typer.Argument(None, help="HOST:PORT of fellows already in the swarm."),
    token: Optional[str] = typer.Option(None, "--token", help="Join token from `p2pswarm init` "
                                        "(or $P2PSWARM_TOKEN)."),
    listen: str = typer.Option(f"0.0.0.0:{DEFAULT_PORT}", "--listen",
                               help="HOST:PORT to listen on (UDP and TCP)."),
    advertise: Optional[str] = typer.Option(None, "--advertise",
                                            help="HOST:PORT fellows should reach this one at."),
    name: Optional[str] = typer.Option(None, "--name", help="This fellow's name (hostname)."),
    preset_name: str = typer.Option("lan", "--preset", help="Timings: lan, wifi or local."),
    leader_priority: int = typer.Option(0, "--leader-priority", min=0, max=255,
                                        help="Prefer this fellow as leader (higher wins)."),
    gpus: Optional[str] = typer.Option(None, "--gpus", help="Offer only these GPUs, e.g. 0,2."),
    cpu_memory: Optional[str] = typer.Option(None, "--cpu-memory",
                                             help="Offer at most this much RAM, e.g. 6GB."),
    no_cpu: bool = typer.Option(False, "--no-cpu", help="Do not offer the CPU as a card."),
    home: Optional[Path] = HomeOption,
    log_level: str = typer.Option("info", "--log-level", help="debug, info or warning."),
) -> None:
    """Run this machine's agent in the foreground and join the swarm (Ctrl-C leaves)."""
    directory = home_dir(home)
    try:
        config = preset(preset_name)
        seed_addrs = seed_list(seeds or [])
        split_addr(listen)
        if advertise:
            split_addr(advertise)
        text = read_token(token)
        state = Home(directory)
        if text is not None:
            state.join_swarm(SwarmSecret.from_token(text))
        state.load_keyring()  # refuse early: no swarm, or key files others can read
        cards = local_card_source(gpus=gpus, cpu_memory=cpu_memory, no_cpu=no_cpu,
                                  own_pids=[os.getpid()])
        settings = NodeSettings(home=directory, listen=listen, seeds=seed_addrs,
                                name=name or socket.gethostname(), config=config,
                                advertise=advertise, leader_priority=leader_priority,
                                card_source=cards)
    except SwarmError as exc:
        fail(str(exc))
    setup_logging(log_level)
    try:
        trio.run(run_node, settings)
    except KeyboardInterrupt:
        pass
    except SwarmError as exc:
        fail(str(exc), EXIT_FAILURE)


@app.command()
def leave(home: Optional[Path] = HomeOption) -> None:
    """Make the local agent leave the swarm gracefully (fellows mark it `left`) and exit."""
    ask_agent(home, {"op": "leave"})
    typer.echo("leaving the swarm")


def setup_logging(level: str) -> None:
    levels = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING}
    if level not in levels:
        fail(f"unknown --log-level {level!r}: use debug, info or warning")
    logging.basicConfig(level=levels[level], stream=sys.stderr,
                        format="%(asctime)s %(levelname)-7s %(message)s", datefmt="%H:%M:%S")


def ask_agent(home: Optional[Path], request: dict[str, Any], timeout_s: float = 30.0) -> Any:
    try:
        return control_request(home_dir(home), request, timeout_s)
    except ControlError as exc:
        fail(str(exc), EXIT_FAILURE)


@app.command()
def status(home: Optional[Path] = HomeOption, as_json: bool = JsonOption) -> None:
    """Show this fellow, the fellows it knows, the leader and traffic counters."""
    data = ask_agent(home, {"op": "status"})
    if as_json:
        print_json(data)
        return
    render_status(data)


def card_summary(card: dict[str, Any]) -> str:
    """``GPU 0 3.9/4.3 GB free`` / ``CPU 11.2/16.7 GB free``."""
    label = f"GPU {card.get('index', 0)}" if card.get("kind") == "cuda" else "CPU"
    free, total = card.get("free_bytes", 0) / 1e9, card.get("total_bytes", 0) / 1e9
    return f"{label} {free:.1f}/{total:.1f} GB free"


def render_status(data: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    me = data["self"]
    leader = data.get("leader")
    console.print(f"[bold]{me['name']}[/] ({me['id'][:8]}) at {me['addr']}, "
                  f"preset {data.get('preset')}, health {data.get('health', 0)}")
    if leader:
        console.print(f"leader: [bold]{leader['name']}[/] ({leader['id'][:8]}), "
                      f"term {leader['term']}")
    else:
        console.print(f"leader: {data.get('leader_note') or 'none yet'}")
    table = Table(title=f"{len(data['members'])} fellows")
    for column in ("name", "id", "address", "state", "inc", "cards", "last heard"):
        table.add_column(column)
    for m in data["members"]:
        cards = ", ".join(card_summary(c) for c in m.get("cards", [])) or "-"
        heard = m.get("last_heard_s")
        name = m["name"] + (" (this one)" if m.get("self") else "")
        table.add_row(name, m["id"][:8], m["addr"], m["state"], str(m["incarnation"]),
                      cards, "-" if heard is None else f"{heard:.1f} s ago")
    console.print(table)
    counters = data.get("counters", {})
    drops = counters.get("drops") or {}
    console.print(
        f"datagrams in/out {counters.get('datagrams_in', 0)}/{counters.get('datagrams_out', 0)}"
        f", streams in/out {counters.get('streams_in', 0)}/{counters.get('streams_out', 0)}"
        + (", drops: " + ", ".join(f"{k} {v}" for k, v in drops.items()) if drops else ""))


@app.command()
def demo(
    fellows: int = typer.Option(3, "--fellows", min=2, max=16, help="How many fellows to start."),
    keep: bool = typer.Option(False, "--keep", help="Keep the temporary state and logs."),
    as_json: bool = JsonOption,
) -> None:
    """Start a local swarm of fellows as separate processes on loopback, show it, clean up."""
    from p2pswarm.demo import run_demo

    say = (lambda text: typer.echo(text, err=True)) if as_json else typer.echo
    try:
        result = run_demo(say, (lambda data: None) if as_json else render_status,
                          fellows=fellows, keep=keep)
    except SwarmError as exc:
        fail(str(exc), EXIT_FAILURE)
    if as_json:
        print_json(result)


# --- planning commands (plan, bench, cluster) ---

_PLAN_HELP_MODEL = "Model directory, config.json path, or built-in name (e.g. tiny-llama)."


def _agent_answer(home: Optional[Path], message: dict[str, Any], offline_hint: str) -> Any:
    """The local agent's answer to a planning op; no agent -> one line saying what to do."""
    directory = home_dir(home)
    try:
        from p2pswarm.control.client import request as agent_request
    except ImportError:
        fail(f"no agent running in {directory}: start one with `p2pswarm join`{offline_hint}",
             EXIT_FAILURE)
    try:
        return agent_request(directory, message)
    except ControlError as exc:
        text = str(exc)
        if text.startswith("no agent running"):
            fail(f"no agent running in {directory}: start one with `p2pswarm join`"
                 f"{offline_hint}", EXIT_FAILURE)
        fail(text, EXIT_FAILURE)
    except ConfigError as exc:
        fail(str(exc))
    except SwarmError as exc:
        fail(str(exc), EXIT_FAILURE)


def _read_cluster_file(path: Path) -> Any:
    from p2pswarm.planner import cluster_from_dict

    try:
        data = json.loads(path.expanduser().read_text())
    except OSError as exc:
        fail(f"cannot read --cluster {path}: {exc.strerror}; export one with "
             f"`p2pswarm cluster export --out FILE`")
    except ValueError as exc:
        fail(f"--cluster {path} is not JSON ({exc}): see docs/planner.md for the format")
    try:
        return cluster_from_dict(data)
    except ConfigError as exc:
        fail(f"--cluster {path}: {exc}")


def _floors(items: list[str]) -> dict[str, str]:
    floors = {}
    for item in items:
        kind, sep, size = item.partition("=")
        if not sep or kind not in ("cuda", "cpu") or not size:
            fail(f"--floor {item!r} must be KIND=SIZE with KIND cuda or cpu, e.g. cuda=2GB")
        floors[kind] = size
    return floors


@app.command()
def plan(
    model: str = typer.Argument(..., help=_PLAN_HELP_MODEL),
    context: Optional[int] = typer.Option(None, "--context", help="Context tokens per "
                                          "sequence (default: 4096 or the model's maximum)."),
    sequences: int = typer.Option(1, "--sequences", help="Sequences decoded together."),
    stages: Optional[int] = typer.Option(None, "--stages", help="Fix the number of stages."),
    weights_dtype: Optional[str] = typer.Option(None, "--weights-dtype",
                                                help="f32, f16, bf16, int8 or int4."),
    kv_dtype: str = typer.Option("f16", "--kv-dtype", help="f32, f16, bf16 or int8."),
    maximize: Optional[str] = typer.Option(None, "--maximize",
                                           help="speed, context (serve) or seq_len (train)."),
    exclude: list[str] = typer.Option([], "--exclude", help="Leave a card out: FELLOW:INDEX "
                                      "or FELLOW:cpu (repeatable)."),
    floor: list[str] = typer.Option([], "--floor", help="Least free memory a card needs, "
                                    "per kind: cuda=2GB, cpu=1GB (repeatable)."),
    train: bool = typer.Option(False, "--train", help="Plan a training job, not serving."),
    seq_len: Optional[int] = typer.Option(None, "--seq-len", help="Training sequence length."),
    micro_batch: int = typer.Option(1, "--micro-batch", help="Sequences per micro-batch."),
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
    from p2pswarm.planner import plan as make_plan
    from p2pswarm.planner import profile_from_config, read_model_config, request_from_dict

    request: dict[str, Any] = {
        "kind": "train" if train else "serve", "stages": stages, "kv_dtype": kv_dtype,
        "weights_dtype": weights_dtype, "maximize": maximize, "exclude": list(exclude),
        "floors_bytes": _floors(floor),
    }
    if train:
        request.update(seq_len=seq_len, micro_batch=micro_batch, micro_batches=micro_batches,
                       steps=steps, optimizer=optimizer, checkpointing=not no_checkpointing,
                       method="lora" if lora_rank is not None else "full")
        if lora_rank is not None:
            request.update(lora_rank=lora_rank,
                           lora_targets=[t.strip() for t in lora_targets.split(",") if t.strip()])
    else:
        if seq_len is not None or lora_rank is not None:
            fail("--seq-len and --lora-rank are training options: add --train")
        request.update(context=context, sequences=sequences)
    try:
        name, config = read_model_config(model)
        profile = profile_from_config(config, name)
        checked = request_from_dict(request)
    except ConfigError as exc:
        fail(str(exc))
    if cluster is not None:
        view = _read_cluster_file(cluster)
        try:
            result = make_plan(profile, view, checked).to_dict()
        except ConfigError as exc:
            fail(str(exc))
        except SwarmError as exc:
            fail(str(exc), EXIT_FAILURE)
    else:
        message = {"model": {"name": name, "config": config}, **request}
        result = _agent_answer(home, {"op": "plan", "request": message},
                               ", or plan offline with --cluster FILE")
    if as_json:
        print_json(result)
    else:
        from rich.console import Console

        from p2pswarm.planner.render import print_plan
        print_plan(result, Console())
    if not result.get("fits", False):
        raise typer.Exit(EXIT_FAILURE)


def _local_cards(gpus: Optional[str], cpu_memory: Optional[str], no_cpu: bool) -> Any:
    from p2pswarm.inventory import local_card_source, read_inventory

    try:
        return read_inventory(local_card_source(gpus=gpus, cpu_memory=cpu_memory,
                                                no_cpu=no_cpu)).cards
    except ConfigError as exc:
        fail(str(exc))


GpusOption = typer.Option(None, "--gpus", help="Offer only these GPUs, e.g. 0,2 (none: no GPU).")
CpuMemoryOption = typer.Option(None, "--cpu-memory", help="Cap on the RAM offered, e.g. 6GB.")
NoCpuOption = typer.Option(False, "--no-cpu", help="Do not offer the CPU as a card.")


@app.command()
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
    try:
        speeds = benchmarks_for(found, BenchmarkCache(home_dir(home)))
    except ConfigError as exc:
        fail(str(exc))
    if as_json:
        print_json({"cards": [{**c.to_dict(), "benchmark": speeds[c.key].to_dict()}
                              for c in found]})
        return
    from rich.console import Console
    from rich.table import Table

    from p2pswarm.planner.wording import card_label, gb
    table = Table(title=f"{len(found)} card{'s' if len(found) != 1 else ''} on this machine")
    for column in ("card", "total", "free", "held by others", "TFLOP/s", "GB/s", "speed"):
        table.add_column(column)
    for c in found:
        bench = speeds[c.key]
        held = ", ".join(f"{h.name} {gb(h.held_bytes)}" for h in c.held_by_others) or "-"
        table.add_row(card_label(c.kind, c.index, c.name), gb(c.total_bytes), gb(c.free_bytes),
                      held, f"{bench.flops / 1e12:.2f}", f"{bench.mem_bandwidth / 1e9:.0f}",
                      "measured" if bench.measured else "estimate (run `p2pswarm bench`)")
    Console().print(table)


@app.command()
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
    try:
        speeds = benchmarks_for(found, BenchmarkCache(home_dir(home)), rerun=True,
                                seconds=seconds)
    except ConfigError as exc:
        fail(str(exc))
    if as_json:
        print_json({"benchmarks": {k: v.to_dict() for k, v in sorted(speeds.items())}})
        return
    from p2pswarm.planner.wording import card_label
    for c in found:
        b = speeds[c.key]
        typer.echo(f"{card_label(c.kind, c.index, c.name)}: {b.flops / 1e12:.3f} TFLOP/s "
                   f"({b.dtype} matmul), {b.mem_bandwidth / 1e9:.1f} GB/s")
    typer.echo(f"saved in {BenchmarkCache(home_dir(home)).path}")


cluster_app = typer.Typer(help="The cluster view the planner plans on, as a file.",
                          no_args_is_help=True)
app.add_typer(cluster_app, name="cluster")


@cluster_app.command("export")
def cluster_export(
    out: Optional[Path] = typer.Option(None, "--out", help="Write here (default: stdout)."),
    home: Optional[Path] = HomeOption,
) -> None:
    """Write the agent's current view of the swarm as a cluster file (for `plan --cluster`)."""
    data = _agent_answer(home, {"op": "cluster"}, "")
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
def cluster_check(path: Path = typer.Argument(..., help="A cluster file."),
                  as_json: bool = JsonOption) -> None:
    """Read a cluster file, say what is wrong with it, or print it back in canonical form."""
    view = _read_cluster_file(path)
    if as_json:
        print_json(view.to_dict())
        return
    n_cards = sum(len(f.cards) for f in view.fellows)
    typer.echo(f"{path}: {len(view.fellows)} fellows, {n_cards} cards")


# --- end planning commands ---


def main() -> None:
    """Console entry point: SwarmErrors become one line on stderr and an exit code."""
    try:
        app(standalone_mode=True)
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_USAGE)
    except SwarmError as exc:
        typer.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_FAILURE)


if __name__ == "__main__":
    main()
