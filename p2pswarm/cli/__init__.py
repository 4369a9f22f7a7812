"""The `p2pswarm` command line (typer).

The only place that reads environment variables and turns errors into exit codes and
human text. Every command that prints data takes `--json`. One module per role:

- ``app``: the typer app, --version, the shared --home and --json, ``main``
- ``exits``: errors to one line of text and an exit code (``exits_on``, ``fail``)
- ``local_agent``: asking the agent of --home over the control API
- ``render``: a plan as bars and tables; ``plan_changed``: a refused pinned plan explained
- ``plan_request``: the options that say what a plan asks for
- commands: ``swarm`` (init, join, leave, status), ``admission`` (invite, revoke, and
  what init does of the admin key), ``demo``, ``loads`` (load, loads,
  unload), ``generate`` (generate, chat), ``plans`` (plan, cluster), ``cards`` (cards,
  bench), ``mcp_stdio`` (mcp), ``training`` (train, jobs), ``simulate``

Heavy imports (torch, the agent, rich) happen inside the commands that need them, so
``p2pswarm --help`` stays fast.
"""

# ruff: noqa: I001  (the order below is the order of --help)
from __future__ import annotations

# Importing a command module registers its commands; this order is the order of --help.
from p2pswarm.cli import swarm  # noqa: F401  (init, join, leave, status)
from p2pswarm.cli import admission  # noqa: F401  (invite, revoke)
from p2pswarm.cli import demo  # noqa: F401
from p2pswarm.cli import loads  # noqa: F401  (load, loads, unload)
from p2pswarm.cli import generate  # noqa: F401  (generate, chat)
from p2pswarm.cli import plans  # noqa: F401  (plan, cluster)
from p2pswarm.cli import cards  # noqa: F401  (cards, bench)
from p2pswarm.cli import mcp_stdio  # noqa: F401  (mcp)
from p2pswarm.cli import training  # noqa: F401  (train, jobs)
from p2pswarm.cli import simulate  # noqa: F401
from p2pswarm.cli.app import app, main

__all__ = ["app", "main"]
