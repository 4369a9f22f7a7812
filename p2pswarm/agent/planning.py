"""The agent's planning ops: `plan` (answered by the leader on its view) and `cluster`.

The cluster view is built from membership: every fellow that has not left, with the
cards and benchmarks it gossiped about itself; a dead or unreachable one stays in the
view as "not connected", so the plan can say why its cards are left out.

The leader reads a plan message once (``PlanQuery``) and plans on values: a ``Plan``
(or a training request's ``FleetPlan``); the plan's document is made where it leaves
the leader (``PlanShown``, the control API) or is remembered (``ShownPlans``).

A start pinned to a ``plan_id`` (``pinned``) gets the leader's plan now; when that
came out different, the plan this leader showed under that id is checked again on the
current view, and while each of its cards still holds its stage's claims (memory moved
within the plan's own headroom, or a tie between equal cards fell the other way) the pin
holds and starts exactly as shown.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from p2pswarm.agent.adapter import adapted
from p2pswarm.agent.pins import ShownPlanValues
from p2pswarm.agent.plan_budget import PlanBudget
from p2pswarm.agent.plan_query import PlanQuery
from p2pswarm.control.requests import typed_op
from p2pswarm.errors import ConfigError, PlacementError
from p2pswarm.planner import (
    ClusterView,
    FleetPlan,
    Pin,
    Plan,
    cluster_to_dict,
    cluster_view,
    fellow_view,
    plan,
    plan_fleet,
    plan_pinned,
)
from p2pswarm.wire.control import ClusterRequest
from p2pswarm.wire.orders import PlanAsk, PlanShown, pack_doc, unpack_doc

if TYPE_CHECKING:
    from p2pswarm.agent.leadership import Leadership
    from p2pswarm.agent.ports import PlanningPort


log = logging.getLogger("p2pswarm.agent")


def plan_ask(request: dict[str, Any]) -> PlanAsk:
    """The plan op's request from a plain map: ``{"request": plan message}``."""
    message = request.get("request")
    if not isinstance(message, dict):
        raise ConfigError("a plan op needs a \"request\" map")
    return PlanAsk(pack_doc(message))


def fellow_id(node_id: bytes) -> str:
    """How plans name a fellow: its node id in hex."""
    return node_id.hex()


class Planning:
    def __init__(self, agent: PlanningPort, leadership: Leadership) -> None:
        self.agent = agent
        self.leadership = leadership
        # the plan op's request is the ask it forwards to the leader
        agent.control_ops["plan"] = typed_op(PlanAsk, plan_ask, self._op_plan)
        agent.control_ops["cluster"] = typed_op(ClusterRequest, lambda _: ClusterRequest(),
                                                self._op_cluster)
        self.shown = ShownPlanValues(agent.name)  # the plans this leader has shown
        tuning = agent.config.compute
        self.budget = PlanBudget(agent.compute, agent.counters, budget_s=tuning.plan_budget_s,
                                 at_once=tuning.plans_at_once)
        leadership.serve_from(PlanAsk, self._leader_plan)

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

    def planned(self, query: PlanQuery, view: ClusterView | None = None) -> Plan | FleetPlan:
        """Plan ``query`` on ``view`` (None: this agent's current view; the leader runs
        this): a single plan with the adapter it names in it and in its ``plan_id``, or a
        fleet plan. Pure given ``view``: a thread may run it."""
        view = self.view() if view is None else view
        if query.fleet is not None:
            if query.adapter:
                raise ConfigError("an adapter is served on its base (`load --adapter`); a "
                                  "training fleet's plan takes none")
            return plan_fleet(query.profile, view, query.request, query.fleet)
        return adapted(plan(query.profile, view, query.request), query.adapter)

    async def plan(self, message: dict[str, Any]) -> dict[str, Any]:
        """``planned`` for a plan message (a job's), as the plan's document, made off the
        loop within the plan budget."""
        view = self.view()
        # the leader's own plan: an asker of its own (never refused as busy), in the budget
        made = await self.budget.run(object(), lambda: self.planned(
            PlanQuery.from_doc(message), view), "a training job")
        return made.to_dict()

    async def pinned_off_loop(self, request: bytes,
                              expected: str | None) -> Plan | FleetPlan:
        """``pinned`` for a load's plan message (``request``: packed, as its ``LoadAsk``
        carries it), read and made off the loop within the plan budget (the view read
        here, on the loop)."""
        view = self.view()
        return await self.budget.run(object(), lambda: self.pinned(
            PlanQuery.from_doc(unpack_doc(request)), expected, view), "a load")

    def still_holds(self, query: PlanQuery, expected: str,
                    view: ClusterView | None = None) -> Plan | None:
        """The plan ``expected`` this leader showed, as it stands on ``view`` (None: its
        view now), when it still holds for ``query``; None when it was not shown here or
        no longer holds."""
        shown = self.shown.get(expected)
        if not isinstance(shown, Plan) or query.fleet is not None:
            return None  # a fleet's id is not a single plan's: it never holds as one
        pin = Pin.of(shown)
        if pin is None:
            return None
        held = plan_pinned(query.profile, self.view() if view is None else view,
                           query.request, pin)
        if held is None:
            return None
        held = adapted(held, query.adapter)
        return held if held.plan_id == expected else None

    def pinned(self, query: PlanQuery, expected: str | None,
               view: ClusterView | None = None) -> Plan | FleetPlan:
        """The plan a start pinned to ``expected`` (None: not pinned) gets: the plan now,
        or the shown one while it still holds. The caller checks the pin
        (``ShownPlanValues.check_pin``), which refuses any other plan with what changed."""
        view = self.view() if view is None else view  # one view for both: a thread may run it
        try:
            now = self.planned(query, view)
        except PlacementError as exc:
            held = self.still_holds(query, expected, view) if expected else None
            if held is not None:
                return held
            if not expected:
                raise
            raise PlacementError(f"plan {expected} no longer holds, and no plan does: "
                                 f"{exc}") from exc
        if expected and now.plan_id != expected:
            return self.still_holds(query, expected, view) or now
        return now

    async def _leader_plan(self, call: PlanAsk, asker: bytes | None) -> PlanShown:
        """A plan for a fellow (or this agent's own user): the view is read here, on the
        loop; the message is read and the plan made off it, within the plan budget."""
        view = self.view()
        member = self.agent.fellow(asker.hex()) if asker is not None else None
        who = "this fellow's user" if asker is None else (
            member.name if member is not None else asker.hex()[:8])
        try:
            made = await self.budget.run(
                asker, lambda: self.planned(PlanQuery.from_doc(unpack_doc(call.request)),
                                            view), who)
        except ConfigError as exc:  # a request past the planner's bounds, say: counted
            self.agent.counters.refuse("plan-request")
            log.info("refused a plan for %s: %s", who, str(exc)[:300])
            raise
        shown = self.shown.remember(made)
        return PlanShown(pack_doc(shown.to_dict()))

    async def ask_plan(self, message: dict[str, Any]) -> dict[str, Any]:
        """The plan the leader makes for ``message`` (here, if this agent leads)."""
        return await self._op_plan(PlanAsk(pack_doc(message)))

    async def _op_plan(self, ask: PlanAsk) -> dict[str, Any]:
        """The leader's plan for ``ask``, as its document (what the CLI shows)."""
        reply = await self.leadership.ask(ask, PlanShown)
        return unpack_doc(reply.plan)

    async def _op_cluster(self, request: ClusterRequest) -> Any:
        return cluster_to_dict(self.view())
