"""Stage weights between fellows: a manifest with SHA-256 per tensor, a server on the
fellow that holds the model directory, and a fetcher into a cache in the state directory.

Theory of operation. The fellow where `load` runs holds the model directory. It makes a
``Manifest``: each tensor's file, byte range, dtype, shape and SHA-256, plus the small
files a driver needs to tokenize (``tokenizer.json``, ...), keyed by a hash of all that,
and offers it. The leader passes the manifest in every stage order. A fellow other than
the source works out which tensors its layers read and fetches exactly those over one
sealed stream: a ``WeightsRequest``, then per tensor a ``WeightsItem`` header and the raw
bytes in frames of ``CHUNK_BYTES``. Each tensor is hashed as it arrives and stored under
its SHA-256 in ``HOME/weights/``; bytes that do not match the manifest are refused and
never stored (files land by an atomic rename, so the cache holds only verified tensors).
A stage then loads from the cache through the torch runtime's ``CachedTensors``
(``p2pswarm.agent.serving.torch_runtime``), a tensor source like ``Checkpoint``, which
checks each tensor's hash again as it reads it.

The server hands out only what a manifest it offered names: a fellow cannot ask for an
arbitrary file. The other way round, a manifest from an order or a gossiped record is
hostile input: its key, hashes and file names are checked (``p2pswarm.names``) before any
becomes a path, and the cache names files by their SHA-256 alone. It is bounded by
``storage.weights_cache_bytes``, the least recently used files evicted first, never a
tensor a live stage loads from.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
import tempfile
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict, TypeVar

import trio

from p2pswarm import wire
from p2pswarm.errors import (
    ConfigError,
    PlacementError,
    RemoteProtocolError,
    TransportError,
    WeightsCacheFull,
)
from p2pswarm.models.model_dir import model_file, model_file_if_any
from p2pswarm.names import UnsafeName, hex_digest, safe_name, sha256_hex
from p2pswarm.shapes.model_config import ModelConfig
from p2pswarm.wire.serving import WeightsItem, WeightsRefused, WeightsRequest

if TYPE_CHECKING:
    from p2pswarm.agent.ports import WeightsPort
    from p2pswarm.transport.secure import SecureStream

CHUNK_BYTES = 8 * 1024 * 1024  # one raw frame of tensor bytes
HASH_CHUNK_BYTES = 4 * 1024 * 1024
FETCH_IDLE_TIMEOUT_S = 60.0  # a source that sends nothing this long has failed
CONNECT_TIMEOUT_S = 10.0  # a source that does not take a stream this soon has failed
# Small files a driver may need besides the tensors (to tokenize, to know the stops).
MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json",
               "tokenizer_config.json", "special_tokens_map.json",
               "rwkv_vocab_v20230424.txt")  # RWKV's World vocabulary

MAX_TENSOR_NAME_CHARS = 512  # a checkpoint's tensor names are dotted paths, never this long
MAX_TENSOR_DIMS = 8

T = TypeVar("T")
Run = Callable[[Callable[[], T]], Awaitable[T]]  # where blocking work runs (a thread, inline)
OnBytes = Callable[[int], None]


@dataclass(frozen=True, slots=True)
class ManifestTensor:
    name: str
    file: str  # relative to the model directory
    dtype: str  # safetensors dtype string
    shape: tuple[int, ...]
    offset_bytes: int
    nbytes: int
    sha256: str

    def to_list(self) -> list[Any]:
        return [self.name, self.file, self.dtype, list(self.shape), self.offset_bytes,
                self.nbytes, self.sha256]

    @staticmethod
    def from_list(raw: Sequence[Any]) -> ManifestTensor:
        """One tensor as a manifest from the network lists it, every field checked."""
        name, file, dtype, shape, offset, nbytes, sha = raw
        if not isinstance(name, str) or not 0 < len(name) <= MAX_TENSOR_NAME_CHARS:
            raise ConfigError(f"bad tensor name {str(name)[:80]!r}")
        if not isinstance(dtype, str) or not 0 < len(dtype) <= 16:
            raise ConfigError(f"bad dtype {str(dtype)[:20]!r} of {name}")
        dims = tuple(int(d) for d in shape)
        if len(dims) > MAX_TENSOR_DIMS or min(dims, default=0) < 0 \
                or int(offset) < 0 or int(nbytes) < 0:
            raise ConfigError(f"bad shape or byte range of {name}")
        return ManifestTensor(name, safe_name(file, "tensor file"), dtype, dims, int(offset),
                              int(nbytes), sha256_hex(sha, f"SHA-256 of {name}"))


@dataclass(frozen=True, slots=True)
class ManifestFile:
    name: str
    nbytes: int
    sha256: str


class ManifestDoc(TypedDict):
    """A manifest as orders, records and offers carry it (``Manifest.to_dict``; read back,
    checked, by ``Manifest.from_dict``)."""

    key: str
    name: str
    path: str
    config: dict[str, Any]  # config.json, as the model directory holds it
    tensors: list[list[Any]]  # ``ManifestTensor.to_list``
    files: list[list[str | int]]  # [name, bytes, SHA-256]


@dataclass(frozen=True, slots=True)
class Manifest:
    """What a model directory holds, tensor by tensor, with hashes."""

    key: str  # 16 hex chars over everything below but the path
    name: str  # the directory's name
    path: str  # on the source fellow, there only: it never travels ("" from the network)
    hf_config: dict[str, Any]
    tensors: tuple[ManifestTensor, ...]
    files: tuple[ManifestFile, ...]

    def tensor(self, name: str) -> ManifestTensor:
        for t in self.tensors:
            if t.name == name:
                return t
        raise ConfigError(f"model {self.name} has no tensor {name!r}")

    def stage_tensors(self, start_layer: int, end_layer: int) -> list[ManifestTensor]:
        """The tensors a stage running layers [start_layer, end_layer) reads."""
        from p2pswarm.models.checkpoint import stage_tensor_names  # imports torch

        by_name = {t.name: t for t in self.tensors}
        names = stage_tensor_names(ModelConfig.from_hf(self.hf_config), start_layer, end_layer)
        missing = [n for n in names if n not in by_name]
        if missing:
            raise ConfigError(f"model {self.name} lacks {', '.join(missing[:3])}")
        return [by_name[n] for n in names]

    def key_holds(self) -> bool:
        """Whether ``key`` is the one its config, tensors and files hash to: a manifest
        from the network is then the model its key names."""
        return _manifest_key(self.hf_config, self.tensors, self.files) == self.key

    def to_dict(self) -> ManifestDoc:
        # no path: where a fellow keeps its models is none of the swarm's business (the
        # source finds its directory by the key it offered it under)
        return {"key": self.key, "name": self.name, "path": "", "config": self.hf_config,
                "tensors": [t.to_list() for t in self.tensors],
                "files": [[f.name, f.nbytes, f.sha256] for f in self.files]}

    @staticmethod
    def from_dict(data: dict[str, Any]) -> Manifest:
        """A manifest from the network (a stage order, a gossiped load record): the key,
        every hash and every file name checked before any of them may touch a path."""
        try:
            return Manifest(
                key=hex_digest(data["key"], 16, "model key"), name=str(data["name"])[:256],
                path="", hf_config=dict(data["config"]),  # a path read never counts
                tensors=tuple(ManifestTensor.from_list(t) for t in data["tensors"]),
                files=tuple(_manifest_file(*f) for f in data["files"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"malformed model manifest ({exc})") from None


def _manifest_file(name: Any, nbytes: Any, sha256: Any) -> ManifestFile:
    if name not in MODEL_FILES:
        raise UnsafeName(f"a model manifest names the file {str(name)[:80]!r}; only "
                         f"{', '.join(MODEL_FILES)} travel with a model")
    if int(nbytes) < 0:
        raise ConfigError(f"bad size of {name}")
    return ManifestFile(name, int(nbytes), sha256_hex(sha256, f"SHA-256 of {name}"))


def _manifest_key(hf_config: dict[str, Any], tensors: Sequence[ManifestTensor],
                  files: Sequence[ManifestFile]) -> str:
    canon = json.dumps([hf_config, [t.to_list() for t in tensors],
                        [[f.name, f.nbytes, f.sha256] for f in files]], sort_keys=True)
    return hashlib.sha256(canon.encode()).hexdigest()[:16]


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def build_manifest(model_dir: str | Path) -> Manifest:
    """Read and hash a model directory (blocking: reads every tensor once)."""
    from p2pswarm.models.checkpoint import Checkpoint, tensor_sha256

    checkpoint = Checkpoint(model_dir)
    tensors = []
    for name in checkpoint.tensor_names():
        e = checkpoint.entry(name)
        tensors.append(ManifestTensor(e.name, e.file, e.dtype, e.shape, e.offset_bytes,
                                      e.nbytes, tensor_sha256(checkpoint, e)))
    files = []
    for name in MODEL_FILES:
        # a link out of the directory (to the fellow's identity, say) is refused, never
        # hashed: what a manifest names, any fellow may fetch
        path = model_file_if_any(checkpoint.model_dir, name)
        if path is not None:
            files.append(ManifestFile(name, path.stat().st_size, _file_sha256(path)))
    return Manifest(_manifest_key(checkpoint.hf_config, tensors, files), checkpoint.name,
                    str(checkpoint.model_dir.resolve()), checkpoint.hf_config, tuple(tensors),
                    tuple(files))


def directory_fingerprint(model_dir: str | Path) -> tuple[tuple[str, int, int], ...]:
    """(name, size, mtime) of each file: a manifest made before is reused while it holds."""
    out = []
    for path in sorted(Path(model_dir).iterdir()):
        if path.is_file():
            st = path.stat()
            out.append((path.name, st.st_size, st.st_mtime_ns))
    return tuple(out)


def check_source_files(manifest: Manifest, names: Sequence[str]) -> None:
    """On the source fellow: the files still hold these tensors where the manifest says."""
    from p2pswarm.models.checkpoint import Checkpoint

    checkpoint = Checkpoint(manifest.path)
    for name in names:
        want = manifest.tensor(name)
        e = checkpoint.entry(name)
        if (e.file, e.dtype, e.shape, e.offset_bytes, e.nbytes) != \
                (want.file, want.dtype, want.shape, want.offset_bytes, want.nbytes):
            raise ConfigError(f"{manifest.path}: {name} changed since the load began")


# --- the cache ---------------------------------------------------------------------------


class WeightsCache:
    """Verified tensors and files by SHA-256 under ``root`` (``HOME/weights``), at most
    ``cap_bytes`` of them: a new tensor first evicts the least recently used ones, never
    one ``in_use`` names (a live stage's), and is refused when that is not enough."""

    def __init__(self, root: Path, cap_bytes: int | None = None,
                 in_use: Callable[[], Iterable[str]] | None = None) -> None:
        self.root = root
        self.cap_bytes = cap_bytes
        self.in_use: Callable[[], Iterable[str]] = in_use or (lambda: ())
        self.evicted = 0  # files dropped to make room, since start
        self._held_bytes: int | None = None  # what the cache holds; counted on first need

    def path(self, sha256: str) -> Path:
        """Where the bytes with this SHA-256 live: the one way a name becomes a path here
        (UnsafeName for anything but 64 lowercase hex digits)."""
        sha256 = sha256_hex(sha256)
        return self.root / sha256[:2] / sha256

    def has(self, sha256: str, nbytes: int) -> bool:
        """Whether the bytes are here; asking marks them used (the eviction order)."""
        path = self.path(sha256)
        try:
            if path.stat().st_size != nbytes:
                return False
            os.utime(path)
        except OSError:
            return False
        return True

    def size_of(self, sha256: str) -> int | None:
        """The size of the file held under ``sha256`` (None if none), without marking it
        used: what fellows are asked about does not decide what this cache keeps."""
        try:
            st = self.path(sha256).lstat()
        except OSError:
            return None
        return st.st_size if stat.S_ISREG(st.st_mode) else None

    def _files(self) -> list[tuple[int, Path, int]]:
        """(mtime, path, size) of every file held, temporary ones left out."""
        out = []
        for path in self.root.rglob("*"):
            if path.name.startswith("."):
                continue
            try:
                st = path.lstat()
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                out.append((st.st_mtime_ns, path, st.st_size))
        return out

    def make_room(self, nbytes: int) -> None:
        """Evict the least recently used files until ``nbytes`` more fit the cap."""
        if self.cap_bytes is None:
            return
        if nbytes > self.cap_bytes:
            raise WeightsCacheFull(f"a tensor of {nbytes:,} bytes is over the {self.cap_bytes:,} "
                                 "bytes this fellow caches (storage.weights_cache_bytes)")
        if self._held_bytes is not None and self._held_bytes + nbytes <= self.cap_bytes:
            return
        files = self._files() if self.root.is_dir() else []
        held = sum(size for _, _, size in files)
        if held + nbytes > self.cap_bytes:
            keep = set(self.in_use())
            # a sixteenth of the cap more than needed, so a model's tensors arriving one
            # after another do not each count the cache again
            goal = self.cap_bytes - self.cap_bytes // 16
            for _, path, size in sorted(files):
                if held + nbytes <= goal:
                    break
                if path.name in keep:
                    continue
                path.unlink(missing_ok=True)
                held -= size
                self.evicted += 1
        self._held_bytes = held
        if held + nbytes > self.cap_bytes:
            raise WeightsCacheFull(f"the weights cache holds {held:,} bytes that live stages use; "
                                 f"{nbytes:,} more would pass its {self.cap_bytes:,} bytes "
                                 "(storage.weights_cache_bytes)")

    def _stored(self, nbytes: int) -> None:
        if self._held_bytes is not None:
            self._held_bytes += nbytes

    def held(self) -> list[str]:
        """Every hash held (for tests and `loads --json`)."""
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.glob("??/*") if len(p.name) == 64)

    def writer(self, sha256: str, nbytes: int) -> CacheWriter:
        return CacheWriter(self, sha256, nbytes)

    def model_dir(self, manifest: Manifest) -> Path:
        """A directory holding the manifest's small files under their names (for a
        tokenizer), made from cached copies; call once they are all cached. It is named by
        its own content (each file's name and SHA-256), never by a name from the network,
        so two manifests under one key cannot share it, and only ``MODEL_FILES`` go in."""
        listing = sorted((_manifest_file(f.name, f.nbytes, f.sha256).name, f.sha256)
                         for f in manifest.files)
        digest = hashlib.sha256(json.dumps(listing).encode()).hexdigest()
        directory = self.root / "models" / digest
        directory.mkdir(parents=True, exist_ok=True)
        for f in manifest.files:
            target = directory / f.name
            if not target.exists():
                tmp = directory / f".{f.name}.tmp"
                tmp.write_bytes(self.path(f.sha256).read_bytes())
                tmp.replace(target)
                self._stored(f.nbytes)
        return directory


