"""The driver of a generation: find the load, tokenize, drive the ring, stream the text.

The fellow where ``generate`` runs opens a sealed stream to stage 0 and waits for the
last stage's stream back (``SessionReturn``); token ids go to stage 0 and the drawn token
comes straight back to the driver, which streams it to the CLI, decides whether to stop
and sends it to stage 0 for the next step. A decode step crosses one hop per stage plus
one: the fewest for a ring that includes a driver that owns the loop (stops, limits,
cancellation, timings), and no hop is ever crossed twice, so a reply never travels back
along the chain. Prompts go in chunks of the plan's prefill chunk, which also pipelines
the prefill: stage 0 runs chunk 2 while stage 1 runs chunk 1.

The driver watches for failures and names them: an error relayed by any stage, stage 0's
stream breaking, a stage fellow that membership declares dead or departed (a silent
fellow behind a lossy link never breaks the stream itself), and a silent pipeline after
``step_timeout_s``.

A lost fellow need not end the generation: the driver asks the leader to heal the load
(``StageLost``; ``failover``), which waits a grace window for a silent fellow and
re-places a lost stage on a spare card. The driver then opens the same session again on
the route the leader answers with (``SessionOpen.recover``), resuming from every position
but the last token's: the stages that kept its cache when its streams broke continue
from it, the others (the moved stage) start afresh and are named in the last stage's
``SessionReturn``. The driver replays the prompt and the tokens drawn so far through the
stages up to the last fresh one only (``StepInput.replay_stages``: a fresh stage needs the
activations of every stage before it, which recompute theirs), then sends the last token
through all of them, and the generation goes on from the token it had reached (greedy
output equals an undisturbed run). Only when the leader cannot heal the load does the
generation end with the error that names the fellow.

Generations wait in the driver's queue (``queue``) for one of the load's session slots.
One asked to be remembered (a chat turn) leaves its session's cache on the stages when it
ends, and a later prompt that begins with the same tokens continues it, prefilling only
the new ones (``prefix_cache``); a kept cache a stage has evicted is not a lost fellow:
the session starts afresh.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from p2pswarm import wire
from p2pswarm.agent.serving.answer_ids import AnswerIds
from p2pswarm.agent.serving.loads import Loads
from p2pswarm.agent.serving.offers import Offers
from p2pswarm.agent.serving.prefix_cache import PrefixCache
from p2pswarm.agent.serving.queue import Admission
from p2pswarm.agent.serving.records import (
    GenerationResult,
    LoadRecord,
    WeightsOrigin,
    former_plan_ids,
)
from p2pswarm.agent.serving.runtime import StageRuntime
from p2pswarm.agent.serving.stage_session import open_hop
from p2pswarm.agent.serving.tally import GenerationTally
from p2pswarm.agent.streams import send_best_effort
from p2pswarm.agent.weight_holders import gather
from p2pswarm.agent.weights import Manifest
from p2pswarm.errors import (
    ConfigError,
    NotLeader,
    PlacementError,
    RemoteProtocolError,
    SwarmError,
    TransportError,
)
from p2pswarm.models.tokenizer import WORLD_VOCAB_FILE, ByteTokenizer, load_tokenizer
from p2pswarm.wire.loads import LoadDone, RouteHop, StageLost
from p2pswarm.wire.orders import unpack_doc
from p2pswarm.wire.serving import (
    SessionEnd,
    SessionError,
    SessionOpen,
    SessionReturn,
    StepInput,
    StepOutput,
)

if TYPE_CHECKING:
    from p2pswarm.agent.serving.ports import GenerationPort
    from p2pswarm.transport.secure import SecureStream

MAX_RESUMES = 8  # a generation resumed on a healed load this often at most
SAME_ROUTE_RESUMES = 2  # ... and at most this often in a row on an unchanged route
HEAL_TIMEOUT_S = 900.0  # the most a driver waits for the leader to heal a load
# ... and for a leader at all: a new one is elected within seconds where a majority of the
# fellows is up; past this, this side of the swarm is likely a minority that cannot elect
HEAL_LEADERLESS_S = 60.0
# a leader that refuses a heal while it is still adopting the load (a new leader, just
# elected by an upgrade's restarts) is asked again this long; one that says the load waits
# for a card is not
HEAL_REFUSED_S = 60.0
HEAL_ASK_AGAIN_S = 1.0  # ... this often (and a load is looked at again while it waits)
# a new generation waits this long for a stage whose fellow is gone to be moved
STAGE_WAIT_S = 60.0

log = logging.getLogger("p2pswarm.serving")


@dataclass
class ReturnSlot:
    """Where the last stage's stream back to a driver lands."""

    expected_id: bytes
    arrived: trio.Event = field(default_factory=trio.Event)
    done: trio.Event = field(default_factory=trio.Event)
    stream: SecureStream | None = None
    fresh: tuple[int, ...] = ()  # a recovering session: the stages that start afresh


