"""The asking side of a load: the fellow where ``load`` runs names the model (a built-in,
or a directory it hashes and offers), reads and checks a LoRA adapter against the planned
base and offers its tensors, then asks the leader (``LoadAsk``) and streams the stage
fellows' progress to its CLI while it waits. ``unload`` asks the leader too."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from p2pswarm.agent.adapter import check_adapter, read_adapter
from p2pswarm.agent.serving.offers import Offers
from p2pswarm.agent.serving.progress import Progress
from p2pswarm.agent.weights import Manifest
from p2pswarm.control.server import Emit
from p2pswarm.errors import ConfigError
from p2pswarm.planner.profile import BUILTIN_MODELS
from p2pswarm.wire.loads import LoadAsk, LoadDone, UnloadAsk, Unloaded
from p2pswarm.wire.orders import pack_doc, unpack_doc

if TYPE_CHECKING:
    from p2pswarm.agent.agent import Agent
    from p2pswarm.agent.leadership import Leadership


class LoadAsker:
    def __init__(self, agent: Agent, leadership: Leadership, offers: Offers,
                 progress: Progress) -> None:
        self.agent = agent
        self.leadership = leadership
        self.offers = offers
        self.progress = progress

    async def load(self, message: dict[str, Any], *, plan_id: str | None = None,
                   model_dir: str | None = None, adapter_dir: str | None = None,
                   on_progress: Emit | None = None) -> dict[str, Any]:
        """Ask the leader to load ``message`` (a plan request), pinned to ``plan_id`` if
        given; ``model_dir``: the model's directory on this fellow (else a built-in);
        ``adapter_dir``: LoRA adapters on this fellow to serve on top of the model."""
        model = await self._model_identity(message, model_dir)
        adapter = None
        if adapter_dir is not None:
            adapter = await self._adapter_identity(message, model, adapter_dir)
            message = {**message, "adapter": adapter["sha256"]}
        elif message.get("adapter"):
            raise ConfigError("the request names an adapter: give its directory (--adapter)")
        ticket = self.progress.new_ticket(on_progress)
        try:
            call = LoadAsk(pack_doc(message), plan_id or "", pack_doc(model),
                           pack_doc(adapter) if adapter else b"", self.agent.addr, ticket)
            reply = await self.leadership.ask(call, LoadDone)
        finally:
            self.progress.done(ticket)
        return unpack_doc(reply.record)

    async def unload(self, plan_id: str | None = None, *, all: bool = False) -> dict[str, Any]:
        """Ask the leader to unload ``plan_id`` (or the only load, or ``all``)."""
        reply = await self.leadership.ask(UnloadAsk(plan_id or "", all), Unloaded)
        return {"unloaded": list(reply.plan_ids)}

    async def _adapter_identity(self, message: dict[str, Any], model: dict[str, Any],
                                adapter_dir: str) -> dict[str, Any]:
        """Read, hash and check the adapter against the planned base, and offer its
        tensors; what the leader passes on (each stage gets its own layers' part)."""
        try:
            adapter = await self.agent.compute.run(lambda: read_adapter(adapter_dir))
        except OSError as exc:
            raise ConfigError(f"cannot read the adapter directory {adapter_dir}: {exc}") from exc
        wanted = message.get("adapter")
        if wanted and wanted != adapter.sha256:
            raise ConfigError(f"the adapter in {adapter.path} changed since it was hashed "
                              "for this request: run the command again")
        check_adapter(adapter, message["model"]["config"], str(model.get("name")),
                      model.get("path") if model.get("kind") == "files" else None)
        self.offers.server.offer(adapter.manifest)
        return {**adapter.public(), "source_id": self.agent.node_id.hex(),
                "source": self.agent.name, "manifest": adapter.manifest.to_dict()}

    async def _model_identity(self, message: dict[str, Any],
                              model_dir: str | None) -> dict[str, Any]:
        model = message.get("model")
        if not isinstance(model, dict) or not isinstance(model.get("config"), dict):
            raise ConfigError("a load request needs \"model\": {\"name\", \"config\"}")
        if model_dir is None:
            name = str(model.get("name"))
            if name in BUILTIN_MODELS and dict(BUILTIN_MODELS[name]) == model["config"]:
                return {"kind": "builtin", "name": name}
            raise ConfigError(f"no weights ship with {name!r}: give the model's directory "
                              f"(a Hugging Face config.json and *.safetensors)")
        manifest = await self.offers.offer(model_dir)
        if manifest.hf_config != model["config"]:
            raise ConfigError(f"{model_dir}/config.json differs from the planned model")
        return self._files_identity(manifest)

    def _files_identity(self, manifest: Manifest) -> dict[str, Any]:
        """A model directory on this fellow, as orders name it (the manifest travels with
        the orders; records and gossip keep the rest)."""
        data = manifest.to_dict()
        return {"kind": "files", "name": manifest.name, "key": manifest.key,
                "source_id": self.agent.node_id.hex(), "source": self.agent.name,
                "source_addr": self.agent.addr, "path": manifest.path,
                "files": data["files"], "manifest": data}