class CacheWriter:
    """One incoming tensor: bytes to a temporary file and a running hash; ``commit``
    renames it into the cache only when every byte came and the hash matches."""

    def __init__(self, cache: WeightsCache, sha256: str, nbytes: int) -> None:
        self.cache = cache
        self.sha256 = sha256
        self.nbytes = nbytes
        self.received = 0
        self._digest = hashlib.sha256()
        final = cache.path(sha256)
        cache.make_room(nbytes)
        final.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=final.parent, prefix=".part-")
        self._file = os.fdopen(fd, "wb")
        self._tmp = Path(tmp)

    def write(self, chunk: bytes) -> None:
        self._digest.update(chunk)
        self._file.write(chunk)
        self.received += len(chunk)

    def commit(self) -> bool:
        """True when stored; False (and nothing kept) when the bytes do not match."""
        self._file.close()
        if self.received != self.nbytes or self._digest.hexdigest() != self.sha256:
            self._tmp.unlink(missing_ok=True)
            return False
        self._tmp.replace(self.cache.path(self.sha256))
        self.cache._stored(self.nbytes)
        return True

    def abort(self) -> None:
        self._file.close()
        self._tmp.unlink(missing_ok=True)


# --- serving and fetching ------------------------------------------------------------------


class WeightsServer:
    """Hands out the tensors and files of the manifests this fellow offered."""

    def __init__(self) -> None:
        self.offers: dict[str, Manifest] = {}
        self.sent_bytes = 0

    def offer(self, manifest: Manifest) -> None:
        self.offers[manifest.key] = manifest

    async def serve(self, request: WeightsRequest, stream: SecureStream, run: Run[Any]) -> None:
        manifest = self.offers.get(request.model_key)
        if manifest is None:
            await stream.send_frame(wire.encode(WeightsRefused(
                f"model {request.model_key} is not offered here")))
            return
        tensors = {t.name: t for t in manifest.tensors}
        files = {f.name: f for f in manifest.files}
        unknown = [n for n in request.names if n not in tensors and n not in files]
        if unknown:
            await stream.send_frame(wire.encode(WeightsRefused(
                f"model {manifest.name} has no {unknown[0]!r}")))
            return
        root = Path(manifest.path)
        with contextlib.ExitStack() as files_open:
            fds: dict[str, int] = {}
            for name in request.names:
                if name in tensors:
                    t = tensors[name]
                    where, offset, nbytes, sha = t.file, t.offset_bytes, t.nbytes, t.sha256
                else:
                    f = files[name]
                    where, offset, nbytes, sha = f.name, 0, f.nbytes, f.sha256
                if where not in fds:
                    # checked again as it is opened: the directory may have changed since
                    handle = await run(partial(open, model_file(root, where), "rb"))
                    fds[where] = files_open.enter_context(handle).fileno()
                await stream.send_frame(wire.encode(WeightsItem(name, nbytes, sha)))
                self.sent_bytes += await send_bytes(stream, run, fds[where], offset, nbytes,
                                                    f"{root / where} is truncated at {name}")


