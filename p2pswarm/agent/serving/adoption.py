"""A new leader adopts the loads its predecessor led, so failover outlives a change of leader.

Theory of operation. The leader that brings a load up, or moves one of its stages, hands
every stage's fellow the whole route and every stage's order with ``StageStart``; each
fellow keeps them beside its stage, with the term of that order (``stage_host``). A
leader newly elected, or one asked to heal a load it does not lead, asks the fellows that
gossip a stage of the load which route and orders they keep (``StageOrdersAsk``, an order
like any other: only from the elected leader, in its term). Each answer is checked
(``kept_orders``: one order per stage, in route order, each for the fellow and layers the
route names, one plan, model and runtime), and the newest wins: the latest term, then the
route most of the answering fellows hold (a fellow lost before a move and back since
still holds the old one), then the route's fellow ids, so the choice does not depend on
the order the answers came in. One fellow's answer is enough: a load whose stage fellows
are all gone but one can still be healed.

Fellows that keep a load's orders without serving it answer too (``kept_loads``): a
keeper (``keepers``), and a fellow restarted from its disk whose stage is gone with its
process. They gossip the plan ids they keep (metadata ``kept_loads``), so a leader finds
a load no fellow serves any more, and adopts it like any other; its heal then re-places
the stages no fellow holds. A load unloaded by this leader is not adopted again, nor one
unloaded by another: before adopting, the leader asks its fellows which unloads of the
plan they remember (``unload_memory``), leaves out every answer of a bring-up a
tombstone covers, and hands that tombstone to the fellows that gave it (they drop it).

A fellow may not answer that question: one just deposed (it re-cut or unloaded the load a
moment before, its own orders refused) does not follow this leader yet, and it may be
the only one that holds the tombstone. A load its fellows still serve is adopted anyway
(a load no one leads heals no stage), but for ``CONFIRM_FOR_S`` after the adoption the
leader's watch asks again every fellow it has not heard from (``confirm``), and unloads
the adopted bring-up if a tombstone of it turns up: a re-cut load is then served on its
new plan only, never on both.

The leader then keeps the load as if it had brought it up: its watch heals it when a
stage's fellow is lost (``failover``), and a fellow that gossips a stage of the load the
adopted route does not name is told to release it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

import trio

from p2pswarm.agent.serving.leader_load import Adopted, LeaderLoad
from p2pswarm.agent.serving.loads import asked_from_doc
from p2pswarm.agent.serving.records import (
    StageOrder,
    public_adapter,
    public_model,
)
from p2pswarm.agent.serving.stage_gossip import gossiped_plan_ids
from p2pswarm.agent.serving.tombstones import unfit
from p2pswarm.errors import ConfigError, SwarmError
from p2pswarm.wire.loads import (
    RouteHop,
    StageAssignment,
    StageOrdersAsk,
    StageOrdersKept,
    UnloadRecord,
)

if TYPE_CHECKING:
    from p2pswarm.agent.serving.loads import Loads
    from p2pswarm.agent.serving.ports import AdoptionPort, Leader
    from p2pswarm.agent.serving.records import HostedStage
    from p2pswarm.agent.serving.stage_host import StageHost
    from p2pswarm.agent.serving.tombstones import Tombstone
    from p2pswarm.agent.serving.unload_memory import UnloadMemory

log = logging.getLogger("p2pswarm.serving")

ASK_TIMEOUT_S = 2.0  # the most one stage fellow may take to say what it keeps
CONFIRM_FOR_S = 120.0  # after an adoption, fellows not heard yet are asked this long


def kept_orders(plan_id: str, route: tuple[RouteHop, ...],
                orders: tuple[StageAssignment, ...]) -> list[StageOrder]:
    """The stage orders of load ``plan_id`` as a leader sent them with ``route``, checked
    (they come from the network); ConfigError naming the first thing that does not fit."""
    if not route or len(orders) != len(route):
        raise ConfigError(f"{len(orders)} stage orders for a route of {len(route)} stages")
    out: list[StageOrder] = []
    for i, (hop, sent) in enumerate(zip(route, orders)):
        order = StageOrder.from_wire(sent)
        if hop.stage != i or order.stage != i or order.plan_id != plan_id \
                or order.n_stages != len(route):
            raise ConfigError(f"order {i} is not stage {i} of the {len(route)} of {plan_id}")
        if order.fellow_id != hop.fellow_id or order.layers != (hop.start_layer, hop.end_layer):
            raise ConfigError(f"stage {i}'s order names another fellow or other layers "
                              "than the route")
        # stages share their runtime but for the weights' quantisation (``auto``)
        if out and (order.layers[0] != out[-1].layers[1] or order.model != out[0].model
                    or replace(order.runtime, quant=out[0].runtime.quant) != out[0].runtime):
            raise ConfigError(f"stage {i}'s order does not follow stage {i - 1}'s (layers, "
                              "model or runtime)")
        if out and order.generation != out[0].generation:
            raise ConfigError(f"stage {i}'s order is of another bring-up than stage 0's")
        out.append(order)
    return out


class Adoption:
    """The fellow's answer to ``StageOrdersAsk``, and the leader's adopting of loads."""

    def __init__(self, agent: AdoptionPort, leadership: Leader, loads: Loads, host: StageHost,
                 release_stray: Callable[[str, str], None], unloads: UnloadMemory) -> None:
        self.agent = agent
        self.unloads = unloads
        self.leadership = leadership
        self.loads = loads
        self.host = host
        self.hosted: dict[tuple[str, int], HostedStage] = host.hosted
        self.release_stray = release_stray  # (plan_id, addr): a fellow the route left out
        # plan_id -> (until when, fellows that said which unloads they remember): a load
        # adopted lately, whose fellows not heard yet may hold a tombstone of it
        self._confirming: dict[str, tuple[float, frozenset[str]]] = {}
        leadership.obey(StageOrdersAsk, self._kept)

    # --- the fellow's side ---------------------------------------------------------------

    async def _kept(self, call: StageOrdersAsk) -> StageOrdersKept:
        mine = [h for (p, _), h in sorted(self.hosted.items())
                if p == call.plan_id and h.state == "active" and h.kept_orders]
        if not mine:  # kept without a live stage: a keeper, or back from its disk
            kept = self.host.kept.get(call.plan_id)
            return kept.answer() if kept is not None else StageOrdersKept(0, (), ())
        h = max(mine, key=lambda h: h.started_term)
        return StageOrdersKept(h.started_term, h.route,
                               h.kept_orders, h.kept_asked)

    # --- the leader's side ---------------------------------------------------------------

    def unadopted(self) -> list[str]:
        """Loads fellows gossip that they serve, or keep the orders of, that this leader
        does not lead (yet); not those it unloaded or re-cut."""
        served = self.loads.loaded_ids()
        kept = set(self._kept_gossip()) | set(self.host.kept_idle())
        kept -= {p for p in kept if self.loads.forgotten_load(p) or p in self.loads.moved_to
                 or self.loads.recently_unloaded(p)}
        return sorted(p for p in served | kept if p not in self.loads.loads)

    def _kept_gossip(self) -> dict[str, list[str]]:
        """plan_id -> addresses of the connected fellows that keep its orders unserved."""
        out: dict[str, list[str]] = {}
        membership = self.agent.membership
        for m in membership.members() if membership is not None else ():
            if m.is_self or not m.present:
                continue
            for plan_id in self.agent.fellow_says(m).kept_loads:
                out.setdefault(plan_id, []).append(m.addr)
        return out

    async def adopt(self, plan_id: str, refresh: bool = False) -> LeaderLoad | None:
        """Lead load ``plan_id`` from what its stage fellows keep; its record, or None
        when no fellow of it answers with a route and orders that fit. A load this
        agent led before is taken as it is, or, with ``refresh`` (elected again: another
        leader may have moved a stage meanwhile), as its fellows now keep it."""
        async with self.loads.lock:  # not beside a load or an unload under way
            before = self.loads.loads.get(plan_id)
            if before is not None and not refresh:
                return before
            holders = self._holders(plan_id)
            answers: list[tuple[str, StageOrdersKept, list[StageOrder]]] = []

            async def ask(addr: str) -> None:
                try:
                    with trio.fail_after(ASK_TIMEOUT_S):
                        kept = await self.leadership.order(addr, StageOrdersAsk(plan_id),
                                                           StageOrdersKept)
                except (SwarmError, trio.TooSlowError) as exc:
                    log.info("stage orders of %s from %s: %s", plan_id, addr, exc)
                    return
                if not kept.route:
                    return  # it keeps nothing of the load (it released it meanwhile)
                try:
                    answers.append((addr, kept, kept_orders(plan_id, kept.route,
                                                            kept.orders)))
                except ConfigError as exc:
                    self.agent.counters.refuse("stage-orders-unfit")
                    log.warning("stage orders of %s from %s do not fit: %s", plan_id,
                                addr, exc)

            learned: list[bool] = []
            heard: set[str] = set()

            async def learn() -> None:
                learned.append(await self.unloads.learn(plan_id, heard))

            async with trio.open_nursery() as nursery:
                for addr in holders:
                    nursery.start_soon(ask, addr)
                nursery.start_soon(learn)
            if not self.leadership.is_leader():
                return before
            answers = self._not_unloaded(plan_id, answers)
            if before is not None and self._unloaded(plan_id, self.loads.orders.get(plan_id)):
                log.warning("load %s was unloaded while %s did not lead it; forgotten here",
                            plan_id, self.agent.name)
                self.loads.drop(plan_id)
                return None
            if not answers:
                return before
            served = bool(self.loads.gossiped_holders(plan_id)) or any(
                p == plan_id for p, _ in self.hosted)
            if not served and not all(learned):
                # kept only, from disk: maybe unloaded while its keeper was away, and the
                # fellow that did not answer may hold that tombstone; asked again later
                log.info("load %s not adopted yet: not every fellow said which unloads "
                         "it remembers", plan_id)
                return before
            _, kept, orders = newest_kept(answers)
            route = tuple(kept.route)
            self._confirming[plan_id] = (trio.current_time() + CONFIRM_FOR_S,
                                         frozenset(heard))
            if before is not None and before.fellow_ids == tuple(h.fellow_id for h in route):
                return before  # as this agent left it
            first = orders[0]
            record = LeaderLoad(plan_id, public_model(first.model), first.runtime,
                                route)
            record.set_adopted(Adopted(time.time(), self.leadership.term(), self.agent.name))
            if first.adapter:
                record.set_adapter(public_adapter(first.adapter))
            if before is not None:  # what this agent saw when it led it before
                if before.moves:
                    record.set_moves(before.moves)
                if before.load_s is not None:
                    record.set_load_s(before.load_s)
            self.loads.lead(record, orders)
            self._take_asked(plan_id, kept, first)
            log.warning("%s leads load %s now (its route and orders from %d of its "
                        "fellows)", self.agent.name, plan_id, len(answers))
            named = record.addrs
            serving = set(self.loads.gossiped_holders(plan_id))
            if any(p == plan_id for p, _ in self.hosted):
                serving.add(self.agent.addr)
            for addr in sorted(serving - named):  # those only keeping it: ``keepers``
                self.release_stray(plan_id, addr)
            return record

    def unconfirmed(self) -> list[str]:
        """Loads adopted lately whose fellows are still asked which unloads they
        remember (``confirm``)."""
        now = trio.current_time()
        for plan_id in [p for p, (until, _) in self._confirming.items()
                        if now >= until or p not in self.loads.loads]:
            del self._confirming[plan_id]
        return sorted(self._confirming)

    async def confirm(self, plan_id: str) -> bool:
        """Ask the fellows not heard from since load ``plan_id`` was adopted which
        unloads of it they remember; whether one covers the bring-up led here now (its
        caller unloads it: it was unloaded or re-cut by a leader deposed right after)."""
        entry = self._confirming.get(plan_id)
        if entry is None:
            return False
        until, before = entry
        heard = set(before)
        await self.unloads.learn(plan_id, heard)
        if plan_id in self._confirming:
            self._confirming[plan_id] = (until, frozenset(heard))
        return self.covered(plan_id)

    def covered(self, plan_id: str) -> bool:
        """Whether this leader leads load ``plan_id`` as a bring-up a tombstone covers."""
        return self.leadership.is_leader() and self._unloaded(
            plan_id, self.loads.orders.get(plan_id))

    def _take_asked(self, plan_id: str, kept: StageOrdersKept, first: StageOrder) -> None:
        """What the load was asked as, when its fellows kept it: a re-cut plans it again."""
        if plan_id in self.loads.asked or not kept.asked:
            return  # led here before (as asked here), or kept before requests were
        try:
            asked = asked_from_doc(kept.asked, first.model)
        except ConfigError as exc:
            self.agent.counters.refuse("load-request-unfit")
            log.warning("the request of load %s as its fellows keep it does not fit: %s",
                        plan_id, exc)
            return
        self.loads.asked[plan_id] = asked
        if asked.replaces is None or asked.replaces[0] == plan_id:
            return
        # a re-cut's new load: the bring-up it replaced is gone, whether or not the leader
        # that re-cut it could say so before it was deposed (the watch unloads it if led)
        record = UnloadRecord(*asked.replaces, kept.started_term)
        if unfit(record, self.leadership.term()) is None \
                and self.unloads.tombstones.remember(record):
            log.warning("load %s replaced load %s (a live move): that bring-up is gone",
                        plan_id, record.plan_id)

    def _unloaded(self, plan_id: str, orders: list[StageOrder] | None) -> bool:
        if not orders:
            return False
        return self.unloads.tombstones.covers(plan_id, orders[0].generation) is not None

    def _not_unloaded(self, plan_id: str,
                            answers: list[tuple[str, StageOrdersKept, list[StageOrder]]]
                            ) -> list[tuple[str, StageOrdersKept, list[StageOrder]]]:
        """``answers`` less those of a bring-up an unload's tombstone covers; the fellows
        that gave those are handed the tombstone (they drop what they keep of it)."""
        out = []
        stale: dict[Tombstone, list[str]] = {}
        for answer in answers:
            tombstone = self.unloads.tombstones.covers(plan_id, answer[2][0].generation)
            if tombstone is None:
                out.append(answer)
            else:
                stale.setdefault(tombstone, []).append(answer[0])
        for tombstone, addrs in stale.items():
            log.warning("%s does not adopt load %s: it was unloaded in term %d (%d of its "
                        "fellows still kept it)", self.agent.name, plan_id,
                        tombstone.unloaded_term, len(addrs))
            self.agent.spawn(self.unloads.hand_to, sorted(addrs), tombstone)
        return out

    def _holders(self, plan_id: str) -> list[str]:
        """Addresses of the connected fellows that gossip a stage of ``plan_id``, or that
        they keep its orders (this one too, when it holds or keeps one)."""
        addrs = set(self._kept_gossip().get(plan_id, []))
        membership = self.agent.membership
        for m in membership.members() if membership is not None else ():
            if not m.present:
                continue
            if plan_id in gossiped_plan_ids(self.agent.fellow_says(m)):
                addrs.add(m.addr)
        if any(p == plan_id for p, _ in self.hosted) or self.host.kept.get(plan_id):
            addrs.add(self.agent.addr)
        return sorted(addrs)


def newest_kept(answers: list[tuple[str, StageOrdersKept, list[StageOrder]]]
                ) -> tuple[str, StageOrdersKept, list[StageOrder]]:
    """The latest term's answer, then the route most answers hold, then the least
    route by fellow ids (the same choice whatever order the answers came in)."""
    def route_of(kept: StageOrdersKept) -> tuple[str, ...]:
        return tuple(h.fellow_id for h in kept.route)

    held: dict[tuple[int, tuple[str, ...]], int] = {}
    for _, kept, _ in answers:
        key = (kept.started_term, route_of(kept))
        held[key] = held.get(key, 0) + 1
    return min(answers, key=lambda a: (-a[1].started_term,
                                       -held[(a[1].started_term, route_of(a[1]))],
                                       route_of(a[1]), a[0]))


__all__ = ["ASK_TIMEOUT_S", "Adoption", "kept_orders"]
