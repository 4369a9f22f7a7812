"""A fellow's side of loading: the leader's stage orders (prepare, load, start, release),
its reservations and their expiry, and what its live cards have left.

``StagePrepare`` is checked against this fellow's own live view before anything is
allocated, and reserved or refused with a reason. ``StageLoad`` fetches the tensors this
fellow lacks (from the fellow that offered the model, or any that holds them:
``weight_holders``), builds the stage through the ``StageRuntime`` and refuses one that
allocates more than the plan claims. ``StageStart`` hands every stage the route and
gossips what this fellow now serves (metadata ``stages``); the route and every stage's
order are kept, on disk too, until the leader releases the load (``kept_loads``), and so
are those a keeper is handed (``LoadKeep``). A reservation that is never
started (the leader died mid-load) is released by itself after ``reservation_s``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from p2pswarm.agent.adapter import block_manifest
from p2pswarm.agent.serving.adoption import kept_orders
from p2pswarm.agent.serving.kept_loads import KeptLoads
from p2pswarm.agent.serving.offers import Offers
from p2pswarm.agent.serving.progress import Progress
from p2pswarm.agent.serving.records import (
    CachedWeights,
    HostedStage,
    StageOrder,
    WeightsOrigin,
    WeightSource,
    public_adapter,
    public_model,
    route_entry,
    runtime_doc,
)
from p2pswarm.agent.serving.runtime import AdapterPart, AdapterWeights, StageRuntime
from p2pswarm.agent.weight_holders import first_unheld, gather
from p2pswarm.agent.weights import Manifest, check_source_files
from p2pswarm.errors import ConfigError, PlacementError, SwarmError
from p2pswarm.names import UnsafeName
from p2pswarm.planner.profile import BUILTIN_MODELS
from p2pswarm.planner.wording import card_label, gb
from p2pswarm.wire.loads import (
    LoadKeep,
    StageLoad,
    StageLoaded,
    StagePrepare,
    StagePrepared,
    StageRelease,
    StageReleased,
    StageStart,
    StageStarted,
)

if TYPE_CHECKING:
    from p2pswarm.agent.serving.ports import Leader, StageHostPort
    from p2pswarm.agent.weights import WeightsCache

log = logging.getLogger("p2pswarm.serving")

PROGRESS_STEP = 0.05  # fetch progress is reported every 5% of a stage's bytes


class StageHost:
    def __init__(self, agent: StageHostPort, leadership: Leader, runtime: StageRuntime,
                 offers: Offers, progress: Progress) -> None:
        self.agent = agent
        self.leadership = leadership
        self.runtime = runtime
        self.offers = offers
        self.progress = progress
        self.hosted: dict[tuple[str, int], HostedStage] = {}
        # released while their build ran: what it allocates is dropped when it ends
        self.releasing: dict[tuple[str, int], HostedStage] = {}
        directory = agent.world.services.loads_dir or (
            agent.home / "loads" if agent.home is not None else None)
        # the orders of the loads this fellow hosts a stage of, or keeps for a later
        # leader; read back from the last run's, gossiped from the start
        self.kept = KeptLoads(directory)
        if self.kept.bad_files:
            agent.counters.drops["kept-load-unfit"] += self.kept.bad_files
        self._note_kept()
        leadership.obey(StagePrepare, self._prepare)
        leadership.obey(StageLoad, self._load)
        leadership.obey(StageStart, self._start)
        leadership.obey(StageRelease, self._release)
        leadership.obey(LoadKeep, self._keep)

    def hashes_in_use(self) -> set[str]:
        """The SHA-256 of every tensor of the models and adapters this fellow's stages
        (reserved to active) load from: the weights cache never evicts these."""
        out: set[str] = set()
        for h in (*self.hosted.values(), *self.releasing.values()):
            for block in (h.order.model, h.order.adapter):
                raw = WeightsOrigin.of(block).manifest
                if isinstance(raw, dict):
                    try:
                        manifest = Manifest.from_dict(raw)
                    except ConfigError:
                        continue
                    out.update(t.sha256 for t in manifest.tensors)
                    out.update(f.sha256 for f in manifest.files)
        return out

    def allocated_bytes(self) -> int:
        """What the stages this fellow holds really allocate."""
        return sum(h.allocated_bytes for h in self.hosted.values())

    # --- prepare: check and reserve ------------------------------------------------------

    async def _prepare(self, call: StagePrepare) -> StagePrepared:
        order = StageOrder.from_wire(call.order)
        key = (order.plan_id, order.stage)
        if order.fellow_id != self.agent.node_id.hex():
            raise PlacementError(f"{self.agent.name} got the order for stage {order.stage}, "
                                 "which the plan gives another fellow")
        now = self.leadership.term()
        plan_held = [h for k, h in self.hosted.items() if k[0] == order.plan_id]
        if key in self.hosted and all(h.state != "active" and h.term < now for h in plan_held):
            # an earlier leader's load of the same plan that never started: the change of
            # leader abandoned it (its release could not come from a deposed leader)
            log.info("%s: stage %d of %s from term %d was never started; the leader of term "
                     "%d loads it again", self.agent.name, order.stage, order.plan_id,
                     self.hosted[key].term, now)
            await self.release(order.plan_id)
        if key in self.hosted:
            raise PlacementError(f"{self.agent.name} already holds stage {order.stage} of "
                                 f"{order.plan_id}")
        reason = await self._refusal(order)
        if reason is None and order.adapter:
            reason = await self._adapter_refusal(order)
        if reason is not None:
            raise PlacementError(f"refuses stage {order.stage}: {reason}")
        hosted = HostedStage(order, self.leadership.term(),
                             trio.current_time() + self.agent.config.serving.reservation_s)
        self.hosted[key] = hosted
        self.agent.spawn(self._expire, key, hosted)
        await self.progress.report(order, "checked", 0, order.claim_bytes)
        return StagePrepared(order.need_bytes)

    async def _refusal(self, order: StageOrder) -> str | None:
        """Why this fellow cannot take ``order`` now, on its own live view; None if it can."""
        if self.agent.extra_metadata.get("training"):
            return "it is training"
        label = card_label(order.card_kind, order.card_index, order.card_name)
        cards = self.live_cards()
        card = next((c for c in cards if c.kind == order.card_kind
                     and c.index == order.card_index), None)
        if card is None:
            return f"its {label} is not offered any more"
        # Memory the plan counted as free but this fellow has promised since: reservations
        # not yet allocated; on a GPU also live stages, whose memory NVML still calls ours.
        promised = sum(h.order.need_bytes for h in self.hosted.values()
                       if h.order.card_key == order.card_key
                       and (h.state in ("reserved", "loading") or card.kind != "cpu"))
        available = card.free_bytes - promised
        if available < order.need_bytes:
            return (f"its {label} has {gb(available)} free now, the stage needs "
                    f"{gb(order.need_bytes)}")
        model = WeightsOrigin.of(order.model)
        if model.kind == "builtin":
            return None if model.name in BUILTIN_MODELS else \
                f"it does not know a built-in model {model.name!r}"
        try:
            manifest = Manifest.from_dict(model.manifest or {})
            names = [t.name for t in manifest.stage_tensors(*order.layers)]
        except ConfigError as exc:
            self._count(exc)
            return str(exc)
        if model.offered_by(self.agent.node_id.hex()):
            where = self.offers.local_dir(manifest)
            if where is None:
                return "it offered no such model directory (a fellow reads only what it offered)"
            mine = dataclasses.replace(manifest, path=where)
            try:
                await self.agent.compute.run(lambda: check_source_files(mine, names))
            except (ConfigError, OSError) as exc:
                return f"the model files are not readable as planned: {exc}"
            return None
        return await self._unreachable(manifest, names, model, "the model files")

    async def _adapter_refusal(self, order: StageOrder) -> str | None:
        """Why this fellow cannot get the adapter tensors of ``order``; None if it can."""
        block = WeightsOrigin.of(order.adapter)
        try:
            manifest = block_manifest(order.adapter)
        except ConfigError as exc:
            self._count(exc)
            return str(exc)
        if block.offered_by(self.agent.node_id.hex()):
            where = self.offers.local_dir(manifest)
            if where is None:
                return "it offered no such adapter (a fellow reads only what it offered)"
            if not Path(where).is_dir():
                return f"the adapter directory {where} is not readable any more"
            return None
        return await self._unreachable(manifest, [t.name for t in manifest.tensors], block,
                                       "the adapter's tensors")

    async def _unreachable(self, manifest: Manifest, names: list[str], block: WeightsOrigin,
                           what: str) -> str | None:
        """Why ``names`` of ``manifest`` cannot be had here: not in the cache, their
        source not connected, and no connected fellow holding one of them; None if they
        can (the source's own answer is only known when the stage loads)."""
        cache = self.offers.weights_cache()
        if all(cache.has(manifest.tensor(n).sha256, manifest.tensor(n).nbytes) for n in names):
            return None
        source_id = block.source_id
        source = self.agent.fellow(source_id)
        if source is not None and source.present:
            return None
        unheld = await first_unheld(self.agent, manifest, names, cache, source_id)
        if unheld is None:
            return None
        source_name = block.source_name("their fellow")
        return (f"{what} are not here, {source_name} (which offered them) is not connected, "
                f"and no connected fellow holds {unheld}")

    def _count(self, exc: BaseException) -> None:
        """A name that may not become a path came from a hostile or broken leader."""
        if isinstance(exc, UnsafeName):
            self.agent.counters.drop("unsafe-name")

    def live_cards(self) -> tuple[Any, ...]:
        source = self.agent.card_source
        if source is not None:
            try:
                return self.less_live_stages(tuple(source.read()))
            except SwarmError as exc:
                log.warning("reading cards failed: %s", exc)
        return tuple(self.agent.inventory.cards) if self.agent.inventory else ()

    def less_live_stages(self, cards: tuple[Any, ...]) -> tuple[Any, ...]:
        """Cards with what our loaded CPU stages hold taken out of the free bytes. The
        machine's available RAM already lacks it, but a CPU capped with ``--cpu-memory``
        reports the cap: without this it would look whole while holding a stage."""
        out = []
        for card in cards:
            held = sum(h.order.need_bytes for h in self.hosted.values()
                       if h.order.card_kind == "cpu" and card.kind == "cpu"
                       and h.order.card_index == card.index
                       and h.state in ("loaded", "active"))
            if held:
                card = dataclasses.replace(
                    card, free_bytes=max(0, min(card.free_bytes, card.total_bytes - held)))
            out.append(card)
        return tuple(out)

    # --- load: fetch and build -----------------------------------------------------------

    async def _load(self, call: StageLoad) -> StageLoaded:
        key = (call.plan_id, call.stage)
        hosted = self.hosted.get(key)
        if hosted is None or hosted.state != "reserved":
            raise PlacementError(f"{self.agent.name} holds no reservation for stage {key[1]} "
                                 f"of {key[0]} (it expired, or was released)")
        hosted.state = "loading"
        order = hosted.order
        run = self.agent.compute.run
        began = time.perf_counter()
        try:
            source, fetched, fetch_s = await self._stage_source(order)
            adapter, adapter_bytes = await self._stage_adapter(order)
            fetched += adapter_bytes
            await self.progress.report(order, "loading", 0, order.claim_bytes)
            stage = await run(lambda: self.runtime.build(order, source, adapter),
                              hosted.limiter)
        except BaseException:
            if self.hosted.get(key) is hosted:
                hosted.state = "reserved"  # the leader releases it
            elif self.releasing.get(key) is hosted:
                del self.releasing[key]
            raise
        allocated = stage.allocated_bytes()
        if self.hosted.get(key) is not hosted:  # released while it loaded
            try:
                await run(stage.unload, hosted.limiter)
            finally:
                if self.releasing.get(key) is hosted:
                    del self.releasing[key]
            raise PlacementError(f"stage {order.stage} of {order.plan_id} was released "
                                 "while it loaded")
        if allocated > order.claim_bytes:
            await run(stage.unload, hosted.limiter)
            hosted.state = "reserved"
            raise PlacementError(
                f"stage {order.stage} allocated {allocated:,} bytes, more than the "
                f"{order.claim_bytes:,} the plan claims for it: refused")
        hosted.stage = stage
        hosted.allocated_bytes = allocated
        hosted.state = "loaded"
        hosted.expires_s = trio.current_time() + self.agent.config.serving.reservation_s
        await self.progress.report(order, "ready", allocated, order.claim_bytes)
        return StageLoaded(allocated, fetched, fetch_s, time.perf_counter() - began)

    async def _stage_source(self, order: StageOrder) -> tuple[WeightSource, int, float]:
        """What the stage loads from (built-in name, model directory, cached tensors),
        fetching the tensors this fellow lacks first; the bytes fetched, and how long."""
        model = WeightsOrigin.of(order.model)
        if model.kind == "builtin":
            return str(model.name), 0, 0.0
        manifest = Manifest.from_dict(model.manifest)
        if model.offered_by(self.agent.node_id.hex()):
            where = self.offers.local_dir(manifest)
            if where is None:
                raise PlacementError(f"{self.agent.name} offered no model directory "
                                     f"{manifest.name}")
            return Path(where), 0, 0.0
        cache = self.offers.weights_cache()
        wanted = manifest.stage_tensors(*order.layers)
        # equal tensors (norms of ones, say) share one cached copy: fetch each hash once
        missing = list({t.sha256: t for t in wanted
                        if not cache.has(t.sha256, t.nbytes)}.values())
        total = sum(t.nbytes for t in missing)
        fetched = 0
        began = time.perf_counter()
        if missing:
            done = 0
            reported = 0.0

            def on_bytes(n: int) -> None:
                nonlocal done, reported
                done += n
                if done == total or done / total - reported >= PROGRESS_STEP:
                    reported = done / total
                    self.agent.spawn(self.progress.report, order, "fetching", done, total)

            await self.progress.report(order, "fetching", 0, total)
            fetched = (await gather(self.agent, manifest, [t.name for t in missing], cache,
                                    self.agent.compute.run,
                                    source_id=model.source_id,
                                    source_name=model.source_name(),
                                    on_bytes=on_bytes)).received_bytes
        return CachedWeights(manifest, cache), fetched, time.perf_counter() - began

    async def _stage_adapter(self, order: StageOrder) -> tuple[AdapterWeights | None, int]:
        """This stage's adapter tensors (fetched first when this fellow lacks them),
        verified against their SHA-256; and the bytes fetched."""
        block = order.adapter
        if not block:
            return None, 0
        manifest = block_manifest(block)
        origin = WeightsOrigin.of(block)
        local = origin.offered_by(self.agent.node_id.hex())
        if local:  # read from the directory this fellow offered, never one a block names
            where = self.offers.local_dir(manifest)
            if where is None:
                raise PlacementError(f"{self.agent.name} offered no adapter {manifest.name}")
            manifest = dataclasses.replace(manifest, path=where)
        cache: WeightsCache = self.offers.weights_cache()
        fetched = 0
        if not local:
            missing = list({t.sha256: t for t in manifest.tensors
                            if not cache.has(t.sha256, t.nbytes)}.values())
            if missing:
                fetched = (await gather(self.agent, manifest, [t.name for t in missing], cache,
                                        self.agent.compute.run,
                                        source_id=origin.source_id,
                                        source_name=origin.source_name())
                           ).received_bytes
        try:  # the scale of its B @ A: alpha / rank (its adapter_config)
            scale = float(block["alpha"]) / int(block["rank"])
        except (KeyError, TypeError, ValueError, ZeroDivisionError):
            raise ConfigError("malformed adapter block: no alpha / rank to scale it by") from None
        part = AdapterPart(manifest, scale, local)
        weights = await self.agent.compute.run(lambda: self.runtime.adapter_tensors(part, cache))
        return weights, fetched

    # --- start, release, expiry --------------------------------------------------------

    async def _start(self, call: StageStart) -> StageStarted:
        plan_id = call.plan_id
        mine = [h for (p, _), h in self.hosted.items() if p == plan_id]
        # a fellow with two stages of the plan (two cards) gets this order twice
        if not mine or any(h.state not in ("loaded", "active") for h in mine):
            raise PlacementError(f"{self.agent.name} has no loaded stage of {plan_id} to start")
        if call.orders:
            try:
                kept_orders(plan_id, call.route, call.orders)
            except ConfigError as exc:
                self.agent.counters.refuse("stage-orders-unfit")
                raise PlacementError(f"StageStart of {plan_id} refused: {exc}") from None
        for h in mine:
            h.route = tuple(call.route)
            h.kept_orders, h.started_term, h.kept_asked = call.orders, call.term, call.asked
            h.state = "active"
        if call.orders:
            self.kept.keep(plan_id, call.term, call.route, call.orders, call.asked)
        self._publish_stages()
        return StageStarted(tuple(h.order.stage for h in mine))

    async def _keep(self, call: LoadKeep) -> StageStarted:
        """Keep a load's route and orders for a later leader, hosting none of its stages."""
        try:
            kept_orders(call.plan_id, call.route, call.orders)
        except ConfigError as exc:
            self.agent.counters.refuse("stage-orders-unfit")
            raise PlacementError(f"LoadKeep of {call.plan_id} refused: {exc}") from None
        if not self.kept.keep(call.plan_id, call.term, call.route, call.orders, call.asked):
            raise PlacementError(f"{self.agent.name} keeps no more loads")
        self._publish_stages()
        return StageStarted(())

    async def _release(self, call: StageRelease) -> StageReleased:
        """The leader drops the load here: its stages, and the orders kept of it. A
        stage that never started (a move onto this fellow that failed) is dropped alone:
        the orders kept from before still count."""
        held = [h.state for (p, _), h in self.hosted.items() if p == call.plan_id]
        dropped = await self.release(call.plan_id)
        if (not held or "active" in held) and self.kept.forget(call.plan_id):
            self._publish_stages()
        return StageReleased(tuple(dropped))

    async def release(self, plan_id: str) -> list[int]:
        """Drop every stage of ``plan_id`` this fellow holds; returns their indexes."""
        dropped = [(k, h) for k, h in self.hosted.items() if k[0] == plan_id]
        was_active = any(h.state == "active" for _, h in dropped)
        for key, hosted in dropped:
            del self.hosted[key]
            if hosted.state == "loading":  # its build runs on: dropped when it ends
                self.releasing[key] = hosted
            hosted.state = "released"
        for _, hosted in dropped:
            stage, hosted.stage, hosted.allocated_bytes = hosted.stage, None, 0
            if stage is not None:  # after the call in flight
                await self.agent.compute.run(stage.unload, hosted.limiter)
        if was_active:
            self._publish_stages()
        return [k[1] for k, _ in dropped]

    async def _expire(self, key: tuple[str, int], hosted: HostedStage) -> None:
        """Drop a reservation the leader never started (it died, or lost us)."""
        while True:
            await trio.sleep_until(hosted.expires_s)
            if self.hosted.get(key) is not hosted or hosted.state == "active":
                return
            if hosted.state == "loading":
                hosted.expires_s = trio.current_time() + self.agent.config.serving.reservation_s
                continue
            log.warning("%s: stage %d of %s was never started; releasing it", self.agent.name,
                        key[1], key[0])
            await self.release(key[0])
            return

    def _publish_stages(self) -> None:
        entries = []
        for h in sorted(self.hosted.values(), key=lambda h: (h.order.plan_id, h.order.stage)):
            if h.state != "active":
                continue
            o = h.order
            entries.append({"plan_id": o.plan_id, "stage": o.stage, "n_stages": o.n_stages,
                            "layers": list(o.layers),
                            "card": card_label(o.card_kind, o.card_index, o.card_name),
                            "claim_bytes": o.claim_bytes, "allocated_bytes": h.allocated_bytes,
                            "runtime": runtime_doc(o.runtime), "model": public_model(o.model),
                            **({"adapter": public_adapter(o.adapter)} if o.adapter else {}),
                            "route": [route_entry(r) for r in h.route]})
        if entries:
            self.agent.extra_metadata["stages"] = entries
        else:
            self.agent.extra_metadata.pop("stages", None)
        self._note_kept()
        self.agent.publish_metadata()

    def publish(self) -> None:
        """Gossip what this fellow serves and keeps, as it is now."""
        self._publish_stages()

    def kept_idle(self) -> list[str]:
        """The loads this fellow keeps the orders of but serves no stage of."""
        live = {p for (p, _), h in self.hosted.items() if h.state == "active"}
        return [p for p in self.kept.plan_ids() if p not in live]

    def _note_kept(self) -> None:
        idle = self.kept_idle()
        if idle:
            self.agent.extra_metadata["kept_loads"] = idle
        else:
            self.agent.extra_metadata.pop("kept_loads", None)

