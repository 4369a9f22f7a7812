"""Checkpoints of a job: gathered by the driver, stored by the leader, copied to fellows.

Every ``checkpoint.interval_steps`` the driver gathers every stage's shard (parameters,
optimizer, sync state, as ``State``) with the replicas' data positions and the keepers'
state into the leader's ``CheckpointStore`` (atomic files, manifest last), then spreads
it: each shard goes to the ``copies`` fellows ``shard_holders`` picks among the connected
fellows other than the leader (rendezvous hashing: stable as unrelated fellows come and
go), and the manifest to every holder, last. A holder writes each shard atomically under
``<home>/checkpoint-copies/<job>/step-NNNNNNNN/`` after checking its SHA-256, and keeps
the newest ``KEEP_STEPS`` steps it has a manifest for. With the leader's copy and two
more on distinct fellows, losing any one fellow (its disk included) loses no shard.

Resuming, the leader reads its own copy; a shard missing or damaged there (or the whole
checkpoint directory gone) is fetched from whichever connected fellow holds it, checked
against the manifest and written back into the leader's store; every stage then loads
its shard (``StateLoad``) and training goes on with the same loss trajectory.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from p2pswarm.agent.streams import send_best_effort, send_message
from p2pswarm.agent.training.links import receive_answer
from p2pswarm.errors import ConfigError, PlacementError, RemoteProtocolError, SwarmError
from p2pswarm.training.checkpoint_files import (
    LATEST,
    MANIFEST,
    atomic_write_bytes,
    shard_holders,
)
from p2pswarm.wire.training import (
    SHARD_CHUNK_BYTES,
    Ack,
    State,
    StateAsk,
    StateLoad,
    TrainError,
    TrainFetch,
    TrainShard,
)

if TYPE_CHECKING:
    from p2pswarm.agent.agent import Agent
    from p2pswarm.agent.training import Training
    from p2pswarm.agent.training.driver import Replica
    from p2pswarm.agent.training.jobs import Job
    from p2pswarm.agent.training.runtime import StageKeeper, TrainRuntime
    from p2pswarm.training.checkpoint import CheckpointStore
    from p2pswarm.training.job import JobConfig
    from p2pswarm.transport.secure import SecureStream

log = logging.getLogger("p2pswarm.training")

KEEP_STEPS = 3  # newest complete steps a holder keeps per job
COPY_TIMEOUT_S = 120.0  # the most one shard's copy may take


def same_training(job: dict[str, Any]) -> dict[str, Any]:
    """What of a job.json must match its checkpoint's: all but where checkpoints live."""
    return {k: v for k, v in job.items() if k != "checkpoint"}


