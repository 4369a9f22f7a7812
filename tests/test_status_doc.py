"""The ``status`` document has exactly the keys its TypedDicts name (``status_doc``): the
JSON that ``status --json`` and the HTTP API show keeps its shape, and a key renamed in
one place and not the other fails here as well as under mypy."""

from __future__ import annotations

import random

import trio

from p2pswarm.agent import Agent
from p2pswarm.agent.status_doc import (
    CountersDoc,
    ElectorateDoc,
    LeaderDoc,
    MemberRow,
    SelfDoc,
    StatusDoc,
)
from p2pswarm.agent.world import AgentWorld
from p2pswarm.config import local
from p2pswarm.security import Identity, Keyring, SwarmSecret
from p2pswarm.transport.memory import MemoryNetwork

SECRET = SwarmSecret(bytes(range(32)))


def _agent(net: MemoryNetwork, name: str, seeds: tuple[str, ...] = ()) -> Agent:
    return Agent(AgentWorld(name=name, transport=net.transport(f"{name}:1"),
                            keyring=Keyring([SECRET]), identity=Identity.generate(),
                            config=local(), epoch=1, rng=random.Random(0), seeds=seeds))


async def test_status_has_exactly_the_keys_of_its_typed_document(autojump_clock) -> None:
    net = MemoryNetwork(seed=3)
    a, b = _agent(net, "a"), _agent(net, "b", ("a:1",))
    async with trio.open_nursery() as nursery:
        await nursery.start(net.run)
        for agent in (a, b):
            await nursery.start(agent.run)
        with trio.fail_after(60):
            while b.leader() is None or len(b.status()["members"]) < 2:
                await trio.sleep(0.5)
        status = b.status()
        assert list(status) == list(StatusDoc.__annotations__)  # the JSON's order too
        assert list(status["self"]) == list(SelfDoc.__annotations__)
        for row in status["members"]:
            assert list(row) == list(MemberRow.__annotations__)
        assert status["leader"] is not None and status["electorate"] is not None
        assert list(status["leader"]) == list(LeaderDoc.__annotations__)
        assert list(status["electorate"]) == list(ElectorateDoc.__annotations__)
        assert list(status["counters"]) == list(CountersDoc.__annotations__)
        assert status["stages_held"] == []
        for agent in (a, b):
            agent.stop()
        nursery.cancel_scope.cancel()
