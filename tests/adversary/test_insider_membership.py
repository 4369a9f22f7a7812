"""A rogue fellow (holds the token, has its own identity) against membership.

It is built from the project's own wire and security modules: it joins as an honest
agent would, then seals datagrams saying what it likes. Whatever it says about another
fellow counts only if that fellow signed it; integers it cannot outdo are clamped or
refused. Every attack runs against live agents on the in-memory network in virtual time:
the attack fails, every honest agent stays alive and keeps a leader, and the refusal is
counted in ``status``.
"""

from __future__ import annotations

import random

import trio
import trio.testing

from p2pswarm import wire
from p2pswarm.agent import Agent
from p2pswarm.agent.world import AgentWorld
from p2pswarm.config import local
from p2pswarm.membership.proofs import alive_signed_bytes
from p2pswarm.security import DatagramSealer, Identity, Keyring, SwarmSecret
from p2pswarm.transport.memory import MemoryNetwork
from p2pswarm.wire.base import Hello, HelloAck
from p2pswarm.wire.gossip import Alive, Dead, Left, Ping, Suspect

SECRET = SwarmSecret(bytes(range(32)))
U32_MAX = 2**32 - 1
U64_MAX = 2**64 - 1


class Rogue:
    """A fellow gone bad: a joined agent whose key and identity seal anything."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent

    def send(self, addr: str, *messages: object, sealer: DatagramSealer | None = None) -> None:
        sealer = sealer or self.agent.sealer
        self.agent.transport.send_datagram_nowait(addr, sealer.seal(wire.encode(*messages)))

    def forged_alive(self, victim: Agent, **changes: object) -> Alive:
        """An Alive about ``victim`` with ``changes``, signed with the rogue's own key."""
        m = victim.membership
        assert m is not None
        fields = dict(node=victim.node_id, incarnation=m.incarnation + 1, name=victim.name,
                      addr=victim.addr, public_key=victim.identity.public_key,
                      meta_version=m.meta_version, priority=0, epoch=victim.sealer.epoch)
        fields.update(changes)
        signature = self.agent.identity.sign(alive_signed_bytes(**fields))  # type: ignore[arg-type]
        return Alive(**fields, signature=signature)  # type: ignore[arg-type]

    def invented_alive(self, i: int, *, sign_as_itself: bool) -> Alive:
        """An Alive about a fellow that does not exist."""
        key = Identity.generate()
        fields = dict(node=key.node_id, incarnation=1, name=f"ghost-{i}", addr=f"ghost:{i}",
                      public_key=key.public_key, meta_version=0, priority=100, epoch=1)
        signer = self.agent.identity if sign_as_itself else None
        signature = signer.sign(alive_signed_bytes(**fields)) if signer else None  # type: ignore[arg-type]
        return Alive(**fields, signature=signature)  # type: ignore[arg-type]


    def self_signed_ghost(self, i: int) -> Alive:
        """An Alive about an identity the rogue made up, signed with that identity: a
        fellow of its own (the token lets the rogue in; nothing lets it speak for others)."""
        key = Identity.generate()
        fields = dict(node=key.node_id, incarnation=1, name=f"ghost-{i}", addr=f"ghost:{i}",
                      public_key=key.public_key, meta_version=0, priority=100, epoch=1)
        return Alive(**fields, signature=key.sign(alive_signed_bytes(**fields)))  # type: ignore[arg-type]


def make(net: MemoryNetwork, name: str, seeds: tuple[str, ...] = (), seed: int = 0) -> Agent:
    return Agent(AgentWorld(name=name, transport=net.transport(f"{name}:1"),
                            keyring=Keyring([SECRET]), identity=Identity.generate(),
                            config=local(), epoch=1000 + seed, rng=random.Random(seed),
                            seeds=seeds))


async def swarm(nursery: trio.Nursery, net: MemoryNetwork) -> tuple[list[Agent], Rogue]:
    honest = [make(net, "a", seed=1)]
    honest += [make(net, n, ("a:1",), seed=i) for i, n in enumerate("bc", start=2)]
    rogue = make(net, "rogue", ("a:1",), seed=9)
    await nursery.start(net.run)
    for agent in (*honest, rogue):
        await nursery.start(agent.run)
    await trio.sleep(10)
    for agent in honest:
        assert len([f for f in agent.fellows() if f.state == "alive"]) == 3, agent.name
        assert agent.leader() is not None
    return honest, Rogue(rogue)


def assert_unharmed(honest: list[Agent], leader: dict | None) -> None:
    for agent in honest:
        assert not agent.stopped.is_set() and agent.failure is None
        states = {f.name: f.state for f in agent.fellows()}
        assert all(states[n] == "alive" for n in ("a", "b", "c") if n != agent.name), states
        assert not any(name.startswith("ghost") for name in states), states
        assert agent.leader() == leader, agent.name


async def test_invented_members_do_not_join_the_electorate(autojump_clock) -> None:
    net = MemoryNetwork(seed=11)
    async with trio.open_nursery() as nursery:
        honest, rogue = await swarm(nursery, net)
        leader = honest[0].leader()
        for agent in honest:  # three fake Alives in one datagram, to every fellow
            rogue.send(agent.addr, *(rogue.invented_alive(i, sign_as_itself=i % 2 == 0)
                                     for i in range(3)))
        await trio.sleep(30)
        assert_unharmed(honest, leader)
        for agent in honest:
            counted = agent.status()["membership"]
            assert counted["unsigned_alives"] + counted["bad_signatures"] >= 3
        # ghosts with keys of their own are fellows of their own: they answer no probe,
        # are found dead and reaped, and the leader stays
        ghosts = [rogue.self_signed_ghost(i) for i in range(3)]
        for agent in honest:
            rogue.send(agent.addr, *ghosts)
        await trio.sleep(5)
        assert all(len(agent.fellows()) == 6 for agent in honest)
        await trio.sleep(60)
        assert_unharmed(honest, leader)
        nursery.cancel_scope.cancel()


