"""The leader's loads: two-phase bring-up of a plan, unload, and what is loaded.

Loading is the leader's job (``LoadAsk``), all or nothing. The leader plans the request
again on its current view; a pinned ``plan_id`` that no longer comes out, and whose shown
placement no longer holds either (``Planning.pinned``: memory that moved within the
plan's headroom keeps it), is refused as ``plan-changed`` (409) with what changed
(``diff_plans`` against the plan the leader showed) and the new plan. Otherwise three
rounds of term-fenced orders go out, one per stage, concurrently:

1. ``StagePrepare``: the fellow checks its own live view before allocating anything
   (the card is still offered, its free memory still covers the stage's claim, it is not
   training, the model's files are readable and match, or are cached, or the fellow that
   has them is connected) and reserves, or refuses with a reason. One refusal and the
   leader orders every fellow to release what it reserved.
2. ``StageLoad``: the fellow fetches the tensors it lacks (``p2pswarm.agent.weights``),
   builds the stage on its card and compares what it really allocated with the plan's
   claim, refusing a stage that outgrows it. One failure and everything is released.
3. ``StageStart``: every stage learns the whole route (so each knows the next hop) and
   goes live; the fellow gossips what it now serves, route included (metadata
   ``stages``), so any fellow, a new leader too, can find the load.

Cancelling (``LoadCancel``, when the CLI that asked is interrupted) names the load by the
asker's ticket and keeps it all or nothing: a bring-up under way is cancelled and every
stage released; a load that had just come up is unloaded; a ticket not seen yet is
remembered, so its ``LoadAsk``, still on its way, is refused.

What is loaded (``views``) is the loads this agent led plus those fellows gossip
that they serve, each stage with its fellow's membership state; an unloaded plan's
gossip may lag, so it is ignored for ``UNLOAD_TOMBSTONE_S``.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import trio

from p2pswarm.agent.adapter import stage_block
from p2pswarm.agent.planning import fellow_id
from p2pswarm.agent.serving.doc_fields import DocFields
from p2pswarm.agent.serving.events import LoadEvents
from p2pswarm.agent.serving.leader_load import LeaderLoad, LoadAsked
from p2pswarm.agent.serving.load_view import UNKNOWN, LoadView, ViewHop
from p2pswarm.agent.serving.records import (
    StageOrder,
    WeightsOrigin,
    public_adapter,
    public_model,
    runtime_block,
)
from p2pswarm.agent.serving.stage_gossip import gossiped_plan_ids
from p2pswarm.agent.serving.tombstones import is_generation
from p2pswarm.agent.weights import Manifest
from p2pswarm.errors import (
    ConfigError,
    ControlError,
    PlacementError,
    RemoteProtocolError,
    SwarmError,
    TransportError,
)
from p2pswarm.names import is_safe_name
from p2pswarm.planner.plan import Plan
from p2pswarm.planner.profile import BUILTIN_MODELS
from p2pswarm.planner.wording import card_label
from p2pswarm.wire.loads import (
    LoadAsk,
    LoadCancel,
    LoadCancelled,
    LoadDone,
    LoadsAsk,
    LoadsShown,
    RouteHop,
    StageLoad,
    StageLoaded,
    StagePrepare,
    StagePrepared,
    StageRelease,
    StageReleased,
    StageStart,
    StageStarted,
    UnloadAsk,
    Unloaded,
)
from p2pswarm.wire.orders import pack_doc, unpack_doc

if TYPE_CHECKING:
    from p2pswarm.agent.fellow_meta import SaidStage
    from p2pswarm.agent.serving.ports import Leader, LoadsPort
    from p2pswarm.membership.member import Member

log = logging.getLogger("p2pswarm.serving")

R = TypeVar("R")
Addrs = dict[int, tuple[str, str, str]]  # stage -> (fellow id hex, name, addr)

UNLOAD_TOMBSTONE_S = 60.0  # gossip of an unloaded stage may lag; ignore it this long
TICKETS_KEPT = 256  # tickets of finished or cancelled loads remembered for a late cancel


@dataclass(eq=False)
class _InFlight:
    """A load being brought up for the asker holding ``ticket``."""

    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    done: trio.Event = field(default_factory=trio.Event)
    plan_id: str = ""


def _remember(kept: OrderedDict[str, str], ticket: str, value: str) -> None:
    kept[ticket] = value
    kept.move_to_end(ticket)
    while len(kept) > TICKETS_KEPT:
        kept.popitem(last=False)


class Loads:
    def __init__(self, agent: LoadsPort, leadership: Leader, events: LoadEvents) -> None:
        self.agent = agent
        self.leadership = leadership
        self.events = events  # loads come up and go (``events``): this publishes them
        self.loads: dict[str, LeaderLoad] = {}  # loads this agent leads, by plan_id
        self._serial = 0  # the last record taken into ``loads`` (``lead``)
        self.timings = agent.config.serving
        self._unloaded: dict[str, float] = {}
        self._heard_gone: dict[str, float] = {}  # unloads the leader told this fellow of
        # loads unloaded here (the last TICKETS_KEPT): a fellow away during the unload
        # that comes back keeping their orders is told to drop them, not adopted
        self._forgotten: OrderedDict[str, str] = OrderedDict()
        self._lock = trio.Lock()
        self.orders: dict[str, list[StageOrder]] = {}  # each led load's stage orders
        # what each load this agent brought up was asked as (request, model, adapter): a
        # live move plans it again (``recut``); a load adopted from its fellows lacks it
        self.asked: dict[str, LoadAsked] = {}
        self.moved_to: dict[str, str] = {}  # a re-cut load's old plan_id -> its new one
        self._in_flight: dict[str, _InFlight] = {}  # ticket -> the bring-up under way
        self._finished: OrderedDict[str, str] = OrderedDict()  # ticket -> plan_id loaded
        # tickets whose load ended without coming up, or was cancelled before it came
        self._cancelled: OrderedDict[str, str] = OrderedDict()  # -> plan_id, if planned
        leadership.serve(LoadAsk, self._leader_load)
        leadership.serve(LoadsAsk, self._leader_loads)
        leadership.serve(UnloadAsk, self._leader_unload)
        leadership.serve(LoadCancel, self._leader_cancel)

    def lead(self, load: LeaderLoad, orders: list[StageOrder]) -> None:
        """Take ``load`` into the table as the current record of its plan, with its
        stage orders."""
        self._serial += 1
        load.serial = self._serial
        self.loads[load.plan_id] = load
        self.orders[load.plan_id] = orders

    def drop(self, plan_id: str) -> None:
        """Stop leading ``plan_id``: its record, orders and request go from the table."""
        self.loads.pop(plan_id, None)
        self.orders.pop(plan_id, None)
        self.asked.pop(plan_id, None)

    def leads(self, load: LeaderLoad) -> bool:
        """Whether ``load`` is still the table's record of its plan (not unloaded, re-cut
        or adopted afresh meanwhile)."""
        now = self.loads.get(load.plan_id)
        return now is not None and now.serial == load.serial

    def loaded_ids(self) -> set[str]:
        """The plan_ids of the loads this agent knows of (``views``)."""
        return {view.plan_id for view in self.views()}

    @property
    def lock(self) -> trio.Lock:
        """Held while a load comes up or goes down (a new leader adopts beside neither)."""
        return self._lock

    # --- loading ---------------------------------------------------------------------

    async def _leader_load(self, call: LoadAsk) -> LoadDone:
        ticket = call.ticket
        if not ticket:
            return await self._load(call, _InFlight())
        if ticket in self._cancelled or ticket in self._in_flight or ticket in self._finished:
            raise PlacementError("this load was cancelled by the fellow that asked for it; "
                                 "nothing was loaded")
        flight = self._in_flight[ticket] = _InFlight()
        came_up = False
        try:
            with flight.scope:
                done = await self._load(call, flight)
                came_up = True
                _remember(self._finished, ticket, flight.plan_id)
                return done
            plan = f" of plan {flight.plan_id}" if flight.plan_id else ""
            raise PlacementError(f"the load{plan} was cancelled by the fellow that asked for "
                                 "it; nothing stays loaded")
        finally:
            del self._in_flight[ticket]
            if not came_up:  # refused, failed or cancelled: nothing of it stays
                _remember(self._cancelled, ticket, flight.plan_id)
            flight.done.set()

    async def _leader_cancel(self, call: LoadCancel) -> LoadCancelled:
        """Cancel the load asked for under ``call.ticket``, all or nothing (see above)."""
        ticket = call.ticket
        flight = self._in_flight.get(ticket)
        if flight is not None:  # under way: stop it; it releases what it holds
            flight.scope.cancel()
            await flight.done.wait()
        plan_id = self._finished.pop(ticket, None)
        if plan_id is not None:  # it came up before the cancel arrived: take it down
            async with self._lock:
                seen = next((r for r in self.views() if r.plan_id == plan_id), None)
                if seen is not None:
                    await self._unload([seen])
            log.info("load %s cancelled by its asker just after it came up; unloaded", plan_id)
            return LoadCancelled("unloaded", plan_id)
        if ticket in self._cancelled:
            plan_id = self._cancelled[ticket]
            if flight is not None:
                log.info("load %s cancelled by its asker; everything released",
                         plan_id or "(not planned yet)")
            return LoadCancelled("cancelled", plan_id)
        _remember(self._cancelled, ticket, "")  # its LoadAsk may still be on its way
        return LoadCancelled("unknown", "")

    async def _load(self, call: LoadAsk, flight: _InFlight) -> LoadDone:
        message = unpack_doc(call.request)
        asked = LoadAsked(message, unpack_doc(call.model),
                          unpack_doc(call.adapter) if call.adapter else None)
        expected = call.plan_id or None
        if not _names_its_adapter(asked):
            raise ConfigError("the load's adapter is not the one its request names")
        async with self._lock:
            plan = await self.agent.planning.pinned_off_loop(call.request, expected)
            self.agent.planning.shown.check_pin(expected, plan)
            if not isinstance(plan, Plan) or plan.kind != "serve":
                raise ConfigError("load serves a model: plan it without --train")
            if not plan.fits:
                raise PlacementError(f"plan {plan.plan_id} does not fit: "
                                     f"{plan.limit.sentence}")
            plan_id = flight.plan_id = plan.plan_id
            if plan_id in self.loaded_ids():
                raise PlacementError(f"plan {plan_id} is already loaded: `p2pswarm loads` "
                                     "shows it; unload it first to load it again")
            _check_model(asked)
            orders = stage_orders(plan, asked, call.progress_addr, call.ticket,
                                  self._generation())
            addrs = self._order_addrs(orders)
            record = await self._bring_up(plan, orders, addrs, asked)
            self.asked[plan_id] = asked
            return LoadDone(pack_doc(record.to_doc()))

    async def bring_up_beside(self, plan: Plan, asked: LoadAsked) -> LeaderLoad:
        """Bring ``plan`` up as a load of its own, as ``load`` does (checked, fetched,
        loaded, started; all or nothing), beside a load it is to replace (``recut``).
        Hold ``lock``."""
        orders = stage_orders(plan, asked, "", "", self._generation())
        record = await self._bring_up(plan, orders, self._order_addrs(orders), asked)
        self.asked[plan.plan_id] = asked
        return record

    def _generation(self) -> str:
        """A new bring-up's name: what an unload's tombstone covers (not the plan id)."""
        return f"{self.agent.rng.getrandbits(64):016x}"

    def generation_of(self, plan_id: str) -> str:
        """The bring-up of led load ``plan_id`` ("" when not led, or kept without one)."""
        orders = self.orders.get(plan_id)
        return orders[0].generation if orders else ""

    def retire(self, plan_id: str, successor: str) -> str:
        """Load ``plan_id`` now lives on as ``successor`` (a live move re-cut it): forget
        it, ignore its stages' lagging gossip, and name the successor to whoever asks
        for it (a driver resuming a session). Its stages are the caller's to release,
        and its bring-up (returned, "" when unknown) the caller's to hand out as
        forgotten (``events``), so that no later leader adopts it either."""
        generation = self.generation_of(plan_id)
        self.drop(plan_id)
        self._unloaded[plan_id] = trio.current_time()
        self.events.unloaded(plan_id)  # its orders kept here and by its keepers
        for old, new in list(self.moved_to.items()):
            if new == plan_id:
                self.moved_to[old] = successor
        self.moved_to[plan_id] = successor
        while len(self.moved_to) > TICKETS_KEPT:
            self.moved_to.pop(next(iter(self.moved_to)))
        return generation

    def heard_unloaded(self, plan_id: str) -> None:
        """The leader told this fellow that load ``plan_id`` was unloaded or re-cut: its
        stages' gossip may still lag here, so this fellow's own view (the listing when
        the leader does not answer) leaves it out a while, as the leader's does. Only
        the view: elected, this fellow still looks at the load's kept orders (a fellow
        away meanwhile is handed the unload's tombstone)."""
        self._heard_gone[plan_id] = trio.current_time()

    def asked_doc(self, plan_id: str) -> bytes:
        """What load ``plan_id`` was asked as, as its keepers keep it (b"": not known)."""
        asked = self.asked.get(plan_id)
        return asked.to_doc() if asked is not None else b""

    def gossiped_holders(self, plan_id: str) -> list[str]:
        """Addresses of the connected fellows that gossip a stage of ``plan_id``."""
        membership = self.agent.membership
        return sorted({m.addr for m in (membership.members() if membership else ())
                       if m.present
                       and plan_id in gossiped_plan_ids(self.agent.fellow_says(m))})

    def current_id(self, plan_id: str) -> str:
        """The plan_id load ``plan_id`` goes by now (another after a re-cut)."""
        return self.moved_to.get(plan_id, plan_id)

    def _order_addrs(self, orders: Sequence[StageOrder]) -> Addrs:
        """stage -> (fellow id hex, name, addr), from this leader's membership view."""
        out = {}
        for order in orders:
            member = self.agent.fellow(order.fellow_id)
            if member is None or not member.present:
                raise PlacementError(f"stage {order.stage}'s fellow is not connected")
            out[order.stage] = (order.fellow_id, member.name, member.addr)
        return out

    async def _bring_up(self, plan: Plan, orders: list[StageOrder], addrs: Addrs,
                        asked: LoadAsked) -> LeaderLoad:
        plan_id = plan.plan_id
        try:
            return await self._bring_up_orders(plan, orders, addrs, asked)
        except SwarmError:
            raise  # refused or failed: it released everything already
        except BaseException:  # cancelled (by its asker, or as this agent stops): the
            await self.release_all(plan_id, addrs)  # same, all or nothing (shielded)
            raise

    async def _bring_up_orders(self, plan: Plan, orders: list[StageOrder],
                               addrs: Addrs, asking: LoadAsked) -> LeaderLoad:
        plan_id, model, adapter = plan.plan_id, asking.model, asking.adapter
        asked = asking.to_doc()
        began = time.perf_counter()
        prepared = await self._order_all(
            orders, addrs, "stage-prepare", self.timings.order_timeout_s, StagePrepared,
            lambda o: StagePrepare(o.to_wire()))
        refusals = [f"{addrs[i][1]}: {r}" for i, r in prepared.items()
                    if isinstance(r, SwarmError)]
        if refusals:
            await self.release_all(plan_id, addrs)
            raise PlacementError(f"load of plan {plan_id} refused, nothing loaded: "
                                 + "; ".join(refusals))
        loaded = await self._order_all(
            orders, addrs, "stage-load", self.timings.load_timeout_s, StageLoaded,
            lambda o: StageLoad(plan_id, o.stage))
        failures = [f"{addrs[i][1]}: {r}" for i, r in loaded.items() if isinstance(r, SwarmError)]
        if failures:
            await self.release_all(plan_id, addrs)
            raise PlacementError(f"load of plan {plan_id} failed, everything released: "
                                 + "; ".join(failures))
        route = []
        for o in orders:
            done = loaded[o.stage]
            assert isinstance(done, StageLoaded)
            fid, name, addr = addrs[o.stage]
            route.append(RouteHop(o.stage, fid, name, addr, o.layers[0], o.layers[1],
                                  card_label(o.card_kind, o.card_index, o.card_name),
                                  o.claim_bytes, done.allocated_bytes, done.fetched_bytes,
                                  done.fetch_s))
        hops = tuple(route)
        kept = tuple(o.to_wire() for o in orders)  # every stage keeps them (``adoption``)
        started = await self._order_all(
            orders, addrs, "stage-start", self.timings.order_timeout_s, StageStarted,
            lambda o: StageStart(plan_id, hops, kept, asked))
        failures = [f"{addrs[i][1]}: {r}" for i, r in started.items()
                    if isinstance(r, SwarmError)]
        if failures:
            await self.release_all(plan_id, addrs)
            raise PlacementError(f"load of plan {plan_id} failed to start, everything "
                                 "released: " + "; ".join(failures))
        record = LeaderLoad(plan_id, public_model(model), orders[0].runtime, hops)
        record.set_load_s(time.perf_counter() - began)
        if adapter:
            record.set_adapter(public_adapter(adapter))
        self.lead(record, list(orders))
        self._unloaded.pop(plan_id, None)
        self._forgotten.pop(plan_id, None)
        self.events.loaded()
        return record

    async def _order_all(self, orders: Sequence[StageOrder], addrs: Addrs, what: str,
                         timeout_s: float, reply_type: type[R],
                         make: Callable[[StageOrder], Any]) -> dict[int, R | SwarmError]:
        """Send each stage's fellow its order at once; stage -> reply or SwarmError."""
        results: dict[int, R | SwarmError] = {}

        async def one(order: StageOrder) -> None:
            addr = addrs[order.stage][2]
            try:
                with trio.fail_after(timeout_s):
                    results[order.stage] = await self.leadership.order(addr, make(order),
                                                                       reply_type)
            except SwarmError as exc:
                results[order.stage] = exc
            except trio.TooSlowError:
                results[order.stage] = TransportError(f"no answer to {what} within "
                                                      f"{timeout_s:g} s")

        async with trio.open_nursery() as nursery:
            for order in orders:
                nursery.start_soon(one, order)
        return results

    async def release_all(self, plan_id: str, addrs: Addrs,
                          keepers: Sequence[str] = ()) -> None:
        """Order every fellow of a load (and the ``keepers`` of its orders) to drop what
        it holds and keeps of it (best effort: one that cannot be reached drops an
        unstarted reservation by itself)."""
        targets = sorted({addr for _, _, addr in addrs.values()} | set(keepers))

        async def one(addr: str) -> None:
            try:
                with trio.fail_after(self.timings.order_timeout_s):
                    await self.leadership.order(addr, StageRelease(plan_id), StageReleased)
            except (SwarmError, trio.TooSlowError) as exc:
                log.warning("release of %s on %s failed: %s", plan_id, addr, exc)

        with trio.CancelScope(shield=True):
            async with trio.open_nursery() as nursery:
                for addr in targets:
                    nursery.start_soon(one, addr)

    # --- what is loaded, and unloading -------------------------------------------------

    async def _leader_loads(self, call: LoadsAsk) -> LoadsShown:
        return LoadsShown(tuple(pack_doc(v.to_doc()) for v in self.views()))

    async def _leader_unload(self, call: UnloadAsk) -> Unloaded:
        # a load this leader knows only from its fellows' gossip (elected a moment ago,
        # it has not adopted it yet) is adopted first: the unload's tombstone must name
        # its bring-up, or a fellow away meanwhile brings it back under a later leader
        for view in self.views():
            if view.plan_id not in self.loads and call.plan_id in ("", view.plan_id):
                await self.events.unleading(view.plan_id)
        async with self._lock:
            views = self.views()
            wanted = call.plan_id
            if wanted:
                chosen = [r for r in views if r.plan_id == wanted]
                if not chosen:
                    raise PlacementError(f"plan {wanted} is not loaded; loaded: "
                                         f"{', '.join(r.plan_id for r in views) or 'nothing'}")
            elif call.all or len(views) <= 1:
                chosen = views
            else:
                raise ConfigError(f"{len(views)} loads: name one (`p2pswarm unload PLAN_ID`) "
                                  "or pass --all")
            await self._unload(chosen)
            return Unloaded(tuple(r.plan_id for r in chosen))

    async def unload_led(self, plan_id: str) -> None:
        """Unload load ``plan_id`` as ``unload`` does, if this agent leads it (a tombstone
        of its bring-up turned up after it was adopted: see ``adoption``)."""
        async with self._lock:
            if plan_id in self.loads:
                await self._unload([v for v in self.views() if v.plan_id == plan_id])

    async def _unload(self, loads: list[LoadView]) -> None:
        """Release every stage of these loads (hold ``_lock``)."""
        for seen in loads:
            plan_id = seen.plan_id
            await self.release_all(plan_id, seen.live, self.keeping(plan_id))
            generation = self.generation_of(plan_id)
            if generation:  # remembered past this leader
                await self.events.forgotten(plan_id, generation)
            self.drop(plan_id)
            self._unloaded[plan_id] = trio.current_time()
            _remember(self._forgotten, plan_id, plan_id)
            self.events.unloaded(plan_id)

    def recently_unloaded(self, plan_id: str) -> bool:
        """Whether ``plan_id`` was unloaded or re-cut here so lately that its stages'
        gossip may still lag."""
        at = self._unloaded.get(plan_id)
        return at is not None and trio.current_time() - at < UNLOAD_TOMBSTONE_S

    def forgotten_load(self, plan_id: str) -> bool:
        """Whether ``plan_id`` was unloaded here (and not loaded again since), or re-cut
        into another plan."""
        return plan_id in self._forgotten or plan_id in self.moved_to

    def keeping(self, plan_id: str) -> list[str]:
        """Addresses of the connected fellows that gossip that they keep the orders of
        ``plan_id`` without serving it (``kept_loads``)."""
        membership = self.agent.membership
        return sorted({m.addr for m in (membership.members() if membership else ())
                       if m.present and not m.is_self
                       and plan_id in self.agent.fellow_says(m).kept_loads})

    async def list_loads(self) -> list[dict[str, Any]]:
        """The leader's answer, or this fellow's own view when no leader answers."""
        try:
            answer = await self.leadership.ask(LoadsAsk(), LoadsShown)
        except (PlacementError, TransportError, ControlError, RemoteProtocolError) as exc:
            log.info("loads from this fellow's view (%s)", exc)
            return [view.to_doc() for view in self.views()]
        return [unpack_doc(r) for r in answer.loads]

    def views(self) -> list[LoadView]:
        """Loads as this agent knows them, by plan_id: those it led, and those fellows
        gossip that they serve; each stage with its fellow's membership state (the
        listing shows each as ``LoadView.to_doc``)."""
        now = trio.current_time()
        self._unloaded = {p: t for p, t in self._unloaded.items()
                          if now - t < UNLOAD_TOMBSTONE_S}
        self._heard_gone = {p: t for p, t in self._heard_gone.items()
                            if now - t < UNLOAD_TOMBSTONE_S}
        members: dict[str, Member] = {}
        # plan_id -> stage -> (what its fellow says of it, as a hop; the stage it says)
        gossiped: dict[str, dict[int, tuple[ViewHop, SaidStage]]] = {}
        membership = self.agent.membership
        for m in membership.members() if membership is not None else ():
            fid = fellow_id(m.node_id)
            members[fid] = m
            if not m.present:
                continue  # a fellow that left or died serves nothing, whatever it last said
            for said in self.agent.fellow_says(m).stages:
                gossiped.setdefault(said.plan_id, {})[said.stage] = (
                    ViewHop.said(said, fid, m.name, m.addr), said)
        found: dict[str, tuple[list[ViewHop], LeaderLoad | SaidStage]] = {
            p: ([ViewHop.led(h) for h in r.stages], r) for p, r in self.loads.items()}
        for plan_id, entries in gossiped.items():
            if plan_id in found or plan_id in self._unloaded or plan_id in self.moved_to \
                    or plan_id in self._heard_gone:
                continue  # unloaded, or re-cut: its stages' gossip lags, or they linger
            # every stage fellow gossips the whole route: one entry heard is enough
            first = entries[min(entries)][1]
            hops = [ViewHop.said(h, h.fellow_id, h.fellow, h.addr) for h in first.route] \
                if first.route else [hop for hop, _ in entries.values()]
            stages = []
            for hop in hops:
                entry = entries.get(hop.stage)
                stages.append((hop if entry is None else hop.over(entry[0])).at(
                    members.get(hop.fellow_id)))
            found[plan_id] = (stages, first)
        return [LoadView(p, tuple(h.with_state(_state(members.get(h.fellow_id))) for h in hops),
                         source)
                for p, (hops, source) in sorted(found.items())]


