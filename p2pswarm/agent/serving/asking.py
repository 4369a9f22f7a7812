"""The asking side of a load: the fellow where ``load`` runs names the model (a built-in,
or a directory it hashes and offers), reads and checks a LoRA adapter against the planned
base and offers its tensors, then asks the leader (``LoadAsk``) and streams the stage
fellows' progress to its CLI while it waits. ``unload`` asks the leader too.

A load its CLI names with a ``load_id`` can be cancelled (``cancel``, the control op
``load_cancel``: the CLI was interrupted), all or nothing: the wait is cancelled and the
leader told (``LoadCancel``), which releases every stage; a load that came up just before
is unloaded; an id not seen yet is remembered, so its load, if it comes, is refused."""

from __future__ import annotations

import logging
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypedDict

import trio

from p2pswarm.agent.adapter import AdapterManifest, check_adapter, read_adapter
from p2pswarm.agent.serving.offers import Offers
from p2pswarm.agent.serving.progress import Progress
from p2pswarm.agent.serving.records import LoadRecord
from p2pswarm.agent.weights import Manifest, ManifestDoc
from p2pswarm.control.server import Emit
from p2pswarm.errors import ConfigError, PlacementError, SwarmError, TransportError
from p2pswarm.planner.profile import BUILTIN_MODELS
from p2pswarm.shapes.model_config import RECURRENT_MODEL_TYPES
from p2pswarm.wire.loads import (
    LoadAsk,
    LoadCancel,
    LoadCancelled,
    LoadDone,
    UnloadAsk,
    Unloaded,
)
from p2pswarm.wire.orders import pack_doc, unpack_doc

if TYPE_CHECKING:
    from p2pswarm.agent.serving.ports import AskerPort, Leader

log = logging.getLogger("p2pswarm.serving")

LOAD_ID = re.compile(r"[0-9a-zA-Z_-]{1,64}")  # what a CLI may name its load with
LOADS_KEPT = 64  # loads remembered by id after they end, for a cancel that comes late
CANCEL_TIMEOUT_S = 30.0  # the most a cancelled load waits for the leader to release it


@dataclass(eq=False)
class _Asking:
    """One load this fellow asked for, as its cancel finds it."""

    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    done: trio.Event = field(default_factory=trio.Event)
    plan_id: str = ""  # the load that came up, or the one the leader cancelled
    loaded: bool = False
    outcome: str = ""  # the leader's word on a cancel (``LoadCancelled.outcome``)


@dataclass(frozen=True, slots=True)
class AskedModel:
    """What a load request (the plan request ``load`` takes) says of its model, read once:
    its name, its config.json and the adapter it names (its SHA-256; "" for none)."""

    name: str
    config: dict[str, Any]  # config.json, as the request gives it (the planner's input)
    adapter: str

    @staticmethod
    def of(request: bytes) -> AskedModel:
        """The model of a packed plan request; ConfigError without one."""
        message = unpack_doc(request)
        model, adapter = message.get("model"), message.get("adapter")
        config = model.get("config") if isinstance(model, dict) else None
        if not isinstance(model, dict) or not isinstance(config, dict):
            raise ConfigError("a load request needs \"model\": {\"name\", \"config\"}")
        return AskedModel(str(model.get("name")), config, str(adapter) if adapter else "")

    @property
    def recurrent(self) -> bool:
        return self.config.get("model_type") in RECURRENT_MODEL_TYPES


class _ModelIdentitySaid(TypedDict):
    kind: str  # "builtin" or "files"
    name: str


class ModelIdentityDoc(_ModelIdentitySaid, total=False):
    """A model's identity as load orders carry it (``ModelIdentity.to_doc``): a built-in
    says only its name; model files say their source and manifest."""

    key: str
    source_id: str
    source: str
    source_addr: str
    files: list[list[str | int]]  # [name, bytes, SHA-256]
    manifest: ManifestDoc
    recurrent: bool


