"""`p2pswarm mcp`: the swarm's tools served to an MCP client on stdio."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from p2pswarm.cli.app import HomeOption, JsonOption, app, home_dir, print_json
from p2pswarm.cli.exits import EXIT_FAILURE, exits_on, fail


@app.command()
@exits_on()
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
