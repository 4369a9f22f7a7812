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
        settings = NodeSettings(home=directory, listen=listen, seeds=seed_addrs,
                                name=name or socket.gethostname(), config=config,
                                advertise=advertise)
    except SwarmError as exc:
        fail(str(exc))
    setup_logging(log_level)
    try:
        trio.run(run_node, settings)
    except KeyboardInterrupt:
        pass
    except SwarmError as exc:
        fail(str(exc), EXIT_FAILURE)


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
        cards = ", ".join(c.get("name", "?") for c in m.get("cards", [])) or "-"
        heard = m.get("last_heard_s")
        table.add_row(m["name"], m["id"][:8], m["addr"], m["state"], str(m["incarnation"]),
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
