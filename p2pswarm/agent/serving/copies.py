"""Copies ahead: every stage's tensors on at least two fellows besides the one that offered
them, so that a lost stage can be re-placed after its offerer left too.

Failover re-places a lost stage on a spare card, whose fellow fetches the stage's tensors
from the offerer first, then from any fellow that holds them (``weight_holders``). Without
copies the only other holder of a stage's tensors is the stage's own fellow: when it is
lost after the offerer left (a laptop that ran ``load`` and went home), nobody has them and
the load waits. So the leader, in the background, once a load is up and after every move,
orders one more fellow per stage (``StageCopy``) to fetch that stage's tensors into its
content-addressed weights cache: the fellow failover would most likely move the stage to
(the first of ``spare_cards``), else any connected fellow outside that stage, the first
that has room. Only a load of a model's files is copied (built-in models are on every
fellow), and only the model's tensors (an adapter's are left to its offerer).

It never holds up a load or a generation: the watch starts ``COPY_AFTER_S`` after a load
answers, takes no lock of the loads or failover, orders one copy at a time for the whole
leader, and gives up quietly (logged, asked again ``RETRY_S`` later or when the route
changes) when nobody has room. The load's record shows what is copied where (``copies``:
``loads`` prints "copies: stage 0 on f2, stage 1 on f3"); the fellow's side is
``copy_host``.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import trio

from p2pswarm.agent.serving.leader_load import CopyAhead, CopyTaken
from p2pswarm.agent.serving.moves import spare_cards
from p2pswarm.agent.serving.records import StageOrder, WeightsOrigin
from p2pswarm.errors import SwarmError
from p2pswarm.wire.orders import pack_doc
from p2pswarm.wire.serving import StageCopied, StageCopy

if TYPE_CHECKING:
    from p2pswarm.agent.serving.leader_load import LeaderLoad
    from p2pswarm.agent.serving.loads import Loads
    from p2pswarm.agent.serving.ports import CopiesPort, Leader

log = logging.getLogger("p2pswarm.serving")

HOLDERS_WANTED = 2  # fellows besides the offerer that hold each stage's tensors
COPY_AFTER_S = 2.0  # the watch looks this long after a load answers, and as often after
RETRY_S = 60.0  # a stage nobody had room for is asked again after this (or a new route)
CANDIDATES_TRIED = 4  # fellows asked in turn for one copy in one round
COPY_TIMEOUT_S = 3600.0  # a big stage over a slow link takes a while

Key = tuple[str, int]  # (plan_id, stage)


class CopiesAhead:
    def __init__(self, agent: CopiesPort, leadership: Leader, loads: Loads) -> None:
        self.agent = agent
        self.leadership = leadership
        self.loads = loads
        self.wanted = HOLDERS_WANTED  # 0: no copies (a test of failover without them)
        self.holders: dict[Key, dict[str, str]] = {}  # fellows that copied: id -> name
        self.copied: dict[tuple[str, int, str], CopyTaken] = {}  # what each copy took
        self._asked: dict[Key, tuple[tuple[str, ...], float]] = {}  # route, when, in vain
        self._watching = False

    def soon(self) -> None:
        """A load came up, or this fellow leads now: look at the loads' copies."""
        if not self._watching:
            self._watching = True
            self.agent.spawn(self._watch)

    async def _watch(self) -> None:
        try:
            while self.loads.loads or self.leadership.is_leader():
                await trio.sleep(COPY_AFTER_S)
                if not self.leadership.is_leader():
                    continue
                if not self.loads.loads and not self.loads.views():
                    return
                await self.round()
        finally:
            self._watching = False

    async def round(self) -> None:
        """One pass over the led loads: each stage short of holders asks for one copy."""
        for plan_id in sorted(self.loads.loads):
            record = self.loads.loads.get(plan_id)
            orders = self.loads.orders.get(plan_id)
            if record is None or orders is None or not self._whole(record):
                continue
            self._show(record, orders)  # the route may have changed since the last round
            for order in list(orders):  # a move replaces an order in place
                if order.stage < len(record.stages):
                    await self._stage(record, order)
                    self._show(record, orders)
        self._forget_gone()

    def _whole(self, record: LeaderLoad) -> bool:
        """A load waiting for a card, or with a stage's fellow lost, is failover's first."""
        if record.waiting:
            return False
        return all(self._state(f) in ("alive", "suspect") for f in record.fellow_ids)

    def _state(self, fid: str) -> str:
        member = self.agent.fellow(fid)
        return member.state if member is not None else "unknown"

    def _held_by(self, key: Key, stage_fid: str, offerer: str) -> dict[str, str]:
        """The fellows besides the offerer that hold the stage's tensors now: its own
        fellow, and those that copied them and are still connected."""
        out = {fid: name for fid, name in self.holders.get(key, {}).items()
               if fid != stage_fid and self._state(fid) in ("alive", "suspect")}
        if stage_fid != offerer:
            out[stage_fid] = ""
        out.pop(offerer, None)
        return out

    async def _stage(self, record: LeaderLoad, order: StageOrder) -> None:
        model = WeightsOrigin.of(order.model)
        if model.kind != "files":
            return
        key = (record.plan_id, order.stage)
        hop = record.stages[order.stage]
        offerer = model.source_id
        route = record.fellow_ids
        asked = self._asked.get(key)
        if asked is not None and asked[0] == route and trio.current_time() < asked[1]:
            return  # nobody had room a moment ago, on this route
        held = self._held_by(key, hop.fellow_id, offerer)
        tried = 0
        for fid in self._candidates(order, route, offerer, held):
            if len(held) >= self.wanted or tried >= CANDIDATES_TRIED:
                break
            tried += 1
            name = await self._copy(record, order, fid)
            if name is not None:
                held[fid] = name
                self.holders.setdefault(key, {})[fid] = name
        if len(held) < self.wanted:
            self._asked[key] = (route, trio.current_time() + RETRY_S)
            if tried:
                log.info("stage %d of %s: no fellow took a copy of its tensors now; asked "
                         "again in %g s", order.stage, record.plan_id, RETRY_S)
        else:
            self._asked.pop(key, None)

    def _candidates(self, order: StageOrder, route: tuple[str, ...], offerer: str,
                    held: dict[str, str]) -> list[str]:
        """Fellows to ask, in turn: the spare cards failover would move the stage to
        (the fastest first), then any other connected fellow outside that stage, by id."""
        view = self.agent.planning.view()
        out: list[str] = []
        skip = {offerer, route[order.stage], *held}
        for fellow, _ in spare_cards(view, order.need_bytes, set(route)):
            if fellow.id not in skip and fellow.id not in out:
                out.append(fellow.id)
        for fellow in sorted(view.fellows, key=lambda f: f.id):
            if fellow.connected and not fellow.training and fellow.id not in skip \
                    and fellow.id not in out:
                out.append(fellow.id)
        return out

    async def _copy(self, record: LeaderLoad, order: StageOrder, fid: str) -> str | None:
        """Order the fellow ``fid`` to copy ``order``'s stage; its name, or None."""
        member = self.agent.fellow(fid)
        if member is None or not member.present:
            return None
        plan_id = record.plan_id
        record.set_copies((*record.copies,
                           CopyAhead(order.stage, member.name, fid, since=time.time())))
        try:
            with trio.fail_after(COPY_TIMEOUT_S):
                done = await self.leadership.order(
                    member.addr, StageCopy(plan_id, order.stage, order.layers[0],
                                           order.layers[1], pack_doc(order.model)),
                    StageCopied)
        except (SwarmError, trio.TooSlowError) as exc:
            log.info("stage %d of %s not copied to %s: %s", order.stage, plan_id,
                     member.name, exc)
            return None
        self.copied[(plan_id, order.stage, fid)] = CopyTaken(
            done.held_bytes, done.fetched_bytes, round(done.fetch_s, 3), time.time())
        log.info("stage %d of %s copied ahead to %s (%d bytes fetched in %.1f s)",
                 order.stage, plan_id, member.name, done.fetched_bytes, done.fetch_s)
        return member.name

    def _show(self, record: LeaderLoad, orders: list[StageOrder]) -> None:
        """The record's ``copies``: each stage's copies outside its route hop, as held."""
        shown = []
        for order in orders:
            key = (record.plan_id, order.stage)
            hop_fid = record.stages[order.stage].fellow_id
            for fid, name in sorted(self.holders.get(key, {}).items(), key=lambda x: x[1]):
                if fid != hop_fid and self._state(fid) in ("alive", "suspect"):
                    shown.append(CopyAhead(order.stage, name, fid,
                                           taken=self.copied.get(key + (fid,))))
        record.set_copies(tuple(shown))

    def _forget_gone(self) -> None:
        led = set(self.loads.loads)
        self.holders = {k: v for k, v in self.holders.items() if k[0] in led}
        self._asked = {k: v for k, v in self._asked.items() if k[0] in led}
        self.copied = {k: v for k, v in self.copied.items() if k[0] in led}


__all__ = ["COPY_AFTER_S", "CopiesAhead", "HOLDERS_WANTED"]
