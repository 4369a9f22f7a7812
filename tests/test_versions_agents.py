"""Versions between agents: an unknown kind answered without closing the stream, a
fellow two protocols away refused with its one line on both sides and kept out of the
view, each fellow's protocol in ``status`` (MemoryNetwork, virtual time)."""

from __future__ import annotations

import logging
import random
from dataclasses import replace

import msgpack
import pytest
import trio

from p2pswarm import wire
from p2pswarm.agent import Agent
from p2pswarm.agent.world import AgentWorld
from p2pswarm.config import local
from p2pswarm.errors import LocalProtocolError, TransportError
from p2pswarm.security import Identity, Keyring, SwarmSecret
from p2pswarm.transport.base import Stream
from p2pswarm.transport.memory import MemoryNetwork
from p2pswarm.transport.secure import secure_accept
from p2pswarm.wire.base import Hello, HelloAck, Refusal, Unsupported
from p2pswarm.wire.gossip import Ping, SyncRecords
from p2pswarm.wire.versions import CAPABILITIES, PROTOCOL, UNSUPPORTED_REPLY, refusal_line

SECRET = SwarmSecret(bytes(range(32)))


def make_agent(net: MemoryNetwork, name: str, seeds: tuple[str, ...] = ()) -> Agent:
    return Agent(AgentWorld(name=name, transport=net.transport(f"{name}:1"),
                            keyring=Keyring([SECRET]), identity=Identity.generate(),
                            config=local(), epoch=1, rng=random.Random(1), seeds=seeds))


async def test_an_unknown_kind_gets_unsupported_and_the_stream_goes_on(autojump_clock) -> None:
    net = MemoryNetwork(seed=5)
    a, b = make_agent(net, "a"), make_agent(net, "b")
    async with trio.open_nursery() as nursery:
        await nursery.start(net.run)
        for agent in (a, b):
            await nursery.start(agent.run)
        async with await b.open_secure("a:1") as stream:
            # a kind from a later release (tag 9999), as protocol 3 would send it
            await stream.send_frame(msgpack.packb([2, PROTOCOL + 1, [[9999, ["x"]]]]))
            (reply,) = wire.decode(await stream.receive_frame())
            assert reply == Unsupported(9999, "unknown kind")
            # the same stream takes the next request
            hello = Hello(3, b.node_id, "b", "b:1")
            assert await b.request(stream, hello) == HelloAck(3, a.node_id, "a", "a:1")
        assert a.counters.drops["frame-unknown-tag"] == 1
        nursery.cancel_scope.cancel()


async def test_a_fellow_two_protocols_away_is_refused_and_never_seen(
        autojump_clock, caplog: pytest.LogCaptureFixture) -> None:
    net = MemoryNetwork(seed=6)
    a, b = make_agent(net, "a"), make_agent(net, "b")
    caplog.set_level(logging.WARNING, logger="p2pswarm.agent")
    async with trio.open_nursery() as nursery:
        await nursery.start(net.run)
        for agent in (a, b):
            await nursery.start(agent.run)
        assert b.membership is not None
        join = SyncRecords(b.node_id, (b.membership.self_record(),), (), True)
        line = refusal_line(PROTOCOL, PROTOCOL - 2)
        async with await b.open_secure("a:1") as stream:
            # b's own join, as a release of protocol 0 would send it
            await stream.send_frame(wire.encode(join, protocol=PROTOCOL - 2))
            (reply,) = wire.decode(await stream.receive_frame())
            assert reply == Refusal(wire.PROTOCOL_MAJOR, PROTOCOL, line)
            with pytest.raises(TransportError):  # and the stream is closed
                await stream.receive_frame()
        assert a.counters.drops["frame-version"] == 1
        # its datagrams too: dropped and counted (and answered with a Refusal)
        ping = Ping(1, a.node_id, b.node_id)
        await b.transport.send_datagram("a:1", b.sealer.seal(
            wire.encode(ping, protocol=PROTOCOL - 2)))
        await trio.sleep(1)
        assert a.counters.drops["version"] == 1
        assert b.counters.drops["refused-by-peer"] == 1
        assert not a.fellows()  # b never entered a's view
        said = sorted(r.getMessage() for r in caplog.records if line in r.getMessage())
        # the stream's and the datagram's refusals at a, and b told by the datagram's
        assert said == [f"a: refusing b:1: {line}", f"a:1 refused us: {line}",
                        f"refusing b:1: {line}"]
        nursery.cancel_scope.cancel()


