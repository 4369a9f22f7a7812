"""Serving: loads placed by the leader, stages hosted by fellows, sessions through them.

The rooms, one role each:

- ``loads``: the leader's side: two-phase bring-up of a plan (plan check, stage orders,
  release on failure), unload, and what is loaded;
- ``asking``: the fellow where ``load`` runs: the model's and the adapter's identity,
  the ``LoadAsk``, progress to its CLI (``progress``);
- ``stage_host``: a fellow's side of a load: prepare, load, start, release orders,
  reservations and their expiry, live-card accounting;
- ``stage_session``: a hosted stage serving a session: the step loop, relays to and from
  its neighbours;
- ``queue``: the driver's line for a load's session slots (429 when full);
- ``prefix_cache``: sessions kept between chat turns, and which one a prompt continues;
- ``batching``: a stage's decode steps of several sessions as one forward pass;
- ``chat_turns``: a `p2pswarm chat` turn: the model's chat template, the context's room;
- ``generation``: the driver: route, prompt, sampling loop, output, watching members,
  and resuming a session on a healed route by replaying its tokens;
- ``failover``: the leader keeps loads whole: a lost stage's fellow back within a grace
  window, or its stage re-placed on a spare card (moves);
- ``copies``: the leader has each stage's tensors copied ahead to a fellow outside it, so
  a stage can be re-placed after its fellow and the model's offerer are both gone;
  ``copy_host`` the fellow's side;
- ``adoption``: a new leader takes over the loads its predecessor led, from the route and
  stage orders every stage's fellow keeps (``kept_loads``, ``keepers``);
- ``tombstones``, ``unload_memory``: an unload remembered by every fellow, so no later
  leader adopts the load again;
- ``offers``: the weights this fellow offers and the cache of those it fetched;
- ``records``: the values (``StageOrder`` with its ``RuntimeBlock``, ``HostedStage``,
  ``LoadRecord`` and its route of ``RouteHop``s, ``GenerationResult``); a plan travels as
  the planner's ``Plan`` (``Plan.from_doc`` where a document comes in);
- ``runtime``: the ``StageRuntime`` seam to compute; ``torch_runtime`` its torch side;
- ``ports``: the small Protocols each room is handed instead of the whole agent;
- ``events``: a load came up or went (``LoadEvents``), the weights in use
  (``WeightsInUse``): built here, subscribed here, in the order they run.

``Serving`` wires them together for one agent and answers the control ops ``load``,
``load_cancel``, ``loads``, ``unload``, ``generate`` and ``chat``. Its timings are the
config's ``serving`` section (``p2pswarm.config.ServingConfig``).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import trio

from p2pswarm.agent.serving.asking import CancelOutcome, LoadAsker
from p2pswarm.agent.serving.chat_turns import ChatPrompts
from p2pswarm.agent.serving.copies import CopiesAhead
from p2pswarm.agent.serving.copy_host import CopyHost
from p2pswarm.agent.serving.events import LoadEvents, WeightsInUse
from p2pswarm.agent.serving.failover import Failover
from p2pswarm.agent.serving.generation import Generation, TextStream
from p2pswarm.agent.serving.leader_load import LeaderLoad
from p2pswarm.agent.serving.load_view import LoadView
from p2pswarm.agent.serving.loads import Loads
from p2pswarm.agent.serving.offers import Offers
from p2pswarm.agent.serving.progress import Progress
from p2pswarm.agent.serving.records import GenerationResult, HostedStage, LoadRecord, StageOrder
from p2pswarm.agent.serving.runtime import StageRuntime, TorchOnFirstUse
from p2pswarm.agent.serving.stage_host import StageHost
from p2pswarm.agent.serving.stage_session import StageSessions
from p2pswarm.agent.status_doc import HeldStageDoc
from p2pswarm.agent.weights import Manifest, WeightsCache, WeightsServer
from p2pswarm.control import serving_requests as requests
from p2pswarm.control.requests import typed_op
from p2pswarm.control.server import Emit, current_emitter, emit
from p2pswarm.wire.control import (
    ChatRequest,
    GenerateRequest,
    LoadCancelRequest,
    LoadRequest,
    LoadsRequest,
    UnloadRequest,
)
from p2pswarm.wire.orders import pack_doc, unpack_doc

if TYPE_CHECKING:
    from p2pswarm.agent.serving.ports import ControlHandler, Leader, ServingPort

T = TypeVar("T")


class Serving:
    """One agent's serving: the rooms above, and the control ops of its CLI."""

    def __init__(self, agent: ServingPort, leadership: Leader,
                 runtime: StageRuntime | None = None) -> None:
        self.agent = agent
        self.leadership = leadership
        lazy = None
        if runtime is None:  # torch's, imported on first use
            runtime = lazy = TorchOnFirstUse()
        self.runtime = runtime
        self.events = LoadEvents()
        self.weights_in_use = WeightsInUse()
        self.offers = Offers(agent, self.weights_in_use)
        self.progress = Progress(agent)
        self.leader = Loads(agent, leadership, self.events)
        self.asker = LoadAsker(agent, leadership, self.offers, self.progress)
        self.host = StageHost(agent, leadership, self.runtime, self.offers, self.progress)
        self.sessions = StageSessions(agent, self.runtime, self.host.hosted)
        self.driver = Generation(agent, self.runtime, self.leader, self.offers)
        self.chat_prompts = ChatPrompts(self)
        self.failover = Failover(agent, leadership, self.leader, self.host)
        self._serve_control(agent.control_ops)
        self.copies = CopiesAhead(agent, leadership, self.leader)
        self.copy_host = CopyHost(agent, leadership, self.offers)
        self._subscribe()
        if lazy is not None and agent.home is not None and agent.card_source is not None:
            # A fellow that offers cards will likely host a stage, and importing torch
            # takes seconds on a small machine: pay it now, beside startup, not in `load`.
            threading.Thread(target=lazy.warm_up, name="p2pswarm-warm-up",
                             daemon=True).start()

    def _subscribe(self) -> None:
        """Every listener of the load events, in the order each event runs them (see
        ``events``): the only place serving's rooms are wired to each other's news."""
        self.events.on_loaded(self.failover.watch_soon)  # the watch a load starts first,
        self.events.on_loaded(self.copies.soon)  # ... then its stages copied ahead
        self.events.on_unloaded(self.failover.forget_load)
        self.events.on_forgotten(self.failover.unloads.hand_out)
        self.events.on_unleading(self.failover.adopt_to_unload)
        # the weights cache keeps what live stages read and what copies ahead keep
        self.weights_in_use.add(self.host.hashes_in_use)
        self.weights_in_use.add(self.copy_host.hashes_kept)

    # --- what other parts of the agent (and tests) use ----------------------------------

    def elected(self) -> None:
        """This agent won an election: it watches every load, the last leader's too."""
        self.copies.soon()  # and has their stages copied ahead
        self.failover.elected()

    def fellow_back(self) -> None:
        """A fellow joined or came back: it may keep the orders of a load no one serves."""
        self.failover.look_a_while()

    def metadata_changed(self, node_id: bytes) -> None:
        """A fellow said something new about itself: a leader looks at the loads whose
        orders it keeps (it may have restarted before anyone thought it dead)."""
        member = self.agent.membership.member(node_id) if self.agent.membership else None
        if member is not None and self.leadership.is_leader() \
                and self.agent.fellow_says(member).kept_loads:
            self.failover.look_a_while()

    @property
    def hosted(self) -> dict[tuple[str, int], HostedStage]:
        return self.host.hosted

    @property
    def loads(self) -> dict[str, LeaderLoad]:
        return self.leader.loads

    @property
    def weights(self) -> WeightsServer:
        return self.offers.server

    @property
    def cache(self) -> WeightsCache | None:
        return self.offers.cache

    @cache.setter
    def cache(self, cache: WeightsCache | None) -> None:
        self.offers.cache = cache

    async def run(self, fn: Callable[[], T], limiter: trio.CapacityLimiter | None = None) -> T:
        return await self.agent.compute.run(fn, limiter)

    def weights_cache(self) -> WeightsCache:
        return self.offers.weights_cache()

    def allocated_bytes(self) -> int:
        return self.host.allocated_bytes()

    def less_live_stages(self, cards: tuple[Any, ...]) -> tuple[Any, ...]:
        return self.host.less_live_stages(cards)

    def _live_cards(self) -> tuple[Any, ...]:
        return self.host.live_cards()

    async def offer(self, model_dir: str) -> Manifest:
        return await self.offers.offer(model_dir)

    async def load(self, message: dict[str, Any], *, plan_id: str | None = None,
                   model_dir: str | None = None, adapter_dir: str | None = None,
                   on_progress: Emit | None = None,
                   load_id: str | None = None) -> dict[str, Any]:
        """Load the plan of ``message`` (a plan request) through the leader; its record."""
        reply = await self.asker.load(pack_doc(message), plan_id=plan_id, model_dir=model_dir,
                                      adapter_dir=adapter_dir, on_progress=on_progress,
                                      load_id=load_id)
        return unpack_doc(reply.record)

    async def cancel_load(self, load_id: str) -> CancelOutcome:
        """Cancel the load asked for as ``load_id``, all or nothing (``asking``)."""
        return await self.asker.cancel(load_id)

    def held_stages(self) -> list[HeldStageDoc]:
        """The stages this fellow holds (reserved, loading, loaded, active, or released
        while their build still runs: ``releasing``), with their claims."""
        held = [(key, h.state, h) for key, h in self.host.hosted.items()]
        held += [(key, "releasing", h) for key, h in self.host.releasing.items()]
        return [HeldStageDoc(plan_id=plan_id, stage=stage, state=state,
                             claim_bytes=h.order.claim_bytes,
                             allocated_bytes=h.allocated_bytes, sessions=len(h.sessions))
                for (plan_id, stage), state, h in sorted(held, key=lambda x: x[:2])]

    async def unload(self, plan_id: str | None = None, *,
                     all: bool = False) -> tuple[str, ...]:
        """Unload ``plan_id`` (or the only load, or ``all``); the plan_ids unloaded."""
        return await self.asker.unload(plan_id, all=all)

    async def release(self, plan_id: str) -> list[int]:
        return await self.host.release(plan_id)

    def loads_view(self) -> list[LoadView]:
        """The loads as this fellow knows them (``Loads.views``)."""
        return self.leader.views()

    async def list_loads(self) -> list[dict[str, Any]]:
        return await self.leader.list_loads()

    async def find_load(self, plan_id: str | None = None) -> LoadRecord:
        """The load ``plan_id`` (or the only one), checked to serve (a stage whose
        fellow is gone waited for a while: the leader moves it)."""
        return await self.driver.serving_load(plan_id)

    async def tokenizer(self, record: LoadRecord) -> Any:
        """The tokenizer of the load ``record`` shows."""
        return await self.driver.tokenizer(record)

    async def generate(self, prompt: str | None = None, *,
                       prompt_ids: Sequence[int] | None = None, plan_id: str | None = None,
                       max_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
                       top_p: float = 1.0, seed: int = 0,
                       stop_token_ids: Sequence[int] | None = None, keep_logits: bool = False,
                       remember: bool = False,
                       on_token: Callable[[int, str], None] | None = None,
                       on_wait: Callable[[int], None] | None = None) -> GenerationResult:
        """Run a session through a loaded pipeline from this fellow (``generation``)."""
        return await self.driver.generate(
            prompt, prompt_ids=prompt_ids, plan_id=plan_id, max_tokens=max_tokens,
            temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
            stop_token_ids=stop_token_ids, keep_logits=keep_logits, remember=remember,
            on_token=on_token, on_wait=on_wait)

    # --- control ops (the CLI's own agent) ------------------------------------------------

    def _serve_control(self, ops: dict[str, ControlHandler]) -> None:
        """Serving's control ops: each a typed request (``p2pswarm.wire.control``), from a
        client's message or made from its plain map (``requests``)."""
        ops.update({
            "load": typed_op(LoadRequest, requests.load_request, self._op_load),
            "load_cancel": typed_op(LoadCancelRequest, requests.load_cancel_request,
                                    self._op_load_cancel),
            "loads": typed_op(LoadsRequest, requests.loads_request, self._op_loads),
            "unload": typed_op(UnloadRequest, requests.unload_request, self._op_unload),
            "generate": typed_op(GenerateRequest, requests.generate_request,
                                 self._op_generate),
            "chat": typed_op(ChatRequest, requests.chat_request, self._op_chat),
        })

    async def _op_load(self, call: LoadRequest) -> Any:
        reply = await self.asker.load(call.request, plan_id=call.plan_id or None,
                                      model_dir=call.path or None,
                                      adapter_dir=call.adapter or None,
                                      on_progress=current_emitter(),
                                      load_id=call.load_id or None)
        return unpack_doc(reply.record)

    async def _op_load_cancel(self, call: LoadCancelRequest) -> Any:
        return (await self.cancel_load(call.load_id)).to_doc()

    async def _op_loads(self, call: LoadsRequest) -> Any:
        return {"loads": await self.list_loads()}

    async def _op_unload(self, call: UnloadRequest) -> Any:
        return {"unloaded": list(await self.unload(call.plan_id or None, all=call.all))}

    async def _op_chat(self, call: ChatRequest) -> Any:
        """One turn of a chat: the conversation through the model's chat template, the
        session kept."""
        drawn = call.generate
        record = await self.find_load(drawn.plan_id or None)
        prompt = await self.chat_prompts.prompt(record, call.messages,
                                                max(1, drawn.max_tokens))
        return await self._op_generate(dataclasses.replace(
            drawn, prompt=prompt, plan_id=record.plan_id, remember=True))

    async def _op_generate(self, call: GenerateRequest) -> Any:
        def on_token(token: int, piece: str) -> None:
            emit({"token": token, "text": piece})

        def on_wait(ahead: int) -> None:
            emit({"queued": ahead})

        ids = call.prompt_ids
        result = await self.generate(
            call.prompt if ids is None else None, prompt_ids=ids, plan_id=call.plan_id or None,
            max_tokens=call.max_tokens, temperature=call.temperature, top_k=call.top_k,
            top_p=call.top_p, seed=call.seed, stop_token_ids=call.stop_token_ids,
            remember=call.remember, on_token=on_token, on_wait=on_wait)
        return result.to_dict()


__all__ = ["GenerationResult", "HostedStage", "Serving", "StageOrder", "StageRuntime",
           "TextStream"]
