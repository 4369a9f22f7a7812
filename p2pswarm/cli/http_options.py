"""``join``'s HTTP options: where the HTTP token comes from, and what the server allows.

A token on the command line is in ``/proc/PID/cmdline`` for every local user to read,
and Python cannot rewrite its own ``argv``: the token's documented ways are
``$P2PSWARM_HTTP_TOKEN`` and ``--http-token-file FILE``; ``--http-token`` still works,
with a warning.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Optional

import typer

from p2pswarm.cli.exits import fail
from p2pswarm.http.app import HttpSettings, http_settings

HTTP_TOKEN_ENV = "P2PSWARM_HTTP_TOKEN"
MAX_TOKEN_BYTES = 4096


def read_http_token(given: Optional[str], file: Optional[Path]) -> Optional[str]:
    """``--http-token``, else ``--http-token-file``, else ``$P2PSWARM_HTTP_TOKEN``."""
    if given is not None and file is not None:
        fail("give --http-token or --http-token-file, not both")
    if given is not None:
        typer.echo(f"warning: --http-token on the command line is visible to every user of "
                   f"this machine (ps, /proc); use ${HTTP_TOKEN_ENV} or --http-token-file "
                   "FILE", err=True)
        return given
    if file is not None:
        try:
            with open(file.expanduser(), "rb") as f:
                mode = os.fstat(f.fileno()).st_mode
                data = f.read(MAX_TOKEN_BYTES + 1)  # bounded: the file may be anything
        except OSError as exc:
            fail(f"cannot read --http-token-file {file}: {exc.strerror or exc}")
        if mode & (stat.S_IRGRP | stat.S_IROTH):
            typer.echo(f"warning: --http-token-file {file} is readable by other users: "
                       f"chmod 600 {file}", err=True)
        token = data.decode("utf-8", errors="replace").strip()
        if not token or len(data) > MAX_TOKEN_BYTES or any(c.isspace() for c in token):
            fail(f"--http-token-file {file} must hold one token (a line without spaces)")
        return token
    return os.environ.get(HTTP_TOKEN_ENV) or None


def join_http_settings(addr: Optional[str], token: Optional[str], token_file: Optional[Path],
                       allow_hosts: Optional[list[str]],
                       allow_dirs: Optional[list[str]]) -> Optional[HttpSettings]:
    """The HTTP server ``join`` runs; ConfigError (exit 2) for a bad option."""
    return http_settings(addr, read_http_token(token, token_file),
                         allow_hosts=tuple(allow_hosts or ()), allow_dirs=tuple(allow_dirs or ()))


__all__ = ["HTTP_TOKEN_ENV", "join_http_settings", "read_http_token"]
