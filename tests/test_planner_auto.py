"""``--weights-dtype auto``: each stage keeps f16 where its card holds it, else int8, then
int4; an explicit dtype wins; the plan_id covers the choice; the speed model weighs a
quantised stage by the card's measured dtype speeds."""

from __future__ import annotations

import copy
import json
import random
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from p2pswarm.errors import ConfigError
from p2pswarm.models.files import load_profile
from p2pswarm.planner import Plan, cluster_from_dict, pin_from_plan
from p2pswarm.planner.costs import UNMEASURED_QUANT_FACTOR, CostModel
from p2pswarm.planner.plan import plan_pinned
from p2pswarm.planner.request import request_from_dict, resolve
from tests.planner_cases import card, cluster, fellow, make
from tests.test_planner import assert_round_trip, check_invariants

CLUSTERS = Path(__file__).resolve().parent.parent / "simulations" / "clusters"
LLAMA3 = load_profile("llama-3-8b")
REASON = re.compile(r"(int8|int4): f16 needs \d+\.\d GB(, int8 \d+\.\d GB)?, "
                    r"this card has \d+\.\d GB free")


def pis() -> dict[str, Any]:
    data: dict[str, Any] = json.loads((CLUSTERS / "pis-4gb.json").read_text())
    return data


def home() -> dict[str, Any]:
    data: dict[str, Any] = json.loads((CLUSTERS / "home.json").read_text())
    return data


def dtypes(p: Plan) -> list[str]:
    return [s.weights_dtype for s in p.stages]


def test_four_4gb_pis_hold_llama_3_8b_with_auto_and_not_in_f16() -> None:
    assert not make(LLAMA3, pis(), weights_dtype="f16").fits
    p = make(LLAMA3, pis())
    check_invariants(p)
    assert_round_trip(p)
    assert p.fits and p.request.weights_dtype == "auto"
    assert len(p.stages) == 4 and all(c.segments.does_not_fit == 0 for c in p.cards)
    for s in p.stages:
        assert s.weights_dtype in ("f16", "int8", "int4")
        if s.weights_dtype == "f16":
            assert s.dtype_reason.startswith("f16: needs ")
        else:  # the reason names what f16 needed and what the card has free
            assert REASON.fullmatch(s.dtype_reason), s.dtype_reason
            assert "this card has 3.2 GB free" in s.dtype_reason
        dtype, quant = p.runtime(s.index)["dtype"], p.runtime(s.index)["quant"]
        assert (dtype, quant) == ("float16", s.weights_dtype if s.weights_dtype != "f16"
                                  else "none")
    assert any(d != "f16" for d in dtypes(p))
    assert "(auto)" in p.summary or "stages" in p.summary.split(")")[0]
    assert "Weights: stage " in p.summary
    doc = p.to_dict()
    assert [s["weights_dtype"] for s in doc["stages"]] == dtypes(p)
    assert [s["weights_dtype"] for s in doc["layout"]["strip"]] == dtypes(p)


def test_tighter_pis_take_int4() -> None:
    data = pis()
    for f in data["fellows"]:
        f["cards"][0]["free_bytes"] = 2_400_000_000
    assert not make(LLAMA3, data, weights_dtype="int8").fits
    p = make(LLAMA3, data)
    assert p.fits and "int4" in dtypes(p)
    assert all(REASON.fullmatch(s.dtype_reason) for s in p.stages if s.weights_dtype == "int4")
    assert any(", int8 " in s.dtype_reason for s in p.stages)


def test_a_fast_card_keeps_f16_while_slow_pis_take_int8() -> None:
    pi = [fellow(f"p{i}", card(0, kind="cpu", free=3.2, total=4, name="Pi 4", flops=None,
                               bw=None), name=f"pi{i}") for i in range(2)]
    data = cluster(fellow("g1", card(0, free=10, total=24, name="RTX 3090"), name="rig"), *pi)
    p = make(LLAMA3, data)
    assert p.fits
    by_fellow = {s.fellow: s.weights_dtype for s in p.stages}
    assert by_fellow["rig"] == "f16" and "int8" in by_fellow.values()


