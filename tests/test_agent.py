"""The agent shell: sealed datagrams and streams between agents, drops counted by reason.

Virtual-time tests run on MemoryNetwork under an autojump MockClock; one test uses real
sockets on loopback.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import trio
import trio.testing

from p2pswarm.agent import Agent
from p2pswarm.agent.world import AgentWorld
from p2pswarm.config import GossipTuning, local
from p2pswarm.errors import TransportError
from p2pswarm.membership import Event, Membership
from p2pswarm.security import Identity, Keyring, SwarmSecret
from p2pswarm.transport.base import DeliversDatagrams, RingsAlarms, SendsNowait
from p2pswarm.transport.memory import MemoryNetwork
from p2pswarm.transport.udp_tcp import UdpTcpTransport, open_udp_tcp_transport
from p2pswarm.wire import PROTOCOL_MAJOR, PROTOCOL_MINOR, encode
from p2pswarm.wire.base import Hello, HelloAck

SECRET = SwarmSecret(bytes(range(32)))
OTHER_SECRET = SwarmSecret(bytes(range(1, 33)))


def world(transport, name: str, secret: SwarmSecret = SECRET, seeds=(), seed: int = 0):
    return AgentWorld(name=name, transport=transport, keyring=Keyring([secret]),
                      identity=Identity.generate(), config=local(), epoch=1,
                      rng=random.Random(seed), seeds=tuple(seeds))


def make_agent(transport, name: str, secret: SwarmSecret = SECRET, seeds=(), seed: int = 0):
    return Agent(world(transport, name, secret, seeds, seed))


async def test_the_world_builds_the_machines_and_hears_every_event(autojump_clock) -> None:
    net = MemoryNetwork(seed=4)
    heard: list[Event] = []
    built: list[Membership] = []

    def membership(*args, **kwargs) -> Membership:
        built.append(Membership(*args, **kwargs))
        return built[-1]

    slow = replace(local(), gossip=replace(local().gossip, tuning=GossipTuning(linger_s=0.5)))
    a = Agent(replace(world(net.transport("a:1"), "a"), config=slow, on_event=heard.append,
                      membership=membership, metadata={"note": "hello"}))
    b = make_agent(net.transport("b:1"), "b", seeds=["a:1"])
    async with trio.open_nursery() as nursery:
        await nursery.start(net.run)
        for agent in (a, b):
            await nursery.start(agent.run)
        await trio.sleep(5)
        assert a.membership is built[0] and len(built) == 1
        assert a.membership.tuning.linger_s == 0.5  # the tuning rides in the config
        assert {"joined", "member-joined", "leader"} <= {e.kind for e in heard}
        assert heard == a.events  # the same events the agent notes for its status
        (fellow,) = b.fellows()
        assert b.fellow_says(fellow).others["note"] == "hello"
        nursery.cancel_scope.cancel()


def test_optional_transport_capabilities_are_protocols() -> None:
    memory = MemoryNetwork(seed=1).transport("a:1")
    for capability in (SendsNowait, DeliversDatagrams, RingsAlarms):
        assert isinstance(memory, capability)
        assert not issubclass(UdpTcpTransport, capability)


async def test_agents_find_each_other_and_an_outsider_is_dropped(autojump_clock) -> None:
    net = MemoryNetwork(seed=3)
    a = make_agent(net.transport("a:1"), "a")
    b = make_agent(net.transport("b:1"), "b", seeds=["a:1"])
    outsider = make_agent(net.transport("x:1"), "x", OTHER_SECRET, seeds=["a:1", "b:1"])
    async with trio.open_nursery() as nursery:
        await nursery.start(net.run)
        for agent in (a, b, outsider):
            await nursery.start(agent.run)
        await trio.sleep(5)
        assert [(f.name, f.state) for f in a.fellows()] == [("b", "alive")]
        assert [(f.name, f.state) for f in b.fellows()] == [("a", "alive")]
        assert not outsider.fellows()
        # the outsider's join attempts (stream handshakes) are refused and counted
        assert a.counters.drops["stream-unknown-key"] > 0
        # a stream request and its reply, sealed end to end
        reply = await a.call("b:1", Hello(9, a.node_id, "a", "a:1"))
        assert reply == HelloAck(9, b.node_id, "b", "b:1")
        # the outsider cannot complete a stream handshake
        refused = a.counters.drops["stream-unknown-key"]
        with pytest.raises(Exception):
            await outsider.call("a:1", Hello(1, outsider.node_id, "x", "x:1"))
        await trio.sleep(0.01)
        assert a.counters.drops["stream-unknown-key"] == refused + 1
        # in virtual time no loop is late: a deadline already past when it was set (work
        # due at once) is not the loop's lateness, or the fellows would wait on for it
        assert a.loop_lag.max_s == b.loop_lag.max_s == 0.0
        nursery.cancel_scope.cancel()


async def test_tampered_replayed_and_garbage_datagrams_are_counted(autojump_clock) -> None:
    net = MemoryNetwork(seed=4)
    a = make_agent(net.transport("a:1"), "a")
    b = make_agent(net.transport("b:1"), "b")
    raw = net.transport("evil:1")
    async with trio.open_nursery() as nursery:
        await nursery.start(net.run)
        await nursery.start(a.run)
        # an envelope of this protocol holding a Hello with no fields
        packet = b.sealer.seal(bytes([0x93, PROTOCOL_MAJOR, PROTOCOL_MINOR, 0x91, 0x92, 0x01,
                                      0x90]))
        good = b.sealer.seal(encode(Hello(1, b.node_id, "b", "b:1")))
        flipped = bytearray(good)
        flipped[-1] ^= 1
        for data in (packet, good, good, bytes(flipped), b"garbage", b""):
            await raw.send_datagram("a:1", data)
        await trio.sleep(1)
        drops = a.counters.drops
        assert drops["invalid-field"] == 1
        assert drops["unexpected-message"] == 1  # a Hello is for streams, not datagrams
        assert drops["replay"] == 1
        assert drops["bad-seal"] == 1
        assert drops["malformed"] == 2
        assert a.fellows() == []  # nothing sealed by b carried membership news
        nursery.cancel_scope.cancel()


async def test_a_different_protocol_major_gets_a_refusal(autojump_clock) -> None:
    import msgpack

    net = MemoryNetwork(seed=5)
    a = make_agent(net.transport("a:1"), "a")
    b = make_agent(net.transport("b:1"), "b")
    async with trio.open_nursery() as nursery:
        await nursery.start(net.run)
        await nursery.start(a.run)
        await nursery.start(b.run)
        future = msgpack.packb([9, 0, [[1, [1, b.node_id, "b", "b:1"]]]], use_bin_type=True)
        await b.transport.send_datagram("a:1", b.sealer.seal(future))
        await trio.sleep(1)
        assert a.counters.drops["version"] == 1
        assert b.counters.datagrams_in >= 1  # the refusal came back, readable
        nursery.cancel_scope.cancel()


async def test_two_real_agents_on_loopback_and_an_outsider() -> None:
    config = local()
    async with open_udp_tcp_transport("127.0.0.1:0", config.transport) as ta, \
            open_udp_tcp_transport("127.0.0.1:0", config.transport) as tb, \
            open_udp_tcp_transport("127.0.0.1:0", config.transport) as tx:
        a = make_agent(ta, "a")
        b = make_agent(tb, "b", seeds=[ta.local_addr])
        x = make_agent(tx, "x", OTHER_SECRET, seeds=[ta.local_addr, tb.local_addr])
        async with trio.open_nursery() as nursery:
            for agent in (a, b, x):
                await nursery.start(agent.run)
            with trio.fail_after(20):
                while not (a.fellows() and b.fellows()
                           and a.counters.drops["stream-unknown-key"]):
                    await trio.sleep(0.05)
            reply = await b.call(ta.local_addr, Hello(3, b.node_id, "b", tb.local_addr))
            assert isinstance(reply, HelloAck) and reply.node_id == a.node_id
            with pytest.raises(Exception):
                await x.call(ta.local_addr, Hello(1, x.node_id, "x", tx.local_addr))
            assert not x.fellows()
            assert {f.name for f in a.fellows()} == {"b"}
            nursery.cancel_scope.cancel()


async def test_stream_call_to_a_vanished_fellow_is_a_transport_error(autojump_clock) -> None:
    net = MemoryNetwork(seed=6)
    a = make_agent(net.transport("a:1"), "a")
    async with trio.open_nursery() as nursery:
        await nursery.start(net.run)
        await nursery.start(a.run)
        with pytest.raises(TransportError):
            await a.call("nobody:1", Hello(1, a.node_id, "a", "a:1"))
        nursery.cancel_scope.cancel()
