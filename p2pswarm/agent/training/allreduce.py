"""A sharded all-reduce of one stage's deltas between a job's replicas: no hub.

Theory of operation. The fellows holding one stage of each replica (``roster``, in a
fixed ring order every fellow knows) split the stage's flat parameters into one part per
fellow (``training.allreduce.part_bounds``); part ``j`` is kept by ``roster[j]`` at first.
A round, for each fellow (``AllReduceFellow.reduce``):

1. it takes its delta as one encoded blob per part and sends part ``j`` to part ``j``'s
   keeper (``PartDelta``; its own part stays local): the reduce-scatter;
2. each keeper closes its part when every live fellow has sent a fresh part or at the
   round's deadline, with what arrived (``PartKeeper``: the DiLoCo outer step of
   ``training.sync`` on its slice), and sends the part's update to every live fellow
   (``PartUpdate``): the all-gather;
3. once it holds every part's update to the next version it applies them all at once;
   every fellow decodes the same bytes, so all replicas stay bit-equal.

A fellow sends and receives about twice one compressed delta per round, whatever the
number of fellows: ``(R - 1) / R`` of its delta out, as much of the others' in, and its
part's update ``R - 1`` times out, the other parts' in.

A fellow vanishing mid-round (``down``, from membership): the live fellows stop waiting
for it, and each part it kept moves to the next live fellow in the ring. The new keeper
starts from its own anchor (the global parameters, the same on every replica) with the
outer momentum and error feedback its predecessor last handed it (``PartState``, every
``backup_every_rounds`` rounds; fresh ones without); every live fellow tells it what it
holds of the part's open round: the part's update, when the vanished keeper sent it one
before dying (the new keeper adopts it and passes it on, so nobody applies two different
updates of one round), else its part of the delta again (a fellow that applied the round
already answers that one with the update). The new keeper closes the round by the same
rule, so a round never waits past its deadline for a vanished fellow.

Everything from the network is checked before it is used: a part number or version out
of range, a blob of the wrong size, a delta from a fellow outside the roster is dropped
and counted (``dropped``), never raised.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import trio

from p2pswarm.errors import SwarmError
from p2pswarm.wire.codec import decode, encode
from p2pswarm.wire.training import PartDelta, PartState, PartUpdate

if TYPE_CHECKING:
    from p2pswarm.training.sync import Verdict

log = logging.getLogger("p2pswarm.training")

HISTORY_VERSIONS = 2  # applied versions whose updates a fellow can pass to a new keeper
MAX_MESSAGE_BYTES = 80 * 1024 * 1024

PartMessage = PartDelta | PartUpdate | PartState
T = TypeVar("T")
Runner = Callable[[Callable[[], Any]], Awaitable[Any]]  # where a torch call runs


async def inline(fn: Callable[[], T]) -> T:
    """Run ``fn`` on the event loop (tests and virtual-time benchmarks)."""
    return fn()


class PartKeeperPort(Protocol):
    """One part's keeper (``training.allreduce.PartKeeper``), fed bytes."""

    @property
    def version(self) -> int: ...

    @property
    def members(self) -> set[str]: ...

    def join(self, replica: str) -> None: ...

    def leave(self, replica: str) -> None: ...

    def contribute(self, replica: str, version: int, blob: bytes, samples: int,
                   now: float) -> Verdict: ...

    def ready(self, now: float) -> bool: ...

    def next_deadline(self) -> float: ...

    def close(self, now: float) -> tuple[int, bytes, tuple[str, ...]] | None: ...

    def adopt(self, version: int, blob: bytes) -> None: ...

    def outer_state(self) -> bytes: ...


class PartSync(Protocol):
    """A replica's side of one stage (``training.allreduce.PartedSync``), in bytes."""

    @property
    def parts(self) -> int: ...

    @property
    def version(self) -> int: ...

    def take_parts(self) -> tuple[int, list[bytes]]: ...

    def apply_parts(self, version: int, blobs: Sequence[bytes]) -> None: ...

    def keeper(self, part: int, now: float, state: bytes | None = None
               ) -> PartKeeperPort: ...


class PartNet(Protocol):
    """How part messages travel between the fellows of one stage."""

    async def send(self, sender: str, to: str, message: PartMessage) -> None: ...


