"""Control requests as typed messages: the one place a request map becomes a value.

A client that speaks messages sends ``request_map(msg)``: the op's name and the message
encoded by the wire codec (``"msg"``), which ``typed_op`` decodes and checks like any
message from the network. A client that sends plain maps (``{"op": NAME, field: value,
...}``: the HTTP API, scripts, older CLIs) is answered too: the op's ``from_map`` builds
the message from them (its own checks, in its own words), and the codec then bounds every
field as if it had come encoded. The handler behind either receives the message only.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from p2pswarm import wire
from p2pswarm.control.protocol import MAX_MESSAGE_BYTES
from p2pswarm.errors import ConfigError, LocalProtocolError, RemoteProtocolError

M = TypeVar("M")

RequestMap = dict[str, Any]
Handler = Callable[[RequestMap], Awaitable[Any]]


def request_map(op: str, msg: object) -> RequestMap:
    """What a client sends for ``msg``, the request of ``op``."""
    return {"op": op, "msg": wire.encode(msg, max_bytes=MAX_MESSAGE_BYTES)}


def decoded(raw: bytes, kind: type[M]) -> M:
    """The ``kind`` message a client sent encoded; ConfigError when it is not one."""
    try:
        messages = wire.decode(raw, max_bytes=MAX_MESSAGE_BYTES)
    except RemoteProtocolError as exc:
        raise ConfigError(f"a malformed {kind.__name__} ({exc})") from None
    if len(messages) != 1 or type(messages[0]) is not kind:
        raise ConfigError(f"expected one {kind.__name__}, got "
                          f"{', '.join(type(m).__name__ for m in messages)}")
    out: M = messages[0]
    return out


def checked(msg: M) -> M:
    """``msg`` bounded by the codec as if it had arrived encoded (every length, range and
    type of its schema); ConfigError naming the field otherwise."""
    try:
        return decoded(wire.encode(msg, max_bytes=MAX_MESSAGE_BYTES), type(msg))
    except LocalProtocolError as exc:
        raise ConfigError(f"{type(msg).__name__}: {exc}") from None


def typed_op(kind: type[M], from_map: Callable[[RequestMap], M],
             handler: Callable[[M], Awaitable[Any]]) -> Handler:
    """A control op answered by ``handler``, which receives a ``kind`` message: decoded
    from ``"msg"``, or made by ``from_map`` from a plain request map and checked."""

    async def answer(request: RequestMap) -> Any:
        raw = request.get("msg")
        msg = decoded(raw, kind) if isinstance(raw, bytes) else checked(from_map(request))
        return await handler(msg)

    return answer


def text(request: RequestMap, key: str, what: str | None = None) -> str:
    """A request's optional text field ("" when missing, empty or null)."""
    value = request.get(key) or ""
    if not isinstance(value, str):
        raise ConfigError(f"{what or repr(key)} must be a string")
    return value


__all__ = ["checked", "decoded", "request_map", "text", "typed_op"]
