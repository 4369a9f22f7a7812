"""Real agents in virtual time: a swarm of ``Agent``s on one ``MemoryNetwork``.

Every fellow runs the same agent code as ``p2pswarm join``, on an in-memory transport;
run it under ``trio.testing.MockClock(autojump_threshold=0)`` and an hour of gossip takes
seconds. Fellows can be crashed (their agent task is cancelled and their address goes
down), restarted (a new agent at the same address with the same identity), and made to
leave gracefully. Identities and randomness are derived from the seed, so a run replays.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import trio
import trio.abc

from p2pswarm.agent import Agent
from p2pswarm.agent.admission import AdmissionSetup
from p2pswarm.agent.compute import Compute
from p2pswarm.agent.votes import VoteRecord
from p2pswarm.agent.world import AgentWorld, Services
from p2pswarm.cards import Card
from p2pswarm.config import SwarmConfig, local
from p2pswarm.inventory import FakeCardSource
from p2pswarm.security import Identity, Keyring, SwarmSecret
from p2pswarm.security.admission import AdminKey, Certificate
from p2pswarm.transport.memory import MemoryNetwork, MemoryTransport

CERTIFIED_UNTIL_S = 2**40  # certificates in a virtual swarm hold for its whole life


def _seeded_bytes(seed: int, *names: object) -> bytes:
    return hashlib.blake2b(repr((seed, *names)).encode(), digest_size=32).digest()


def cpu_card(total_gb: float, free_gb: float | None = None, name: str = "CPU") -> Card:
    total = int(total_gb * 1e9)
    return Card(index=0, kind="cpu", name=name, uuid="", total_bytes=total,
                free_bytes=int((free_gb if free_gb is not None else total_gb) * 1e9))


@dataclass
class Fellow:
    index: int
    name: str
    addr: str
    identity: Identity
    cards: FakeCardSource
    leader_priority: int = 0
    agent: Agent | None = None
    scope: trio.CancelScope | None = None
    boots: int = 0
    votes: VoteRecord = field(default_factory=VoteRecord)  # kept across restarts


def plain_agent(fellow: Fellow, world: AgentWorld) -> Agent:
    return Agent(world)


AgentFactory = Callable[[Fellow, AgentWorld], Agent]  # (fellow, its world) -> its agent


@dataclass
class VirtualSwarm:
    """``n`` fellows; fellow 0 is the seed the others join through.

    ``agent_factory(fellow, world)`` builds each agent from the world this swarm made for
    it (default: a plain ``Agent(world)``); the simulation harness passes one that adds
    its event sink or a variant's machines to that world. ``inline_compute`` runs every
    fellow's torch work inline (it then takes no virtual time); ``services`` is what
    every fellow's serving and training are given (``Services``).
    """

    n: int
    seed: int = 1
    config: SwarmConfig = field(default_factory=local)
    agent_factory: AgentFactory = plain_agent
    inline_compute: bool = False
    services: Services = field(default_factory=Services)
    admission: bool = False  # an admin key certifies every fellow (fellow 0 holds it)
    net: MemoryNetwork = field(init=False)
    fellows: list[Fellow] = field(init=False)
    secret: SwarmSecret = field(init=False)

    def __post_init__(self) -> None:
        self.net = MemoryNetwork(seed=self.seed)
        self.secret = SwarmSecret(_seeded_bytes(self.seed, "secret"))
        self.fellows = [
            Fellow(i, f"f{i:03d}", f"10.0.{i // 250}.{i % 250 + 1}:7946",
                   Identity.from_private_bytes(_seeded_bytes(self.seed, "identity", i)),
                   FakeCardSource((cpu_card(16.0),)))
            for i in range(self.n)
        ]
        self._nursery: trio.Nursery | None = None
        self.admin: AdminKey | None = None
        self.certificates: dict[int, bytes] = {}
        if self.admission:
            self.admin = AdminKey.from_private_bytes(_seeded_bytes(self.seed, "admin"))
            invitation = self.admin.invite(_seeded_bytes(self.seed, "invitation")[:16],
                                           self.n, CERTIFIED_UNTIL_S, max_priority=255)
            for f in self.fellows:
                self.certificates[f.index] = Certificate.issue(
                    self.admin.identity, invitation, f.identity.public_key, f.name, f.index,
                    0, CERTIFIED_UNTIL_S).encode()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the network scheduler; start fellows with ``start``. Cancel to end."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            await nursery.start(self.net.run)
            task_status.started()
            await trio.sleep_forever()

    async def start(self, i: int, seeds: tuple[str, ...] | None = None) -> Agent:
        """Boot fellow ``i`` (again, after a crash: same identity, a later epoch)."""
        assert self._nursery is not None, "run the swarm first"
        fellow = self.fellows[i]
        if seeds is None:
            seeds = () if i == 0 else (self.fellows[0].addr,)
        self.net.up(fellow.addr)
        fellow.boots += 1
        agent = self.agent_factory(fellow, AgentWorld(
            name=fellow.name, transport=self.net.transport(fellow.addr),
            keyring=Keyring([self.secret]), identity=fellow.identity, config=self.config,
            epoch=fellow.boots, rng=random.Random(int.from_bytes(
                _seeded_bytes(self.seed, "rng", i, fellow.boots)[:8], "big")),
            seeds=seeds, leader_priority=fellow.leader_priority, card_source=fellow.cards,
            votes=fellow.votes, compute=Compute(inline=self.inline_compute),
            services=self.services, admission=self._admission(i)))
        fellow.agent = agent
        fellow.scope = await self._nursery.start(self._run_agent, agent)
        return agent

    def _admission(self, i: int) -> AdmissionSetup | None:
        if self.admin is None:
            return None
        return AdmissionSetup(self.admin.public_key, self.certificates[i],
                              issuer=self.admin if i == 0 else None)

    async def _run_agent(self, agent: Agent, *,
                         task_status: trio.TaskStatus[trio.CancelScope]) -> None:
        try:
            with trio.CancelScope() as scope:
                await agent.run(task_status=_Started(task_status, scope))
        finally:
            with trio.CancelScope(shield=True):
                await agent.transport.aclose()  # the address may be booted again

    async def start_all(self, stagger_s: float = 0.0) -> None:
        for i in range(self.n):
            await self.start(i)
            if stagger_s:
                await trio.sleep(stagger_s)

    def crash(self, i: int) -> None:
        """Kill fellow ``i`` without a goodbye: its agent stops, its address goes dark."""
        fellow = self.fellows[i]
        if fellow.scope is not None:
            fellow.scope.cancel()
        if fellow.agent is not None and isinstance(fellow.agent.transport, MemoryTransport):
            fellow.agent.transport.close_now()  # at once: not one more packet or alarm
        self.net.down(fellow.addr)
        fellow.agent = None

    def freeze(self, i: int) -> None:
        """Stop fellow ``i`` as SIGSTOP does: nothing it hears, rings or sends happens
        until ``thaw`` (``MemoryTransport.freeze``)."""
        agent = self.fellows[i].agent
        assert agent is not None and isinstance(agent.transport, MemoryTransport)
        agent.transport.freeze()

    def thaw(self, i: int) -> None:
        """Fellow ``i`` goes on: what it heard and its alarms, late, all at once."""
        agent = self.fellows[i].agent
        assert agent is not None and isinstance(agent.transport, MemoryTransport)
        agent.transport.thaw()

    async def leave(self, i: int) -> dict[str, Any]:
        """Fellow ``i`` leaves gracefully; what its agent's ``leave`` says."""
        agent = self.fellows[i].agent
        assert agent is not None
        outcome = await agent.leave()
        self.fellows[i].agent = None
        return outcome.to_dict()

    def live(self) -> list[Agent]:
        return [f.agent for f in self.fellows if f.agent is not None]

    def states_seen_by_all(self, i: int) -> set[str]:
        """The states the other live fellows hold for fellow ``i``."""
        target = self.fellows[i].identity.node_id
        states: set[str] = set()
        for agent in self.live():
            if agent.node_id == target or agent.membership is None:
                continue
            member = agent.membership.member(target)
            states.add(member.state if member is not None else "unknown")
        return states

    def leaders(self) -> set[tuple[bytes | None, int]]:
        """(leader id, term) as each live fellow sees it."""
        out = set()
        for agent in self.live():
            assert agent.election is not None
            status = agent.election.status()
            out.add((status.leader_id, status.term))
        return out

    def converged(self) -> bool:
        """Every live fellow sees every live fellow alive."""
        live_ids = {a.node_id for a in self.live()}
        for agent in self.live():
            assert agent.membership is not None
            alive = {m.node_id for m in agent.membership.members() if m.state == "alive"}
            if not live_ids <= alive:
                return False
        return True


