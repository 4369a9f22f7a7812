"""Keepers: a few fellows beside a load's stage fellows that keep its route and orders.

Theory of operation. A load is known to its leader (in memory) and to the fellows it
handed the route and every stage's order: each stage's fellow (``StageStart``) and
``KEEPERS`` connected fellows outside the route (``LoadKeep``), all of whom also write
them to their disk (``kept_loads``), as the leader does itself. So a one-stage load
hosted by the leader outlives that machine's death: the keepers answer the next leader
(``adoption``), which re-places the stage. Keepers are chosen by highest-random-weight
hashing of the plan id over the connected fellows (not the leader itself, nor the
route's), so a choice moves only when a keeper goes or the route takes it; the leader
hands them the orders whenever the route or the term changes and when a keeper is lost.
A fellow that keeps orders the leader no longer wants kept there (a keeper no longer
chosen, a stale copy read back after a restart, a load unloaded while it was away) is
told to drop them (``StageRelease``). The leader's watch (``failover``) runs this every
half second.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import trio

from p2pswarm.agent.planning import fellow_id
from p2pswarm.agent.serving.records import StageOrder
from p2pswarm.errors import SwarmError
from p2pswarm.wire.loads import (
    LoadKeep,
    RouteHop,
    StageAssignment,
    StageRelease,
    StageReleased,
    StageStarted,
)

if TYPE_CHECKING:
    from p2pswarm.agent.serving.leader_load import LeaderLoad
    from p2pswarm.agent.serving.loads import Loads
    from p2pswarm.agent.serving.ports import KeepersPort, Leader

log = logging.getLogger("p2pswarm.serving")

KEEPERS = 2  # fellows outside the route that keep a load's orders
DROP_AGAIN_S = 5.0  # a fellow that did not drop orders (no leader yet) is told again
DROPS_REMEMBERED = 1024


def chosen_keepers(plan_id: str, fellows: list[str], copies: int = KEEPERS) -> list[str]:
    """The ``copies`` fellow ids of ``fellows`` that keep ``plan_id``'s orders: highest
    random weight, stable when unrelated fellows come or go."""
    ranked = sorted(set(fellows), key=lambda f: hashlib.sha256(
        f"{plan_id}\0{f}".encode()).digest(), reverse=True)
    return ranked[:copies]


class Keepers:
    """The leader's side: who keeps each led load's orders, and who is told to drop them."""

    def __init__(self, agent: KeepersPort, leadership: Leader, loads: Loads,
                 keep_here: Callable[[str, int, tuple[RouteHop, ...],
                                      tuple[StageAssignment, ...], bytes], None]) -> None:
        self.agent = agent
        self.leadership = leadership
        self.loads = loads
        self.keep_here = keep_here  # the leader keeps them on its own disk too
        # plan_id -> (term, route fellow ids, keeper ids) as last handed out
        self.handed: dict[str, tuple[int, tuple[str, ...], tuple[str, ...]]] = {}
        self._told: dict[tuple[str, str], float] = {}  # (plan_id, addr) -> told to drop

    def kept_by(self) -> dict[str, list[tuple[str, str]]]:
        """plan_id -> (fellow id, addr) of the connected fellows gossiping that they keep
        its orders without serving it."""
        out: dict[str, list[tuple[str, str]]] = {}
        membership = self.agent.membership
        for m in membership.members() if membership is not None else ():
            if m.is_self or not m.present:
                continue
            for plan_id in self.agent.fellow_says(m).kept_loads:
                out.setdefault(plan_id, []).append((fellow_id(m.node_id), m.addr))
        return out

    def due(self, plan_id: str, record: LeaderLoad) -> bool:
        """Whether ``plan_id``'s keepers are to be handed its orders (again)."""
        return self.handed.get(plan_id) != self._key(plan_id, record)

    def _key(self, plan_id: str, record: LeaderLoad
             ) -> tuple[int, tuple[str, ...], tuple[str, ...]]:
        route = record.fellow_ids
        return (self.leadership.term(), route,
                tuple(sorted(self._choose(plan_id, set(route)))))

    def _choose(self, plan_id: str, route: set[str]) -> dict[str, str]:
        """fellow id -> addr of the keepers of ``plan_id`` now."""
        membership = self.agent.membership
        fellows = {fellow_id(m.node_id): m.addr
                   for m in (membership.members() if membership is not None else ())
                   if m.state == "alive" and not m.is_self}
        candidates = [f for f in fellows if f not in route]
        return {f: fellows[f] for f in chosen_keepers(plan_id, candidates)}

    async def hand(self, plan_id: str, record: LeaderLoad,
                   orders: list[StageOrder]) -> None:
        """Hand the keepers of ``plan_id`` its route and orders, and tell fellows that
        keep them but are neither keepers nor in the route to drop them."""
        key = self._key(plan_id, record)
        route_ids = set(key[1])
        keepers = self._choose(plan_id, route_ids)
        hops = record.stages
        kept = tuple(o.to_wire() for o in orders)
        asked = self.loads.asked_doc(plan_id)  # so an adopted load can be re-cut
        self.keep_here(plan_id, key[0], hops, kept, asked)

        async def one(addr: str) -> None:
            try:
                with trio.fail_after(self.agent.config.serving.keep_order_timeout_s):
                    await self.leadership.order(addr, LoadKeep(plan_id, hops, kept, asked),
                                                StageStarted)
            except (SwarmError, trio.TooSlowError) as exc:
                log.info("keeper %s of %s: %s", addr, plan_id, exc)

        async with trio.open_nursery() as nursery:
            for addr in sorted(keepers.values()):
                nursery.start_soon(one, addr)
        # one that did not take them is asked again when the route, the term or the
        # choice changes (membership calls it dead: another is chosen)
        self.handed[plan_id] = key
        self.tidy(plan_id, record)

    def tidy(self, plan_id: str, record: LeaderLoad) -> None:
        """Fellows that keep ``plan_id``'s orders, neither in its route nor its keepers
        (a keeper no longer chosen, a stale copy read back after a restart), drop them.
        Not while a stage of the load moves: the fellow it moves to may be one."""
        handed = self.handed.get(plan_id)
        if handed is None:
            return
        wanted = set(record.fellow_ids) | set(handed[2])
        for fid, addr in self.kept_by().get(plan_id, []):
            if fid not in wanted:
                self.drop(plan_id, addr)

    def drop_forgotten(self) -> None:
        """Fellows that keep the orders of a load unloaded meanwhile drop them."""
        for plan_id, holders in self.kept_by().items():
            if self.loads.forgotten_load(plan_id):
                for _, addr in holders:
                    self.drop(plan_id, addr)

    def forget(self, plan_id: str) -> None:
        self.handed.pop(plan_id, None)

    def drop(self, plan_id: str, addr: str) -> None:
        """Tell the fellow at ``addr`` to drop what it holds and keeps of ``plan_id``."""
        now = trio.current_time()
        if now < self._told.get((plan_id, addr), -DROP_AGAIN_S) + DROP_AGAIN_S:
            return  # told lately (its gossip lags, or it had no leader yet)
        self._told[(plan_id, addr)] = now
        while len(self._told) > DROPS_REMEMBERED:
            self._told.pop(next(iter(self._told)))
        self.agent.spawn(self._drop, plan_id, addr)

    async def _drop(self, plan_id: str, addr: str) -> None:
        try:
            with trio.fail_after(self.agent.config.serving.keep_order_timeout_s):
                await self.leadership.order(addr, StageRelease(plan_id), StageReleased)
            log.info("%s no longer keeps the orders of %s", addr, plan_id)
        except (SwarmError, trio.TooSlowError) as exc:
            log.info("%s keeps the orders of %s still: %s", addr, plan_id,
                     exc or "no answer in time")


__all__ = ["KEEPERS", "Keepers", "chosen_keepers"]
