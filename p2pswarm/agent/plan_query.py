"""The leader's planning input: a plan message read and checked once, into values.

A plan message (``{"model": {"name", "config"}, **request fields}``, what the CLI, the
HTTP API and a fellow's ``PlanAsk`` carry) is a document; the leader reads it here, once,
into the model's profile, the plan request, the fleet's part of a training request that
names ``replicas``, and the adapter the plan is made for. The planner and the pins then
take these values. A fellow that is not the leader passes the message on unread.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from p2pswarm.planner import ModelProfile, PlanRequest, read_plan_message
from p2pswarm.planner.fleet import FleetRequest


@dataclass(frozen=True, slots=True)
class PlanQuery:
    """What the leader is asked to plan: ``profile`` and ``request`` (a single plan's, or
    each replica's of a fleet), ``fleet`` (None: a single plan), ``adapter`` (the LoRA
    adapter's SHA-256 the plan is made for, checked as the plan is adapted; "": none)."""

    profile: ModelProfile
    request: PlanRequest
    fleet: FleetRequest | None
    adapter: str

    @staticmethod
    def from_doc(message: Mapping[str, Any]) -> PlanQuery:
        """Read a plan message; ConfigError says what is wrong with it."""
        profile, request, fleet = read_plan_message(message)
        adapter = message.get("adapter")
        return PlanQuery(profile, request, fleet, str(adapter) if adapter else "")


__all__ = ["PlanQuery"]
