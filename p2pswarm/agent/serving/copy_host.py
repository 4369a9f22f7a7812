"""A fellow's side of copies ahead: the leader's ``StageCopy``, obeyed at low priority.

The order names a stage of a load and carries the stage order's model block. Before any
byte moves, the fellow checks it can verify the ask: the manifest's key is what its
config, tensors and files hash to, and a load of that plan_id with a model of that key is
gossiped by the swarm's stage fellows (this fellow's own gossip included), with exactly
that stage on exactly those layers. It asks only for the tensors that stage reads, and
only when their bytes fit in what its weights cache may hold beside what live stages and
other copies keep (``storage.weights_cache_bytes``); otherwise it refuses with the
reason, counted. The tensors come by the ``gather`` path a stage load uses (the fellow
that offered them first, then any holder by hash, each checked against its SHA-256), one
copy at a time on this fellow, on their own worker slot.

A copy is kept from eviction while its load is gossiped (``hashes_kept``): a copy the
cache could drop the moment another stage loads would not be there when failover needs it.
A load no stage fellow has gossiped for ``FORGET_AFTER_S`` (unloaded, or re-cut under
another plan_id) frees its copies for eviction; they stay cached until room is needed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import trio

from p2pswarm.agent.fellow_meta import FellowSays
from p2pswarm.agent.serving.records import WeightsOrigin
from p2pswarm.agent.serving.stage_gossip import gossiped_plan_ids
from p2pswarm.agent.weight_holders import gather
from p2pswarm.agent.weights import Manifest, ManifestTensor, WeightsCache
from p2pswarm.errors import ConfigError, PlacementError
from p2pswarm.names import UnsafeName
from p2pswarm.wire.orders import unpack_doc
from p2pswarm.wire.serving import StageCopied, StageCopy

if TYPE_CHECKING:
    from p2pswarm.agent.serving.offers import Offers
    from p2pswarm.agent.serving.ports import CopyHostPort, Leader

log = logging.getLogger("p2pswarm.serving")

PLANS_KEPT = 64  # loads whose copies this fellow keeps from eviction at once
FORGET_AFTER_S = 300.0  # a load not gossiped this long frees its copies
LOOK_S = 10.0  # how often the fellow looks whether its copies' loads are still gossiped


class CopyHost:
    def __init__(self, agent: CopyHostPort, leadership: Leader, offers: Offers) -> None:
        self.agent = agent
        self.offers = offers
        self.kept: dict[str, set[str]] = {}  # plan_id -> hashes copied ahead for it
        self._kept_hashes: frozenset[str] = frozenset()
        self._unseen_since: dict[str, float] = {}  # plan_id -> when its gossip went
        self._looking = False
        self._one_at_a_time = trio.Lock()
        self._worker = trio.CapacityLimiter(1)  # copies never take more than one thread
        leadership.obey(StageCopy, self._copy)

    def hashes_kept(self) -> frozenset[str]:
        """The hashes copied ahead for loads still gossiped: the cache keeps them. A
        snapshot made on trio's thread (the cache asks from a worker thread)."""
        return self._kept_hashes

    def _keep(self, plan_id: str, hashes: set[str]) -> None:
        if plan_id not in self.kept and len(self.kept) >= PLANS_KEPT:
            return  # full of live loads' copies: this one may be evicted like any file
        self.kept.setdefault(plan_id, set()).update(hashes)
        self._kept_hashes = frozenset().union(*self.kept.values())
        if not self._looking:
            self._looking = True
            self.agent.spawn(self._forget_gone_loads)

    async def _forget_gone_loads(self) -> None:
        try:
            while self.kept:
                await trio.sleep(LOOK_S)
                now = trio.current_time()
                live = self._gossiped_plans()
                for plan_id in list(self.kept):
                    if plan_id in live:
                        self._unseen_since.pop(plan_id, None)
                    elif now - self._unseen_since.setdefault(plan_id, now) >= FORGET_AFTER_S:
                        del self.kept[plan_id], self._unseen_since[plan_id]
                        log.info("%s: load %s is gone; its copies may be evicted",
                                 self.agent.name, plan_id)
                self._kept_hashes = frozenset().union(*self.kept.values())
        finally:
            self._looking = False

    async def _copy(self, call: StageCopy) -> StageCopied:
        wanted = self._verified(call)
        cache = self.offers.weights_cache()
        lacking = [t for t in wanted if not cache.has(t.sha256, t.nbytes)]
        total = sum(t.nbytes for t in wanted)
        if lacking:
            await self._check_room(cache, sum(t.nbytes for t in lacking), call)
        model = WeightsOrigin.of(unpack_doc(call.model))
        began = time.perf_counter()
        fetched = 0
        async with self._one_at_a_time:
            if lacking:
                manifest = Manifest.from_dict(model.manifest)
                got = await gather(self.agent, manifest, [t.name for t in lacking], cache,
                                   self._run, source_id=model.source_id,
                                   source_name=model.source_name())
                fetched = got.received_bytes
        self._keep(call.plan_id, {t.sha256 for t in wanted})
        took = time.perf_counter() - began
        log.info("%s: copied stage %d of %s ahead: %d tensors, %d bytes fetched in %.1f s",
                 self.agent.name, call.stage, call.plan_id, len(wanted), fetched, took)
        return StageCopied(fetched, total, took)

    async def _run(self, fn: Any) -> Any:
        return await self.agent.compute.run(fn, self._worker)

    def _verified(self, call: StageCopy) -> list[ManifestTensor]:
        """The distinct tensors the order's stage reads, once the ask is one this fellow
        can verify (see above); PlacementError (counted) otherwise."""
        def refuse(why: str) -> PlacementError:
            self.agent.counters.refuse("stage-copy-unfit")
            return PlacementError(f"refuses to copy stage {call.stage} of {call.plan_id}: "
                                  f"{why}")

        model = WeightsOrigin.of(unpack_doc(call.model))
        if model.kind != "files" or not isinstance(model.manifest, dict):
            raise refuse("its model is not files a fellow offered")
        if not call.start_layer < call.end_layer:
            raise refuse("its layers are empty")
        try:
            manifest = Manifest.from_dict(model.manifest)
            if not manifest.key_holds():
                raise refuse("the manifest is not the model its key names")
            tensors = manifest.stage_tensors(call.start_layer, call.end_layer)
        except UnsafeName as exc:  # a name that may not become a path: hostile or broken
            self.agent.counters.drop("unsafe-name")
            raise PlacementError(f"refuses to copy stage {call.stage}: {exc}") from None
        except ConfigError as exc:
            raise refuse(str(exc)) from None
        if not self._gossiped_stage(call, manifest.key):
            raise refuse("no stage fellow gossips that stage of a load of that model")
        return list({t.sha256: t for t in tensors}.values())

    async def _check_room(self, cache: WeightsCache, need: int, call: StageCopy) -> None:
        """PlacementError unless ``need`` bytes fit beside what the cache must keep."""
        cap = cache.cap_bytes
        if cap is None:
            return
        keep = set(cache.in_use())
        kept = await self._run(lambda: sum(cache.size_of(h) or 0 for h in keep))
        if kept + need > cap:
            self.agent.counters.refuse("stage-copy-no-room")
            raise PlacementError(
                f"{self.agent.name} has no room to copy stage {call.stage} of {call.plan_id}: "
                f"{need:,} bytes more, its weights cache keeps {kept:,} of {cap:,}")

    def _gossips(self) -> Iterator[FellowSays]:
        """What this fellow and each present fellow say about themselves."""
        yield FellowSays.from_doc(self.agent.extra_metadata)
        membership = self.agent.membership
        for m in membership.members() if membership is not None else ():
            if m.present and not m.is_self:
                yield self.agent.fellow_says(m)

    def _gossiped_plans(self) -> set[str]:
        """The loads this fellow and each present fellow say they serve a stage of."""
        plans: set[str] = set()
        for says in self._gossips():
            plans |= gossiped_plan_ids(says)
        return plans

    def _gossiped_stage(self, call: StageCopy, model_key: str) -> bool:
        layers = (call.start_layer, call.end_layer)
        for said in (s for says in self._gossips() for s in says.stages):
            if said.plan_id != call.plan_id or said.model.key != model_key:
                continue
            # a hop out of its place in the route is not read (as ``route_hop`` reads it)
            for i, hop in enumerate(said.route or ()):
                if hop.stage == i == call.stage and hop.layers == layers:
                    return True
        return False


__all__ = ["FORGET_AFTER_S", "CopyHost", "PLANS_KEPT"]