def test_home_cluster_keeps_f16_where_it_fits_and_lowers_only_what_must() -> None:
    p = make(LLAMA3, home())
    f16 = make(LLAMA3, home(), weights_dtype="f16")
    assert dtypes(p) == ["f16"] * len(p.stages)
    assert [(s.fellow_id, s.layers) for s in p.stages] == \
        [(s.fellow_id, s.layers) for s in f16.stages]
    assert "f16 weights" in p.summary and p.plan_id != f16.plan_id
    big = make(load_profile("llama-3-70b"), home(), exclude=["oldserver:cpu"])
    check_invariants(big)
    assert big.fits and not make(load_profile("llama-3-70b"), home(), exclude=["oldserver:cpu"],
                                 weights_dtype="f16").fits
    chosen = {s.name: s.weights_dtype for s in big.stages}
    assert chosen["RTX 3090"] == "f16" and "int8" in chosen.values()


@pytest.mark.parametrize("explicit", ["f16", "int8", "int4"])
def test_an_explicit_dtype_wins(explicit: str) -> None:
    p = make(LLAMA3, pis(), weights_dtype=explicit)
    assert dtypes(p) == [explicit] * len(p.stages)
    assert all(s.dtype_reason == f"{explicit}: asked for, on every stage" for s in p.stages)
    assert p.plan_id != make(LLAMA3, pis()).plan_id


def test_plan_id_changes_when_the_choice_does_and_is_deterministic() -> None:
    p = make(LLAMA3, pis())
    shuffled = pis()
    random.Random(3).shuffle(shuffled["fellows"])
    assert make(LLAMA3, shuffled).to_dict() == p.to_dict()
    roomy = pis()
    for f in roomy["fellows"]:
        f["cards"][0]["free_bytes"] = 2_400_000_000
    lower = make(LLAMA3, roomy)
    assert dtypes(lower) != dtypes(p) and lower.plan_id != p.plan_id


def test_a_pinned_auto_plan_holds_with_its_dtypes() -> None:
    p = make(LLAMA3, pis())
    pin = pin_from_plan(p.to_dict())
    assert pin is not None and [s.weights_dtype for s in pin.stages] == dtypes(p)
    again = plan_pinned(LLAMA3, cluster_from_dict(pis()), p.request, pin)
    assert again is not None and again.plan_id == p.plan_id
    bad = copy.deepcopy(p.to_dict())
    bad["stages"][0]["weights_dtype"] = "f32"
    wrong = pin_from_plan(bad)
    assert wrong is not None
    assert plan_pinned(LLAMA3, cluster_from_dict(pis()), p.request, wrong) is None


def test_auto_is_the_default_to_serve_and_bf16_to_train() -> None:
    assert resolve(request_from_dict({}), LLAMA3).weights_dtype == "auto"
    assert resolve(request_from_dict({"weights_dtype": "auto"}), LLAMA3).weights_dtype == "auto"
    assert resolve(request_from_dict({"kind": "train", "weights_dtype": "auto"}),
                   LLAMA3).weights_dtype == "bf16"
    with pytest.raises(ConfigError, match="--weights-dtype 'q3' is not known: use one of auto"):
        request_from_dict({"weights_dtype": "q3"})