async def test_a_fellow_cannot_be_moved_or_renamed_by_another(autojump_clock) -> None:
    net = MemoryNetwork(seed=12)
    async with trio.open_nursery() as nursery:
        honest, rogue = await swarm(nursery, net)
        a, b, c = honest
        leader = a.leader()
        moved = rogue.forged_alive(b, addr="rogue:1", name="b-now-mine")
        rogue.send(a.addr, moved)
        rogue.send(c.addr, moved, rogue.forged_alive(c, incarnation=U32_MAX))
        await trio.sleep(20)
        assert_unharmed(honest, leader)
        for agent in (a, c):
            (seen,) = [f for f in agent.fellows() if f.node_id == b.node_id]
            assert (seen.name, seen.addr) == ("b", "b:1")
        assert c.membership is not None and c.membership.incarnation < 1000
        assert a.status()["membership"]["bad_signatures"] >= 1
        nursery.cancel_scope.cancel()


async def test_max_incarnations_from_a_third_party_neither_crash_nor_spread(
        autojump_clock) -> None:
    net = MemoryNetwork(seed=13)
    async with trio.open_nursery() as nursery:
        honest, rogue = await swarm(nursery, net)
        a, b, c = honest
        leader = a.leader()
        for agent in honest:
            rogue.send(agent.addr, Suspect(agent.node_id, U32_MAX, rogue.agent.node_id),
                       Suspect(b.node_id, U32_MAX, rogue.agent.node_id),
                       Dead(c.node_id, U32_MAX - 1, rogue.agent.node_id),
                       Left(a.node_id, U32_MAX))
        await trio.sleep(30)
        assert_unharmed(honest, leader)
        for agent in honest:
            assert agent.membership is not None
            assert agent.membership.incarnation < 100  # refuted just above what it signed
            assert all(f.incarnation < 100 for f in agent.fellows())
            assert agent.status()["membership"]["claims_clamped"] >= 1
            assert not any(k.startswith("handler-failed")
                           for k in agent.status()["counters"]["drops"])
        nursery.cancel_scope.cancel()


async def test_a_forged_far_future_epoch_does_not_lock_a_fellow_out(autojump_clock) -> None:
    net = MemoryNetwork(seed=14)
    async with trio.open_nursery() as nursery:
        honest, rogue = await swarm(nursery, net)
        a, b, c = honest
        leader = a.leader()
        for k in range(4):  # sealed as if b sent them, epochs at the top of the range
            as_b = DatagramSealer(rogue.agent.keyring, b.node_id, U64_MAX - k)
            replayed = b.membership._alive_msg() if b.membership else None
            for agent in (a, c):
                rogue.send(agent.addr, Ping(1, agent.node_id, b.node_id), replayed,
                           sealer=as_b)
        await trio.sleep(30)
        assert_unharmed(honest, leader)
        for agent in (a, c):
            assert agent.sealer.proven_epoch(b.node_id) == b.sealer.epoch
            (seen,) = [f for f in agent.fellows() if f.node_id == b.node_id]
            assert seen.last_heard_s is not None and seen.last_heard_s > 35
        nursery.cancel_scope.cancel()


async def test_a_fellow_cannot_hold_unbounded_streams_open(autojump_clock) -> None:
    net = MemoryNetwork(seed=15)
    async with trio.open_nursery() as nursery:
        honest, rogue = await swarm(nursery, net)
        a, b = honest[0], honest[1]
        cap = a.config.transport.max_streams_per_fellow
        held = [await rogue.agent.open_secure(a.addr) for _ in range(cap + 5)]
        await trio.sleep(1)
        assert a.status()["counters"]["drops"]["stream-fellow-cap"] == 5
        reply = await b.call(a.addr, Hello(1, b.node_id, "b", b.addr))  # others still served
        assert reply == HelloAck(1, a.node_id, "a", a.addr)
        # silent streams are closed after stream_idle_timeout_s, freeing the cap
        await trio.sleep(a.config.transport.stream_idle_timeout_s + 1)
        assert a.status()["counters"]["drops"]["stream-idle"] == cap
        for stream in held:
            await stream.aclose()
        nursery.cancel_scope.cancel()


async def test_a_fellow_restarted_with_its_clock_behind_is_heard_again(autojump_clock) -> None:
    net = MemoryNetwork(seed=16)
    async with trio.open_nursery() as nursery:
        honest, rogue = await swarm(nursery, net)
        a, b, c = honest
        assert a.sealer.proven_epoch(b.node_id) == b.sealer.epoch
        b.stop()  # a Raspberry Pi without a clock battery: back up with an older epoch
        await trio.sleep(1)
        b2 = Agent(AgentWorld(name="b", transport=net.transport("b2:1"), keyring=b.keyring,
                              identity=b.identity, config=local(), epoch=b.sealer.epoch - 500,
                              rng=random.Random(99), seeds=("a:1",)))
        await nursery.start(b2.run)
        await trio.sleep(15)
        for agent in (a, c):
            (seen,) = [f for f in agent.fellows() if f.node_id == b.node_id]
            assert (seen.state, seen.addr) == ("alive", "b2:1"), agent.name
            assert agent.sealer.proven_epoch(b.node_id) == b2.sealer.epoch
            assert seen.last_heard_s is not None and seen.last_heard_s > 20
        nursery.cancel_scope.cancel()
