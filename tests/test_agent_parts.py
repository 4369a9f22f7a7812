"""The agent's small parts on their own: loop lag, goodbye, rejoin, what a fellow says."""

from __future__ import annotations

import random

from p2pswarm.agent.alarm import LoopLag
from p2pswarm.agent.fellow_meta import FellowSays
from p2pswarm.agent.leaving import Goodbye, Leaving
from p2pswarm.agent.rejoin import JOIN_REFUSALS, Rejoin
from p2pswarm.cards import Card
from p2pswarm.errors import TokenRefused


def test_loop_lag_keeps_the_most_and_counts_late_rings() -> None:
    lag = LoopLag().noted(0.05).noted(0.4).noted(1.2345).noted(0.2)
    assert lag == LoopLag(max_s=1.234, over_0_1_s=3, over_1_s=1)
    assert lag.to_dict() == {"max_s": 1.234, "over_0_1_s": 3, "over_1_s": 1}


def test_a_goodbye_reads_as_the_leave_op_answers() -> None:
    assert Goodbye(2, 3, False).to_dict() == {"acknowledged": 2, "fellows": 3,
                                              "spread": False}


def test_a_leave_begins_once() -> None:
    leaving = Leaving()
    assert leaving.begin(1.0, 5.0) and leaving.left
    assert not leaving.begin(2.0, 5.0)


def test_rejoin_calls_lost_fellows_and_seeds_only_when_alone() -> None:
    rejoin = Rejoin("me", ("seed:1",), random.Random(1))
    assert rejoin.pick({b"me", b"b"}) is None  # nothing lost, not alone
    assert rejoin.pick({b"me"}) == "seed:1"
    rejoin.lost(b"b", "b:1")
    assert rejoin.pick({b"me", b"c"}) == "b:1"
    assert rejoin.pick({b"me", b"b", b"c"}) is None  # it is back: forgotten


def test_rejoin_counts_only_seeds_refusing_before_we_are_in() -> None:
    rejoin = Rejoin("me", ("seed:1",), random.Random(1))
    assert rejoin.refused("other:1", joined=False) is None
    assert rejoin.refused("seed:1", joined=True) is None
    outcomes = [rejoin.refused("seed:1", joined=False) for _ in range(JOIN_REFUSALS)]
    assert outcomes[:-1] == [None] * (JOIN_REFUSALS - 1)
    assert isinstance(outcomes[-1], TokenRefused) and rejoin.refusals == JOIN_REFUSALS
    rejoin.let_in()
    assert rejoin.refused("seed:1", joined=False) is None and rejoin.refusals == 1


def test_what_a_fellow_says_from_its_cleaned_metadata() -> None:
    assert FellowSays.of({}) == FellowSays()
    card = {"kind": "cpu", "index": 0, "name": "CPU", "uuid": "", "total_bytes": 8 << 30,
            "free_bytes": 4 << 30, "held_by_others": []}
    stage = {"plan_id": "0123456789abcdef", "stage": 0, "layers": [0, 4],
             "model": {"kind": "builtin", "key": "k1"}, "runtime": {}}
    checked = FellowSays.from_doc({"cards": [card], "training": True, "stages": [stage]})
    meta, dropped = checked.to_doc(), checked.dropped
    says = FellowSays.of(meta)
    assert dropped == 0 and says.training and says.inventory.cards[0].total_bytes == 8 << 30
    assert says.serves_model("k1") and not says.serves_model("k2")
    assert says.inventory.to_dict()["cards"] == meta["cards"]  # the gossip form, exactly


def test_what_a_fellow_says_round_trips_through_its_gossip_form() -> None:
    hop = {"stage": 0, "fellow_id": "ab" * 16, "fellow": "f", "addr": "h:1",
           "layers": [0, 4], "card": "cpu:0", "claim_bytes": 3}
    stage = {"plan_id": "0123456789abcdef", "stage": 0, "layers": [0, 4], "n_stages": 1,
             "model": {"kind": "builtin", "key": "k1"}, "runtime": {"max_sessions": 2},
             "card": "cpu:0", "allocated_bytes": 5, "adapter": {"rank": 4}, "route": [hop]}
    cpu = {"kind": "cpu", "index": 0, "name": "CPU", "uuid": "", "total_bytes": 8,
           "free_bytes": 4, "held_by_others": []}
    gpu = {**cpu, "kind": "cuda", "name": "GPU"}
    doc = {"cards": [cpu, gpu], "kept_loads": ["fedcba9876543210"], "note": [1],
           "stages": [stage], "training": False}
    says = FellowSays.from_doc(doc)
    assert says.dropped == 0 and says.to_doc() == doc and list(says.to_doc()) == list(doc)
    assert FellowSays.from_doc(says.to_doc()) == says
    assert [c.kind for c in says.inventory.cards] == ["cuda", "cpu"]  # canonical order
    said = says.stages[0]
    assert said.layers == (0, 4) and said.route is not None and said.route[0].claim_bytes == 3
    assert said.route[0].allocated_bytes is None and says.kept_loads == ("fedcba9876543210",)


def test_a_fellows_card_and_stage_model_are_read_as_values() -> None:
    card = {"kind": "cuda", "index": 1, "name": "GPU", "uuid": "u", "total_bytes": 8 << 30,
            "free_bytes": 2 << 30, "memory_source": "nvml",
            "held_by_others": [{"pid": 7, "name": "a", "bytes": 1 << 20},
                               {"pid": 3, "name": "b", "bytes": 5 << 20}]}
    stage = {"plan_id": "0123456789abcdef", "stage": 0, "layers": [0, 4],
             "model": {"kind": "builtin", "key": "k1", "name": "tiny"}, "runtime": {}}
    says = FellowSays.from_doc({"cards": [card], "stages": [stage, {**stage, "model": {}}]})
    assert says.dropped == 0 and says.cards == (Card.from_dict(card),)
    assert [h.pid for h in says.cards[0].held_by_others] == [3, 7]  # the largest first
    first, second = says.stages
    assert (first.model.kind, first.model.key) == ("builtin", "k1")
    assert (second.model.kind, second.model.key) == ("builtin", None)
    assert first.to_doc()["model"] == stage["model"] and says.plan_ids == {stage["plan_id"]}
    unknown = FellowSays.from_doc({"stages": [{**stage, "model": {"kind": "hub"}}]})
    assert unknown.dropped == 1 and unknown.stages == ()
