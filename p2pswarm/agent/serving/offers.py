"""A fellow's weights: the model directories and adapters it offers to the others (hashed
once while unchanged), the verified cache of tensors it fetched, and the streams that
serve them: its offers by name (``WeightsRequest``), its offers and its cache by hash to
a fellow whose model's source is gone (``WeightsHeldAsk``, ``WeightsByHash``). How tensors
travel: ``p2pswarm.agent.weights``; who holds them: ``p2pswarm.agent.weight_holders``."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from p2pswarm.agent.serving.events import WeightsInUse
from p2pswarm.agent.weight_holders import HeldWeights
from p2pswarm.agent.weights import (
    Manifest,
    WeightsCache,
    WeightsServer,
    build_manifest,
    directory_fingerprint,
)
from p2pswarm.disk_budget import cap_bytes
from p2pswarm.errors import ConfigError
from p2pswarm.home import scratch_dir
from p2pswarm.wire.serving import WeightsByHash, WeightsHeldAsk, WeightsRequest

if TYPE_CHECKING:
    from p2pswarm.agent.serving.ports import OffersPort
    from p2pswarm.transport.secure import SecureStream


class Offers:
    def __init__(self, agent: OffersPort, in_use: WeightsInUse) -> None:
        self.agent = agent
        self.server = WeightsServer()
        self.cache: WeightsCache | None = \
            WeightsCache(agent.home / "weights") if agent.home is not None else None
        self._manifests: dict[str, tuple[Any, Manifest]] = {}
        # the hashes live stages read and copies ahead keep, never evicted (``events``)
        self.in_use = in_use
        self.held = HeldWeights(agent, self.server, self.weights_cache)
        agent.on_stream(WeightsRequest, self._on_weights_request)
        agent.on_stream(WeightsHeldAsk, self.held.answer_ask)
        agent.on_stream(WeightsByHash, self.held.serve)

    def weights_cache(self) -> WeightsCache:
        """The cache, bounded by ``storage.weights_cache_bytes`` (whichever directory the
        agent's world gave it)."""
        if self.cache is None:  # an agent without a state directory (a bare simulation)
            self.cache = WeightsCache(scratch_dir("weights-"))
        self.cache.cap_bytes = cap_bytes("weights", self.cache.root,
                                         self.agent.config.storage)
        self.cache.in_use = self.in_use
        return self.cache

    async def offer(self, model_dir: str) -> Manifest:
        """Hash a model directory (once while it stays unchanged) and serve its tensors."""
        run = self.agent.compute.run
        path = str(Path(model_dir).expanduser().resolve())
        try:
            stamp = await run(lambda: directory_fingerprint(path))
        except OSError as exc:
            raise ConfigError(f"cannot read the model directory {path}: {exc}") from exc
        known = self._manifests.get(path)
        if known is None or known[0] != stamp:
            manifest = await run(lambda: build_manifest(path))
            self._manifests[path] = (stamp, manifest)
        manifest = self._manifests[path][1]
        self.server.offer(manifest)
        return manifest

    def offered(self, manifest: Manifest) -> bool:
        """Whether this fellow offered ``manifest`` (its key): an order that names this
        fellow as the source may read only a directory it offered."""
        return self.local_dir(manifest) is not None

    def local_dir(self, manifest: Manifest) -> str | None:
        """The directory this fellow offered ``manifest``'s key from (None: it offered
        none). Orders and records carry no paths: this is the one way to the files."""
        mine = self.server.offers.get(manifest.key)
        return mine.path if mine is not None else None

    async def _on_weights_request(self, msg: WeightsRequest, stream: SecureStream) -> None:
        await self.server.serve(msg, stream, self.agent.compute.run)