class _Evicted(SwarmError):
    """A stage no longer keeps the session's cache a continued generation wanted."""


class _Failure:
    """The first failure of a session, and the scope to cancel when it comes (keeps
    errors out of exception groups: watchers record, the caller raises)."""

    def __init__(self) -> None:
        self.error: SwarmError | None = None
        self.scope: trio.CancelScope | None = None
        self.lost: int | None = None  # the stage lost, when the failure is a lost fellow
        self.healed: LoadRecord | None = None  # the record a heal already gave
        self.unhealed = ""  # why the leader could not be asked to heal, when it could not

    def set(self, error: SwarmError, lost: int | None = None) -> None:
        if self.error is None:
            self.error = error
            self.lost = lost
        if self.scope is not None:
            self.scope.cancel()


@dataclass
class GenerationRun:
    """One generation across its sessions: when the leader heals the load, the driver
    opens a new session on the healed route and replays ``ids + tokens`` as its prompt,
    so the generation goes on from the token it had reached."""

    ids: list[int]  # the prompt
    stage_s: list[float]
    began: float
    tokens: list[int] = field(default_factory=list)
    kept: list[Any] = field(default_factory=list)
    first_token_s: float = 0.0
    decode_began: float = 0.0
    stop_reason: str = "max_tokens"
    resumes: int = 0
    remember: bool = False  # keep the session's cache for a next turn
    reuse: tuple[str, int] | None = None  # a kept session to continue, and its positions
    cached: int = 0  # prompt tokens the kept session's cache held
    session: str | None = None  # the session's id: a resumed one keeps it (``recover``)
    replays: list[int] = field(default_factory=list)  # stages replayed through, per resume
    prefill_s: tuple[float, ...] = ()  # each stage's compute of the prompt's last chunk


