"""What the HTTP API answers when it cannot do what was asked.

Every error is an HTTP status and one JSON document::

    {"error": {"code": "<stable-kebab-code>", "message": "<one human sentence>", ...extra}}

The code is for programs (it never changes meaning), the message for people. The
``/v1`` endpoints answer the same document, with ``type`` added, which is where the
OpenAI clients look. ``from_swarm_error`` turns what an agent op raised into one.
"""

from __future__ import annotations

from typing import Any

from p2pswarm.errors import (
    Busy,
    ConfigError,
    ControlError,
    NotLeader,
    PlacementError,
    PlanChanged,
    SwarmError,
    TransportError,
)
from p2pswarm.models.chat_template import ChatRefused

STATUS_CODES: dict[str, int] = {
    "bad-json": 400,
    "bad-request": 400,
    "context-length-exceeded": 400,
    "bad-framing": 400,
    "unauthorized": 401,
    "foreign-host": 403,
    "foreign-origin": 403,
    "dir-not-allowed": 403,
    "not-found": 404,
    "method-not-allowed": 405,
    "plan-changed": 409,
    "refused": 409,
    "too-large": 413,
    "unsupported-media-type": 415,
    "headers-too-large": 431,
    "busy": 429,
    "agent-error": 500,
    "not-available": 501,
    "unreachable": 503,
    "no-leader": 503,
}

_OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                 403: "permission_error", 404: "not_found_error", 409: "conflict_error",
                 413: "invalid_request_error", 415: "invalid_request_error",
                 429: "rate_limit_error", 431: "invalid_request_error"}

_NO_LEADER = ("no leader to ask", "the leader is not in this fellow's view")


class HttpError(SwarmError):
    """An answer that is an error: its code, its sentence, and anything more to say."""

    def __init__(self, code: str, message: str, extra: dict[str, Any] | None = None,
                 headers: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.extra = dict(extra or {})
        self.headers = headers  # e.g. Retry-After on 429

    @property
    def status(self) -> int:
        return STATUS_CODES.get(self.code, 500)

    def document(self) -> dict[str, Any]:
        return {"error": {"code": self.code, "message": self.message,
                          "type": _OPENAI_TYPES.get(self.status, "server_error"),
                          **self.extra}}


def from_swarm_error(exc: SwarmError) -> HttpError:
    """The HTTP answer for what an agent op raised."""
    if isinstance(exc, HttpError):
        return exc  # already an answer
    message = str(exc)
    if isinstance(exc, PlanChanged):
        return HttpError("plan-changed", message, {
            "expected_plan_id": exc.expected_plan_id, "new_plan_id": exc.new_plan_id,
            "changed": list(exc.changes), "plan": exc.new_plan})
    if isinstance(exc, (ConfigError, ChatRefused)):
        return HttpError("bad-request", message)
    if isinstance(exc, Busy):
        return HttpError("busy", message, {"retry_after_s": exc.retry_after_s},
                         (("retry-after", str(exc.retry_after_s)),))
    if isinstance(exc, PlacementError):
        # NotLeader, or its words from a fellow of an older version
        if isinstance(exc, NotLeader) or message.startswith(_NO_LEADER) or \
                " is not the leader (" in message:
            return HttpError("no-leader", message)
        if " is not loaded" in message or message.startswith("nothing is loaded"):
            return HttpError("not-found", message)
        return HttpError("refused", message)
    if isinstance(exc, TransportError):
        return HttpError("unreachable", message)
    if isinstance(exc, ControlError):
        return HttpError("agent-error", message)
    return HttpError("agent-error", message)


__all__ = ["HttpError", "STATUS_CODES", "from_swarm_error"]
