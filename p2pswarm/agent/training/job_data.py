"""The data a job trains on travels with the job, named by its SHA-256, like weights.

The fellow where a job is submitted (the CLI's own agent, or the agent behind the HTTP
API or MCP) reads the text and token files the job names, on its own disk: paths the
CLI already resolved against the job file's directory; a relative path that reaches an
agent has no job file to resolve against and is refused. Each file is hashed into this
fellow's store (``HOME/job-data/<sha256>``) and the job's ``data.files`` and
``data.token_files`` name it ``sha256:<hex>`` from then on. The leader, and each fellow
that drives the job, fetches the files it lacks from whichever connected fellow holds
them (``DataFetch``, answered by ``DataPut`` and ``StatePart`` frames, checked as they
arrive, landing by an atomic rename only when the hash matches); a leader never reads a
data path from its own disk: a job naming one is refused.

The store is bounded: one file at most ``transport.max_job_data_bytes``, and all of them
together too, the least recently used evicted to make room, never a live job's. Nobody
pushes data unasked but the leader: a ``DataPut`` stream from any other fellow is refused
and counted (``data-put-not-leader``) before anything is evicted or written, so a fellow
cannot fill another's store and push other jobs' data out of it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from p2pswarm.agent.streams import send_best_effort, send_message
from p2pswarm.agent.training.links import receive_answer
from p2pswarm.agent.training.transfer import (
    Landing,
    check_hash,
    check_room,
    receive_state_parts,
    send_state_file,
)
from p2pswarm.disk_budget import cap_bytes
from p2pswarm.errors import ConfigError, RemoteProtocolError, SwarmError
from p2pswarm.training.job import (
    DATA_REF,
    JobConfig,
    is_data_ref,
    local_data_files,
)
from p2pswarm.wire.training import Ack, DataFetch, DataPut, TrainError

if TYPE_CHECKING:
    from p2pswarm.agent.training.ports import SwarmNode
    from p2pswarm.transport.secure import SecureStream

log = logging.getLogger("p2pswarm.training")

DATA_TIMEOUT_S = 120.0  # the most a small file's copy may take
DATA_FLOOR_BYTES_PER_S = 10e6  # a big one gets this much longer per byte


class JobData:
    """This fellow's store of job data files, and the streams that fill it."""

    def __init__(self, agent: SwarmNode, in_use: Callable[[], Iterable[str]] | None = None) -> None:
        self.agent = agent
        # the files live jobs train on (``Training`` tells): never evicted
        self.in_use: Callable[[], Iterable[str]] = in_use or (lambda: ())
        self._root: Path | None = None
        agent.on_stream(DataPut, self._on_put)
        agent.on_stream(DataFetch, self._on_fetch)

    @property
    def root(self) -> Path:
        if self._root is None:
            self._root = self.agent.state_dir("job-data")
        return self._root

    @property
    def cap(self) -> int:
        return self.agent.config.transport.max_job_data_bytes

    @property
    def store_cap(self) -> int:
        """What all the files together may hold: one job's most, cut to this store's
        share of its disk (``p2pswarm.disk_budget``)."""
        return min(self.cap, cap_bytes("job-data", self.root, self.agent.config.storage))

    def path(self, sha256: str) -> Path:
        return self.root / check_hash(sha256)

    def has(self, sha256: str) -> bool:
        return self.path(sha256).is_file()

    # --- the submitting side --------------------------------------------------------------

    async def attach(self, job: JobConfig) -> JobConfig:
        """``job`` with every data file it names on this fellow's disk read into the
        store and named by its hash instead."""
        paths = local_data_files(job.data)
        if not paths:
            return job
        relative = [p for p in paths if not Path(p).is_absolute()]
        if relative:
            raise ConfigError(f"data file {relative[0]!r} is a relative path and there is no "
                              "job file to resolve it against: give an absolute path")
        sizes = {}
        for p in paths:
            try:
                sizes[p] = os.stat(p).st_size
            except OSError as exc:
                raise ConfigError(f"cannot read data file {p}: {exc.strerror}") from exc
        if sum(sizes.values()) > self.cap:
            raise ConfigError(f"the job's data files hold {sum(sizes.values()):,} bytes, over "
                              f"the {self.cap:,} bytes a job may bring "
                              "(transport.max_job_data_bytes)")
        names = {}
        for p in paths:
            names[p] = await self.agent.compute.run(partial(self._add_file, Path(p)))
        def sent(entries: tuple[str, ...]) -> tuple[str, ...]:
            return tuple(DATA_REF + names[e] if e in names else e for e in entries)

        data = dataclasses.replace(job.data, files=sent(job.data.files),
                                   token_files=sent(job.data.token_files))
        return dataclasses.replace(job, data=data)

    def _add_file(self, src: Path) -> str:
        """Copy ``src`` into the store under its SHA-256; the hash."""
        try:
            size = src.stat().st_size
            check_room(size, self.cap, self.root, f"data file {src}")
            digest = hashlib.sha256()
            with open(src, "rb") as f:
                while block := f.read(1 << 20):
                    digest.update(block)
            sha256 = digest.hexdigest()
            if not self.has(sha256):
                self._make_room(size)
                landing = Landing(self.path(sha256), size, sha256, f"data file {src}")
                try:
                    with open(src, "rb") as f:
                        while part := f.read(1 << 20):
                            landing.add(landing.have, part)
                    landing.finish()
                finally:
                    landing.abort()
        except OSError as exc:
            raise ConfigError(f"cannot read data file {src}: {exc.strerror}") from exc
        os.utime(self.path(sha256))  # the most recently used
        return sha256

    # --- the driving side -----------------------------------------------------------------

    async def local(self, job: JobConfig) -> JobConfig:
        """``job`` with its sent data files as paths in this store (fetched from fellows
        where missing); a job naming a path on this disk is refused."""
        refuse_paths(job)
        for sha256 in sent_files_of(job):
            if not self.has(sha256) and not await self.fetch(sha256):
                raise ConfigError(f"data file {DATA_REF}{sha256} is on no connected fellow")
            os.utime(self.path(sha256))

        def here(name: str) -> str:
            return str(self.path(name[len(DATA_REF):])) if is_data_ref(name) else name

        data = dataclasses.replace(job.data, files=tuple(map(here, job.data.files)),
                                   token_files=tuple(map(here, job.data.token_files)))
        return dataclasses.replace(job, data=data)

    async def fetch(self, sha256: str) -> bool:
        """Data file ``sha256`` from the first connected fellow holding it."""
        membership = self.agent.membership
        fellows = sorted((m.name, m.addr) for m in (membership.members() if membership else ())
                         if m.state == "alive" and m.node_id != self.agent.node_id)
        for name, addr in fellows:
            try:
                async with await self.agent.open_secure(addr) as stream:
                    with trio.fail_after(DATA_TIMEOUT_S):
                        await send_message(stream, DataFetch(sha256))
                        head = await receive_answer(stream, DataPut, name, name_stage=False)
                    if head.sha256 != sha256:
                        raise ConfigError(f"{name} sent another file")
                    with trio.fail_after(DATA_TIMEOUT_S + head.total / DATA_FLOOR_BYTES_PER_S):
                        await self._receive(head, stream, name)
                    return True
            except (SwarmError, OSError, trio.TooSlowError) as exc:
                log.info("fetching data file %s from %s: %s", sha256[:12], name, exc)
        return False

    # --- the streams ----------------------------------------------------------------------

    async def _receive(self, head: DataPut, stream: SecureStream, who: str) -> None:
        what = f"data file {head.sha256[:12]}"
        if head.total > self.cap:
            raise ConfigError(f"{what} of {head.total:,} bytes is over the {self.cap:,} bytes "
                              "a job may bring (transport.max_job_data_bytes)")
        self._make_room(head.total)
        check_room(head.total, self.cap, self.root, what)
        await receive_state_parts(stream, Landing(self.path(head.sha256), head.total,
                                                  head.sha256, what), who,
                                  self.agent.compute.run)

    async def _on_put(self, msg: DataPut, stream: SecureStream) -> None:
        election = self.agent.election
        leader = election.status().leader_id if election is not None else None
        if leader is None or stream.peer_node_id != leader:
            self.agent.counters.refuse("data-put-not-leader")
            log.warning("refused job data %s from %s: only the leader sends job data",
                        msg.sha256[:12], stream.peer_node_id.hex()[:8])
            await send_best_effort(stream, TrainError(0, self.agent.name, "only the leader "
                                                      "sends job data unasked"))
            return
        try:
            await self._receive(msg, stream, "the sender")
        except (SwarmError, OSError) as exc:
            if isinstance(exc, RemoteProtocolError):  # a bad hash, a bad part: counted
                self.agent.counters.drop(exc.reason)
            why = str(exc) if isinstance(exc, SwarmError) else f"cannot write: {exc.strerror}"
            await send_best_effort(stream, TrainError(0, self.agent.name, why[:500]))
            return
        await send_best_effort(stream, Ack())

    async def _on_fetch(self, msg: DataFetch, stream: SecureStream) -> None:
        try:
            path = self.path(msg.sha256)
            if not path.is_file():
                raise ConfigError(f"{self.agent.name} holds no data file {msg.sha256[:12]}")
            size = path.stat().st_size
        except (SwarmError, OSError) as exc:
            if isinstance(exc, RemoteProtocolError):  # a bad hash, a bad part: counted
                self.agent.counters.drop(exc.reason)
            why = str(exc) if isinstance(exc, SwarmError) else f"cannot read: {exc.strerror}"
            await send_best_effort(stream, TrainError(0, self.agent.name, why[:500]))
            return
        await send_message(stream, DataPut(msg.sha256, size))
        await send_state_file(stream, path, self.agent.compute.run)

    def _make_room(self, size: int) -> None:
        """Evict the least recently used files until ``size`` more fits the store's cap,
        never one a live job trains on; ConfigError when that is not enough."""
        files = sorted((p for p in self.root.iterdir() if p.is_file()
                        and not p.name.startswith(".")), key=lambda p: p.stat().st_mtime)
        held = sum(p.stat().st_size for p in files)
        cap = self.store_cap
        keep = set(self.in_use()) if held + size > cap else set()
        for p in files:
            if held + size <= cap:
                break
            if p.name in keep:
                continue
            held -= p.stat().st_size
            p.unlink(missing_ok=True)
        if held + size > cap:
            raise ConfigError(f"job data of live jobs holds {held:,} bytes; {size:,} more "
                              f"would pass the {cap:,} bytes this fellow keeps "
                              "(transport.max_job_data_bytes, storage.job_data_bytes)")


def refuse_paths(job: JobConfig) -> None:
    """A job reaching the leader names its data files by hash, never by a path on the
    leader's disk."""
    on_disk = local_data_files(job.data)
    if on_disk:
        raise ConfigError(f"data file {on_disk[0]} is a path: data travels with the job "
                          "(submit it with p2pswarm train or the API, which read the files "
                          "it names and send them), it is never read from the leader's disk")


def sent_files_of(job: JobConfig) -> list[str]:
    """The SHA-256 of every data file sent with ``job``, in order, once each."""
    names = (*job.data.files, *job.data.token_files)
    return list(dict.fromkeys(n[len(DATA_REF):] for n in names if is_data_ref(n)))


__all__ = ["JobData", "refuse_paths", "sent_files_of"]
