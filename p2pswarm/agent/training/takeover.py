"""A new leader takes over the jobs its predecessor led, without the user doing anything.

Elected, this agent gathers the job copies (``handover``): its own and every connected
fellow's (``JobsKeptAsk``), and fetches the newest of each job (latest term, then latest
``seq``) whole (``JobCopyAsk``). A job it does not lead already is recorded as the copy
says; a finished, failed or cancelled one stays so (``jobs`` still lists it); a pending
or running one is driven again, from where the copy says its rounds stood:

1. Every replica is ordered back onto the fellows and cards that held it (a later
   placement ``generation``, a newer term). A fellow still holding that stage keeps it,
   its parameters and inner optimizer state with it (``stage_host``).
2. A job of several replicas whose copy carries the keepers' outer state resumes where
   its rounds stood: the keepers take that state (global parameters at version v, outer
   momentum), every replica placed takes the global parameters (``Reset``) and goes on
   from its data position and optimizer steps in the copy. A replica whose fellow is
   gone is paused; the driver places it again as it does any paused replica. What the
   replicas trained after the copy (at most one round) is trained again.
3. Otherwise (one replica: no rounds; outer state too big to copy) the job resumes from
   its latest checkpoint, fetched from the fellows holding copies; a job that wrote no
   checkpoint starts again from step 0, and says so.

The record says it moved (``moved``: from which leader, to which, at which step, from
what), and ``jobs`` / ``GET /api/jobs`` on any fellow show it running under the new
leader.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import trio

from p2pswarm.agent.training.handover import JobCopy, fetch_copy
from p2pswarm.agent.training.job_state import Handed, JobSnapshot
from p2pswarm.agent.training.jobs import TERMINAL, Job
from p2pswarm.errors import ReplicaLost, SwarmError
from p2pswarm.wire.jobs import JobCopyAsk, JobsKept, JobsKeptAsk

if TYPE_CHECKING:
    from p2pswarm.agent.training.placed import Placement, StagePlacement
    from p2pswarm.agent.training.ports import TakeoverPort

log = logging.getLogger("p2pswarm.training")

ASK_TIMEOUT_S = 10.0  # the most one fellow may take to list its copies
FETCH_TIMEOUT_S = 120.0  # the most one copy (outer state and all) may take to arrive


class Takeover:
    """The new leader's side: gather the copies, adopt the jobs, drive them again."""

    def __init__(self, training: TakeoverPort) -> None:
        self.training = training
        self.agent = training.agent
        self._adopting = trio.Lock()  # one gather at a time: a job is adopted once

    def elected(self) -> None:
        self.agent.spawn(self.take_over, self.training.leadership.term())

    def fellow_back(self, node_id: bytes) -> None:
        """A fellow joined or came back while this agent leads: ask it too. The gather
        at the election missed it (down, booting or suspected then), and it may keep
        the only copy of a job: after a whole swarm restarts, or from a deposed leader
        that took a job in just before it learned of the election."""
        leadership = self.training.leadership
        member = self.agent.fellow(node_id.hex())
        if leadership.is_leader() and member is not None and not member.is_self:
            self.agent.spawn(self.take_over, leadership.term(), member.addr)

    async def take_over(self, term: int, only: str | None = None) -> None:
        """Adopt every job whose newest copy this agent (or only the fellow at ``only``,
        and this agent) can find."""
        async with self._adopting:
            await self._take_over(term, only)

    async def _take_over(self, term: int, only: str | None) -> None:
        leadership = self.training.leadership
        if not leadership.is_leader() or leadership.term() != term:
            return
        copies = await self.gather(only)
        for job_id, copy in sorted(copies.items()):
            if not leadership.is_leader() or leadership.term() != term:
                return  # no longer the leader that gathered them
            known = self.training.jobs.get(job_id)
            if known is not None and not known.handed:
                # this agent drives it already, or ended it itself: an older copy of it
                # (its last one not yet made) must not drive it again (a job it handed on
                # is taken back)
                continue
            try:
                taken = JobSnapshot.read(copy.head.state)
            except SwarmError as exc:
                log.warning("job copy of %s refused: %s", job_id, exc)
                continue
            job, rounds = taken.job, taken.rounds
            was = taken.leader or "the last leader"
            self.training.jobs[job_id] = job
            self.training.handover.hold(copy, job.state)
            if job.state in TERMINAL:
                continue
            log.info("job %s: taken over from %s at step %d", job_id, was, job.step)
            job.state, job.reason = "pending", (f"taken over from {was}: its replicas go "
                                                "back on their fellows")
            handed = Handed(rounds, tuple(copy.outer_parts()), was)
            self.agent.spawn(self.training.drive, job, handed)

    async def gather(self, only: str | None = None) -> dict[str, JobCopy]:
        """The newest copy of every job this agent or a connected fellow (or only the
        one at ``only``) keeps; this agent's own copies win ties and older copies."""
        own = self.training.handover.kept
        best: dict[str, tuple[tuple[int, int], str]] = {j: (c.order, "")
                                                        for j, c in own.items()}
        membership = self.agent.membership
        fellows = [only] if only is not None else sorted(
            m.addr for m in (membership.members() if membership else ())
            if m.state == "alive" and not m.is_self)

        async def ask(addr: str) -> None:
            try:
                with trio.fail_after(ASK_TIMEOUT_S):
                    reply = await self.training.leadership.order(addr, JobsKeptAsk(),
                                                                 JobsKept)
            except (SwarmError, trio.TooSlowError) as exc:
                log.info("job copies of %s: %s", addr, exc)
                return
            for c in reply.copies:
                if c.job_id not in best or best[c.job_id][0] < (c.term, c.seq):
                    best[c.job_id] = ((c.term, c.seq), addr)

        async with trio.open_nursery() as nursery:
            for addr in fellows:
                nursery.start_soon(ask, addr)
        out: dict[str, JobCopy] = {}
        for job_id, (_, addr) in sorted(best.items()):
            if not addr:
                out[job_id] = own[job_id]
                continue
            try:
                with trio.fail_after(FETCH_TIMEOUT_S):
                    got = await fetch_copy(self.agent, addr, JobCopyAsk(
                        job_id, self.training.leadership.term()))
            except (SwarmError, trio.TooSlowError) as exc:
                log.info("job copy of %s from %s: %s", job_id, addr, exc)
                if job_id in own:
                    out[job_id] = own[job_id]
                continue
            if got.head.job_id == job_id:
                out[job_id] = got
        return out

    # --- placing a job taken over ------------------------------------------------------------

    async def place(self, job: Job, handed: Handed) -> Placement:
        """The job's replicas back on their fellows; sets what the driver resumes from."""
        placer = self.training.placer
        if not job.placement:  # it never started: placed as any new job
            self._note(job, handed, "placing it (it had not started)")
            placement = await placer.place(job)
            handed.generation = job.generation
            return placement
        n = len(job.placement)
        rounds = handed.rounds
        stages = len(job.placement[0].stages) if job.placement else 0
        synced = n > 1 and rounds is not None and len(handed.outer) == stages > 0
        placed = await self._prepare_old(job, handed)
        whence: str
        if synced and placed and rounds is not None:
            handed.restore_rounds = True
            job.resume = False
            whence = (f"resumed where its rounds stood (round {rounds.version}, step "
                      f"{job.step})")
        elif job.placement and not handed.lost:
            whence = self.from_checkpoint(job)
        else:
            # placed afresh: every stage the fellows still hold goes (a lone replica then
            # waits for its cards as after any loss)
            await placer.release(job, None, sorted({
                s.addr for replica in job.placement for s in replica.stages
                if self._alive(s.fellow_id)}))
            lost = ReplicaLost("; ".join(handed.lost.values()) or "its fellows are gone")
            handed.lost = {}  # placed afresh below: nothing of the old placement to pause
            if n == 1:
                self._note(job, handed, "waiting for its fellows to resume")
                placement = await placer.wait_to_resume(job, lost)
            else:
                placement = await self.place_afresh(job, handed, synced=synced, moved=True)
            handed.generation = job.generation  # what the placer placed them with
            return placement
        self._note(job, handed, whence)
        return job.placement

    async def place_afresh(self, job: Job, handed: Handed, *, synced: bool,
                           moved: bool) -> Placement:
        """A job of several replicas none of which went back on its fellows, placed
        again on the cards the swarm gives now. Where ``synced`` (``handed`` carries the
        rounds and the keepers' outer state: a copy, or this leader's own last one) the
        new replicas take that global state and go on where the rounds stood; only a
        placement on another cut (the outer state is the old cut's) or no such state
        falls back to the latest checkpoint, or to step 0. ``moved``: a new leader took
        the job over (the record says so)."""
        cut = placement_cut(job.placement)
        rounds = handed.rounds if synced else None
        if rounds is not None:
            whence = (f"placed again, resumes where its rounds stood (round "
                      f"{rounds.version}, step {job.step})")
        else:
            whence = "placed again, " + self.from_checkpoint(job)
        if moved:
            self._note(job, handed, whence)
            job.state, job.reason = "pending", whence
        placement = await self.training.placer.place(job, cut=cut)
        if rounds is not None:
            if placement_cut(placement) == cut:
                handed.restore_rounds = True
                job.resume = False
            else:
                line = (f"placed on another cut ({placement_cut(placement)}, not {cut}): "
                        + self.from_checkpoint(job))
                job.moves.append(line)
                log.warning("job %s: %s", job.job_id, line)
        return placement

    def _note(self, job: Job, handed: Handed, whence: str) -> None:
        line = (f"moved from leader {handed.from_leader} to {self.agent.name} (term "
                f"{self.training.leadership.term()}) at step {job.step}: {whence}")
        job.moves.append(line)
        log.warning("job %s %s", job.job_id, line)

    @staticmethod
    def from_checkpoint(job: Job) -> str:
        """Set ``job`` to resume from its latest checkpoint, else from step 0; says which."""
        if job.config.checkpoint.dir is not None and job.checkpoint_step:
            job.resume = True
            return f"resumed from its checkpoint of step {job.checkpoint_step}"
        job.resume = False
        job.step, job.loss, job.losses, job.samples = 0, None, [], 0
        job.rounds, job.replica_steps = [], {}
        return "started again from step 0 (no round state or checkpoint reached it)"

    async def _prepare_old(self, job: Job, handed: Handed) -> list[int]:
        """Order each replica onto the fellows that held it, at a placement generation
        later than any the copy knows; the replicas placed (the others are in
        ``handed.lost``, with why)."""
        placer = self.training.placer
        known = [job.generation, job.paused_times] + [
            r.generation for r in (handed.rounds.replicas if handed.rounds else ())]
        job.generation = max(known)
        handed.generation = generation = job.next_generation()
        placed: list[int] = []
        for i in range(len(job.placement)):
            replica = job.placement[i]
            gone = [s.fellow for s in replica.stages if not self._alive(s.fellow_id)]
            if gone:
                handed.lost[i] = f"replica-{i}: {', '.join(gone)} not connected"
                continue
            # a fellow restarted may answer at a new address
            replica = replica.with_stages(tuple(self._now_at(s) for s in replica.stages))
            job.placement = tuple(replica if r == i else was
                                  for r, was in enumerate(job.placement))
            refusals = await placer.prepare(job, {i: replica}, generation)
            if refusals:
                await placer.release(job, i, replica.addrs, generation)
                handed.lost[i] = f"replica-{i}: " + "; ".join(refusals)
                continue
            placed.append(i)
        return placed

    def own_copy(self, job: Job) -> Handed | None:
        """Where ``job``'s rounds stood at this leader's own newest copy of it (made as
        each round closed), with the keepers' outer state; None without one."""
        copy = self.training.handover.kept.get(job.job_id)
        if copy is None or not copy.head.outer_bytes or not job.placement:
            return None
        try:
            own = JobSnapshot.read(copy.head.state)
        except SwarmError as exc:
            log.warning("job %s: its own copy does not read back: %s", job.job_id, exc)
            return None
        was, rounds = own.job, own.rounds
        if rounds is None or len(copy.head.outer_bytes) != len(job.placement[0].stages):
            return None
        # the record goes back to that copy too: the steps after it are trained again
        job.step, job.loss, job.losses, job.samples = was.step, was.loss, was.losses, \
            was.samples
        job.rounds, job.replica_steps = was.rounds, was.replica_steps
        return Handed(rounds, tuple(copy.outer_parts()), self.agent.name)

    def _now_at(self, stage: StagePlacement) -> StagePlacement:
        """``stage`` with its fellow's name and address as this leader sees them now."""
        member = self.agent.fellow(stage.fellow_id)
        assert member is not None
        return stage.at(member.name, member.addr)

    def _alive(self, fellow_id: str) -> bool:
        if fellow_id == self.agent.node_id.hex():
            return True
        member = self.agent.fellow(fellow_id)
        return member is not None and member.state == "alive"


def placement_cut(placement: Placement) -> list[int]:
    """The first layer of every stage but the first: where the replicas are cut."""
    return placement[0].cut if placement else []


__all__ = ["Handed", "Takeover", "placement_cut"]
