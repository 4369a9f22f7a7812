"""The agent's HTTP server: the JSON API, the pages, and the OpenAI-compatible endpoint.

One ASGI application served by hypercorn's trio worker inside the agent's own nursery, so
a request runs on the agent's event loop and calls the agent's control ops in-process
(``agent.control_ops[op]``): the HTTP API and the CLI share one implementation.

It binds 127.0.0.1 by default. Any other address needs a token, and then every request
must carry ``Authorization: Bearer TOKEN`` (401 otherwise): the API can load models
and spend every fellow's memory, so it is never open to a network by accident. The pages
and their static files hold no data, so a browser may fetch them without the header; the
page takes the token from its address (``/plan?token=T``) and sends it on every API call.
Before any of that, ``http.guard`` keeps the web out: foreign ``Host`` names (DNS
rebinding), state changes from other origins, bodies that are not JSON, and framing a
proxy could read differently are refused, and counted in ``status``.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import math
import mimetypes
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast
from urllib.parse import parse_qs

import trio

from p2pswarm.config import split_addr
from p2pswarm.errors import ConfigError, SwarmError, TransportError
from p2pswarm.http.guard import (
    COUNTED,
    JSON_TYPE,
    MAX_BODY_BYTES,
    MAX_HEADER_BYTES,
    SECURITY_HEADERS,
    WebGuard,
    split_host,
)
from p2pswarm.http.problems import HttpError, from_swarm_error

if TYPE_CHECKING:
    from p2pswarm.agent.agent import Agent

log = logging.getLogger("p2pswarm.http")

DEFAULT_HTTP = "127.0.0.1:7780"
STATIC_DIR = Path(__file__).resolve().parent / "static"
PAGES = {"/": "index.html", "/plan": "plan.html", "/swarm": "swarm.html"}

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


# --- settings ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class HttpSettings:
    host: str
    port: int
    token: str | None = None
    explicit: bool = True  # given with --http: a busy port is an error, not a warning
    allow_hosts: tuple[str, ...] = ()  # names beyond loopback the server answers to
    allow_dirs: tuple[str, ...] = ()  # where jobs sent over HTTP may name files

    @property
    def guard(self) -> WebGuard:
        names = self.allow_hosts if is_loopback(self.host) else (*self.allow_hosts, self.host)
        return WebGuard.for_names(names)

    @property
    def bind(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def http_settings(addr: str | None, token: str | None = None, *,
                  allow_hosts: tuple[str, ...] = (),
                  allow_dirs: tuple[str, ...] = ()) -> HttpSettings | None:
    """``--http ADDR:PORT`` (None: the default; ``off``: no server), ``--http-token``,
    ``--http-allow-host`` and ``--http-allow-dir``.

    ConfigError for an address beyond loopback without a token, a bad address, a host
    name that is not one, or an allowed directory that is not an existing directory."""
    explicit = addr is not None
    text = (addr if addr is not None else DEFAULT_HTTP).strip()
    if text.lower() == "off":
        return None
    if token is not None and not token.strip():
        raise ConfigError("--http-token is empty: give a long random string, e.g. "
                          "from `openssl rand -hex 16`")
    try:
        host, port = split_addr(text, default_port=7780)
    except ConfigError as exc:
        raise ConfigError(f"--http: {exc}") from None
    if not is_loopback(host) and token is None:
        raise ConfigError(f"--http {text} is reachable beyond this machine: add --http-token "
                          "TOKEN (clients then send `Authorization: Bearer TOKEN`), or bind "
                          "127.0.0.1")
    return HttpSettings(host, port, token.strip() if token else None, explicit,
                        tuple(_allowed_host(h) for h in allow_hosts),
                        tuple(_allowed_dir(d) for d in allow_dirs))


def _allowed_host(name: str) -> str:
    try:
        host, _ = split_host(name)
    except ValueError:
        host = ""
    if not host or "/" in host or "*" in host:
        raise ConfigError(f"--http-allow-host {name!r}: give a host name such as "
                          "mybox.local, without a scheme or path")
    return host


def _allowed_dir(text: str) -> str:
    path = Path(text).expanduser()
    if not path.is_dir():
        raise ConfigError(f"--http-allow-dir {text}: not a directory on this machine")
    return str(path.resolve())


# --- one request ---------------------------------------------------------------------------


class Call:
    """One HTTP request being answered: its parts, and the ways to answer it."""

    def __init__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.scope = scope
        self.receive = receive
        self.send = send
        self.method: str = scope["method"]
        self.path: str = scope["path"]
        self.query = {k: v[-1] for k, v in
                      parse_qs(scope.get("query_string", b"").decode("latin-1")).items()}
        self.headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                        for k, v in scope.get("headers", [])}
        self.started = False  # the response's status line went out
        self.disconnected = False
        self.body_read = False

    @property
    def announced_body(self) -> bool:
        """Whether the request said a body follows."""
        return ("transfer-encoding" in self.headers
                or self.headers.get("content-length", "0").strip() not in ("", "0"))

    async def body(self) -> bytes:
        data = bytearray()
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                self.disconnected = True
                raise HttpError("bad-request", "the client went away mid-request")
            data += message.get("body", b"")
            if len(data) > MAX_BODY_BYTES:
                raise HttpError("too-large", f"the request body is over "
                                             f"{MAX_BODY_BYTES // (1024 * 1024)} MiB")
            if not message.get("more_body", False):
                self.body_read = True
                return bytes(data)

    async def json(self) -> dict[str, Any]:
        """The body as a JSON object; 400 ``bad-json`` when it is not one."""
        raw = await self.body()
        if not raw.strip():
            return {}
        kind = self.headers.get("content-type", "").partition(";")[0].strip().lower()
        if kind != JSON_TYPE:  # the guard's check, again for bodies no header announced
            raise HttpError("unsupported-media-type", f"the body must be JSON sent with "
                                                      f"`Content-Type: {JSON_TYPE}`")
        try:
            data = json.loads(raw)
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise HttpError("bad-json", f"the request body is not valid JSON ({exc})") from None
        if not isinstance(data, dict):
            raise HttpError("bad-json", "the request body must be a JSON object, "
                                        f"not {type(data).__name__}")
        return data

    async def respond(self, status: int, body: bytes, content_type: str,
                      headers: tuple[tuple[str, str], ...] = ()) -> None:
        await self.start(status, content_type, headers)
        await self.send({"type": "http.response.body", "body": body, "more_body": False})

    async def respond_json(self, data: Any, status: int = 200) -> None:
        await self.respond(status, dumps(data), "application/json")

    async def fail(self, error: HttpError) -> None:
        await self.respond(error.status, dumps(error.document()), "application/json",
                           error.headers)

    async def start(self, status: int, content_type: str,
                    headers: tuple[tuple[str, str], ...] = ()) -> None:
        self.started = True
        await self.send({"type": "http.response.start", "status": status, "headers": [
            (b"content-type", content_type.encode()), (b"cache-control", b"no-store"),
            *((k.encode(), v.encode()) for k, v in (*SECURITY_HEADERS, *headers))]})

    async def chunk(self, data: bytes) -> None:
        """Part of a streamed body (after ``start``)."""
        await self.send({"type": "http.response.body", "body": data, "more_body": True})

    async def end(self) -> None:
        await self.send({"type": "http.response.body", "body": b"", "more_body": False})

    async def wait_disconnect(self) -> None:
        """Return when the client goes away (call after reading the body)."""
        while not self.disconnected:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                self.disconnected = True


def dumps(data: Any) -> bytes:
    """JSON bytes; infinities and NaN (which JSON lacks) become null."""
    try:
        return json.dumps(data, allow_nan=False, separators=(",", ":")).encode()
    except ValueError:
        return json.dumps(_finite(data), allow_nan=False, separators=(",", ":")).encode()


def _finite(data: Any) -> Any:
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, dict):
        return {k: _finite(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [_finite(v) for v in data]
    return data


# --- routing -------------------------------------------------------------------------------

Handler = Callable[..., Awaitable[None]]


@dataclass(frozen=True, slots=True)
class Route:
    method: str
    path: str  # segments in braces match one path segment: /api/jobs/{job_id}/cancel
    handler: Handler

    def match(self, path: str) -> dict[str, str] | None:
        want, got = self.path.strip("/").split("/"), path.strip("/").split("/")
        if len(want) != len(got):
            return None
        params = {}
        for w, g in zip(want, got):
            if w.startswith("{") and w.endswith("}"):
                if not g:
                    return None
                params[w[1:-1]] = g
            elif w != g:
                return None
        return params


class HttpApp:
    """The ASGI application of one agent."""

    def __init__(self, agent: Agent, token: str | None = None, *,
                 guard: WebGuard | None = None, allow_dirs: tuple[str, ...] = ()) -> None:
        from p2pswarm.http.api import api_routes
        from p2pswarm.http.metrics import Metrics
        from p2pswarm.http.openai_api import openai_routes
        from p2pswarm.http.openapi import openapi_document
        from p2pswarm.http.swarm_view import SwarmView

        self.agent = agent
        self.token = token
        self.guard = guard or WebGuard()
        self.errors: Counter[str] = Counter()  # error answers by code, for /metrics
        document = openapi_document()
        view = SwarmView(agent)
        self.metrics = Metrics(agent, self.errors)

        async def openapi(call: Call) -> None:
            await call.respond_json(document)

        async def swarm(call: Call) -> None:
            await call.respond_json(await view.document(time.time()))

        async def metrics(call: Call) -> None:
            from prometheus_client import CONTENT_TYPE_LATEST

            await call.respond(200, await self.metrics.scrape(), CONTENT_TYPE_LATEST)

        self.routes: list[Route] = [
            *api_routes(agent, tuple(Path(d) for d in allow_dirs)), *openai_routes(agent),
            Route("GET", "/openapi.json", openapi),
            Route("GET", "/api/swarm", swarm),
            Route("GET", "/metrics", metrics),
            *(Route("GET", path, _page(name)) for path, name in PAGES.items()),
            Route("GET", "/static/{name}", _static),
        ]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            return  # websockets: not offered
        call = Call(scope, receive, send)
        try:
            self.guard.check(call.method, scope.get("headers", []))
            self._authorize(call)
            handler, params = self._route(call)
            await handler(call, **params)
        except HttpError as exc:
            await self._fail(call, exc)
        except SwarmError as exc:
            await self._fail(call, from_swarm_error(exc))
        except Exception as exc:  # a bug must not take the agent down: report it
            log.exception("http: %s %s failed", call.method, call.path)
            await self._fail(call, HttpError("agent-error", f"the agent failed: "
                                                            f"{type(exc).__name__}: {exc}"))

    async def _fail(self, call: Call, error: HttpError) -> None:
        self.errors[error.code] += 1  # every refusal, by its code (bounded: the codes)
        if error.code in COUNTED:
            self.agent.counters.drop(f"http-{error.code}")
        if call.started:  # mid-stream: the handler said what it could; just end
            try:
                await call.end()
            except Exception:  # the client is gone
                pass
            return
        if call.announced_body and not call.body_read:
            # refused before its body was read: the connection cannot carry another request,
            # and a client must not send one on it
            await call.respond(error.status, dumps(error.document()), "application/json",
                               (*error.headers, ("connection", "close")))
            return
        await call.fail(error)

    def _authorize(self, call: Call) -> None:
        if self.token is None:
            return
        if call.method in ("GET", "HEAD") and (call.path in PAGES
                                               or call.path.startswith("/static/")):
            return  # code, not data: the page's own API calls carry the token
        scheme, _, given = call.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            raise HttpError("unauthorized", "this agent needs `Authorization: Bearer TOKEN` "
                                            "with the token given to `p2pswarm join "
                                            "--http-token`")
        if not hmac.compare_digest(given.strip().encode(), self.token.encode()):
            raise HttpError("unauthorized", "the bearer token is not this agent's "
                                            "--http-token")

    def _route(self, call: Call) -> tuple[Handler, dict[str, str]]:
        allowed = []
        for route in self.routes:
            params = route.match(call.path)
            if params is None:
                continue
            if route.method == call.method or (call.method == "HEAD" and route.method == "GET"):
                return route.handler, params
            allowed.append(route.method)
        if allowed:
            raise HttpError("method-not-allowed", f"{call.path} answers "
                                                  f"{' or '.join(sorted(set(allowed)))}, "
                                                  f"not {call.method}")
        raise HttpError("not-found", f"nothing at {call.path}; /openapi.json lists what "
                                     "this agent answers")


def _page(name: str) -> Handler:
    async def page(call: Call) -> None:
        await _send_file(call, name)
    return page


async def _static(call: Call, name: str) -> None:
    await _send_file(call, name)


async def _send_file(call: Call, name: str) -> None:
    path = (STATIC_DIR / name).resolve()
    if STATIC_DIR not in path.parents or not path.is_file():
        raise HttpError("not-found", f"no page file {name!r} is installed with this agent")
    data = await trio.Path(path).read_bytes()
    kind = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
    if kind.startswith("text/") or kind in ("application/javascript", "application/json"):
        kind += "; charset=utf-8"
    await call.respond(200, data, kind)


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


# --- serving -------------------------------------------------------------------------------


async def serve_http(agent: Agent, settings: HttpSettings, *,
                     task_status: trio.TaskStatus[str | None] = trio.TASK_STATUS_IGNORED) -> None:
    """Answer HTTP on ``settings`` until the agent stops; ``started`` with the bound
    ``host:port`` (None when the default port was busy and the server stayed off)."""
    from hypercorn.config import Config
    from hypercorn.trio.run import worker_serve
    from hypercorn.typing import ASGIFramework
    from hypercorn.utils import wrap_app

    config = Config()
    config.bind = [settings.bind]
    config.accesslog = None
    config.errorlog = logging.getLogger("p2pswarm.http.server")
    config.graceful_timeout = 1.0
    config.include_server_header = False
    config.h11_max_incomplete_size = MAX_HEADER_BYTES  # a larger header block: 400, closed
    config.h2_max_header_list_size = MAX_HEADER_BYTES
    app = HttpApp(agent, settings.token, guard=settings.guard, allow_dirs=settings.allow_dirs)
    try:  # bind here, not in hypercorn: a busy port is a clear error (or, by default, a note)
        sockets = config.create_sockets()
    except OSError as exc:
        what = f"cannot serve HTTP on {settings.bind}: {exc.strerror or exc}"
        if settings.explicit:
            raise TransportError(f"{what}; give another --http port, stop the other program "
                                 "holding it, or --http off") \
                from exc
        log.warning("%s; the HTTP API is off (choose a port with --http ADDR:PORT)", what)
        task_status.started(None)
        return
    for sock in sockets.insecure_sockets:
        sock.listen(config.backlog)
    host, port = sockets.insecure_sockets[0].getsockname()[:2]
    bound = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    log.info("HTTP API on http://%s (%s)", bound,
             "bearer token required" if settings.token else "this machine only")
    # HttpApp speaks ASGI 3 with plain-dict scopes and events, not hypercorn's TypedDicts
    framework = cast("ASGIFramework", app)
    await worker_serve(wrap_app(framework, config.wsgi_max_body_size, "asgi"), config,
                       sockets=sockets, shutdown_trigger=agent.stopped.wait,
                       task_status=_Started(task_status, bound))


class _Started:
    """Hands ``started`` the bound address rather than hypercorn's list of URLs."""

    def __init__(self, task_status: trio.TaskStatus[str | None], bound: str) -> None:
        self.task_status = task_status
        self.bound = bound

    def started(self, value: Any = None) -> None:
        self.task_status.started(self.bound)


__all__ = ["Call", "DEFAULT_HTTP", "HttpApp", "HttpSettings", "Route", "dumps", "http_settings",
           "is_loopback", "serve_http"]
