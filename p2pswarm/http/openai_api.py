"""The OpenAI-compatible endpoint for what the swarm has loaded: ``/v1/models``,
``/v1/completions`` and ``/v1/chat/completions``, so any chat client can talk to it.

Each load is a model; its id is the model's name (``name@plan_id`` for a second load of
the same model; a bare ``plan_id`` is understood too). A completion runs the agent's
``generate`` op in-process, its token events routed here (``emitting_to``): with
``stream: true`` every piece of text goes out as a server-sent event the moment the
pipeline's last stage hands the token to this fellow, and ``data: [DONE]`` ends the
stream. Stop strings are the endpoint's: text that may begin one is held back until it
is clear, and a stop found ends the generation (the op is cancelled, which closes the
session on every stage). Chat messages become one prompt through the model's chat
template, or a plain layout for a model without one (``p2pswarm.models.chat_template``).
A chat's session stays cached on the stages after it answers, so a client that resends
the conversation with a new message has only the new tokens prefilled. A request that finds
every session slot of the load taken waits in line; a full line answers 429 with
``Retry-After``.

What the swarm cannot do (several choices, log probabilities, penalties, tools) is
refused with 400 rather than silently ignored.
"""

from __future__ import annotations

import math
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio

from p2pswarm.agent.serving.records import LoadRecord, former_plan_ids, generation_tokens
from p2pswarm.control.server import emitting_to
from p2pswarm.errors import ConfigError, SwarmError
from p2pswarm.http.app import Call, Route, dumps
from p2pswarm.http.problems import HttpError, from_swarm_error
from p2pswarm.models.chat_template import ChatTemplate, chat_messages, render_chat
from p2pswarm.models.tokenizer import token_id_list

if TYPE_CHECKING:
    from p2pswarm.agent.agent import Agent

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
CHAT_MAX_TOKENS = 512  # without max_tokens, a chat answer stops here or at the context's end
MAX_STOPS = 4
_REFUSED_OPTIONS: dict[str, tuple[object, ...]] = {  # option -> the value that means "not used"
    "logprobs": (None, False), "top_logprobs": (None, 0), "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0), "tools": (None, []), "functions": (None, []),
    "logit_bias": (None, {}), "suffix": (None, ""), "best_of": (None, 1),
}


# --- stop strings --------------------------------------------------------------------------


class StopScanner:
    """Text as it may be shown: cut before the first stop string, holding back a tail
    that could still become one."""

    def __init__(self, stops: tuple[str, ...] = ()) -> None:
        self.stops = tuple(s for s in stops if s)
        self.pending = ""
        self.shown = ""
        self.stopped = False

    def push(self, piece: str) -> str:
        """The new text that is safe to show now."""
        if self.stopped or not piece:
            return ""
        buffer = self.pending + piece
        cut = min((buffer.find(s) for s in self.stops if s in buffer), default=-1)
        if cut >= 0:
            self.stopped = True
            out, self.pending = buffer[:cut], ""
        else:
            hold = max((n for s in self.stops for n in range(1, len(s))
                        if buffer.endswith(s[:n])), default=0)
            out, self.pending = buffer[:len(buffer) - hold], buffer[len(buffer) - hold:]
        self.shown += out
        return out

    def finish(self, full_text: str) -> str:
        """The rest of ``full_text`` (the generation's final text) still to show."""
        if self.stopped:
            return ""
        cuts = [full_text.find(s) for s in self.stops if s in full_text]
        final = full_text[:min(cuts)] if cuts else full_text
        self.stopped = bool(cuts)
        rest = final[len(self.shown):] if final.startswith(self.shown) else ""
        self.shown += rest
        self.pending = ""
        return rest


# --- requests ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Sampling:
    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stops: tuple[str, ...]
    stream: bool
    include_usage: bool


