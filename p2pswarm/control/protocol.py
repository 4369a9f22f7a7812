"""Control API framing and error mapping, shared by the agent's server and the CLI's client.

A request and a response are each one msgpack map behind a 4-byte big-endian length.
Requests: ``{"op": NAME, ...arguments}``, or ``{"op": NAME, "msg": ...}`` carrying the
op's typed request encoded by the wire codec (``p2pswarm.control.requests``). Responses:
``{"ok": true, "result": ...}`` or
``{"ok": false, "error": {"kind": CLASS, "message": TEXT, "data": {...}}}``; the client
raises the matching SwarmError so the CLI reports it like a local one.

A request with ``"stream": true`` may get any number of ``{"event": {...}}`` messages
(progress, tokens) before its one final response; without it the agent sends the final
response alone, so a one-shot client never sees an event.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import msgpack

from p2pswarm import errors

SOCKET_NAME = "agent.sock"
# sockaddr_un holds 108 bytes on Linux, the last one the terminating zero
MAX_SOCKET_PATH_BYTES = 107
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
HEADER = struct.Struct(">I")


def socket_path(home: Path) -> Path:
    return home / SOCKET_NAME


def pack(obj: dict[str, Any]) -> bytes:
    body: bytes = msgpack.packb(obj, use_bin_type=True)
    return HEADER.pack(len(body)) + body


def is_event(message: dict[str, Any]) -> bool:
    return "event" in message and "ok" not in message


def unpack(body: bytes) -> dict[str, Any]:
    try:
        obj = msgpack.unpackb(body, raw=False, strict_map_key=False)
    except Exception as exc:  # any msgpack failure means a bad frame
        raise errors.ControlError(f"malformed control message ({type(exc).__name__})") from None
    if not isinstance(obj, dict):
        raise errors.ControlError("malformed control message (not a map)")
    return obj


def error_data(exc: BaseException) -> dict[str, Any]:
    """An error's details in an error response (``{}``: none): a refused pin's plan ids,
    what changed and the new plan."""
    if isinstance(exc, errors.PlanChanged):
        return {"expected_plan_id": exc.expected_plan_id, "new_plan_id": exc.new_plan_id,
                "changes": exc.changes, "new_plan": exc.new_plan}
    return {}


def error_response(exc: BaseException) -> dict[str, Any]:
    kind = type(exc).__name__ if isinstance(exc, errors.SwarmError) else "SwarmError"
    return {"ok": False, "error": {"kind": kind, "message": str(exc), "data": error_data(exc)}}


def raise_error(error: dict[str, Any]) -> None:
    """Re-raise an error response as the SwarmError it was on the agent."""
    kind = str(error.get("kind", "SwarmError"))
    message = str(error.get("message", "the agent refused the request"))
    data = error.get("data") or {}
    if kind == "PlanChanged":
        raise errors.PlanChanged(data.get("expected_plan_id", ""), data.get("new_plan_id", ""),
                                 list(data.get("changes", [])), data.get("new_plan"))
    cls = getattr(errors, kind, None)
    if not (isinstance(cls, type) and issubclass(cls, errors.SwarmError)) or issubclass(
            cls, errors.ProtocolError):
        cls = errors.SwarmError
    raise cls(message)
