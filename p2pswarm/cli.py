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
from p2pswarm.http.app import http_settings
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
# what a plan asks for, shared by `plan` and `load`
ContextOption = typer.Option(None, "--context", help="Context tokens per sequence (default: "
                             "4096 or the model's maximum).")
SequencesOption = typer.Option(1, "--sequences", help="Sequences decoded together.")
StagesOption = typer.Option(None, "--stages", help="Fix the number of stages.")
WeightsDtypeOption = typer.Option(None, "--weights-dtype", help="f32, f16, bf16, int8 or int4.")
KvDtypeOption = typer.Option("f16", "--kv-dtype", help="f32, f16, bf16 or int8.")
ExcludeOption = typer.Option([], "--exclude", help="Leave a card out: FELLOW:INDEX or "
                             "FELLOW:cpu (repeatable).")
FloorOption = typer.Option([], "--floor", help="Least free memory a card needs, per kind: "
                           "cuda=2GB, cpu=1GB (repeatable).")


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
    http: Optional[str] = typer.Option(None, "--http", help="ADDR:PORT of the HTTP API, pages "
                                       "and OpenAI endpoint (default 127.0.0.1:7780), or off."),
    http_token: Optional[str] = typer.Option(None, "--http-token", help="Bearer token the HTTP "
                                             "API requires; needed beyond loopback."),
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
        http_server = http_settings(http, http_token)
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
                                card_source=cards, http=http_server)
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
    train: bool = typer.Option(False, "--train", help="Train a small model across the "
                               "fellows on the shipped corpus, then serve it."),
    steps: Optional[int] = typer.Option(None, "--steps", min=1, help="With --train: "
                                        "optimizer steps (default 300, about a minute)."),
    as_json: bool = JsonOption,
) -> None:
    """Serve a model no fellow could hold alone: a temporary swarm of fellows as separate
    processes on loopback loads it across all of them and generates; then it cleans up.
    With --train the swarm first trains the model it then serves."""
    from p2pswarm.demo import DEMO_TRAIN_STEPS, run_demo, run_train_demo

    say = (lambda text: typer.echo(text, err=True)) if as_json else typer.echo

    def render_plan(plan: dict[str, Any]) -> None:
        from rich.console import Console

        from p2pswarm.planner.render import print_plan
        print_plan(plan, Console())

    def write(text: str) -> None:
        sys.stdout.write(_printable(text))
        sys.stdout.flush()

    if steps is not None and not train:
        fail("--steps goes with --train")
    terminal = not as_json and sys.stdout.isatty()

    def live(line: str) -> None:  # rewrite the progress line in place; "" ends it
        sys.stdout.write("\r\033[K" + line if line else "\n")
        sys.stdout.flush()

    try:
        if train:
            result = run_train_demo(say, (lambda data: None) if as_json else render_status,
                                    None if as_json else render_plan,
                                    None if as_json else write, live if terminal else None,
                                    fellows=fellows, keep=keep,
                                    steps=steps or DEMO_TRAIN_STEPS)
        else:
            result = run_demo(say, (lambda data: None) if as_json else render_status,
                              None if as_json else render_plan, None if as_json else write,
                              fellows=fellows, keep=keep)
    except SwarmError as exc:
        fail(str(exc), EXIT_FAILURE)
    if as_json:
        print_json(result)


# --- serving commands (load, loads, unload, generate, chat) ---

_PLAN_HELP_MODEL_SERVE = ("Model directory (config.json and *.safetensors) or built-in name "
                          "(tiny-llama, small-llama).")

_LOAD_TIMEOUT_S = 600.0  # the most a `load` waits between two words from its agent
_GENERATE_TIMEOUT_S = 180.0  # ... and a `generate` between two tokens


