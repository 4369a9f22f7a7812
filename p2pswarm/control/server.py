"""The agent's side of the control API: a Unix socket (mode 0600) in the state directory.

A handler that has something to say before its result (load progress, generated tokens)
calls ``emit(event)``: for a request that asked to stream, the event goes out at once;
otherwise it is dropped. Handlers find the emitter through a context variable, so the
ops keep their one-argument signature and a one-shot request costs nothing extra.
"""

from __future__ import annotations

import contextlib
import contextvars
import errno
import logging
import math
import os
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import trio

from p2pswarm.control.protocol import (
    HEADER,
    MAX_MESSAGE_BYTES,
    MAX_SOCKET_PATH_BYTES,
    error_response,
    pack,
    socket_path,
    unpack,
)
from p2pswarm.errors import ControlError, SwarmError, TransportError

log = logging.getLogger("p2pswarm.control")

_ACCEPT_PAUSE_ERRNOS = frozenset(
    getattr(errno, name) for name in ("EMFILE", "ENFILE", "ENOMEM", "ENOBUFS")
    if hasattr(errno, name))
_ACCEPT_PAUSE_S = 0.5  # out of descriptors: accept again after this long

Handler = Callable[[dict[str, Any]], Awaitable[Any]]
Emit = Callable[[dict[str, Any]], None]

_emitter: contextvars.ContextVar[Emit | None] = contextvars.ContextVar("control_emitter",
                                                                      default=None)


def emit(event: dict[str, Any]) -> None:
    """Send ``event`` to the client of the request being answered, if it streams."""
    send = _emitter.get()
    if send is not None:
        send(event)


@contextlib.contextmanager
def emitting_to(send: Emit) -> Iterator[None]:
    """Route what ops ``emit`` inside the block to ``send``: how an in-process caller (the
    HTTP API) streams an op's events, as the control socket does for a streaming client."""
    token = _emitter.set(send)
    try:
        yield
    finally:
        _emitter.reset(token)


def current_emitter() -> Emit | None:
    """The emitter of the request being answered (to hand to tasks that outlive the
    context, e.g. a datagram handler), or None when the client does not stream."""
    return _emitter.get()


async def serve_control(home: Path, handle: Handler, *,
                        task_status: trio.TaskStatus[Path] = trio.TASK_STATUS_IGNORED) -> None:
    """Answer control requests on ``home/agent.sock`` until cancelled."""
    path = socket_path(home)
    if len(os.fsencode(path)) > MAX_SOCKET_PATH_BYTES:
        raise TransportError(f"the state directory {home} is too deep for its control socket "
                             f"({len(os.fsencode(path))} bytes to agent.sock, at most "
                             f"{MAX_SOCKET_PATH_BYTES}): choose a shorter --home")
    if path.exists():
        if await _socket_answers(path):
            raise TransportError(f"an agent is already running in {home}; "
                                 "stop it first or choose another --home")
        path.unlink()  # stale socket of an agent that did not exit cleanly
    sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
    old_umask = os.umask(0o177)  # the socket is created 0600: only this user may control
    try:
        await sock.bind(str(path))
    except OSError as exc:
        sock.close()
        raise TransportError(f"cannot open the control socket {path}: "
                             f"{exc.strerror or exc}; choose another --home") from exc
    finally:
        os.umask(old_umask)
    sock.listen(16)
    listener = trio.SocketListener(sock)
    try:
        async with trio.open_nursery() as nursery:
            task_status.started(path)
            while True:
                try:
                    stream = await listener.accept()
                except OSError as exc:  # out of descriptors: wait, never die of it
                    if exc.errno not in _ACCEPT_PAUSE_ERRNOS:
                        raise
                    await trio.sleep(_ACCEPT_PAUSE_S)
                    continue
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
        if request.get("stream") is True:
            await _answer_streaming(stream, handle, request)
            return
        response = await _respond(handle, request)
        try:
            await stream.send_all(_packed(response, request))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass


def _packed(message: dict[str, Any], request: dict[str, Any]) -> bytes:
    """``message`` framed; an error answer instead when it cannot be encoded (a number
    beyond 64 bits from a model config the user gave, say): the agent lives on."""
    try:
        return pack(message)
    except (ValueError, OverflowError, TypeError) as exc:
        log.warning("control: the answer to %s could not be encoded: %s", request.get("op"), exc)
        return pack(error_response(ControlError(
            f"the agent's answer to {str(request.get('op'))[:40]} could not be encoded "
            f"({type(exc).__name__}: {exc}); a value in the request is out of range")))


async def _respond(handle: Handler, request: dict[str, Any]) -> dict[str, Any]:
    try:
        return {"ok": True, "result": await handle(request)}
    except SwarmError as exc:
        return error_response(exc)
    except Exception as exc:  # a bug must not take the agent down: report it
        log.exception("control: %s failed", request.get("op"))
        return error_response(exc)


async def _answer_streaming(stream: trio.SocketStream, handle: Handler,
                            request: dict[str, Any]) -> None:
    """Events as the handler emits them, then the response. A client that goes away
    cancels the handler (a generation stops when its `generate` is interrupted, a load is
    cancelled when its `load` is killed): seen when an event cannot be written, and at
    once when its end of the socket closes (a client sends nothing after its request)."""
    events_in, events_out = trio.open_memory_channel[dict[str, Any]](math.inf)
    watching = trio.CancelScope()

    def send(event: dict[str, Any]) -> None:
        try:
            events_in.send_nowait({"event": event})
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            pass  # the answer is complete or the client left

    async def write_events(cancel: trio.CancelScope) -> None:
        async for event in events_out:
            try:
                await stream.send_all(_packed(event, request))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                cancel.cancel()
                return

    async def watch_for_hang_up(cancel: trio.CancelScope) -> None:
        with watching:
            try:
                while await stream.receive_some(1024):
                    pass  # nothing is expected after the request: ignored
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
            cancel.cancel()

    response: dict[str, Any] | None = None
    async with trio.open_nursery() as nursery:
        nursery.start_soon(write_events, nursery.cancel_scope)
        nursery.start_soon(watch_for_hang_up, nursery.cancel_scope)
        token = _emitter.set(send)
        try:
            response = await _respond(handle, request)
        finally:
            _emitter.reset(token)
            events_in.close()
            watching.cancel()
    if response is None:
        return  # cancelled: the client is gone
    try:
        await stream.send_all(_packed(response, request))
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