class Checkpoints:
    """The driver's checkpoints (a mixin of ``driver.Driver``, which holds the state)."""

    training: Training
    runtime: TrainRuntime
    job: Job
    cfg: JobConfig
    replicas: list[Replica]
    keepers: list[StageKeeper]

    def init_checkpoints(self) -> None:
        self.store: CheckpointStore | None = None

    if TYPE_CHECKING:  # provided by the driver and its other rooms
        @property
        def active(self) -> list[Replica]: ...

        async def copy_tied(self, r: Replica) -> None: ...

    async def checkpoint(self) -> None:
        """Gather every shard into the store, then copy it to fellows."""
        store = self.store
        assert store is not None
        if len(self.active) != len(self.replicas):
            log.info("job %s: checkpoint at step %d skipped, a replica is paused",
                     self.job.job_id, self.job.step)
            return
        shards: dict[str, dict[str, Any]] = {}
        for r in self.replicas:
            for link in r.links:
                state = self.runtime.read_shard((await link.ask(StateAsk(), State)).blob)
                shards[f"{r.name}.stage-{link.stage}"] = {
                    **state, "data_position": r.stream.position, "pipeline_steps": r.steps,
                    "samples_unsent": r.samples_unsent, "steps_unsent": r.steps_unsent}
        for s, keeper in enumerate(self.keepers):
            shards[f"keeper.stage-{s}"] = keeper.state_dict()
        cut = [link_layers[0] for link_layers in
               (s["layers"] for s in self.job.placement[0][1:])]
        meta = {"step": self.job.step, "samples": self.job.samples,
                "bytes_sent": self.job.bytes_sent, "losses": self.job.losses, "cut": cut,
                "replicas": len(self.replicas), "job": self.cfg.to_dict(),
                "job_id": self.job.job_id}
        step = self.job.step
        path = await self.training.agent.compute.run(lambda: store.write(step, shards, meta))
        self.job.checkpoint = str(path)
        self.job.checkpoint_step = self.job.step
        self.job.copies = await self.training.copies.spread(
            self.job.job_id, self.job.step, path, self.cfg.checkpoint.copies)
        thin = sorted(n for n, h in self.job.copies.items() if len(h) < self.cfg.checkpoint.copies)
        if thin:
            log.warning("job %s: checkpoint %d has fewer than %d copies on fellows of %s",
                        self.job.job_id, self.job.step, self.cfg.checkpoint.copies,
                        ", ".join(thin))

    async def resume(self) -> None:
        """Every stage, keeper and data stream back where the latest checkpoint left."""
        store = self.store
        if store is None:
            raise ConfigError("the job names no checkpoint.dir to resume from")
        step = await self.training.copies.restore(self.job.job_id, store)
        if step is None:
            raise ConfigError(f"no complete checkpoint of {self.job.job_id} in "
                              f"{self.cfg.checkpoint.dir} or on any connected fellow")
        meta = store.manifest(step)["meta"]
        if same_training(meta["job"]) != same_training(self.cfg.to_dict()):
            raise ConfigError("the checkpoint was written by a different job.json; resume "
                              "with the job it was trained with")
        cut = [s["layers"][0] for s in self.job.placement[0][1:]]
        if list(meta["cut"]) != cut or int(meta["replicas"]) != len(self.replicas):
            raise PlacementError(
                f"the checkpoint was trained as {meta['replicas']} replicas cut at "
                f"{meta['cut']}; the swarm now gives {len(self.replicas)} cut at {cut}")
        for r in self.replicas:
            for link in r.links:
                state = store.read(step, f"{r.name}.stage-{link.stage}")
                await link.ask(StateLoad(self.runtime.shard_bytes(
                    {"stage": state["stage"], "sync": state["sync"]})), Ack)
                r.stream.position = int(state["data_position"])
                r.version = r.rounds_done = int(state["sync"]["version"])
                r.steps = int(state["pipeline_steps"])
                r.samples_unsent = int(state["samples_unsent"])
                r.steps_unsent = int(state["steps_unsent"])
            await self.copy_tied(r)
        for s, keeper in enumerate(self.keepers):
            keeper.load_state_dict(store.read(step, f"keeper.stage-{s}"), float(step))
        self.job.step = int(meta["step"])
        self.job.samples = int(meta["samples"])
        self.job.bytes_sent = int(meta["bytes_sent"])
        self.job.losses = [float(x) for x in meta["losses"]]
        self.job.loss = self.job.losses[-1] if self.job.losses else None


# --- copies of checkpoint shards on fellows ---------------------------------------------------