def _number(body: dict[str, Any], key: str, default: float, low: float, high: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise HttpError("bad-request", f"{key} must be a number from {low:g} to {high:g}, "
                                       f"got {value!r}")
    return float(value)


def _whole(body: dict[str, Any], key: str, low: int, high: int = 2**31 - 1) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        raise HttpError("bad-request", f"{key} must be a whole number from {low:,} to "
                                       f"{high:,}, got {shown}")
    return value


def sampling(body: dict[str, Any], *, chat: bool) -> Sampling:
    for key, unused in _REFUSED_OPTIONS.items():
        if key in body and body[key] not in unused:
            raise HttpError("bad-request", f"{key} is not supported by this endpoint")
    if body.get("n") not in (None, 1):
        raise HttpError("bad-request", "n must be 1: the swarm answers one choice per request")
    stop = body.get("stop")
    stops = (stop,) if isinstance(stop, str) else stop if stop is not None else ()
    if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) for s in stops) \
            or len(stops) > MAX_STOPS:
        raise HttpError("bad-request", f"stop must be a string or a list of at most "
                                       f"{MAX_STOPS} strings")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise HttpError("bad-request", "stream must be true or false")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise HttpError("bad-request", "stream_options must be an object")
    max_tokens = _whole(body, "max_tokens", 1)
    if chat and max_tokens is None:
        max_tokens = _whole(body, "max_completion_tokens", 1)
    seed = _whole(body, "seed", -2**63, 2**64 - 1)
    return Sampling(
        max_tokens=max_tokens if max_tokens is not None or chat else COMPLETION_MAX_TOKENS,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0), top_k=_whole(body, "top_k", 0) or 0,
        seed=seed % 2**63 if seed is not None else secrets.randbits(63),
        stops=tuple(stops), stream=stream, include_usage=bool(options.get("include_usage")))


