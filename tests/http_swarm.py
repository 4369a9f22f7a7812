"""A real swarm on loopback with each agent's HTTP server, for tests and benchmarks that
talk to it over HTTP from ordinary (blocking) clients.

The agents run on trio in a thread of their own; the caller's thread talks HTTP to them
(``url(i)``), and runs coroutines on their loop with ``call``.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import trio

from p2pswarm.agent import Agent
from p2pswarm.agent.weights import WeightsCache
from p2pswarm.cards import Card
from p2pswarm.config import local
from p2pswarm.http.app import HttpSettings, serve_http
from p2pswarm.inventory import FakeCardSource
from p2pswarm.planner import BUILTIN_MODELS
from p2pswarm.security import Identity, Keyring, SwarmSecret
from p2pswarm.transport.udp_tcp import open_udp_tcp_transport

T = TypeVar("T")
GB = 10**9


def cpu_card(free_gb: float = 16.0, total_gb: float = 16.0) -> Card:
    return Card(index=0, kind="cpu", name="CPU", uuid="", total_bytes=int(total_gb * GB),
                free_bytes=int(free_gb * GB))


def serve_body(model: str = "tiny-llama", **extra: Any) -> dict[str, Any]:
    """An /api/models/plan body for the test swarm: two stages, exact f32."""
    return {"model": model, "stages": 2, "weights_dtype": "f32", "kv_dtype": "f32",
            "context": 512, **extra}


def serve_message(model: str = "tiny-llama", **extra: Any) -> dict[str, Any]:
    """The plan request ``serve_body`` becomes (what the CLI sends the agent)."""
    return {"model": {"name": model, "config": BUILTIN_MODELS[model]}, "kind": "serve",
            "stages": 2, "weights_dtype": "f32", "kv_dtype": "f32", "context": 512,
            "sequences": 1, "exclude": [], "floors_bytes": {}, "maximize": None, **extra}


class LoopbackSwarm:
    def __init__(self, root: Path, n: int = 2, *, token: str | None = None,
                 http_host: str = "127.0.0.1") -> None:
        self.root = root
        self.n = n
        self.token = token
        self.http_host = http_host
        self.agents: list[Agent] = []
        self.cards: list[FakeCardSource] = []
        self.http: list[str] = []  # host:port of each agent's HTTP server
        self._trio_token: trio.lowlevel.TrioToken | None = None
        self._ready = threading.Event()
        self._stop: trio.Event | None = None
        self._nursery: trio.Nursery | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="loopback-swarm", daemon=True)

    def url(self, i: int = 0) -> str:
        return f"http://{self.http[i]}"

    def __enter__(self) -> LoopbackSwarm:
        self._thread.start()
        if not self._ready.wait(60) or self._error is not None:
            self.__exit__()
            raise RuntimeError(f"the loopback swarm did not start: {self._error!r}")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._stop is not None and self._trio_token is not None:
            try:
                trio.from_thread.run_sync(self._stop.set, trio_token=self._trio_token)
            except trio.RunFinishedError:
                pass
        self._thread.join(30)

    def call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``fn(*args)`` on the swarm's trio loop and return its result."""
        return trio.from_thread.run(fn, *args, trio_token=self._trio_token)

    def run_sync(self, fn: Callable[..., T], *args: Any) -> T:
        return trio.from_thread.run_sync(fn, *args, trio_token=self._trio_token)

    def serve_http(self, i: int, settings: HttpSettings) -> str | None:
        """Start another HTTP server for agent ``i``; its bound host:port."""
        assert self._nursery is not None
        return self.call(self._nursery.start, serve_http, self.agents[i], settings)

    def leader(self) -> Agent:
        return next(a for a in self.agents if a.leadership.is_leader())

    def _run(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as exc:  # reported by __enter__
            self._error = exc
            self._ready.set()

    async def _main(self) -> None:
        self._trio_token = trio.lowlevel.current_trio_token()
        self._stop = trio.Event()
        config = local()
        secret = SwarmSecret(bytes(range(32)))
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            transports = [await nursery.start(_transport, config) for _ in range(self.n)]
            for i, transport in enumerate(transports):
                cards = FakeCardSource((cpu_card(),))
                agent = Agent(name=f"fellow-{i + 1}", transport=transport,
                              keyring=Keyring([secret]), identity=Identity.generate(),
                              config=config, epoch=time.time_ns() // 1000,
                              rng=random.Random(i), card_source=cards,
                              seeds=() if i == 0 else (transports[0].local_addr,))
                agent.serving.cache = WeightsCache(self.root / f"cache-{i}")
                self.agents.append(agent)
                self.cards.append(cards)
                await nursery.start(agent.run)
            with trio.fail_after(30):
                while not self._converged():
                    await trio.sleep(0.02)
            for agent in self.agents:
                bound = await nursery.start(serve_http, agent,
                                            HttpSettings(self.http_host, 0, self.token))
                self.http.append(bound)
            self._ready.set()
            await self._stop.wait()
            for agent in self.agents:
                agent.stop()
            nursery.cancel_scope.cancel()

    def _converged(self) -> bool:
        for agent in self.agents:
            if agent.leader() is None or agent.membership is None:
                return False
            if sum(m.state == "alive" for m in agent.membership.members()) != self.n:
                return False
        return True

    async def wait_for(self, predicate: Callable[[], bool], timeout_s: float = 30) -> None:
        """Until ``predicate()`` holds on the swarm's loop (polled, never slept out)."""
        with trio.fail_after(timeout_s):
            while not predicate():
                await trio.sleep(0.02)


async def _transport(config: Any, *, task_status: Any) -> None:
    async with open_udp_tcp_transport("127.0.0.1:0", config.transport) as transport:
        task_status.started(transport)
        await trio.sleep_forever()


__all__ = ["LoopbackSwarm", "cpu_card", "serve_body", "serve_message"]
