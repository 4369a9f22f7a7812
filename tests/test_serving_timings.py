"""Serving's timings live in the config (``ServingConfig``), every preset keeps them, and
the rooms read them from the world they are built in."""

from __future__ import annotations

import random
from dataclasses import replace

from p2pswarm.agent import Agent
from p2pswarm.agent.world import AgentWorld
from p2pswarm.config import PRESETS, ServingConfig, local
from p2pswarm.security import Identity, Keyring, SwarmSecret
from p2pswarm.transport.memory import MemoryNetwork


def test_every_preset_keeps_the_serving_timings() -> None:
    for make in PRESETS.values():
        assert make().serving == ServingConfig()
    assert ServingConfig().grace_s == 8.0 and ServingConfig().order_timeout_s == 30.0


def test_the_rooms_read_their_timings_from_the_agents_config() -> None:
    timings = ServingConfig(grace_s=2.0, order_timeout_s=3.0, reservation_s=4.0)
    network = MemoryNetwork()
    agent = Agent(AgentWorld(
        name="a", transport=network.transport("a:1"),
        keyring=Keyring([SwarmSecret.generate()]), identity=Identity.generate(),
        config=replace(local(), serving=timings), epoch=1, rng=random.Random(0)))
    serving = agent.serving
    assert serving.failover.grace_s == 2.0
    assert serving.leader.timings is timings and serving.failover.timings is timings