async def test_the_joiner_gets_the_line_from_a_seed_two_protocols_ahead(
        autojump_clock, caplog: pytest.LogCaptureFixture) -> None:
    """A seed of protocol 4 refuses this release (2): the joiner logs the one line it
    sent, once, and stays out."""
    net = MemoryNetwork(seed=7)
    seed_transport = net.transport("s:1")
    seed_identity = Identity.generate()
    later = PROTOCOL + 2
    line = refusal_line(later, PROTOCOL)

    async def refuse(raw: Stream) -> None:
        stream = await secure_accept(raw, Keyring([SECRET]), seed_identity, 5.0)
        await stream.receive_frame()
        await stream.send_frame(wire.encode(Refusal(wire.PROTOCOL_MAJOR, later, line),
                                            protocol=later))
        await stream.aclose()

    joiner = make_agent(net, "j", seeds=("s:1",))
    caplog.set_level(logging.WARNING, logger="p2pswarm.agent")
    async with trio.open_nursery() as nursery:
        await nursery.start(net.run)
        await nursery.start(seed_transport.serve_streams, refuse)
        await nursery.start(joiner.run)
        await trio.sleep(30)
        assert not joiner.fellows()
        said = [r.getMessage() for r in caplog.records if line in r.getMessage()]
        assert said == [f"j: s:1 refused this fellow: {line}"]
        nursery.cancel_scope.cancel()


async def test_status_shows_each_fellows_protocol(autojump_clock) -> None:
    net = MemoryNetwork(seed=8)
    a, b = make_agent(net, "a"), make_agent(net, "b", seeds=("a:1",))
    async with trio.open_nursery() as nursery:
        await nursery.start(net.run)
        for agent in (a, b):
            await nursery.start(agent.run)
        await trio.sleep(5)
        rows = a.status()["members"]
        assert [(r["name"], r["protocol"]) for r in rows] == [("a", PROTOCOL), ("b", PROTOCOL)]
        assert all(r["speaks"] == sorted(CAPABILITIES) for r in rows)
        (fellow,) = a.fellows()
        assert a.fellow_says(fellow).release.protocol == PROTOCOL
        nursery.cancel_scope.cancel()


async def test_a_kind_a_fellow_did_not_announce_is_never_sent_it(autojump_clock) -> None:
    """``Unsupported`` stands for any kind added after protocol 1 (it needs the
    ``unsupported-reply`` capability): a fellow that plays protocol 1 (its metadata says
    so, as 675ee12's says nothing) is never sent one; a fellow of this release is."""
    net = MemoryNetwork(seed=9)
    a = make_agent(net, "a")
    b = make_agent(net, "b", seeds=("a:1",))
    old = Agent(replace(b.world, name="old", transport=net.transport("old:1"),
                        identity=Identity.generate(),
                        metadata={"protocol": 1, "speaks": []}))
    kind = Unsupported(9999)
    assert wire.needs(Unsupported) == UNSUPPORTED_REPLY
    async with trio.open_nursery() as nursery:
        await nursery.start(net.run)
        for agent in (a, b, old):
            await nursery.start(agent.run)
        await trio.sleep(5)
        assert {m.name: a.release_of(m.node_id).protocol for m in a.fellows()} \
            == {"b": PROTOCOL, "old": 1}
        assert not wire.sendable(a.release_of(old.node_id), kind)
        frames_in = old.counters.frames_in
        with pytest.raises(LocalProtocolError, match="unspoken: old:1 has not announced"):
            await a.call("old:1", kind)
        assert old.counters.frames_in == frames_in  # nothing reached it
        # a fellow of this release is sent it (and, serving no such request, closes)
        assert wire.sendable(a.release_of(b.node_id), kind)
        frames_in = b.counters.frames_in
        with pytest.raises(TransportError):
            await a.call("b:1", kind)
        assert b.counters.frames_in == frames_in + 1
        nursery.cancel_scope.cancel()


def test_the_status_table_shows_protocols() -> None:
    from rich.console import Console

    from p2pswarm.cli.swarm import members_table

    def row(name: str, protocol: int | None, me: bool = False) -> dict:
        r = dict(id="ab" * 8, name=name, addr="127.0.0.1:7782", state="alive",
                 incarnation=1, cards=[], last_heard_s=0.1, self=me)
        return r if protocol is None else {**r, "protocol": protocol}

    rows = [row("new", PROTOCOL, True), row("older", 1), row("unsaid", None)]
    for width in (80, 140):
        console = Console(width=width, record=True)
        console.print(members_table(rows, width))
        text = console.export_text()
        if width < 110:  # narrow: the protocol by the name, where it differs
            assert "older (protocol 1)" in text and "new (this one) (" not in text
            assert "unsaid (" not in text
        else:
            assert "proto" in text
