"""Copies of the leader's jobs on fellows, so that a job outlives its leader.

The leader hands ``KEEPERS`` fellows (rendezvous hashing over the connected fellows, so
the choice is stable as unrelated fellows come and go) a copy of each job it leads
(``JobKeep``): the record and where the rounds stand (``job_state.JobSnapshot``) and, for a
job of several replicas, every stage keeper's outer state (global parameters, outer
momentum, error feedback, recent updates; left out when it passes ``OUTER_KEEP_BYTES``,
and the job then resumes from its checkpoint). It copies when the job is submitted, when
it starts running, after every sync round (a job of one replica: every
``KEEP_EVERY_STEPS`` steps and after every checkpoint) and when it ends. Copies travel
in the background, one at a time per job, the newest replacing one not yet sent, so a
slow fellow never holds a round up. The leader keeps its own copy too: stepped down, it
hands the newest to whoever leads next.

A fellow keeps a copy only from the leader it follows, stamped with the term it is at
(``stream.peer_node_id`` is authenticated by the handshake), and only if it is newer than
the one it has (later term, or same term and later ``seq``); it checks the document
before keeping it, keeps at most ``MAX_KEPT_JOBS`` jobs (finished ones go first) and at
most ``KEPT_OUTER_BYTES`` of outer state (the oldest copies lose theirs first). Any
fellow may ask what it keeps (``JobsKeptAsk``) and fetch one copy (``JobCopyAsk``):
``takeover`` does, when this fellow is elected. Every copy kept is also written to the
fellow's state directory (``kept_store``) and read back when it starts, so a whole swarm
restarted from its homes resumes its jobs.
"""

from __future__ import annotations

import hashlib
import logging
from typing import TYPE_CHECKING

import trio

from p2pswarm.agent.leadership import call_failed, expect_reply
from p2pswarm.agent.streams import receive_message, send_message
from p2pswarm.agent.training.job_state import JobSnapshot
from p2pswarm.agent.training.jobs import TERMINAL
from p2pswarm.agent.training.kept_store import JobCopy, KeptStore
from p2pswarm.agent.training.runtime import KeeperState
from p2pswarm.errors import PlacementError, RemoteProtocolError, SwarmError
from p2pswarm.training.checkpoint_files import shard_holders
from p2pswarm.wire.jobs import (
    MAX_KEPT_JOBS,
    OUTER_CHUNK_BYTES,
    OUTER_KEEP_BYTES,
    JobCopyAsk,
    JobKeep,
    JobKept,
    JobOuterChunk,
    JobsKept,
    JobsKeptAsk,
    KeptCopy,
)
from p2pswarm.wire.orders import CallFailed

if TYPE_CHECKING:
    from p2pswarm.agent.training.job_record import Job, Running
    from p2pswarm.agent.training.ports import HandoverPort, Node
    from p2pswarm.transport.secure import SecureStream

log = logging.getLogger("p2pswarm.training")

KEEPERS = 3  # fellows besides the leader holding each job's copy
KEEP_EVERY_STEPS = 10  # a job of one replica (no rounds) is copied this often
KEEP_TIMEOUT_S = 120.0  # the most one copy may take to reach one fellow
KEPT_OUTER_BYTES = 512 * 1024 * 1024  # outer state one fellow keeps, all jobs together


def outer_state(keeper_state: KeeperState) -> KeeperState:
    """What of a keeper's state a new leader resumes from: the global parameters, the
    outer momentum and the update's error feedback (not the recent updates: every
    replica takes the whole global state on a takeover)."""
    return {**keeper_state, "history": {}}


async def send_copy(stream: SecureStream, copy: JobCopy) -> None:
    """``copy`` on ``stream``: its header, then its outer state in chunks."""
    await send_message(stream, copy.head)
    for offset in range(0, len(copy.outer), OUTER_CHUNK_BYTES):
        await send_message(stream, JobOuterChunk(
            copy.head.job_id, copy.head.seq, offset,
            copy.outer[offset:offset + OUTER_CHUNK_BYTES]))


async def receive_outer(head: JobKeep, stream: SecureStream, who: str) -> bytes:
    """The outer state that follows ``head`` on ``stream``, checked against its digest."""
    total = sum(head.outer_bytes)
    if total > OUTER_KEEP_BYTES:
        raise RemoteProtocolError("bad-job-copy", f"outer state of {total} bytes is over "
                                  f"the {OUTER_KEEP_BYTES} a copy may carry")
    parts, have = [], 0
    while have < total:
        chunk = await receive_message(stream, JobOuterChunk, who)
        if (chunk.job_id, chunk.seq, chunk.offset) != (head.job_id, head.seq, have) \
                or have + len(chunk.data) > total:
            raise RemoteProtocolError("bad-job-copy", "outer state out of order")
        parts.append(chunk.data)
        have += len(chunk.data)
    data = b"".join(parts)
    if total and hashlib.sha256(data).hexdigest() != head.outer_sha256:
        raise RemoteProtocolError("bad-job-copy", "outer state does not match its SHA-256")
    return data


