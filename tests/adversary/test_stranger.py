"""A stranger (no join token) against live agents on real sockets.

Nothing before authentication costs more than a few bytes: a connection announcing a
64 MiB frame is cut off after the header, a slow handshake after ``handshake_timeout_s``,
and a flood of connections from one host meets the per-host caps, while an honest fellow
keeps being served. Every refusal is counted in ``status``.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

import trio

from p2pswarm.agent import Agent
from p2pswarm.agent.world import AgentWorld
from p2pswarm.config import local
from p2pswarm.security import Identity, Keyring, SwarmSecret
from p2pswarm.transport.udp_tcp import open_udp_tcp_transport
from p2pswarm.wire.base import Hello, HelloAck
from tests.adversary.stranger import announce_frame, closed_by_peer, flood, slow_loris

SECRET = SwarmSecret(bytes(range(32)))
DEADLINE_S = 20.0


def tight_config():  # type: ignore[no-untyped-def]
    config = local()
    return replace(config, security=replace(config.security, handshake_timeout_s=1.0))


async def pair(nursery: trio.Nursery, transports) -> tuple[Agent, Agent]:  # type: ignore[no-untyped-def]
    a_t, b_t = transports
    agents = [Agent(AgentWorld(name=name, transport=t, keyring=Keyring([SECRET]),
                               identity=Identity.generate(), config=tight_config(), epoch=1,
                               rng=random.Random(i), seeds=seeds))
              for i, (name, t, seeds) in enumerate((("a", a_t, ()),
                                                    ("b", b_t, (a_t.local_addr,))))]
    for agent in agents:
        await nursery.start(agent.run)
    return agents[0], agents[1]


@asynccontextmanager
async def two_fellows() -> AsyncIterator[tuple[Agent, Agent, trio.Nursery]]:
    """Fellows ``a`` and ``b`` (seeded with ``a``) on real sockets, running in a nursery
    of their own: cancel it to stop them."""
    async with open_udp_tcp_transport("127.0.0.1:0", local().transport) as a_t, \
            open_udp_tcp_transport("127.0.0.1:0", local().transport) as b_t, \
            trio.open_nursery() as nursery:
        a, b = await pair(nursery, (a_t, b_t))
        yield a, b, nursery


async def honest_call(b: Agent, a: Agent) -> None:
    reply = await b.call(a.addr, Hello(1, b.node_id, "b", b.addr))
    assert reply == HelloAck(1, a.node_id, "a", a.addr)


async def test_announced_giant_frames_and_a_slow_handshake_are_cut_off() -> None:
    with trio.fail_after(DEADLINE_S):
        async with two_fellows() as (a, b, nursery):
            socks = [await announce_frame(a.addr) for _ in range(10)]
            for sock in socks:
                with sock, trio.fail_after(2):  # cut off after the header, not waited out
                    assert await closed_by_peer(sock)
            held_s = await slow_loris(a.addr, interval_s=0.1)
            assert held_s < 3.0  # handshake_timeout_s is 1 s
            await honest_call(b, a)
            drops = a.status()["counters"]["drops"]
            assert drops["stream-handshake"] >= 11
            assert not a.stopped.is_set() and a.failure is None
            nursery.cancel_scope.cancel()


def turned_away(fellow: Any) -> int:
    transport = fellow.status()["transport"]
    return int(transport["streams_refused_busy"] + transport["handshakes_evicted"])


async def test_a_connection_flood_meets_the_per_host_cap() -> None:
    with trio.fail_after(DEADLINE_S):
        async with two_fellows() as (a, b, nursery):
            cap = a.config.transport.max_unauthenticated_per_host
            socks = await flood(a.addr, 4 * cap)
            try:
                deadline = trio.current_time() + 5
                while (turned_away(a) < 2 * cap and trio.current_time() < deadline):
                    await trio.sleep(0.02)
                # the stranger's host holds at most its cap (its oldest handshakes make room
                # for its newest); an honest fellow still gets in
                assert turned_away(a) >= 2 * cap
                await honest_call(b, a)
            finally:
                for sock in socks:
                    sock.close()
            assert not a.stopped.is_set() and a.failure is None
            nursery.cancel_scope.cancel()