class JumpClock(trio.abc.Clock):
    """Virtual time that jumps to the next deadline whenever no task can run.

    What ``trio.testing.MockClock(autojump_threshold=0)`` does, without its helper task
    and idle bookkeeping: about a quarter faster for a swarm of agents. Only for worlds
    with no real I/O (a MemoryNetwork); ``trio.testing.wait_all_tasks_blocked`` never
    fires under it.
    """

    def __init__(self, start_s: float = 0.0) -> None:
        self._now = start_s
        self._waiter: tuple[Callable[[], float], trio.lowlevel.Task] | None = None

    def start_clock(self) -> None:
        pass

    def current_time(self) -> float:
        return self._now

    def wake_when_due(self, next_s: Callable[[], float], task: trio.lowlevel.Task) -> None:
        """Reschedule ``task`` (parked in ``wait_task_rescheduled``) once no task can
        run and ``next_s()`` comes no later than every trio deadline, time jumped there.

        An event loop inside the run (MemoryNetwork's packets and alarms) waits so with
        no cancel scope and no Cancelled per event: half its cost. One wake per call.
        """
        self._waiter = (next_s, task)

    def forget_waiter(self) -> None:
        self._waiter = None

    def deadline_to_sleep_time(self, deadline: float) -> float:
        if self._waiter is not None:
            next_s, task = self._waiter
            at = next_s()
            if at <= deadline and at != math.inf:
                self._waiter = None
                self._now = max(self._now, at)
                trio.lowlevel.reschedule(task)
                return 0.0
        if deadline == math.inf:
            return 86400.0  # nothing scheduled: a deadlock, as under MockClock
        self._now = max(self._now, deadline)
        return 0.0