async def send_bytes(stream: SecureStream, run: Run[Any], fd: int, offset: int, nbytes: int,
                     truncated: str) -> int:
    """Send ``nbytes`` of the open file ``fd`` from ``offset`` as raw frames of
    ``CHUNK_BYTES``; ConfigError(``truncated``) when the file ends first."""
    # read the next chunk while this one is sealed and sent
    async with _Ahead(run) as ahead:
        sizes = [min(CHUNK_BYTES, nbytes - at) for at in range(0, nbytes, CHUNK_BYTES)]
        if sizes:
            ahead.start(partial(os.pread, fd, sizes[0], offset))
        sent = 0
        for i, size in enumerate(sizes):
            chunk = await ahead.result()
            if i + 1 < len(sizes):
                ahead.start(partial(os.pread, fd, sizes[i + 1], offset + sent + size))
            if len(chunk) != size:
                raise ConfigError(truncated)
            await stream.send_frame(chunk)
            sent += size
    return sent


async def receive_bytes(stream: SecureStream, writer: CacheWriter, run: Run[Any],
                        fellow_name: str, name: str, on_bytes: OnBytes | None = None) -> bool:
    """Receive ``writer.nbytes`` raw frames into ``writer`` and commit it: True when the
    bytes matched their SHA-256 and are cached, False when they did not (nothing kept)."""
    nbytes = writer.nbytes
    try:
        # hash and write one chunk while the next arrives
        async with _Ahead(run) as ahead:
            arrived = 0
            while arrived < nbytes:
                with trio.fail_after(FETCH_IDLE_TIMEOUT_S):
                    chunk = await stream.receive_frame()
                if len(chunk) > nbytes - arrived:
                    raise RemoteProtocolError("weights-overrun",
                                              f"{fellow_name} sent too much for {name}")
                arrived += len(chunk)
                await ahead.result()
                ahead.start(partial(writer.write, chunk))
                if on_bytes is not None:
                    on_bytes(len(chunk))
            await ahead.result()
    except BaseException:
        writer.abort()
        raise
    return bool(await run(writer.commit))