class MemoryPartNet:
    """An in-memory network for the fellows of a stage (tests, virtual-time benchmarks):
    each message is encoded and decoded as on the wire, counted in bytes each way, and
    takes ``latency_s`` plus its size at ``bandwidth_bps`` on the sender's uplink (one
    message after another, in the order they were sent). A killed fellow's messages,
    either way, are lost."""

    def __init__(self, *, latency_s: float = 0.01, bandwidth_bps: float = 0.0) -> None:
        self.latency_s = latency_s
        self.bandwidth_bps = bandwidth_bps
        self.sent_bytes: dict[str, int] = {}
        self.received_bytes: dict[str, int] = {}
        self._inboxes: dict[str, trio.MemorySendChannel[PartMessage]] = {}
        self._dead: set[str] = set()
        self._uplink_free_at: dict[str, float] = {}  # one message after another

    def attach(self, name: str) -> trio.MemoryReceiveChannel[PartMessage]:
        send, receive = trio.open_memory_channel[PartMessage](10_000)
        self._inboxes[name] = send
        self._dead.discard(name)
        self.sent_bytes.setdefault(name, 0)
        self.received_bytes.setdefault(name, 0)
        return receive

    def kill(self, name: str) -> None:
        self._dead.add(name)

    def reset_counts(self) -> None:
        for name in self.sent_bytes:
            self.sent_bytes[name] = self.received_bytes[name] = 0

    async def send(self, sender: str, to: str, message: PartMessage) -> None:
        data = encode(message, max_bytes=MAX_MESSAGE_BYTES)
        if sender in self._dead:
            return
        self.sent_bytes[sender] = self.sent_bytes.get(sender, 0) + len(data)
        now = trio.current_time()
        start = max(now, self._uplink_free_at.get(sender, now))
        done = start + (8 * len(data) / self.bandwidth_bps if self.bandwidth_bps > 0 else 0.0)
        self._uplink_free_at[sender] = done
        await trio.sleep_until(done + self.latency_s)
        inbox = self._inboxes.get(to)
        if inbox is None or to in self._dead or sender in self._dead:
            return
        self.received_bytes[to] = self.received_bytes.get(to, 0) + len(data)
        for received in decode(data, max_bytes=MAX_MESSAGE_BYTES):
            inbox.send_nowait(received)


