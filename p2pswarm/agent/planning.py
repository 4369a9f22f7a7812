"""The agent's planning ops: `plan` (answered by the leader on its view) and `cluster`.

The cluster view is built from membership: every fellow that has not left, with the
cards and benchmarks it gossiped about itself; a dead or unreachable one stays in the
view as "not connected", so the plan can say why its cards are left out.

A start pinned to a ``plan_id`` (``pinned_plan``) gets the leader's plan now; when that
came out different, the plan this leader showed under that id is checked again on the
current view, and while each of its cards still holds its stage's claims (memory moved
within the plan's own headroom, or a tie between equal cards fell the other way) the pin
holds and starts exactly as shown.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from p2pswarm.agent.adapter import adapted_plan
from p2pswarm.agent.pins import ShownPlans
from p2pswarm.errors import ConfigError, PlacementError
from p2pswarm.planner import (
    ClusterView,
    cluster_to_dict,
    cluster_view,
    fellow_view,
    pinned_plan_message,
    plan_message,
)
from p2pswarm.wire.orders import PlanAsk, PlanShown, pack_doc, unpack_doc

if TYPE_CHECKING:
    from p2pswarm.agent.leadership import Leadership
    from p2pswarm.agent.ports import PlanningPort


def fellow_id(node_id: bytes) -> str:
    """How plans name a fellow: its node id in hex."""
    return node_id.hex()


class Planning:
    def __init__(self, agent: PlanningPort, leadership: Leadership) -> None:
        self.agent = agent
        self.leadership = leadership
        agent.control_ops["plan"] = self._op_plan
        agent.control_ops["cluster"] = self._op_cluster
        self.shown = ShownPlans(agent.name)  # serving plans this leader has shown
        leadership.serve(PlanAsk, self._leader_plan)

    def view(self) -> ClusterView:
        """The swarm as this agent sees it now, in the planner's terms."""
        fellows = []
        for member in self.agent.members():
            if member.state == "left":
                continue
            said = self.agent.fellow_says(member)
            fellows.append(fellow_view(fellow_id(member.node_id), member.name, said.inventory,
                                       said.benchmarks, connected=member.present,
                                       training=said.training))
        return cluster_view(fellows)

    async def plan(self, message: dict[str, Any]) -> dict[str, Any]:
        """Plan on this agent's current view (the leader runs this), with the adapter
        the request names in the plan and its ``plan_id``."""
        return adapted_plan(plan_message(message, self.view()),  # type: ignore[no-any-return]
                            message.get("adapter"))

    def still_holds(self, message: dict[str, Any], expected: str) -> dict[str, Any] | None:
        """The plan ``expected`` this leader showed, as it stands on its view now, when it
        still holds for ``message``; None when it was not shown here or no longer holds."""
        shown = self.shown.get(expected)
        if shown is None:
            return None
        plan = adapted_plan(pinned_plan_message(message, self.view(), shown),
                            message.get("adapter"))
        return plan if isinstance(plan, dict) and plan.get("plan_id") == expected else None

    async def pinned_plan(self, message: dict[str, Any], expected: str | None
                          ) -> dict[str, Any]:
        """The plan a start pinned to ``expected`` (None: not pinned) gets: the plan now,
        or the shown one while it still holds. The caller checks the pin
        (``ShownPlans.check_pin``), which refuses any other plan with what changed."""
        try:
            plan = await self.plan(message)
        except PlacementError as exc:
            held = self.still_holds(message, expected) if expected else None
            if held is not None:
                return held
            if not expected:
                raise
            raise PlacementError(f"plan {expected} no longer holds, and no plan does: "
                                 f"{exc}") from exc
        if expected and plan["plan_id"] != expected:
            return self.still_holds(message, expected) or plan
        return plan

    async def _leader_plan(self, call: PlanAsk) -> PlanShown:
        plan = self.shown.remember(await self.plan(unpack_doc(call.request)))
        return PlanShown(pack_doc(plan))

    async def ask_plan(self, message: dict[str, Any]) -> dict[str, Any]:
        """The plan the leader makes for ``message`` (here, if this agent leads)."""
        reply = await self.leadership.ask(PlanAsk(pack_doc(message)), PlanShown)
        return unpack_doc(reply.plan)

    async def _op_plan(self, request: dict[str, Any]) -> Any:
        message = request.get("request")
        if not isinstance(message, dict):
            raise ConfigError("a plan op needs a \"request\" map")
        return await self.ask_plan(message)

    async def _op_cluster(self, request: dict[str, Any]) -> Any:
        return cluster_to_dict(self.view())