@contextmanager
def seeded_scheduler(seed: int) -> Iterator[None]:
    """Make trio's order of tasks woken at the same instant a function of ``seed``.

    trio runs each batch of ready tasks in an order drawn from its module generator,
    unseeded. As its hypothesis plugin does, this switches the scheduler to its
    deterministic mode (the batch is sorted by task creation order, then shuffled with
    that generator) and seeds the generator; both are restored on exit.
    """
    from trio._core import _run as run_module

    saved_flag = run_module._ALLOW_DETERMINISTIC_SCHEDULING
    saved_state = run_module._r.getstate()
    run_module._ALLOW_DETERMINISTIC_SCHEDULING = True  # type: ignore[misc]
    run_module._r.seed(seed)
    try:
        yield
    finally:
        run_module._ALLOW_DETERMINISTIC_SCHEDULING = saved_flag  # type: ignore[misc]
        run_module._r.setstate(saved_state)


class _Started:
    """Pass the cancel scope up when the agent reports it has started."""

    def __init__(self, task_status: trio.TaskStatus[trio.CancelScope],
                 scope: trio.CancelScope) -> None:
        self._task_status = task_status
        self._scope = scope

    def started(self, value: object = None) -> None:
        self._task_status.started(self._scope)


async def wait_until(predicate, *, timeout_s: float, step_s: float = 0.05) -> float:  # type: ignore[no-untyped-def]
    """Virtual seconds until ``predicate()`` holds; TooSlowError after ``timeout_s``."""
    start = trio.current_time()
    with trio.fail_after(timeout_s):
        while not predicate():
            await trio.sleep(step_s)
    return trio.current_time() - start
