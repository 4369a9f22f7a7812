"""The typer app, its --version, the options every command shares, and the state
directory (--home, else $P2PSWARM_HOME, else ~/.p2pswarm)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Optional

import typer

from p2pswarm import __version__
from p2pswarm.cli.exits import exits_on
from p2pswarm.wire.versions import range_line

app = typer.Typer(
    name="p2pswarm",
    help="Pool mismatched machines into one swarm that serves and trains models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

HomeOption = typer.Option(None, "--home", help="State directory (default $P2PSWARM_HOME or "
                          "~/.p2pswarm).")
JsonOption = typer.Option(False, "--json", help="Print machine-readable JSON.")


def home_dir(home: Optional[Path]) -> Path:
    """--home, else $P2PSWARM_HOME, else ~/.p2pswarm."""
    if home is not None:
        return home.expanduser()
    env = os.environ.get("P2PSWARM_HOME")
    return Path(env).expanduser() if env else Path.home() / ".p2pswarm"


def print_json(data: Any) -> None:
    typer.echo(json.dumps(data, indent=2, sort_keys=False))


def printable(text: str) -> str:
    """Model output is untrusted: no terminal control sequences reach the screen."""
    return "".join(c if c.isprintable() or c in "\n\t" else "\ufffd" for c in text)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"p2pswarm {__version__}, {range_line()}")
        raise typer.Exit()


@app.callback()
def root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                 help="Print the version and exit."),
) -> None:
    """Pool mismatched machines into one swarm that serves and trains models."""


def main() -> None:
    """Console entry point: SwarmErrors become one line on stderr and an exit code."""
    try:
        with exits_on():
            app(standalone_mode=True)
    except typer.Exit as exc:  # raised by exits_on, outside click's own handling
        sys.exit(exc.exit_code)


__all__ = ["HomeOption", "JsonOption", "app", "home_dir", "main", "print_json", "printable"]
