"""A hosted stage's place in its job's all-reduce ring: no hub for the deltas.

Theory of operation. In a job that syncs by the all-reduce (``ring_rounds``), the driver
sends each stage, at the end of each of its replica's rounds, a ``RingRound``: the fellow
of this stage in every replica (its address and id, "" for a replica out of the rounds)
and which replica keeps each part. The stage's ``StageRing`` (made at the first one, and
again after the stage took a new state: a reset, a checkpoint loaded) is an
``allreduce.AllReduceFellow`` whose names are the replicas' indices, over
``StreamPartNet``: each part message goes on a sealed stream of its own to the fellow
that hosts the receiving replica's stage, behind a ``PartOpen`` that names the job, the
stage and both replicas.

A round (``StageRing.round``) first applies the previous round's update, waiting for it
at most ``wait_s`` (a keeper closes its part at its deadline whatever arrives, so a slow
or vanished fellow costs a round's deadline, never a stall), then sends this round's
delta and answers at once: the update travels while the replica computes its next round
(one round in flight, as in Streaming DiLoCo). A ``last`` round waits for its own
update, at most ``wait_s`` too: past that it answers with the version it stands at, so a
job always ends from what its ring closed.
The driver's word on the ring (``regroup``) moves a vanished replica's parts to the next
live one and lets a replica placed again back in; a fellow that missed an update while
it was out gets it from the part's keeper when its first delta arrives late.

What arrives is checked: a ``PartOpen`` for a stage this fellow does not host in a ring,
from a peer that is not the fellow the ring names for its sender, or a part message that
is not one, is dropped and counted.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import trio

from p2pswarm.agent.streams import receive_message, send_message
from p2pswarm.agent.training.allreduce import AllReduceFellow, PartMessage, Runner
from p2pswarm.errors import RemoteProtocolError
from p2pswarm.wire.training import (
    MAX_RING,
    PartDelta,
    PartOpen,
    PartState,
    PartUpdate,
    RingRound,
)

if TYPE_CHECKING:
    from p2pswarm.agent.training.allreduce import PartSync
    from p2pswarm.agent.training.ports import SwarmNode
    from p2pswarm.transport.secure import SecureStream

log = logging.getLogger("p2pswarm.training")

PART_SEND_TIMEOUT_S = 60.0  # the most one part message may take to reach its fellow
MAX_QUEUED = 1024  # part messages a ring holds before it drops


@dataclass
class RingTraffic:
    """Bytes of part messages one ring sent and received (blobs and envelopes)."""

    sent_bytes: int = 0
    received_bytes: int = 0
    rounds: int = 0


class StreamPartNet:
    """``allreduce.PartNet`` over the agent's sealed streams, one stream a message."""

    def __init__(self, agent: SwarmNode, job_id: str, stage: int,
                 traffic: RingTraffic) -> None:
        self.agent = agent
        self.job_id = job_id
        self.stage = stage
        self.traffic = traffic
        self.addrs: tuple[str, ...] = ()

    async def send(self, sender: str, to: str, message: PartMessage) -> None:
        index = int(to)
        addr = self.addrs[index] if index < len(self.addrs) else ""
        if not addr:
            return
        with trio.move_on_after(PART_SEND_TIMEOUT_S):
            stream = await self.agent.open_secure(addr)
            async with stream:
                await send_message(stream, PartOpen(self.job_id, self.stage, index,
                                                    int(sender)))
                await send_message(stream, message)
            self.traffic.sent_bytes += _size(message)


def _size(message: PartMessage) -> int:
    return len(message.blob) + 32  # the blob and about its envelope's fields


