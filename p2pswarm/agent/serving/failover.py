"""Failover: the leader keeps its loads whole when a stage's fellow is lost.

Theory of operation. A stage's fellow may be *gone* (it left the swarm, or its machine
answers that nothing listens at its address: the process died) or *silent* (membership
declares it dead, or a driver's stream to it broke, yet its machine does not refuse: a
frozen process, a fading radio). A gone fellow is lost at once; a silent one is lost only
when it does not answer for ``grace_s``, so a laptop whose WiFi fades for five seconds
keeps its stage, and its KV caches with it.

Healing a load (``heal``) is the leader's, one load at a time: it asks every stage's
fellow ``StageCheck`` (term-fenced, like every order) until each answers that it holds
its stage live, or is lost. A lost stage is re-placed with the same machinery as a load:
the same stage order (layers, runtime, claims) goes to the fastest card outside the load
with the stage's memory free (``spare_cards``), ``StagePrepare`` then ``StageLoad``
(weights fetched as for a load), and ``StageStart`` with the new route to every stage's
fellow. Each move is recorded on the load (when, which stage, from, to, why), and the
lost fellow, should it come back, is told to release what it held.

Two things start a heal: a driver that lost its pipeline (``StageLost``, answered with
the load's record as it now stands: the driver then replays its session's tokens on
that route, see ``generation``), and the leader's own watch over membership (a stage
fellow dead or departed heals the load with no generation running). When no card can
hold a lost stage, the heal fails with the reason, the load shows what it waits for
(``waiting``), and the watch tries again as the swarm changes.

A leader heals the loads its predecessors led too: every ``StageStart`` hands each stage's
fellow the route and every stage's order (and ``keepers`` hands them to a few other
fellows; all of them keep them on disk), and a new leader adopts a load from them
(``adoption``) when it is elected, when its watch finds a load it does not lead, or when
a driver asks it to heal one. A stage's fellow restarted from its disk keeps the orders
but not the stage, and says so (metadata ``kept_loads``): the watch heals such a load,
and the lost stage goes back to that same fellow first when its card has room (its
weights are cached there).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import trio

from p2pswarm.agent.serving.adoption import Adoption
from p2pswarm.agent.serving.keepers import Keepers
from p2pswarm.agent.serving.leader_load import LeaderLoad, StageMoved
from p2pswarm.agent.serving.moves import moved_order, no_spare_reason, spare_cards
from p2pswarm.agent.serving.records import StageOrder
from p2pswarm.agent.serving.recut import Recut
from p2pswarm.agent.serving.requests import load_move_request
from p2pswarm.agent.serving.unload_memory import UnloadMemory
from p2pswarm.control.requests import typed_op
from p2pswarm.errors import (
    NobodyListens,
    PlacementError,
    SwarmError,
    TransportError,
)
from p2pswarm.planner.cluster import CardView, Fellow
from p2pswarm.planner.wording import card_label, gb
from p2pswarm.wire.control import LoadMoveRequest
from p2pswarm.wire.loads import (
    LoadDone,
    LoadMove,
    RouteHop,
    StageAssignment,
    StageCheck,
    StageChecked,
    StageLoad,
    StageLoaded,
    StageLost,
    StagePrepare,
    StagePrepared,
    StageRelease,
    StageReleased,
    StageStart,
    StageStarted,
)
from p2pswarm.wire.orders import pack_doc, unpack_doc

if TYPE_CHECKING:
    from p2pswarm.agent.serving.loads import Loads
    from p2pswarm.agent.serving.ports import FailoverPort, Leader
    from p2pswarm.agent.serving.stage_host import StageHost

log = logging.getLogger("p2pswarm.serving")

CANDIDATES_TRIED = 3  # cards asked, in order, before a heal gives up for now
CONFIRM_EVERY_S = 1.0  # a load adopted lately: its fellows not heard yet asked this often
MOVES_KEPT = 32  # moves a load remembers


class Failover:
    """The leader's side (heal, watch, moves) and the fellow's answer to ``StageCheck``."""

    def __init__(self, agent: FailoverPort, leadership: Leader, loads: Loads,
                 host: StageHost) -> None:
        self.agent = agent
        self.leadership = leadership
        self.loads = loads
        self.host = host
        self.hosted = host.hosted
        self.timings = agent.config.serving  # its watch, checks and grace (``config``)
        # a silent fellow keeps its stage this long: a test shortens it midway
        self.grace_s = self.timings.grace_s
        self._locks: dict[str, trio.Lock] = {}
        self._healing: set[str] = set()
        self._retry_at: dict[str, float] = {}
        self._watching = False
        self._adopt_at: dict[str, float] = {}  # a load not adopted yet: when to ask again
        self._confirm_at: dict[str, float] = {}  # a load adopted lately: when to ask again
        self._confirming: set[str] = set()
        self._look_until = 0.0  # the watch runs at least this long (fellows come back)
        self.unloads = UnloadMemory(agent, leadership, host, loads)  # unloads outlive leaders
        self.adoption = Adoption(agent, leadership, loads, host, self._release_stray,
                                 self.unloads)
        self.keepers = Keepers(agent, leadership, loads, self._keep_here)
        self.recut = Recut(agent, loads, MOVES_KEPT)  # a live move to another cut
        leadership.serve(StageLost, self._leader_stage_lost)
        leadership.serve(LoadMove, self._leader_move)
        agent.control_ops["load_move"] = typed_op(LoadMoveRequest, load_move_request,
                                                  self._op_load_move)
        leadership.obey(StageCheck, self._check)

    # --- the fellow's side ---------------------------------------------------------------

    async def _check(self, call: StageCheck) -> StageChecked:
        hosted = self.hosted.get((call.plan_id, call.stage))
        return StageChecked(hosted.state if hosted is not None else "none")

    # --- the leader's side ---------------------------------------------------------------

    async def _leader_stage_lost(self, call: StageLost) -> LoadDone:
        log.info("a driver lost stage %d of %s (%s)", call.stage, call.plan_id,
                 call.reason[:200])
        async with self._locks.setdefault(call.plan_id, trio.Lock()):
            pass  # a live move under way ends first: it may re-cut the load (``recut``)
        record = await self.heal(self.loads.current_id(call.plan_id), f"{call.reason[:200]}")
        return LoadDone(pack_doc(record.to_doc()))

    async def _op_load_move(self, call: LoadMoveRequest) -> Any:
        reply = await self.leadership.ask(LoadMove(call.plan_id), LoadDone)
        return unpack_doc(reply.record)

    async def _leader_move(self, call: LoadMove) -> LoadDone:
        """Take the faster placement proposed for the load, live: whole stages moved to
        faster cards, or the load re-cut (``recut``). ``call.plan_id`` names the load (or
        the plan_id it had before a re-cut), or a re-cut plan proposed for it (then exactly
        that plan, or refused with what is proposed now)."""
        # the load's plan_id (its former one, after a re-cut), or a plan proposed for it
        asked = call.plan_id
        plan_id, pinned = self.loads.current_id(asked), ""
        if plan_id not in self.loads.loads:
            shown = self.recut.proposed_for(plan_id)
            if shown is not None:
                plan_id, pinned = shown, asked
        lock = self._locks.setdefault(plan_id, trio.Lock())
        async with lock:
            record = self.loads.loads.get(plan_id) or await self.adoption.adopt(plan_id)
            orders = self.loads.orders.get(plan_id)
            if record is None or orders is None:
                raise PlacementError(f"plan {plan_id} is neither a load the leader "
                                     f"{self.agent.name} leads nor a placement it proposed "
                                     "for one (`p2pswarm loads` shows both); nothing moved")
            proposal = self.recut.proposal(plan_id, orders, self.agent.planning.view())
            shown = proposal.plan.plan_id if proposal is not None and proposal.plan else ""
            if pinned and shown != pinned:
                now = "nothing faster" if proposal is None else \
                    shown or "moving whole stages"
                raise PlacementError(f"plan {pinned} is no longer the faster placement for "
                                     f"load {plan_id} (now: {now}); `p2pswarm loads` shows "
                                     "it; nothing moved")
            if proposal is None:
                named = plan_id if plan_id == asked else \
                    f"{plan_id} (plan {asked} before it was re-cut)"
                raise PlacementError(f"plan {named}: no markedly faster placement now "
                                     "(`p2pswarm loads` says when there is one)")
            if proposal.plan is not None:
                moved = await self.recut.take(record, proposal)
                self._locks.pop(plan_id, None)  # the load goes by the new plan_id now
                last = [m.to_doc() for m in moved.moves[-1:]]
                return LoadDone(pack_doc({**moved.to_doc(), "moved": last}))
            estimate = (f"{proposal.now_s * 1e3:.1f} -> {proposal.after_s * 1e3:.1f} ms a "
                        "token, estimated")
            before = len(record.moves)
            for m in proposal.moves:
                await self._move(record, m.stage, f"live move to a faster card ({estimate})",
                                 [(m.fellow, m.card)])
            record.set_faster(None)
            moves = record.moves
            return LoadDone(pack_doc({**record.to_doc(),
                                      "moved": [m.to_doc() for m in moves[-len(proposal.moves):]]
                                      if len(moves) > before else []}))

    def _note_faster(self, record: LeaderLoad) -> None:
        """Say on the load's record whether a markedly faster placement is to be had."""
        plan_id = record.plan_id
        orders = self.loads.orders.get(plan_id)
        proposal = self.recut.proposal(plan_id, orders, self.agent.planning.view()) \
            if orders else None
        record.set_faster(proposal)

    def elected(self) -> None:
        """This agent won an election: watch the loads, adopting those it did not lead,
        and those it led before as their fellows now keep them."""
        for plan_id in sorted(self.loads.loads):
            self.agent.spawn(self._adopt_quietly, plan_id, True)
        self._look_until = trio.current_time() + self.timings.look_after_change_s
        self.watch_soon()

    async def adopt_to_unload(self, plan_id: str) -> None:
        """Lead load ``plan_id`` before unloading it, so that the unload knows which
        bring-up its tombstone covers (best effort: unloaded as it is otherwise)."""
        if self.leadership.is_leader() and plan_id not in self.loads.loads:
            await self.adoption.adopt(plan_id)

    def look_a_while(self) -> None:
        """Watch for a while even with no load in sight: a fellow (back, or just
        elected) may gossip the orders of a load no one serves any more."""
        self._look_until = trio.current_time() + self.timings.look_after_change_s
        if self.leadership.is_leader():
            self.watch_soon()

    def _keep_here(self, plan_id: str, term: int, route: tuple[RouteHop, ...],
                   orders: tuple[StageAssignment, ...], asked: bytes) -> None:
        if self.host.kept.keep(plan_id, term, route, orders, asked):
            self.host.publish()

    def forget_load(self, plan_id: str) -> None:
        """An unload forgets the load here too: its keepers and kept orders."""
        self.keepers.forget(plan_id)
        if self.host.kept.forget(plan_id):
            self.host.publish()

    def _release_stray(self, plan_id: str, addr: str) -> None:
        self.agent.spawn(self._release_when_back, plan_id, addr)

    def watch_soon(self) -> None:
        if not self._watching:
            self._watching = True
            self.agent.spawn(self._watch)

    async def _watch(self) -> None:
        """Heal a led load whose stage fellow membership calls dead or gone (no driver
        needs to be running), retry a load that waits for a card, and adopt the loads
        fellows gossip that this leader does not lead (a predecessor's)."""
        try:
            while self.loads.loads or (self.leadership.is_leader() and (
                    self.adoption.unadopted() or trio.current_time() < self._look_until)):
                await trio.sleep(self.timings.watch_s)
                if not self.leadership.is_leader():
                    continue
                now = trio.current_time()
                for plan_id in self.adoption.unadopted():
                    if now >= self._adopt_at.get(plan_id, 0.0):
                        self._adopt_at[plan_id] = now + self.timings.retry_waiting_s
                        self.agent.spawn(self._adopt_quietly, plan_id)
                unconfirmed = self.adoption.unconfirmed()
                for plan_id in unconfirmed:
                    if plan_id not in self._confirming \
                            and now >= self._confirm_at.get(plan_id, 0.0):
                        self._confirm_at[plan_id] = now + CONFIRM_EVERY_S
                        self._confirming.add(plan_id)
                        self.agent.spawn(self._confirm_quietly, plan_id)
                for plan_id in [p for p in self._confirm_at if p not in unconfirmed]:
                    del self._confirm_at[plan_id]
                kept_by = self.keepers.kept_by()
                for plan_id, record in list(self.loads.loads.items()):
                    if plan_id in self._healing:
                        continue
                    if self.adoption.covered(plan_id) and plan_id not in self._confirming:
                        # a re-cut's new load adopted since names this one as replaced
                        self._confirming.add(plan_id)
                        self.agent.spawn(self._unload_covered, plan_id)
                        continue
                    states = [self._member_state(f) for f in record.fellow_ids]
                    # a stage's fellow that keeps the orders but serves none: restarted
                    restarted = {f for f, _ in kept_by.get(plan_id, [])} & set(
                        record.fellow_ids)
                    waiting = bool(record.waiting)
                    if waiting and now < self._retry_at.get(plan_id, 0.0):
                        continue
                    if waiting or restarted or any(s in ("dead", "left", "unknown")
                                                   for s in states):
                        self.agent.spawn(self._heal_quietly, plan_id)
                    else:
                        self._note_faster(record)
                        if self.keepers.due(plan_id, record):
                            self.agent.spawn(self._hand_keepers, plan_id)
                        elif not self._locks.setdefault(plan_id, trio.Lock()).locked():
                            self.keepers.tidy(plan_id, record)
                self.keepers.drop_forgotten()
        finally:
            self._watching = False

    async def _adopt_quietly(self, plan_id: str, refresh: bool = False) -> None:
        lock = self._locks.setdefault(plan_id, trio.Lock())
        async with lock:
            if await self.adoption.adopt(plan_id, refresh) is not None:
                self._adopt_at.pop(plan_id, None)

    async def _confirm_quietly(self, plan_id: str) -> None:
        """Ask the fellows not heard yet which unloads of a load adopted lately they
        remember (outside the load's lock: one may be silent for seconds), and unload
        the load if one covers it: a leader deposed just after it re-cut or unloaded it
        holds the tombstone, and its fellows must not serve both plans of one load."""
        try:
            if await self.adoption.confirm(plan_id):
                await self._unload_covered(plan_id)
        finally:
            self._confirming.discard(plan_id)

    async def _unload_covered(self, plan_id: str) -> None:
        """Unload led load ``plan_id`` if a tombstone known here covers its bring-up."""
        try:
            async with self._locks.setdefault(plan_id, trio.Lock()):
                if self.adoption.covered(plan_id):
                    log.warning("%s unloads load %s: it was unloaded or re-cut before it "
                                "adopted it", self.agent.name, plan_id)
                    await self.loads.unload_led(plan_id)
        finally:
            self._confirming.discard(plan_id)
            if plan_id not in self.loads.loads:
                self._locks.pop(plan_id, None)

    async def _hand_keepers(self, plan_id: str) -> None:
        lock = self._locks.setdefault(plan_id, trio.Lock())
        if lock.locked() or plan_id in self._healing:
            return  # a heal or a move under way: the next round hands the new route
        async with lock:
            record, orders = self.loads.loads.get(plan_id), self.loads.orders.get(plan_id)
            if record is not None and orders is not None and self.leadership.is_leader() \
                    and self.keepers.due(plan_id, record):
                await self.keepers.hand(plan_id, record, orders)

    async def _heal_quietly(self, plan_id: str) -> None:
        try:
            await self.heal(plan_id, "its fellow's membership state")
        except SwarmError as exc:
            log.info("load %s waits: %s", plan_id, exc)

    def _member_state(self, fid: str) -> str:
        member = self.agent.fellow(fid)
        return member.state if member is not None else "unknown"

    async def heal(self, plan_id: str, why: str) -> LeaderLoad:
        """Make load ``plan_id`` whole: every stage's fellow back, or its stage re-placed.
        Returns the load's record; PlacementError when a lost stage has no card to go to
        (the record then says what it waits for)."""
        lock = self._locks.setdefault(plan_id, trio.Lock())
        self._healing.add(plan_id)
        try:
            async with lock:
                record = self.loads.loads.get(plan_id) or await self.adoption.adopt(plan_id)
                if record is None:
                    raise PlacementError(f"plan {plan_id} is not loaded, or none of its "
                                         "fellows says how (the leader "
                                         f"{self.agent.name}); it cannot be healed")
                lost = await self._lost_stages(record)
                if not lost:
                    record.set_waiting("")
                    return record
                for stage in sorted(lost):
                    said, answered = lost[stage]
                    try:
                        await self._move(record, stage, f"{said} ({why})",
                                         same_fellow_first=answered)
                    except PlacementError as exc:
                        record.set_waiting(str(exc))
                        self._retry_at[plan_id] = trio.current_time() + self.timings.retry_waiting_s
                        raise
                record.set_waiting("")
                return record
        finally:
            self._healing.discard(plan_id)
            if plan_id not in self.loads.loads:
                self._locks.pop(plan_id, None)

    async def _lost_stages(self, record: LeaderLoad) -> dict[int, tuple[str, bool]]:
        """stage -> why its fellow is lost, and whether that fellow answered (it no longer
        holds the stage: restarted, say), for the stages whose fellow is gone, silent past
        the grace window, or without the stage; the others hold their stage live."""
        lost: dict[int, tuple[str, bool]] = {}
        deadline = trio.current_time() + self.grace_s

        async def one(hop: RouteHop) -> None:
            why = await self._lost_why(record.plan_id, hop, deadline)
            if why is not None:
                lost[hop.stage] = why

        async with trio.open_nursery() as nursery:
            for hop in record.stages:
                nursery.start_soon(one, hop)
        return lost

    async def _lost_why(self, plan_id: str, hop: RouteHop,
                        deadline: float) -> tuple[str, bool] | None:
        name = hop.fellow
        while True:
            if self._member_state(hop.fellow_id) in ("left", "unknown"):
                return f"{name} left the swarm", False
            try:
                with trio.fail_after(self.timings.check_timeout_s):
                    reply = await self.leadership.order(
                        hop.addr, StageCheck(plan_id, hop.stage), StageChecked)
                if reply.state == "active":
                    return None
                return f"{name} no longer holds the stage ({reply.state})", True
            except NobodyListens:
                return f"{name}'s process is gone (nothing listens at {hop.addr})", False
            except (SwarmError, trio.TooSlowError):
                pass
            if trio.current_time() >= deadline:
                return f"{name} was silent for {self.grace_s:g} s", False
            await trio.sleep(self.timings.check_retry_s)

    async def _move(self, record: LeaderLoad, stage: int, why: str,
                    candidates: list[tuple[Fellow, CardView]] | None = None,
                    same_fellow_first: bool = False) -> None:
        """Re-place ``stage`` of the load on a spare card (the first of ``candidates``
        that takes it), and start the new route. With ``same_fellow_first`` (its fellow
        answered that it no longer holds it), its own card comes first when it has room:
        the stage's weights are cached there."""
        plan_id = record.plan_id
        orders = self.loads.orders.get(plan_id)
        if orders is None:
            raise PlacementError(f"the leader {self.agent.name} has not the stage orders of "
                                 f"plan {plan_id} (it did not load it)")
        old = orders[stage]
        route = record.stages
        old_hop = route[stage]
        if candidates is None:
            busy = set(record.fellow_ids)
            own = old_hop.fellow_id
            if same_fellow_first and record.fellow_ids.count(own) == 1:
                busy.discard(own)  # it holds no other stage of the load
            candidates = spare_cards(self.agent.planning.view(), old.need_bytes, busy)
            if same_fellow_first:
                candidates.sort(key=lambda fc: (fc[0].id, fc[1].key)
                                != (own, old.card_key))
        refusals: list[str] = []
        began = time.perf_counter()
        for fellow, card in candidates[:CANDIDATES_TRIED]:
            order = moved_order(old, fellow, card)
            member = self.agent.fellow(fellow.id)
            if member is None:
                continue
            try:
                loaded = await self._bring_up(order, member.addr)
            except SwarmError as exc:
                refusals.append(f"{fellow.name}: {exc}")
                continue
            if not self.loads.leads(record):  # unloaded meanwhile
                await self._release(plan_id, member.addr, stage)
                raise PlacementError(f"plan {plan_id} was unloaded while stage {stage} moved")
            hop = replace(old_hop, fellow_id=fellow.id, fellow=member.name, addr=member.addr,
                          card=card_label(card.kind, card.index, card.name),
                          allocated_bytes=loaded.allocated_bytes,
                          fetched_bytes=loaded.fetched_bytes, fetch_s=loaded.fetch_s)
            new_route = tuple(hop if h.stage == stage else h for h in route)
            orders[stage] = order
            await self._start(plan_id, new_route, orders)
            record.stages = new_route
            record.add_move(StageMoved(time.time(), stage, old.layers, old_hop.fellow,
                                       old_hop.fellow_id, member.name, fellow.id, hop.card,
                                       why[:300], round(time.perf_counter() - began, 3)),
                            MOVES_KEPT)
            log.warning("stage %d of %s moved from %s to %s: %s", stage, plan_id,
                        old_hop.fellow, member.name, why)
            if old_hop.fellow_id not in record.fellow_ids:
                self.agent.spawn(self._release_when_back, plan_id, old_hop.addr)
            return
        needs = (f"stage {stage} (layers {old.layers[0]}-{old.layers[1] - 1}) needs a card "
                 f"with {gb(old.need_bytes)} free outside the load")
        if refusals:
            raise PlacementError(f"{needs}; those asked refused: " + "; ".join(refusals))
        why = no_spare_reason(self.agent.planning.view(), old.need_bytes,
                              set(record.fellow_ids))
        raise PlacementError(f"{needs}; {why}")

    async def _bring_up(self, order: StageOrder, addr: str) -> StageLoaded:
        """Prepare and load ``order`` on the fellow at ``addr``; released on failure."""
        try:
            with trio.fail_after(self.timings.order_timeout_s):
                await self.leadership.order(addr, StagePrepare(order.to_wire()), StagePrepared)
            with trio.fail_after(self.timings.load_timeout_s):
                return await self.leadership.order(addr, StageLoad(order.plan_id, order.stage),
                                                   StageLoaded)
        except BaseException as exc:
            with trio.CancelScope(shield=True):
                await self._release(order.plan_id, addr, order.stage)
            if isinstance(exc, trio.TooSlowError):
                raise TransportError("no answer in time") from None
            raise

    async def _release(self, plan_id: str, addr: str, stage: int) -> None:
        try:
            with trio.fail_after(self.timings.order_timeout_s):
                await self.leadership.order(addr, StageRelease(plan_id), StageReleased)
        except (SwarmError, trio.TooSlowError) as exc:
            log.info("release of stage %d of %s on %s: %s", stage, plan_id, addr, exc)

    async def _start(self, plan_id: str, hops: tuple[RouteHop, ...],
                     orders: list[StageOrder]) -> None:
        """Every stage's fellow learns the new route (the moved stage goes live) and keeps
        the orders (``adoption``). One that does not answer is left to the next heal."""
        kept = tuple(o.to_wire() for o in orders)
        asked = self.loads.asked_doc(plan_id)

        async def one(addr: str) -> None:
            try:
                with trio.fail_after(self.timings.order_timeout_s):
                    await self.leadership.order(addr, StageStart(plan_id, hops, kept, asked),
                                                StageStarted)
            except (SwarmError, trio.TooSlowError) as exc:
                log.warning("route of %s to %s: %s", plan_id, addr, exc)

        async with trio.open_nursery() as nursery:
            for addr in _distinct(h.addr for h in hops):
                nursery.start_soon(one, addr)

    async def _release_when_back(self, plan_id: str, addr: str) -> None:
        """A lost fellow that comes back still holds the moved stage: release it."""
        deadline = trio.current_time() + self.timings.release_for_s
        while trio.current_time() < deadline and plan_id in self.loads.loads:
            if addr in self.loads.loads[plan_id].addrs:
                return  # it holds another stage of the load now; the route says which
            try:
                with trio.fail_after(self.timings.check_timeout_s * 2):
                    await self.leadership.order(addr, StageRelease(plan_id), StageReleased)
                return
            except NobodyListens:
                return  # gone: it holds nothing
            except (SwarmError, trio.TooSlowError):
                await trio.sleep(2.0)


def _distinct(items: Iterable[str]) -> list[str]:
    return sorted(set(items))


__all__ = ["Failover"]
