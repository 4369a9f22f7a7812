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

import typer

from p2pswarm import __version__
from p2pswarm.errors import ConfigError, SwarmError

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
