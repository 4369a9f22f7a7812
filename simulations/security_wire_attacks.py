"""What a rogue fellow holding the swarm's key can make a victim pay on the wire and the
transport: its event-loop lag and its memory, attack by attack.

    python simulations/security_wire_attacks.py [--json] [--quick]
    python simulations/bench_security.py --only wire

The victim is a live ``Agent`` on real loopback sockets in this process; the rogue holds
the swarm key and an identity of its own, so its streams and datagrams are authenticated.
Attacks:

- every wire message type at its schema's extremes (longest strings and bytes, most
  items, largest ints, nested structs at theirs), within 16 MiB a stream frame and one
  datagram's size, each sent over a sealed stream and as a sealed datagram;
- for every message type, 1 MiB of ``0x90`` (empty arrays) and 100,000 nested arrays
  where its fields belong, and once 16 MiB of ``0x90`` (the frame that cost +1.2 GB and
  28 s before the codec read kinds and sizes first);
- 12 sealed streams each holding back the last byte of a 48 MiB frame;
- a stranger holding every handshake slot from 64 source addresses 127.0.0.x, and a
  fellow then opening a stream (it must get in).

Each attack runs twice. The first time measures loop lag: the longest step any of the
victim's tasks took (a trio instrument: the time the loop could do nothing else), in CPU
time of the thread, so that other programs on a busy machine do not count. The second
measures memory: tracemalloc's peak over the attack (started with it, so what was there
before does not count; tracemalloc slows allocations several times, which is why it is
off the first time). Targets: 100 ms and 64 MiB, per attack.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import random
import time
import tracemalloc
import types
import typing
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import trio
import trio.lowlevel

from p2pswarm import wire
from p2pswarm.agent import Agent
from p2pswarm.agent.world import AgentWorld
from p2pswarm.config import SwarmConfig, local, split_addr
from p2pswarm.errors import SwarmError
from p2pswarm.security import DatagramSealer, Identity, Keyring, SwarmSecret
from p2pswarm.transport.secure import SecureStream, secure_connect
from p2pswarm.transport.udp_tcp import TcpStream, UdpTcpTransport, open_udp_tcp_transport
from p2pswarm.wire import codec
from p2pswarm.wire import layout as lay
from p2pswarm.wire.schema import Items, Range, Size

MIB = 1024 * 1024
LAG_TARGET_S = 0.100
MEMORY_TARGET_BYTES = 64 * MIB
STREAM_EXTREME_BYTES = 16 * MIB  # the extremes of a kind whose schema allows more: cut here
SECRET = SwarmSecret(bytes(range(32)))
REPLY_WAIT_S = 0.5  # a stream the victim neither answers nor closes: given up after this


@dataclass(frozen=True, slots=True)
class Cost:
    attack: str
    lag_s: float  # the longest step the victim's tasks took meanwhile
    memory_bytes: int  # tracemalloc's peak above the start of the attack
    outcome: str  # what the victim did with it
    wall_s: float = 0.0  # how long the attack took, start to end

    @property
    def met(self) -> bool:
        return self.lag_s <= LAG_TARGET_S and self.memory_bytes <= MEMORY_TARGET_BYTES


# --- messages at their schema's extremes -------------------------------------------------


def extreme(cls: type, budget_bytes: int) -> Any:
    """A ``cls`` message with every field at its schema's extremes, its encoding within
    about ``budget_bytes`` (tuples get fewer items, strings and bytes fewer, when the
    schema allows more). Built without ``__init__``: a rogue's message need not make sense,
    only pass the codec."""
    return _struct(cls, budget_bytes)


def _largest(tp: Any) -> int:
    return lay.largest_bytes(codec._layout(tp))


def _struct(cls: type, budget: int) -> Any:
    hints = typing.get_type_hints(cls, include_extras=True)
    fields = dataclasses.fields(cls)
    largest = [_largest(hints[f.name]) for f in fields]
    total = sum(largest) or 1
    obj = object.__new__(cls)
    for f, most in zip(fields, largest):
        share = most if total <= budget else max(16, most * budget // total)
        object.__setattr__(obj, f.name, _value(hints[f.name], (), min(most, share)))
    return obj


def _value(tp: Any, meta: tuple[Any, ...], budget: int) -> Any:  # noqa: C901 - one a type
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        base, *extra = typing.get_args(tp)
        return _value(base, meta + tuple(extra), budget)
    if origin in (typing.Union, types.UnionType):
        (inner,) = [a for a in typing.get_args(tp) if a is not type(None)]
        return _value(inner, meta, budget)
    if origin is tuple:
        item_tp = typing.get_args(tp)[0]
        most = next((m.high for m in meta if isinstance(m, Items)), codec.DEFAULT_ITEMS)
        item_bytes = max(1, _largest(item_tp))
        count = min(most, max(1, (budget - 5) // item_bytes))
        item = _value(item_tp, (), max(16, min(item_bytes, (budget - 5) // count)))
        return tuple([item] * count)
    if tp is bool:
        return True
    if tp is int:
        rng = next((m for m in meta if isinstance(m, Range)), Range(-(2**63), 2**64 - 1))
        return int(rng.high)
    if tp is float:
        rng = next((m for m in meta if isinstance(m, Range)), Range(-1e300, 1e300))
        return float(rng.high)
    if tp is str or tp is bytes:
        default = codec.DEFAULT_STR_CHARS if tp is str else codec.DEFAULT_BYTES
        size = next((m for m in meta if isinstance(m, Size)), Size(0, default))
        n = max(size.low, min(size.high, budget - 5))
        return "x" * n if tp is str else b"\xff" * n
    return _struct(tp, budget)


def extreme_frame(cls: type, budget_bytes: int) -> bytes | None:
    """The encoded extreme ``cls`` within ``budget_bytes``; None when none fits."""
    budget = budget_bytes
    while budget >= 64:
        try:
            data = wire.encode(extreme(cls, budget))
        except SwarmError:
            return None
        if len(data) <= budget_bytes:
            return data
        budget = budget * 3 // 4
    return None


def hostile_body(tag: int, body: bytes) -> bytes:
    """An envelope naming ``tag`` whose fields are ``body``, whatever that holds."""
    return bytes([0x93, wire.PROTOCOL_MAJOR, wire.PROTOCOL_MINOR, 0x91, 0x92]) \
        + _uint(tag) + body


def _uint(n: int) -> bytes:
    return bytes([n]) if n < 0x80 else bytes([0xcc, n]) if n < 0x100 else \
        bytes([0xcd]) + n.to_bytes(2, "big")


def empty_arrays(tag: int, count: int) -> bytes:
    return hostile_body(tag, b"\xdd" + count.to_bytes(4, "big") + b"\x90" * count)


def nested_arrays(tag: int, depth: int) -> bytes:
    return hostile_body(tag, b"\x91" * depth + b"\x90")


# --- measuring the victim ----------------------------------------------------------------


class StepTimer(trio.abc.Instrument):
    """The longest step any task under ``root`` took since ``reset``."""

    def __init__(self, root: trio.lowlevel.Task) -> None:
        self._root = root
        self._mine: dict[trio.lowlevel.Task, bool] = {}
        self._began: float | None = None
        self.longest_s = 0.0

    def _is_mine(self, task: trio.lowlevel.Task) -> bool:
        known = self._mine.get(task)
        if known is None:
            up: trio.lowlevel.Task | None = task
            while up is not None and up is not self._root:
                nursery = up.parent_nursery
                up = nursery.parent_task if nursery is not None else None
            known = self._mine[task] = up is self._root
        return known

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self._began = time.thread_time() if self._is_mine(task) else None

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        if self._began is not None:
            self.longest_s = max(self.longest_s, time.thread_time() - self._began)
            self._began = None

    def task_exited(self, task: trio.lowlevel.Task) -> None:
        self._mine.pop(task, None)

    def reset(self) -> None:
        self.longest_s = 0.0


@dataclass
class Scene:
    victim: Agent
    victim_transport: UdpTcpTransport
    rogue_transport: UdpTcpTransport
    rogue_identity: Identity
    sealer: DatagramSealer
    timer: StepTimer

    def drops(self) -> dict[str, int]:
        return dict(self.victim.counters.drops)


@asynccontextmanager
async def scene() -> AsyncIterator[Scene]:
    """A victim agent on loopback (its tasks timed) and a rogue's transport beside it."""
    config = local()
    ready: list[Scene] = []
    # What the process held before the victim (a test worker's heap, a thousand tests
    # deep) is not the victim's: a full collection walking it would be charged to
    # whichever victim step it fell in.
    gc.collect()
    gc.freeze()
    try:
        async with _victim_beside_rogue(config, ready) as s:
            yield s
    finally:
        gc.unfreeze()