@dataclass(frozen=True, slots=True)
class Incoming:
    """One tensor or file a fetch expects: its name in the manifest, what the sender's
    ``WeightsItem`` header calls it (the name, or the hash when asked by hash), and the
    manifest's size and SHA-256, against which the bytes are checked."""

    name: str
    header: str
    nbytes: int
    sha256: str


def incoming(manifest: Manifest, names: Sequence[str], by_hash: bool = False) -> list[Incoming]:
    """What fetching ``names`` of ``manifest`` receives, each hash once (equal tensors,
    norms of ones say, share one cached copy)."""
    known = {t.name: (t.nbytes, t.sha256) for t in manifest.tensors}
    known.update({f.name: (f.nbytes, f.sha256) for f in manifest.files})
    out: dict[str, Incoming] = {}
    for name in names:
        nbytes, sha = known[name]
        out.setdefault(sha, Incoming(name, sha if by_hash else name, nbytes, sha))
    return list(out.values())


async def fetch(agent: WeightsPort, addr: str, fellow_id: bytes, fellow_name: str,
                manifest: Manifest, names: Sequence[str], cache: WeightsCache, run: Run[Any],
                on_bytes: OnBytes | None = None) -> int:
    """Fetch ``names`` of ``manifest`` from the fellow at ``addr`` that offered it into
    ``cache``; returns the bytes received. PlacementError names a tensor whose bytes fail
    their SHA-256."""
    if not names:
        return 0
    items = incoming(manifest, names)
    received = 0

    def count(n: int) -> None:
        nonlocal received
        received += n
        if on_bytes is not None:
            on_bytes(n)

    failed = await fetch_items(agent, addr, fellow_id, fellow_name,
                               WeightsRequest(manifest.key, tuple(i.name for i in items)),
                               items, cache, run, count)
    if failed:
        raise PlacementError(hash_failure(failed[0], fellow_name))
    return received


