"""Blocking client for the local control API (the CLI is synchronous)."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

from p2pswarm.control.protocol import HEADER, MAX_MESSAGE_BYTES, pack, raise_error, socket_path
from p2pswarm.control.protocol import unpack
from p2pswarm.errors import ControlError


def request(home: Path, req: dict[str, Any], timeout_s: float = 30.0) -> Any:
    """Send one request to the agent of ``home`` and return its result (or raise its error)."""
    path = socket_path(home)
    if not path.exists():
        raise ControlError(f"no agent running in {home}: start one with `p2pswarm join`")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        try:
            sock.connect(str(path))
            sock.sendall(pack(req))
            (length,) = HEADER.unpack(_receive_exactly(sock, HEADER.size))
            if length > MAX_MESSAGE_BYTES:
                raise ControlError(f"agent answered {length} bytes, over the limit")
            response = unpack(_receive_exactly(sock, length))
        except (ConnectionRefusedError, FileNotFoundError):
            raise ControlError(
                f"no agent running in {home} (stale socket): start one with `p2pswarm join`"
            ) from None
        except socket.timeout:
            raise ControlError(f"the agent in {home} did not answer within {timeout_s:g} s") \
                from None
        except OSError as exc:
            raise ControlError(f"cannot talk to the agent in {home}: {exc.strerror}") from None
    if response.get("ok"):
        return response.get("result")
    raise_error(response.get("error") or {})
    raise AssertionError("unreachable")


def _receive_exactly(sock: socket.socket, n: int) -> bytes:
    chunks = bytearray()
    while len(chunks) < n:
        chunk = sock.recv(min(n - len(chunks), 1 << 20))
        if not chunk:
            raise ControlError("the agent closed the connection mid-answer")
        chunks += chunk
    return bytes(chunks)