class TrainCopies:
    """This fellow's copies of checkpoint shards (holder side) and the leader's side:
    spread a checkpoint, fetch one back."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self._root: Path | None = None
        agent.on_stream(TrainShard, self._on_shard)
        agent.on_stream(TrainFetch, self._on_fetch)

    @property
    def root(self) -> Path:
        if self._root is None:
            if self.agent.home is not None:
                self._root = self.agent.home / "checkpoint-copies"
            else:  # an agent without a state directory (a bare simulation)
                self._root = Path(tempfile.mkdtemp(prefix="p2pswarm-copies-"))
        return self._root

    def step_dir(self, job_id: str, step: int) -> Path:
        _check_part(job_id)
        return self.root / job_id / f"step-{step:08d}"

    def held(self, job_id: str) -> dict[int, list[str]]:
        """The steps of ``job_id`` this fellow holds whole (manifest present) and the
        shards it holds of each."""
        _check_part(job_id)
        out: dict[int, list[str]] = {}
        for d in sorted((self.root / job_id).glob("step-*")):
            if (d / MANIFEST).is_file() and d.name[5:].isdigit():
                out[int(d.name[5:])] = sorted(p.name[:-3] for p in d.glob("*.pt"))
        return out

    # --- holder side ----------------------------------------------------------------------

    async def _on_shard(self, first: TrainShard, stream: SecureStream) -> None:
        try:
            data = await _receive_rest(first, stream)
            directory = self.step_dir(first.job_id, first.step)
            _check_part(first.name)
            directory.mkdir(parents=True, exist_ok=True)
            filename = MANIFEST if first.name == MANIFEST else f"{first.name}.pt"
            atomic_write_bytes(directory / filename, data)
            if first.name == MANIFEST:
                self._prune(first.job_id)
        except (SwarmError, OSError) as exc:
            why = str(exc) if isinstance(exc, SwarmError) else f"cannot write: {exc.strerror}"
            await send_best_effort(stream, TrainError(0, self.agent.name, why[:500]))
            return
        await send_best_effort(stream, Ack(first.step))

    async def _on_fetch(self, msg: TrainFetch, stream: SecureStream) -> None:
        try:
            step = msg.step
            if step == 0:
                steps = self.held(msg.job_id)
                if not steps:
                    raise ConfigError(f"{self.agent.name} holds no checkpoint of {msg.job_id}")
                step = max(steps)
            _check_part(msg.name)
            filename = MANIFEST if msg.name == MANIFEST else f"{msg.name}.pt"
            path = self.step_dir(msg.job_id, step) / filename
            if not path.is_file():
                raise ConfigError(f"{self.agent.name} holds no {msg.name} of step {step}")
            data = path.read_bytes()
        except (SwarmError, OSError) as exc:
            why = str(exc) if isinstance(exc, SwarmError) else f"cannot read: {exc.strerror}"
            await send_best_effort(stream, TrainError(0, self.agent.name, why[:500]))
            return
        await _send_shard(stream, msg.job_id, step, msg.name, data)

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
        manifest_bytes = (directory / MANIFEST).read_bytes()
        names = sorted(json.loads(manifest_bytes)["shards"])
        fellows = self._fellows()
        holders = shard_holders(names, sorted(fellows), copies)
        landed: dict[str, list[str]] = {name: [] for name in names}

        async def one(fellow: str) -> None:
            mine = [n for n in names if fellow in holders[n]]
            try:
                for name in mine:
                    data = (directory / f"{name}.pt").read_bytes()
                    await self._push(fellows[fellow], job_id, step, name, data)
                    landed[name].append(fellow)
                await self._push(fellows[fellow], job_id, step, MANIFEST, manifest_bytes)
            except (SwarmError, OSError, trio.TooSlowError) as exc:
                log.warning("checkpoint %d of %s: copy to %s failed: %s", step, job_id,
                            fellow, exc)
                for name in mine:
                    if fellow in landed[name]:
                        landed[name].remove(fellow)

        async with trio.open_nursery() as nursery:
            for fellow in sorted({f for h in holders.values() for f in h}):
                nursery.start_soon(one, fellow)
        return {name: sorted(landed[name]) for name in names}

    async def _push(self, addr: str, job_id: str, step: int, name: str, data: bytes) -> None:
        with trio.fail_after(COPY_TIMEOUT_S):
            async with await self.agent.open_secure(addr) as stream:
                await _send_shard(stream, job_id, step, name, data)
                await receive_answer(stream, Ack, f"the holder at {addr}", name_stage=False)

    async def fetch(self, job_id: str, step: int, name: str) -> tuple[int, bytes] | None:
        """Shard ``name`` of step ``step`` (0: each fellow's newest; the highest wins) from
        the connected fellows: (step, bytes), or None when no fellow has it."""
        found: list[tuple[int, bytes]] = []
        for fellow, addr in sorted(self._fellows().items()):
            try:
                with trio.fail_after(COPY_TIMEOUT_S):
                    async with await self.agent.open_secure(addr) as stream:
                        await send_message(stream, TrainFetch(job_id, step, name))
                        first = await receive_answer(stream, TrainShard, fellow,
                                                     name_stage=False)
                        found.append((first.step, await _receive_rest(first, stream)))
            except (SwarmError, trio.TooSlowError) as exc:
                log.info("fetching %s of %s from %s: %s", name, job_id, fellow, exc)
                continue
            if step != 0:
                break
        return max(found, key=lambda f: f[0]) if found else None

    async def restore(self, job_id: str, store: CheckpointStore) -> int | None:
        """Make the newest checkpoint whole in ``store``: the leader's own copy where it
        is sound, shards fetched from fellows where it is not; its step (None: none)."""
        step = store.latest()
        remote = await self.fetch(job_id, 0, MANIFEST)
        if remote is not None and (step is None or remote[0] > step):
            step = remote[0]
            store.step_dir(step).mkdir(parents=True, exist_ok=True)
            manifest_bytes = remote[1]
        elif step is None:
            return None
        else:
            manifest_bytes = (store.step_dir(step) / MANIFEST).read_bytes()
        shards = json.loads(manifest_bytes)["shards"]
        directory = store.step_dir(step)
        for name in sorted(shards):
            path = directory / f"{name}.pt"
            if path.is_file() and hashlib.sha256(path.read_bytes()).hexdigest() == shards[name]:
                continue
            got = await self.fetch(job_id, step, name)
            if got is None or hashlib.sha256(got[1]).hexdigest() != shards[name]:
                raise ConfigError(f"checkpoint step {step} of {job_id}: shard {name} is gone "
                                  "from the leader and from every connected fellow")
            atomic_write_bytes(path, got[1])
            log.info("checkpoint %d of %s: shard %s fetched from a fellow", step, job_id, name)
        atomic_write_bytes(directory / MANIFEST, manifest_bytes)
        atomic_write_bytes(store.directory / LATEST, directory.name.encode())
        return step


def _check_part(name: str) -> None:
    if not name or "/" in name or "\\" in name or name.startswith(".") or "\0" in name:
        raise ConfigError(f"bad checkpoint name {name!r}")


async def _send_shard(stream: SecureStream, job_id: str, step: int, name: str,
                      data: bytes) -> None:
    digest = hashlib.sha256(data).hexdigest()
    offset = 0
    while True:
        chunk = data[offset:offset + SHARD_CHUNK_BYTES]
        await send_message(stream, TrainShard(job_id, step, name, digest, offset, len(data),
                                              chunk))
        offset += len(chunk)
        if offset >= len(data):
            return


async def _receive_rest(first: TrainShard, stream: SecureStream) -> bytes:
    """The whole shard whose first frame is ``first``, checked against its digest."""
    parts, have = [first.data], len(first.data)
    if first.offset != 0:
        raise RemoteProtocolError("bad-shard", "a shard must start at offset 0")
    while have < first.total:
        msg = await receive_answer(stream, TrainShard, "the sender", name_stage=False)
        if (msg.name, msg.step, msg.offset, msg.total) != (first.name, first.step, have,
                                                           first.total) or not msg.data:
            raise RemoteProtocolError("bad-shard", f"shard {first.name}: frame out of order")
        parts.append(msg.data)
        have += len(msg.data)
    data = b"".join(parts)
    if have != first.total or hashlib.sha256(data).hexdigest() != first.sha256:
        raise RemoteProtocolError("bad-shard", f"shard {first.name} does not match its "
                                  "SHA-256 (damaged in transit)")
    return data


__all__ = ["COPY_TIMEOUT_S", "KEEP_STEPS", "Checkpoints", "TrainCopies", "same_training"]
