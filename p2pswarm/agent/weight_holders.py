"""Tensors from any fellow that holds them, so that a stage never depends on the one
fellow that offered its model: a user's laptop that ran ``load`` and led the swarm is the
fellow most likely to leave.

Theory of operation. ``gather`` fetches what this fellow's weights cache lacks of a
manifest. It asks the fellow the order names as the source first (the one that offered
the model's directory, by name, as a load always has). What that fellow does not give (it
is not connected, nothing listens, it refuses, or a tensor fails its SHA-256) is asked of
the others by hash: ``WeightsHeldAsk`` goes to at most ``MAX_FELLOWS_ASKED`` connected
fellows at once (those that gossip a stage of a load of this model first: they hold its
tensors), each answering with a bitmap of what it holds. The holders are then asked in
turn, the one holding most first and the node id breaking ties, for exactly the missing
tensors they said they hold (``WeightsByHash``). Every tensor is checked against the
manifest's SHA-256 as it arrives, whoever sends it; one that fails is refused (nothing of
it kept), counted (``weights-hash-mismatch``) and asked of the next holder, while the
rest of that holder's stream goes on. What no fellow gave ends the fetch with one
PlacementError that names the first such tensor and why each fellow failed.

The holder's side (``HeldWeights``) answers for hashes only: the tensors and files of the
manifests this fellow offered (read from their directories, as ``WeightsServer`` reads
them) and what its content-addressed cache holds (a hash becomes a path only through
``WeightsCache.path``, after its 64 lowercase hex digits are checked). It serves nothing
else, only over the swarm's sealed streams, and answering does not count as a use of a
cached file (a fellow cannot keep another's cache from evicting by asking).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from p2pswarm import wire
from p2pswarm.agent.weights import (
    Incoming,
    Manifest,
    OnBytes,
    Run,
    WeightsCache,
    WeightsServer,
    fetch_items,
    hash_failure,
    incoming,
    next_message,
    open_to,
    send_bytes,
)
from p2pswarm.errors import (
    ConfigError,
    PlacementError,
    RemoteProtocolError,
    SwarmError,
    WeightsCacheFull,
)
from p2pswarm.names import is_hex_digest
from p2pswarm.wire.serving import (
    MAX_HASHES_PER_ASK,
    WeightsByHash,
    WeightsHeld,
    WeightsHeldAsk,
    WeightsItem,
    WeightsRefused,
    WeightsRequest,
)

if TYPE_CHECKING:
    from p2pswarm.agent.ports import Computes, HoldersPort
    from p2pswarm.membership.member import Member
    from p2pswarm.transport.secure import SecureStream

log = logging.getLogger("p2pswarm.serving")

MAX_FELLOWS_ASKED = 32  # fellows asked at once what they hold
ASK_TIMEOUT_S = 5.0  # one fellow's answer (stream and bitmap) must come this soon
HOLDERS_TRIED = 8  # holders fetched from, in turn, before giving up
REASONS_SHOWN = 4  # failures a refusal spells out


@dataclass(frozen=True, slots=True)
class Gathered:
    """What ``gather`` brought: bytes received, and the fellows that sent them."""

    received_bytes: int
    senders: tuple[str, ...]


async def gather(agent: HoldersPort, manifest: Manifest, names: Sequence[str], cache: WeightsCache,
                 run: Run[Any], *, source_id: str, source_name: str,
                 on_bytes: OnBytes | None = None) -> Gathered:
    """Fetch the tensors or files ``names`` of ``manifest`` that ``cache`` lacks: from the
    fellow ``source_id`` that offered them, then from any fellow that holds them.
    PlacementError when some could be got from none (the cache keeps what came)."""
    wanted = [i for i in incoming(manifest, names) if not cache.has(i.sha256, i.nbytes)]
    if not wanted:
        return Gathered(0, ())
    total = sum(i.nbytes for i in wanted)
    received = 0
    senders: list[str] = []
    failures: list[str] = []
    bad: set[tuple[bytes, str]] = set()  # (fellow, hash) whose bytes failed their check

    def count(n: int) -> None:
        nonlocal received
        shown = min(n, max(total - received, 0))  # refused bytes would pass 100%
        received += n
        if on_bytes is not None and shown:
            on_bytes(shown)

    def lacking() -> list[Incoming]:
        return [i for i in wanted if not cache.has(i.sha256, i.nbytes)]

    source = agent.fellow(source_id)
    skip = {agent.node_id}
    if source is None or not source.present:
        failures.append(f"{source_name} (which offered them) is not connected")
    elif source.node_id != agent.node_id:
        skip.add(source.node_id)
        request = WeightsRequest(manifest.key, tuple(i.name for i in wanted))
        if await _fetch_from(agent, source, request, wanted, cache, run, count, failures, bad):
            senders.append(source.name)
    missing = lacking()
    if missing:
        holders = await ask_holders(agent, _candidates(agent, manifest.key, skip),
                                    [i.sha256 for i in missing])
        for member, held in holders[:HOLDERS_TRIED]:
            items = [i for i in lacking() if i.sha256 in held
                     and (member.node_id, i.sha256) not in bad]
            if not items:
                continue
            if await _fetch_from(agent, member, WeightsByHash(tuple(i.sha256 for i in items)),
                                 [Incoming(i.name, i.sha256, i.nbytes, i.sha256) for i in items],
                                 cache, run, count, failures, bad):
                senders.append(member.name)
        missing = lacking()
        if missing and not holders:
            failures.append(f"no other connected fellow holds {missing[0].name}")
    if missing:
        raise PlacementError(
            f"{len(missing)} of the {len(wanted)} tensors of {manifest.name} this stage "
            f"lacks came from no fellow, {missing[0].name} first: "
            + "; ".join(failures[:REASONS_SHOWN]))
    if senders and senders[0] != source_name:
        log.info("%s: %d tensors of %s fetched from %s (%s is gone or failed)", agent.name,
                 len(wanted), manifest.name, ", ".join(senders), source_name)
    return Gathered(received, tuple(senders))


async def _fetch_from(agent: HoldersPort, member: Member, request: Any, items: list[Incoming],
                      cache: WeightsCache, run: Run[Any], count: OnBytes,
                      failures: list[str], bad: set[tuple[bytes, str]]) -> bool:
    """Fetch ``items`` from ``member``, noting what failed; True if it sent something."""
    try:
        failed = await fetch_items(agent, member.addr, member.node_id, member.name, request,
                                   items, cache, run, count)
    except WeightsCacheFull:
        raise  # no other sender makes room here
    except SwarmError as exc:
        failures.append(f"{member.name}: {exc}")
        return any(cache.has(i.sha256, i.nbytes) for i in items)
    for item in failed:
        agent.counters.drop("weights-hash-mismatch")
        bad.add((member.node_id, item.sha256))
        failures.append(hash_failure(item, member.name))
        log.warning("%s: %s", agent.name, hash_failure(item, member.name))
    return len(failed) < len(items)


async def first_unheld(agent: HoldersPort, manifest: Manifest, names: Sequence[str],
                       cache: WeightsCache, skip_id: str = "") -> str | None:
    """The first of ``names`` that neither ``cache`` nor any connected fellow (but
    ``skip_id``, a source known gone) says it holds; None when every one is held."""
    lacking = [i for i in incoming(manifest, names) if not cache.has(i.sha256, i.nbytes)]
    if not lacking:
        return None
    skip = {agent.node_id}
    with contextlib.suppress(ValueError):
        skip.add(bytes.fromhex(skip_id))
    held: set[str] = set()
    for _, theirs in await ask_holders(agent, _candidates(agent, manifest.key, skip),
                                       [i.sha256 for i in lacking]):
        held |= theirs
    return next((i.name for i in lacking if i.sha256 not in held), None)


def _candidates(agent: HoldersPort, model_key: str, skip: set[bytes]) -> list[Member]:
    """The connected fellows to ask, at most ``MAX_FELLOWS_ASKED``: first those that
    gossip a stage of a load of this model (they hold some of its tensors), each group
    by node id."""
    members = [m for m in agent.fellows() if m.present and m.node_id not in skip]

    def serves_model(m: Member) -> bool:
        return agent.fellow_says(m).serves_model(model_key)

    members.sort(key=lambda m: (not serves_model(m), m.node_id))
    return members[:MAX_FELLOWS_ASKED]


async def ask_holders(agent: HoldersPort, fellows: Sequence[Member],
                      hashes: Sequence[str]) -> list[tuple[Member, set[str]]]:
    """Ask ``fellows`` at once which of ``hashes`` they hold; those holding any, the one
    holding most first (node id breaking ties). A fellow that does not answer in
    ``ASK_TIMEOUT_S``, or answers out of form, holds nothing here."""
    answers: dict[bytes, set[str]] = {}

    async def one(member: Member) -> None:
        try:
            with trio.fail_after(ASK_TIMEOUT_S):
                held = await _ask(agent, member, hashes)
        except (SwarmError, trio.TooSlowError) as exc:
            log.debug("%s: %s did not say what it holds: %s", agent.name, member.name, exc)
            return
        if held:
            answers[member.node_id] = held

    async with trio.open_nursery() as nursery:
        for member in fellows:
            nursery.start_soon(one, member)
    by_id = {m.node_id: m for m in fellows}
    order = sorted(answers, key=lambda fid: (-len(answers[fid]), fid))
    return [(by_id[fid], answers[fid]) for fid in order]


async def _ask(agent: HoldersPort, member: Member, hashes: Sequence[str]) -> set[str]:
    stream = await open_to(agent, member.addr, member.node_id, member.name)
    held: set[str] = set()
    try:
        for at in range(0, len(hashes), MAX_HASHES_PER_ASK):
            part = tuple(hashes[at:at + MAX_HASHES_PER_ASK])
            await stream.send_frame(wire.encode(WeightsHeldAsk(part)))
            reply = await next_message(stream, agent, member.name)
            if not isinstance(reply, WeightsHeld) or len(reply.held) != (len(part) + 7) // 8:
                agent.counters.drop("weights-held-unfit")
                raise RemoteProtocolError("weights-held-unfit",
                                          f"{member.name} answered what it holds out of form")
            held.update(h for i, h in enumerate(part) if reply.held[i // 8] >> (i % 8) & 1)
    finally:
        await stream.aclose()
    return held


def held_bitmap(flags: Sequence[bool]) -> bytes:
    out = bytearray((len(flags) + 7) // 8)
    for i, flag in enumerate(flags):
        if flag:
            out[i // 8] |= 1 << (i % 8)
    return bytes(out)


class HeldWeights:
    """The holder's side: which hashes this fellow holds, and their bytes."""

    def __init__(self, agent: Computes, server: WeightsServer,
                 cache: Callable[[], WeightsCache]) -> None:
        self.agent = agent
        self.server = server
        self.cache = cache
        self.sent_bytes = 0
        self._offered: tuple[tuple[str, ...], dict[str, tuple[Path, int, int]]] = ((), {})

    def _offered_index(self) -> dict[str, tuple[Path, int, int]]:
        """hash -> (file, offset, size) over the manifests offered, made once per set."""
        keys = tuple(sorted(f"{k} {m.path}" for k, m in self.server.offers.items()))
        if keys != self._offered[0]:
            index: dict[str, tuple[Path, int, int]] = {}
            for _, m in sorted(self.server.offers.items()):
                root = Path(m.path)
                for t in m.tensors:
                    index.setdefault(t.sha256, (root / t.file, t.offset_bytes, t.nbytes))
                for f in m.files:
                    index.setdefault(f.sha256, (root / f.name, 0, f.nbytes))
            self._offered = (keys, index)
        return self._offered[1]

    def where(self, sha256: str) -> tuple[Path, int, int] | None:
        """Where the bytes of ``sha256`` are here (file, offset, size), or None."""
        if not is_hex_digest(sha256, 64):
            return None
        offered = self._offered_index().get(sha256)
        if offered is not None:
            return offered
        cache = self.cache()
        size = cache.size_of(sha256)
        return (cache.path(sha256), 0, size) if size is not None else None

    async def answer_ask(self, msg: WeightsHeldAsk, stream: SecureStream) -> WeightsHeld:
        self._check(msg.hashes)
        return WeightsHeld(held_bitmap([self.where(h) is not None for h in msg.hashes]))

    async def serve(self, msg: WeightsByHash, stream: SecureStream) -> None:
        """Each asked hash as a ``WeightsItem`` and raw frames; ``WeightsRefused`` at the
        first one not held (evicted since it was asked about, say)."""
        self._check(msg.hashes)
        run = self.agent.compute.run
        with contextlib.ExitStack() as files_open:
            fds: dict[Path, int] = {}
            for sha in msg.hashes:
                where = self.where(sha)
                if where is None:
                    await stream.send_frame(wire.encode(WeightsRefused(
                        f"{sha[:12]}... is not held here any more")))
                    return
                path, offset, nbytes = where
                if path not in fds:
                    try:
                        handle = await run(partial(open, path, "rb"))
                    except OSError:
                        await stream.send_frame(wire.encode(WeightsRefused(
                            f"{sha[:12]}... is not readable here any more")))
                        return
                    fds[path] = files_open.enter_context(handle).fileno()
                await stream.send_frame(wire.encode(WeightsItem(sha, nbytes, sha)))
                try:
                    self.sent_bytes += await send_bytes(stream, run, fds[path], offset, nbytes,
                                                        f"{path} is truncated at {sha[:12]}...")
                except OSError as exc:  # a disk error here ends this stream, in one line
                    raise ConfigError(f"{path} could not be read: {exc}") from None

    def _check(self, hashes: Sequence[str]) -> None:
        """A hash that is not 64 lowercase hex digits ends the stream, counted."""
        if not all(is_hex_digest(h, 64) for h in hashes):  # counted as frame-unsafe-name
            raise RemoteProtocolError("unsafe-name", "a hash asked for is not 64 lowercase "
                                      "hex digits")


__all__ = ["ASK_TIMEOUT_S", "Gathered", "HeldWeights", "MAX_FELLOWS_ASKED", "ask_holders",
           "first_unheld", "gather", "held_bitmap"]
