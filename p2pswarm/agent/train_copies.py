"""Checkpoint copies on fellows, so that no checkpoint is lost with one disk.

Theory of operation. The leader writes every checkpoint into its ``CheckpointStore``
(atomic files, manifest last), then spreads it: each shard goes to the ``copies``
fellows ``shard_holders`` picks among the connected fellows other than the leader
(rendezvous hashing: stable as unrelated fellows come and go), and the manifest to
every holder, last. A holder writes each shard atomically under
``<home>/checkpoint-copies/<job>/step-NNNNNNNN/`` after checking its SHA-256, and keeps
the newest ``KEEP_STEPS`` steps it has a manifest for. With the leader's copy and two
more on distinct fellows, losing any one fellow (its disk included) loses no shard.

Resuming, the leader reads its own copy; a shard missing or damaged there (or the whole
checkpoint directory gone) is fetched from whichever connected fellow holds it, checked
against the manifest and written back into the leader's store before training goes on.
"""

from __future__ import annotations

import hashlib
import logging
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from p2pswarm import wire
from p2pswarm.errors import ConfigError, RemoteProtocolError, SwarmError, TransportError
from p2pswarm.wire.training import SHARD_CHUNK_BYTES, TrainCtl, TrainError, TrainFetch, \
    TrainShard

if TYPE_CHECKING:
    from p2pswarm.agent.agent import Agent
    from p2pswarm.training.checkpoint import CheckpointStore
    from p2pswarm.transport.secure import SecureStream

log = logging.getLogger("p2pswarm.training")

MANIFEST = "manifest.json"
KEEP_STEPS = 3  # newest complete steps a holder keeps per job
COPY_TIMEOUT_S = 120.0  # the most one shard's copy may take


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
        from p2pswarm.training.checkpoint import atomic_write_bytes

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
            await _say(stream, TrainError(0, self.agent.name, why[:500]))
            return
        await _say(stream, TrainCtl("ok", first.step))

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
            await _say(stream, TrainError(0, self.agent.name, why[:500]))
            return
        await _send_shard(stream, msg.job_id, step, msg.name, data)

    def _prune(self, job_id: str) -> None:
        import shutil

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
        import json

        from p2pswarm.training.checkpoint import shard_holders

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
                await _receive(stream, TrainCtl, f"the holder at {addr}")

    async def fetch(self, job_id: str, step: int, name: str) -> tuple[int, bytes] | None:
        """Shard ``name`` of step ``step`` (0: each fellow's newest; the highest wins) from
        the connected fellows: (step, bytes), or None when no fellow has it."""
        found: list[tuple[int, bytes]] = []
        for fellow, addr in sorted(self._fellows().items()):
            try:
                with trio.fail_after(COPY_TIMEOUT_S):
                    async with await self.agent.open_secure(addr) as stream:
                        await stream.send_frame(wire.encode(TrainFetch(job_id, step, name)))
                        first = await _receive(stream, TrainShard, fellow)
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
        import json

        from p2pswarm.training.checkpoint import LATEST, atomic_write_bytes

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
        await stream.send_frame(wire.encode(TrainShard(job_id, step, name, digest, offset,
                                                       len(data), chunk)))
        offset += len(chunk)
        if offset >= len(data):
            return


async def _receive(stream: SecureStream, expected: type, who: str) -> Any:
    frame = await stream.receive_frame()
    (msg,) = wire.decode(frame, max_bytes=len(frame) + 1)
    if isinstance(msg, TrainError):
        raise TransportError(f"{msg.fellow}: {msg.reason}")
    if not isinstance(msg, expected):
        raise RemoteProtocolError("unexpected-message",
                                  f"{who} sent {type(msg).__name__}, not {expected.__name__}")
    return msg


async def _receive_rest(first: TrainShard, stream: SecureStream) -> bytes:
    """The whole shard whose first frame is ``first``, checked against its digest."""
    parts, have = [first.data], len(first.data)
    if first.offset != 0:
        raise RemoteProtocolError("bad-shard", "a shard must start at offset 0")
    while have < first.total:
        msg = await _receive(stream, TrainShard, "the sender")
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


async def _say(stream: SecureStream, msg: Any) -> None:
    try:
        await stream.send_frame(wire.encode(msg))
    except (SwarmError, trio.BrokenResourceError, trio.ClosedResourceError):
        pass


__all__ = ["KEEP_STEPS", "TrainCopies"]