async def fetch_copy(agent: Node, addr: str, ask: JobCopyAsk) -> JobCopy:
    """Job copy ``ask.job_id`` from the fellow at ``addr``, outer state and all."""
    async with await agent.open_secure(addr) as stream:
        await send_message(stream, ask)
        head = expect_reply(await receive_message(stream, object, addr), JobKeep, addr)
        return JobCopy(head, await receive_outer(head, stream, addr))


class JobHandover:
    """This fellow's kept copies (any fellow) and the leader's side: copying its jobs."""

    def __init__(self, training: HandoverPort) -> None:
        self.training = training
        self.agent = training.agent
        self.kept: dict[str, JobCopy] = {}  # job id -> the newest copy this fellow holds
        self._states: dict[str, str] = {}  # job id -> the job's state in that copy
        self._seq = 0
        self._latest: dict[str, JobCopy] = {}  # job id -> its copy waiting to be sent
        self._sending: set[str] = set()
        self.sent = 0  # copies that reached a fellow (for tests and figures)
        self._receiving = trio.Lock()
        # on disk too, so that a whole swarm restarted resumes its jobs (``kept_store``)
        self.store: KeptStore | None = None
        if getattr(self.agent, "home", None) is not None:  # (a bare test agent has none)
            self.store = KeptStore(self.agent.state_dir("job-copies"), self.agent.compute.run,
                                   self.agent.spawn)
            self._read_back(self.store)
        self.agent.on_stream(JobKeep, self._on_keep)
        self.agent.on_stream(JobsKeptAsk, self._on_list)
        self.agent.on_stream(JobCopyAsk, self._on_copy_ask)

    # --- the leader's side ------------------------------------------------------------------

    async def keep(self, job: Job, driver: Running | None = None) -> None:
        """Copy ``job`` (and where ``driver``'s rounds stand) to its fellows, in the
        background; returns once the copy is made, not sent."""
        leadership = self.training.leadership
        if not leadership.is_leader() or (job.term and job.term != leadership.term()):
            return  # a job driven in a term this agent no longer leads is not its to copy
        parts: list[bytes] = []
        digest = ""
        if driver is not None and driver.synced and driver.keepers:
            states = [outer_state(k.state_dict()) for k in driver.keepers]  # taken now
            runtime = self.training.runtime

            def serialize() -> tuple[list[bytes], str]:  # off the event loop: torch.save
                blobs = [runtime.shard_bytes(s) for s in states]
                return blobs, hashlib.sha256(b"".join(blobs)).hexdigest()

            parts, digest = await self.agent.compute.run(serialize)
            if sum(len(b) for b in parts) > OUTER_KEEP_BYTES:
                log.info("job %s: outer state of %d bytes is over the copy's %d; a new "
                         "leader would resume from the checkpoint", job.job_id,
                         sum(len(b) for b in parts), OUTER_KEEP_BYTES)
                parts, digest = [], ""
        outer = b"".join(parts)
        self._seq += 1
        state = JobSnapshot.of(job, driver, self.agent.name).packed()
        head = JobKeep(job.job_id, self._seq, state, tuple(len(b) for b in parts), digest,
                       leadership.term())
        copy = JobCopy(head, outer)
        self._hold(copy, job.state)
        self._latest[job.job_id] = copy
        if job.job_id not in self._sending:
            self._sending.add(job.job_id)
            self.agent.spawn(self._send, job.job_id)

    def hold(self, copy: JobCopy, state: str) -> None:
        """Keep ``copy`` as this fellow's own: a leader adopting a job holds the copy it
        adopted, to resume from (and hand on) until it makes one of its own."""
        self._hold(copy, state)

    def holders(self, job_id: str) -> dict[str, str]:
        """The connected fellows that keep ``job_id``'s copy: node id (hex) -> address."""
        membership = self.agent.membership
        fellows = {m.node_id.hex(): m.addr for m in (membership.members() if membership
                                                      else ())
                   if m.state == "alive" and not m.is_self}
        chosen = shard_holders([job_id], sorted(fellows), KEEPERS)[job_id]
        return {f: fellows[f] for f in chosen}

    async def _send(self, job_id: str) -> None:
        try:
            while job_id in self._latest:
                copy = self._latest.pop(job_id)
                if not self.training.leads(copy.head.term):
                    continue  # stepped down since: the new leader's copies count now
                async with trio.open_nursery() as nursery:
                    for addr in sorted(self.holders(job_id).values()):
                        nursery.start_soon(self._send_one, addr, copy)
        finally:
            self._sending.discard(job_id)

    async def _send_one(self, addr: str, copy: JobCopy) -> None:
        try:
            with trio.fail_after(KEEP_TIMEOUT_S):
                async with await self.agent.open_secure(addr) as stream:
                    await send_copy(stream, copy)
                    expect_reply(await receive_message(stream, object, addr), JobKept, addr)
            self.sent += 1
        except (SwarmError, trio.TooSlowError) as exc:
            why = str(exc) if isinstance(exc, SwarmError) else "no answer"
            log.info("copy %d of job %s to %s: %s", copy.head.seq, copy.head.job_id, addr, why)

    # --- any fellow: the copies it keeps -------------------------------------------------------

    def _read_back(self, store: KeptStore) -> None:
        """The copies this fellow kept before it stopped (oldest first, so the bounds
        below drop the oldest)."""
        for copy in reversed(store.load()):
            try:
                job = JobSnapshot.read(copy.head.state).job
            except SwarmError as exc:
                log.warning("job copy of %s on disk refused: %s", copy.head.job_id, exc)
                store.drop_now(copy.head.job_id)
                continue
            if job.job_id == copy.head.job_id:
                self._hold(copy, job.state, write=False)
        if self.kept:
            log.info("%d job copies read back from %s", len(self.kept), store.root)

    def _hold(self, copy: JobCopy, state: str, *, write: bool = True) -> None:
        job_id = copy.head.job_id
        old = self.kept.get(job_id)
        if old is not None and old.order >= copy.order:
            return
        if old is None and len(self.kept) >= MAX_KEPT_JOBS:
            oldest = min(self.kept, key=lambda j: (self._states[j] not in TERMINAL,
                                                   self.kept[j].order))
            del self.kept[oldest], self._states[oldest]
            if write:
                self._write(oldest, None)
        self.kept[job_id] = copy
        self._states[job_id] = state
        if write:
            self._write(job_id, copy)
        held = sum(len(c.outer) for c in self.kept.values())
        for j in sorted(self.kept, key=lambda j: self.kept[j].order):
            if held <= KEPT_OUTER_BYTES:
                break
            c = self.kept[j]
            held -= len(c.outer)
            self.kept[j] = JobCopy(JobKeep(j, c.head.seq, c.head.state, (), "", c.head.term))
            if write:  # (read back before the agent runs: nothing may be spawned yet)
                self._write(j, self.kept[j])

    def _write(self, job_id: str, copy: JobCopy | None) -> None:
        if self.store is not None:
            if copy is None:
                self.store.drop(job_id)
            else:
                self.store.put(copy)

    async def _on_keep(self, msg: JobKeep, stream: SecureStream) -> JobKept | CallFailed:
        election = self.agent.election
        leader = election.status().leader_id if election is not None else None
        if election is None or leader != stream.peer_node_id or msg.term != election.term:
            self.agent.counters.refuse("order-not-from-leader" if leader != stream.peer_node_id
                                       else "order-stale-term")
            return call_failed(PlacementError(
                f"{self.agent.name} keeps job copies only from the leader it follows, in "
                f"its term ({election.term if election else 0})"))
        try:
            async with self._receiving:  # one copy in memory at a time, however many come
                outer = await receive_outer(msg, stream, "the leader")
            job = JobSnapshot.read(msg.state).job
        except RemoteProtocolError as exc:
            return call_failed(exc)
        if job.job_id != msg.job_id:
            return call_failed(PlacementError("the copy names another job"))
        self._hold(JobCopy(msg, outer), job.state)
        return JobKept(msg.job_id, msg.seq)

    async def _on_list(self, msg: JobsKeptAsk, stream: SecureStream) -> JobsKept:
        return JobsKept(tuple(KeptCopy(j, c.head.term, c.head.seq, self._states[j])
                              for j, c in sorted(self.kept.items())))

    async def _on_copy_ask(self, msg: JobCopyAsk, stream: SecureStream) -> CallFailed | None:
        copy = self.kept.get(msg.job_id)
        if copy is None:
            return call_failed(PlacementError(f"{self.agent.name} keeps no copy of "
                                              f"{msg.job_id}"))
        await send_copy(stream, copy)
        return None


__all__ = ["KEEPERS", "KEEP_EVERY_STEPS", "JobCopy", "JobHandover", "fetch_copy",
           "outer_state"]
