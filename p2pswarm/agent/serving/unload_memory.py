"""Unloads remembered across leaders: the orders that hand tombstones out and ask for them.

The leader that unloads a load (or re-cuts it into another plan) hands every connected
fellow a tombstone of that bring-up (``LoadUnloaded``): each keeps it (``tombstones``)
and drops the stages and kept orders of that bring-up it still has. A leader about to
adopt a load asks its fellows which unloads of that plan they remember (``UnloadsAsk``),
adopts no bring-up one covers, and hands the tombstone to the fellows that still keep it
(a fellow that was away during the unload), which drop it. See ``tombstones``.
"""

from __future__ import annotations

import hashlib
import logging
from typing import TYPE_CHECKING

import trio

from p2pswarm.agent.serving.tombstones import Tombstone, Tombstones, unfit
from p2pswarm.errors import PlacementError, SwarmError
from p2pswarm.wire.loads import (
    MAX_TOMBSTONES_SHOWN,
    LoadUnloaded,
    StageReleased,
    UnloadRecord,
    UnloadsAsk,
    UnloadsKnown,
)

if TYPE_CHECKING:
    from p2pswarm.agent.serving.loads import Loads
    from p2pswarm.agent.serving.ports import Leader, UnloadsPort
    from p2pswarm.agent.serving.stage_host import StageHost

log = logging.getLogger("p2pswarm.serving")

ASK_TIMEOUT_S = 2.0  # one fellow asked which unloads it remembers
MAX_ASKED = 64  # fellows asked before an adoption (each was handed every tombstone)


class UnloadMemory:
    """The fellow's tombstones and its answers; the leader's handing out and asking."""

    def __init__(self, agent: UnloadsPort, leadership: Leader, host: StageHost,
                 loads: Loads) -> None:
        self.agent = agent
        self.loads = loads
        self.leadership = leadership
        self.host = host
        directory = host.kept.directory
        self.tombstones = Tombstones(directory / "unloaded" if directory is not None
                                     else None)
        if self.tombstones.bad_file:
            agent.counters.drops["unloads-file-unfit"] += 1
        for plan_id in host.kept.plan_ids():  # read back beside an unload it learned
            kept = host.kept.get(plan_id)
            if kept is not None and kept.orders and self.tombstones.covers(
                    plan_id, kept.orders[0].generation) is not None:
                host.kept.forget(plan_id)
        leadership.obey(LoadUnloaded, self._unloaded)
        leadership.obey(UnloadsAsk, self._ask)

    # --- the fellow's side ---------------------------------------------------------------

    async def _unloaded(self, call: LoadUnloaded) -> StageReleased:
        record = call.unload
        why = unfit(record, self.leadership.term())
        if why is not None:
            self.agent.counters.refuse("unload-record-unfit")
            raise PlacementError(f"LoadUnloaded of {record.plan_id:.64} refused: {why}")
        self.tombstones.remember(record)
        self.loads.heard_unloaded(record.plan_id)  # its stages' gossip may lag here
        return StageReleased(tuple(await self.drop_covered(record.plan_id)))

    async def drop_covered(self, plan_id: str) -> list[int]:
        """Drop what this fellow holds and keeps of a bring-up of ``plan_id`` a tombstone
        here covers: its live stages (all of them of that bring-up) and its kept orders."""
        dropped: list[int] = []
        held = [h for (p, _), h in self.host.hosted.items() if p == plan_id]
        if held and all(self.tombstones.covers(plan_id, h.order.generation) is not None
                        for h in held):
            dropped = await self.host.release(plan_id)
        kept = self.host.kept.get(plan_id)
        if kept is not None and kept.orders and self.tombstones.covers(
                plan_id, kept.orders[0].generation) is not None \
                and self.host.kept.forget(plan_id):
            log.info("%s drops the kept orders of %s: it was unloaded", self.agent.name,
                     plan_id)
            self.host.publish()
        return dropped

    async def _ask(self, call: UnloadsAsk) -> UnloadsKnown:
        return UnloadsKnown(tuple(t.to_wire() for t in self.tombstones.of_plan(call.plan_id)))

    # --- the leader's side ---------------------------------------------------------------

    async def hand_out(self, plan_id: str, generation: str) -> None:
        """Remember the unload of ``plan_id`` brought up as ``generation`` here, and hand
        it to every connected fellow (best effort, shielded: an unload finishes it)."""
        if not generation:
            return  # orders from before generations: nothing could tell it from a reload
        record = UnloadRecord(plan_id, generation, self.leadership.term())
        self.tombstones.remember(record)
        with trio.CancelScope(shield=True):
            async with trio.open_nursery() as nursery:
                for addr in self._fellows(plan_id, MAX_ASKED * 4):
                    nursery.start_soon(self._hand, addr, record)

    async def hand_to(self, addrs: list[str], tombstone: Tombstone) -> None:
        """Hand ``tombstone`` to the fellows at ``addrs`` (they keep what it covers)."""
        async with trio.open_nursery() as nursery:
            for addr in addrs:
                nursery.start_soon(self._hand, addr, tombstone.to_wire())

    async def _hand(self, addr: str, record: UnloadRecord) -> None:
        try:
            with trio.fail_after(self.agent.config.serving.keep_order_timeout_s):
                await self.leadership.order(addr, LoadUnloaded(record), StageReleased)
        except (SwarmError, trio.TooSlowError) as exc:
            log.info("%s was not told of the unload of %s: %s", addr, record.plan_id,
                     exc or "no answer in time")

    async def learn(self, plan_id: str, heard: set[str] | None = None) -> bool:
        """Ask the connected fellows which unloads of ``plan_id`` they remember and keep
        the ones that fit here too; whether every fellow asked answered (one just
        elected may not follow this leader yet, and one silent may hold the tombstone).
        With ``heard``, the fellows in it are not asked again, and those that answer
        are added to it."""
        term = self.leadership.term()
        complete = True

        async def ask(addr: str) -> None:
            try:
                with trio.fail_after(ASK_TIMEOUT_S):
                    known = await self.leadership.order(addr, UnloadsAsk(plan_id),
                                                        UnloadsKnown)
            except (SwarmError, trio.TooSlowError) as exc:
                log.info("unloads of %s from %s: %s", plan_id, addr, exc or "no answer")
                nonlocal complete
                complete = False
                return
            for record in known.unloads[:MAX_TOMBSTONES_SHOWN]:
                if record.plan_id != plan_id or unfit(record, term) is not None:
                    self.agent.counters.refuse("unload-record-unfit")
                    continue
                self.tombstones.remember(record)
            if heard is not None:
                heard.add(addr)

        async with trio.open_nursery() as nursery:
            for addr in self._fellows(plan_id, MAX_ASKED):
                if heard is None or addr not in heard:
                    nursery.start_soon(ask, addr)
        return complete

    def _fellows(self, plan_id: str, most: int) -> list[str]:
        """Addresses of up to ``most`` connected fellows, not this one; the same choice
        for the same plan (highest random weight) when there are more."""
        membership = self.agent.membership
        addrs = {m.addr for m in (membership.members() if membership is not None else ())
                 if m.present and not m.is_self}
        ranked = sorted(addrs, key=lambda a: hashlib.sha256(
            f"{plan_id}\0{a}".encode()).digest(), reverse=True)
        return ranked[:most]


__all__ = ["UnloadMemory"]
