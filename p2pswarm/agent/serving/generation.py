"""The driver of a generation: find the load, tokenize, drive the ring, stream the text.

The fellow where ``generate`` runs opens a sealed stream to stage 0 and waits for the
last stage's stream back (``SessionReturn``); token ids go to stage 0 and the drawn token
comes straight back to the driver, which streams it to the CLI, decides whether to stop
and sends it to stage 0 for the next step. A decode step crosses one hop per stage plus
one: the fewest for a ring that includes a driver that owns the loop (stops, limits,
cancellation, timings), and no hop is ever crossed twice, so a reply never travels back
along the chain. Prompts go in chunks of the plan's prefill chunk, which also pipelines
the prefill: stage 0 runs chunk 2 while stage 1 runs chunk 1.

Generations wait in the driver's queue (``queue``) for one of the load's session slots.
One asked to be remembered (a chat turn) leaves its session's cache on the stages when it
ends, and a later prompt that begins with the same tokens continues it, prefilling only
the new ones (``prefix_cache``).

The driver watches for failures and names them: an error relayed by any stage, stage 0's
stream breaking, a stage fellow that membership declares dead or departed (a silent
fellow behind a lossy link never breaks the stream itself), and a silent pipeline after
``step_timeout_s``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import trio

from p2pswarm import wire
from p2pswarm.agent.serving.loads import Loads
from p2pswarm.agent.serving.offers import Offers
from p2pswarm.agent.serving.prefix_cache import PrefixCache
from p2pswarm.agent.serving.queue import Admission
from p2pswarm.agent.serving.records import GenerationResult
from p2pswarm.agent.serving.runtime import StageRuntime
from p2pswarm.agent.serving.stage_session import open_hop
from p2pswarm.agent.streams import send_best_effort
from p2pswarm.agent.weights import Manifest, fetch
from p2pswarm.errors import (
    ConfigError,
    PlacementError,
    RemoteProtocolError,
    SwarmError,
    TransportError,
)
from p2pswarm.models.tokenizer import ByteTokenizer, HFTokenizer
from p2pswarm.wire.serving import (
    SessionEnd,
    SessionError,
    SessionOpen,
    SessionReturn,
    StepInput,
    StepOutput,
)

if TYPE_CHECKING:
    from p2pswarm.agent.agent import Agent
    from p2pswarm.transport.secure import SecureStream

MEMBER_WATCH_S = 0.25  # how often a driver looks at its stage fellows' membership state


@dataclass
class _ReturnSlot:
    """Where the last stage's stream back to a driver lands."""

    expected_id: bytes
    arrived: trio.Event = field(default_factory=trio.Event)
    done: trio.Event = field(default_factory=trio.Event)
    stream: SecureStream | None = None


class _Evicted(SwarmError):
    """A stage no longer keeps the session's cache a resumed generation wanted."""


class _Failure:
    """The first failure of a session, and the scope to cancel when it comes (keeps
    errors out of exception groups: watchers record, the caller raises)."""

    def __init__(self) -> None:
        self.error: SwarmError | None = None
        self.scope: trio.CancelScope | None = None
        self.produced = 0  # tokens the driver had when it failed
        self.tokens: list[int] = []  # the tokens drawn so far

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
        text: str = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd") or not text.startswith(self.text):
            return ""  # wait for the rest of the character
        piece, self.text = text[len(self.text):], text
        return piece


