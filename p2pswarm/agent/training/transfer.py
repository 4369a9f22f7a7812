"""Bytes of any size on a training stream: a stage's state, a checkpoint shard, job data.

No message carries a whole state: the sender announces the size and SHA-256 first (a
``StateHead``, a ``StateLoadHead``, or the header fields every ``TrainShard`` frame
repeats), then sends the bytes in parts of at most ``SHARD_CHUNK_BYTES``. The receiver
refuses a size above its cap (``transport.max_shard_bytes``) or above the free space of
the disk it writes to before it writes a byte, checks every part as it arrives (in
order, not empty, never past the announced size), writes them to a temporary file next
to the destination, and renames it into place only once the size and the SHA-256 match.
A transfer that fails leaves no file behind. Names that come from the network become
paths only through ``check_part``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator
from contextlib import aclosing
from functools import partial
from pathlib import Path
from typing import Any, BinaryIO

from p2pswarm.agent.streams import send_message
from p2pswarm.agent.training.links import receive_answer
from p2pswarm.errors import ConfigError, RemoteProtocolError
from p2pswarm.names import UnsafeName, is_hex_digest, is_safe_name
from p2pswarm.training.checkpoint_files import fsync_dir
from p2pswarm.transport.secure import SecureStream
from p2pswarm.wire.training import SHARD_CHUNK_BYTES, StatePart, TrainShard

Run = Callable[[Callable[[], Any]], Awaitable[Any]]  # where blocking work runs (the
# agent's ``compute.run``: a worker thread, or inline in virtual time)
PART_CHARS = 64  # a checkpoint or job name from the network: one path component this long
READ_BYTES = SHARD_CHUNK_BYTES


def check_part(name: str) -> str:
    """``name`` if it is safe as one path component (letters, digits, ``._-``, no leading
    dot, at most 64 characters); an UnsafeName (a ConfigError) otherwise."""
    if not is_safe_name(name, PART_CHARS) or name.endswith(".tmp"):
        raise UnsafeName(f"bad name {str(name)[:80]!r}: letters, digits, '.', '_' and '-' "
                          f"only, no leading dot, at most {PART_CHARS} characters")
    return name


def check_hash(sha256: str) -> str:
    if not is_hex_digest(sha256, 64):
        raise RemoteProtocolError("bad-hash", f"{str(sha256)[:80]!r} is not a SHA-256 in hex")
    return sha256


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(READ_BYTES):
            digest.update(block)
    return digest.hexdigest()


def check_room(total: int, cap: int, directory: Path, what: str) -> None:
    """Refuse ``total`` bytes above ``cap`` or above the free space in ``directory``."""
    if total > cap:
        raise ConfigError(f"{what} of {total:,} bytes is over the {cap:,} bytes this fellow "
                          "accepts (transport.max_shard_bytes)")
    directory.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(directory).free
    if total > free:
        raise ConfigError(f"{what} of {total:,} bytes does not fit the {free:,} bytes free "
                          f"in {directory}")


class Landing:
    """A file being received: a temporary file beside ``dest``, hashed as it grows,
    renamed over ``dest`` by ``finish`` once whole and matching; removed otherwise."""

    def __init__(self, dest: Path, total: int, sha256: str, what: str) -> None:
        self.dest = dest
        self.total = total
        self.sha256 = check_hash(sha256)
        self.what = what
        self.have = 0
        self._digest = hashlib.sha256()
        self._tmp = dest.with_name(f".{dest.name}.{os.getpid()}-{id(self):x}.tmp")
        self._file: BinaryIO | None = open(self._tmp, "wb")  # noqa: SIM115 (closed in finish/abort)

    def add(self, offset: int, data: bytes) -> None:
        if offset != self.have or not data or self.have + len(data) > self.total:
            raise RemoteProtocolError(
                "bad-part", f"{self.what}: a part at {offset} of {len(data)} bytes where "
                f"{self.have:,} of {self.total:,} bytes are in")
        assert self._file is not None
        self._file.write(data)
        self._digest.update(data)
        self.have += len(data)

    @property
    def complete(self) -> bool:
        return self.have == self.total

    def finish(self) -> None:
        assert self._file is not None
        if self._digest.hexdigest() != self.sha256:
            raise RemoteProtocolError("bad-hash", f"{self.what} does not match its SHA-256 "
                                      "(damaged in transit)")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self._file = None
        os.replace(self._tmp, self.dest)
        fsync_dir(self.dest.parent)

    def abort(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        self._tmp.unlink(missing_ok=True)


def parts_of(data: bytes) -> Iterator[tuple[int, bytes]]:
    """(offset, part) of ``data``; one empty part for empty data."""
    view = memoryview(data)
    offset = 0
    while True:
        part = bytes(view[offset:offset + SHARD_CHUNK_BYTES])
        yield offset, part
        offset += len(part)
        if offset >= len(data):
            return


async def file_parts(path: Path, run: Run) -> AsyncGenerator[tuple[int, bytes], None]:
    """(offset, part) of the file at ``path``, read a part at a time where ``run`` runs
    blocking work; one empty part for an empty file."""
    f: BinaryIO = await run(partial(open, path, "rb"))
    try:
        offset = 0
        while True:
            part: bytes = await run(partial(f.read, SHARD_CHUNK_BYTES))
            if part or offset == 0:
                yield offset, part
            offset += len(part)
            if len(part) < SHARD_CHUNK_BYTES:
                return
    finally:
        f.close()


async def send_state_parts(stream: SecureStream, data: bytes) -> None:
    """``data`` (announced by its head) as ``StatePart`` frames."""
    for offset, part in parts_of(data):
        if part:
            await send_message(stream, StatePart(offset, part))


async def send_state_file(stream: SecureStream, path: Path, run: Run) -> None:
    """The file at ``path`` (announced by its head) as ``StatePart`` frames."""
    async with aclosing(file_parts(path, run)) as parts:  # the file closed on any error
        async for offset, part in parts:
            if part:
                await send_message(stream, StatePart(offset, part))


async def receive_state_parts(stream: SecureStream, landing: Landing, who: str,
                              run: Run) -> None:
    """``StatePart`` frames into ``landing`` until it is whole, then into place."""
    try:
        while not landing.complete:
            part = await receive_answer(stream, StatePart, who)
            await run(partial(landing.add, part.offset, part.data))
        await run(landing.finish)
    finally:
        landing.abort()


async def send_shard_file(stream: SecureStream, job_id: str, step: int, name: str,
                          path: Path, sha256: str, run: Run) -> None:
    """The file at ``path`` as ``TrainShard`` frames."""
    total = (await run(path.stat)).st_size
    async with aclosing(file_parts(path, run)) as parts:
        async for offset, part in parts:
            await send_message(stream, TrainShard(job_id, step, name, sha256, offset, total,
                                                  part))


async def receive_shard_file(first: TrainShard, stream: SecureStream, dest: Path,
                             cap: int, run: Run) -> None:
    """The shard whose first frame is ``first`` into ``dest`` (atomically, verified)."""
    what = f"shard {first.name}"
    if first.offset != 0:
        raise RemoteProtocolError("bad-shard", f"{what} must start at offset 0")
    check_room(first.total, cap, dest.parent, what)
    landing = Landing(dest, first.total, first.sha256, what)
    try:
        msg = first
        while True:
            if (msg.job_id, msg.name, msg.step, msg.total, msg.sha256) != (
                    first.job_id, first.name, first.step, first.total, first.sha256):
                raise RemoteProtocolError("bad-shard", f"{what}: a frame of another shard")
            if msg.data or msg.total:
                await run(partial(landing.add, msg.offset, msg.data))
            if landing.complete:
                break
            msg = await receive_answer(stream, TrainShard, "the sender", name_stage=False)
        await run(landing.finish)
    finally:
        landing.abort()


__all__ = ["Landing", "Run", "check_hash", "check_part", "check_room", "file_parts",
           "file_sha256", "parts_of", "receive_shard_file", "receive_state_parts",
           "send_shard_file", "send_state_file", "send_state_parts"]