def hash_failure(item: Incoming, fellow_name: str) -> str:
    return (f"tensor {item.name} from {fellow_name} failed its SHA-256 check (expected "
            f"{item.sha256[:12]}...): refused, nothing of it kept")


async def fetch_items(agent: WeightsPort, addr: str, fellow_id: bytes, fellow_name: str,
                      request: Any, items: Sequence[Incoming], cache: WeightsCache,
                      run: Run[Any], on_bytes: OnBytes | None = None) -> list[Incoming]:
    """Send ``request`` (a ``WeightsRequest`` or ``WeightsByHash``) to the fellow at
    ``addr`` and receive ``items`` in order into ``cache``. Returns the items whose bytes
    failed their SHA-256 (refused, nothing of them kept; the others are cached).
    PlacementError when the fellow refuses one (those before it are cached),
    TransportError when it falls silent or goes, RemoteProtocolError when it sends
    something else."""
    stream = await open_to(agent, addr, fellow_id, fellow_name)
    failed = []
    try:
        await stream.send_frame(wire.encode(request))
        for item in items:
            header = await next_message(stream, agent, fellow_name)
            if isinstance(header, WeightsRefused):
                raise PlacementError(f"{fellow_name} would not send {item.name}: "
                                     f"{header.reason}")
            if not isinstance(header, WeightsItem) or header.name != item.header \
                    or header.nbytes != item.nbytes or header.sha256 != item.sha256:
                raise RemoteProtocolError("weights-out-of-order",
                                          f"{fellow_name} sent something else than {item.name}")
            writer = await run(partial(cache.writer, item.sha256, item.nbytes))
            if not await receive_bytes(stream, writer, run, fellow_name, item.name, on_bytes):
                failed.append(item)
    except trio.TooSlowError:
        raise TransportError(f"{fellow_name} stopped sending weights for "
                             f"{FETCH_IDLE_TIMEOUT_S:g} s") from None
    finally:
        await stream.aclose()
    return failed


