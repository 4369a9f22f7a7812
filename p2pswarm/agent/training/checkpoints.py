"""Checkpoints of a job: gathered by the driver, stored by the leader, copied to fellows.

Every ``checkpoint.interval_steps`` the driver asks every stage for its state
(``StateAsk``); each answers in parts (``transfer``: size and SHA-256 first, then
``StatePart`` frames), written straight into the shard's file in the step directory of
the leader's ``CheckpointStore``, so no message or memory cap limits a checkpoint. The
replicas' data positions and the keepers' state join them, and the manifest goes last.
Then the leader spreads it: each shard goes to the ``copies`` fellows ``shard_holders``
picks among the connected fellows other than the leader (rendezvous hashing: stable as
unrelated fellows come and go), and the manifest to every holder, last. A holder writes
each shard under ``<home>/checkpoint-copies/<job>/step-NNNNNNNN/`` as its frames arrive,
renaming it into place once its SHA-256 matches, and keeps the newest ``KEEP_STEPS``
steps it has a manifest for. With the leader's copy and two more on distinct fellows,
losing any one fellow (its disk included) loses no shard.

Resuming, the leader reads its own copy; a shard missing or damaged there (or the whole
checkpoint directory gone) is fetched from whichever connected fellow holds it, checked
against the manifest and written back into the leader's store. Where the swarm now cuts
the model differently, the runtime re-shards the checkpoint onto the new cut
(``training.reshard``) in a scratch store. Every stage then loads its shard
(``StateLoadHead`` and parts) and training goes on with the same loss trajectory; a
replica whose stage fails meanwhile is paused (placed again later), not the job.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, cast

import trio

from p2pswarm.agent.streams import send_best_effort, send_message
from p2pswarm.agent.training.checkpoint_meta import (
    CheckpointMeta,
    StagePosition,
    shard_digests,
)
from p2pswarm.agent.training.links import receive_answer
from p2pswarm.agent.training.runtime import KeeperState
from p2pswarm.agent.training.transfer import (
    Landing,
    check_hash,
    check_part,
    check_room,
    file_sha256,
    receive_shard_file,
    receive_state_parts,
    send_shard_file,
    send_state_file,
)
from p2pswarm.disk_budget import JOB_CHECKPOINTS, cap_bytes
from p2pswarm.errors import ConfigError, PlacementError, SwarmError
from p2pswarm.names import UnsafeName
from p2pswarm.training.checkpoint_files import (
    LATEST,
    MANIFEST,
    atomic_write_bytes,
    fsync_dir,
    shard_holders,
)
from p2pswarm.wire.training import (
    Ack,
    MomentsAsk,
    MomentsLoadHead,
    OuterAsk,
    StateAsk,
    StateHead,
    StateLoadHead,
    TrainError,
    TrainFetch,
    TrainShard,
)

if TYPE_CHECKING:
    from p2pswarm.agent.training.global_state import GlobalState
    from p2pswarm.agent.training.links import Link
    from p2pswarm.agent.training.ports import Compute, DriverPort, Leadership, SwarmNode
    from p2pswarm.agent.training.replica import Replica
    from p2pswarm.training.checkpoint import CheckpointStore
    from p2pswarm.transport.secure import SecureStream

log = logging.getLogger("p2pswarm.training")

KEEP_STEPS = 3  # newest complete steps a holder keeps per job
COPY_TIMEOUT_S = 120.0  # the most a small shard's copy may take
COPY_FLOOR_BYTES_PER_S = 10e6  # a big one gets this much longer per byte
MAX_MANIFEST_BYTES = 16 * 1024 * 1024  # a manifest names shards; it is never big


def second_name(source: Path, dest: Path) -> None:
    """``dest`` holding ``source``'s bytes (a whole, synced shard): a hard link, or where
    the disk allows none a synced copy renamed into place."""
    dest.unlink(missing_ok=True)
    try:
        os.link(source, dest)
    except OSError:
        tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
        shutil.copyfile(source, tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, dest)
    fsync_dir(dest.parent)


class CheckpointKeeper:
    """A driver's checkpoints: gathered from its stages into its store, copied to
    fellows, resumed from; and the optimizer moments a replica placed again borrows.
    Its state is its store; the driver's replicas and keepers it reaches through the
    driver (``ports.DriverPort``), the global state through ``global_state``."""

    def __init__(self, driver: DriverPort, global_state: GlobalState) -> None:
        self._driver = driver
        self._global = global_state
        self.store: CheckpointStore | None = None  # None: the job keeps no checkpoints

    @property
    def _compute(self) -> Compute:
        """Where work off the event loop runs (the agent's compute)."""
        return self._driver.training.agent.compute

    @property
    def _max_shard_bytes(self) -> int:
        return self._driver.training.agent.config.transport.max_shard_bytes

    async def checkpoint(self) -> None:
        """Gather every stage's state into the store (each straight into its shard file,
        in parts), then copy the checkpoint to fellows."""
        driver, job, cfg = self._driver, self._driver.job, self._driver.cfg
        store = self.store
        assert store is not None
        present = list(driver.active)
        step = job.step
        target = store.step_dir(step)
        files: dict[str, str] = {}
        positions: dict[str, StagePosition] = {}
        for r in list(present):
            try:
                for link in r.links:
                    name = f"{r.name}.stage-{link.stage}"
                    files[name] = await self.gather_state(link, target / f"{name}.pt")
                    positions[name] = StagePosition(r.stream.position, r.steps,
                                                    r.samples_unsent, r.steps_unsent,
                                                    r.version)
            except SwarmError as exc:
                # a fellow that left or crashed since the last step: its replica is
                # lost, not the job; the checkpoint is written as for any paused replica
                log.info("job %s: checkpoint at step %d: %s lost a fellow", job.job_id,
                         step, r.name)
                await driver.pause(r, exc)
                present.remove(r)
        if not present:
            log.info("job %s: checkpoint at step %d skipped, every replica is paused",
                     job.job_id, step)
            if step not in store.steps():  # only this attempt's shards
                shutil.rmtree(target, ignore_errors=True)
            return
        for r in driver.replicas:
            if all(r is not x for x in present):
                await self._stand_in(r, present[0], target, files, positions)
        shards = {f"keeper.stage-{s}": keeper.state_dict()
                  for s, keeper in enumerate(driver.keepers)}
        meta = CheckpointMeta(step, job.samples, job.bytes_sent, tuple(job.losses),
                              tuple(job.placement[0].cut), len(driver.replicas),
                              cfg, job.job_id, positions).to_doc()
        path = await self._compute.run(lambda: store.write(step, shards, meta, files))
        await self._trim(store)
        job.checkpoint = str(path)
        job.checkpoint_step = job.step
        copies = cfg.checkpoint.copies
        job.copies = await driver.training.copies.spread(job.job_id, job.step, path, copies)
        thin = sorted(n for n, h in job.copies.items() if len(h) < copies)
        if thin:
            log.warning("job %s: checkpoint %d has fewer than %d copies on fellows of %s",
                        job.job_id, job.step, copies, ", ".join(thin))

    async def _trim(self, store: CheckpointStore) -> None:
        """Past its cap, the store of leaders' own checkpoints under the home (where
        ``store`` is) drops other jobs' steps: those of ended jobs, and of jobs this
        fellow led before leadership moved on. The live job's are never dropped."""
        root = store.directory.parent
        if root.name != JOB_CHECKPOINTS:
            return  # a directory the submitter chose: never trimmed
        cap = cap_bytes(JOB_CHECKPOINTS, root, self._driver.training.agent.config.storage)
        dropped = await self._compute.run(lambda: trim_other_jobs(root, store.directory, cap))
        for name in dropped:
            log.info("%s: dropped %s, another job's checkpoint, over the %s bytes the "
                     "store keeps (storage.job_checkpoints_bytes)", JOB_CHECKPOINTS, name,
                     f"{cap:,}")

    async def _stand_in(self, r: Replica, present: Replica, target: Path,
                        files: dict[str, str], positions: dict[str, StagePosition]) -> None:
        """Shards for paused replica ``r``, whose stages are not there to ask (under
        churn one nearly always is, and a checkpoint skipped for it left a job with none
        for hundreds of steps): copies of ``present``'s, marked ``global_state``, so a
        resume puts ``r`` on the keepers' global parameters (as its rejoin would) and
        its data goes on from where its last delta left. Every reader of the layout
        (resume, export, re-shard) finds every shard."""
        keepers = self._driver.keepers
        version = keepers[0].version if keepers else r.version
        for link in present.links:
            name, like = f"{r.name}.stage-{link.stage}", f"{present.name}.stage-{link.stage}"
            source, dest = target / f"{like}.pt", target / f"{name}.pt"
            await self._compute.run(partial(second_name, source, dest))
            files[name] = files[like]
            positions[name] = StagePosition(r.kept_position, r.steps, 0, 0, version,
                                            global_state=True)

    async def gather_state(self, link: Link, dest: Path,
                           ask: StateAsk | MomentsAsk | OuterAsk = StateAsk()) -> str:
        """Stage ``link``'s state (or what else ``ask`` asks for) into the file ``dest``;
        its SHA-256."""
        await link.send(ask)
        head = await link.receive(StateHead)
        what = f"the {'moments' if isinstance(ask, MomentsAsk) else 'state'} of stage " \
               f"{link.stage} on {link.fellow}"
        check_room(head.total, self._max_shard_bytes, dest.parent, what)
        assert link.stream is not None
        await receive_state_parts(link.stream, Landing(dest, head.total, head.sha256, what),
                                  f"stage {link.stage} on {link.fellow}", self._compute.run)
        return head.sha256

    async def lend_moments(self, r: Replica) -> bool:
        """Replica ``r``, placed again, takes each stage's optimizer moments from the same
        stage of a training replica, so its stages, built anew, start with gradient
        statistics rather than none (``training.TrainStage.moments``; in bf16, about
        the bytes of the global parameters it takes next). Where no replica trains, or
        the lender fails, ``r`` starts fresh and ramps its learning rate. False (``r``
        paused) when a stage of ``r`` fails."""
        driver, job = self._driver, self._driver.job
        timeout_s = driver.training.timings.step_timeout_s
        lender = next((x for x in driver.active if x.running and not x.joining
                       and [k.stage for k in x.links] == [k.stage for k in r.links]), None)
        if lender is None:
            return True
        for theirs, ours in zip(lender.links, r.links):
            # ``gather_state`` makes the directory when it checks the room there
            path = driver.training.copies.incoming / f"{job.job_id}.lent-{ours.stage}.pt"
            try:
                try:
                    async with lender.lock:
                        if lender.paused:  # lost while its step ended
                            return True
                        with trio.fail_after(timeout_s):
                            digest = await self.gather_state(theirs, path, MomentsAsk())
                except (SwarmError, trio.TooSlowError) as exc:
                    # its own task meets a broken stream at its next command and pauses
                    # it; the lender's fate is not this replica's
                    log.info("job %s: %s lent no moments: %s", job.job_id, lender.name, exc)
                    return True
                size = path.stat().st_size
                try:
                    with trio.fail_after(timeout_s):
                        await ours.send(MomentsLoadHead(size, digest))
                        assert ours.stream is not None
                        await send_state_file(ours.stream, path, self._compute.run)
                        await ours.receive(Ack)
                except (SwarmError, trio.TooSlowError) as exc:
                    await driver.pause(r, exc)
                    return False
                job.bytes_sent += 2 * size  # from the lender, and on to ``r``
            finally:
                path.unlink(missing_ok=True)
        log.info("job %s: %s was lent the moments of %s", job.job_id, r.name, lender.name)
        return True

    async def resume(self) -> None:
        """Every stage, keeper and data stream back where the latest checkpoint left: on
        the checkpoint's own cut, or re-sharded onto the cut the swarm gives now."""
        driver, job = self._driver, self._driver.job
        store = self.store
        if store is None:
            raise ConfigError("the job names no checkpoint.dir to resume from")
        step = await driver.training.copies.restore(job.job_id, store)
        if step is None:
            raise ConfigError(f"no complete checkpoint of {job.job_id} in "
                              f"{store.directory} or on any connected fellow")
        meta = CheckpointMeta.of_manifest(store.manifest(step))
        if not meta.same_training(driver.cfg):
            raise ConfigError("the checkpoint was written by a different job.json; resume "
                              "with the job it was trained with")
        cut = job.placement[0].cut
        if meta.replicas != len(driver.replicas):
            raise PlacementError(
                f"the checkpoint was trained as {meta.replicas} replicas; the swarm now "
                f"gives {len(driver.replicas)} (resume when the cards hold as many)")
        source = store
        if list(meta.cut) != cut:
            log.info("job %s: checkpoint %d was cut at %s, the swarm now cuts at %s: "
                     "re-sharding it", job.job_id, step, list(meta.cut), cut)
            runtime = driver.runtime
            source = await self._compute.run(lambda: runtime.reshard(store, step, cut))
        try:
            await self._load_from(source, step)
        finally:
            if source is not store:
                shutil.rmtree(source.directory, ignore_errors=True)

    async def _load_from(self, store: CheckpointStore, step: int) -> None:
        driver, job = self._driver, self._driver.job
        manifest = store.manifest(step)
        meta, digests = CheckpointMeta.of_manifest(manifest), shard_digests(manifest)
        for r in driver.replicas:
            for link in r.links:
                name = f"{r.name}.stage-{link.stage}"
                # checkpoints written before the positions moved to the manifest keep
                # them in each shard
                at = meta.positions.get(name) or StagePosition.from_doc(store.read(step, name))
                r.stream.position = at.data_position
                r.steps = at.pipeline_steps
                r.samples_unsent = at.samples_unsent
                r.steps_unsent = at.steps_unsent
                # the stages come back with their local steps: what no delta carries
                # yet began that many samples back
                r.kept_position = max(0, r.stream.position - r.samples_unsent)
                r.version = r.rounds_done = at.version
            if r.paused:
                continue  # placed again later, it takes the keepers' global state then
            try:
                await self._load_replica(store, step, r, digests)
            except SwarmError as exc:
                # a stage whose stream fails while the job resumes (its fellow left, or
                # it was placed again meanwhile) loses its replica, not the job: the
                # driver places that replica again, as after any loss
                log.info("job %s: %s not resumed from checkpoint %d", job.job_id, r.name,
                         step)
                await driver.pause(r, exc)
        for s, keeper in enumerate(driver.keepers):
            # a keeper's shard is its state_dict, as written above
            state = cast(KeeperState, store.read(step, f"keeper.stage-{s}"))
            keeper.load_state_dict(state, float(step))
        for r in driver.replicas:  # paused when it was written: it stood in for them
            stood_in = meta.positions.get(f"{r.name}.stage-0")
            if stood_in is not None and stood_in.global_state:
                r.kept_position = r.stream.position
                await self._global.put(r)
        job.step, job.samples, job.bytes_sent = meta.step, meta.samples, meta.bytes_sent
        job.losses = list(meta.losses)
        job.loss = job.losses[-1] if job.losses else None

    async def _load_replica(self, store: CheckpointStore, step: int, r: Replica,
                            digests: dict[str, str]) -> None:
        """Every stage of replica ``r`` takes its state of checkpoint ``step``."""
        for link in r.links:
            name = f"{r.name}.stage-{link.stage}"
            path = store.step_dir(step) / f"{name}.pt"
            await link.send(StateLoadHead(path.stat().st_size, digests[name]))
            assert link.stream is not None
            await send_state_file(link.stream, path, self._compute.run)
            await link.receive(Ack)
        await self._global.copy_tied(r)


# --- copies of checkpoint shards on fellows ---------------------------------------------------


class TrainCopies:
    """This fellow's copies of checkpoint shards (holder side) and the leader's side:
    spread a checkpoint, fetch one back."""

    def __init__(self, agent: SwarmNode, leadership: Leadership) -> None:
        self.agent = agent
        self.leadership = leadership
        self._root: Path | None = None
        self.evicted = 0  # steps dropped to make room, since start
        self.refused_full = 0  # copies refused for want of room, since start
        # leader side: fellows that refused a copy for want of room -> when (trio time);
        # left out of the next placements while others can hold the copies
        self.full_at: dict[str, float] = {}
        agent.on_stream(TrainShard, self._on_shard)
        agent.on_stream(TrainFetch, self._on_fetch)

    @property
    def root(self) -> Path:
        if self._root is None:
            self._root = self.agent.state_dir("checkpoint-copies")
        return self._root

    @property
    def incoming(self) -> Path:
        """Where a stage's state lands before it is loaded (no job id starts with a dot)."""
        return self.root / ".incoming"

    @property
    def _cap(self) -> int:
        return self.agent.config.transport.max_shard_bytes

    def step_dir(self, job_id: str, step: int) -> Path:
        return self.root / check_part(job_id) / f"step-{step:08d}"

    def held(self, job_id: str) -> dict[int, list[str]]:
        """The steps of ``job_id`` this fellow holds whole (manifest present) and the
        shards it holds of each."""
        out: dict[int, list[str]] = {}
        for d in sorted((self.root / check_part(job_id)).glob("step-*")):
            if (d / MANIFEST).is_file() and d.name[5:].isdigit():
                out[int(d.name[5:])] = sorted(p.name[:-3] for p in d.glob("*.pt"))
        return out

    # --- holder side ----------------------------------------------------------------------

    async def _on_shard(self, first: TrainShard, stream: SecureStream) -> None:
        try:  # only the leader spreads checkpoints: no one else fills this disk
            self.leadership.from_leader(stream.peer_node_id, "a checkpoint shard")
            directory = self.step_dir(first.job_id, first.step)
            filename = _filename(first.name)
            cap = MAX_MANIFEST_BYTES if first.name == MANIFEST else self._cap
            if first.total > cap:
                raise ConfigError(f"shard {first.name} of {first.total:,} bytes is over the "
                                  f"{cap:,} bytes this fellow accepts")
            try:
                self.make_room(first.job_id, first.step, first.total)
            except ConfigError as exc:
                self.refused_full += 1
                self.agent.counters.refuse("checkpoint-copies-full")
                log.warning("refused shard %s of checkpoint %d of %s: %s", first.name,
                            first.step, first.job_id, exc)
                raise
            directory.mkdir(parents=True, exist_ok=True)
            await receive_shard_file(first, stream, directory / filename, cap,
                                     self.agent.compute.run)
            if first.name == MANIFEST:
                self._prune(first.job_id)
        except (SwarmError, OSError) as exc:
            self._count(exc)
            why = str(exc) if isinstance(exc, SwarmError) else f"cannot write: {exc.strerror}"
            await send_best_effort(stream, TrainError(0, self.agent.name, why[:500]))
            return
        await send_best_effort(stream, Ack(first.step))

    def _count(self, exc: BaseException) -> None:
        """A name that may not become a path is a hostile sender's: counted in status."""
        if isinstance(exc, UnsafeName):
            self.agent.counters.drop("unsafe-name")

    async def _on_fetch(self, msg: TrainFetch, stream: SecureStream) -> None:
        try:
            step = msg.step
            if step == 0:
                steps = self.held(msg.job_id)
                if not steps:
                    raise ConfigError(f"{self.agent.name} holds no checkpoint of {msg.job_id}")
                step = max(steps)
            path = self.step_dir(msg.job_id, step) / _filename(msg.name)
            if not path.is_file():
                raise ConfigError(f"{self.agent.name} holds no {msg.name} of step {step}")
            digest = await self.agent.compute.run(lambda: file_sha256(path))
        except (SwarmError, OSError) as exc:
            self._count(exc)
            why = str(exc) if isinstance(exc, SwarmError) else f"cannot read: {exc.strerror}"
            await send_best_effort(stream, TrainError(0, self.agent.name, why[:500]))
            return
        await send_shard_file(stream, msg.job_id, step, msg.name, path, digest,
                              self.agent.compute.run)

    def make_room(self, job_id: str, step: int, nbytes: int) -> None:
        """Drop whole steps, the least recently written first, until ``nbytes`` more fit
        ``storage.checkpoint_copies_bytes``; never the step being written nor the newest
        whole step of its job (what a resume of the live job would need). ConfigError when
        that is not enough."""
        cap = cap_bytes("checkpoint-copies", self.root, self.agent.config.storage)
        keep = {self.step_dir(job_id, step)}
        newest = max(self.held(job_id), default=None)
        if newest is not None:
            keep.add(self.step_dir(job_id, newest))
        steps = []
        held = 0
        for directory in self.root.glob("*/step-*") if self.root.is_dir() else ():
            files = [f.stat() for f in directory.iterdir() if f.is_file()]
            size = sum(f.st_size for f in files)
            held += size
            steps.append((max((f.st_mtime_ns for f in files), default=0), str(directory),
                          size))
        for _, name, size in sorted(steps):
            if held + nbytes <= cap:
                break
            if Path(name) in keep:
                continue
            shutil.rmtree(name, ignore_errors=True)
            held -= size
            self.evicted += 1
        if held + nbytes > cap:
            raise ConfigError(f"{NO_ROOM}: they hold {held:,} bytes; {nbytes:,} more would "
                              f"pass the {cap:,} bytes this fellow keeps "
                              "(storage.checkpoint_copies_bytes)")

    def _prune(self, job_id: str) -> None:
        for step in sorted(self.held(job_id))[:-KEEP_STEPS]:
            shutil.rmtree(self.step_dir(job_id, step), ignore_errors=True)

    # --- leader side ----------------------------------------------------------------------

    def _fellows(self) -> dict[str, str]:
        """Connected fellows other than this one: name -> address."""
        membership = self.agent.membership
        return {m.name: m.addr for m in (membership.members() if membership else ())
                if m.state == "alive" and m.node_id != self.agent.node_id}

    async def spread(self, job_id: str, step: int, directory: Path,
                     copies: int) -> dict[str, list[str]]:
        """Copy checkpoint ``step`` (written in ``directory``) to ``copies`` fellows per
        shard; which fellows hold each shard (an empty list where no copy landed)."""
        manifest_path = directory / MANIFEST
        manifest_sha = file_sha256(manifest_path)
        digests = shard_digests(json.loads(manifest_path.read_bytes()))
        names = sorted(digests)
        fellows = self._fellows()
        holders = shard_holders(names, self._with_room(sorted(fellows), copies), copies)
        landed: dict[str, list[str]] = {name: [] for name in names}

        async def one(fellow: str) -> None:
            mine = [n for n in names if fellow in holders[n]]
            try:
                for name in mine:
                    await self._push(fellows[fellow], job_id, step, name,
                                     directory / f"{name}.pt", digests[name])
                    landed[name].append(fellow)
                await self._push(fellows[fellow], job_id, step, MANIFEST, manifest_path,
                                 manifest_sha)
            except (SwarmError, OSError, trio.TooSlowError) as exc:
                if NO_ROOM in str(exc):
                    self.full_at[fellow] = trio.current_time()
                log.warning("checkpoint %d of %s: copy to %s failed: %s", step, job_id,
                            fellow, exc)
                for name in mine:
                    if fellow in landed[name]:
                        landed[name].remove(fellow)

        async with trio.open_nursery() as nursery:
            for fellow in sorted({f for h in holders.values() for f in h}):
                nursery.start_soon(one, fellow)
        return {name: sorted(landed[name]) for name in names}

    def _with_room(self, fellows: list[str], copies: int) -> list[str]:
        """``fellows`` less those that refused a copy for want of room in the last
        ``FULL_FORGET_S``, unless that leaves fewer than ``copies``: a full disk is
        learnt from its refusal (its one line), then passed over."""
        now = trio.current_time()
        self.full_at = {f: at for f, at in self.full_at.items() if now - at < FULL_FORGET_S}
        roomy = [f for f in fellows if f not in self.full_at]
        return roomy if len(roomy) >= copies else fellows

    async def _push(self, addr: str, job_id: str, step: int, name: str, path: Path,
                    sha256: str) -> None:
        with trio.fail_after(_copy_timeout_s(path.stat().st_size)):
            async with await self.agent.open_secure(addr) as stream:
                await send_shard_file(stream, job_id, step, name, path, sha256,
                                      self.agent.compute.run)
                await receive_answer(stream, Ack, f"the holder at {addr}", name_stage=False)

    async def _fetch_one(self, fellow: str, addr: str, ask: TrainFetch, dest: Path,
                         cap: int, sha256: str | None) -> int | None:
        """``ask`` of one fellow into ``dest``: the step it sent, or None."""
        try:
            async with await self.agent.open_secure(addr) as stream:
                with trio.fail_after(COPY_TIMEOUT_S):
                    await send_message(stream, ask)
                    first = await receive_answer(stream, TrainShard, fellow,
                                                 name_stage=False)
                if (first.name != ask.name or (ask.step and first.step != ask.step)
                        or (sha256 is not None and first.sha256 != sha256)):
                    raise ConfigError(f"{fellow} holds another {ask.name}")
                with trio.fail_after(_copy_timeout_s(first.total)):
                    await receive_shard_file(first, stream, dest, cap,
                                             self.agent.compute.run)
                return first.step
        except (SwarmError, OSError, trio.TooSlowError) as exc:
            log.info("fetching %s of %s from %s: %s", ask.name, ask.job_id, fellow, exc)
            return None

    async def fetch_manifest(self, job_id: str, scratch: Path) -> tuple[int, bytes] | None:
        """The newest manifest of ``job_id`` any connected fellow holds: (step, bytes)."""
        best: tuple[int, bytes] | None = None
        dest = scratch / f".{MANIFEST}.fetched"
        for fellow, addr in sorted(self._fellows().items()):
            step = await self._fetch_one(fellow, addr, TrainFetch(job_id, 0, MANIFEST), dest,
                                         MAX_MANIFEST_BYTES, None)
            if step is not None and (best is None or step > best[0]):
                best = (step, dest.read_bytes())
            dest.unlink(missing_ok=True)
        return best

    async def fetch_shard(self, job_id: str, step: int, name: str, dest: Path,
                          sha256: str) -> bool:
        """Shard ``name`` of step ``step`` with SHA-256 ``sha256`` from the first connected
        fellow that has it, into ``dest``; whether one had it."""
        for fellow, addr in sorted(self._fellows().items()):
            if await self._fetch_one(fellow, addr, TrainFetch(job_id, step, name), dest,
                                     self._cap, sha256) is not None:
                return True
        return False

    async def restore(self, job_id: str, store: CheckpointStore) -> int | None:
        """Make the newest checkpoint whole in ``store``: the leader's own copy where it
        is sound, shards fetched from fellows where it is not; its step (None: none)."""
        step = store.latest()
        store.directory.mkdir(parents=True, exist_ok=True)
        remote = await self.fetch_manifest(job_id, store.directory)
        if remote is not None and (step is None or remote[0] > step):
            step = remote[0]
            store.step_dir(step).mkdir(parents=True, exist_ok=True)
            manifest_bytes = remote[1]
        elif step is None:
            return None
        else:
            manifest_bytes = (store.step_dir(step) / MANIFEST).read_bytes()
        try:
            shards = shard_digests(json.loads(manifest_bytes))
            names = sorted(shards)
            for name in names:
                check_part(name)
                check_hash(shards[name])
        except (ValueError, KeyError, TypeError, SwarmError) as exc:
            raise ConfigError(f"checkpoint step {step} of {job_id}: its manifest is "
                              f"damaged ({exc})") from exc
        directory = store.step_dir(step)
        for name in names:
            path = directory / f"{name}.pt"
            if path.is_file() and await self.agent.compute.run(
                    partial(file_sha256, path)) == shards[name]:
                continue
            if not await self.fetch_shard(job_id, step, name, path, shards[name]):
                raise ConfigError(f"checkpoint step {step} of {job_id}: shard {name} is gone "
                                  "from the leader and from every connected fellow")
            log.info("checkpoint %d of %s: shard %s fetched from a fellow", step, job_id, name)
        atomic_write_bytes(directory / MANIFEST, manifest_bytes)
        atomic_write_bytes(store.directory / LATEST, directory.name.encode())
        return step


def trim_other_jobs(root: Path, live: Path, cap: int) -> list[str]:
    """Whole steps of the jobs under ``root`` other than ``live`` (a job's directory),
    least recently written first, deleted until the store holds at most ``cap`` bytes;
    ``job/step-N`` of each one deleted."""
    steps = []
    held = 0
    for directory in root.glob("*/step-*"):
        try:
            files = [f.stat() for f in directory.iterdir() if f.is_file()]
        except OSError:
            continue
        size = sum(f.st_size for f in files)
        held += size
        if directory.parent != live:
            steps.append((max((f.st_mtime_ns for f in files), default=0), directory, size))
    dropped = []
    for _, directory, size in sorted(steps):
        if held <= cap:
            break
        shutil.rmtree(directory, ignore_errors=True)
        held -= size
        dropped.append(f"{directory.parent.name}/{directory.name}")
        if not any(directory.parent.glob("step-*")):  # its job's last: the job goes too
            shutil.rmtree(directory.parent, ignore_errors=True)
    return dropped


NO_ROOM = "no room for checkpoint copies"  # the holder's refusal, read by the leader
FULL_FORGET_S = 600.0  # a full holder is passed over this long, then asked again


def _filename(name: str) -> str:
    """The file a shard name from the network is kept in (the name checked first)."""
    return MANIFEST if name == MANIFEST else f"{check_part(name)}.pt"


def _copy_timeout_s(total_bytes: int) -> float:
    """The most one copy may take: ``COPY_TIMEOUT_S``, and more for a big shard (at
    ``COPY_FLOOR_BYTES_PER_S`` at least)."""
    return COPY_TIMEOUT_S + total_bytes / COPY_FLOOR_BYTES_PER_S


__all__ = ["COPY_TIMEOUT_S", "KEEP_STEPS", "CheckpointKeeper", "TrainCopies"]
