"""Job copies on disk, so that a whole swarm restarted resumes its jobs.

Every copy a fellow keeps (``handover``) is also written under
``<home>/job-copies/``: ``<job>.outer`` (the keepers' outer state, raw) first, then
``<job>.head`` (the ``JobKeep`` header, wire-encoded), each atomically; a header is
written last, so a header on disk always names outer state whole or none. Writes run
off the event loop, one at a time per job, the newest copy replacing one not yet
written (a round every few seconds never queues up disk writes).

Read back when the agent starts, as hostile as anything from the network: the newest
``MAX_KEPT_JOBS`` headers that read back, each at most ``MAX_HEAD_BYTES``, a name that
must be a safe path part and match the header's job id, outer state only when its size
matches the header, is at most ``OUTER_KEEP_BYTES`` and its SHA-256 matches (otherwise
the copy is kept without it, and a new leader resumes that job from its checkpoint).
Whatever does not read back is deleted, with a log line.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from p2pswarm.agent.training.transfer import check_part
from p2pswarm.errors import SwarmError
from p2pswarm.training.checkpoint_files import atomic_write_bytes
from p2pswarm.wire.codec import decode, encode
from p2pswarm.wire.jobs import MAX_KEPT_JOBS, OUTER_KEEP_BYTES, JobKeep
from p2pswarm.wire.orders import DOC_BYTES

log = logging.getLogger("p2pswarm.training")

MAX_HEAD_BYTES = DOC_BYTES + 64 * 1024  # a header: the job's record and round state, framed
HEAD, OUTER = ".head", ".outer"

Offload = Callable[[Callable[[], Any]], Awaitable[Any]]


@dataclass(frozen=True, slots=True)
class JobCopy:
    """One copy of a job: its header (record, sizes, digest) and its outer state."""

    head: JobKeep
    outer: bytes = b""

    @property
    def order(self) -> tuple[int, int]:
        return (self.head.term, self.head.seq)

    def outer_parts(self) -> list[bytes]:
        """Each stage keeper's outer state (empty when the copy carries none)."""
        parts, at = [], 0
        for n in self.head.outer_bytes:
            parts.append(self.outer[at:at + n])
            at += n
        return parts


class KeptStore:
    """The job copies of one fellow, on its disk (``root``)."""

    def __init__(self, root: Path, offload: Offload, spawn: Callable[..., Any]) -> None:
        self.root = root
        self._offload = offload
        self._spawn = spawn
        self._pending: dict[str, JobCopy | None] = {}  # job id -> to write (None: delete)
        self._writing: set[str] = set()
        self.written = 0  # copies written since start (for tests and figures)

    # --- writing ------------------------------------------------------------------------------

    def put(self, copy: JobCopy) -> None:
        self._queue(copy.head.job_id, copy)

    def drop(self, job_id: str) -> None:
        self._queue(job_id, None)

    def drop_now(self, job_id: str) -> None:
        """Delete ``job_id``'s copy at once (reading back, before the agent runs)."""
        try:
            self._write_now(check_part(job_id), None)
        except (SwarmError, OSError):
            pass

    def _queue(self, job_id: str, copy: JobCopy | None) -> None:
        try:
            check_part(job_id)
        except SwarmError:
            return  # never a path: such a copy is refused before it is kept anyway
        self._pending[job_id] = copy
        if job_id not in self._writing:
            self._writing.add(job_id)
            self._spawn(self._write, job_id)

    async def _write(self, job_id: str) -> None:
        try:
            while job_id in self._pending:
                copy = self._pending.pop(job_id)
                try:
                    await self._offload(partial(self._write_now, job_id, copy))
                except OSError as exc:
                    log.warning("job copy of %s not written to %s: %s", job_id, self.root,
                                exc.strerror or exc)
        finally:
            self._writing.discard(job_id)

    def _write_now(self, job_id: str, copy: JobCopy | None) -> None:
        head, outer = self.root / f"{job_id}{HEAD}", self.root / f"{job_id}{OUTER}"
        if copy is None:
            head.unlink(missing_ok=True)
            outer.unlink(missing_ok=True)
            return
        self.root.mkdir(parents=True, exist_ok=True)
        if copy.outer:
            atomic_write_bytes(outer, copy.outer)
        else:
            outer.unlink(missing_ok=True)
        atomic_write_bytes(head, encode(copy.head))
        self.written += 1

    # --- reading back -------------------------------------------------------------------------

    def load(self) -> list[JobCopy]:
        """The copies on disk that read back whole (see the module), newest first."""

        if not self.root.is_dir():
            return []
        heads = sorted(self.root.glob(f"*{HEAD}"), key=_mtime, reverse=True)
        out: list[JobCopy] = []
        for path in heads:
            if len(out) >= MAX_KEPT_JOBS:
                self._discard(path, "more copies than a fellow keeps")
                continue
            job_id = path.name[:-len(HEAD)]
            try:
                check_part(job_id)
                if path.stat().st_size > MAX_HEAD_BYTES:
                    raise SwarmError(f"over {MAX_HEAD_BYTES} bytes")
                messages = decode(path.read_bytes(), max_bytes=MAX_HEAD_BYTES)
            except (SwarmError, OSError, ValueError) as exc:
                self._discard(path, str(exc)[:200])
                continue
            head = messages[0] if len(messages) == 1 else None
            if not isinstance(head, JobKeep) or head.job_id != job_id:
                self._discard(path, "not the copy its name says")
                continue
            out.append(JobCopy(head, b"") if not head.outer_bytes
                       else self._with_outer(head))
        return out

    def _with_outer(self, head: JobKeep) -> JobCopy:

        path = self.root / f"{head.job_id}{OUTER}"
        total = sum(head.outer_bytes)
        try:
            ok = total <= OUTER_KEEP_BYTES and path.stat().st_size == total
            data = path.read_bytes() if ok else b""
        except OSError:
            ok, data = False, b""
        if not ok or hashlib.sha256(data).hexdigest() != head.outer_sha256:
            log.warning("job copy of %s: its outer state on disk does not read back; kept "
                        "without it (a new leader resumes it from its checkpoint)",
                        head.job_id)
            return JobCopy(JobKeep(head.job_id, head.seq, head.state, (), "", head.term))
        return JobCopy(head, data)

    def _discard(self, path: Path, why: str) -> None:
        log.warning("job copy %s dropped: %s", path.name, why)
        for p in (path, path.with_suffix(OUTER)):
            try:
                p.unlink(missing_ok=True)
            except OSError:
                pass


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


__all__ = ["JobCopy", "KeptStore", "MAX_HEAD_BYTES"]
