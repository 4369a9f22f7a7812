"""Pinned plans: the plans a leader has shown lately, and the check a pinned start makes.

A load or a job pinned to ``plan_id`` starts exactly there or is refused as
``plan-changed`` with what changed. The leader re-plans on its current view; when the new
``plan_id`` differs it compares against the plan it showed (remembered here, the newest
``SHOWN_PLANS``) to say what moved.

``ShownPlanValues`` keeps the plans a leader showed as values (``Plan``, a training
request's ``FleetPlan``); ``ShownPlans`` keeps job plans as the documents training makes
of them. Both say what changed the same way (``diff_plans`` on the two plans' documents).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, Generic, TypeVar

from p2pswarm.errors import PlanChanged
from p2pswarm.planner import FleetPlan, Plan, diff_plans

SHOWN_PLANS = 64  # plans a leader remembers, to say what changed when a pin is refused

P = TypeVar("P")


class _Shown(Generic[P]):
    """The newest ``keep`` plans a leader showed, by ``plan_id``."""

    def __init__(self, leader_name: str, keep: int = SHOWN_PLANS) -> None:
        self.leader_name = leader_name
        self.keep = keep
        self._plans: OrderedDict[str, P] = OrderedDict()

    # what a kind of plan says of itself
    def _plan_id(self, plan: P) -> str | None:
        raise NotImplementedError

    def _doc(self, plan: P) -> Mapping[str, Any]:
        raise NotImplementedError

    def _replicas(self, plan: P) -> int:
        raise NotImplementedError

    def remember(self, plan: P) -> P:
        """Keep ``plan`` (newest last); return it unchanged."""
        plan_id = self._plan_id(plan)
        if plan_id is not None:
            self._plans[plan_id] = plan
            self._plans.move_to_end(plan_id)
            while len(self._plans) > self.keep:
                self._plans.popitem(last=False)
        return plan

    def get(self, plan_id: str) -> P | None:
        return self._plans.get(plan_id)

    def plan_ids(self) -> list[str]:
        """The remembered plans' ids, oldest first."""
        return list(self._plans)

    def changes(self, expected: str, plan: P) -> list[str]:
        """What differs between the shown plan ``expected`` and ``plan``, in words."""
        return self._changes(expected, self._doc(plan), self._replicas(plan))

    def _changes(self, expected: str, doc: Mapping[str, Any], now: int) -> list[str]:
        """``changes`` for a plan's document ``doc`` of ``now`` replicas."""
        old = self._plans.get(expected)
        if old is None:
            return [f"plan {expected} is not one the leader ({self.leader_name}) has shown; "
                    "the swarm has changed since, or it was made under another leader"]
        changes = list(diff_plans(self._doc(old), doc))
        then = self._replicas(old)
        if then != now:
            changes.append(f"{then} replicas then, {now} now")
        return changes or ["the placement differs"]

    def check_pin(self, expected: str | None, plan: P) -> None:
        """Remember ``plan``; refuse as PlanChanged when a pin ``expected`` is not it."""
        plan_id = str(self._plan_id(plan))
        changes = self.changes(expected, plan) if expected and plan_id != expected else []
        self.remember(plan)
        if changes:
            raise PlanChanged(str(expected), plan_id, changes, self._doc(plan))


class ShownPlanValues(_Shown[Plan | FleetPlan]):
    """The plans a leader showed, as values."""

    def _plan_id(self, plan: Plan | FleetPlan) -> str:
        return plan.plan_id

    def _doc(self, plan: Plan | FleetPlan) -> dict[str, Any]:
        return plan.to_dict()

    def _replicas(self, plan: Plan | FleetPlan) -> int:
        return len(plan.replicas) if isinstance(plan, FleetPlan) else 0

    def check_pin(self, expected: str | None, plan: Plan | FleetPlan | Mapping[str, Any]
                  ) -> None:
        """``_Shown.check_pin``; a plan's document (the form ``Planning.pinned_plan``
        gives) is read back into its value first. A fleet plan's document has none: it
        is checked against the plan shown, not remembered."""
        if isinstance(plan, (Plan, FleetPlan)):
            return super().check_pin(expected, plan)
        replicas = plan.get("replicas")
        if replicas is None:
            return super().check_pin(expected, Plan.from_doc(plan))
        plan_id = str(plan.get("plan_id"))
        if expected and plan_id != expected:
            raise PlanChanged(expected, plan_id, self._changes(expected, plan, len(replicas)),
                              plan)
        return None


class ShownPlans(_Shown[dict[str, Any]]):
    """The job plans a leader showed, as the documents training makes of them."""

    def _plan_id(self, plan: dict[str, Any]) -> str | None:
        plan_id = plan.get("plan_id") if isinstance(plan, dict) else None
        return plan_id if isinstance(plan_id, str) else None

    def _doc(self, plan: dict[str, Any]) -> dict[str, Any]:
        return plan

    def _replicas(self, plan: dict[str, Any]) -> int:
        return len(plan.get("replicas", []))

    def remember(self, plan: Any) -> Any:
        """Keep ``plan`` when it is a plan document (newest last); return it unchanged."""
        return super().remember(plan)


__all__ = ["SHOWN_PLANS", "ShownPlanValues", "ShownPlans"]
