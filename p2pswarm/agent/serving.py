"""Serving: loads placed by the leader, stages hosted by fellows, sessions through them.

Theory of operation.

Loading is the leader's job (leader op ``load``), all or nothing. The leader plans the
request again on its current view; a pinned ``plan_id`` that no longer comes out is
refused as ``plan-changed`` (409) with what changed (``diff_plans`` against the plan the
leader showed) and the new plan. Otherwise three rounds of term-fenced orders go out, one
per stage, concurrently:

1. ``stage-prepare``: the fellow checks its own live view before allocating anything
   (the card is still offered, its free memory still covers the stage's claim, it is not
   training, the model's files are readable and match, or are cached, or the fellow that
   has them is connected) and reserves, or refuses with a reason. One refusal and the
   leader orders every fellow to release what it reserved.
2. ``stage-load``: the fellow fetches the tensors it lacks (``p2pswarm.agent.weights``),
   builds the stage on its card and compares what it really allocated with the plan's
   claim, refusing a stage that outgrows it. One failure and everything is released.
3. ``stage-start``: every stage learns the whole route (so each knows the next hop) and
   goes live; the fellow gossips what it now serves, route included (metadata
   ``stages``), so any fellow, a new leader too, can find the load.

A reservation that is never started (the leader died mid-load) is released by itself
after ``reservation_s``. Fellows report progress with ``LoadProgress`` datagrams to the
fellow whose ``load`` is waiting, which streams them to its CLI.

Generating. The data path is a ring through the driver: the fellow where ``generate``
runs opens a sealed stream to stage 0, stage 0 one to stage 1, and so on; the last stage
opens one back to the driver. These streams stay open for the whole session (no
connection per token). Token ids go to stage 0, hidden states flow stage to stage as
tensor frames, each stage keeps its session's KV cache, the last stage samples (seeded
``Sampler``) and sends the token straight to the driver, which streams it to the CLI,
decides whether to stop and sends it to stage 0 for the next step. A decode step crosses
one hop per stage plus one: the fewest for a ring that includes a driver that owns the
loop (stops, limits, cancellation, timings), and no hop is ever crossed twice, so a
reply never travels back along the chain. Prompts go in chunks of the plan's prefill
chunk, which also pipelines the prefill: stage 0 runs chunk 2 while stage 1 runs chunk 1.

Failures are named, never waited out. A stage that cannot reach its next hop, or loses
it, sends ``SessionError`` upstream; one that loses the hop before it sends it
downstream; both get relayed, so whichever end the driver hears first names the same
fellow. The driver also watches membership (a dead or departed stage fellow ends the
session) and gives up on a silent pipeline after ``step_timeout_s``.

Each stage's torch calls run one at a time (a per-stage ``CapacityLimiter(1)``) on a
worker thread, so a long prefill never stalls gossip and heartbeats; a decode step the
stage does in under ``INLINE_STEP_S`` runs on the trio thread: the loop can spare that
long, and handing a short step to a thread and back (two wake-ups) adds a millisecond
or more to every hop on a busy machine. ``inline_compute`` runs every
call on the trio thread: in virtual time (MockClock) a thread would let the clock jump
while torch works, so the simulation sets it and compute takes no virtual time at all.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import trio

from p2pswarm import wire
from p2pswarm.agent.planning import fellow_id
from p2pswarm.agent.streams import send_best_effort
from p2pswarm.agent.weights import (
    CachedTensors,
    Manifest,
    WeightsCache,
    WeightsServer,
    build_manifest,
    check_source_files,
    directory_fingerprint,
    fetch,
)
from p2pswarm.control.server import Emit, current_emitter, emit
from p2pswarm.errors import (
    ConfigError,
    ControlError,
    PlacementError,
    RemoteProtocolError,
    SwarmError,
    TransportError,
)
from p2pswarm.planner.wording import card_label, gb
from p2pswarm.wire.serving import (
    LoadProgress,
    SessionEnd,
    SessionError,
    SessionOpen,
    SessionReturn,
    StepInput,
    StepOutput,
    WeightsRequest,
)

if TYPE_CHECKING:
    import torch

    from p2pswarm.agent.agent import Agent
    from p2pswarm.agent.leadership import Leadership
    from p2pswarm.runtime.stage import Stage
    from p2pswarm.transport.secure import SecureStream

log = logging.getLogger("p2pswarm.serving")

T = TypeVar("T")

UNLOAD_TOMBSTONE_S = 60.0  # gossip of an unloaded stage may lag; ignore it this long
MEMBER_WATCH_S = 0.25  # how often a driver looks at its stage fellows' membership state
_ROUTE_KEYS = ("stage", "fellow_id", "fellow", "addr", "layers", "card", "claim_bytes",
               "allocated_bytes")
PROGRESS_STEP = 0.05  # fetch progress is reported every 5% of a stage's bytes
INLINE_STEP_S = 0.025  # decode steps faster than this skip the worker thread


# --- values --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StageOrder:
    """What the leader asks one fellow to host: a stage of a plan, on one of its cards."""

    plan_id: str
    stage: int
    n_stages: int
    fellow_id: str  # the fellow the plan puts it on (hex node id)
    layers: tuple[int, int]
    card_kind: str
    card_index: int
    card_name: str
    claim_bytes: int  # what the stage allocates: weights, embeddings/head/buffers, KV cache
    need_bytes: int  # what must be free: the claim plus activations and workspace
    runtime: dict[str, Any]  # the plan's runtime block (StageSpec fields)
    model: dict[str, Any]  # identity: {"kind": "builtin", "name"} or {"kind": "files", ...}
    progress_addr: str = ""
    ticket: str = ""
    adapter: dict[str, Any] = field(default_factory=dict)  # LoRA on top: this stage's part

    @property
    def card_key(self) -> str:
        return f"{self.card_kind}:{self.card_index}"

    @property
    def device(self) -> str:
        return "cpu" if self.card_kind == "cpu" else f"cuda:{self.card_index}"

    def spec(self) -> Any:
        from p2pswarm.runtime.spec import StageSpec

        fields = ("dtype", "quant", "quant_group_size", "kv_dtype", "max_context_tokens",
                  "max_sessions", "prefill_chunk_tokens")
        return StageSpec(self.layers[0], self.layers[1], device=self.device,
                         **{k: self.runtime[k] for k in fields if k in self.runtime})

    def to_dict(self) -> dict[str, Any]:
        return {"plan_id": self.plan_id, "stage": self.stage, "n_stages": self.n_stages,
                "fellow_id": self.fellow_id, "layers": list(self.layers), "card_kind": self.card_kind,
                "card_index": self.card_index, "card_name": self.card_name,
                "claim_bytes": self.claim_bytes, "need_bytes": self.need_bytes,
                "runtime": self.runtime, "model": self.model,
                "progress_addr": self.progress_addr, "ticket": self.ticket,
                "adapter": self.adapter}

    @staticmethod
    def from_dict(data: dict[str, Any]) -> StageOrder:
        try:
            start, end = (int(x) for x in data["layers"])
            return StageOrder(
                plan_id=str(data["plan_id"]), stage=int(data["stage"]),
                n_stages=int(data["n_stages"]), fellow_id=str(data["fellow_id"]),
                layers=(start, end),
                card_kind=str(data["card_kind"]), card_index=int(data["card_index"]),
                card_name=str(data.get("card_name", "")),
                claim_bytes=int(data["claim_bytes"]), need_bytes=int(data["need_bytes"]),
                runtime=dict(data["runtime"]), model=dict(data["model"]),
                progress_addr=str(data.get("progress_addr", "")),
                ticket=str(data.get("ticket", "")), adapter=dict(data.get("adapter") or {}))
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"malformed stage order ({exc})") from None


@dataclass(frozen=True, slots=True)
class GenerationResult:
    plan_id: str
    prompt_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    text: str
    stop_reason: str  # "stop_token" | "max_tokens"
    time_to_first_token_s: float
    decode_s: float
    stage_decode_s: tuple[float, ...]  # compute per stage over the decode steps
    route: tuple[dict[str, Any], ...]
    logits: tuple[torch.Tensor, ...] = ()  # (vocab,) float32 per token, with keep_logits

    @property
    def decode_steps(self) -> int:
        return max(len(self.token_ids) - 1, 0)  # the first token comes out of the prefill

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_steps / self.decode_s if self.decode_steps and self.decode_s else 0.0

    def to_dict(self) -> dict[str, Any]:
        steps = self.decode_steps
        per_token = self.decode_s / steps if steps else 0.0
        compute = sum(self.stage_decode_s) / steps if steps else 0.0
        return {
            "plan_id": self.plan_id, "prompt_tokens": len(self.prompt_ids),
            "token_ids": list(self.token_ids), "text": self.text,
            "stop_reason": self.stop_reason,
            "time_to_first_token_s": self.time_to_first_token_s, "decode_s": self.decode_s,
            "decode_tokens_per_s": self.decode_tokens_per_s,
            "stages": [{**r, "ms_per_token": 1e3 * s / steps if steps else 0.0}
                       for r, s in zip(self.route, self.stage_decode_s)],
            "network_ms_per_token": max(per_token - compute, 0.0) * 1e3,
            "hops": len(self.route) + 1,
        }


def _public_adapter(adapter: dict[str, Any]) -> dict[str, Any]:
    """What records and gossip show of an adapter (no tensor list)."""
    keys = ("name", "path", "sha256", "base", "rank", "alpha", "targets", "source")
    return {k: adapter[k] for k in keys if k in adapter}


# --- state on a fellow that hosts stages ---------------------------------------------------


class HostedStage:
    """One stage this fellow holds, from reservation to release."""

    def __init__(self, order: StageOrder, term: int, expires_s: float) -> None:
        self.order = order
        self.term = term
        self.state = "reserved"  # -> loading -> loaded -> active; released when dropped
        self.expires_s = expires_s
        self.stage: Stage | None = None
        self.limiter = trio.CapacityLimiter(1)  # torch calls of one stage run one at a time
        self.allocated_bytes = 0
        self.decode_s = math.inf  # smoothed compute time of one decode step
        self.route: list[dict[str, Any]] = []
        self.sessions: set[str] = set()

    @property
    def next_hop(self) -> dict[str, Any] | None:
        i = self.order.stage + 1
        return self.route[i] if i < len(self.route) else None

    @property
    def previous_hop(self) -> dict[str, Any] | None:
        i = self.order.stage - 1
        return self.route[i] if 0 <= i < len(self.route) else None


@dataclass
class _ReturnSlot:
    """Where the last stage's stream back to a driver lands."""

    expected_id: bytes
    arrived: trio.Event = field(default_factory=trio.Event)
    done: trio.Event = field(default_factory=trio.Event)
    stream: SecureStream | None = None


