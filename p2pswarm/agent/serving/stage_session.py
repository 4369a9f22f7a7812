"""A hosted stage serving sessions: the step loop, and relays to and from its neighbours.

The data path is a ring through the driver (``generation``): the driver opens a sealed
stream to stage 0, stage 0 one to stage 1, and so on; the last stage opens one back to
the driver. These streams stay open for the whole session. Each stage keeps its
session's KV cache; hidden states flow stage to stage as tensor frames; the last stage
samples (seeded) and sends the token straight to the driver.

Failures are named, never waited out. A stage that cannot reach its next hop, or loses
it, sends ``SessionError`` upstream; one that loses the hop before it sends it
downstream; both get relayed, so whichever end the driver hears first names the same
fellow.

Each stage's compute runs one call at a time (a per-stage ``CapacityLimiter(1)``) on a
worker thread, so a long prefill never stalls gossip and heartbeats; a decode step the
stage does in under ``INLINE_STEP_S`` runs on the trio thread: the loop can spare that
long, and handing a short step to a thread and back (two wake-ups) adds a millisecond
or more to every hop on a busy machine. With ``agent.compute.inline`` every call runs on
the trio thread: in virtual time (MockClock) a thread would let the clock jump while
torch works, so the simulation sets it and compute takes no virtual time at all.

Many sessions share a stage: decode steps waiting at once run as one batch
(``batching``), and a session that finds every KV slot taken waits for one (the driver's
queue keeps the wait short). A session the driver ends with ``keep`` leaves its cache in
its slot for its next turn (``SessionOpen.resume_from``); a new session evicts the least
recently kept when no slot is free.

A session whose stream breaks without a ``SessionEnd`` (a neighbour lost) is kept the same
way for a grace period (``interrupted``). When the driver resumes the generation after a
failover (``SessionOpen.recover``), a stage that still holds at least the positions it
resumes from continues there; one that does not (the moved stage) starts the session
afresh and says so (``fresh``, returned to the driver), and the driver replays the past
positions only through the stages up to the last fresh one (``StepInput.replay_stages``):
they need the activations of every stage before them, so those recompute theirs.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

import trio

from p2pswarm import wire
from p2pswarm.agent.serving.batching import DecodeBatcher
from p2pswarm.agent.serving.interrupted import InterruptedCaches
from p2pswarm.agent.serving.records import HostedStage
from p2pswarm.agent.serving.runtime import BatchStep, StageRuntime, Stepped
from p2pswarm.agent.streams import send_best_effort
from p2pswarm.errors import PlacementError, RemoteProtocolError, SwarmError, TransportError
from p2pswarm.wire.loads import RouteHop
from p2pswarm.wire.serving import (
    SessionEnd,
    SessionError,
    SessionOpen,
    SessionReturn,
    StepInput,
    StepOutput,
)

if TYPE_CHECKING:
    from p2pswarm.agent.serving.ports import SessionsPort, Streams
    from p2pswarm.transport.secure import SecureStream

T = TypeVar("T")

INLINE_STEP_S = 0.025  # decode steps faster than this skip the worker thread
SLOT_WAIT_S = 60.0  # the most a session waits at a stage for a KV slot to free


class StageSession:
    """One session at one stage: its two streams and, on the last stage, its sampler."""

    def __init__(self, msg: SessionOpen, hosted: HostedStage, upstream: SecureStream,
                 downstream: SecureStream) -> None:
        self.msg = msg
        self.hosted = hosted
        self.upstream = upstream
        self.downstream = downstream
        self.ending = False
        self.ended = False  # the driver ended it (SessionEnd): not a broken stream
        self.failed = False  # this stage's compute failed: nothing to resume from
        self.keep = False  # the driver ended it with keep: leave its cache for a next turn
        self.scope: trio.CancelScope | None = None
        self.sampler: Any = None


async def open_hop(agent: Streams, hop: RouteHop) -> SecureStream:
    """A stream to the fellow a route names, checked to be that fellow."""
    stream = await agent.open_secure(hop.addr)
    if stream.peer_node_id.hex() != hop.fellow_id:
        await stream.aclose()
        raise TransportError(f"{hop.addr} is no longer {hop.fellow}")
    return stream


class StageSessions:
    def __init__(self, agent: SessionsPort, runtime: StageRuntime,
                 hosted: dict[tuple[str, int], HostedStage]) -> None:
        self.agent = agent
        self.runtime = runtime
        self.hosted = hosted
        self.session_idle_s = 600.0  # a stage drops a session whose driver fell silent
        self.prefill_tokens = 0  # positions of prompts this fellow's first stages ran
        self.positions_run: Counter[tuple[str, int]] = Counter()  # per (plan, stage)
        self.interrupted = InterruptedCaches(agent)
        self._running: dict[tuple[str, int, str], StageSession] = {}
        self._batchers: dict[tuple[str, int], tuple[HostedStage, DecodeBatcher[Any, Any]]] = {}
        self._freed: dict[tuple[str, int], trio.Event] = {}  # a slot freed at that stage
        agent.on_stream(SessionOpen, self._on_session_open)

    def batcher(self, hosted: HostedStage) -> DecodeBatcher[Any, Any]:
        """The decode batcher of a hosted stage (a new one for a stage loaded again)."""
        key = (hosted.order.plan_id, hosted.order.stage)
        known = self._batchers.get(key)
        if known is None or known[0] is not hosted:
            batcher: DecodeBatcher[Any, Any] = DecodeBatcher(
                partial(self._decode_one, hosted), partial(self._decode_batch, hosted))
            self._batchers[key] = known = (hosted, batcher)
        return known[1]

    async def _room(self, hosted: HostedStage, session: str) -> bool:
        """Wait (bounded) until ``session`` can take a KV slot at this stage: a session
        that just ended upstream may not have ended here yet."""
        key = (hosted.order.plan_id, hosted.order.stage)
        with trio.move_on_after(SLOT_WAIT_S):
            while True:
                stage = hosted.stage
                if stage is None or stage.has_room(session):
                    return True
                await self._freed.setdefault(key, trio.Event()).wait()
        return False

    async def _ended(self, hosted: HostedStage, session: str) -> None:
        """Wait (bounded) until ``session``'s earlier run at this stage has ended."""
        key = (hosted.order.plan_id, hosted.order.stage)
        with trio.move_on_after(SLOT_WAIT_S):
            while session in hosted.sessions:
                await self._freed.setdefault(key, trio.Event()).wait()

    async def _recover(self, hosted: HostedStage, msg: SessionOpen) -> bool:
        """A generation resumed after a failover: take the session back from its cache
        when this stage holds at least ``resume_from`` of its positions, else start it
        afresh. Its earlier run here may not have noticed the break yet (a frozen
        neighbour keeps its streams open): that run ends now. False: no slot came free."""
        running = self._running.get(self.interrupted.key(hosted, msg.session))
        if running is not None and running.scope is not None:
            self.interrupted.taken_over += 1
            running.scope.cancel()
        await self._ended(hosted, msg.session)
        self.interrupted.claim(hosted, msg.session)
        stage = hosted.stage
        if stage is None or msg.session in hosted.sessions:  # that run never ended
            return False
        session = msg.session

        def resume() -> bool:
            if stage.resume_session(session, msg.resume_from):
                return True
            stage.end_session(session)  # too short, or none: never a stale cache
            return False

        async with hosted.limiter:
            if resume():
                return True
        return await self._room(hosted, session)

    def _slot_freed(self, hosted: HostedStage) -> None:
        event = self._freed.pop((hosted.order.plan_id, hosted.order.stage), None)
        if event is not None:
            event.set()

    async def _on_session_open(self, msg: SessionOpen, upstream: SecureStream) -> None:
        """Host one session at one stage: open the next hop, then run steps until the
        session ends or fails. The stream is this handler's until it returns."""
        hosted = self.hosted.get((msg.plan_id, msg.stage))
        me = self.agent.name
        if hosted is None or hosted.state != "active" or hosted.stage is None:
            await send_best_effort(upstream, SessionError(
                msg.stage, me, f"holds no stage {msg.stage} of plan {msg.plan_id} (unloaded?)"))
            return
        stage = hosted.stage
        fresh = msg.fresh
        if msg.recover:
            if not await self._recover(hosted, msg):
                await send_best_effort(upstream, SessionError(
                    msg.stage, me, f"had no free session slot for {SLOT_WAIT_S:g} s"))
                return
            if msg.session not in stage.sessions:
                fresh = (*msg.fresh, msg.stage)[:256]
        elif msg.resume_from > 0:
            # the turn before may still be ending here (its SessionEnd is on its way)
            await self._ended(hosted, msg.session)
            self.interrupted.claim(hosted, msg.session)
            async with hosted.limiter:
                resumed = stage.resume_session(msg.session, msg.resume_from)
            if not resumed:
                await send_best_effort(upstream, SessionError(
                    msg.stage, me, f"no longer keeps session {msg.session}'s cache",
                    evicted=True))
                return
        elif not await self._room(hosted, msg.session):
            await send_best_effort(upstream, SessionError(
                msg.stage, me, f"had no free session slot for {SLOT_WAIT_S:g} s"))
            return
        nxt = hosted.next_hop
        try:
            if nxt is not None:
                downstream = await open_hop(self.agent, nxt)
                await downstream.send_frame(wire.encode(SessionOpen(
                    msg.session, msg.plan_id, msg.stage + 1, msg.return_addr, msg.temperature,
                    msg.top_k, msg.top_p, msg.seed, msg.keep_logits, msg.resume_from,
                    msg.recover, fresh)))
            else:
                downstream = await self.agent.open_secure(msg.return_addr)
                await downstream.send_frame(wire.encode(SessionReturn(msg.session, fresh)))
        except SwarmError as exc:
            blame = (msg.stage + 1, nxt.fellow) if nxt is not None else (msg.stage, me)
            await send_best_effort(upstream, SessionError(
                blame[0], blame[1], f"is unreachable from {me}: {exc}"[:500]))
            # a cache taken back for this run is kept again, for the driver's next try
            await self.interrupted.keep(hosted, msg.session)
            return
        session = StageSession(msg, hosted, upstream, downstream)
        hosted.sessions.add(msg.session)
        running = self.interrupted.key(hosted, msg.session)
        self._running[running] = session
        try:
            async with trio.open_nursery() as nursery:
                session.scope = nursery.cancel_scope
                nursery.start_soon(self._relay_from_downstream, session)
                await self._run_steps(session)
                session.ending = True
                nursery.cancel_scope.cancel()
        finally:
            self.batcher(hosted).leave(msg.session)
            with trio.CancelScope(shield=True):
                # a kept session is kept before its stream downstream closes: the last
                # stage's close tells the driver the turn is over, and the next turn's
                # SessionOpen (``_ended``) must find the cache kept, not yet in use
                if not session.keep:
                    await downstream.aclose()
                held = hosted.stage
                if self._running.get(running) is session:
                    del self._running[running]
                if held is not None and msg.session in held.sessions:
                    if not (session.ended or session.failed):  # broken: may be resumed
                        await self.interrupted.keep(hosted, msg.session)
                    else:
                        end = held.keep_session if session.keep else held.end_session
                        await self.agent.compute.run(lambda: end(msg.session),
                                                     hosted.limiter)
                hosted.sessions.discard(msg.session)
                if session.keep:
                    await downstream.aclose()
                self._slot_freed(hosted)

    async def _run_steps(self, s: StageSession) -> None:
        hosted, me = s.hosted, self.agent.name
        max_bytes = self.agent.config.transport.max_frame_bytes
        while True:
            try:
                with trio.fail_after(self.session_idle_s):
                    frame = await s.upstream.receive_frame()
                (msg,) = wire.decode(frame, max_bytes=max_bytes)
            except (TransportError, RemoteProtocolError, ValueError, trio.TooSlowError) as exc:
                prev = hosted.previous_hop
                if prev is not None:  # the driver's own end needs no word
                    why = (f"fell silent (nothing for {me} in {self.session_idle_s:g} s)"
                           if isinstance(exc, trio.TooSlowError)
                           else f"went away (its stream to {me} broke)")
                    await send_best_effort(s.downstream, SessionError(prev.stage,
                                                                   prev.fellow, why))
                return
            if isinstance(msg, StepInput):
                try:
                    if msg.step > 0:
                        out = await self.batcher(hosted).step((s, msg), s.msg.session)
                    else:
                        out = await self._run_step(hosted, partial(self._compute, s, msg),
                                                   decode=False)
                except (SwarmError, RuntimeError, ValueError) as exc:
                    # a stage released under the session (the load moved, or was
                    # unloaded) is a lost stage for the driver to heal, not a failure
                    released = hosted.state == "released"
                    s.failed = not released
                    why = "released the stage" if released else f"failed: {exc}"
                    error = SessionError(hosted.order.stage, me, why[:500])
                    await send_best_effort(s.upstream, error)
                    await send_best_effort(s.downstream, error)
                    return
                if out is None:
                    continue
                try:
                    await s.downstream.send_frame(out)
                except TransportError:
                    await self._lost_downstream(s)
                    return
            elif isinstance(msg, SessionEnd):
                s.ending = s.ended = True
                s.keep = msg.keep
                await send_best_effort(s.downstream, msg)
                return
            elif isinstance(msg, SessionError):
                await send_best_effort(s.downstream, msg)  # relay towards the driver
                return
            else:
                return

    async def _run_step(self, hosted: HostedStage, compute: Callable[[], T], *,
                        decode: bool) -> T:
        """A decode step this stage has been doing in under ``INLINE_STEP_S`` runs on the
        trio thread (see the module's comment); prompt chunks and slow steps go to the
        worker thread."""
        if decode and hosted.decode_s < INLINE_STEP_S and not self.agent.compute.inline:
            async with hosted.limiter:
                return compute()
        return await self.agent.compute.run(compute, hosted.limiter)

    def _sampler(self, s: StageSession, msg: StepInput, is_last: bool) -> Any:
        if not (is_last and msg.final):
            return None
        if s.sampler is None:
            m = s.msg
            s.sampler = self.runtime.sampler(m.temperature, m.top_k, m.top_p, m.seed)
        return s.sampler

    def _compute(self, s: StageSession, msg: StepInput) -> bytes | None:
        """One chunk through this stage (on the stage's worker): the frame to send on."""
        stage = s.hosted.stage
        if stage is None:
            raise PlacementError("the stage was unloaded")
        began = time.perf_counter()
        if msg.replay_stages and msg.position == 0 and s.msg.session in stage.sessions:
            # a stage before the last that must rebuild recomputes its outputs for the
            # past positions (it kept no activations): its cache is rebuilt with them
            stage.end_session(s.msg.session)
        out = self.runtime.step(stage, s.msg.session, msg.tensor, msg.position,
                                self._sampler(s, msg, stage.is_last), s.msg.keep_logits)
        self.positions_run[(s.hosted.order.plan_id, s.hosted.order.stage)] += out.tokens
        if msg.step > 0:  # a decode step: how long this stage takes for one (smoothed)
            _smooth_decode_s(s.hosted, out.forward_s)
        elif s.hosted.order.stage == 0:
            self.prefill_tokens += out.tokens
        return self._output(stage.is_last, msg, out, time.perf_counter() - began,
                            s.hosted.order.stage)

    async def _decode_one(self, hosted: HostedStage, item: tuple[StageSession, StepInput]
                          ) -> bytes | None:
        return await self._run_step(hosted, partial(self._compute, *item), decode=True)

    async def _decode_batch(self, hosted: HostedStage,
                            items: list[tuple[StageSession, StepInput]]) -> list[bytes | None]:
        return await self._run_step(hosted, partial(self._compute_batch, hosted, items),
                                    decode=True)

    def _compute_batch(self, hosted: HostedStage,
                       items: list[tuple[StageSession, StepInput]]) -> list[bytes | None]:
        """Several sessions' decode steps as one forward (on the stage's worker)."""
        stage = hosted.stage
        if stage is None:
            raise PlacementError("the stage was unloaded")
        began = time.perf_counter()
        steps = [BatchStep(s.msg.session, msg.tensor, msg.position,
                           self._sampler(s, msg, stage.is_last), s.msg.keep_logits)
                 for s, msg in items]
        outs = self.runtime.step_batch(stage, steps)
        self.positions_run[(hosted.order.plan_id, hosted.order.stage)] += len(outs)
        if outs:
            _smooth_decode_s(hosted, outs[0].forward_s)  # how long the batch holds the loop
        took = time.perf_counter() - began
        return [self._output(stage.is_last, msg, out, took, hosted.order.stage)
                for (_, msg), out in zip(items, outs)]

    @staticmethod
    def _output(is_last: bool, msg: StepInput, out: Stepped, took: float,
                index: int) -> bytes | None:
        stage_s = msg.stage_s + (took,)
        if msg.replay_stages and index + 1 >= msg.replay_stages:
            return None  # a replayed chunk stops at the last stage that rebuilds
        if not is_last:
            return wire.encode(StepInput(msg.step, msg.position, msg.final, stage_s, out.frame,
                                         msg.replay_stages))
        if out.token is None:
            return None  # a prompt chunk before the last: its cache is what counts
        return wire.encode(StepOutput(msg.step, out.token, stage_s, out.logits))


    async def _relay_from_downstream(self, s: StageSession) -> None:
        """Errors coming back from the next hop go upstream; so does its loss."""
        max_bytes = self.agent.config.transport.max_frame_bytes
        try:
            frame = await s.downstream.receive_frame()
            (msg,) = wire.decode(frame, max_bytes=max_bytes)
        except (TransportError, RemoteProtocolError, ValueError):
            if not s.ending:
                await self._lost_downstream(s)
            msg = None
        if isinstance(msg, SessionError):
            await send_best_effort(s.upstream, msg)
        if s.scope is not None:
            s.scope.cancel()

    async def _lost_downstream(self, s: StageSession) -> None:
        nxt = s.hosted.next_hop
        if nxt is not None:  # the last stage losing the driver has no one to tell
            await send_best_effort(s.upstream, SessionError(
                nxt.stage, nxt.fellow, f"went away (its stream from {self.agent.name} "
                "broke)"))
        if s.scope is not None:
            s.scope.cancel()


def _smooth_decode_s(hosted: HostedStage, took: float) -> None:
    """How long this stage takes for one decode step (smoothed): decides inline or not."""
    h = hosted
    h.decode_s = took if math.isinf(h.decode_s) else 0.8 * h.decode_s + 0.2 * took
