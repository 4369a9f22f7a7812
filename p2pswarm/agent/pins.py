"""Pinned plans: the plans a leader has shown lately, and the check a pinned start makes.

A load or a job pinned to ``plan_id`` starts exactly there or is refused as
``plan-changed`` with what changed. The leader re-plans on its current view; when the new
``plan_id`` differs it compares against the plan it showed (remembered here, the newest
``SHOWN_PLANS``) to say what moved.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from p2pswarm.errors import PlanChanged
from p2pswarm.planner import diff_plans

SHOWN_PLANS = 64  # plans a leader remembers, to say what changed when a pin is refused


class ShownPlans:
    def __init__(self, leader_name: str, keep: int = SHOWN_PLANS) -> None:
        self.leader_name = leader_name
        self.keep = keep
        self._plans: OrderedDict[str, dict[str, Any]] = OrderedDict()

    def remember(self, plan: Any) -> Any:
        """Keep ``plan`` (newest last); return it unchanged."""
        if isinstance(plan, dict) and isinstance(plan.get("plan_id"), str):
            self._plans[plan["plan_id"]] = plan
            self._plans.move_to_end(plan["plan_id"])
            while len(self._plans) > self.keep:
                self._plans.popitem(last=False)
        return plan

    def get(self, plan_id: str) -> dict[str, Any] | None:
        return self._plans.get(plan_id)

    def plan_ids(self) -> list[str]:
        """The remembered plans' ids, oldest first."""
        return list(self._plans)

    def changes(self, expected: str, plan: dict[str, Any]) -> list[str]:
        """What differs between the shown plan ``expected`` and ``plan``, in words."""
        old = self._plans.get(expected)
        if old is None:
            return [f"plan {expected} is not one the leader ({self.leader_name}) has shown; "
                    "the swarm has changed since, or it was made under another leader"]
        changes = list(diff_plans(old, plan))
        then, now = len(old.get("replicas", [])), len(plan.get("replicas", []))
        if then != now:
            changes.append(f"{then} replicas then, {now} now")
        return changes or ["the placement differs"]

    def check_pin(self, expected: str | None, plan: dict[str, Any]) -> None:
        """Remember ``plan``; refuse as PlanChanged when a pin ``expected`` is not it."""
        changes = self.changes(expected, plan) if expected and \
            plan["plan_id"] != expected else []
        self.remember(plan)
        if changes:
            raise PlanChanged(str(expected), plan["plan_id"], changes, plan)
