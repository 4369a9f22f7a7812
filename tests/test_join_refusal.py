"""A fellow whose token is another swarm's, in virtual time: the seed answers its hello
with a key refusal, and after three the agent stops with TokenRefused (what `join` then
says in one line, see tests/test_join_token.py for the real processes). A seed that only
closes streams at the hello (busy, flooded) is retried: that is no verdict on the token."""

from __future__ import annotations

import random

import trio

from p2pswarm.agent import Agent
from p2pswarm.agent.world import AgentWorld
from p2pswarm.config import local
from p2pswarm.errors import TokenRefused
from p2pswarm.security import Identity, Keyring, SwarmSecret
from p2pswarm.sim.virtual import VirtualSwarm, wait_until
from p2pswarm.transport.base import Stream

STRANGER_ADDR = "10.0.9.9:7946"


def stranger(swarm: VirtualSwarm, seeds: tuple[str, ...]) -> Agent:
    swarm.net.up(STRANGER_ADDR)
    return Agent(AgentWorld(
        name="stranger", transport=swarm.net.transport(STRANGER_ADDR),
        keyring=Keyring([SwarmSecret(bytes(range(1, 33)))]),
        identity=Identity.from_private_bytes(bytes(32)), config=local(), epoch=1,
        rng=random.Random(1), seeds=seeds))


async def test_three_refused_handshakes_stop_the_agent(autojump_clock) -> None:
    swarm = VirtualSwarm(1, seed=3)
    async with trio.open_nursery() as nursery:
        await nursery.start(swarm.run)
        await swarm.start(0)
        agent = stranger(swarm, (swarm.fellows[0].addr,))
        began = trio.current_time()
        await nursery.start(agent.run)
        await wait_until(agent.stopped.is_set, timeout_s=60)
        assert isinstance(agent.failure, TokenRefused)
        assert "refused this fellow's handshake 3 times" in str(agent.failure)
        assert trio.current_time() - began < 15
        nursery.cancel_scope.cancel()


async def test_a_silent_seed_is_retried_not_refused(autojump_clock) -> None:
    swarm = VirtualSwarm(1, seed=4)
    async with trio.open_nursery() as nursery:
        await nursery.start(swarm.run)
        agent = stranger(swarm, (swarm.fellows[0].addr,))  # the seed never started
        await nursery.start(agent.run)
        await trio.sleep(120.0)
        assert not agent.stopped.is_set() and agent.failure is None
        nursery.cancel_scope.cancel()


async def test_a_seed_that_closes_at_the_hello_is_retried_not_refused(autojump_clock) -> None:
    swarm = VirtualSwarm(1, seed=5)
    busy_addr = "10.0.9.8:7946"
    swarm.net.up(busy_addr)
    busy = swarm.net.transport(busy_addr)
    closed = 0

    async def close_at_hello(stream: Stream) -> None:
        nonlocal closed
        await stream.receive_frame()
        closed += 1
        await stream.aclose()

    async with trio.open_nursery() as nursery:
        await nursery.start(swarm.run)
        await nursery.start(busy.serve_streams, close_at_hello)
        agent = stranger(swarm, (busy_addr,))
        await nursery.start(agent.run)
        await trio.sleep(120.0)
        assert closed >= 3  # more than enough closes to have stopped it before
        assert not agent.stopped.is_set() and agent.failure is None
        nursery.cancel_scope.cancel()