def test_a_quantised_stage_runs_at_its_measured_speed_or_the_stated_factor() -> None:
    view = cluster_from_dict(cluster(fellow("a", card(0, kind="cpu", free=30, total=32))))
    cpu = view.fellows[0].cards[0]
    r = resolve(request_from_dict({}), LLAMA3)
    f16 = CostModel(LLAMA3, r, 4096)
    int8 = f16.with_dtype("int8")
    assert int8.stage_time_s(cpu, 4, False) == pytest.approx(
        UNMEASURED_QUANT_FACTOR * f16.stage_time_s(cpu, 4, False))
    measured = cluster_from_dict(cluster(fellow("a", {
        **card(0, kind="cpu", free=30, total=32),
        "dtype_tokens_per_s": {"f16": 100.0, "int8": 250.0, "int4": 50}})))
    fast = measured.fellows[0].cards[0]
    assert fast.dtype_tokens_per_s == (("f16", 100.0), ("int8", 250.0), ("int4", 50.0))
    assert int8.stage_time_s(fast, 4, False) == pytest.approx(
        f16.stage_time_s(fast, 4, False) * 100 / 250)
    assert f16.with_dtype("int4").stage_time_s(fast, 4, False) == pytest.approx(
        f16.stage_time_s(fast, 4, False) * 2)


@pytest.mark.parametrize("rates", [{"f16": -1}, {"q3": 5.0}, {"f16": "fast"}, [1, 2],
                                   {"f16": float("nan")}, {"f16": 1e300}, {"f16": True}])
def test_bad_dtype_speeds_are_refused(rates: Any) -> None:
    with pytest.raises(ConfigError, match="dtype_tokens_per_s"):
        cluster_from_dict(cluster(fellow("a", {**card(0, kind="cpu"),
                                               "dtype_tokens_per_s": rates})))


def test_each_stage_order_carries_its_own_dtype_and_kept_orders_accept_them() -> None:
    from p2pswarm.agent.serving.adoption import kept_orders
    from p2pswarm.agent.serving.leader_load import LoadAsked
    from p2pswarm.agent.serving.loads import stage_orders
    from p2pswarm.wire.loads import RouteHop

    pi = [fellow(f"{i:02x}" * 8, card(0, kind="cpu", free=3.2, total=4, name="Pi 4",
                                      flops=None, bw=None), name=f"pi{i}") for i in range(2)]
    data = cluster(fellow("ff" * 8, card(0, free=10, total=24, name="RTX 3090"), name="rig"),
                   *pi)
    p = Plan.from_doc(make(LLAMA3, data).to_dict())
    orders = stage_orders(p, LoadAsked({}, {"kind": "builtin", "name": "x"}), "", "")
    quants = [o.runtime.quant for o in orders]
    assert quants == [d if d != "f16" else "none" for d in dtypes(p)]
    assert len(set(quants)) > 1 and {o.runtime.dtype for o in orders} == {"float16"}
    assert [o.spec().quant for o in orders] == quants
    route = tuple(RouteHop(o.stage, o.fellow_id, f"f{o.stage}", "127.0.0.1:1", o.layers[0],
                           o.layers[1], "card", o.claim_bytes, 0, 0, 0.0) for o in orders)
    kept = kept_orders(p.plan_id, route, tuple(o.to_wire() for o in orders))
    assert [o.runtime for o in kept] == [o.runtime for o in orders]
    other = replace(orders[1].runtime, kv_dtype="float32")
    with pytest.raises(ConfigError, match="does not follow"):
        kept_orders(p.plan_id, route, (orders[0].to_wire(),
                                       replace(orders[1], runtime=other).to_wire(),
                                       *(o.to_wire() for o in orders[2:])))


def test_a_changed_choice_is_named_when_a_pinned_plan_is_refused() -> None:
    from p2pswarm.planner import diff_plans

    before = make(LLAMA3, pis())
    tighter = pis()
    for f in tighter["fellows"]:
        f["cards"][0]["free_bytes"] = 2_400_000_000
    after = make(LLAMA3, tighter)
    lines = diff_plans(before.to_dict(), after.to_dict())
    assert any(re.fullmatch(r"pi4-\d's CPU \(Raspberry Pi 4 Model B \(4 GB\)\) now takes "
                            r"int4 weights, it took int8 \(int4: f16 needs .*\)", line)
               for line in lines), lines