async def open_to(agent: WeightsPort, addr: str, fellow_id: bytes, fellow_name: str
                  ) -> SecureStream:
    """A sealed stream to the fellow ``fellow_id`` at ``addr``, within
    ``CONNECT_TIMEOUT_S`` (a vanished machine may never answer a connection)."""
    try:
        with trio.fail_after(CONNECT_TIMEOUT_S):
            stream = await agent.open_secure(addr)
    except trio.TooSlowError:
        raise TransportError(f"{fellow_name} did not answer at {addr} within "
                             f"{CONNECT_TIMEOUT_S:g} s") from None
    if stream.peer_node_id != fellow_id:
        await stream.aclose()
        raise TransportError(f"{addr} is no longer {fellow_name}")
    return stream


class _Ahead:
    """At most one blocking job running beside the caller: start it, go on, collect its
    result (or its exception) later. Keeps a transfer's disk and hashing work overlapped
    with its network work without an unbounded queue."""

    def __init__(self, run: Run[Any]) -> None:
        self._run = run
        self._nursery: trio.Nursery | None = None
        self._manager: Any = None
        self._done: trio.Event | None = None
        self._value: Any = None
        self._error: BaseException | None = None

    async def __aenter__(self) -> _Ahead:
        self._manager = trio.open_nursery()
        self._nursery = await self._manager.__aenter__()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if exc_info[0] is not None and self._nursery is not None:
            self._nursery.cancel_scope.cancel()  # a failed transfer drops its job
        # the job never raises (it keeps its exception), so this only waits for it; the
        # caller's own exception goes on as it is, not wrapped in a group
        await self._manager.__aexit__(None, None, None)

    def start(self, fn: Callable[[], Any]) -> None:
        assert self._nursery is not None and self._done is None, "one job at a time"
        done = self._done = trio.Event()

        async def job() -> None:
            try:
                self._value = await self._run(fn)
            except Exception as exc:  # handed to whoever collects the result
                self._error = exc
            finally:
                done.set()

        self._nursery.start_soon(job)

    async def result(self) -> Any:
        """The running job's result (None when nothing runs); raises its exception."""
        if self._done is None:
            return None
        await self._done.wait()
        self._done = None
        value, error, self._value, self._error = self._value, self._error, None, None
        if error is not None:
            raise error
        return value


async def next_message(stream: SecureStream, agent: WeightsPort, fellow_name: str) -> Any:
    try:
        with trio.fail_after(FETCH_IDLE_TIMEOUT_S):
            frame = await stream.receive_frame()
    except TransportError as exc:
        raise TransportError(f"{fellow_name} stopped sending weights: {exc}") from exc
    messages = wire.decode(frame, max_bytes=agent.config.transport.max_frame_bytes)
    if len(messages) != 1:
        raise RemoteProtocolError("weights-unexpected", f"{fellow_name} sent {len(messages)} "
                                  "messages in one frame")
    return messages[0]


__all__ = [
    "CHUNK_BYTES", "Incoming", "Manifest", "ManifestFile", "ManifestTensor",
    "WeightsCache", "WeightsServer", "build_manifest", "check_source_files",
    "directory_fingerprint", "fetch", "fetch_items", "hash_failure", "incoming", "open_to",
    "receive_bytes", "send_bytes",
]