@dataclass(frozen=True, slots=True)
class ModelIdentity:
    """A model as load orders name it (``StageOrder.model``): a built-in by name, or a
    directory a fellow offers, whose manifest travels with the orders (records and gossip
    keep the rest); ``to_doc`` is the document the orders carry."""

    name: str
    manifest: Manifest | None = None  # None: a built-in
    source_id: str = ""  # the offering fellow (hex id), its name and address
    source: str = ""
    source_addr: str = ""
    recurrent: bool = False  # records say so: its generations pass the context

    def to_doc(self) -> ModelIdentityDoc:
        m = self.manifest
        doc: ModelIdentityDoc
        if m is None:
            doc = {"kind": "builtin", "name": self.name}
        else:
            doc = {"kind": "files", "name": m.name, "key": m.key, "source_id": self.source_id,
                   "source": self.source, "source_addr": self.source_addr,
                   "files": [[f.name, f.nbytes, f.sha256] for f in m.files],
                   "manifest": m.to_dict()}
        if self.recurrent:
            doc["recurrent"] = True
        return doc


class CancelDoc(TypedDict):
    """The control op ``load_cancel``'s answer (``plan_id``: None where no load came up)."""

    load_id: str
    outcome: str
    plan_id: str | None


@dataclass(frozen=True, slots=True)
class CancelOutcome:
    """What became of a load cancelled by its id (``LoadAsker.cancel``)."""

    load_id: str
    outcome: str  # "cancelled", "unloaded", "not-started" or "unconfirmed"
    plan_id: str = ""  # the load that came up (or the one the leader cancelled); "": none

    def to_doc(self) -> CancelDoc:
        """As the control op ``load_cancel`` answers it."""
        return CancelDoc(load_id=self.load_id, outcome=self.outcome,
                         plan_id=self.plan_id or None)