class AllReduceFellow:
    """One fellow's side of the sharded all-reduce of one stage (see the module doc)."""

    def __init__(self, name: str, roster: Sequence[str], sync: PartSync, net: PartNet,
                 inbox: trio.MemoryReceiveChannel[PartMessage], *, stage: int = 0,
                 round_deadline_s: float = 60.0, backup_every_rounds: int = 0,
                 owners: Sequence[str] | None = None) -> None:
        if name not in roster or len(set(roster)) != len(roster):
            raise ValueError(f"{name} must be in a roster of distinct names: {list(roster)}")
        if sync.parts != len(roster):
            raise ValueError(f"{sync.parts} parts for {len(roster)} fellows")
        self.name = name
        self.roster = tuple(roster)
        self.sync = sync
        self.net = net
        self.stage = stage
        self.round_deadline_s = round_deadline_s
        # every so many rounds a keeper sends its parts' outer state to its heir (0: never)
        self.backup_every_rounds = backup_every_rounds
        self.live = set(roster)
        # part j's keeper: roster[j] at first, or as the driver says (a fellow joining a
        # ring whose parts moved on)
        self.owners = list(roster if owners is None else owners)
        if len(self.owners) != len(roster) or any(o not in roster for o in self.owners):
            raise ValueError(f"owners {self.owners} are not one roster fellow per part")
        self.keepers: dict[int, PartKeeperPort] = {}
        self.dropped = 0  # malformed or misrouted messages
        self.rounds_applied = 0
        self._inbox = inbox
        self._updates: dict[int, dict[int, bytes]] = {}  # version -> part -> update
        self._history: dict[int, dict[int, bytes]] = {}  # applied versions, the same
        self._sent: dict[int, PartDelta] = {}  # this round's parts, until their update
        self._orphans: dict[int, dict[str, PartDelta]] = {}  # parts no keeper here yet
        self._backups: dict[int, PartState] = {}  # parts this fellow is the heir of
        self._taken: set[int] = set()  # parts it keeps since their keeper vanished
        self._changed = trio.Event()
        self._nursery: trio.Nursery | None = None

    # --- running ------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        """Receive part messages and close the parts this fellow keeps, until cancelled."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                now = trio.current_time()
                for j, owner in enumerate(self.owners):
                    if owner == self.name and j not in self.keepers:
                        self._keep(j, now)
                nursery.start_soon(self._close_loop)
                task_status.started()
                async for message in self._inbox:
                    self._receive(message)
        finally:
            self._nursery = None  # stopped: nothing more is sent

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def reduce(self, samples: int) -> int:
        """Send this round's delta (part by part to their keepers) and apply every part's
        update once all arrived; the version this fellow stands at after."""
        version, blobs = self.sync.take_parts()
        self._sent = {}
        for j, blob in enumerate(blobs):
            self._sent[j] = PartDelta(self.stage, j, version, self.name, samples, blob)
        for j in range(len(blobs)):
            await self._deliver(self._sent[j])
        while True:
            target = self.sync.version + 1
            got = self._updates.get(target, {})
            if len(got) == self.sync.parts:
                self._apply(target)
                if self.sync.version > version:
                    return self.sync.version
                continue
            await self._changed.wait()

    async def start(self, samples: int, run: Runner = inline) -> int:
        """Send this round's delta (part by part to their keepers) and return at once: the
        version it is anchored on. Its update arrives while the replica computes on;
        ``finish`` applies it (one round in flight, as Streaming DiLoCo overlaps them)."""
        version, blobs = await run(self.sync.take_parts)
        self._sent = {}
        for j, blob in enumerate(blobs):
            self._sent[j] = PartDelta(self.stage, j, version, self.name, samples, blob)
        for j in range(len(blobs)):
            await self._deliver(self._sent[j])
        return int(version)

    async def finish(self, version: int, run: Runner = inline) -> int:
        """Wait for every part's update past ``version`` and apply the updates held in
        order; the version this fellow stands at after. The caller bounds the wait."""
        while self.sync.version <= version:
            target = self.sync.version + 1
            if len(self._updates.get(target, {})) == self.sync.parts:
                await self._apply_with(target, run)
                continue
            await self._changed.wait()
        return self.sync.version

    def holds_update(self, version: int) -> bool:
        """Whether every part's update to ``version`` is here (applied or not)."""
        return len(self._history.get(version, self._updates.get(version, {}))) \
            == self.sync.parts

    def update_part(self, version: int, part: int) -> bytes | None:
        """Part ``part``'s update to ``version``, when this fellow still holds it."""
        return self._history.get(version, self._updates.get(version, {})).get(part)

    async def _apply_with(self, version: int, run: Runner) -> None:
        got = self._updates.pop(version)
        await run(partial(self.sync.apply_parts, version,
                          [got[j] for j in range(self.sync.parts)]))
        self._applied(version, got)

    def _apply(self, version: int) -> None:
        got = self._updates.pop(version)
        self.sync.apply_parts(version, [got[j] for j in range(self.sync.parts)])
        self._applied(version, got)

    def _applied(self, version: int, got: dict[int, bytes]) -> None:
        self.rounds_applied += 1
        self._history[version] = got
        for old in [v for v in self._history if v <= version - HISTORY_VERSIONS]:
            del self._history[old]
        self._sent = {j: d for j, d in self._sent.items() if d.version >= version}

    async def _deliver(self, message: PartDelta) -> None:
        owner = self.owners[message.part]
        if owner == self.name:
            self._receive(message)
        else:
            await self._send(owner, message)

    async def _send(self, to: str, message: PartMessage) -> None:
        try:
            await self.net.send(self.name, to, message)
        except (SwarmError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            log.info("all-reduce: %s could not reach %s: %s", self.name, to, exc)

    # --- the parts this fellow keeps --------------------------------------------------

    def _keep(self, part: int, now: float) -> None:
        backup = self._backups.pop(part, None)
        try:
            keeper = self.sync.keeper(part, now, None if backup is None else backup.blob)
        except SwarmError:  # a bad backup: start the part's momentum afresh
            self.dropped += 1
            keeper = self.sync.keeper(part, now)
        for name in sorted(self.live):
            keeper.join(name)
        self.keepers[part] = keeper
        for update_version in sorted(self._updates):  # passed on before it took over
            blob = self._updates[update_version].get(part)
            if blob is not None and update_version == keeper.version + 1:
                try:
                    keeper.adopt(update_version, blob)
                except SwarmError:
                    self.dropped += 1
                    break
                if self._nursery is not None:  # to those the vanished keeper missed
                    self._nursery.start_soon(
                        self._publish, PartUpdate(self.stage, part, update_version, blob))
        for delta in self._orphans.pop(part, {}).values():
            self._contribute(keeper, delta)

    async def _close_loop(self) -> None:
        while True:
            now = trio.current_time()
            for j in sorted(self.keepers):
                keeper = self.keepers[j]
                # past its deadline with nothing arrived, closing moves the deadline on
                if keeper.ready(now) or now >= keeper.next_deadline():
                    closed = keeper.close(now)
                    if closed is not None:
                        version, blob, _ = closed
                        await self._publish(PartUpdate(self.stage, j, version, blob))
                        await self._back_up(j, keeper, version)
            deadline = min((k.next_deadline() for k in self.keepers.values()),
                           default=now + self.round_deadline_s)
            with trio.move_on_at(max(deadline, now)):
                await self._changed.wait()

    async def _publish(self, update: PartUpdate) -> None:
        """A part's update to this fellow and every live one (in parallel: the keeper's
        uplink carries them one after another anyway)."""
        self._store(update)
        async with trio.open_nursery() as nursery:
            for name in self.roster:
                if name != self.name and name in self.live:
                    nursery.start_soon(self._send, name, update)

    async def _back_up(self, part: int, keeper: PartKeeperPort, version: int) -> None:
        """Every ``backup_every_rounds`` rounds, the part's outer state to its heir."""
        every = self.backup_every_rounds
        heir = self._heir(self.name)
        if every <= 0 or version % every or heir == self.name:
            return
        await self._send(heir, PartState(self.stage, part, version, keeper.outer_state()))

    def _contribute(self, keeper: PartKeeperPort, delta: PartDelta) -> None:
        try:
            keeper.contribute(delta.replica, delta.version, delta.blob, delta.samples,
                              trio.current_time())
        except SwarmError:
            self.dropped += 1
            return
        self._wake()

    # --- what arrives -----------------------------------------------------------------

    def _receive(self, message: PartMessage) -> None:
        if message.stage != self.stage or message.part >= self.sync.parts:
            self.dropped += 1
            return
        if isinstance(message, PartDelta):
            if message.replica not in self.roster:
                self.dropped += 1
                return
            if message.replica not in self.live:
                # back in the rounds (a replica placed again): its sender heard so first
                self.live.add(message.replica)
                for part_keeper in self.keepers.values():
                    part_keeper.join(message.replica)
            passed = self._history.get(message.version + 1, {}).get(message.part)
            if passed is not None and message.part in self._taken:
                # sent again to a new keeper: the vanished one closed its round with it,
                # and its sender lacks that update
                if self._nursery is not None:
                    self._nursery.start_soon(self._send, message.replica, PartUpdate(
                        self.stage, message.part, message.version + 1, passed))
                return
            keeper = self.keepers.get(message.part)
            if keeper is None:  # its sender already knows that this fellow keeps it
                self._orphans.setdefault(message.part, {})[message.replica] = message
                return
            missed = self.update_part(message.version + 1, message.part)
            if message.version < keeper.version and missed is not None \
                    and self._nursery is not None:
                # a late (or rejoining) fellow missed the update its round closed with
                self._nursery.start_soon(self._send, message.replica, PartUpdate(
                    self.stage, message.part, message.version + 1, missed))
            self._contribute(keeper, message)
        elif isinstance(message, PartState):
            held = self._backups.get(message.part)
            if held is None or message.version > held.version:
                self._backups[message.part] = message
        else:
            self._store(message)

    def _store(self, update: PartUpdate) -> None:
        """An update of one part: kept for when every part arrived; the first one of a
        (version, part) wins (a new keeper passes on what it adopted)."""
        version, part = update.version, update.part
        if not self.sync.version < version <= self.sync.version + HISTORY_VERSIONS + 1:
            if version > self.sync.version:
                self.dropped += 1
            return
        got = self._updates.setdefault(version, {})
        if part in got:
            return
        got[part] = update.blob
        keeper = self.keepers.get(part)
        if keeper is not None and version == keeper.version + 1:
            try:  # the round closed before its keeper vanished: pass that one on
                keeper.adopt(version, update.blob)
            except SwarmError:
                self.dropped += 1
                del got[part]
                return
            if self._nursery is not None:
                self._nursery.start_soon(self._publish, update)
        self._wake()

    # --- a fellow vanishing ------------------------------------------------------------

    def down(self, name: str) -> None:
        """Membership says ``name`` is gone: stop waiting for it, move the parts it kept
        to the next live fellow in the ring and tell that one what this fellow holds of
        the parts' open round."""
        if name not in self.live or name == self.name:
            return
        self.live.discard(name)
        for keeper in self.keepers.values():
            keeper.leave(name)
        for orphans in self._orphans.values():
            orphans.pop(name, None)
        now = trio.current_time()
        for j, owner in enumerate(self.owners):
            if owner != name:
                continue
            heir = self._heir(name)
            self.owners[j] = heir
            if heir == self.name:
                self._taken.add(j)
                self._keep(j, now)
            if self._nursery is not None:
                self._nursery.start_soon(self._tell_heir, j, heir)
        self._wake()

    def regroup(self, live: Collection[str], owners: Sequence[str]) -> None:
        """The driver's word on which fellows are in the rounds and who keeps each part:
        the gone ones leave (``down``: their parts move to the next live fellow, the same
        rule the driver applies), the new ones join the keepers' rounds, and any part the
        driver says moved elsewhere moves."""
        if len(owners) != len(self.owners) or any(o not in self.roster for o in owners):
            raise ValueError(f"owners {list(owners)} are not one roster fellow per part")
        wanted = set(live) | {self.name}
        for name in sorted(self.live - wanted):
            self.down(name)
        for name in sorted(wanted - self.live):
            if name in self.roster:
                self.live.add(name)
                for keeper in self.keepers.values():
                    keeper.join(name)
        now = trio.current_time()
        for j, owner in enumerate(owners):
            if owner == self.owners[j]:
                continue
            was, self.owners[j] = self.owners[j], owner
            if owner == self.name:
                self._taken.add(j)
                self._keep(j, now)
            elif was == self.name:
                self.keepers.pop(j, None)
        self._wake()

    def outer_states(self) -> dict[int, bytes]:
        """The outer state of every part this fellow keeps (``PartKeeper.outer_state``)."""
        return {j: self.keepers[j].outer_state() for j in sorted(self.keepers)}

    def seed(self, states: Mapping[int, bytes]) -> None:
        """Parts' outer state to start from (a resumed job's); taken by the keeper of
        each part here when it starts (``run``), or when a part moves here."""
        for part, blob in states.items():
            if 0 <= part < self.sync.parts:
                self._backups[part] = PartState(self.stage, part, self.sync.version, blob)

    def _heir(self, gone: str) -> str:
        i = self.roster.index(gone)
        for k in range(1, len(self.roster) + 1):
            name = self.roster[(i + k) % len(self.roster)]
            if name in self.live:
                return name
        return self.name

    async def _tell_heir(self, part: int, heir: str) -> None:
        """What this fellow holds of part ``part``'s recent rounds, to its new keeper: the
        updates it got (the keeper adopts them), else its delta again."""
        held = [(v, got[part]) for v, got in sorted({**self._history, **self._updates}.items())
                if part in got]
        messages: list[PartMessage] = [PartUpdate(self.stage, part, v, blob)
                                       for v, blob in held]
        delta = self._sent.get(part)
        if delta is not None and not any(v == delta.version + 1 for v, _ in held):
            messages.append(delta)
        for message in messages:
            if heir == self.name:
                if isinstance(message, PartDelta):  # its own updates it adopted already
                    self._receive(message)
            else:
                await self._send(heir, message)


__all__ = ["AllReduceFellow", "MemoryPartNet", "PartKeeperPort", "PartNet", "PartSync",
           "Runner", "inline"]