def _state(member: Member | None) -> str:
    """A stage's fellow's membership state as the listing shows it."""
    return member.state if member is not None else UNKNOWN


def _names_its_adapter(asked: LoadAsked) -> bool:
    """Whether the adapter is the one the request names (or neither has one)."""
    named = asked.adapter_named or None
    if not (asked.adapter or named):
        return True
    return bool((asked.adapter or {}).get("sha256") == named)


def asked_from_doc(raw: bytes, model: dict[str, Any]) -> LoadAsked:
    """``LoadAsked.to_doc`` back, from a fellow's keeping (checked: the request plans
    the orders' ``model``, and names the adapter it carries); ConfigError otherwise."""
    try:
        doc = DocFields(unpack_doc(raw), "a kept request")
    except RemoteProtocolError as exc:
        raise ConfigError(f"not a document ({exc})") from None
    message, adapter = doc.value("request", None), doc.value("adapter", None)
    try:
        DocFields(message, "its request").fields("model").fields("config")
    except ConfigError:
        raise ConfigError("no request, or an adapter that is no document") from None
    if not (adapter is None or isinstance(adapter, dict)):
        raise ConfigError("no request, or an adapter that is no document")
    replaces = doc.value("replaces", None)
    if replaces is not None and not (
            isinstance(replaces, (list, tuple)) and len(replaces) == 2
            and isinstance(replaces[0], str) and is_safe_name(replaces[0], 64)
            and is_generation(replaces[1])):
        raise ConfigError("the bring-up it replaces is not a plan id and a generation")
    asked = LoadAsked(message, model, adapter,
                      None if replaces is None else (replaces[0], replaces[1]))
    if not _names_its_adapter(asked):
        raise ConfigError("the adapter is not the one its request names")
    _check_model(asked)
    return asked


