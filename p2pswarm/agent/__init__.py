"""The trio agent: one nursery driving the state machines, transports and control API."""

from p2pswarm.agent.agent import Agent, Counters

__all__ = ["Agent", "Counters"]