def model_ids(loads: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """(id, load record) for each load: the model's name, ``name@plan_id`` for a second
    load of the same model."""
    out, seen = [], set()
    for record in sorted(loads, key=lambda r: str(r.get("plan_id"))):
        name = str((record.get("model") or {}).get("name") or record["plan_id"])
        out.append((name if name not in seen else f"{name}@{record['plan_id']}", record))
        seen.add(name)
    return out


# --- the endpoint --------------------------------------------------------------------------


class OpenAIEndpoint:
    def __init__(self, agent: Agent) -> None:
        self.agent = agent

    async def _op(self, name: str, request: dict[str, Any]) -> Any:
        return await self.agent.control_ops[name]({"op": name, **request})

    async def _models(self) -> list[tuple[str, dict[str, Any]]]:
        return model_ids(list((await self._op("loads", {})).get("loads", [])))

    @staticmethod
    def _card(model_id: str, record: dict[str, Any]) -> dict[str, Any]:
        return {"id": model_id, "object": "model", "created": 0, "owned_by": "p2pswarm",
                "plan_id": record["plan_id"], "stages": len(record.get("stages", [])),
                "context": int((record.get("runtime") or {}).get("max_context_tokens", 0))}

    async def models(self, call: Call) -> None:
        await call.respond_json({"object": "list", "data": [
            self._card(i, r) for i, r in await self._models()]})

    async def model(self, call: Call, model: str) -> None:
        model_id, record = await self._find(model)
        await call.respond_json(self._card(model_id, record))

    async def _find(self, model: Any) -> tuple[str, dict[str, Any]]:
        if not isinstance(model, str) or not model:
            raise HttpError("bad-request", "\"model\" must name a loaded model; GET /v1/models "
                                           "lists them")
        models = await self._models()
        for model_id, record in models:
            name = (record.get("model") or {}).get("name")
            if model in (model_id, record["plan_id"], f"{name}@{record['plan_id']}") \
                    or model in former_plan_ids(record):  # a live move re-cut it since
                return model_id, record
        loaded = ", ".join(i for i, _ in models) or "nothing"
        raise HttpError("not-found", f"model {model!r} is not loaded (loaded: {loaded}); "
                                     "load it with `p2pswarm load` or POST /api/models/load")

    async def _template(self, record: dict[str, Any]) -> ChatTemplate | None:
        """The load's chat template (the serving side reads and caches it)."""
        return await self.agent.serving.chat_prompts.template(await self._typed(record))

    async def _typed(self, record: dict[str, Any]) -> LoadRecord:
        """The serving side's value of a load record ``_find`` found; one not fit to serve
        (a stage not known yet) is refused in the words a generation would meet."""
        try:
            return LoadRecord.from_doc(record)
        except ConfigError:
            return await self.agent.serving.find_load(str(record.get("plan_id")))

    async def completions(self, call: Call) -> None:
        body = await call.json()
        options = sampling(body, chat=False)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # one prompt in a list: a text or a list of token ids
        if isinstance(prompt, list):  # token ids, as the OpenAI API takes them
            try:
                prompt = token_id_list(prompt, "prompt")
            except ConfigError as exc:
                raise HttpError("bad-request", str(exc)) from None
        elif not isinstance(prompt, str):
            raise HttpError("bad-request", "prompt must be one string or one list of token "
                                           "ids (lists of prompts are not supported)")
        echo = body.get("echo", False)
        if not isinstance(echo, bool):
            raise HttpError("bad-request", "echo must be true or false")
        if echo and isinstance(prompt, list):
            raise HttpError("bad-request", "echo needs a text prompt, not token ids")
        model_id, record = await self._find(body.get("model"))
        await self._answer(call, model_id, record, prompt, options, chat=False,
                           echo=prompt if echo and isinstance(prompt, str) else "")

    async def chat_completions(self, call: Call) -> None:
        body = await call.json()
        options = sampling(body, chat=True)
        messages = chat_messages(body.get("messages"))
        model_id, record = await self._find(body.get("model"))
        prompt = render_chat(messages, await self._template(record))
        await self._answer(call, model_id, record, prompt, options, chat=True)

    # --- one generation ---------------------------------------------------------------

    async def _answer(self, call: Call, model_id: str, record: dict[str, Any],
                      prompt: str | list[int], options: Sampling, *, chat: bool,
                      echo: str = "") -> None:
        prompt_tokens = (len(prompt) if isinstance(prompt, list) else
                         len((await self.agent.serving.tokenizer(await self._typed(record)))
                             .encode(prompt)))
        context, bound = generation_tokens(record)  # a recurrent load: past its context
        room = context - prompt_tokens + 1 if context else CHAT_MAX_TOKENS
        max_tokens = options.max_tokens or min(CHAT_MAX_TOKENS, room)
        if max_tokens > room:
            raise HttpError("context-length-exceeded", (
                f"{prompt_tokens} prompt tokens and {max_tokens} new ones exceed {bound}"
                if room > 0 else f"the prompt's {prompt_tokens} tokens fill {bound}"))
        given = {"prompt_ids": prompt} if isinstance(prompt, list) else {"prompt": prompt}
        request = {**given, "plan_id": record["plan_id"], "max_tokens": max_tokens,
                   "temperature": options.temperature, "top_k": options.top_k,
                   "top_p": options.top_p, "seed": options.seed,
                   "remember": chat}  # a chat resends the conversation: continue its cache
        reply = _Reply(call, model_id, chat, options.stream)
        if echo:
            await reply.text(echo)
        outcome = await self._generate(call, request, options.stops, reply.text)
        if outcome.error is not None:
            if not reply.started:
                raise outcome.error
            await reply.error(outcome.error)
            return
        if outcome.client_gone:
            return
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": outcome.tokens,
                 "total_tokens": prompt_tokens + outcome.tokens}
        await reply.finish(outcome.finish_reason, usage, options.include_usage)

    async def _generate(self, call: Call, request: dict[str, Any], stops: tuple[str, ...],
                        on_text: Callable[[str], Awaitable[None]]) -> _Outcome:
        """Run the generate op, each piece of text to ``on_text`` as it comes; a stop
        string or a departed client ends it early."""
        scanner = StopScanner(stops)
        outcome = _Outcome()
        events_in, events_out = trio.open_memory_channel[dict[str, Any]](math.inf)
        drained = trio.Event()

        def tap(event: dict[str, Any]) -> None:
            if "token" in event:
                try:
                    events_in.send_nowait(event)
                except (trio.ClosedResourceError, trio.BrokenResourceError):
                    pass

        async def relay(generation: trio.CancelScope) -> None:
            try:
                async for event in events_out:
                    outcome.tokens += 1
                    text = scanner.push(str(event.get("text", "")))
                    if text:
                        await on_text(text)
                    if scanner.stopped:
                        generation.cancel()
                        return
            except Exception:  # the client went away mid-write
                outcome.client_gone = True
                generation.cancel()
            finally:
                drained.set()

        async def watch_client(generation: trio.CancelScope) -> None:
            await call.wait_disconnect()
            outcome.client_gone = True
            generation.cancel()

        result: dict[str, Any] | None = None
        with trio.CancelScope() as generation:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(relay, generation)
                nursery.start_soon(watch_client, generation)
                try:
                    with emitting_to(tap):
                        result = await self._op("generate", request)
                except SwarmError as exc:
                    outcome.error = from_swarm_error(exc)
                finally:
                    events_in.close()
                await drained.wait()
                nursery.cancel_scope.cancel()
        if scanner.stopped:
            outcome.finish_reason = "stop"
        elif result is not None and outcome.error is None and not outcome.client_gone:
            outcome.tokens = len(result.get("token_ids", [])) or outcome.tokens
            rest = scanner.finish(str(result.get("text", "")))
            if rest:
                await on_text(rest)
            stopped = scanner.stopped or result.get("stop_reason") == "stop_token"
            outcome.finish_reason = "stop" if stopped else "length"
        return outcome