def _serve_message(model: str, context: Optional[int], sequences: int, stages: Optional[int],
                   weights_dtype: Optional[str], kv_dtype: str, maximize: Optional[str],
                   exclude: list[str], floor: list[str]) -> tuple[dict[str, Any], Optional[str]]:
    """The plan request a load sends, and the model's directory when MODEL is one."""
    from p2pswarm.models.files import read_model_config
    from p2pswarm.planner import BUILTIN_MODELS, profile_from_config
    from p2pswarm.planner import request_from_dict

    request: dict[str, Any] = {
        "kind": "serve", "stages": stages, "kv_dtype": kv_dtype, "weights_dtype": weights_dtype,
        "maximize": maximize, "exclude": list(exclude), "floors_bytes": _floors(floor),
        "context": context, "sequences": sequences,
    }
    try:
        name, config = read_model_config(model)
        profile_from_config(config, name)
        request_from_dict(request)
    except ConfigError as exc:
        fail(str(exc))
    path: Optional[str] = None
    if model not in BUILTIN_MODELS:
        where = Path(model).expanduser()
        directory = where if where.is_dir() else where.parent
        path = str(directory.resolve())
    return {"model": {"name": name, "config": config}, **request}, path


def _stream_agent(home: Optional[Path], message: dict[str, Any], on_event: Any,
                  timeout_s: float) -> Any:
    """A streamed request to the local agent; errors become one line and an exit code
    (except plan-changed, which the caller explains)."""
    from p2pswarm.control.client import stream as control_stream
    from p2pswarm.errors import PlanChanged

    try:
        return control_stream(home_dir(home), message, on_event, timeout_s)
    except PlanChanged:
        raise
    except ConfigError as exc:
        fail(str(exc))
    except SwarmError as exc:
        fail(str(exc), EXIT_FAILURE)


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
        self.console.print(f"  stage {key[0]} on {key[1]}: {words.get(phase, phase)}")


