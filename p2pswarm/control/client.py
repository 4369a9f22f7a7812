"""Blocking client for the local control API (the CLI is synchronous)."""

from __future__ import annotations

import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

from p2pswarm.control.protocol import (
    HEADER,
    MAX_MESSAGE_BYTES,
    is_event,
    pack,
    raise_error,
    socket_path,
    unpack,
)
from p2pswarm.errors import ControlError

OnEvent = Callable[[dict[str, Any]], None]


def request(home: Path, req: dict[str, Any], timeout_s: float = 30.0) -> Any:
    """Send one request to the agent of ``home`` and return its result (or raise its error)."""
    return _exchange(home, req, timeout_s, None)


def stream(home: Path, req: dict[str, Any], on_event: OnEvent, timeout_s: float = 30.0) -> Any:
    """Like ``request``, and hand every event the agent sends before its result (progress,
    tokens) to ``on_event`` as it comes. ``timeout_s`` bounds the silence between two
    messages, not the whole answer, so a long generation that keeps talking never times out.
    """
    return _exchange(home, {**req, "stream": True}, timeout_s, on_event)


def _exchange(home: Path, req: dict[str, Any], timeout_s: float,
              on_event: OnEvent | None) -> Any:
    path = socket_path(home)
    if not path.exists():
        raise ControlError(f"no agent running in {home}: start one with `p2pswarm join`")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        try:
            sock.connect(str(path))
            sock.sendall(pack(req))
            while True:
                message = _receive_message(sock)
                if not is_event(message):
                    break
                if on_event is not None and isinstance(message["event"], dict):
                    on_event(message["event"])
        except (ConnectionRefusedError, FileNotFoundError):
            raise ControlError(
                f"no agent running in {home} (stale socket): start one with `p2pswarm join`"
            ) from None
        except TimeoutError:
            raise ControlError(f"the agent in {home} did not answer within {timeout_s:g} s") \
                from None
        except OSError as exc:
            raise ControlError(f"cannot talk to the agent in {home}: {exc.strerror}") from None
    if message.get("ok"):
        return message.get("result")
    raise_error(message.get("error") or {})
    raise AssertionError("unreachable")


def _receive_message(sock: socket.socket) -> dict[str, Any]:
    (length,) = HEADER.unpack(_receive_exactly(sock, HEADER.size))
    if length > MAX_MESSAGE_BYTES:
        raise ControlError(f"agent answered {length} bytes, over the limit")
    return unpack(_receive_exactly(sock, length))


def _receive_exactly(sock: socket.socket, n: int) -> bytes:
    chunks = bytearray()
    while len(chunks) < n:
        chunk = sock.recv(min(n - len(chunks), 1 << 20))
        if not chunk:
            raise ControlError("the agent closed the connection mid-answer")
        chunks += chunk
    return bytes(chunks)
