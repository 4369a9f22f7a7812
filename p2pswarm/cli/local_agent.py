"""Asking the agent of --home over the local control API.

The client is looked up on its module at each call, so a test can stand in for the agent
by replacing ``p2pswarm.control.client.request`` and ``.stream``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from p2pswarm.cli.app import home_dir
from p2pswarm.cli.exits import EXIT_FAILURE, exits_on, fail
from p2pswarm.control import client as control_client
from p2pswarm.errors import ControlError


def ask_agent(home: Optional[Path], request: dict[str, Any], timeout_s: float = 30.0) -> Any:
    """The agent's answer, its error as it words it."""
    return control_client.request(home_dir(home), request, timeout_s)


def agent_answer(home: Optional[Path], message: dict[str, Any], offline_hint: str,
                 timeout_s: float = 30.0) -> Any:
    """The local agent's answer to an op; no agent -> one line saying what to do, ending in
    ``offline_hint``. Every error, a refused pinned plan included, ends the command here."""
    directory = home_dir(home)
    with exits_on():
        try:
            return control_client.request(directory, message, timeout_s)
        except ControlError as exc:
            if str(exc).startswith("no agent running"):
                fail(f"no agent running in {directory}: start one with `p2pswarm join`"
                     f"{offline_hint}", EXIT_FAILURE)
            raise


def stream_agent(home: Optional[Path], message: dict[str, Any], on_event: Any,
                 timeout_s: float) -> Any:
    """A streamed request to the local agent: ``on_event`` gets each event before the
    answer. Errors reach the command (plan-changed is for the caller to explain)."""
    return control_client.stream(home_dir(home), message, on_event, timeout_s)


__all__ = ["agent_answer", "ask_agent", "stream_agent"]
