"""Requests of the local control API (the CLI, the HTTP API): each op its own frozen
message, bounded like every message on the wire.

A control request still arrives as a map, ``{"op": NAME, ...}``: either carrying the
message itself, encoded (``"msg"``: what ``encode`` makes of it), or, from a client that
sends plain maps (the HTTP API, scripts), its fields by name, which the control API's edge
turns into the message (``p2pswarm.control.serving_requests``) and then checks with this
codec as any message. The CLI sends the messages themselves.
Either way, a handler receives one of these values, never the map.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from p2pswarm.wire.codec import message, struct
from p2pswarm.wire.orders import Doc
from p2pswarm.wire.schema import F64, I64, U32, Items, Size

MAX_PROMPT_CHARS = 16 * 1024 * 1024  # a control frame holds 64 MiB, a char up to 4 bytes
MAX_TOKEN_IDS = 1 << 20
MAX_CHAT_TURNS = 4096

PlanIdOrAll = Annotated[str, Size(0, 64)]  # "" where the request names no plan
LoadId = Annotated[str, Size(0, 64)]
LocalPath = Annotated[str, Size(0, 4096)]  # "" where none is given
Prompt = Annotated[str, Size(0, MAX_PROMPT_CHARS)]
TokenIds = Annotated[tuple[U32, ...], Items(MAX_TOKEN_IDS)]
Role = Annotated[str, Size(1, 16)]


@message(200)
@dataclass(frozen=True, slots=True)
class StatusRequest:
    """``status``: how this agent sees itself and the swarm."""


@message(201)
@dataclass(frozen=True, slots=True)
class LeaveRequest:
    """``leave``: say goodbye to the swarm, then stop."""


@message(202)
@dataclass(frozen=True, slots=True)
class LoadRequest:
    """``load``: bring up the plan of ``request`` (pinned to ``plan_id`` when given)."""

    request: Doc  # the plan request, as ``plan`` takes it
    plan_id: PlanIdOrAll = ""
    path: LocalPath = ""  # the model directory this fellow offers, if any
    adapter: LocalPath = ""  # a LoRA adapter directory on top, if any
    load_id: LoadId = ""  # the asker's name for it, to cancel it by


@message(203)
@dataclass(frozen=True, slots=True)
class LoadCancelRequest:
    load_id: Annotated[str, Size(1, 64)]


@message(204)
@dataclass(frozen=True, slots=True)
class LoadsRequest:
    """``loads``: what is loaded."""


@message(205)
@dataclass(frozen=True, slots=True)
class UnloadRequest:
    plan_id: PlanIdOrAll = ""
    all: bool = False


@message(206)
@dataclass(frozen=True, slots=True)
class LoadMoveRequest:
    plan_id: Annotated[str, Size(1, 64)]


@message(207)
@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """``generate``: a prompt (text, or token ids) through a load, tokens as they come."""

    prompt: Prompt = ""
    prompt_ids: TokenIds | None = None  # given: the prompt, and ``prompt`` is ignored
    plan_id: PlanIdOrAll = ""
    max_tokens: I64 = 64
    temperature: F64 = 0.0
    top_k: I64 = 0
    top_p: F64 = 1.0
    seed: I64 = 0
    stop_token_ids: Annotated[tuple[I64, ...], Items(MAX_TOKEN_IDS)] | None = None
    remember: bool = False  # keep the session for a next turn


@struct
@dataclass(frozen=True, slots=True)
class ChatTurn:
    role: Role
    content: Prompt


@message(208)
@dataclass(frozen=True, slots=True)
class ChatRequest:
    """``chat``: one turn; ``messages`` is the conversation so far, ``generate`` says how
    to draw the answer (its prompt is the chat template's)."""

    messages: Annotated[tuple[ChatTurn, ...], Items(MAX_CHAT_TURNS)]
    generate: GenerateRequest


@message(209)
@dataclass(frozen=True, slots=True)
class RevokeRequest:
    """``revoke``: take in an admin-signed revocation (security.admission.Revocation),
    keep it and gossip it."""

    revocation: Annotated[bytes, Size(1, 1024)]


@message(290)
@dataclass(frozen=True, slots=True)
class ClusterRequest:
    """``cluster``: the swarm as this agent's planner sees it."""


__all__ = ["ChatRequest", "ChatTurn", "ClusterRequest", "GenerateRequest", "LeaveRequest",
           "LoadCancelRequest", "LoadMoveRequest", "LoadRequest", "LoadsRequest",
           "RevokeRequest", "StatusRequest", "UnloadRequest"]