class TextStream:
    """The text each new token completes (a UTF-8 sequence may span several tokens)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""

    def push(self, token: int) -> str:
        self.ids.append(token)
        text: str = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd") or not text.startswith(self.text):
            return ""  # wait for the rest of the character
        piece, self.text = text[len(self.text):], text
        return piece


class Generation:
    def __init__(self, agent: GenerationPort, runtime: StageRuntime, loads: Loads,
                 offers: Offers) -> None:
        self.agent = agent
        self.runtime = runtime
        self.loads = loads
        self.offers = offers
        self.step_timeout_s = 60.0  # the most a driver waits for one token
        self.heal_timeout_s = HEAL_TIMEOUT_S
        self.heal_leaderless_s = HEAL_LEADERLESS_S
        self.heal_refused_s = HEAL_REFUSED_S
        self.stage_wait_s = STAGE_WAIT_S
        # a resumed session replays through every stage under a new id, as before the
        # stages kept broken sessions' caches (the benchmark's comparison)
        self.replay_everything = False
        self.admission = Admission()
        self.tally = GenerationTally()  # tokens and first-token times, for /metrics
        self.kept = PrefixCache()
        self.answers = AnswerIds()  # remembered answers' own ids, for the next turn's prompt
        self._returns: dict[str, ReturnSlot] = {}
        agent.on_stream(SessionReturn, self._on_session_return)

    async def _on_session_return(self, msg: SessionReturn, stream: SecureStream) -> None:
        slot = self._returns.get(msg.session)
        if slot is None or slot.stream is not None or stream.peer_node_id != slot.expected_id:
            return
        slot.stream = stream
        slot.fresh = msg.fresh
        slot.arrived.set()
        await slot.done.wait()  # the driver reads it; returning would close it

    async def find_load(self, plan_id: str | None = None) -> LoadRecord:
        """The load ``plan_id`` (or the only one), checked to serve: a ``LoadRecord`` of
        the record the leader or this fellow's view shows (its stages' states and
        completeness checked there first, as they say what is wrong in words)."""
        loads = await self.loads.list_loads()
        ids = [str(r["plan_id"]) for r in loads]
        if plan_id:
            chosen = [(p, r) for p, r in zip(ids, loads)
                      if p == plan_id or plan_id in former_plan_ids(r)]  # re-cut since
            if not chosen:
                raise PlacementError(f"plan {plan_id} is not loaded; `p2pswarm loads` shows "
                                     "what is")
        elif not loads:
            raise PlacementError("nothing is loaded: run `p2pswarm load MODEL` first")
        elif len(loads) > 1:
            raise ConfigError(f"{len(loads)} loads: pick one with --plan-id "
                              f"({', '.join(ids)})")
        else:
            chosen = [(ids[0], loads[0])]
        found, record = chosen[0]
        down = _stage_down(record)
        if down:
            raise TransportError(down)
        if not record.get("complete", True):
            raise PlacementError(f"plan {found} is not completely loaded "
                                 "(some stages are not known yet); try again")
        return LoadRecord.from_doc(record)

    async def serving_load(self, plan_id: str | None = None) -> LoadRecord:
        """As ``find_load``, but a stage whose fellow is gone (it left: a SIGTERM, an
        upgrade; or it died) is waited for, up to ``stage_wait_s``: the leader moves the
        stage to a spare card within seconds, and a new generation then serves instead of
        failing. A load the leader says waits for a card fails at once, as before. So
        does a leader that does not list a load its fellows serve: one just elected that
        is still adopting it (a load no fellow serves is not waited for)."""
        deadline = trio.current_time() + self.stage_wait_s
        while True:
            try:
                return await self.find_load(plan_id)
            except TransportError:
                if trio.current_time() >= deadline or await self._waits_for_card(plan_id):
                    raise
            except PlacementError:
                if trio.current_time() >= deadline or not self._served_here(plan_id):
                    raise
            await trio.sleep(HEAL_ASK_AGAIN_S)

    def _served_here(self, plan_id: str | None) -> bool:
        """Whether this fellow hears of the load from the fellows serving its stages."""
        return any(plan_id is None or v.plan_id == plan_id for v in self.loads.views())

    async def _waits_for_card(self, plan_id: str | None) -> bool:
        """Whether the leader says the load waits for a card (its heal found none)."""
        for doc in await self.loads.list_loads():
            if plan_id is None or doc.get("plan_id") == plan_id \
                    or plan_id in former_plan_ids(doc):
                return bool(doc.get("waiting"))
        return False

    async def tokenizer(self, record: LoadRecord) -> Any:
        """The tokenizer of a load's model (its public identity, as its record shows it);
        a files model's come from the fellow that has them."""
        origin = WeightsOrigin.of(record.model)
        if origin.kind != "files":
            return ByteTokenizer()  # a built-in: p2pswarm's own, byte-level
        manifest = Manifest.from_dict({**record.model, "config": {}, "tensors": []})
        files = {f.name for f in manifest.files}
        if "tokenizer.json" not in files and WORLD_VOCAB_FILE not in files:
            # p2pswarm's own models (built in, or trained from scratch and saved) are
            # byte-level and ship no tokenizer.json
            return ByteTokenizer()
        if origin.offered_by(self.agent.node_id.hex()):
            # a record gossiped by any fellow may name this one the source: read only a
            # directory this fellow offered
            where = self.offers.local_dir(manifest)
            if where is None:
                raise PlacementError(f"{self.agent.name} offered no model directory "
                                     f"{manifest.name}")
            return load_tokenizer(Path(where))
        cache = self.offers.weights_cache()
        missing = [f.name for f in manifest.files if not cache.has(f.sha256, f.nbytes)]
        if missing:  # from the fellow that offered them, or any that holds them
            await gather(self.agent, manifest, missing, cache, self.agent.compute.run,
                         source_id=origin.source_id, source_name=origin.source_name())
        directory = await self.agent.compute.run(lambda: cache.model_dir(manifest))
        return load_tokenizer(Path(directory))

    async def generate(self, prompt: str | None = None, *, prompt_ids: Sequence[int] | None = None,
                       plan_id: str | None = None, max_tokens: int = 64,
                       temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                       seed: int = 0, stop_token_ids: Sequence[int] | None = None,
                       keep_logits: bool = False, remember: bool = False,
                       on_token: Callable[[int, str], None] | None = None,
                       on_wait: Callable[[int], None] | None = None) -> GenerationResult:
        """Run a session through a loaded pipeline from this fellow: tokens stream to
        ``on_token(id, text)`` as the last stage draws them. It waits in line for a
        session slot (``on_wait(ahead)``); ``remember``: keep the session's cache for a
        next turn, and continue a kept one this prompt begins with."""
        if max_tokens <= 0:
            raise ConfigError("max_tokens must be positive, e.g. --max-tokens 64")
        record = await self.serving_load(plan_id)
        tokenizer = await self.tokenizer(record)
        plan = record.plan_id
        if prompt_ids is not None:
            ids = list(prompt_ids)
        elif remember:  # a chat resending its answers: as the ids they were drawn as
            ids = self.answers.encode(plan, tokenizer, prompt or "")
        else:
            ids = tokenizer.encode(prompt or "")
        if not ids:
            raise ConfigError("the prompt is empty")
        reach, bound = record.generation_tokens()  # a recurrent load: past its context
        if reach and len(ids) + max_tokens - 1 > reach:
            raise PlacementError(f"{len(ids)} prompt tokens and {max_tokens} new ones exceed "
                                 f"{bound}")
        stops = set(tokenizer.eos_ids if stop_token_ids is None else stop_token_ids)
        open_msg = SessionOpen("-", record.plan_id, 0, self.agent.addr, float(temperature),
                               int(top_k), float(top_p), int(seed), keep_logits)
        async with self.admission.slot(plan, record.max_sessions, on_wait):
            run = GenerationRun(list(ids), [0.0] * len(record.stages), time.perf_counter(),
                                remember=remember)
            run.reuse = self.kept.take(plan, ids) if remember else None
            result = await self._run(record, run, max_tokens, stops, open_msg, tokenizer,
                                     on_token)
        if remember:
            answer = list(result.token_ids)
            while answer and answer[-1] in stops:  # the template closes the turn itself
                answer.pop()
            self.answers.note(plan, tokenizer, tokenizer.decode(answer), answer)
        return result

    async def _run(self, record: LoadRecord, run: GenerationRun, max_tokens: int,
                   stops: set[int], open_msg: SessionOpen, tokenizer: Any,
                   on_token: Callable[[int, str], None] | None) -> GenerationResult:
        """The generation's sessions: one, or more when the load heals under it (or a
        kept cache it meant to continue is gone)."""
        ids = run.ids
        text = TextStream(tokenizer)
        same_route = 0
        while True:
            failure = await self._session(record, run, max_tokens, stops, open_msg, text,
                                          on_token)
            if failure is None:
                break
            error = failure.error
            assert error is not None
            if isinstance(error, _Evicted):  # start the session afresh: nothing was lost
                continue
            healed = None
            if failure.lost is not None and run.resumes < MAX_RESUMES:
                healed = failure.healed or await self._heal(record, failure)
            if healed is not None:
                same = healed.fellow_ids == record.fellow_ids
                same_route = same_route + 1 if same else 0
            if healed is None or same_route > SAME_ROUTE_RESUMES:
                if isinstance(error, TransportError):  # a lost fellow: say how far it got
                    why = f" ({failure.unhealed})" if failure.unhealed else ""
                    error = TransportError(f"{error}; the generation stopped after "
                                           f"{len(run.tokens)} tokens{why}")
                raise error
            log.info("resuming after %d tokens on the route %s (%s)", len(run.tokens),
                     ", ".join(h.fellow for h in healed.stages), error)
            record = healed
            if len(run.stage_s) != len(record.stages):  # re-cut: other stages now
                run.stage_s = [0.0] * len(record.stages)
            run.resumes += 1
        return GenerationResult(
            plan_id=record.plan_id, prompt_ids=tuple(ids), token_ids=tuple(run.tokens),
            text=text.tokenizer.decode(run.tokens), stop_reason=run.stop_reason,
            time_to_first_token_s=run.first_token_s,
            decode_s=time.perf_counter() - run.decode_began,
            stage_decode_s=tuple(run.stage_s),
            route=tuple({"stage": r.stage, "fellow": r.fellow,
                         "layers": [r.start_layer, r.end_layer], "card": r.card}
                        for r in record.stages),
            logits=tuple(run.kept), resumes=run.resumes, cached_tokens=run.cached,
            stage_prefill_s=run.prefill_s, replayed_stages=tuple(run.replays))

    async def _session(self, record: LoadRecord, run: GenerationRun, max_tokens: int,
                       stops: set[int], open_msg: SessionOpen, text: TextStream,
                       on_token: Callable[[int, str], None] | None) -> _Failure | None:
        """One session through the load's route, from the tokens ``run`` has so far to
        the end; its failure, or None when the generation is done."""
        session, start = f"{self.agent.rng.getrandbits(64):016x}", 0
        recover = False
        if run.reuse is not None and not run.tokens:
            session, start = run.reuse
        elif run.session is not None and run.tokens and not self.replay_everything:
            # resumed after a failure: the stages that kept the session's cache continue
            # it from every position but the last token's (which not all of them ran)
            session, start, recover = run.session, len(run.ids) + len(run.tokens) - 1, True
        run.reuse, run.cached, run.session = None, 0 if recover else start, session
        route = record.stages
        open_msg = dataclasses.replace(open_msg, session=session, plan_id=record.plan_id,
                                       resume_from=start, recover=recover)
        slot = ReturnSlot(bytes.fromhex(route[-1].fellow_id))
        self._returns[session] = slot
        failure = _Failure()
        try:
            first = route[0]
            try:
                upstream = await open_hop(self.agent, first)
            except SwarmError as exc:
                failure.set(TransportError(f"stage 0 on fellow {first.fellow} is "
                                           f"unreachable: {exc}"), lost=0)
                return failure
            try:
                with trio.CancelScope() as scope:
                    failure.scope = scope
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(self._watch_stage_zero, upstream, first, failure)
                        nursery.start_soon(self._watch_members, record, failure)
                        try:
                            await self._drive(record, route, run, max_tokens, stops,
                                              open_msg, upstream, slot, failure, text,
                                              on_token)
                        except SwarmError as exc:
                            failure.set(exc)
                        nursery.cancel_scope.cancel()
                return failure if failure.error is not None else None
            finally:
                with trio.CancelScope(shield=True):
                    keep = run.remember and bool(run.tokens)  # else its length is unknown
                    if failure.error is None:
                        with trio.move_on_after(1.0):
                            await send_best_effort(upstream, SessionEnd(len(run.tokens),
                                                                        keep))
                        if keep:
                            self.kept.put(record.plan_id, session,
                                          run.ids + run.tokens[:-1], record.max_sessions)
                            await _until_closed(slot.stream)  # every stage kept it
                    await upstream.aclose()
        finally:
            slot.done.set()
            self._returns.pop(session, None)

    async def _heal(self, record: LoadRecord, failure: _Failure) -> LoadRecord | None:
        """Ask the leader to heal the load after ``failure``; the load's record as it now
        stands (checked: it comes from the network), or None when it cannot be healed."""
        stage = failure.lost if failure.lost is not None else 0
        hops = record.stages
        fid = hops[stage].fellow_id if 0 <= stage < len(hops) else ""
        ask = StageLost(record.plan_id, max(0, min(stage, 65535)), fid[:64],
                        str(failure.error)[:500])
        deadline = trio.current_time() + self.heal_timeout_s
        refused_until: float | None = None
        while True:
            try:  # a leader that crashed (it may have hosted the lost stage) gives way
                reply = await self.loads.leadership.ask_until(ask, LoadDone, deadline,
                                                              self.heal_leaderless_s)
                healed = LoadRecord.from_doc(unpack_doc(reply.record))
            except ConfigError:  # a malformed answer: not this load
                return None
            except NotLeader as exc:  # no leader at all: say so, not only what was lost
                failure.unhealed = str(exc)
                log.info("the load could not be healed: %s", exc)
                return None
            except PlacementError as exc:
                # a leader still adopting the load refuses (it does not lead it yet): ask
                # again for a while; one whose heal found no card says the load waits
                now = trio.current_time()
                if refused_until is None:
                    refused_until = min(deadline, now + self.heal_refused_s)
                if now >= refused_until or await self._waits_for_card(record.plan_id):
                    log.info("the load could not be healed: %s", exc)
                    return None
                log.info("the leader refused the heal, asking again: %s", exc)
                await trio.sleep(HEAL_ASK_AGAIN_S)
                continue
            except SwarmError as exc:
                log.info("the load could not be healed: %s", exc)
                return None
            return healed if healed.continues(record) else None

    async def _drive(self, record: LoadRecord, route: tuple[RouteHop, ...], run: GenerationRun,
                     max_tokens: int, stops: set[int], open_msg: SessionOpen,
                     upstream: SecureStream, slot: ReturnSlot, failure: _Failure,
                     text: TextStream, on_token: Callable[[int, str], None] | None) -> None:
        chunk = record.prefill_chunk_tokens
        prompt = run.ids + run.tokens  # a resumed session replays what it had

        async def send(msg: Any) -> None:
            try:
                await upstream.send_frame(wire.encode(msg))
            except TransportError:
                failure.set(TransportError(f"stage 0 on fellow {route[0].fellow} went "
                                           "away"), lost=0)
                await trio.sleep_forever()

        began = time.perf_counter()
        await send(open_msg)
        resume = open_msg.resume_from
        if open_msg.recover:  # which stages rebuild is known once the ring is open
            await self._returned(slot, route, failure)
            through = min(max(slot.fresh, default=-1) + 1, len(route))
            run.replays.append(through)
            for start in range(0, resume if through else 0, chunk):
                await send(StepInput(0, start, False, (), self.runtime.token_frame(
                    prompt[start:min(start + chunk, resume)]), through))
        for start in range(resume, len(prompt), chunk):
            await send(StepInput(0, start, start + chunk >= len(prompt), (),
                                 self.runtime.token_frame(prompt[start:start + chunk])))
        ret = await self._returned(slot, route, failure)
        max_bytes = self.agent.config.transport.max_frame_bytes
        n_chunks = math.ceil(len(prompt) / chunk)
        step = 0
        while True:
            timeout = self.step_timeout_s * (n_chunks if step == 0 else 1)
            msg = await self._receive_output(ret, route, timeout, max_bytes, failure)
            if msg.step != step:
                failure.set(RemoteProtocolError("out-of-step", f"token for step {msg.step} "
                                                f"arrived at step {step}"))
                await trio.sleep_forever()
            now = time.perf_counter()
            if not run.tokens:
                run.first_token_s = now - began
                self.tally.first_token(run.first_token_s)
                run.decode_began = now
                run.prefill_s = tuple(msg.stage_s)
            elif step > 0:  # a resumed session's first step is a prefill: not decode time
                for i, t in enumerate(msg.stage_s[:len(run.stage_s)]):
                    run.stage_s[i] += t
            run.tokens.append(msg.token)
            self.tally.token(record.plan_id)
            if open_msg.keep_logits:
                run.kept.append(self.runtime.read_logits(msg.logits))
            if on_token is not None:
                on_token(msg.token, text.push(msg.token))
            if msg.token in stops:
                run.stop_reason = "stop_token"
                return
            if len(run.tokens) == max_tokens:
                run.stop_reason = "max_tokens"
                return
            step += 1
            position = len(run.ids) + len(run.tokens) - 1
            await send(StepInput(step, position, True, (),
                                 self.runtime.token_frame([msg.token])))

    async def _returned(self, slot: ReturnSlot, route: tuple[RouteHop, ...],
                        failure: _Failure) -> SecureStream:
        """The last stage's stream back, once it has connected."""
        with trio.move_on_after(self.step_timeout_s):
            await slot.arrived.wait()
        if slot.stream is None:
            failure.set(TransportError(
                f"the last stage on fellow {route[-1].fellow} did not connect back within "
                f"{self.step_timeout_s:g} s"), lost=len(route) - 1)
            await trio.sleep_forever()
        return slot.stream

    async def _receive_output(self, stream: SecureStream, route: tuple[RouteHop, ...],
                              timeout_s: float, max_bytes: int,
                              failure: _Failure) -> StepOutput:
        last = route[-1]
        try:
            with trio.fail_after(timeout_s):
                frame = await stream.receive_frame()
            (msg,) = wire.decode(frame, max_bytes=max_bytes)
        except trio.TooSlowError:
            names = ", ".join(r.fellow for r in route)
            failure.set(TransportError(f"no token within {timeout_s:g} s from the pipeline "
                                       f"on {names}"), lost=0)
            await trio.sleep_forever()
        except (TransportError, RemoteProtocolError, ValueError):
            failure.set(TransportError(
                f"stage {last.stage} on fellow {last.fellow} went away"),
                lost=len(route) - 1)
            await trio.sleep_forever()
        if isinstance(msg, SessionError):
            failure.set(_session_error(msg), lost=_lost_stage(msg))
            await trio.sleep_forever()
        if not isinstance(msg, StepOutput):
            failure.set(RemoteProtocolError("unexpected-message",
                                            f"{type(msg).__name__} from the last stage"))
            await trio.sleep_forever()
        return msg

    async def _watch_stage_zero(self, stream: SecureStream, first: RouteHop,
                                failure: _Failure) -> None:
        """Stage 0 only ever sends an error back; a broken stream is its loss."""
        try:
            frame = await stream.receive_frame()
            (msg,) = wire.decode(frame, max_bytes=self.agent.config.transport.max_frame_bytes)
        except (TransportError, RemoteProtocolError, ValueError):
            failure.set(TransportError(f"stage 0 on fellow {first.fellow} went away"),
                        lost=0)
            return
        if isinstance(msg, SessionError):
            failure.set(_session_error(msg), lost=_lost_stage(msg))
        else:
            failure.set(RemoteProtocolError("unexpected-message",
                                            f"{type(msg).__name__} from stage 0"))

    async def _watch_members(self, record: LoadRecord, failure: _Failure) -> None:
        """A stage fellow that membership declares dead, or that left the swarm (a
        SIGTERM: an upgrade's restart), is the leader's to heal (``failover``): a dead one
        may be silent behind a fading link with its streams intact, a departed one's stage
        moves. The session goes on unless the stage moved; then it resumes there."""
        while True:
            for hop in record.stages:
                member = self.agent.fellow(hop.fellow_id)
                state = member.state if member is not None else "unknown"
                if state not in _GONE:
                    continue
                lost = _Failure()
                lost.set(TransportError(f"stage {hop.stage} on fellow {hop.fellow} "
                                        f"went away ({state})"), lost=hop.stage)
                healed = await self._heal(record, lost)
                if healed is None:
                    failure.unhealed = lost.unhealed
                    failure.set(lost.error or TransportError("lost"))
                    return
                if healed.fellow_ids != record.fellow_ids:  # moved: resume there
                    failure.healed = healed
                    failure.set(lost.error or TransportError("moved"), lost=lost.lost)
                    return
                while (m := self.agent.fellow(hop.fellow_id)) is None \
                        or m.state in _GONE:  # back, as the leader found: wait for word
                    await trio.sleep(self.agent.config.serving.member_watch_s)
            await trio.sleep(self.agent.config.serving.member_watch_s)


