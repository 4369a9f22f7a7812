"""Serving's control requests made from a plain request map (``p2pswarm.control.requests``):
the checks and the words a client that sends maps has always met. This is the control
API's edge, where a map becomes a typed request once; the agent's handlers receive the
messages only. A client that sends the messages themselves (``p2pswarm.wire.control``)
skips this; both reach the same handler."""

from __future__ import annotations

from typing import Any

from p2pswarm.control.requests import RequestMap, text
from p2pswarm.errors import ConfigError
from p2pswarm.models.tokenizer import token_id_list
from p2pswarm.wire.control import (
    ChatRequest,
    ChatTurn,
    GenerateRequest,
    LoadCancelRequest,
    LoadMoveRequest,
    LoadRequest,
    LoadsRequest,
    UnloadRequest,
)
from p2pswarm.wire.orders import pack_doc


def load_request(request: RequestMap) -> LoadRequest:
    message = request.get("request")
    if not isinstance(message, dict):
        raise ConfigError("a load op needs a \"request\" map, as the plan op")
    path, adapter = request.get("path"), request.get("adapter")
    load_id = request.get("load_id")
    if load_id is not None and not isinstance(load_id, str):
        raise ConfigError("\"load_id\" must be a string")
    return LoadRequest(pack_doc(message), text(request, "plan_id"), str(path) if path else "",
                       str(adapter) if adapter else "", load_id or "")


def load_cancel_request(request: RequestMap) -> LoadCancelRequest:
    load_id = request.get("load_id")
    if not isinstance(load_id, str) or not load_id:
        raise ConfigError("load_cancel needs the \"load_id\" its load was asked with")
    return LoadCancelRequest(load_id)


def loads_request(request: RequestMap) -> LoadsRequest:
    return LoadsRequest()


def unload_request(request: RequestMap) -> UnloadRequest:
    return UnloadRequest(text(request, "plan_id"), bool(request.get("all")))


def load_move_request(request: RequestMap) -> LoadMoveRequest:
    plan_id = request.get("plan_id")
    if not isinstance(plan_id, str) or not 1 <= len(plan_id) <= 64:
        raise ConfigError("load_move needs the \"plan_id\" of the load to move")
    return LoadMoveRequest(plan_id)


def generate_request(request: RequestMap) -> GenerateRequest:
    prompt, prompt_ids = request.get("prompt"), request.get("prompt_ids")
    ids: tuple[int, ...] | None = None
    if prompt_ids is not None:
        prompt, ids = "", tuple(token_id_list(prompt_ids, "\"prompt_ids\""))
    elif not isinstance(prompt, str) or not prompt:
        raise ConfigError("generate needs a non-empty \"prompt\" or \"prompt_ids\"")
    return _drawn(request, prompt, ids)


def chat_request(request: RequestMap) -> ChatRequest:
    """One turn of a chat: ``messages`` (the conversation so far, as the OpenAI endpoint
    takes them) and how to draw the answer."""
    from p2pswarm.models.chat_template import chat_messages

    turns = tuple(ChatTurn(m["role"], m["content"])
                  for m in chat_messages(request.get("messages")))
    try:
        int(request.get("max_tokens", 64))
    except (TypeError, ValueError):
        raise ConfigError("chat: max_tokens must be a whole number") from None
    prompt_ids = request.get("prompt_ids")  # given, it is the prompt (as generate takes it)
    ids = None if prompt_ids is None else tuple(token_id_list(prompt_ids, "\"prompt_ids\""))
    return ChatRequest(turns, _drawn(request, "", ids))


def _drawn(request: RequestMap, prompt: str, ids: tuple[int, ...] | None) -> GenerateRequest:
    """A generation of ``prompt`` (or ``ids``) as ``request`` says to draw it."""
    stops: Any = request.get("stop_token_ids")
    if stops is not None and not (isinstance(stops, list)
                                  and all(isinstance(t, int) for t in stops)):
        raise ConfigError("\"stop_token_ids\" must be a list of token ids")
    try:
        max_tokens = int(request.get("max_tokens", 64))
        temperature = float(request.get("temperature", 0.0))
        top_k = int(request.get("top_k", 0))
        top_p = float(request.get("top_p", 1.0))
        seed = int(request.get("seed", 0))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"generate: a bad number ({exc})") from None
    return GenerateRequest(prompt, ids, text(request, "plan_id"), max_tokens, temperature,
                           top_k, top_p, seed,
                           tuple(int(t) for t in stops) if stops is not None else None,
                           bool(request.get("remember")))


__all__ = ["chat_request", "generate_request", "load_cancel_request", "load_move_request",
           "load_request", "loads_request", "unload_request"]