class LoadAsker:
    def __init__(self, agent: AskerPort, leadership: Leader, offers: Offers,
                 progress: Progress) -> None:
        self.agent = agent
        self.leadership = leadership
        self.offers = offers
        self.progress = progress
        self._asking: OrderedDict[str, _Asking] = OrderedDict()  # by load id

    async def load(self, request: bytes, *, plan_id: str | None = None,
                   model_dir: str | None = None, adapter_dir: str | None = None,
                   on_progress: Emit | None = None,
                   load_id: str | None = None) -> LoadDone:
        """Ask the leader to load ``request`` (a plan request, packed as ``LoadRequest``
        carries it and ``LoadAsk`` passes it on), pinned to ``plan_id`` if given;
        ``model_dir``: the model's directory on this fellow (else a built-in);
        ``adapter_dir``: LoRA adapters on this fellow to serve on top of the model;
        ``load_id``: the name ``cancel`` finds it by. The leader's answer: its record."""
        asking = self._begin(load_id)
        ticket = self.progress.new_ticket(on_progress)
        asked = False
        try:
            with asking.scope:
                wanted = AskedModel.of(request)
                model = await self._model_identity(wanted, model_dir)
                adapter = b""
                if adapter_dir is not None:
                    read = await self._adapter(wanted, model, adapter_dir)
                    request = pack_doc({**unpack_doc(request), "adapter": read.sha256})
                    adapter = pack_doc({**read.public(), "source_id": self.agent.node_id.hex(),
                                        "source": self.agent.name,
                                        "manifest": read.manifest.to_dict()})
                elif wanted.adapter:
                    raise ConfigError("the request names an adapter: give its directory "
                                      "(--adapter)")
                call = LoadAsk(request, plan_id or "", pack_doc(model.to_doc()),
                               adapter, self.agent.addr, ticket)
                asked = True
                try:
                    reply = await self.leadership.ask(call, LoadDone)
                except TransportError:
                    raise  # the leader may be bringing it up still: cancelled below
                except SwarmError:
                    asked = False  # the leader refused it: it keeps nothing of it
                    raise
                # the record, checked as any from the network (a malformed one is cancelled)
                asking.plan_id = LoadRecord.from_doc(unpack_doc(reply.record)).plan_id
                asking.loaded = True
                return reply
            raise PlacementError("the load was cancelled; nothing stays loaded")
        finally:
            self.progress.done(ticket)
            if asked and not asking.loaded:  # cancelled while the leader worked on it
                with trio.CancelScope(shield=True):
                    await self._cancel_on_leader(ticket, asking)
            asking.done.set()

    def _begin(self, load_id: str | None) -> _Asking:
        asking = _Asking()
        if load_id is None:
            return asking
        if not LOAD_ID.fullmatch(load_id):
            raise ConfigError("a load_id is 1-64 letters, digits, '-' or '_'")
        if load_id in self._asking:
            raise PlacementError(f"load {load_id} was asked for already (or cancelled)")
        ended = [k for k, a in self._asking.items() if a.done.is_set()]
        for old in ended[:max(0, len(self._asking) + 1 - LOADS_KEPT)]:
            del self._asking[old]  # the oldest that ended; one under way stays findable
        self._asking[load_id] = asking
        return asking

    async def _cancel_on_leader(self, ticket: str, asking: _Asking) -> None:
        """Tell the leader the load under ``ticket`` is no longer wanted; wait for it."""
        with trio.move_on_after(CANCEL_TIMEOUT_S) as waited:
            try:
                reply = await self.leadership.ask(LoadCancel(ticket), LoadCancelled)
            except SwarmError as exc:
                log.warning("cancelling a load: the leader did not answer (%s); fellows "
                            "drop stages never started by themselves", exc)
                asking.outcome = "unconfirmed"
                return
            asking.outcome = reply.outcome
            asking.plan_id = reply.plan_id or asking.plan_id
        if waited.cancelled_caught:
            log.warning("cancelling a load: no answer from the leader within %g s",
                        CANCEL_TIMEOUT_S)
            asking.outcome = "unconfirmed"

    async def cancel(self, load_id: str) -> CancelOutcome:
        """Cancel the load asked for as ``load_id``, all or nothing: what became of it
        (``cancelled``: nothing stays loaded; ``unloaded``: it had come up, and is
        unloaded again; ``not-started``: it had not reached this agent, and never will;
        ``unconfirmed``: the leader did not answer the cancel)."""
        if not LOAD_ID.fullmatch(load_id):
            raise ConfigError("a load_id is 1-64 letters, digits, '-' or '_'")
        asking = self._asking.get(load_id)
        if asking is None:  # its load op has not arrived yet: refuse it when it does
            self._begin(load_id).done.set()
            return CancelOutcome(load_id, "not-started")
        asking.scope.cancel()
        await asking.done.wait()
        if asking.loaded:  # it came up before the cancel: take it down
            await self.unload(asking.plan_id)
            asking.loaded = False
            asking.outcome = "unloaded"
        outcome = asking.outcome if asking.outcome in ("unloaded", "unconfirmed") \
            else "cancelled"
        return CancelOutcome(load_id, outcome, asking.plan_id)

    async def unload(self, plan_id: str | None = None, *,
                     all: bool = False) -> tuple[str, ...]:
        """Ask the leader to unload ``plan_id`` (or the only load, or ``all``); the plan_ids
        it unloaded."""
        reply = await self.leadership.ask(UnloadAsk(plan_id or "", all), Unloaded)
        return reply.plan_ids

    async def _adapter(self, wanted: AskedModel, model: ModelIdentity,
                       adapter_dir: str) -> AdapterManifest:
        """Read, hash and check the adapter against the planned base, and offer its
        tensors (each stage gets its own layers' part, which the leader cuts)."""
        try:
            adapter = await self.agent.compute.run(lambda: read_adapter(adapter_dir))
        except OSError as exc:
            raise ConfigError(f"cannot read the adapter directory {adapter_dir}: {exc}") from exc
        if wanted.adapter and wanted.adapter != adapter.sha256:
            raise ConfigError(f"the adapter in {adapter.path} changed since it was hashed "
                              "for this request: run the command again")
        check_adapter(adapter, wanted.config, model.name,
                      model.manifest.path if model.manifest is not None else None)
        self.offers.server.offer(adapter.manifest)
        return adapter

    async def _model_identity(self, wanted: AskedModel,
                              model_dir: str | None) -> ModelIdentity:
        if model_dir is None:
            name = wanted.name
            if name in BUILTIN_MODELS and dict(BUILTIN_MODELS[name]) == wanted.config:
                return ModelIdentity(name, recurrent=wanted.recurrent)
            raise ConfigError(f"no weights ship with {name!r}: give the model's directory "
                              f"(a Hugging Face config.json and *.safetensors)")
        manifest = await self.offers.offer(model_dir)
        if manifest.hf_config != wanted.config:
            raise ConfigError(f"{model_dir}/config.json differs from the planned model")
        return ModelIdentity(manifest.name, manifest, self.agent.node_id.hex(), self.agent.name,
                             self.agent.addr, wanted.recurrent)