_GONE = ("dead", "left", "unknown")  # a stage fellow's membership states the leader heals


def _stage_down(record: Mapping[str, Any]) -> str:
    """Why a load's record says it cannot serve now (a stage whose fellow is not up), or
    the empty string."""
    for s in record["stages"]:
        state = s.get("state", "unknown")
        if state not in ("alive", "suspect"):
            return (f"stage {s['stage']} on fellow {s['fellow']} is {state}: the load "
                    "cannot serve now; where a spare card fits the stage the leader moves "
                    "it there within seconds (`p2pswarm loads` shows the move), so try "
                    "again; else unload it and load again")
    return ""


def _lost_stage(msg: SessionError) -> int | None:
    """The stage a relayed error blames, when it is a lost fellow (a stage whose compute
    failed is no fellow lost: replaying would fail again; nor is an evicted cache)."""
    if msg.reason.startswith("failed") or msg.evicted:
        return None
    return int(msg.stage)


async def _until_closed(stream: SecureStream | None) -> None:
    """Until the last stage closes its stream back (bounded): it has then seen the
    session's end, and a return stream closed first would read to it as the driver lost."""
    if stream is None:
        return
    with trio.move_on_after(2.0):
        try:
            while True:
                await stream.receive_frame()
        except (TransportError, RemoteProtocolError):
            pass


def _session_error(msg: SessionError) -> SwarmError:
    if msg.evicted:
        return _Evicted(f"stage {msg.stage} on fellow {msg.fellow} {msg.reason}")
    return TransportError(f"stage {msg.stage} on fellow {msg.fellow} {msg.reason}")