@dataclass
class _Outcome:
    tokens: int = 0
    finish_reason: str = "stop"
    error: HttpError | None = None
    client_gone: bool = False


class _Reply:
    """The answer to one completion: one JSON document, or server-sent events."""

    def __init__(self, call: Call, model_id: str, chat: bool, stream: bool) -> None:
        self.call = call
        self.model_id = model_id
        self.chat = chat
        self.stream = stream
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{secrets.token_hex(12)}"
        self.created = int(time.time())
        self.pieces: list[str] = []
        self.started = False

    def _envelope(self, choice: dict[str, Any], finished: str | None) -> dict[str, Any]:
        kind = ("chat.completion" if self.chat else "text_completion")
        if self.stream and self.chat:
            kind += ".chunk"
        choice = {"index": 0, **choice, "logprobs": None, "finish_reason": finished}
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model_id,
                "choices": [choice]}

    async def _event(self, data: dict[str, Any]) -> None:
        await self.call.chunk(b"data: " + dumps(data) + b"\n\n")

    async def _start(self) -> None:
        if self.started:
            return
        self.started = True
        await self.call.start(200, "text/event-stream; charset=utf-8",
                              (("x-accel-buffering", "no"),))
        if self.chat:
            await self._event(self._envelope({"delta": {"role": "assistant", "content": ""}},
                                             None))

    async def text(self, piece: str) -> None:
        if not self.stream:
            self.pieces.append(piece)
            return
        await self._start()
        choice = {"delta": {"content": piece}} if self.chat else {"text": piece}
        await self._event(self._envelope(choice, None))

    async def error(self, error: HttpError) -> None:
        await self._event(error.document())
        await self.call.end()

    async def finish(self, reason: str, usage: dict[str, int], include_usage: bool) -> None:
        if not self.stream:
            text = "".join(self.pieces)
            choice = {"message": {"role": "assistant", "content": text}} if self.chat \
                else {"text": text}
            await self.call.respond_json({**self._envelope(choice, reason), "usage": usage})
            return
        await self._start()
        await self._event(self._envelope({"delta": {}} if self.chat else {"text": ""}, reason))
        if include_usage:
            await self._event({**self._envelope({}, None), "choices": [], "usage": usage})
        await self.call.chunk(b"data: [DONE]\n\n")
        await self.call.end()


def openai_routes(agent: Agent) -> list[Route]:
    endpoint = OpenAIEndpoint(agent)
    return [
        Route("GET", "/v1/models", endpoint.models),
        Route("GET", "/v1/models/{model}", endpoint.model),
        Route("POST", "/v1/completions", endpoint.completions),
        Route("POST", "/v1/chat/completions", endpoint.chat_completions),
    ]


__all__ = ["OpenAIEndpoint", "Sampling", "StopScanner", "model_ids", "openai_routes",
           "sampling"]
