"""Errors to exit codes: the one place an error becomes a line of text and a number.

Every command runs under ``exits_on()``: a SwarmError that reaches it becomes
``error: <message>`` on stderr and exit code 2 for a ConfigError (the message says how to
fix the arguments or configuration) or 1 for any other (the swarm could not do what was
asked; a refused pinned plan says ``plan-changed (409): ...``). A step whose errors read
differently narrows the errors, adds a prefix or fixes the code with its own
``with exits_on(...)``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn, Optional

import typer

from p2pswarm.errors import ConfigError, SwarmError

EXIT_USAGE = 2  # bad argument or configuration: the message says how to fix it
EXIT_FAILURE = 1  # the swarm could not do what was asked
EXIT_INTERRUPTED = 130  # Ctrl-C: what it interrupted was cancelled or left running, as said


def fail(message: str, code: int = EXIT_USAGE) -> NoReturn:
    """One line on stderr, no traceback."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def exit_code(exc: BaseException) -> int:
    """2 for what the user can fix in the arguments or configuration, else 1."""
    return EXIT_USAGE if isinstance(exc, ConfigError) else EXIT_FAILURE


@contextmanager
def exits_on(code: Optional[int] = None, *, prefix: str = "",
             errors: tuple[type[BaseException], ...] = (SwarmError,)) -> Iterator[None]:
    """Turn ``errors`` raised inside into ``error: {prefix}{exc}`` and an exit code:
    ``code``, or by default 2 for a ConfigError and 1 for anything else. Works as a
    context manager and as a decorator."""
    try:
        yield
    except errors as exc:
        fail(f"{prefix}{exc}", exit_code(exc) if code is None else code)
    except RecursionError:  # a document nested deeper than any reader follows
        fail(f"{prefix}the input is nested too deeply to read (JSON arrays or objects "
             "inside each other, thousands deep)", EXIT_USAGE if code is None else code)


__all__ = ["EXIT_FAILURE", "EXIT_INTERRUPTED", "EXIT_USAGE", "exit_code", "exits_on", "fail"]
