"""The ``status`` answer, put together from the agent's parts: the fellows as membership
lists them, the leader and electorate as the election sees them, counters, the self watch,
admission and the stores' use on disk.

It lives apart from the agent so that ``agent.py`` keeps to running the machines; it reads
the agent through ``StatusSource`` (what it shows, read-only), never as ``Agent``. The
stores' use is measured by the control op, off the loop, and shown until the next one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import trio

from p2pswarm.agent.admission import Admission
from p2pswarm.agent.alarm import LoopLag
from p2pswarm.agent.compute import Compute
from p2pswarm.agent.counters import Counters
from p2pswarm.agent.fellow_meta import FellowSays
from p2pswarm.agent.links import Links
from p2pswarm.agent.serving import Serving
from p2pswarm.agent.status_doc import (
    ElectorateDoc,
    LeaderDoc,
    MemberRow,
    SelfDoc,
    StatusDoc,
    StoreUseDoc,
)
from p2pswarm.config import SwarmConfig
from p2pswarm.disk_budget import store_uses
from p2pswarm.election import Election
from p2pswarm.membership.machine import Membership
from p2pswarm.membership.member import Member
from p2pswarm.transport.base import Transport
from p2pswarm.wire.control import StatusRequest


class StatusSource(Protocol):
    """What ``status`` reads of the agent."""

    @property
    def name(self) -> str: ...

    @property
    def node_id(self) -> bytes: ...

    @property
    def addr(self) -> str: ...

    @property
    def transport(self) -> Transport: ...

    @property
    def config(self) -> SwarmConfig: ...

    @property
    def home(self) -> Path | None: ...

    @property
    def compute(self) -> Compute: ...

    @property
    def loop_lag(self) -> LoopLag: ...

    @property
    def membership(self) -> Membership | None: ...

    @property
    def election(self) -> Election | None: ...

    @property
    def counters(self) -> Counters: ...

    @property
    def links(self) -> Links: ...

    @property
    def admission(self) -> Admission | None: ...

    @property
    def serving(self) -> Serving: ...

    @property
    def started_s(self) -> float: ...

    def fellow_says(self, member: Member) -> FellowSays: ...


class StatusReport:
    """The ``status`` document of one agent, and the control op that answers with it."""

    def __init__(self, agent: StatusSource) -> None:
        self.agent = agent
        self._disks: list[StoreUseDoc] = []  # the stores' use, as status last measured it

    async def op_status(self, request: StatusRequest) -> StatusDoc:
        agent = self.agent
        home = agent.home
        if home is not None:  # walking the stores reads the disk: off the loop
            uses = await agent.compute.run(lambda: store_uses(home, agent.config.storage))
            self._disks = [StoreUseDoc(store=u.store, used_bytes=u.used_bytes,
                                       cap_bytes=u.cap_bytes) for u in uses]
        return self.status()

    def leader(self) -> LeaderDoc | None:
        """The leader this fellow follows, as ``status`` shows it; None: none."""
        if self.agent.election is None:
            return None
        s = self.agent.election.status()
        if s.leader_id is None:
            return None
        return LeaderDoc(id=s.leader_id.hex(), name=s.leader_name, term=s.term)

    def _electorate_doc(self, now: float) -> ElectorateDoc | None:
        """What a leader needs and this side has: votes of a majority of the electorate,
        and when the electorate next shrinks (the dead leave it after
        ``electorate_dead_after_s`` unseen). ``status`` explains a leaderless side by it."""
        election = self.agent.election
        if election is None:
            return None
        voters, shrinks_at = election.electorate(), election.shrinks_at()
        return ElectorateDoc(voters=voters, needs=voters // 2 + 1, sees=election.present(),
                             dead_leave_after_s=self.agent.config.election
                             .electorate_dead_after_s,
                             shrinks_in_s=None if shrinks_at is None
                             else round(max(0.0, shrinks_at - now), 3))

    def status(self) -> StatusDoc:
        agent = self.agent
        now = trio.current_time()

        def row(m: Member) -> MemberRow:
            heard = None if m.last_heard_s is None else round(now - m.last_heard_s, 3)
            says = agent.fellow_says(m)
            release = says.release
            return MemberRow(id=m.node_id.hex(), name=m.name, addr=m.addr, state=m.state,
                             incarnation=m.incarnation,
                             cards=[c.to_dict() for c in says.inventory.cards],
                             last_heard_s=heard, in_state_s=round(now - m.state_since_s, 3),
                             self=m.is_self, protocol=release.protocol,
                             speaks=sorted(release.speaks))

        membership, admission = agent.membership, agent.admission
        members = sorted(membership.members(), key=lambda m: (m.name, m.node_id)) \
            if membership is not None else []
        election = agent.election.status() if agent.election is not None else None
        return {
            "self": SelfDoc(id=agent.node_id.hex(), name=agent.name, addr=agent.addr,
                            listen=agent.transport.local_addr),
            "preset": agent.config.preset,
            "uptime_s": round(now - agent.started_s, 3),
            "health": membership.health_score if membership else 0,
            "members": [row(m) for m in members],
            "leader": self.leader(),
            "leader_note": election.sentence if election is not None else "starting",
            "electorate": self._electorate_doc(now),
            "stages_held": agent.serving.held_stages(),
            "role": election.role if election is not None else "follower",
            # what the election refused too (forged or unsigned votes, leaders without
            # a proof, terms too far ahead)
            "counters": agent.counters.to_dict(
                agent.election.refused if agent.election is not None else None),
            "transport": dict(getattr(agent.transport, "counters", {})),
            "membership": membership.counters() if membership else {},
            "loop_lag": {**agent.loop_lag.to_dict(), "stretch_s": round(
                agent.election.stretch(), 3) if agent.election is not None else 0.0},
            "self_watch": agent.links.watch.to_doc(),
            "admission": None if admission is None else {
                **admission.status(),
                "refused": {k: v for k, v in admission.gate.stats.items()
                            if "refused" in k or "certific" in k}},
            "disks": list(self._disks),
        }


__all__ = ["StatusReport", "StatusSource"]