class Generation:
    def __init__(self, agent: Agent, runtime: StageRuntime, loads: Loads,
                 offers: Offers) -> None:
        self.agent = agent
        self.runtime = runtime
        self.loads = loads
        self.offers = offers
        self.step_timeout_s = 60.0  # the most a driver waits for one token
        self.admission = Admission()
        self.kept = PrefixCache()
        self._returns: dict[str, _ReturnSlot] = {}
        agent.on_stream(SessionReturn, self._on_session_return)

    async def _on_session_return(self, msg: SessionReturn, stream: SecureStream) -> None:
        slot = self._returns.get(msg.session)
        if slot is None or slot.stream is not None or stream.peer_node_id != slot.expected_id:
            return
        slot.stream = stream
        slot.arrived.set()
        await slot.done.wait()  # the driver reads it; returning would close it

    async def find_load(self, plan_id: str | None = None) -> dict[str, Any]:
        loads = await self.loads.list_loads()
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
        model = record.get("model", {})
        files = {f[0] for f in model.get("files", [])}
        if model.get("kind") == "builtin" or "tokenizer.json" not in files:
            # p2pswarm's own models (built in, or trained from scratch and saved) are
            # byte-level and ship no tokenizer.json
            return ByteTokenizer()
        manifest = Manifest.from_dict({**model, "config": {}, "tensors": []})
        if model.get("source_id") == self.agent.node_id.hex():
            # a record gossiped by any fellow may name this one the source: read only a
            # directory this fellow offered
            if not self.offers.offered(manifest):
                raise PlacementError(f"{self.agent.name} offered no model directory "
                                     f"{manifest.path}")
            return HFTokenizer(manifest.path)
        cache = self.offers.weights_cache()
        missing = [f.name for f in manifest.files if not cache.has(f.sha256, f.nbytes)]
        if missing:
            source = self.agent.fellow(str(model.get("source_id", "")))
            if source is None or source.state not in ("alive", "suspect"):
                raise PlacementError(f"the tokenizer is on {model.get('source')}, which is "
                                     "not connected")
            await fetch(self.agent, source.addr, source.node_id, source.name, manifest,
                        missing, cache, self.agent.compute.run)
        directory = await self.agent.compute.run(lambda: cache.model_dir(manifest))
        return HFTokenizer(directory)

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
        plan = record["plan_id"]
        slots = int(record["runtime"].get("max_sessions", 1))
        async with self.admission.slot(plan, slots, on_wait):
            reuse = self.kept.take(plan, ids) if remember else None
            settings = (float(temperature), int(top_k), float(top_p), int(seed), keep_logits)
            try:
                return await self._session(record, tokenizer, ids, max_tokens, stops,
                                           settings, reuse, remember, on_token)
            except _Evicted:
                if reuse is None:
                    raise TransportError("a stage lost a new session's cache") from None
                return await self._session(record, tokenizer, ids, max_tokens, stops,
                                           settings, None, remember, on_token)

    async def _session(self, record: dict[str, Any], tokenizer: Any, ids: list[int],
                       max_tokens: int, stops: set[int], settings: tuple[Any, ...],
                       reuse: tuple[str, int] | None, remember: bool,
                       on_token: Callable[[int, str], None] | None) -> GenerationResult:
        """One session through the pipeline: new, or continuing a kept one (``reuse``:
        its id and how many of its positions still hold)."""
        session, start = reuse or (f"{self.agent.rng.getrandbits(64):016x}", 0)
        route = [dict(s) for s in record["stages"]]
        open_msg = SessionOpen(session, record["plan_id"], 0, self.agent.addr, *settings,
                               resume_from=start)
        slot = _ReturnSlot(bytes.fromhex(route[-1]["fellow_id"]))
        self._returns[session] = slot
        failure = _Failure()
        text = TextStream(tokenizer)
        try:
            first = route[0]
            try:
                upstream = await open_hop(self.agent, first)
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
                    keep = remember and bool(failure.tokens)  # else its length is unknown
                    if failure.error is None:
                        with trio.move_on_after(1.0):
                            await send_best_effort(upstream, SessionEnd(len(failure.tokens),
                                                                        keep))
                        if keep:
                            self.kept.put(record["plan_id"], session,
                                          ids + failure.tokens[:-1],
                                          int(record["runtime"].get("max_sessions", 1)))
                            await _until_closed(slot.stream)  # every stage kept it
                    await upstream.aclose()
        finally:
            slot.done.set()
            self._returns.pop(session, None)

    async def _drive(self, record: dict[str, Any], route: list[dict[str, Any]], ids: list[int],
                     max_tokens: int, stops: set[int], open_msg: SessionOpen,
                     upstream: SecureStream, slot: _ReturnSlot, failure: _Failure,
                     text: TextStream,
                     on_token: Callable[[int, str], None] | None) -> GenerationResult:
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
        for start in range(open_msg.resume_from, len(ids), chunk):
            await send(StepInput(0, start, start + chunk >= len(ids), (),
                                 self.runtime.token_frame(ids[start:start + chunk])))
        with trio.move_on_after(self.step_timeout_s):
            await slot.arrived.wait()
        if slot.stream is None:
            failure.set(TransportError(
                f"the last stage on fellow {route[-1]['fellow']} did not connect back within "
                f"{self.step_timeout_s:g} s"))
            await trio.sleep_forever()
        ret = slot.stream
        tokens = failure.tokens
        kept: list[Any] = []
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
                kept.append(self.runtime.read_logits(msg.logits))
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
                                 self.runtime.token_frame([msg.token])))
        decode_s = time.perf_counter() - decode_began
        return GenerationResult(
            plan_id=record["plan_id"], prompt_ids=tuple(ids), token_ids=tuple(tokens),
            text=text.tokenizer.decode(tokens), stop_reason=stop_reason,
            time_to_first_token_s=first_token_s, decode_s=decode_s,
            stage_decode_s=tuple(stage_s),
            route=tuple({"stage": r["stage"], "fellow": r["fellow"], "layers": r["layers"],
                         "card": r.get("card", "")} for r in route),
            logits=tuple(kept), cached_tokens=open_msg.resume_from)

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
