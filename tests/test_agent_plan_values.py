"""The leader plans on values: a plan message read once (``PlanQuery``), plans kept as
values (``ShownPlanValues``), adapted as values; their documents stay what they were."""

from __future__ import annotations

import pytest

from p2pswarm.agent.adapter import adapted, adapted_plan
from p2pswarm.agent.pins import ShownPlans, ShownPlanValues
from p2pswarm.agent.plan_query import PlanQuery
from p2pswarm.errors import ConfigError, PlanChanged
from p2pswarm.planner import Pin, Plan, pin_from_plan
from tests.planner_cases import MID, MID_CONFIG, card, cluster, fellow, make

SHA = "ab" * 32


def two_cards(second: str = "f1") -> Plan:
    return make(MID, cluster(fellow("f0", card(0, free=3.0, total=4.0)),
                             fellow(second, card(0, free=3.0, total=4.0))),
                context=2048, stages=2)


def test_a_plan_document_round_trips_through_its_value() -> None:
    for plan in (two_cards(), make(MID, cluster(fellow("f0", card(0, free=3.0))),
                                   kind="train", seq_len=512)):
        doc = plan.to_dict()
        assert Plan.from_doc(doc).to_dict() == doc


def test_a_plan_query_reads_the_message_once() -> None:
    query = PlanQuery.from_doc({"model": {"name": "mid", "config": MID_CONFIG},
                                "context": 2048, "adapter": SHA})
    assert query.profile.name == "mid" and query.request.context == 2048
    assert query.fleet is None and query.adapter == SHA
    fleet = PlanQuery.from_doc({"model": {"name": "mid", "config": MID_CONFIG},
                                "kind": "train", "replicas": 2})
    assert fleet.fleet is not None and fleet.fleet.replicas == 2 and not fleet.adapter
    with pytest.raises(ConfigError):
        PlanQuery.from_doc({"context": 2048})


def test_an_adapted_plan_is_the_adapted_document() -> None:
    plan = two_cards()
    assert adapted(plan, SHA).to_dict() == adapted_plan(plan.to_dict(), SHA)
    assert adapted(plan, "") is plan
    with pytest.raises(ConfigError):
        adapted(plan, "not a hash")


def test_a_pin_of_a_plan_is_the_pin_of_its_document() -> None:
    plan = two_cards()
    assert Pin.of(plan) == pin_from_plan(plan.to_dict())


def test_shown_values_and_shown_documents_say_the_same_changes() -> None:
    old, new = two_cards(), two_cards("f2")
    assert old.plan_id != new.plan_id
    values, docs = ShownPlanValues("leader"), ShownPlans("leader")
    values.remember(old)
    docs.remember(old.to_dict())
    assert values.get(old.plan_id) == old and values.plan_ids() == [old.plan_id]
    assert values.changes(old.plan_id, new) == docs.changes(old.plan_id, new.to_dict())
    # a pin checked on a plan's document (``Planning.pinned_plan``'s form) as on its value
    with pytest.raises(PlanChanged) as refused:
        values.check_pin(old.plan_id, new.to_dict())
    assert refused.value.new_plan == new.to_dict()
    assert values.plan_ids() == [old.plan_id, new.plan_id]
    values.check_pin(new.plan_id, new)
    assert values.changes("0" * 16, new)[0].startswith("plan 0000000000000000 is not one")
