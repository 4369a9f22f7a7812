"""The agent's planning ops: `plan` (answered by the leader on its view) and `cluster`.

The cluster view is built from membership: every fellow that has not left, with the
cards and benchmarks it gossiped about itself; a dead or unreachable one stays in the
view as "not connected", so the plan can say why its cards are left out.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from p2pswarm.agent.adapter import adapted_plan
from p2pswarm.agent.pins import ShownPlans
from p2pswarm.cards import benchmarks_from_dict
from p2pswarm.errors import ConfigError
from p2pswarm.planner import ClusterView, cluster_to_dict, cluster_view, fellow_view
from p2pswarm.planner import plan_message
from p2pswarm.wire.orders import PlanAsk, PlanShown, pack_doc, unpack_doc

if TYPE_CHECKING:
    from p2pswarm.agent.agent import Agent
    from p2pswarm.agent.leadership import Leadership


def fellow_id(node_id: bytes) -> str:
    """How plans name a fellow: its node id in hex."""
    return node_id.hex()


class Planning:
    def __init__(self, agent: Agent, leadership: Leadership) -> None:
        self.agent = agent
        self.leadership = leadership
        agent.control_ops["plan"] = self._op_plan
        agent.control_ops["cluster"] = self._op_cluster
        self.shown = ShownPlans(agent.name)  # serving plans this leader has shown
        leadership.serve(PlanAsk, self._leader_plan)

    def view(self) -> ClusterView:
        """The swarm as this agent sees it now, in the planner's terms."""
        fellows = []
        membership = self.agent.membership
        for member in membership.members() if membership is not None else ():
            if member.state == "left":
                continue
            meta = self.agent.member_metadata(member)
            fellows.append(fellow_view(
                fellow_id(member.node_id), member.name, {"cards": meta.get("cards", [])},
                benchmarks_from_dict(meta.get("benchmarks", {})),
                connected=member.state in ("alive", "suspect"),
                training=bool(meta.get("training", False))))
        return cluster_view(fellows)

    async def plan(self, message: dict[str, Any]) -> dict[str, Any]:
        """Plan on this agent's current view (the leader runs this), with the adapter
        the request names in the plan and its ``plan_id``."""
        return adapted_plan(plan_message(message, self.view()),  # type: ignore[no-any-return]
                            message.get("adapter"))

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
