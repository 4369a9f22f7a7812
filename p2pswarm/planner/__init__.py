"""The placement planner: a pure, deterministic function of (model profile, cluster view,
request) to a plan.

Entry points:

- ``plan(profile, view, request) -> Plan`` and ``Plan.to_dict()``;
- ``plan_fleet(profile, view, request, fleet) -> FleetPlan``: a training job's DiLoCo
  replicas over the whole cluster, each with its own micro-batch (``fleet``);
- ``plan_message(message, view) -> dict``: what the agent's control API calls for the
  ``plan`` op: ``message`` is ``{"model": {"name", "config"}, ...request fields}``;
- ``profile_from_config(config, name)``, ``BUILTIN_MODELS`` (a model's config from a name
  or a path: ``p2pswarm.models.files``, which reads files);
- ``cluster_from_dict`` / ``cluster_to_dict`` (the cluster file), ``fellow_view`` +
  ``cluster_view`` (a view from membership's inventories and benchmarks);
- ``diff_views`` / ``diff_plans``: what changed, for a refused pinned plan;
- ``pinned_plan_message(message, view, shown)``: a plan shown before, as it stands on
  ``view`` now (None when it no longer holds), for a pinned start whose re-plan came out
  different only because free memory moved.

Importing the planner pulls in no torch, trio, sockets or clock. Showing a plan to a
person is the CLI's job (``p2pswarm.cli.render``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from p2pswarm.errors import ConfigError
from p2pswarm.planner.cluster import (
    CardView,
    ClusterView,
    Fellow,
    Link,
    cluster_from_dict,
    cluster_to_dict,
    cluster_view,
    fellow_view,
)
from p2pswarm.planner.diff import diff_plans, diff_views
from p2pswarm.planner.fleet import (
    FleetPlan,
    FleetRequest,
    fleet_plan_message,
    fleet_request_from_dict,
    plan_fleet,
)
from p2pswarm.planner.pin import Pin, PinnedStage, pin_from_plan
from p2pswarm.planner.plan import PLANNER_VERSION, Plan, plan, plan_pinned
from p2pswarm.planner.profile import (
    BUILTIN_MODELS,
    REFERENCE_CONFIGS,
    ModelProfile,
    profile_from_config,
)
from p2pswarm.planner.request import PlanRequest, request_from_dict


def _read_message(message: Mapping[str, Any]) -> tuple[ModelProfile, PlanRequest]:
    model = message.get("model")
    if not isinstance(model, Mapping) or not isinstance(model.get("config"), Mapping):
        raise ConfigError("a plan request needs \"model\": {\"name\", \"config\"}")
    profile = profile_from_config(model["config"], str(model.get("name") or "model"))
    return profile, request_from_dict({k: v for k, v in message.items() if k != "model"})


def asks_fleet(message: Mapping[str, Any]) -> bool:
    """Whether a plan message is a training request naming ``replicas`` ("auto" or a
    number): the fleet planner's (``fleet_plan_message``)."""
    return message.get("kind") == "train" and "replicas" in message


def read_plan_message(message: Mapping[str, Any]
                      ) -> tuple[ModelProfile, PlanRequest, FleetRequest | None]:
    """A plan message read and checked once: the model's profile, the plan request, and
    the fleet's part of a fleet request (None for a single plan). Raises ConfigError."""
    if asks_fleet(message):
        profile, _ = _read_message({"model": message.get("model"), "kind": "train"})
        fleet, rest = fleet_request_from_dict(
            {k: v for k, v in message.items() if k != "model"})
        return profile, request_from_dict({**rest, "kind": "train"}), fleet
    profile, request = _read_message(message)
    return profile, request, None


def plan_message(message: Mapping[str, Any], view: ClusterView) -> dict[str, Any]:
    """The ``plan`` op: ``{"model": {"name": str, "config": HF config dict}, **request}``
    planned on ``view``, as the plan's dict. A training request that names
    ``replicas`` ("auto" or a number) gets the fleet plan (``fleet``). Raises
    ConfigError / PlacementError."""
    if asks_fleet(message):
        return fleet_plan_message(message, view)
    profile, request = _read_message(message)
    return plan(profile, view, request).to_dict()


def pinned_plan_message(message: Mapping[str, Any], view: ClusterView,
                        shown: Mapping[str, Any]) -> dict[str, Any] | None:
    """The placement of the plan dict ``shown``, planned for ``message`` on ``view``
    (``plan_pinned``), as a plan dict; None when it no longer holds. Its ``plan_id`` is
    ``shown``'s exactly when ``message`` asks for what ``shown`` was made for."""
    pin = pin_from_plan(shown)
    if pin is None:
        return None
    profile, request = _read_message(message)
    pinned = plan_pinned(profile, view, request, pin)
    return None if pinned is None else pinned.to_dict()


__all__ = [
    "BUILTIN_MODELS",
    "PLANNER_VERSION",
    "Pin",
    "PinnedStage",
    "REFERENCE_CONFIGS",
    "CardView",
    "FleetPlan",
    "FleetRequest",
    "ClusterView",
    "Fellow",
    "Link",
    "ModelProfile",
    "asks_fleet",
    "Plan",
    "PlanRequest",
    "cluster_from_dict",
    "cluster_to_dict",
    "cluster_view",
    "diff_plans",
    "diff_views",
    "fellow_view",
    "fleet_plan_message",
    "plan",
    "plan_fleet",
    "plan_message",
    "plan_pinned",
    "pin_from_plan",
    "pinned_plan_message",
    "profile_from_config",
    "read_plan_message",
    "request_from_dict",
]
