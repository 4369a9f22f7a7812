"""Sync rounds of a job whose replicas average their deltas by the all-reduce: no hub.

Theory of operation. As in ``rounds`` each replica trains its budget of steps in its own
task, but at the end of a round it does not send its deltas to the driver: the driver
tells each of its stages ``RingRound`` (``ring``), and the stages of one index across the
replicas run the sharded all-reduce among themselves (``allreduce``): each keeps a part
of the stage, reduces that part of everyone's delta and sends its update to all. The
answer comes once the stage applied the previous round's update and sent this round's
delta, so a round's traffic overlaps the next round's compute. A replica that took its
budget while another has not yet sent into the round its stages would wait on trains on,
a step at a time, rather than idle there (``_train_on``); its delta weighs the samples
it took.

The driver stays the job's memory, with one mirror ``StageKeeper`` a stage: when a
stage reports a version its mirror lacks, the driver fetches that update's parts from it
(one compressed update a stage a round, whatever the number of replicas) and adopts
them, so checkpoints, job copies and a replica placed again take the global parameters
from there as before. The parts' outer momentum and error feedback live with their
keepers: a checkpoint gathers them (``OuterAsk``) into the mirror first, and a ring
that starts from a resumed job is seeded with them (``OuterLoadHead``).

The driver says who is in each ring: the replicas training now, and for each part its
keeper, at first the replica of its index; a part whose keeper leaves the rounds moves to
the next replica in ring order that trains (the same rule ``allreduce`` applies), and
stays there when its keeper comes back.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING

import trio

from p2pswarm.agent.training.links import Link
from p2pswarm.agent.training.round_entry import LateContribution, RoundEntry
from p2pswarm.agent.training.rounds import RoundsKeeper
from p2pswarm.agent.training.transfer import send_state_parts
from p2pswarm.errors import SwarmError
from p2pswarm.training.round_rule import delta_weight, round_closes
from p2pswarm.wire.training import (
    Ack,
    OuterAsk,
    OuterLoadHead,
    PartUpdate,
    PartUpdateAsk,
    RingDone,
    RingRound,
)

if TYPE_CHECKING:
    from p2pswarm.agent.training.checkpoints import CheckpointKeeper
    from p2pswarm.agent.training.global_state import GlobalState
    from p2pswarm.agent.training.placed import ReplicaPlacement
    from p2pswarm.agent.training.ports import DriverPort
    from p2pswarm.agent.training.replica import Replica
    from p2pswarm.agent.training.runtime import StageKeeper

log = logging.getLogger("p2pswarm.training")


def sync_by_allreduce(roster: Sequence[ReplicaPlacement],
                      speaks_allreduce: Callable[[str], bool]) -> bool:
    """Whether a job of these replicas syncs by the all-reduce (``RingRounds``) rather
    than through its stages' keepers on the driver (``RoundsKeeper``).

    The one place this is decided. Fellows of the previous release (protocol 1) do not
    speak ``RingRound`` and the part messages, so every stage's fellow must have
    announced the capability (``speaks_allreduce``, by fellow id); a roster with one
    that has not syncs through the keepers. One replica syncs with nobody (the driver
    trains it alone)."""
    return len(roster) >= 2 and all(speaks_allreduce(s.fellow_id)
                                    for placed in roster for s in placed.stages)


class RingRounds(RoundsKeeper):
    """A driver's rounds when its replicas sync by the all-reduce (see the module doc)."""

    def __init__(self, driver: DriverPort, global_state: GlobalState,
                 checkpoints: CheckpointKeeper) -> None:
        super().__init__(driver, global_state, checkpoints)
        self._owners = list(range(len(self._driver.replicas)))
        self._recorded = -1  # the mirrors' version whose round is in the job's record
        self._seeded: dict[tuple[int, int], int] = {}  # (replica, stage) -> generation
        self._mirroring = trio.Lock()  # one replica's fetch at a time takes an update
        # (generation, version) of each replica's delta in flight: its next round's delta
        # is anchored on the version after
        self._in_flight: dict[int, tuple[int, int]] = {}
        self._ring_sent: dict[tuple[int, int], int] = {}  # (replica, stage) -> its bytes

    # --- the round-closer -------------------------------------------------------------

    def _round_due(self, keeper: StageKeeper, now: float) -> bool:
        if self._recorded < 0:
            self._recorded = keeper.version
        return keeper.version > self._recorded or round_closes(keeper, now)

    async def _close_round(self, now: float) -> None:
        """A round the mirrors took (else only the deadline moves on): into the job's
        record, then replicas placed again join, the job is copied, and checkpointed
        when one is due (with the parts' outer state gathered first)."""
        driver = self._driver
        for keeper in driver.keepers:
            keeper.restart_deadline(now)
        version = driver.keepers[0].version
        if version <= self._recorded:
            return
        self._recorded = version
        driver.job.rounds.append(RoundEntry(
            driver.job.step, version, round(now, 3),
            # the replicas whose deltas anchored on the round before are in it
            tuple(r.name for r in driver.replicas if r.sent_version >= version - 1), (),
            tuple(self._late)))
        self._late = []
        closed, self._closed = self._closed, trio.Event()
        closed.set()
        await self._admit()
        await driver.training.handover.keep(driver.job, driver)
        due = driver.cfg.checkpoint.interval_steps
        store = self._checkpoints.store
        if store is not None and driver.job.step // due > self._checkpointed // due:
            async with self.all_locks():
                await self._gather_outer()
                await self._checkpoints.checkpoint()
            self._checkpointed = driver.job.step

    # --- one replica's round ----------------------------------------------------------

    def _in_ring(self, r: Replica) -> list[Replica]:
        """The replicas whose stages sync now: those training, and those that sent their
        last round (their stages keep their parts until the job's last round closes)."""
        return [x for x in self._driver.replicas
                if x is r or (not x.paused and (x.running or x.finished))]

    def _regroup(self, live: list[Replica]) -> list[int]:
        """Each part's keeper: a part whose keeper left moves to the next replica in ring
        order that trains."""
        n = len(self._owners)
        indices = {x.index for x in live}
        for j, owner in enumerate(self._owners):
            if owner not in indices:
                self._owners[j] = next((owner + k) % n for k in range(1, n + 1)
                                       if (owner + k) % n in indices)
        return list(self._owners)

    def _train_on(self, r: Replica, budget_done_s: float) -> bool:
        """Whether ``r``, its budget taken, takes one more step rather than send now.

        Its stages would first wait for the update of the round its delta in flight is
        in, which closes once every replica of the ring sent into it: while one that
        trains has not (a slower replica, or one whose budget came out longer), ``r``
        would idle there. So it trains on, a step at a time, until the last of them
        sent (its delta then weighs the samples it took, as the keepers weigh every
        delta), but for no longer than a round's deadline past its budget: past that
        the keepers close the round without the late one anyway. A replica more than
        a round behind (placed again, say) is not waited for; it is late either way."""
        flying = self._in_flight.get(r.index)
        if flying is None or flying[0] != r.generation:
            return False  # nothing in flight: sending waits for nobody
        if trio.current_time() - budget_done_s >= self._driver.cfg.sync.round_deadline_s:
            return False
        anchored = flying[1]
        return any(anchored - 1 <= x.sent_version < anchored for x in self._driver.replicas
                   if x is not r and x.running and not x.paused and not x.finished)

    def _wait_s(self) -> float:
        """The most a stage waits for a round's update: a keeper closes its part by its
        deadline; a part moving to a new keeper may take as long again."""
        timings = self._driver.training.timings
        return 2 * self._driver.cfg.sync.round_deadline_s + timings.step_timeout_s

    async def _contribute(self, r: Replica) -> tuple[int, bool]:
        """Each stage of ``r`` applies the previous round's update and sends this round's
        delta into its ring; (the version it stands at, False: the driver never waits
        on a round)."""
        live = self._in_ring(r)
        owners = self._regroup(live)
        last = self._trained_enough()
        flying = self._in_flight.pop(r.index, None)
        # what this round's delta is anchored on, known before it is sent: a round that
        # closes meanwhile counts it in the job's record (``_close_round``); not when a
        # stage fails before it is sent
        was = r.sent_version
        r.sent_version = flying[1] + 1 if flying is not None and flying[0] == r.generation \
            else r.version
        try:
            versions = await self._send_round(r, live, owners, last)
        except BaseException:
            r.sent_version = was
            raise
        await self._mirror(r, versions)
        self._late_or_not(r, r.sent_version)
        r.version = min(versions)
        if not last:
            self._in_flight[r.index] = (r.generation, r.version)
        else:
            await self._step_aside(r, live, owners)
        r.rounds_done = max(r.rounds_done, r.version)
        r.samples_unsent = r.steps_unsent = 0
        r.kept_position = r.stream.position
        if len(r.links) > 1:
            await self._global.copy_tied(r)
        self.wake()
        return r.version, False

    def _late_or_not(self, r: Replica, anchored: int) -> None:
        """A delta anchored on a round the ring closed already is late: its keepers
        weigh it by its staleness (``round_rule.delta_weight``), or drop it past the
        bound, as the driver's keepers would; the job's record says so."""
        driver = self._driver
        staleness = driver.keepers[0].version - anchored
        if staleness <= 0:
            return
        sync = driver.cfg.sync
        weight = delta_weight(1, staleness, sync.staleness_decay, sync.staleness_bound)
        self._late.append(LateContribution(r.name, staleness, r.samples_unsent, weight,
                                           weight == 0.0))
        log.info("job %s: %s sent %d round(s) late: %s", driver.job.job_id, r.name,
                 staleness, "dropped" if weight == 0.0 else f"weighed {weight:g}")
        if weight == 0.0:  # too stale: the model never learns from these
            driver.job.samples = max(0, driver.job.samples - r.samples_unsent)

    async def _step_aside(self, r: Replica, live: list[Replica], owners: list[int]) -> None:
        """After ``r``'s last round: when another replica's delta waits in a round ``r``
        never joins (one anchored on the version ``r`` ended at, as a replica placed again
        a round behind the others leaves them), the part keepers still count ``r`` in that
        round and would wait for it until its deadline; an empty round of ``r`` (no
        samples, so it weighs nothing) lets that round close at once."""
        waited = [x for x in self._driver.replicas
                  if x is not r and x.running and not x.paused
                  and x.sent_version >= r.version]
        if not waited:
            return
        log.info("job %s: %s ended its rounds at version %d; an empty one for %s",
                 self._driver.job.job_id, r.name, r.version,
                 ", ".join(x.name for x in waited))
        r.samples_unsent = 0
        await self._send_round(r, live, owners, False)

    async def _send_round(self, r: Replica, live: list[Replica], owners: list[int],
                          last: bool) -> list[int]:
        """``RingRound`` to every stage of ``r``; the versions they stand at."""
        driver = self._driver
        versions = []
        for link in r.links:
            s = link.stage
            stages = [x.links[s] if x in live else None for x in driver.replicas]
            fellows = tuple("" if x not in live else driver.job.placement[x.index]
                            .stages[s].fellow_id for x in driver.replicas)
            await self._seed(r, link, owners)
            msg = RingRound(r.samples_unsent, self._wait_s(),
                            tuple(k.addr if k is not None else "" for k in stages),
                            fellows, tuple(owners), last)
            done = await link.ask(msg, RingDone)
            versions.append(done.version)
            # the bytes its ring sent since its last answer (a new ring counts afresh)
            key = (r.index, s)
            before = self._ring_sent.get(key, 0)
            driver.job.bytes_sent += done.sent_bytes - (
                before if done.sent_bytes >= before else 0)
            self._ring_sent[key] = done.sent_bytes
        return versions

    async def _catch_up(self, r: Replica) -> None:
        """Nothing: its stages take the updates from their rings."""

    async def _seed(self, r: Replica, link: Link, owners: list[int]) -> None:
        """A stage's first ring round since it was placed: the outer state of the parts
        it keeps, from its mirror (a resumed job's; none when it is all zero)."""
        key = (r.index, link.stage)
        if self._seeded.get(key) == r.generation:
            return
        self._seeded[key] = r.generation
        driver = self._driver
        keeper = driver.keepers[link.stage]
        parts = len(owners)
        states = await driver.training.agent.compute.run(lambda: keeper.outer_parts(parts))
        mine = {j: b for j, b in states.items() if owners[j] == r.index}
        if not mine:
            return
        runtime = driver.runtime
        blob = await driver.training.agent.compute.run(lambda: runtime.pack_outer(mine))
        digest = await driver.training.agent.compute.run(lambda: _sha256(blob))
        await link.send(OuterLoadHead(len(blob), digest))
        assert link.stream is not None
        await send_state_parts(link.stream, blob)
        await link.receive(Ack)

    async def _mirror(self, r: Replica, versions: list[int]) -> None:
        """Each stage's mirror takes the updates its stage applied and it lacks."""
        driver = self._driver
        async with self._mirroring:
            for link, keeper, version in zip(r.links, driver.keepers, versions):
                await self._mirror_stage(link, keeper, version)

    async def _mirror_stage(self, link: Link, keeper: StageKeeper, version: int) -> None:
        """One stage's mirror up to ``version``, from the stage that stands there."""
        driver = self._driver
        parts = len(self._owners)
        while keeper.version < version:
            target = keeper.version + 1
            blobs = []
            for j in range(parts):
                blobs.append((await link.ask(PartUpdateAsk(target, j), PartUpdate)).blob)
            if not all(blobs):  # it applied that update too long ago
                log.warning("job %s: stage %d no longer holds the update to version %d",
                            driver.job.job_id, link.stage, target)
                return
            try:
                await driver.training.agent.compute.run(
                    partial(keeper.adopt_parts, target, blobs))
            except SwarmError as exc:
                log.warning("job %s: stage %d's update to version %d: %s",
                            driver.job.job_id, link.stage, target, exc)
                return
            driver.job.bytes_sent += sum(len(b) for b in blobs)

    async def _gather_outer(self) -> None:
        """The parts' outer state from their keepers into each stage's mirror."""
        driver = self._driver
        parts = len(self._owners)
        runtime = driver.runtime
        incoming = driver.training.copies.incoming
        for r in driver.replicas:
            if not r.running or r.paused or r.index not in self._owners:
                continue
            for link, keeper in zip(r.links, driver.keepers):
                path = incoming / f"{driver.job.job_id}.outer-{r.index}-{link.stage}.pt"
                try:
                    with trio.fail_after(driver.training.timings.step_timeout_s):
                        await self._checkpoints.gather_state(link, path, OuterAsk())
                    blob = path.read_bytes()
                    states = await driver.training.agent.compute.run(
                        partial(runtime.unpack_outer, blob, parts))
                    await driver.training.agent.compute.run(
                        partial(keeper.take_outer_parts, states, parts))
                except (SwarmError, trio.TooSlowError, OSError) as exc:
                    log.info("job %s: outer state of %s's parts not gathered: %s",
                             driver.job.job_id, r.name, exc)
                finally:
                    path.unlink(missing_ok=True)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


__all__ = ["RingRounds", "sync_by_allreduce"]
