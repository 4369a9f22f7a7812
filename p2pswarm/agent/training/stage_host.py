"""A fellow hosting training stages: the leader's orders, the control and data streams.

``TrainPrepare`` asks this fellow to take one stage of a replica: it checks its own live
view first (the order is for it, the card still offered, enough memory free after what it
already promised, not serving a load on that card) and builds the stage (through the
``TrainRuntime``), or refuses with why. ``TrainRelease`` lets go of a job's stages (of one
replica, of its placements up to a generation).

The driver then opens a control stream (``TrainOpen`` role ``control``); this fellow
opens a data stream on to the next stage of the replica (role ``data``) and answers the
driver's commands, each its own message type, until ``Stop``. A step (``StepRun``) takes
the driver's inputs (first stage) and targets (last stage), runs forwards and backwards
in the order the pipeline schedule gives this stage, activations down the data stream
and gradients back up it, reports its squared gradient norm and losses, and takes the
optimizer step with the driver's clip coefficient (``StepApply``).
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Awaitable, Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import trio

from p2pswarm.agent.streams import send_best_effort, send_message
from p2pswarm.agent.training.jobs import job_config
from p2pswarm.agent.training.links import receive_answer, send_long
from p2pswarm.agent.training.ring import StageRing
from p2pswarm.agent.training.transfer import (
    Landing,
    check_part,
    check_room,
    receive_state_parts,
    send_state_parts,
)
from p2pswarm.errors import ConfigError, PlacementError, RemoteProtocolError, SwarmError
from p2pswarm.planner.wording import card_label, gb
from p2pswarm.training.schedule import stage_ops
from p2pswarm.wire.jobs import (
    StageKey,
    TrainPrepare,
    TrainPrepared,
    TrainRelease,
    TrainReleased,
)
from p2pswarm.wire.orders import unpack_doc
from p2pswarm.wire.training import (
    MAX_RING,
    Ack,
    Delta,
    MomentsAsk,
    MomentsLoadHead,
    OuterAsk,
    OuterLoadHead,
    Params,
    ParamsAsk,
    PartOpen,
    PartUpdate,
    PartUpdateAsk,
    Reset,
    RingDone,
    RingRound,
    StateAsk,
    StateHead,
    StateLoadHead,
    StepApply,
    StepReport,
    StepRun,
    Stop,
    TakeDelta,
    Tied,
    TiedAsk,
    TiedWeight,
    TrainError,
    TrainOpen,
    TrainTensor,
    Update,
)

if TYPE_CHECKING:
    from p2pswarm.agent.training.ports import StageHostsPort
    from p2pswarm.agent.training.runtime import StageCompute
    from p2pswarm.training.job import JobConfig
    from p2pswarm.transport.secure import SecureStream

log = logging.getLogger("p2pswarm.training")

PIPELINE_SCHEDULE = "1f1b"  # the order a stage runs its micro-batches' passes in


class TrainHost:
    """One stage of a job this fellow holds, from ``TrainPrepare`` to release."""

    def __init__(self, order: TrainPrepare, job: JobConfig, compute: StageCompute) -> None:
        self.job_id = order.job_id
        self.replica = order.replica
        self.index = order.stage
        self.n_stages = order.n_stages
        self.card_key = f"{order.card_kind}:{order.card_index}"
        self.need_bytes = order.need_bytes
        self.next_addr = order.next_addr
        self.prev_fellow = order.prev_fellow  # None: placed by a leader that did not say
        self.schedule = PIPELINE_SCHEDULE
        self.generation = order.generation  # which placement of the replica
        self.term = order.term  # the leader's term that placed it
        self.layers = (order.layer_start, order.layer_end)
        self.superseded = False  # a newer placement took this stage (and its compute) over
        self.job = job
        self.compute = compute
        self.limiter = trio.CapacityLimiter(1)
        self.upstream: SecureStream | None = None
        self.upstream_ready = trio.Event()
        self.done = trio.Event()
        self.ring: StageRing | None = None  # its place in the job's all-reduce (``ring``)
        self.ring_seeds: dict[int, bytes] = {}  # parts' outer state its ring starts from

    def drop_ring(self) -> None:
        """The stage took a new state (reset, loaded): its next ``RingRound`` makes a
        new ring from it."""
        if self.ring is not None:
            self.ring.stop()
            self.ring = None

    @property
    def key(self) -> tuple[str, int, int]:
        return (self.job_id, self.replica, self.index)

    @property
    def stage(self) -> Any:
        """The ``training.TrainStage`` this host trains."""
        return self.compute.stage


Command = Callable[[TrainHost, Any, "SecureStream"], Awaitable[None]]


class StageHosts:
    """The stages this fellow hosts: orders, streams, steps."""

    def __init__(self, training: StageHostsPort) -> None:
        self.training = training
        self.agent = training.agent
        self.hosts: dict[tuple[str, int, int], TrainHost] = {}
        self._commands: dict[type, Command] = {
            TakeDelta: self._take_delta, Update: self._update, ParamsAsk: self._params,
            StateAsk: self._state, StateLoadHead: self._load, Reset: self._reset,
            TiedAsk: self._tied, TiedWeight: self._tied_weight, MomentsAsk: self._moments,
            MomentsLoadHead: self._borrow_moments, RingRound: self._ring_round,
            PartUpdateAsk: self._part_update, OuterAsk: self._outer,
            OuterLoadHead: self._seed_outer,
        }
        training.leadership.obey(TrainPrepare, self.prepare)
        training.leadership.obey(TrainRelease, self.release)
        self.agent.on_stream(TrainOpen, self._on_train_open)
        self.agent.on_stream(PartOpen, self._on_part)

    async def run(self, fn: Callable[[], Any], host: TrainHost) -> Any:
        return await self.agent.compute.run(fn, host.limiter)

    # --- orders ---------------------------------------------------------------------------

    async def prepare(self, order: TrainPrepare) -> TrainPrepared:
        key = (order.job_id, order.replica, order.stage)
        kind, index, need = order.card_kind, order.card_index, order.need_bytes
        if order.fellow_id != self.agent.node_id.hex():
            raise PlacementError(f"{self.agent.name} got the order for stage {key[2]}, which "
                                 "the plan gives another fellow")
        old = self._take_over_from(key, order)
        cards = self.agent.serving._live_cards()
        card = next((c for c in cards if c.kind == kind and c.index == index), None)
        label = card_label(kind, index, getattr(card, "name", ""))
        if card is None:
            raise PlacementError(f"refuses stage {key[2]}: its {label} is not offered any more")
        promised = sum(h.need_bytes for h in self.hosts.values()
                       if h.card_key == f"{kind}:{index}")
        job = job_config(unpack_doc(order.config))
        reuse = old is not None and old.card_key == f"{kind}:{index}" and old.job == job \
            and old.layers == (order.layer_start, order.layer_end) \
            and old.n_stages == order.n_stages
        # a stage kept for its new placement already holds its memory on the card
        available = card.free_bytes - promised + (old.need_bytes if reuse and old else 0)
        if available < need:
            raise PlacementError(f"refuses stage {key[2]}: its {label} has {gb(available)} "
                                 f"free now, the stage needs {gb(need)}")
        if self.agent.serving.hosted and kind != "cpu":
            raise PlacementError(f"refuses stage {key[2]}: it is serving a load")
        if reuse and old is not None:
            # the same stage again (a new leader took the job over): it keeps its
            # parameters and inner optimizer state; the driver resets what is synced
            compute = old.compute
            log.info("%s: stage %d of replica %d of %s kept for its new placement",
                     self.agent.name, key[2], key[1], key[0])
        else:
            runtime = self.training.runtime
            compute = await self.agent.compute.run(lambda: runtime.build_stage(order, job))
        # another order for this stage may have landed while this one built (a deposed
        # leader's and its successor's): the newer placement wins, as above
        self._take_over_from(key, order)
        self.hosts[key] = host = TrainHost(order, job, compute)
        if reuse and old is not None:
            host.limiter = old.limiter  # one computation at a time on the shared stage
        self._publish()
        return TrainPrepared()

    def _take_over_from(self, key: tuple[str, int, int], order: TrainPrepare) -> TrainHost | None:
        """The stage this fellow holds under ``key``, let go for ``order``'s newer
        placement; refused when what it holds is as new (or newer)."""
        old = self.hosts.get(key)
        if old is None:
            return None
        if old.generation >= order.generation and old.term >= order.term:
            raise PlacementError(f"{self.agent.name} already holds stage {key[2]} of "
                                 f"replica {key[1]} of {key[0]}")
        # an earlier placement the leader (or a new leader) moved on from
        self._supersede(self.hosts.pop(key))
        return old

    async def release(self, order: TrainRelease) -> TrainReleased:
        dropped = [k for k, h in self.hosts.items()
                   if k[0] == order.job_id and (order.replica is None or k[1] == order.replica)
                   and (order.generation is None or h.generation <= order.generation)]
        for key in dropped:
            self._supersede(self.hosts.pop(key))
        if dropped:
            self._publish()
        return TrainReleased(tuple(StageKey(k[1], k[2]) for k in dropped))

    @staticmethod
    def _supersede(host: TrainHost) -> None:
        """``host`` is no longer held: a driver still talking to it is told so."""
        host.superseded = True
        host.done.set()
        host.drop_ring()

    def _publish(self) -> None:
        training = bool(self.hosts)
        if bool(self.agent.extra_metadata.get("training")) != training:
            if training:
                self.agent.extra_metadata["training"] = True
            else:
                self.agent.extra_metadata.pop("training", None)
            self.agent.publish_metadata()

    # --- streams --------------------------------------------------------------------------

    async def _on_train_open(self, msg: TrainOpen, stream: SecureStream) -> None:
        host = self.hosts.get((msg.job_id, msg.replica, msg.stage))
        if host is None:
            await send_best_effort(stream, TrainError(msg.stage, self.agent.name,
                                                      f"holds no stage {msg.stage} of replica "
                                                      f"{msg.replica} of {msg.job_id}"))
            return
        if msg.role == "data":
            if host.prev_fellow is not None and stream.peer_node_id.hex() != host.prev_fellow:
                self.agent.counters.refuse("train-data-not-from-upstream")
                await send_best_effort(stream, TrainError(msg.stage, self.agent.name,
                                                          "only the previous stage's fellow "
                                                          "feeds this stage"))
                return
            host.upstream = stream
            host.upstream_ready.set()
            await host.done.wait()
            return
        if msg.role != "control":
            raise RemoteProtocolError("bad-role", f"role {msg.role!r}")
        try:  # the driver runs on the leader: no one else steers a stage
            self.training.leadership.from_leader(stream.peer_node_id, "a stage's control stream")
        except SwarmError as exc:
            await send_best_effort(stream, TrainError(msg.stage, self.agent.name, str(exc)))
            return
        downstream: SecureStream | None = None
        try:
            if host.next_addr:
                downstream = await self.agent.open_secure(host.next_addr)
                await send_message(downstream, TrainOpen(host.job_id, host.replica,
                                                         host.index + 1, "data"))
            await send_message(stream, Ack())
            await self._serve_stage(host, stream, downstream)
        except (SwarmError, trio.TooSlowError) as exc:
            reason = str(exc) if isinstance(exc, SwarmError) else "a neighbour fell silent"
            log.warning("%s: stage %d of %s: %s", self.agent.name, host.index, host.job_id,
                        reason)
            await send_best_effort(stream, TrainError(host.index, self.agent.name,
                                                      reason[:500]))
        finally:
            host.done.set()
            if downstream is not None:
                with trio.CancelScope(shield=True):
                    await downstream.aclose()
        return

    async def _serve_stage(self, host: TrainHost, control: SecureStream,
                           downstream: SecureStream | None) -> None:
        """Answer the driver's commands until it says stop."""
        while True:
            msg = await receive_answer(control, object, "the driver")
            if isinstance(msg, Stop):
                return
            if host.superseded:  # a later placement (a new leader's) holds this stage now
                raise PlacementError(f"stage {host.index} of {host.job_id} was placed again "
                                     "since this driver opened it")
            if isinstance(msg, StepRun):
                await self._step(host, control, downstream, msg)
                continue
            command = self._commands.get(type(msg))
            if command is None:
                raise RemoteProtocolError("bad-op", f"the driver sent {type(msg).__name__}, "
                                          "not a training command")
            await command(host, msg, control)

    # --- the driver's commands ------------------------------------------------------------

    async def _take_delta(self, host: TrainHost, msg: TakeDelta, control: SecureStream
                          ) -> None:
        version, blob = await self.run(host.compute.take_delta, host)
        await send_long(control, Delta(version, blob))

    async def _update(self, host: TrainHost, msg: Update, control: SecureStream) -> None:
        await self.run(lambda: host.compute.apply_update(msg.version, msg.blob), host)
        await send_message(control, Ack(msg.version))

    async def _params(self, host: TrainHost, msg: ParamsAsk, control: SecureStream) -> None:
        await send_long(control, Params(await self.run(host.compute.params, host)))

    async def _state(self, host: TrainHost, msg: StateAsk, control: SecureStream) -> None:
        await self._send_bytes(host, control, await self.run(host.compute.state, host))

    async def _moments(self, host: TrainHost, msg: MomentsAsk, control: SecureStream
                       ) -> None:
        await self._send_bytes(host, control, await self.run(host.compute.moments, host))

    async def _send_bytes(self, host: TrainHost, control: SecureStream, data: bytes) -> None:
        digest = await self.run(lambda: hashlib.sha256(data).hexdigest(), host)
        await send_message(control, StateHead(len(data), digest))
        await send_state_parts(control, data)

    async def _load(self, host: TrainHost, msg: StateLoadHead, control: SecureStream
                    ) -> None:
        """The driver's state for this stage, in parts, through a verified file."""
        state = await self._land(host, msg, control, "state")
        host.drop_ring()
        await self.run(lambda: host.compute.load_state(state), host)
        await send_message(control, Ack())

    async def _borrow_moments(self, host: TrainHost, msg: MomentsLoadHead,
                              control: SecureStream) -> None:
        """Another replica's moments of this stage (this one was built anew). Moments
        that fail their checks are dropped and counted, and the stage goes on without
        (ramping its learning rate): a lender's bad bytes must not keep it out."""
        moments = await self._land(host, msg, control, "moments")
        try:
            taken = await self.run(lambda: host.compute.borrow_moments(moments), host)
        except (RemoteProtocolError, ConfigError) as exc:
            self.agent.counters.drop("bad-moments")
            log.warning("%s: stage %d of replica %d of %s refused the moments lent: %s",
                        self.agent.name, host.index, host.replica, host.job_id, exc)
        else:
            log.info("%s: stage %d of replica %d of %s borrowed the moments of %d "
                     "parameters", self.agent.name, host.index, host.replica, host.job_id,
                     taken)
        await send_message(control, Ack())

    async def _land(self, host: TrainHost, msg: StateLoadHead | MomentsLoadHead | OuterLoadHead,
                    control: SecureStream, kind: str) -> bytes:
        """The bytes ``msg`` announces, received in parts through a verified file."""
        incoming = self.training.copies.incoming
        what = f"the {kind} of stage {host.index}"
        check_room(msg.total, self.agent.config.transport.max_shard_bytes, incoming, what)
        path = incoming / check_part(f"{host.job_id}.{host.replica}.{host.index}.{kind}.pt")
        try:
            await receive_state_parts(control, Landing(path, msg.total, msg.sha256, what),
                                      "the driver", partial(self.run, host=host))
            shard: bytes = await self.run(path.read_bytes, host)
            return shard
        finally:
            path.unlink(missing_ok=True)

    async def _reset(self, host: TrainHost, msg: Reset, control: SecureStream) -> None:
        host.drop_ring()
        await self.run(lambda: host.compute.reset(msg.version, msg.blob), host)
        await send_message(control, Ack(msg.version))

    # --- the all-reduce (``ring``) ---------------------------------------------------------

    async def _ring_round(self, host: TrainHost, msg: RingRound, control: SecureStream
                          ) -> None:
        if host.ring is None:
            sync = host.compute.parted(len(msg.addrs))
            host.ring = StageRing.make(self.agent, host.job_id, host.replica, host.index,
                                       sync, msg, host.job.sync.round_deadline_s,
                                       host.ring_seeds)
            host.ring_seeds = {}
            self.agent.spawn(host.ring.run, host.done)
        version = await host.ring.round(msg, partial(self.run, host=host))
        traffic = host.ring.traffic
        await send_message(control, RingDone(version, traffic.sent_bytes,
                                             traffic.received_bytes))

    async def _part_update(self, host: TrainHost, msg: PartUpdateAsk, control: SecureStream
                           ) -> None:
        blob = None if host.ring is None else host.ring.fellow.update_part(msg.version,
                                                                           msg.part)
        # empty when it holds that update no more: the driver's mirror waits for another
        await send_message(control, PartUpdate(host.index, msg.part, msg.version,
                                               blob or b""))

    async def _outer(self, host: TrainHost, msg: OuterAsk, control: SecureStream) -> None:
        states = {} if host.ring is None else host.ring.fellow.outer_states()
        runtime = self.training.runtime
        await self._send_bytes(host, control,
                               await self.run(lambda: runtime.pack_outer(states), host))

    async def _seed_outer(self, host: TrainHost, msg: OuterLoadHead, control: SecureStream
                          ) -> None:
        blob = await self._land(host, msg, control, "outer")
        runtime = self.training.runtime
        host.ring_seeds = await self.run(lambda: runtime.unpack_outer(blob, MAX_RING), host)
        await send_message(control, Ack())

    async def _on_part(self, msg: PartOpen, stream: SecureStream) -> None:
        host = self.hosts.get((msg.job_id, msg.replica, msg.stage))
        with trio.move_on_after(self.training.timings.step_timeout_s):
            if host is None or host.ring is None or not await host.ring.receive(msg, stream):
                self.agent.counters.drop("ring-part")

    async def _tied(self, host: TrainHost, msg: TiedAsk, control: SecureStream) -> None:
        await send_long(control, Tied(host.compute.tied()))

    async def _tied_weight(self, host: TrainHost, msg: TiedWeight, control: SecureStream
                           ) -> None:
        host.compute.set_tied(msg.blob)
        await send_message(control, Ack())

    async def _step(self, host: TrainHost, control: SecureStream,
                    downstream: SecureStream | None, msg: StepRun) -> None:
        compute, n_micro, step = host.compute, msg.micro_batches, msg.step
        first, last = compute.is_first, compute.is_last
        inputs: dict[int, bytes] = {}
        targets: dict[int, bytes] = {}
        for _ in range(n_micro * (int(first) + int(last))):
            t = await receive_answer(control, TrainTensor, "the driver")
            (inputs if t.kind == "input" else targets)[t.micro] = t.tensor
        losses: list[float] = []
        for op in stage_ops(host.schedule, host.index, host.n_stages, n_micro):
            m = op.micro
            if op.kind == "F":
                x = inputs.pop(m) if first else (await self._upstream_receive(host)).tensor
                out = await self.run(partial(compute.forward, m, x, targets.get(m)), host)
                if isinstance(out, float):
                    losses.append(out)
                else:
                    assert downstream is not None
                    await send_long(downstream, TrainTensor("activation", step, m, out))
            else:
                g = None
                if not last:
                    assert downstream is not None
                    g = (await receive_answer(downstream, TrainTensor,
                                              "the next stage")).tensor
                grad_in = await self.run(partial(compute.backward, m, g, 1.0 / n_micro), host)
                if grad_in is not None:
                    assert host.upstream is not None
                    await send_long(host.upstream, TrainTensor("gradient", step, m, grad_in))
        tied, sq = compute.finish()
        loss_sum = sum(losses)
        if not math.isfinite(loss_sum) or not math.isfinite(sq):
            raise PlacementError(f"stage {host.index}: the loss or gradients are not finite "
                                 "(lower lr.peak)")
        await send_message(control, StepReport(step, tied is not None, sq, loss_sum))
        if tied is not None:
            await send_long(control, TrainTensor("tied", step, 0, tied))
        apply = await receive_answer(control, StepApply, "the driver")
        total = None
        if tied is not None:
            total = (await receive_answer(control, TrainTensor, "the driver")).tensor
        await self.run(lambda: compute.apply(msg.lr, apply.clip, total, step), host)
        if self.training.timings.simulated_step_s:
            await trio.sleep(self.training.timings.simulated_step_s)
        await send_message(control, Ack(step))

    async def _upstream_receive(self, host: TrainHost) -> TrainTensor:
        if host.upstream is None:
            with trio.fail_after(self.training.timings.open_timeout_s):
                await host.upstream_ready.wait()
        assert host.upstream is not None
        with trio.fail_after(self.training.timings.step_timeout_s):
            return await receive_answer(host.upstream, TrainTensor, "the stage before")


__all__ = ["PIPELINE_SCHEDULE", "StageHosts", "TrainHost"]