def _print_load(record: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    stages = record.get("stages", [])
    load_s = record.get("load_s")
    console.print(f"loaded plan [bold]{record['plan_id']}[/] ({record['model'].get('name')}): "
                  f"{len(stages)} stages" + (f" in {load_s:.1f} s" if load_s else ""))
    adapter = record.get("adapter")
    if isinstance(adapter, dict):
        console.print(f"  with LoRA adapter {adapter.get('name')} (rank {adapter.get('rank')}, "
                      f"{', '.join(adapter.get('targets') or [])}; sha256 "
                      f"{str(adapter.get('sha256', ''))[:16]}), merged into the weights")
    table = Table()
    for column in ("stage", "fellow", "card", "layers", "allocated", "claimed", "fetched",
                   "state"):
        table.add_column(column)
    for s in stages:
        a, b = s["layers"]
        table.add_row(str(s["stage"]), s["fellow"], s.get("card", ""), f"{a}-{b - 1}",
                      f"{s.get('allocated_bytes', 0) / 1e6:,.1f} MB",
                      f"{s.get('claim_bytes', 0) / 1e6:,.1f} MB",
                      f"{s.get('fetched_bytes', 0) / 1e6:,.1f} MB"
                      if "fetched_bytes" in s else "-", s.get("state", "alive"))
    console.print(table)


def _explain_plan_changed(exc: Any, model: str, as_json: bool) -> NoReturn:
    if as_json:
        print_json({"error": "plan-changed", "code": 409, "expected_plan_id":
                    exc.expected_plan_id, "new_plan_id": exc.new_plan_id,
                    "changes": exc.changes, "new_plan": exc.new_plan})
        raise typer.Exit(EXIT_FAILURE)
    from rich.console import Console

    from p2pswarm.planner.render import print_plan

    typer.echo(f"plan-changed (409): plan {exc.expected_plan_id} no longer holds; the "
               f"swarm now gives {exc.new_plan_id}. What changed:", err=True)
    for line in exc.changes or ["the live view differs"]:
        typer.echo(f"  - {line}", err=True)
    if isinstance(exc.new_plan, dict):
        print_plan(exc.new_plan, Console())
        if exc.new_plan.get("fits"):
            typer.echo(f"To load the new plan: p2pswarm load {model} --plan-id "
                       f"{exc.new_plan_id} (with the same options)", err=True)
    raise typer.Exit(EXIT_FAILURE)


@app.command()
def load(
    model: str = typer.Argument(..., help=_PLAN_HELP_MODEL_SERVE),
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
    home: Optional[Path] = HomeOption,
    as_json: bool = JsonOption,
) -> None:
    """Load MODEL across the swarm as planned, all or nothing (--plan-id: exactly that plan)."""
    from rich.console import Console

    from p2pswarm.errors import PlanChanged

    message, path = _serve_message(model, context, sequences, stages, weights_dtype, kv_dtype,
                                   maximize, exclude, floor)
    adapter_dir: Optional[str] = None
    if adapter is not None:
        from p2pswarm.agent.adapter import check_adapter, read_adapter

        try:
            found = read_adapter(adapter)
            check_adapter(found, message["model"]["config"], message["model"]["name"], path)
        except ConfigError as exc:
            fail(str(exc))
        adapter_dir = found.path
        message["adapter"] = found.sha256  # the plan, and its plan_id, name the adapter
    if show_plan:
        result = _agent_answer(home, {"op": "plan", "request": message}, "")
        if as_json:
            print_json(result)
        else:
            from p2pswarm.planner.render import print_plan
            print_plan(result, Console())
        if not result.get("fits", False):
            raise typer.Exit(EXIT_FAILURE)
        return
    console = Console(stderr=as_json)
    try:
        with _LoadProgress(console) as progress:
            record = _stream_agent(home, {"op": "load", "request": message, "plan_id": plan_id,
                                          "path": path, "adapter": adapter_dir}, progress,
                                   _LOAD_TIMEOUT_S)
    except PlanChanged as exc:
        _explain_plan_changed(exc, model, as_json)
    if as_json:
        print_json(record)
        return
    _print_load(record, console)
    console.print("generate with: p2pswarm generate \"Once upon a time\"")


@app.command()
def loads(home: Optional[Path] = HomeOption, as_json: bool = JsonOption) -> None:
    """Show what is loaded in the swarm: each load's plan_id, model, and where its stages run."""
    result = _agent_answer(home, {"op": "loads"}, "")
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
        _print_load(record, console)
        if not record.get("complete", True):
            console.print("[bold red]incomplete:[/] a stage is missing or its fellow is gone; "
                          f"`p2pswarm unload {record['plan_id']}` and load again")


@app.command()
def unload(
    plan_id: Optional[str] = typer.Argument(None, help="The load to drop (default: the only one)."),
    all_loads: bool = typer.Option(False, "--all", help="Unload everything."),
    home: Optional[Path] = HomeOption,
    as_json: bool = JsonOption,
) -> None:
    """Free the stages of a load on every fellow."""
    result = _agent_answer(home, {"op": "unload", "plan_id": plan_id, "all": all_loads}, "")
    if as_json:
        print_json(result)
        return
    gone = result.get("unloaded", [])
    typer.echo(f"unloaded {', '.join(gone)}" if gone else "nothing was loaded")


def _printable(text: str) -> str:
    """Model output is untrusted: no terminal control sequences reach the screen."""
    return "".join(c if c.isprintable() or c in "\n\t" else "\ufffd" for c in text)


def _print_generation_stats(result: dict[str, Any]) -> None:
    n = len(result.get("token_ids", []))
    typer.echo(f"\n{n} tokens ({result.get('stop_reason')}); first after "
               f"{result.get('time_to_first_token_s', 0):.2f} s for {result.get('prompt_tokens')}"
               f" prompt tokens; then {result.get('decode_tokens_per_s', 0):.1f} tokens/s", err=True)
    parts = [f"stage {s['stage']} {s['fellow']} (layers {s['layers'][0]}-{s['layers'][1] - 1}) "
             f"{s['ms_per_token']:.1f} ms" for s in result.get("stages", [])]
    typer.echo("per token: " + ", ".join(parts)
               + f", network {result.get('network_ms_per_token', 0):.1f} ms over "
               f"{result.get('hops')} hops", err=True)


def _generate_once(home: Optional[Path], prompt: str, options: dict[str, Any],
                   as_json: bool) -> dict[str, Any]:
    def on_event(event: dict[str, Any]) -> None:
        if not as_json and isinstance(event.get("text"), str):
            sys.stdout.write(_printable(event["text"]))
            sys.stdout.flush()

    return _stream_agent(home, {"op": "generate", "prompt": prompt, **options},  # type: ignore[no-any-return]
                         on_event, _GENERATE_TIMEOUT_S)


def _generate_options(max_tokens: int, temperature: float, top_k: int, top_p: float,
                      seed: int, plan_id: Optional[str]) -> dict[str, Any]:
    if max_tokens <= 0:
        fail(f"--max-tokens {max_tokens} must be positive, e.g. --max-tokens 64")
    if temperature < 0 or top_k < 0 or not 0 < top_p <= 1:
        fail("--temperature and --top-k must be >= 0 and --top-p in (0, 1]")
    return {"max_tokens": max_tokens, "temperature": temperature, "top_k": top_k,
            "top_p": top_p, "seed": seed, "plan_id": plan_id}


MaxTokensOption = typer.Option(64, "--max-tokens", help="The most new tokens.")
TemperatureOption = typer.Option(0.0, "--temperature", help="0: greedy; else sample.")
TopKOption = typer.Option(0, "--top-k", help="Sample among the k likeliest (0: all).")
TopPOption = typer.Option(1.0, "--top-p", help="Sample within this probability mass.")
SeedOption = typer.Option(0, "--seed", help="Seed of the sampler (same seed, same text).")
PlanIdOption = typer.Option(None, "--plan-id", help="Which load (default: the only one).")


@app.command()
def generate(
    prompt: str = typer.Argument(..., help="The text to continue."),
    max_tokens: int = MaxTokensOption,
    temperature: float = TemperatureOption,
    top_k: int = TopKOption,
    top_p: float = TopPOption,
    seed: int = SeedOption,
    plan_id: Optional[str] = PlanIdOption,
    home: Optional[Path] = HomeOption,
    as_json: bool = JsonOption,
) -> None:
    """Continue PROMPT with the loaded model, streaming tokens; then tokens/s per stage."""
    options = _generate_options(max_tokens, temperature, top_k, top_p, seed, plan_id)
    try:
        result = _generate_once(home, prompt, options, as_json)
    except KeyboardInterrupt:
        typer.echo("\ninterrupted", err=True)
        raise typer.Exit(130) from None
    if as_json:
        print_json(result)
        return
    _print_generation_stats(result)


@app.command()
def chat(
    max_tokens: int = MaxTokensOption,
    temperature: float = TemperatureOption,
    top_k: int = TopKOption,
    top_p: float = TopPOption,
    seed: int = SeedOption,
    plan_id: Optional[str] = PlanIdOption,
    turns: int = typer.Option(4, "--turns", help="Earlier turns kept in the prompt."),
    home: Optional[Path] = HomeOption,
) -> None:
    """Talk with the loaded model: each line you type is a turn (EOF or Ctrl-D ends)."""
    options = _generate_options(max_tokens, temperature, top_k, top_p, seed, plan_id)
    history: list[str] = []
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            typer.echo("> ", nl=False)
        try:
            line = sys.stdin.readline()
        except KeyboardInterrupt:
            break
        if not line:
            break
        line = line.rstrip("\n")
        if not line.strip():
            continue
        prompt = "".join(history[-turns:]) + f"User: {line}\nAssistant:"
        try:
            result = _generate_once(home, prompt, options, False)
        except KeyboardInterrupt:
            typer.echo("\ninterrupted", err=True)
            continue
        typer.echo("")
        history.append(f"User: {line}\nAssistant:{result.get('text', '')}\n")
    if interactive:
        typer.echo("")


# --- end serving commands ---


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
    from p2pswarm.models.files import read_model_config
    from p2pswarm.planner import profile_from_config, request_from_dict

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


# --- mcp command ---


@app.command()
def mcp(
    home: Optional[Path] = HomeOption,
    list_tools: bool = typer.Option(False, "--list-tools", help="Print the tools and exit."),
    as_json: bool = JsonOption,
) -> None:
    """Serve the swarm's tools (plan, load, train, status) to an MCP client on stdio;
    the tools talk to the agent in --home, which `p2pswarm join` runs."""
    try:
        from p2pswarm.mcp_server import TOOL_NAMES, build_server, serve_stdio
    except ImportError as exc:
        fail(f"the MCP server needs the `mcp` package ({exc.name} is missing): "
             f"pip install 'mcp>=2'", EXIT_FAILURE)
    directory = home_dir(home)
    if list_tools:
        import anyio

        tools = anyio.run(build_server(directory).list_tools, backend="trio")
        if as_json:
            print_json([{"name": t.name, "description": t.description} for t in tools])
        else:
            for tool in tools:
                typer.echo(f"{tool.name}: {(tool.description or '').split(chr(10))[0]}")
        return
    if sys.stdin.isatty():
        typer.echo(f"p2pswarm mcp: serving MCP on stdin/stdout for the agent in {directory} "
                   f"({len(TOOL_NAMES)} tools); an MCP client starts this command", err=True)
    try:
        serve_stdio(directory)
    except KeyboardInterrupt:
        pass


# --- end mcp command ---


# --- training commands ---

_TRAIN_TIMEOUT_S = 900.0  # the most `train` waits between two words from its agent
_EXPORT_TIMEOUT_S = 1800.0  # fetching a checkpoint's shards and writing the export


def _read_job(path: Path) -> dict[str, Any]:
    """job.json, checked and made canonical (paths absolute, defaults filled in)."""
    from p2pswarm.training.job import JobConfig

    try:
        return JobConfig.from_json(path).to_dict()
    except ConfigError as exc:
        fail(f"{path}: {exc}")


def _resume_config(resume: str) -> Optional[dict[str, Any]]:
    """The job a checkpoint directory was written by (None: RESUME is a job id)."""
    where = Path(resume).expanduser()
    if not where.is_dir():
        return None
    from p2pswarm.training.checkpoint import CheckpointStore

    try:
        store = CheckpointStore(where)
        step = store.latest()
        if step is None:
            fail(f"no complete checkpoint in {where}")
        job = dict(store.manifest(step)["meta"]["job"])
    except (ConfigError, KeyError, OSError) as exc:
        fail(f"cannot read the checkpoint in {where}: {exc}")
    job["checkpoint"] = {**job.get("checkpoint", {}), "dir": str(where.resolve())}
    return job


def _job_line(job: dict[str, Any]) -> str:
    loss = job.get("loss")
    text = (f"{job['job_id']} {job['state']}: step {job.get('step', 0)}/{job.get('steps', 0)}"
            + (f", loss {loss:.4f}" if isinstance(loss, (int, float)) else "")
            + f", {job.get('tokens_per_s', 0.0):,.0f} tokens/s, "
            f"{job.get('replicas', 0)} replica(s), {job.get('bytes_sent', 0) / 1e6:,.2f} MB "
            "exchanged")
    return text + (f" ({job['reason']})" if job.get("reason") else "")


@app.command()
def train(
    config: Optional[Path] = typer.Option(None, "--config", help="The job: job.json."),
    show_plan: bool = typer.Option(False, "--plan", help="Print the training plan and its "
                                   "plan_id; start nothing."),
    plan_id: Optional[str] = typer.Option(None, "--plan-id", help="Start exactly this plan, "
                                          "or refuse with what changed (plan-changed, 409)."),
    maximize_seq_len: bool = typer.Option(False, "--maximize-seq-len", help="Plan and train "
                                          "at the longest sequence length that fits now."),
    stages: Optional[int] = typer.Option(None, "--stages", help="Fix the stages per replica."),
    exclude: list[str] = ExcludeOption,
    resume: Optional[str] = typer.Option(None, "--resume", help="Continue job JOB (its id, "
                                         "or its checkpoint directory) from its latest "
                                         "checkpoint."),
    detach: bool = typer.Option(False, "--detach", help="Submit and return; follow with "
                                "`p2pswarm jobs`."),
    home: Optional[Path] = HomeOption,
    as_json: bool = JsonOption,
) -> None:
    """Train a model across the swarm as job.json says, with live progress."""
    from rich.console import Console

    from p2pswarm.errors import PlanChanged

    if config is None and resume is None:
        fail("give the job with --config job.json (or --resume JOB)")
    job = _read_job(config) if config is not None else _resume_config(str(resume))
    if show_plan:
        if job is None:
            fail("--plan needs --config job.json")
        result = _agent_answer(home, {"op": "job_plan", "config": job, "stages": stages,
                                      "exclude_cards": list(exclude),
                                      "maximize": "seq_len" if maximize_seq_len else None}, "")
        if as_json:
            print_json(result)
        else:
            from p2pswarm.planner.render import print_plan
            print_plan(result, Console())
            for r in result.get("replicas", []):
                typer.echo(f"replica {r['replica']}: {r['strip_text']}")
            typer.echo(f"plan_id {result['plan_id']}: start it with p2pswarm train --config "
                       f"{config} --plan-id {result['plan_id']}")
        if not result.get("fits", False):
            raise typer.Exit(EXIT_FAILURE)
        return
    console = Console(stderr=as_json)
    said: dict[str, Any] = {}

    def on_event(event: dict[str, Any]) -> None:
        record = event.get("job")
        if not isinstance(record, dict):
            return
        line = _job_line(record)
        if said.get("line") == line:
            return
        said["line"] = line
        if console.is_terminal and not as_json:
            console.print(line, end="\r", overflow="ellipsis", soft_wrap=True)
        else:
            console.print(line)

    message: dict[str, Any] = {"op": "job_submit", "config": job, "plan_id": plan_id,
                               "stages": stages, "resume": resume or None,
                               "maximize": "seq_len" if maximize_seq_len else None,
                               "exclude_cards": list(exclude)}
    try:
        if detach:
            record = _agent_answer(home, message, "")
        else:
            record = _stream_agent(home, message, on_event, _TRAIN_TIMEOUT_S)
    except PlanChanged as exc:
        _explain_plan_changed(exc, f"--config {config}", as_json)
    if as_json:
        print_json(record)
    else:
        console.print(_job_line(record))
    if record.get("state") in ("failed", "cancelled"):
        raise typer.Exit(EXIT_FAILURE)


jobs_app = typer.Typer(help="Training jobs: list them, cancel one.")
app.add_typer(jobs_app, name="jobs")


@jobs_app.callback(invoke_without_command=True)
def jobs(ctx: typer.Context, home: Optional[Path] = HomeOption,
         as_json: bool = JsonOption) -> None:
    """List the swarm's training jobs with their state."""
    if ctx.invoked_subcommand is not None:
        return
    records = _agent_answer(home, {"op": "jobs"}, "")
    if as_json:
        print_json(records)
        return
    if not records:
        typer.echo("no jobs; start one with p2pswarm train --config job.json")
        return
    for record in records:
        typer.echo(_job_line(record))


@jobs_app.command("cancel")
def jobs_cancel(job_id: str = typer.Argument(..., help="The job's id (see p2pswarm jobs)."),
                home: Optional[Path] = HomeOption, as_json: bool = JsonOption) -> None:
    """Cancel a job: its stages are released; its checkpoints stay."""
    record = _agent_answer(home, {"op": "job_cancel", "job_id": job_id}, "")
    if as_json:
        print_json(record)
    else:
        typer.echo(f"cancelling {record['job_id']} (was {record['state']})")


def _print_export(result: dict[str, Any]) -> None:
    where = result["path"]
    cut = result.get("cut") or []
    cut_text = f"cut at layers {cut}" if cut else "one stage, no cut"
    if result["kind"] == "adapter":
        typer.echo(f"exported the LoRA adapters of {result['job_id'] or 'the job'} (step "
                   f"{result['step']}, {cut_text}) to {where}; base: {result['base']}")
        typer.echo(f"serve them with: p2pswarm load {result['base']} --adapter {where}")
    else:
        typer.echo(f"exported {result['job_id'] or 'the job'} (step {result['step']}, "
                   f"{cut_text}) to {where}")
        typer.echo(f"serve it on the cut it trained with: p2pswarm load {where}")


@jobs_app.command("export")
def jobs_export(job: str = typer.Argument(..., help="The job's id (see p2pswarm jobs), or "
                                          "its checkpoint directory."),
                out: Path = typer.Option(..., "--out", help="A new (or empty) directory to "
                                         "write into."),
                home: Optional[Path] = HomeOption, as_json: bool = JsonOption) -> None:
    """Export a job's latest checkpoint: a Hugging Face model directory recording the cut
    it trained with, or, for a LoRA job, its adapters on their own."""
    from p2pswarm.training.job_export import check_out_dir

    try:
        out_dir = check_out_dir(out)
    except ConfigError as exc:
        fail(str(exc))
    where = Path(job).expanduser()
    if where.is_dir():  # a checkpoint directory: exported here, no agent needed
        from p2pswarm.training.checkpoint import CheckpointStore
        from p2pswarm.training.job_export import export_checkpoint

        try:
            result = export_checkpoint(CheckpointStore(where), out_dir).to_dict()
        except (SwarmError, OSError) as exc:
            fail(f"cannot export {where}: {exc}", EXIT_FAILURE)
    else:
        from p2pswarm.control.client import request as agent_request

        directory = home_dir(home)
        try:
            result = agent_request(directory, {"op": "job_export", "job_id": job,
                                               "out": str(out_dir)}, _EXPORT_TIMEOUT_S)
        except ControlError as exc:
            if str(exc).startswith("no agent running"):
                fail(f"no agent running in {directory}: start one with `p2pswarm join`, or "
                     "give the job's checkpoint directory instead of its id", EXIT_FAILURE)
            fail(str(exc), EXIT_FAILURE)
        except ConfigError as exc:
            fail(str(exc))
        except SwarmError as exc:
            fail(str(exc), EXIT_FAILURE)
    if as_json:
        print_json(result)
    else:
        _print_export(result)


# --- end training commands ---


# --- simulation commands ---


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


@app.command()
def simulate(
    scenario: str = typer.Argument(..., help="A scenario file, or a name in "
                                   "simulations/scenarios/ (e.g. w3, clean, smoke)."),
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
                                        "(never-refutes) to see the oracle catch it."),
    progress: Optional[bool] = typer.Option(None, "--progress/--no-progress",
                                            help="Progress bar (default: on a terminal)."),
    as_json: bool = JsonOption,
) -> None:
    """Run a WiFi-dropout scenario on real agents in virtual time, judge it against the
    truth, and report (exit 1 if the oracle finds a failure)."""
    from p2pswarm.sim.harness import run_scenario, variant_for
    from p2pswarm.sim.metrics import ks_two_sample
    from p2pswarm.sim.report import markdown, public, to_json, write_reports
    from p2pswarm.sim.scenario import load_scenario

    try:
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
    except SwarmError as exc:
        fail(str(exc))
    bar = _sim_progress(progress, chosen.name)
    results: list[dict[str, Any]] = []
    comparison: Optional[dict[str, Any]] = None
    try:
        if bar is not None:
            bar.start()
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
    except SwarmError as exc:
        fail(str(exc), EXIT_FAILURE)
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


# --- end simulation commands ---


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