def _check_model(asked: LoadAsked) -> None:
    """Whether the model's weights (``asked.model``) are the model the request plans."""
    config = DocFields(asked.request, "the load's request").fields("model").value("config")
    origin = WeightsOrigin.of(asked.model)
    if origin.kind == "builtin":
        if dict(BUILTIN_MODELS.get(str(origin.name), {})) != config:
            raise ConfigError(f"built-in {origin.name!r} is not the planned model")
    elif origin.kind == "files":
        if Manifest.from_dict(origin.manifest or {}).hf_config != config:
            raise ConfigError("the model files are not the planned model")
    else:
        raise ConfigError(f"unknown model kind {origin.kind!r}")


def stage_orders(plan: Plan, asked: LoadAsked, progress_addr: str, ticket: str,
                 generation: str = "") -> list[StageOrder]:
    """The stage order of each stage of ``plan``, for the model and the adapter (its
    part of it: ``stage_block``) a load was asked with."""
    cards = {(c.fellow_id, c.kind, c.index): c for c in plan.cards if c.used}
    orders = []
    for s in plan.stages:
        card = cards[(s.fellow_id, s.kind, s.card_index)]
        start, end = s.layers
        orders.append(StageOrder(
            plan_id=plan.plan_id, stage=s.index, n_stages=len(plan.stages),
            fellow_id=s.fellow_id, layers=(start, end), card_kind=s.kind,
            card_index=s.card_index, card_name=s.name,
            claim_bytes=card.segments.claim_bytes, need_bytes=card.segments.need_bytes,
            # each stage's own runtime: its weights dtype may differ (``auto``)
            runtime=runtime_block(plan.runtime(s.index)), model=asked.model,
            progress_addr=progress_addr, ticket=ticket,
            adapter=stage_block(asked.adapter, start, end) if asked.adapter else {},
            generation=generation))
    return orders


__all__ = ["UNLOAD_TOMBSTONE_S", "Loads", "asked_from_doc", "stage_orders"]
