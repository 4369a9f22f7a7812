"""The agent's side of the control API: a Unix socket (mode 0600) in the state directory."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Awaitable, Callable

import trio

from p2pswarm.control.protocol import HEADER, MAX_MESSAGE_BYTES, error_response, pack, unpack
from p2pswarm.control.protocol import socket_path
from p2pswarm.errors import ControlError, SwarmError, TransportError

log = logging.getLogger("p2pswarm.control")

Handler = Callable[[dict[str, Any]], Awaitable[Any]]


async def serve_control(home: Path, handle: Handler, *,
                        task_status: trio.TaskStatus[Path] = trio.TASK_STATUS_IGNORED) -> None:
    """Answer control requests on ``home/agent.sock`` until cancelled."""
    path = socket_path(home)
    if path.exists():
        if await _socket_answers(path):
            raise TransportError(f"an agent is already running in {home}; "
                                 "stop it first or choose another --home")
        path.unlink()  # stale socket of an agent that did not exit cleanly
    sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
    old_umask = os.umask(0o177)  # the socket is created 0600: only this user may control
    try:
        await sock.bind(str(path))
    finally:
        os.umask(old_umask)
    sock.listen(16)
    listener = trio.SocketListener(sock)
    try:
        async with trio.open_nursery() as nursery:
            task_status.started(path)
            while True:
                stream = await listener.accept()
                nursery.start_soon(_answer, stream, handle)
    finally:
        with trio.CancelScope(shield=True):
            await listener.aclose()
        path.unlink(missing_ok=True)


async def _socket_answers(path: Path) -> bool:
    try:
        stream = await trio.open_unix_socket(str(path))
    except OSError:
        return False
    await stream.aclose()
    return True


async def _answer(stream: trio.SocketStream, handle: Handler) -> None:
    async with stream:
        try:
            request = await _receive_request(stream)
        except (ControlError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            log.debug("control: dropped a bad request: %s", exc)
            return
        try:
            result = await handle(request)
            response: dict[str, Any] = {"ok": True, "result": result}
        except SwarmError as exc:
            response = error_response(exc)
        except Exception as exc:  # a bug must not take the agent down: report it
            log.exception("control: %s failed", request.get("op"))
            response = error_response(exc)
        try:
            await stream.send_all(pack(response))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass


async def _receive_request(stream: trio.SocketStream) -> dict[str, Any]:
    header = await _receive_exactly(stream, HEADER.size)
    (length,) = HEADER.unpack(header)
    if length > MAX_MESSAGE_BYTES:
        raise ControlError(f"request of {length} bytes is over the limit")
    return unpack(await _receive_exactly(stream, length))


async def _receive_exactly(stream: trio.SocketStream, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = await stream.receive_some(n - len(data))
        if not chunk:
            raise ControlError("client closed the connection mid-request")
        data += chunk
    return bytes(data)
