"""A live move that re-cuts a load: the planner's faster placement brought up beside the
running one, the load's route switched to it, the old stages released.

The proposal (``proposal``): the leader plans the load's own request again on its view,
with no fixed stage count (the default plan is the fastest that fits), and
``moves.recut_proposal`` weighs it against the load as placed and against moving whole
stages. The plan is cached per load until the view changes, since the leader's watch asks
every half second. A load this leader adopted from its fellows (a predecessor brought it
up) is re-planned too: its fellows keep what it was asked as beside its orders
(``Loads.asked_doc``), and adoption takes it back; only orders kept without it are not
re-planned (whole-stage moves still are).

Taking it (``take``), all or nothing, with the load's own lock held and ``Loads.lock``:

1. The new placement comes up as a load of its own under its ``plan_id``, exactly as
   ``load`` brings one up (each fellow checks and reserves, fetches and builds, then every
   new stage learns the new route). The running load holds its memory all the while, and
   the plan was made on a view that counts it as taken, so the two fit side by side; a
   fellow that finds otherwise refuses, and the move is refused with its reason while the
   old load goes on serving untouched. What the new load was asked as names the bring-up
   it replaces (``LoadAsked.replaces``), and its fellows keep it: should this leader be
   deposed before the old stages are released and their tombstone handed out (its
   orders refused), the next leader that adopts the new load unloads the old one.
2. The load's record is handed over: the new record carries the old one's moves and this
   one, and names the plan_ids it was before (``recut_from``); the old plan_id now names
   the new load (``Loads.retire``), so a driver that asks the leader to heal the old one
   gets the new route.
3. The old stages are released. Each session in flight then loses its stream, asks the
   leader (``StageLost``), and resumes on the new route by replaying its tokens, as after
   a failover (``generation``): no session is dropped, and greedy output is unchanged.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import replace
from typing import TYPE_CHECKING

import trio

from p2pswarm.agent.adapter import adapted_plan
from p2pswarm.agent.serving.leader_load import LoadRecut
from p2pswarm.agent.serving.moves import (
    Proposal,
    faster_placement,
    recut_proposal,
)
from p2pswarm.errors import ConfigError, PlacementError, SwarmError
from p2pswarm.planner import plan_message
from p2pswarm.planner.plan import Plan

if TYPE_CHECKING:
    from p2pswarm.agent.serving.leader_load import LeaderLoad
    from p2pswarm.agent.serving.loads import Loads
    from p2pswarm.agent.serving.ports import RecutPort
    from p2pswarm.agent.serving.records import StageOrder
    from p2pswarm.planner.cluster import ClusterView

log = logging.getLogger("p2pswarm.serving")

RECUTS_NAMED = 8  # earlier plan_ids a load keeps naming (``recut_from``)
PROPOSALS_KEPT = 64  # plans proposed lately, each with its load: a stale one is named so
STRAGGLERS_FOR_S = 120.0  # a fellow still gossiping an old stage is told to release it
STRAGGLERS_EVERY_S = 2.0  # ... this often, for this long


class Recut:
    def __init__(self, agent: RecutPort, loads: Loads, moves_kept: int) -> None:
        self.agent = agent
        self.loads = loads
        self.moves_kept = moves_kept
        self._planned: dict[str, tuple[ClusterView, Plan | None]] = {}
        self._proposed: OrderedDict[str, str] = OrderedDict()  # plan_id -> the load's

    def fastest_plan(self, plan_id: str, view: ClusterView) -> Plan | None:
        """The planner's fastest plan for load ``plan_id``'s request on ``view``; None
        when the request is not known here or nothing fits."""
        asked = self.loads.asked.get(plan_id)
        if asked is None:
            self._planned.pop(plan_id, None)
            return None
        cached = self._planned.get(plan_id)
        if cached is not None and cached[0] == view:
            return cached[1]
        again = asked.replanned()
        try:
            plan: Plan | None = Plan.from_doc(adapted_plan(plan_message(again.request, view),
                                                           again.adapter_named))
        except (ConfigError, PlacementError) as exc:
            log.info("no faster plan for load %s: %s", plan_id, exc)
            plan = None
        for gone in [p for p in self._planned if p not in self.loads.asked]:
            del self._planned[gone]
        self._planned[plan_id] = (view, plan)
        return plan

    def proposal(self, plan_id: str, orders: list[StageOrder],
                 view: ClusterView) -> Proposal | None:
        """The faster placement for the load, if any: whole stages moved to faster free
        cards, or the planner's plan with another cut, whichever is faster."""
        found = recut_proposal(view, orders, self.fastest_plan(plan_id, view),
                               faster_placement(view, orders))
        if found is not None and found.plan is not None:
            self._proposed[found.plan.plan_id] = plan_id
            self._proposed.move_to_end(found.plan.plan_id)
            while len(self._proposed) > PROPOSALS_KEPT:
                self._proposed.popitem(last=False)
        return found

    def proposed_for(self, plan_id: str) -> str | None:
        """The running load (by the plan_id it goes by now) plan ``plan_id`` was proposed
        for lately, the proposal current or not; None when it was not, or the load is
        gone. A user may move by a proposal `loads` showed before the swarm changed."""
        load = self._proposed.get(plan_id)
        if load is None:
            return None
        now = self.loads.current_id(load)
        return now if now in self.loads.loads else None

    async def take(self, record: LeaderLoad, proposal: Proposal) -> LeaderLoad:
        """Bring ``proposal.plan`` up beside load ``record``, switch the load to it and
        release the old stages; the new load's record. Hold the load's own lock. Refused
        (PlacementError) with the old load serving as before when anything fails."""
        plan = proposal.plan
        assert plan is not None
        old_id, new_id = record.plan_id, plan.plan_id
        refused = f"live move of plan {old_id} to plan {new_id} refused, the load serves on " \
                  "as it was"
        began = time.perf_counter()
        async with self.loads.lock:
            asked = self.loads.asked.get(old_id)
            if asked is None or not self.loads.leads(record):
                raise PlacementError(f"{refused}: it was unloaded or changed meanwhile")
            if new_id in self.loads.loaded_ids():
                raise PlacementError(f"{refused}: plan {new_id} is loaded already")
            # the new load names the bring-up it replaces: should this leader be deposed
            # before its fellows hear the old one is gone, the next leader still knows
            replaced = self.loads.generation_of(old_id)
            again = asked.replanned()
            try:
                new = await self.loads.bring_up_beside(
                    plan, replace(again, replaces=(old_id, replaced)) if replaced else again)
            except SwarmError as exc:
                # a fellow short of memory (stage_host says "... free now, the stage
                # needs ..."): the cards cannot hold both placements at once
                both = (" (during a move both placements are held at once, and the cards "
                        "cannot hold both: `p2pswarm unload` and a new `load` take it)"
                        if "free now" in str(exc) else "")
                raise PlacementError(f"{refused}: {exc}{both}") from None
            estimate = (f"{proposal.now_s * 1e3:.1f} -> {proposal.after_s * 1e3:.1f} ms a "
                        "token, estimated")
            move = LoadRecut(time.time(), old_id, new_id, len(record.stages),
                             plan.stages, round(proposal.now_s * 1e3, 3),
                             round(proposal.after_s * 1e3, 3),
                             f"live move to a faster placement ({estimate})",
                             round(time.perf_counter() - began, 3))
            new.set_moves((*record.moves, move)[-self.moves_kept:])
            new.set_recut_from((*record.recut_from, old_id)[-RECUTS_NAMED:])
            old_addrs = {h.stage: (h.fellow_id, h.fellow, h.addr) for h in record.stages}
            generation = self.loads.retire(old_id, new_id)
            self._planned.pop(old_id, None)
            log.warning("load %s re-cut live into plan %s (%d stages -> %d): %s", old_id,
                        new_id, len(record.stages), len(new.stages), estimate)
            async with trio.open_nursery() as nursery:
                # the sessions in flight lose their streams here and resume on the new
                # route; every fellow learns that the old plan is gone before the move
                # is answered (its listing never shows the load twice)
                nursery.start_soon(self.loads.release_all, old_id, old_addrs,
                                   self.loads.keeping(old_id))
                if generation:
                    nursery.start_soon(self.loads.events.forgotten, old_id, generation)
            self.agent.spawn(self._release_stragglers, old_id)
            return new

    async def _release_stragglers(self, plan_id: str) -> None:
        """A fellow that missed the release (unreachable for a moment) still holds its old
        stage, and gossips it: tell it again, for a while."""
        deadline = trio.current_time() + STRAGGLERS_FOR_S
        while trio.current_time() < deadline:
            await trio.sleep(STRAGGLERS_EVERY_S)
            addrs = self.loads.gossiped_holders(plan_id)
            if addrs:
                await self.loads.release_all(plan_id, {i: ("", "", a)
                                                       for i, a in enumerate(addrs)})


__all__ = ["Recut"]
