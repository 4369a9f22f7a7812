"""A leave is a leave: a fellow that says goodbye is recorded ``left`` by every fellow,
never ``dead``, even on a lossy network. The membership machine by hand, then agents in
virtual time."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import trio

from p2pswarm.agent import Agent
from p2pswarm.agent.world import AgentWorld
from p2pswarm.config import GossipConfig
from p2pswarm.effects import DEAD, Event
from p2pswarm.membership import Membership
from p2pswarm.sim.virtual import Fellow, VirtualSwarm, cpu_card, wait_until
from p2pswarm.transport.memory import Bernoulli, LinkModel, UniformDelay
from p2pswarm.wire import gossip as g
from tests.swarm_start import formed
from tests.test_membership import kinds, make, sends

# --- the machine ---------------------------------------------------------------------------


def fellows(n: int) -> list[Membership]:
    """``n`` machines that know each other alive (as after anti-entropy)."""
    nodes = [make(i) for i in range(n)]
    for node in nodes:
        node.join((), 0.0)
    for node in nodes:
        node.merge_records([o.self_record() for o in nodes if o is not node], 0.0)
    return nodes


def deliver(nodes: list[Membership], sender: Membership, effects: list, now: float,
            to: set[str] | None = None) -> list:
    """Hand ``sender``'s datagrams to their addressees (only those in ``to``, if given);
    what they send back."""
    by_addr = {n.local.addr: n for n in nodes}
    replies = []
    for send in sends(effects):
        if send.addr in by_addr and (to is None or send.addr in to):
            replies += by_addr[send.addr].handle_datagram(list(send.messages),
                                                          sender.local.addr, now)
    return replies


def test_the_goodbye_rides_with_a_ping_and_the_acks_say_who_holds_it() -> None:
    nodes = fellows(4)
    leaver, others = nodes[1], [nodes[0], nodes[2], nodes[3]]
    effects = leaver.leave(1.0)
    assert "left" in kinds(effects) and not leaver.leave_spread
    out = sends(effects)
    assert sorted(s.addr for s in out) == sorted(o.local.addr for o in others)
    for s in out:
        left, ping = s.messages
        # signed by the leaver: where admission is on, nobody else can make it left
        assert (left.node, left.incarnation) == (leaver.node_id, leaver.incarnation)
        assert left.signature is not None
        assert isinstance(ping, g.Ping) and ping.source == leaver.node_id

    # two of the three hear it; their acks come back
    heard = {nodes[0].local.addr, nodes[2].local.addr}
    acks = deliver(nodes, leaver, effects, 1.01, to=heard)
    assert nodes[0].member(leaver.node_id).state == "left"
    assert nodes[3].member(leaver.node_id).state == "alive"
    for reply in sends(acks):
        assert reply.addr == leaver.local.addr
        leaver.handle_datagram(list(reply.messages), "x:1", 1.02)
    assert leaver.leave_acknowledgements() == (2, 3) and not leaver.leave_spread

    # only the one still silent is asked again, after a probe timeout
    retry_at = 1.0 + GossipConfig().probe_timeout_s
    assert leaver.next_deadline() is not None and leaver.next_deadline() <= retry_at
    again = [s for s in sends(leaver.tick(retry_at)) if any(
        isinstance(m, g.Ping) for m in s.messages)]
    assert [s.addr for s in again] == [nodes[3].local.addr]
    for reply in sends(deliver(nodes, leaver, again, retry_at + 0.01)):
        leaver.handle_datagram(list(reply.messages), "x:1", retry_at + 0.02)
    assert leaver.leave_acknowledgements() == (3, 3) and leaver.leave_spread
    assert {o.member(leaver.node_id).state for o in others} == {"left"}


def test_the_asking_stops_at_the_leave_timeout() -> None:
    nodes = fellows(3)
    leaver = nodes[0]
    leaver.leave(0.0)
    config = GossipConfig()
    asked_at = []
    now = 0.0
    while now < 10.0:
        deadline = leaver.next_deadline()
        if deadline is None or deadline > 10.0:
            break
        now = max(now, deadline)
        if any(isinstance(m, g.Ping) for s in sends(leaver.tick(now)) for m in s.messages):
            asked_at.append(now)
    assert asked_at and max(asked_at) < config.leave_timeout_s
    assert len(asked_at) == pytest.approx(config.leave_timeout_s / config.probe_timeout_s - 1,
                                          abs=1)
    assert not leaver.leave_spread and leaver.leave_acknowledgements() == (0, 2)


def test_enough_acks_and_a_full_gossip_count_is_spread_in_a_larger_swarm() -> None:
    nodes = fellows(8)
    leaver = nodes[7]
    effects = leaver.leave(0.0)
    first_three = {n.local.addr for n in nodes[:3]}
    for reply in sends(deliver(nodes, leaver, effects, 0.01, to=first_three)):
        leaver.handle_datagram(list(reply.messages), "x:1", 0.02)
    assert leaver.leave_acknowledgements() == (3, 7)
    assert not leaver.leave_spread  # gossip has not sent it its count yet
    now = 0.0
    while not leaver.leave_spread and now < GossipConfig().leave_timeout_s:
        now += GossipConfig().gossip_interval_s
        leaver.tick(now)
    assert leaver.leave_spread and now < GossipConfig().leave_timeout_s


def test_a_leaver_publishes_no_metadata_and_refutes_nothing() -> None:
    nodes = fellows(3)
    leaver = nodes[0]
    leaver.leave(0.0)
    incarnation, version = leaver.incarnation, leaver.meta_version
    assert leaver.set_metadata(b"cards moved", 0.1) == []
    leaver.handle(g.Suspect(leaver.node_id, incarnation, nodes[1].node_id), "x:1", 0.2)
    assert (leaver.incarnation, leaver.meta_version) == (incarnation, version)
    gossip = [m for s in sends(leaver.tick(0.3)) for m in s.messages]
    assert (leaver.node_id, incarnation) in [(m.node, m.incarnation) for m in gossip
                                             if isinstance(m, g.Left)]
    assert not [m for m in gossip if isinstance(m, g.Alive) and m.node == leaver.node_id]


def test_fellows_leaving_together_acknowledge_each_others_goodbye() -> None:
    nodes = fellows(3)
    a, b, stays = nodes
    a_says, b_says = a.leave(0.0), b.leave(0.0)
    # a leaver answers the goodbye ping of another leaver, and nothing else
    deliver(nodes, a, a_says, 0.01, to={b.local.addr})
    assert b.member(a.node_id).state == "left"
    back = [s for s in sends(deliver(nodes, b, b_says, 0.01, to={a.local.addr}))]
    assert back and all(s.addr == b.local.addr for s in back)
    for reply in back:
        b.handle_datagram(list(reply.messages), a.local.addr, 0.02)
    assert b.leave_acknowledgements() == (1, 2)
    assert not a.handle(g.Ping(7, a.node_id, stays.node_id), stays.local.addr, 0.03)


def test_a_goodbye_heard_late_turns_dead_into_left() -> None:
    nodes = fellows(3)
    leaver, late = nodes[0], nodes[1]
    late.handle(g.Dead(leaver.node_id, leaver.incarnation, nodes[2].node_id), "x:1", 0.5)
    assert late.member(leaver.node_id).state == "dead"
    assert "left" in kinds(late.handle(g.Left(leaver.node_id, leaver.incarnation), "x:1", 1.0))
    assert late.member(leaver.node_id).state == "left"


# --- agents in virtual time ----------------------------------------------------------------


async def formed_noting_deaths(nursery: trio.Nursery, n: int, seed: int
                              ) -> tuple[VirtualSwarm, set[tuple[str, bytes]]]:
    """A swarm whose fellows report every death they record: (who, whom); run in
    ``nursery`` and formed."""
    deaths: set[tuple[str, bytes]] = set()

    def agent(fellow: Fellow, world: AgentWorld) -> Agent:
        def note(event: Event) -> None:
            if event.kind == DEAD:
                deaths.add((fellow.name, event.node_id))
        return Agent(dataclasses.replace(world, on_event=note))

    swarm = VirtualSwarm(n, seed=seed, agent_factory=agent)
    await formed(nursery, swarm, timeout_s=30)
    return swarm, deaths


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_leaves_are_left_at_every_fellow_with_20_percent_loss(
        autojump_clock: trio.testing.MockClock, seed: int) -> None:
    async with trio.open_nursery() as nursery:
        swarm, deaths = await formed_noting_deaths(nursery, 6, seed)
        swarm.net.set_default(LinkModel(delay=UniformDelay(0.002, 0.010), loss=Bernoulli(0.2)))
        leavers = [5, 4, 3]
        for i in leavers:
            began = trio.current_time()
            outcome = await swarm.leave(i)
            took_s = trio.current_time() - began
            assert outcome["spread"] and outcome["fellows"] == 5 - leavers.index(i)
            assert took_s < swarm.config.gossip.leave_timeout_s
            await wait_until(lambda: swarm.states_seen_by_all(i) == {"left"}, timeout_s=10)
        await trio.sleep(30)  # long past any suspicion a missed goodbye would raise
        gone = {swarm.fellows[i].identity.node_id for i in leavers}
        assert {(who, whom) for who, whom in deaths if whom in gone} == set()
        for i in leavers:
            assert swarm.states_seen_by_all(i) <= {"left", "unknown"}
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_a_card_change_while_leaving_does_not_bring_the_leaver_back(
        autojump_clock: trio.testing.MockClock, seed: int) -> None:
    async with trio.open_nursery() as nursery:
        swarm, deaths = await formed_noting_deaths(nursery, 4, seed)
        leaver = swarm.fellows[3]
        leaver.cards.cards = (cpu_card(16.0, free_gb=10.0),)  # memory moved: news to publish
        await trio.sleep(swarm.config.inventory.refresh_interval_s * 0.7)
        await swarm.leave(3)
        await trio.sleep(30)
        assert swarm.states_seen_by_all(3) <= {"left", "unknown"}
        assert not [d for d in deaths if d[1] == leaver.identity.node_id]
        nursery.cancel_scope.cancel()


async def test_fellows_leaving_at_once_do_not_wait_out_the_bound(
        autojump_clock: trio.testing.MockClock) -> None:
    async with trio.open_nursery() as nursery:
        swarm, deaths = await formed_noting_deaths(nursery, 4, seed=5)
        outcomes: dict[int, tuple[dict[str, Any], float]] = {}

        async def leave(i: int) -> None:
            began = trio.current_time()
            outcomes[i] = (await swarm.leave(i), trio.current_time() - began)

        async with trio.open_nursery() as leaving:  # as a whole swarm shut down at once
            for i in (1, 2, 3):
                leaving.start_soon(leave, i)
        for outcome, took_s in outcomes.values():
            assert outcome == {"acknowledged": 3, "fellows": 3, "spread": True}
            assert took_s < swarm.config.gossip.leave_timeout_s / 2
        assert all(swarm.states_seen_by_all(i) == {"left"} for i in (1, 2, 3))
        assert deaths == set()
        nursery.cancel_scope.cancel()