@dataclass
class StageRing:
    """One hosted stage's ``AllReduceFellow``, its net and the round it has in flight."""

    fellow: AllReduceFellow
    net: StreamPartNet
    inbox: trio.MemorySendChannel[PartMessage]
    fellows: tuple[str, ...]  # each replica's fellow id (hex), "" when out
    in_flight: int | None = None  # the version this fellow's delta in flight is anchored on
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    failed: bool = False  # its fellow stopped on an error: the next round says so

    @staticmethod
    def check(msg: RingRound, replica: int) -> None:
        """A ``RingRound`` names each replica's fellow, and a keeper in the ring for each
        part, one of which is ``replica``: RemoteProtocolError when it does not."""
        n = len(msg.addrs)
        if not 1 <= n <= MAX_RING or len(msg.fellows) != n or len(msg.owners) != n:
            raise RemoteProtocolError("bad-ring", f"a ring of {n} addresses, "
                                      f"{len(msg.fellows)} fellows, {len(msg.owners)} parts")
        if replica >= n or not msg.addrs[replica]:
            raise RemoteProtocolError("bad-ring", f"replica {replica} is not in the ring")
        if any(o >= n or not msg.addrs[o] for o in msg.owners):
            raise RemoteProtocolError("bad-ring", "a part kept by a replica out of the ring")

    @classmethod
    def make(cls, agent: SwarmNode, job_id: str, replica: int, stage: int, sync: PartSync,
             msg: RingRound, round_deadline_s: float, seeds: dict[int, bytes]) -> StageRing:
        cls.check(msg, replica)
        roster = [str(i) for i in range(len(msg.addrs))]
        send, receive = trio.open_memory_channel[PartMessage](MAX_QUEUED)
        net = StreamPartNet(agent, job_id, stage, RingTraffic())
        net.addrs = msg.addrs
        fellow = AllReduceFellow(str(replica), roster, sync, net, receive, stage=stage,
                                 round_deadline_s=round_deadline_s,
                                 owners=[str(o) for o in msg.owners])
        fellow.seed(seeds)
        return cls(fellow, net, send, msg.fellows)

    @property
    def traffic(self) -> RingTraffic:
        return self.net.traffic

    async def run(self, done: trio.Event) -> None:
        """The fellow's keepers and inbox, until the stage is let go or the ring replaced."""
        with self.scope:
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self.fellow.run)
                    await done.wait()
                    nursery.cancel_scope.cancel()
            except Exception:  # a ring's failure is its stage's, never the agent's
                log.exception("the all-reduce ring of stage %d of %s stopped",
                              self.net.stage, self.net.job_id)
                self.failed = True

    def stop(self) -> None:
        self.scope.cancel()

    def regroup(self, msg: RingRound) -> None:
        """The driver's word on who is in the rounds and who keeps each part."""
        self.check(msg, int(self.fellow.name))
        if len(msg.addrs) != len(self.fellow.roster):
            raise RemoteProtocolError("bad-ring", f"a ring of {len(msg.addrs)} replicas "
                                      f"for one of {len(self.fellow.roster)}")
        self.net.addrs, self.fellows = msg.addrs, msg.fellows
        live = [str(i) for i, addr in enumerate(msg.addrs) if addr]
        self.fellow.regroup(live, [str(o) for o in msg.owners])

    async def round(self, msg: RingRound, run: Runner) -> int:
        """Apply the previous round's update, send this round's delta; the version this
        stage stands at (see the module doc)."""
        if self.failed:
            raise RemoteProtocolError("ring-failed", "this stage's ring stopped on an error")
        self.regroup(msg)
        if self.in_flight is not None:
            await self._finish(self.in_flight, msg.wait_s, run)
        self.in_flight = await self.fellow.start(msg.samples, run)
        self.traffic.rounds += 1
        if msg.last:
            # the job ends from what the ring closed: a last update that does not come
            # within the wait (its round waits for a fellow that will never send) is
            # given up, never a stall or an error that pauses a replica at the end
            anchored, self.in_flight = self.in_flight, None
            with trio.move_on_after(msg.wait_s) as waited:
                await self.fellow.finish(anchored, run)
            if waited.cancelled_caught:
                log.warning("stage %d of %s: no update past version %d within %.0f s; "
                            "its last round ends at version %d", self.net.stage,
                            self.net.job_id, anchored, msg.wait_s, self.fellow.sync.version)
        return self.fellow.sync.version

    async def _finish(self, version: int, wait_s: float, run: Runner) -> None:
        with trio.move_on_after(wait_s) as waited:
            await self.fellow.finish(version, run)
        if waited.cancelled_caught:
            raise RemoteProtocolError("ring-stalled", f"no update past version {version} "
                                      f"within {wait_s:.0f} s")

    async def receive(self, first: PartOpen, stream: SecureStream) -> bool:
        """One part message from ``stream`` into the fellow; False (dropped) when it is
        not from the fellow the ring names for its sender, or not a part message."""
        sender = first.sender
        if sender >= len(self.fellows) or not self.fellows[sender] \
                or stream.peer_node_id.hex() != self.fellows[sender]:
            return False
        msg = await receive_message(stream, object, "a fellow of the ring")
        if not isinstance(msg, PartDelta | PartUpdate | PartState):
            return False
        if isinstance(msg, PartDelta) and msg.replica != str(sender):
            return False
        self.traffic.received_bytes += _size(msg)
        try:
            self.inbox.send_nowait(msg)
        except trio.WouldBlock:
            return False
        return True


__all__ = ["MAX_QUEUED", "RingTraffic", "StageRing", "StreamPartNet"]