class _Failure:
    """The first failure of a session, and the scope to cancel when it comes (keeps
    errors out of exception groups: watchers record, the caller raises)."""

    def __init__(self) -> None:
        self.error: SwarmError | None = None
        self.scope: trio.CancelScope | None = None
        self.produced = 0  # tokens the driver had when it failed

    def set(self, error: SwarmError) -> None:
        if self.error is None:
            self.error = error
        if self.scope is not None:
            self.scope.cancel()


class TextStream:
    """The text each new token completes (a UTF-8 sequence may span several tokens)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd") or not text.startswith(self.text):
            return ""  # wait for the rest of the character
        piece, self.text = text[len(self.text):], text
        return piece


# --- the service ---------------------------------------------------------------------------


class Serving:
    """Loads (leader ops), hosted stages (orders), sessions (streams) and the control ops
    `load`, `loads`, `unload`, `generate` of one agent."""

    def __init__(self, agent: Agent, leadership: Leadership) -> None:
        self.agent = agent
        self.leadership = leadership
        self.hosted: dict[tuple[str, int], HostedStage] = {}
        self.loads: dict[str, dict[str, Any]] = {}  # loads this agent led, by plan_id
        self.weights = WeightsServer()
        self.cache: WeightsCache | None = \
            WeightsCache(agent.home / "weights") if agent.home is not None else None
        self.step_timeout_s = 60.0  # the most a driver waits for one token
        self.session_idle_s = 600.0  # a stage drops a session whose driver fell silent
        self.prepare_timeout_s = 30.0
        self.load_timeout_s = 3600.0  # fetching and loading a big stage takes a while
        self.reservation_s = 120.0  # a stage reserved or loaded but never started
        self._unloaded: dict[str, float] = {}
        self._load_lock = trio.Lock()
        self._manifests: dict[str, tuple[Any, Manifest]] = {}
        self._progress_sinks: dict[str, Emit] = {}
        self._returns: dict[str, _ReturnSlot] = {}
        agent.control_ops.update({"load": self._op_load, "loads": self._op_loads,
                                  "unload": self._op_unload, "generate": self._op_generate})
        leadership.leader_ops.update({"load": self._leader_load, "loads": self._leader_loads,
                                      "unload": self._leader_unload})
        leadership.order_ops.update({
            "stage-prepare": self._order_prepare, "stage-load": self._order_load,
            "stage-start": self._order_start, "stage-release": self._order_release})
        agent.on_stream(SessionOpen, self._on_session_open)
        agent.on_stream(SessionReturn, self._on_session_return)
        agent.on_stream(WeightsRequest, self._on_weights_request)
        agent.on_datagram(LoadProgress, self._on_progress)
        if agent.home is not None and agent.card_source is not None:
            # A fellow that offers cards will likely host a stage, and importing torch
            # takes seconds on a small machine: pay it now, beside startup, not in `load`.
            threading.Thread(target=_import_runtime, name="p2pswarm-warm-up",
                             daemon=True).start()

    # --- where blocking work runs ----------------------------------------------------

    async def run(self, fn: Callable[[], T], limiter: trio.CapacityLimiter | None = None) -> T:
        return await self.agent.compute.run(fn, limiter)

    @property
    def inline_compute(self) -> bool:
        return self.agent.compute.inline

    @inline_compute.setter
    def inline_compute(self, inline: bool) -> None:
        self.agent.compute.inline = inline

    def weights_cache(self) -> WeightsCache:
        if self.cache is None:  # an agent without a state directory (a bare simulation)
            self.cache = WeightsCache(Path(tempfile.mkdtemp(prefix="p2pswarm-weights-")))
        return self.cache

    def allocated_bytes(self) -> int:
        """What the stages this fellow holds really allocate."""
        return sum(h.allocated_bytes for h in self.hosted.values())

    # --- control ops (the CLI's own agent) ------------------------------------------------

    async def _op_load(self, request: dict[str, Any]) -> Any:
        message = request.get("request")
        if not isinstance(message, dict):
            raise ConfigError("a load op needs a \"request\" map, as the plan op")
        path, adapter = request.get("path"), request.get("adapter")
        return await self.load(message, plan_id=request.get("plan_id") or None,
                               model_dir=str(path) if path else None,
                               adapter_dir=str(adapter) if adapter else None,
                               on_progress=current_emitter())

    async def _op_loads(self, request: dict[str, Any]) -> Any:
        return {"loads": await self.list_loads()}

    async def _op_unload(self, request: dict[str, Any]) -> Any:
        return await self.leadership.ask_op("unload", {"plan_id": request.get("plan_id") or None,
                                                    "all": bool(request.get("all"))})

    async def _op_generate(self, request: dict[str, Any]) -> Any:
        prompt = request.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise ConfigError("generate needs a non-empty \"prompt\"")

        def on_token(token: int, piece: str) -> None:
            emit({"token": token, "text": piece})

        stops = request.get("stop_token_ids")
        if stops is not None and not (isinstance(stops, list)
                                      and all(isinstance(t, int) for t in stops)):
            raise ConfigError("\"stop_token_ids\" must be a list of token ids")
        try:
            options = {"max_tokens": int(request.get("max_tokens", 64)),
                       "temperature": float(request.get("temperature", 0.0)),
                       "top_k": int(request.get("top_k", 0)),
                       "top_p": float(request.get("top_p", 1.0)),
                       "seed": int(request.get("seed", 0))}
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"generate: a bad number ({exc})") from None
        result = await self.generate(prompt, plan_id=request.get("plan_id") or None,
                                     stop_token_ids=stops, on_token=on_token, **options)
        return result.to_dict()

    # --- loading: the asking side -------------------------------------------------------

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
        ticket = f"{self.agent.rng.getrandbits(64):016x}"
        if on_progress is not None:
            self._progress_sinks[ticket] = on_progress
        try:
            return await self.leadership.ask_op("load", {  # type: ignore[no-any-return]
                "request": message, "plan_id": plan_id, "model": model, "adapter": adapter,
                "progress": {"addr": self.agent.addr, "ticket": ticket}})
        finally:
            self._progress_sinks.pop(ticket, None)

    async def _adapter_identity(self, message: dict[str, Any], model: dict[str, Any],
                                adapter_dir: str) -> dict[str, Any]:
        """Read, hash and check the adapter against the planned base, and offer its
        tensors; what the leader passes on (each stage gets its own layers' part)."""
        from p2pswarm.agent.adapter import check_adapter, read_adapter

        try:
            adapter = await self.run(lambda: read_adapter(adapter_dir))
        except OSError as exc:
            raise ConfigError(f"cannot read the adapter directory {adapter_dir}: {exc}") from exc
        wanted = message.get("adapter")
        if wanted and wanted != adapter.sha256:
            raise ConfigError(f"the adapter in {adapter.path} changed since it was hashed "
                              "for this request: run the command again")
        check_adapter(adapter, message["model"]["config"], str(model.get("name")),
                      model.get("path") if model.get("kind") == "files" else None)
        self.weights.offer(adapter.manifest)
        return {**adapter.public(), "source_id": self.agent.node_id.hex(),
                "source": self.agent.name, "manifest": adapter.manifest.to_dict()}

    async def _model_identity(self, message: dict[str, Any],
                              model_dir: str | None) -> dict[str, Any]:
        from p2pswarm.planner.profile import BUILTIN_MODELS

        model = message.get("model")
        if not isinstance(model, dict) or not isinstance(model.get("config"), dict):
            raise ConfigError("a load request needs \"model\": {\"name\", \"config\"}")
        if model_dir is None:
            name = str(model.get("name"))
            if name in BUILTIN_MODELS and dict(BUILTIN_MODELS[name]) == model["config"]:
                return {"kind": "builtin", "name": name}
            raise ConfigError(f"no weights ship with {name!r}: give the model's directory "
                              f"(a Hugging Face config.json and *.safetensors)")
        manifest = await self.offer(model_dir)
        if manifest.hf_config != model["config"]:
            raise ConfigError(f"{model_dir}/config.json differs from the planned model")
        return self._files_identity(manifest)

    async def offer(self, model_dir: str) -> Manifest:
        """Hash a model directory (once while it stays unchanged) and serve its tensors."""
        path = str(Path(model_dir).expanduser().resolve())
        try:
            stamp = await self.run(lambda: directory_fingerprint(path))
        except OSError as exc:
            raise ConfigError(f"cannot read the model directory {path}: {exc}") from exc
        known = self._manifests.get(path)
        if known is None or known[0] != stamp:
            manifest = await self.run(lambda: build_manifest(path))
            self._manifests[path] = (stamp, manifest)
        manifest = self._manifests[path][1]
        self.weights.offer(manifest)
        return manifest

    def _files_identity(self, manifest: Manifest) -> dict[str, Any]:
        """A model directory on this fellow, as orders name it (the manifest travels with
        the orders; records and gossip keep the rest)."""
        data = manifest.to_dict()
        return {"kind": "files", "name": manifest.name, "key": manifest.key,
                "source_id": self.agent.node_id.hex(), "source": self.agent.name,
                "source_addr": self.agent.addr, "path": manifest.path,
                "files": data["files"], "manifest": data}

    def _on_progress(self, msg: LoadProgress, sender: bytes, addr: str) -> None:
        sink = self._progress_sinks.get(msg.ticket)
        if sink is not None:
            sink({"progress": {"stage": msg.stage, "fellow": msg.fellow, "phase": msg.phase,
                               "done_bytes": msg.done_bytes, "total_bytes": msg.total_bytes}})

    async def _report(self, order: StageOrder, phase: str, done: int, total: int) -> None:
        if not order.progress_addr or not order.ticket:
            return
        msg = LoadProgress(order.ticket, order.stage, self.agent.name, phase, done, total)
        if order.progress_addr == self.agent.addr:
            self._on_progress(msg, self.agent.node_id, self.agent.addr)
            return
        try:
            await self.agent.send(order.progress_addr, msg)
        except SwarmError:
            pass  # progress is best effort

    # --- loading: the leader -------------------------------------------------------------

    async def _leader_load(self, body: dict[str, Any]) -> dict[str, Any]:
        message, model = body.get("request"), body.get("model")
        if not isinstance(message, dict) or not isinstance(model, dict):
            raise ConfigError("a load needs a request and a model")
        expected = body.get("plan_id")
        progress = body.get("progress") or {}
        adapter = body.get("adapter") or None
        if (adapter or {}).get("sha256") != (message.get("adapter") or None) and (
                adapter or message.get("adapter")):
            raise ConfigError("the load's adapter is not the one its request names")
        async with self._load_lock:
            try:
                plan = await self.agent.planning.plan(message)
            except PlacementError as exc:
                if not expected:
                    raise
                raise PlacementError(f"plan {expected} no longer holds, and no plan does: "
                                     f"{exc}") from exc
            self.agent.planning.shown.check_pin(str(expected) if expected else None, plan)
            if plan.get("kind") != "serve":
                raise ConfigError("load serves a model: plan it without --train")
            if not plan.get("fits"):
                raise PlacementError(f"plan {plan['plan_id']} does not fit: "
                                     f"{plan['layout']['limit']['sentence']}")
            plan_id = plan["plan_id"]
            if any(r["plan_id"] == plan_id for r in self.loads_view()):
                raise PlacementError(f"plan {plan_id} is already loaded: `p2pswarm loads` "
                                     "shows it; unload it first to load it again")
            self._check_model(message, model)
            orders = self._stage_orders(plan, model, progress, adapter)
            addrs = self._order_addrs(orders)
            return await self._bring_up(plan, orders, addrs, model, adapter)

    def _check_model(self, message: dict[str, Any], model: dict[str, Any]) -> None:
        from p2pswarm.planner.profile import BUILTIN_MODELS

        config = message["model"]["config"]
        if model.get("kind") == "builtin":
            if dict(BUILTIN_MODELS.get(str(model.get("name")), {})) != config:
                raise ConfigError(f"built-in {model.get('name')!r} is not the planned model")
        elif model.get("kind") == "files":
            if Manifest.from_dict(model.get("manifest") or {}).hf_config != config:
                raise ConfigError("the model files are not the planned model")
        else:
            raise ConfigError(f"unknown model kind {model.get('kind')!r}")

    def _stage_orders(self, plan: dict[str, Any], model: dict[str, Any],
                      progress: dict[str, Any],
                      adapter: dict[str, Any] | None = None) -> list[StageOrder]:
        from p2pswarm.agent.adapter import stage_block

        cards = {(c["fellow_id"], c["kind"], c["index"]): c for c in plan["cards"] if c["used"]}
        orders = []
        for s in plan["stages"]:
            card = cards[(s["fellow_id"], s["kind"], s["index"])]
            seg = card["segments"]
            claim = seg["weights"] + seg["embeddings_head_buffers"] + seg["kv_cache"]
            need = sum(v for k, v in seg.items()
                       if k not in ("other_programs", "free", "does_not_fit"))
            orders.append(StageOrder(
                plan_id=plan["plan_id"], stage=s["stage"], n_stages=len(plan["stages"]),
                fellow_id=s["fellow_id"], layers=(s["layers"][0], s["layers"][1]), card_kind=s["kind"],
                card_index=s["index"], card_name=s["name"], claim_bytes=claim,
                need_bytes=need, runtime=dict(plan["runtime"]), model=model,
                progress_addr=str(progress.get("addr", "")),
                ticket=str(progress.get("ticket", "")),
                adapter=stage_block(adapter, s["layers"][0], s["layers"][1]) if adapter else {}))
        return orders

    def _order_addrs(self, orders: Sequence[StageOrder]) -> dict[int, tuple[str, str, str]]:
        """stage -> (fellow id hex, name, addr), from this leader's membership view."""
        out = {}
        for order in orders:
            member = self.agent.fellow(order.fellow_id)
            if member is None or member.state not in ("alive", "suspect"):
                raise PlacementError(f"stage {order.stage}'s fellow is not connected")
            out[order.stage] = (order.fellow_id, member.name, member.addr)
        return out

    async def _bring_up(self, plan: dict[str, Any], orders: list[StageOrder],
                        addrs: dict[int, tuple[str, str, str]],
                        model: dict[str, Any],
                        adapter: dict[str, Any] | None = None) -> dict[str, Any]:
        plan_id = plan["plan_id"]
        began = time.perf_counter()
        prepared = await self._order_all(orders, addrs, "stage-prepare", self.prepare_timeout_s,
                                         lambda o: o.to_dict())
        refusals = [f"{addrs[i][1]}: {r}" for i, r in prepared.items()
                    if isinstance(r, SwarmError)]
        if refusals:
            await self._release_all(plan_id, addrs)
            raise PlacementError(f"load of plan {plan_id} refused, nothing loaded: "
                                 + "; ".join(refusals))
        loaded = await self._order_all(orders, addrs, "stage-load", self.load_timeout_s,
                                       lambda o: {"plan_id": plan_id, "stage": o.stage})
        failures = [f"{addrs[i][1]}: {r}" for i, r in loaded.items() if isinstance(r, SwarmError)]
        if failures:
            await self._release_all(plan_id, addrs)
            raise PlacementError(f"load of plan {plan_id} failed, everything released: "
                                 + "; ".join(failures))
        route = [{"stage": o.stage, "fellow_id": addrs[o.stage][0], "fellow": addrs[o.stage][1],
                  "addr": addrs[o.stage][2], "layers": list(o.layers),
                  "card": card_label(o.card_kind, o.card_index, o.card_name),
                  "claim_bytes": o.claim_bytes,
                  "allocated_bytes": int(loaded[o.stage]["allocated_bytes"]),  # type: ignore[index]
                  "fetched_bytes": int(loaded[o.stage]["fetched_bytes"]),  # type: ignore[index]
                  "fetch_s": float(loaded[o.stage]["fetch_s"])}  # type: ignore[index]
                 for o in orders]
        started = await self._order_all(orders, addrs, "stage-start", self.prepare_timeout_s,
                                        lambda o: {"plan_id": plan_id, "route": route})
        failures = [f"{addrs[i][1]}: {r}" for i, r in started.items()
                    if isinstance(r, SwarmError)]
        if failures:
            await self._release_all(plan_id, addrs)
            raise PlacementError(f"load of plan {plan_id} failed to start, everything "
                                 "released: " + "; ".join(failures))
        public_model = {k: v for k, v in model.items() if k != "manifest"}
        record = {"plan_id": plan_id, "model": public_model, "runtime": dict(plan["runtime"]),
                  "stages": route, "load_s": time.perf_counter() - began}
        if adapter:
            record["adapter"] = _public_adapter(adapter)
        self.loads[plan_id] = record
        self._unloaded.pop(plan_id, None)
        return record

    async def _order_all(self, orders: Sequence[StageOrder],
                         addrs: dict[int, tuple[str, str, str]], op: str, timeout_s: float,
                         body: Callable[[StageOrder], dict[str, Any]]) -> dict[int, Any]:
        """Send ``op`` to every stage's fellow at once; stage -> result or SwarmError."""
        results: dict[int, Any] = {}

        async def one(order: StageOrder) -> None:
            addr = addrs[order.stage][2]
            try:
                with trio.fail_after(timeout_s):
                    results[order.stage] = await self.leadership.order_op(addr, op, body(order))
            except SwarmError as exc:
                results[order.stage] = exc
            except trio.TooSlowError:
                results[order.stage] = TransportError(f"no answer to {op} within {timeout_s:g} s")

        async with trio.open_nursery() as nursery:
            for order in orders:
                nursery.start_soon(one, order)
        return results

    async def _release_all(self, plan_id: str, addrs: dict[int, tuple[str, str, str]]) -> None:
        """Order every fellow of a load to drop what it holds of it (best effort: one that
        cannot be reached drops an unstarted reservation by itself)."""
        targets = sorted({addr for _, _, addr in addrs.values()})

        async def one(addr: str) -> None:
            try:
                with trio.fail_after(self.prepare_timeout_s):
                    await self.leadership.order_op(addr, "stage-release", {"plan_id": plan_id})
            except (SwarmError, trio.TooSlowError) as exc:
                log.warning("release of %s on %s failed: %s", plan_id, addr, exc)

        with trio.CancelScope(shield=True):
            async with trio.open_nursery() as nursery:
                for addr in targets:
                    nursery.start_soon(one, addr)

    async def _leader_loads(self, body: dict[str, Any]) -> dict[str, Any]:
        return {"loads": self.loads_view()}

    async def _leader_unload(self, body: dict[str, Any]) -> dict[str, Any]:
        async with self._load_lock:
            views = self.loads_view()
            wanted = body.get("plan_id")
            if wanted:
                chosen = [r for r in views if r["plan_id"] == wanted]
                if not chosen:
                    raise PlacementError(f"plan {wanted} is not loaded; loaded: "
                                         f"{', '.join(r['plan_id'] for r in views) or 'nothing'}")
            elif body.get("all") or len(views) <= 1:
                chosen = views
            else:
                raise ConfigError(f"{len(views)} loads: name one (`p2pswarm unload PLAN_ID`) "
                                  "or pass --all")
            for record in chosen:
                addrs = {s["stage"]: (s["fellow_id"], s["fellow"], s["addr"])
                         for s in record["stages"] if s.get("state") in ("alive", "suspect")}
                await self._release_all(record["plan_id"], addrs)
                self.loads.pop(record["plan_id"], None)
                self._unloaded[record["plan_id"]] = trio.current_time()
            return {"unloaded": [r["plan_id"] for r in chosen]}

    # --- what is loaded ------------------------------------------------------------------

    def loads_view(self) -> list[dict[str, Any]]:
        """Loads as this agent knows them: those it led, and those fellows gossip that
        they serve; each stage with its fellow's membership state."""
        now = trio.current_time()
        self._unloaded = {p: t for p, t in self._unloaded.items()
                          if now - t < UNLOAD_TOMBSTONE_S}
        members = {}
        gossiped: dict[str, dict[int, dict[str, Any]]] = {}
        membership = self.agent.membership
        for m in membership.members() if membership is not None else ():
            members[fellow_id(m.node_id)] = m
            for entry in self.agent.member_metadata(m).get("stages", []) or []:
                if not isinstance(entry, dict) or "plan_id" not in entry:
                    continue
                gossiped.setdefault(str(entry["plan_id"]), {})[int(entry["stage"])] = {
                    **entry, "fellow_id": fellow_id(m.node_id), "fellow": m.name,
                    "addr": m.addr}
        records = {p: {**r, "stages": [dict(s) for s in r["stages"]]}
                   for p, r in self.loads.items()}
        for plan_id, entries in gossiped.items():
            if plan_id in records or plan_id in self._unloaded:
                continue
            # every stage fellow gossips the whole route: one entry heard is enough
            first = entries[min(entries)]
            stages = []
            for hop in first.get("route") or list(entries.values()):
                member = members.get(str(hop.get("fellow_id")))
                stages.append({**{k: hop[k] for k in _ROUTE_KEYS if k in hop},
                               **{k: v for k, v in entries.get(int(hop["stage"]), {}).items()
                                  if k in _ROUTE_KEYS},
                               **({"fellow": member.name, "addr": member.addr}
                                  if member is not None else {})})
            records[plan_id] = {"plan_id": plan_id, "model": first.get("model", {}),
                                "runtime": first.get("runtime", {}), "stages": stages}
            if first.get("adapter"):
                records[plan_id]["adapter"] = first["adapter"]
        out = []
        for plan_id in sorted(records):
            record = records[plan_id]
            for s in record["stages"]:
                member = members.get(s["fellow_id"])
                s["state"] = member.state if member is not None else "unknown"
            present = sorted(s["stage"] for s in record["stages"])
            record["complete"] = present == list(range(len(present))) and all(
                s["state"] in ("alive", "suspect") for s in record["stages"])
            out.append(record)
        return out

    async def list_loads(self) -> list[dict[str, Any]]:
        """The leader's answer, or this fellow's own view when no leader answers."""
        try:
            answer = await self.leadership.ask_op("loads", {})
        except (PlacementError, TransportError, ControlError) as exc:
            log.info("loads from this fellow's view (%s)", exc)
            return self.loads_view()
        return list(answer.get("loads", []))

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
                            "runtime": o.runtime,
                            "model": {k: v for k, v in o.model.items() if k != "manifest"},
                            **({"adapter": _public_adapter(o.adapter)} if o.adapter else {}),
                            "route": [{k: r[k] for k in _ROUTE_KEYS if k in r}
                                      for r in h.route]})
        if entries:
            self.agent.extra_metadata["stages"] = entries
        else:
            self.agent.extra_metadata.pop("stages", None)
        self.agent.publish_metadata()

    # --- loading: the fellow's orders ------------------------------------------------------

    async def _order_prepare(self, body: dict[str, Any]) -> dict[str, Any]:
        order = StageOrder.from_dict(body)
        key = (order.plan_id, order.stage)
        if order.fellow_id != self.agent.node_id.hex():
            raise PlacementError(f"{self.agent.name} got the order for stage {order.stage}, "
                                 "which the plan gives another fellow")
        if key in self.hosted:
            raise PlacementError(f"{self.agent.name} already holds stage {order.stage} of "
                                 f"{order.plan_id}")
        reason = await self._refusal(order)
        if reason is None and order.adapter:
            reason = await self._adapter_refusal(order)
        if reason is not None:
            raise PlacementError(f"refuses stage {order.stage}: {reason}")
        hosted = HostedStage(order, self.leadership.term(),
                             trio.current_time() + self.reservation_s)
        self.hosted[key] = hosted
        self.agent.spawn(self._expire, key, hosted)
        await self._report(order, "checked", 0, order.claim_bytes)
        return {"reserved_bytes": order.need_bytes}

    async def _refusal(self, order: StageOrder) -> str | None:
        """Why this fellow cannot take ``order`` now, on its own live view; None if it can."""
        if self.agent.extra_metadata.get("training"):
            return "it is training"
        label = card_label(order.card_kind, order.card_index, order.card_name)
        cards = self._live_cards()
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
        model = order.model
        if model.get("kind") == "builtin":
            from p2pswarm.planner.profile import BUILTIN_MODELS
            return None if model.get("name") in BUILTIN_MODELS else \
                f"it does not know a built-in model {model.get('name')!r}"
        try:
            manifest = Manifest.from_dict(model.get("manifest") or {})
            names = [t.name for t in manifest.stage_tensors(*order.layers)]
        except ConfigError as exc:
            return str(exc)
        if model.get("source_id") == self.agent.node_id.hex():
            try:
                await self.run(lambda: check_source_files(manifest, names))
            except (ConfigError, OSError) as exc:
                return f"the model files are not readable as planned: {exc}"
            return None
        cache = self.weights_cache()
        if all(cache.has(manifest.tensor(n).sha256, manifest.tensor(n).nbytes) for n in names):
            return None
        source = self.agent.fellow(str(model.get("source_id", "")))
        if source is None or source.state not in ("alive", "suspect"):
            return (f"the model files are not here and {model.get('source', 'their fellow')} "
                    "(which has them) is not connected")
        return None

    async def _adapter_refusal(self, order: StageOrder) -> str | None:
        """Why this fellow cannot get the adapter tensors of ``order``; None if it can."""
        from p2pswarm.agent.adapter import block_manifest

        block = order.adapter
        try:
            manifest = block_manifest(block)
        except ConfigError as exc:
            return str(exc)
        if block.get("source_id") == self.agent.node_id.hex():
            if not Path(manifest.path).is_dir():
                return f"the adapter directory {manifest.path} is not readable any more"
            return None
        cache = self.weights_cache()
        if all(cache.has(t.sha256, t.nbytes) for t in manifest.tensors):
            return None
        source = self.agent.fellow(str(block.get("source_id", "")))
        if source is None or source.state not in ("alive", "suspect"):
            return (f"the adapter is not here and {block.get('source', 'its fellow')} "
                    "(which has it) is not connected")
        return None

    async def _stage_adapter(self, order: StageOrder) -> tuple[dict[str, Any], int]:
        """This stage's adapter tensors (fetched first when this fellow lacks them),
        verified against their SHA-256; and the bytes fetched."""
        from p2pswarm.agent.adapter import block_manifest, read_adapter_tensors

        block = order.adapter
        if not block:
            return {}, 0
        manifest = block_manifest(block)
        local = block.get("source_id") == self.agent.node_id.hex()
        cache = self.weights_cache()
        fetched = 0
        if not local:
            missing = list({t.sha256: t for t in manifest.tensors
                            if not cache.has(t.sha256, t.nbytes)}.values())
            if missing:
                source = self.agent.fellow(str(block.get("source_id", "")))
                if source is None:
                    raise PlacementError(f"{block.get('source')} (which has the adapter) is "
                                         "not in this fellow's view")
                fetched = await fetch(self.agent, source.addr, source.node_id, source.name,
                                      manifest, [t.name for t in missing], cache, self.run)
        tensors = await self.run(lambda: read_adapter_tensors(block, cache, local))
        return tensors, fetched

    def _live_cards(self) -> tuple[Any, ...]:
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


    async def _order_load(self, body: dict[str, Any]) -> dict[str, Any]:
        key = (str(body.get("plan_id")), int(body.get("stage", -1)))
        hosted = self.hosted.get(key)
        if hosted is None or hosted.state != "reserved":
            raise PlacementError(f"{self.agent.name} holds no reservation for stage {key[1]} "
                                 f"of {key[0]} (it expired, or was released)")
        hosted.state = "loading"
        order = hosted.order
        began = time.perf_counter()
        try:
            source, fetched, fetch_s = await self._stage_source(order)
            adapter, adapter_bytes = await self._stage_adapter(order)
            fetched += adapter_bytes
            await self._report(order, "loading", 0, order.claim_bytes)
            stage = await self.run(lambda: self._build(source, order, adapter), hosted.limiter)
        except BaseException:
            if self.hosted.get(key) is hosted:
                hosted.state = "reserved"  # the leader releases it
            raise
        allocated = stage.allocated_bytes()
        if self.hosted.get(key) is not hosted:  # released while it loaded
            await self.run(stage.unload, hosted.limiter)
            raise PlacementError(f"stage {order.stage} of {order.plan_id} was released "
                                 "while it loaded")
        if allocated > order.claim_bytes:
            await self.run(stage.unload, hosted.limiter)
            hosted.state = "reserved"
            raise PlacementError(
                f"stage {order.stage} allocated {allocated:,} bytes, more than the "
                f"{order.claim_bytes:,} the plan claims for it: refused")
        hosted.stage = stage
        hosted.allocated_bytes = allocated
        hosted.state = "loaded"
        hosted.expires_s = trio.current_time() + self.reservation_s
        await self._report(order, "ready", allocated, order.claim_bytes)
        return {"allocated_bytes": allocated, "fetched_bytes": fetched, "fetch_s": fetch_s,
                "load_s": time.perf_counter() - began}

    @staticmethod
    def _build(source: Any, order: StageOrder, adapter: dict[str, Any] | None = None) -> Stage:
        from p2pswarm.runtime.stage import Stage

        if order.adapter:  # merge W += scale * B @ A as the stage reads its weights
            from p2pswarm.agent.adapter import AdaptedSource
            from p2pswarm.models.loader import open_model

            if isinstance(source, (str, Path)):
                source = open_model(source)
            source = AdaptedSource(source, order.adapter, adapter or {}, *order.layers)
        try:
            return Stage.load(source, order.spec())
        except (RuntimeError, MemoryError) as exc:  # torch's out-of-memory and kin
            raise PlacementError(f"stage {order.stage} could not be allocated on "
                                 f"{order.device}: {exc}") from exc

    async def _stage_source(self, order: StageOrder) -> tuple[Any, int, float]:
        """What the stage loads from (built-in name, model directory, cached tensors),
        fetching the tensors this fellow lacks first; the bytes fetched, and how long."""
        model = order.model
        if model.get("kind") == "builtin":
            return str(model["name"]), 0, 0.0
        manifest = Manifest.from_dict(model["manifest"])
        if model.get("source_id") == self.agent.node_id.hex():
            return Path(manifest.path), 0, 0.0
        cache = self.weights_cache()
        wanted = manifest.stage_tensors(*order.layers)
        # equal tensors (norms of ones, say) share one cached copy: fetch each hash once
        missing = list({t.sha256: t for t in wanted
                        if not cache.has(t.sha256, t.nbytes)}.values())
        total = sum(t.nbytes for t in missing)
        fetched = 0
        began = time.perf_counter()
        if missing:
            source = self.agent.fellow(str(model.get("source_id", "")))
            if source is None:
                raise PlacementError(f"{model.get('source')} (which has the model files) is "
                                     "not in this fellow's view")
            done = 0
            reported = 0.0

            def on_bytes(n: int) -> None:
                nonlocal done, reported
                done += n
                if done == total or done / total - reported >= PROGRESS_STEP:
                    reported = done / total
                    self.agent.spawn(self._report, order, "fetching", done, total)

            await self._report(order, "fetching", 0, total)
            fetched = await fetch(self.agent, source.addr, source.node_id, source.name,
                                  manifest, [t.name for t in missing], cache, self.run,
                                  on_bytes)
        return CachedTensors(manifest, cache), fetched, time.perf_counter() - began

    async def _order_start(self, body: dict[str, Any]) -> dict[str, Any]:
        plan_id = str(body.get("plan_id"))
        route = body.get("route")
        if not isinstance(route, list):
            raise ConfigError("stage-start needs the route")
        mine = [h for (p, _), h in self.hosted.items() if p == plan_id]
        # a fellow with two stages of the plan (two cards) gets this order twice
        if not mine or any(h.state not in ("loaded", "active") for h in mine):
            raise PlacementError(f"{self.agent.name} has no loaded stage of {plan_id} to start")
        for h in mine:
            h.route = [dict(r) for r in route]
            h.state = "active"
        self._publish_stages()
        return {"started": [h.order.stage for h in mine]}

    async def _order_release(self, body: dict[str, Any]) -> dict[str, Any]:
        plan_id = str(body.get("plan_id"))
        return {"released": await self.release(plan_id)}

    async def release(self, plan_id: str) -> list[int]:
        """Drop every stage of ``plan_id`` this fellow holds; returns their indexes."""
        dropped = [(k, h) for k, h in self.hosted.items() if k[0] == plan_id]
        was_active = any(h.state == "active" for _, h in dropped)
        for key, hosted in dropped:
            del self.hosted[key]
            hosted.state = "released"
        for _, hosted in dropped:
            stage, hosted.stage, hosted.allocated_bytes = hosted.stage, None, 0
            if stage is not None:
                await self.run(stage.unload, hosted.limiter)  # after the call in flight
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
                hosted.expires_s = trio.current_time() + self.reservation_s
                continue
            log.warning("%s: stage %d of %s was never started; releasing it", self.agent.name,
                        key[1], key[0])
            await self.release(key[0])
            return

    # --- weights --------------------------------------------------------------------------

    async def _on_weights_request(self, msg: WeightsRequest, stream: SecureStream) -> None:
        await self.weights.serve(msg, stream, self.run)

    # --- sessions: a stage's side --------------------------------------------------------------

    async def _on_session_open(self, msg: SessionOpen, upstream: SecureStream) -> None:
        """Host one session at one stage: open the next hop, then run steps until the
        session ends or fails. The stream is this handler's until it returns."""
        hosted = self.hosted.get((msg.plan_id, msg.stage))
        me = self.agent.name
        if hosted is None or hosted.state != "active" or hosted.stage is None:
            await send_best_effort(upstream, SessionError(
                msg.stage, me, f"holds no stage {msg.stage} of plan {msg.plan_id} (unloaded?)"))
            return
        nxt = hosted.next_hop
        try:
            if nxt is not None:
                downstream = await self._open_hop(nxt)
                await downstream.send_frame(wire.encode(SessionOpen(
                    msg.session, msg.plan_id, msg.stage + 1, msg.return_addr, msg.temperature,
                    msg.top_k, msg.top_p, msg.seed, msg.keep_logits)))
            else:
                downstream = await self.agent.open_secure(msg.return_addr)
                await downstream.send_frame(wire.encode(SessionReturn(msg.session)))
        except SwarmError as exc:
            blame = (msg.stage + 1, nxt["fellow"]) if nxt is not None else (msg.stage, me)
            await send_best_effort(upstream, SessionError(
                blame[0], blame[1], f"is unreachable from {me}: {exc}"[:500]))
            return
        session = _StageSession(msg, hosted, upstream, downstream)
        hosted.sessions.add(msg.session)
        try:
            async with trio.open_nursery() as nursery:
                session.scope = nursery.cancel_scope
                nursery.start_soon(self._relay_from_downstream, session)
                await self._run_steps(session)
                session.ending = True
                nursery.cancel_scope.cancel()
        finally:
            hosted.sessions.discard(msg.session)
            with trio.CancelScope(shield=True):
                await downstream.aclose()
                stage = hosted.stage
                if stage is not None and msg.session in stage.sessions:
                    await self.run(lambda: stage.end_session(msg.session), hosted.limiter)
        return

    async def _open_hop(self, hop: dict[str, Any]) -> SecureStream:
        stream = await self.agent.open_secure(str(hop["addr"]))
        if stream.peer_node_id.hex() != hop["fellow_id"]:
            await stream.aclose()
            raise TransportError(f"{hop['addr']} is no longer {hop['fellow']}")
        return stream

    async def _run_steps(self, s: _StageSession) -> None:
        hosted, me = s.hosted, self.agent.name
        max_bytes = self.agent.config.transport.max_frame_bytes
        while True:
            try:
                with trio.fail_after(self.session_idle_s):
                    frame = await s.upstream.receive_frame()
                (msg,) = wire.decode(frame, max_bytes=max_bytes)
            except (TransportError, RemoteProtocolError, ValueError, trio.TooSlowError) as exc:
                prev = hosted.previous_hop
                if prev is not None:  # the driver's own end needs no word
                    why = (f"fell silent (nothing for {me} in {self.session_idle_s:g} s)"
                           if isinstance(exc, trio.TooSlowError)
                           else f"went away (its stream to {me} broke)")
                    await send_best_effort(s.downstream, SessionError(prev["stage"],
                                                                   prev["fellow"], why))
                return
            if isinstance(msg, StepInput):
                try:
                    out = await self._run_step(hosted, partial(self._compute, s, msg),
                                               decode=msg.step > 0)
                except (SwarmError, RuntimeError, ValueError) as exc:
                    error = SessionError(hosted.order.stage, me, f"failed: {exc}"[:500])
                    await send_best_effort(s.upstream, error)
                    await send_best_effort(s.downstream, error)
                    return
                if out is None:
                    continue
                try:
                    await s.downstream.send_frame(out)
                except TransportError:
                    await self._lost_downstream(s)
                    return
            elif isinstance(msg, SessionEnd):
                s.ending = True
                await send_best_effort(s.downstream, msg)
                return
            elif isinstance(msg, SessionError):
                await send_best_effort(s.downstream, msg)  # relay towards the driver
                return
            else:
                return

    async def _run_step(self, hosted: HostedStage, compute: Callable[[], T], *,
                        decode: bool) -> T:
        """A decode step this stage has been doing in under ``INLINE_STEP_S`` runs on the
        trio thread (see the module's comment); prompt chunks and slow steps go to the
        worker thread."""
        if decode and hosted.decode_s < INLINE_STEP_S and not self.inline_compute:
            async with hosted.limiter:
                return compute()
        return await self.run(compute, hosted.limiter)

    def _compute(self, s: _StageSession, msg: StepInput) -> bytes | None:
        """One chunk through this stage (on the stage's worker): the frame to send on."""
        from p2pswarm.runtime.frame import decode_tensor, encode_tensor

        stage = s.hosted.stage
        if stage is None:
            raise PlacementError("the stage was unloaded")
        began = time.perf_counter()
        out = stage.prefill(s.msg.session, decode_tensor(msg.tensor), msg.position)
        if msg.step > 0:  # a decode step: how long this stage takes for one (smoothed)
            took = time.perf_counter() - began
            h = s.hosted
            h.decode_s = took if math.isinf(h.decode_s) else 0.8 * h.decode_s + 0.2 * took
        if not stage.is_last:
            stage_s = msg.stage_s + (time.perf_counter() - began,)
            return wire.encode(StepInput(msg.step, msg.position, msg.final, stage_s,
                                         bytes(encode_tensor(out))))
        if not msg.final:
            return None  # a prompt chunk before the last: its cache is what counts
        logits = out[-1]
        token = s.sampler().sample(logits)
        stage_s = msg.stage_s + (time.perf_counter() - began,)
        return wire.encode(StepOutput(
            msg.step, token, stage_s,
            bytes(encode_tensor(logits)) if s.msg.keep_logits else b""))

    async def _relay_from_downstream(self, s: _StageSession) -> None:
        """Errors coming back from the next hop go upstream; so does its loss."""
        max_bytes = self.agent.config.transport.max_frame_bytes
        try:
            frame = await s.downstream.receive_frame()
            (msg,) = wire.decode(frame, max_bytes=max_bytes)
        except (TransportError, RemoteProtocolError, ValueError):
            if not s.ending:
                await self._lost_downstream(s)
            msg = None
        if isinstance(msg, SessionError):
            await send_best_effort(s.upstream, msg)
        if s.scope is not None:
            s.scope.cancel()

    async def _lost_downstream(self, s: _StageSession) -> None:
        nxt = s.hosted.next_hop
        if nxt is not None:  # the last stage losing the driver has no one to tell
            await send_best_effort(s.upstream, SessionError(
                nxt["stage"], nxt["fellow"], f"went away (its stream from {self.agent.name} "
                "broke)"))
        if s.scope is not None:
            s.scope.cancel()

    # --- sessions: the driver -----------------------------------------------------------

    async def _on_session_return(self, msg: SessionReturn, stream: SecureStream) -> None:
        slot = self._returns.get(msg.session)
        if slot is None or slot.stream is not None or stream.peer_node_id != slot.expected_id:
            return
        slot.stream = stream
        slot.arrived.set()
        await slot.done.wait()  # the driver reads it; returning would close it
        return

    async def find_load(self, plan_id: str | None = None) -> dict[str, Any]:
        loads = await self.list_loads()
        if plan_id:
            chosen = [r for r in loads if r["plan_id"] == plan_id]
            if not chosen:
                raise PlacementError(f"plan {plan_id} is not loaded; `p2pswarm loads` shows "
                                     "what is")
        elif not loads:
            raise PlacementError("nothing is loaded: run `p2pswarm load MODEL` first")
        elif len(loads) > 1:
            raise ConfigError(f"{len(loads)} loads: pick one with --plan-id "
                              f"({', '.join(r['plan_id'] for r in loads)})")
        else:
            chosen = loads
        record = chosen[0]
        for s in record["stages"]:
            if s.get("state") not in ("alive", "suspect"):
                raise TransportError(f"stage {s['stage']} on fellow {s['fellow']} is "
                                     f"{s.get('state', 'unknown')}: the load cannot serve; "
                                     "unload it and load again")
        if not record.get("complete", True):
            raise PlacementError(f"plan {record['plan_id']} is not completely loaded "
                                 "(some stages are not known yet); try again")
        return record

    async def tokenizer(self, record: dict[str, Any]) -> Any:
        """The load's tokenizer; a files model's come from the fellow that has them."""
        from p2pswarm.models.tokenizer import ByteTokenizer, HFTokenizer

        model = record.get("model", {})
        files = {f[0] for f in model.get("files", [])}
        if model.get("kind") == "builtin" or "tokenizer.json" not in files:
            # p2pswarm's own models (built in, or trained from scratch and saved) are
            # byte-level and ship no tokenizer.json
            return ByteTokenizer()
        if model.get("source_id") == self.agent.node_id.hex():
            return HFTokenizer(str(model["path"]))
        manifest = Manifest.from_dict({**model, "config": {}, "tensors": []})
        cache = self.weights_cache()
        missing = [f.name for f in manifest.files if not cache.has(f.sha256, f.nbytes)]
        if missing:
            source = self.agent.fellow(str(model.get("source_id", "")))
            if source is None or source.state not in ("alive", "suspect"):
                raise PlacementError(f"the tokenizer is on {model.get('source')}, which is "
                                     "not connected")
            await fetch(self.agent, source.addr, source.node_id, source.name, manifest,
                        missing, cache, self.run)
        directory = await self.run(lambda: cache.model_dir(manifest))
        return HFTokenizer(directory)

    async def generate(self, prompt: str | None = None, *, prompt_ids: Sequence[int] | None = None,
                       plan_id: str | None = None, max_tokens: int = 64,
                       temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                       seed: int = 0, stop_token_ids: Sequence[int] | None = None,
                       keep_logits: bool = False,
                       on_token: Callable[[int, str], None] | None = None) -> GenerationResult:
        """Run a session through a loaded pipeline from this fellow: tokens stream to
        ``on_token(id, text)`` as the last stage draws them."""
        if max_tokens <= 0:
            raise ConfigError("max_tokens must be positive, e.g. --max-tokens 64")
        record = await self.find_load(plan_id)
        tokenizer = await self.tokenizer(record)
        ids = list(prompt_ids) if prompt_ids is not None else tokenizer.encode(prompt or "")
        if not ids:
            raise ConfigError("the prompt is empty")
        context = int(record["runtime"].get("max_context_tokens", 0))
        if context and len(ids) + max_tokens - 1 > context:
            raise PlacementError(f"{len(ids)} prompt tokens and {max_tokens} new ones exceed "
                                 f"the load's context of {context} tokens")
        stops = set(tokenizer.eos_ids if stop_token_ids is None else stop_token_ids)
        session = f"{self.agent.rng.getrandbits(64):016x}"
        route = [dict(s) for s in record["stages"]]
        open_msg = SessionOpen(session, record["plan_id"], 0, self.agent.addr, float(temperature),
                               int(top_k), float(top_p), int(seed), keep_logits)
        slot = _ReturnSlot(bytes.fromhex(route[-1]["fellow_id"]))
        self._returns[session] = slot
        failure = _Failure()
        text = TextStream(tokenizer)
        try:
            first = route[0]
            try:
                upstream = await self._open_hop(first)
            except SwarmError as exc:
                raise TransportError(f"stage 0 on fellow {first['fellow']} is unreachable: "
                                     f"{exc}") from exc
            try:
                with trio.CancelScope() as scope:
                    failure.scope = scope
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(self._watch_stage_zero, upstream, first, failure)
                        nursery.start_soon(self._watch_members, route, failure)
                        try:
                            result = await self._drive(record, route, ids, max_tokens, stops,
                                                       open_msg, upstream, slot, failure, text,
                                                       on_token)
                        except SwarmError as exc:
                            failure.set(exc)
                        nursery.cancel_scope.cancel()
                if failure.error is not None:
                    error = failure.error
                    if isinstance(error, TransportError):  # a lost fellow: say how far it got
                        error = TransportError(f"{error}; the generation stopped after "
                                               f"{failure.produced} tokens")
                    raise error
                return result
            finally:
                with trio.CancelScope(shield=True):
                    if failure.error is None:
                        with trio.move_on_after(1.0):
                            await send_best_effort(upstream, SessionEnd(0))
                    await upstream.aclose()
        finally:
            slot.done.set()
            self._returns.pop(session, None)

    async def _drive(self, record: dict[str, Any], route: list[dict[str, Any]], ids: list[int],
                     max_tokens: int, stops: set[int], open_msg: SessionOpen,
                     upstream: SecureStream, slot: _ReturnSlot, failure: _Failure,
                     text: TextStream,
                     on_token: Callable[[int, str], None] | None) -> GenerationResult:
        import torch

        from p2pswarm.runtime.frame import decode_tensor, encode_tensor

        chunk = int(record["runtime"].get("prefill_chunk_tokens", 256))

        async def send(msg: Any) -> None:
            try:
                await upstream.send_frame(wire.encode(msg))
            except TransportError:
                failure.set(TransportError(f"stage 0 on fellow {route[0]['fellow']} went "
                                           "away"))
                await trio.sleep_forever()

        began = time.perf_counter()
        await send(open_msg)
        for start in range(0, len(ids), chunk):
            part = torch.tensor(ids[start:start + chunk], dtype=torch.long)
            await send(StepInput(0, start, start + chunk >= len(ids), (),
                                 bytes(encode_tensor(part))))
        with trio.move_on_after(self.step_timeout_s):
            await slot.arrived.wait()
        if slot.stream is None:
            failure.set(TransportError(
                f"the last stage on fellow {route[-1]['fellow']} did not connect back within "
                f"{self.step_timeout_s:g} s"))
            await trio.sleep_forever()
        ret = slot.stream
        tokens: list[int] = []
        kept: list[torch.Tensor] = []
        stage_s = [0.0] * len(route)
        first_token_s = 0.0
        decode_began = 0.0
        stop_reason = "max_tokens"
        max_bytes = self.agent.config.transport.max_frame_bytes
        n_chunks = math.ceil(len(ids) / chunk)
        step = 0
        while True:
            timeout = self.step_timeout_s * (n_chunks if step == 0 else 1)
            msg = await self._receive_output(ret, route, timeout, max_bytes, failure)
            if msg.step != step:
                failure.set(RemoteProtocolError("out-of-step", f"token for step {msg.step} "
                                                f"arrived at step {step}"))
                await trio.sleep_forever()
            now = time.perf_counter()
            if step == 0:
                first_token_s = now - began
                decode_began = now
            else:
                for i, t in enumerate(msg.stage_s[:len(route)]):
                    stage_s[i] += t
            tokens.append(msg.token)
            failure.produced = len(tokens)
            if open_msg.keep_logits:
                kept.append(decode_tensor(msg.logits))
            if on_token is not None:
                on_token(msg.token, text.push(msg.token))
            if msg.token in stops:
                stop_reason = "stop_token"
                break
            if len(tokens) == max_tokens:
                break
            step += 1
            position = len(ids) + len(tokens) - 1
            await send(StepInput(step, position, True, (),
                                 bytes(encode_tensor(torch.tensor([msg.token], dtype=torch.long)))))
        decode_s = time.perf_counter() - decode_began
        return GenerationResult(
            plan_id=record["plan_id"], prompt_ids=tuple(ids), token_ids=tuple(tokens),
            text=text.tokenizer.decode(tokens), stop_reason=stop_reason,
            time_to_first_token_s=first_token_s, decode_s=decode_s,
            stage_decode_s=tuple(stage_s),
            route=tuple({"stage": r["stage"], "fellow": r["fellow"], "layers": r["layers"],
                         "card": r.get("card", "")} for r in route),
            logits=tuple(kept))

    async def _receive_output(self, stream: SecureStream, route: list[dict[str, Any]],
                              timeout_s: float, max_bytes: int,
                              failure: _Failure) -> StepOutput:
        last = route[-1]
        try:
            with trio.fail_after(timeout_s):
                frame = await stream.receive_frame()
            (msg,) = wire.decode(frame, max_bytes=max_bytes)
        except trio.TooSlowError:
            names = ", ".join(r["fellow"] for r in route)
            failure.set(TransportError(f"no token within {timeout_s:g} s from the pipeline "
                                       f"on {names}"))
            await trio.sleep_forever()
        except (TransportError, RemoteProtocolError, ValueError):
            failure.set(TransportError(
                f"stage {last['stage']} on fellow {last['fellow']} went away"))
            await trio.sleep_forever()
        if isinstance(msg, SessionError):
            failure.set(_session_error(msg))
            await trio.sleep_forever()
        if not isinstance(msg, StepOutput):
            failure.set(RemoteProtocolError("unexpected-message",
                                            f"{type(msg).__name__} from the last stage"))
            await trio.sleep_forever()
        return msg

    async def _watch_stage_zero(self, stream: SecureStream, first: dict[str, Any],
                                failure: _Failure) -> None:
        """Stage 0 only ever sends an error back; a broken stream is its loss."""
        try:
            frame = await stream.receive_frame()
            (msg,) = wire.decode(frame, max_bytes=self.agent.config.transport.max_frame_bytes)
        except (TransportError, RemoteProtocolError, ValueError):
            failure.set(TransportError(f"stage 0 on fellow {first['fellow']} went away"))
            return
        if isinstance(msg, SessionError):
            failure.set(_session_error(msg))
        else:
            failure.set(RemoteProtocolError("unexpected-message",
                                            f"{type(msg).__name__} from stage 0"))

    async def _watch_members(self, route: list[dict[str, Any]], failure: _Failure) -> None:
        """A stage fellow membership declares dead (or gone) ends the session: a silent
        fellow behind a lossy link never breaks the stream itself."""
        while True:
            for hop in route:
                member = self.agent.fellow(hop["fellow_id"])
                state = member.state if member is not None else "unknown"
                if state in ("dead", "left", "unknown"):
                    failure.set(TransportError(f"stage {hop['stage']} on fellow "
                                               f"{hop['fellow']} went away ({state})"))
                    return
            await trio.sleep(MEMBER_WATCH_S)


class _StageSession:
    """One session at one stage: its two streams and, on the last stage, its sampler."""

    def __init__(self, msg: SessionOpen, hosted: HostedStage, upstream: SecureStream,
                 downstream: SecureStream) -> None:
        self.msg = msg
        self.hosted = hosted
        self.upstream = upstream
        self.downstream = downstream
        self.ending = False
        self.scope: trio.CancelScope | None = None
        self._sampler: Any = None

    def sampler(self) -> Any:
        if self._sampler is None:
            from p2pswarm.runtime.sampler import Sampler

            m = self.msg
            self._sampler = Sampler(m.temperature, m.top_k, m.top_p if m.top_p > 0 else 1.0,
                                    m.seed)
        return self._sampler


def _import_runtime() -> None:
    try:
        import p2pswarm.runtime.stage  # noqa: F401
    except Exception:  # the load that needs it will say what is wrong
        log.debug("importing the runtime ahead failed", exc_info=True)


def _session_error(msg: SessionError) -> TransportError:
    return TransportError(f"stage {msg.stage} on fellow {msg.fellow} {msg.reason}")


__all__ = ["GenerationResult", "HostedStage", "Serving", "StageOrder", "TextStream"]