@asynccontextmanager
async def _victim_beside_rogue(config: SwarmConfig, ready: list[Scene]) -> AsyncIterator[Scene]:
    async with open_udp_tcp_transport("127.0.0.1:0", config.transport) as rogue_t, \
            trio.open_nursery() as nursery:
        async def victim_root(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
            timer = StepTimer(trio.lowlevel.current_task())
            trio.lowlevel.add_instrument(timer)
            try:
                async with open_udp_tcp_transport("127.0.0.1:0", config.transport) as t, \
                        trio.open_nursery() as inner:
                    agent = Agent(AgentWorld(
                        name="victim", transport=t, keyring=Keyring([SECRET]),
                        identity=Identity.generate(), config=config, epoch=1,
                        rng=random.Random(1)))
                    await inner.start(agent.run)
                    rogue = Identity.generate()
                    ready.append(Scene(agent, t, rogue_t, rogue,
                                       DatagramSealer(Keyring([SECRET]), rogue.node_id, 1),
                                       timer))
                    task_status.started()
            finally:
                trio.lowlevel.remove_instrument(timer)

        await nursery.start(victim_root)
        yield ready[0]
        nursery.cancel_scope.cancel()


async def measure(s: Scene, attack: str, run: Callable[[], Awaitable[str]],
                  traced: bool) -> Cost:
    """Run one attack: the victim's longest step meanwhile, or (``traced``) the memory
    peak over it."""
    await trio.sleep(0.002)  # let the victim settle what came before
    s.timer.reset()
    if traced:
        tracemalloc.start()
    began = time.perf_counter()
    try:
        outcome = await run()
        await trio.sleep(0.002)
        peak = tracemalloc.get_traced_memory()[1] if traced else 0
    finally:
        if traced:
            tracemalloc.stop()
    return Cost(attack, s.timer.longest_s, peak, outcome, time.perf_counter() - began)


async def twice(attack: Callable[[bool], Awaitable[Cost]]) -> Cost:
    """The attack's lag untraced, its memory traced."""
    timed, traced = await attack(False), await attack(True)
    return dataclasses.replace(timed, memory_bytes=traced.memory_bytes)


def _drop_delta(before: dict[str, int], after: dict[str, int]) -> str:
    changed = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
    return ", ".join(f"{k} {v}" for k, v in sorted(changed.items())) or "taken"


async def _secure(s: Scene) -> SecureStream:
    raw = await s.rogue_transport.open_stream(s.victim_transport.local_addr)
    return await secure_connect(raw, Keyring([SECRET]), s.rogue_identity, 5.0)


async def stream_attack(s: Scene, name: str, plaintext: bytes, traced: bool) -> Cost:
    """One frame on a fresh sealed stream (sealed before the clock starts)."""
    stream = await _secure(s)
    sealed = stream._cipher.seal_frame(plaintext)
    raw = stream._stream

    async def run() -> str:
        before = s.drops()
        try:
            await raw.send_frame(sealed)
            with trio.move_on_after(REPLY_WAIT_S):
                await raw.receive_frame()
        except SwarmError:
            pass
        await raw.aclose()
        return _drop_delta(before, s.drops())

    return await measure(s, name, run, traced)


async def datagram_attack(s: Scene, name: str, plaintext: bytes, traced: bool) -> Cost:
    packet = s.sealer.seal(plaintext)
    host, port = split_addr(s.victim_transport.local_addr)

    async def run() -> str:
        before, seen = s.drops(), s.victim.counters.datagrams_in
        await s.rogue_transport._udp.sendto(packet, (host, port))
        with trio.move_on_after(2.0):
            while s.victim.counters.datagrams_in == seen:
                await trio.sleep(0.001)
        return _drop_delta(before, s.drops())

    return await measure(s, name, run, traced)


async def held_back_frames(s: Scene, traced: bool, streams: int = 12,
                           frame_bytes: int = 48 * MIB) -> Cost:
    """``streams`` sealed streams each send a ``frame_bytes`` frame but its last byte."""
    opened = [await _secure(s) for _ in range(streams)]
    body = bytes(frame_bytes - 1)  # the rogue's bytes, shared and made before the clock
    host_key = ("host", "127.0.0.1")

    async def run() -> str:
        async def send_all_but_one(stream: SecureStream) -> None:
            raw = stream._stream
            assert isinstance(raw, TcpStream)
            await raw._sock.send(frame_bytes.to_bytes(4, "big"))
            view = memoryview(body)
            while view:  # the raw socket: the frame is never finished
                view = view[await raw._sock.send(view[:MIB]):]

        held = s.victim_transport.held_bytes

        def arrived() -> int:  # what the victim has allocated for the frames so far
            return sum(t.held_frame_bytes for t in s.victim_transport._accepted)

        async with trio.open_nursery() as senders:
            for stream in opened:
                senders.start_soon(send_all_but_one, stream)
            deadline = trio.current_time() + 30
            while (s.victim_transport.counters.get("frame_budget_waits", 0) < streams - 1
                   or arrived() < frame_bytes) and trio.current_time() < deadline:
                await trio.sleep(0.01)
            await trio.sleep(0.2)  # and a while longer: nothing more is taken
            reserved, holding = held.held(host_key), arrived()
            waits = s.victim_transport.counters.get("frame_budget_waits", 0)
            senders.cancel_scope.cancel()
        for stream in opened:
            await stream.aclose()
        return (f"{reserved / MIB:.0f} MiB reserved, {holding / MIB:.0f} MiB held, "
                f"{waits} streams waiting")

    return await measure(s, f"{streams} streams holding back a {frame_bytes // MIB} MiB "
                            "frame's last byte", run, traced)


async def handshake_slot_flood(s: Scene, traced: bool, sources: int = 64) -> Cost:
    """A stranger holds every handshake slot from ``sources`` addresses 127.0.0.x (two
    connections each, kept open, never a hello); then a fellow opens a stream."""
    host, port = split_addr(s.victim_transport.local_addr)
    per_source = max(2, s.victim.config.transport.max_unauthenticated_streams // sources)
    socks: list[trio.socket.SocketType] = []

    async def run() -> str:
        for i in range(sources):
            for _ in range(per_source):
                sock = trio.socket.socket()
                await sock.bind((f"127.0.0.{2 + i}", 0))
                await sock.connect((host, port))
                socks.append(sock)
        await trio.sleep(0.2)  # all accepted: the slots are full
        began = trio.current_time()
        try:
            stream = await _secure(s)
            await stream.aclose()
            joined = f"a fellow got in after {1000 * (trio.current_time() - began):.0f} ms"
        except SwarmError as exc:
            joined = f"a fellow was kept out: {exc}"
        counters = s.victim_transport.counters
        return (f"{joined}; {counters['handshakes_evicted']} evicted, "
                f"{counters['streams_refused_busy']} refused")

    try:
        return await measure(s, f"handshake slots held from {sources} source addresses", run,
                             traced)
    finally:
        for sock in socks:
            sock.close()


# --- the whole run ----------------------------------------------------------------------


async def run_attacks(quick: bool = False, *, kinds: list[type] | None = None) -> list[Cost]:
    """Every attack in turn against one victim; ``quick`` (for tests) cuts extremes at
    256 KiB and junk at 128 KiB, and leaves out the 16 and 48 MiB frames."""
    import p2pswarm.control.requests  # noqa: F401  (registers the control messages too)

    costs: list[Cost] = []
    async with scene() as s:
        stream_budget = s.victim.config.transport.max_frame_bytes - 64
        datagram_budget = s.victim.config.transport.max_datagram_bytes - 64
        for tag, cls in sorted(wire.message_types().items()):
            if kinds is not None and cls not in kinds:
                continue
            name = f"{cls.__name__} ({tag})"
            frame = extreme_frame(cls, min(stream_budget, 256 * 1024 if quick
                                           else STREAM_EXTREME_BYTES))
            if frame is not None:
                costs.append(await twice(partial(
                    stream_attack, s, f"{name} at its extremes, {len(frame) / MIB:.2f} MiB",
                    frame)))
            small = extreme_frame(cls, datagram_budget)
            if small is not None:
                costs.append(await twice(partial(
                    datagram_attack, s, f"{name} at its extremes, datagram", small)))
            junk = 128 * 1024 if quick else MIB  # above codec.SMALL_FRAME_BYTES: skimmed
            costs.append(await twice(partial(
                stream_attack, s, f"{name} with {junk // 1024} KiB of 0x90",
                empty_arrays(tag, junk))))
            costs.append(await twice(partial(
                stream_attack, s, f"{name} nested 100,000 deep", nested_arrays(tag, 100_000))))
        if not quick:
            from p2pswarm.wire.serving import StepInput

            costs.append(await twice(partial(
                stream_attack, s, "16 MiB of 0x90 as a StepInput",
                empty_arrays(wire.tag_of(StepInput), 16 * MIB))))
            costs.append(await twice(partial(held_back_frames, s)))
        costs.append(await twice(partial(handshake_slot_flood, s)))
    return costs


Row = tuple[str, str, str, bool]


def rows(costs: list[Cost]) -> list[Row]:
    """Table rows for bench_security.py: the worst attack on each figure, then every
    attack that missed a target."""
    worst_lag = max(costs, key=lambda c: c.lag_s)
    worst_mem = max(costs, key=lambda c: c.memory_bytes)
    out: list[Row] = [
        (f"wire: victim's loop lag, worst of {len(costs)} rogue attacks ({worst_lag.attack})",
         f"{worst_lag.lag_s * 1000:.1f} ms", "<= 100 ms", worst_lag.lag_s <= LAG_TARGET_S),
        (f"wire: victim's memory growth, worst of {len(costs)} ({worst_mem.attack})",
         f"{worst_mem.memory_bytes / MIB:.1f} MiB", "<= 64 MiB",
         worst_mem.memory_bytes <= MEMORY_TARGET_BYTES),
    ]
    named = [c for c in costs if c.attack.startswith(("16 MiB", "12 streams", "handshake"))]
    for c in named + [c for c in costs if not c.met and c not in named]:
        out.append((f"wire: {c.attack}: lag, memory ({c.outcome})",
                    f"{c.lag_s * 1000:.1f} ms, {c.memory_bytes / MIB:.1f} MiB",
                    "<= 100 ms, <= 64 MiB", c.met))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quick", action="store_true",
                        help="256 KiB extremes, without the 16 and 48 MiB frames")
    parser.add_argument("--all", action="store_true", help="print every attack's row")
    args = parser.parse_args()
    costs = trio.run(run_attacks, args.quick)
    if args.json:
        print(json.dumps([dataclasses.asdict(c) | {"met": c.met} for c in costs], indent=2))
        return
    for c in costs if args.all else [c for c in costs if not c.met] + costs[-3:]:
        print(f"{c.attack:<64} {c.lag_s * 1000:8.1f} ms {c.memory_bytes / MIB:8.1f} MiB "
              f"{c.wall_s:6.2f} s"
              f"{'' if c.met else '  MISSED'}  {c.outcome}")
    for figure, value, target, met in rows(costs):
        print(f"{figure}: {value} (target {target}){'' if met else '  MISSED'}")


if __name__ == "__main__":
    main()
