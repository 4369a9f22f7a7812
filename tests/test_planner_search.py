"""The searches against brute force: maximize speed is the exact optimum of the cost
model, maximize context the exact maximum; proportional splits; diffs in words."""

from __future__ import annotations

import copy
import random
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pswarm.planner import cluster_from_dict, diff_plans, diff_views, request_from_dict
from p2pswarm.planner.costs import CostModel
from p2pswarm.planner.exhaustive import every_placement, fastest_exhaustive, most_tokens_exhaustive
from p2pswarm.planner.placement import (
    Search,
    Slot,
    most_tokens,
    pipeline_order,
    split_in_proportion,
)
from p2pswarm.planner.profile import profile_from_config
from p2pswarm.planner.request import resolve
from tests.planner_cases import GB, MB, MID, card, cluster, fellow, make, random_cluster, reference


def searches_for(data: dict[str, Any], request: dict[str, Any], layers: int, seed: int):
    rng = random.Random(seed)
    config = {"model_type": "llama", "vocab_size": rng.choice([259, 32000]),
              "hidden_size": rng.choice([512, 1024]), "intermediate_size": rng.choice([1408, 2816]),
              "num_hidden_layers": layers, "num_attention_heads": 8,
              "num_key_value_heads": rng.choice([2, 4, 8]), "max_position_embeddings": 4096,
              "tie_word_embeddings": rng.random() < 0.5}
    profile = profile_from_config(config, "r")
    view = cluster_from_dict(data)
    r = resolve(request_from_dict(request), profile)
    slots = pipeline_order([Slot(f.id, c) for f in view.fellows for c in f.cards])
    pairs = {x for (a, b), _ in view.links for x in (a, b)}

    def at(tokens: int) -> Search:
        return Search(CostModel(profile, replace(r, context=tokens), tokens), slots, view.link,
                      lambda f: f in pairs)
    return r, profile, at


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32), st.integers(1, 5), st.integers(2, 10))
def test_maximize_speed_equals_the_exhaustive_optimum(seed: int, n_cards: int,
                                                      layers: int) -> None:
    rng = random.Random(seed)
    data = random_cluster(rng, n_cards)
    request = {"context": rng.choice([256, 1024, 4096]), "sequences": rng.randint(1, 16),
               "weights_dtype": rng.choice(["f32", "f16", "int8", "int4"]),
               "kv_dtype": rng.choice(["f32", "f16", "int8"])}
    if rng.random() < 0.3:
        request["stages"] = rng.randint(1, min(n_cards, layers))
    r, _, at = searches_for(data, request, layers, seed)
    search = at(r.context)
    found = search.fastest(r.stages)
    best = fastest_exhaustive(search, r.stages)
    assert (found is None) == (best is None)
    if found is not None and best is not None:
        placement, cost = found
        assert search.fits(placement)
        assert cost == search.time_s(placement)
        assert cost <= best * (1 + 1e-12)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32), st.integers(1, 5), st.integers(2, 10))
def test_maximize_context_equals_the_exhaustive_maximum(seed: int, n_cards: int,
                                                        layers: int) -> None:
    rng = random.Random(seed)
    data = random_cluster(rng, n_cards)
    request = {"sequences": rng.randint(1, 64), "kv_dtype": rng.choice(["f32", "f16", "int8"]),
               "weights_dtype": rng.choice(["f32", "f16", "int4"])}
    stages = rng.randint(1, min(n_cards, layers)) if rng.random() < 0.3 else None
    _, profile, at = searches_for(data, request, layers, seed)
    got = most_tokens(lambda t: at(t).holding(stages) is not None, profile.max_context, 256)
    assert got == most_tokens_exhaustive(at, profile.max_context, 256, stages)
    if got:
        held = at(got).holding(stages)
        assert held is not None and at(got).fits(held)
        assert stages is None or len(held) == stages


def test_every_placement_counts_compositions() -> None:
    # 3 slots, 4 layers: choose k slots in order and a composition of 4 into k parts
    assert sum(1 for _ in every_placement(3, 4)) == 3 * 1 + 3 * 3 + 1 * 3
    assert all(len(p) == 2 for p in every_placement(3, 4, stages=2))


@given(st.integers(1, 40), st.lists(st.integers(0, 10**9), min_size=1, max_size=8),
       st.lists(st.integers(1, 40), min_size=8, max_size=8))
def test_split_in_proportion(total: int, weights: list[int], caps: list[int]) -> None:
    caps = caps[:len(weights)]
    parts = split_in_proportion(total, weights, caps)
    if len(weights) > total or sum(min(c, total) for c in caps) < total:
        assert parts is None
        return
    assert parts is not None and sum(parts) == total
    assert all(1 <= p <= c for p, c in zip(parts, caps))


def test_split_in_proportion_is_proportional_without_caps() -> None:
    assert split_in_proportion(10, [3, 1, 1], [10, 10, 10]) == [6, 2, 2]
    assert split_in_proportion(9, [1, 1, 1], [10, 10, 10]) == [3, 3, 3]
    assert split_in_proportion(10, [1, 1], [3, 10]) == [3, 7]


def test_pipeline_order_puts_the_fastest_fellow_last() -> None:
    view = cluster_from_dict(reference())
    slots = pipeline_order([Slot(f.id, c) for f in view.fellows for c in f.cards])
    names = {f.id: f.name for f in view.fellows}
    assert names[slots[-1].fellow_id] == "rig" and slots[-1].card.kind == "cuda"
    order = [names[s.fellow_id] for s in slots]
    assert order.index("fxserver") < order.index("rig")


# --- what changed -----------------------------------------------------------------------------

def test_diff_views_in_words() -> None:
    old_data = cluster(fellow("a", card(0, free=3.9, total=4.3, name="GTX 1050 Ti"),
                              name="fxserver"),
                       fellow("b", card(0, kind="cpu", free=8, total=16), name="laptop-2"),
                       fellow("c", card(0, free=20, total=24, name="RTX 3090"), name="rig"))
    new_data = copy.deepcopy(old_data)
    new_data["fellows"][0]["cards"][0]["free_bytes"] = int(2.1 * GB)
    del new_data["fellows"][1]
    new_data["fellows"][1]["training"] = True
    new_data["fellows"].append(fellow("d", card(0, free=8), name="newbie"))
    old, new = cluster_from_dict(old_data), cluster_from_dict(new_data)
    p = make(MID, old_data, context=1024)
    lines = diff_views(old, new, p)
    assert "fxserver's GTX 1050 Ti #0 now has 2.1 GB free, was 3.9 GB" in lines
    assert "fellow laptop-2 went away" in lines
    assert "fellow rig started training" in lines
    assert "fellow newbie joined" in lines
    assert diff_views(old, old) == []
    # a change smaller than the rounding is said in MB
    tweak = copy.deepcopy(old_data)
    tweak["fellows"][0]["cards"][0]["free_bytes"] += 20 * MB
    (line,) = diff_views(old, cluster_from_dict(tweak))
    assert line.startswith("fxserver's GTX 1050 Ti #0 now has 3,920 MB free, was 3,900 MB")


def test_diff_plans_from_the_plans_alone() -> None:
    before = reference()
    after = copy.deepcopy(before)
    rig = next(f for f in after["fellows"] if f["name"] == "rig")
    # below the floor: the model moves off it (2 GB would still hold all of it, and then
    # the plan stays where it was)
    rig["cards"][0]["free_bytes"] = int(0.5 * GB)
    after["fellows"] = [f for f in after["fellows"] if f["name"] != "laptop-1"]
    old = make(MID, before, context=2048).to_dict()
    new = make(MID, after, context=2048).to_dict()
    lines = diff_plans(old, new)
    assert lines[0] == "rig's RTX 3090 #0 now has 0.5 GB free, was 25.1 GB"
    assert "fellow laptop-1 went away" in lines
    assert any(line.startswith("the layers now run ") for line in lines)
    assert diff_plans(old, old) == []


@pytest.mark.parametrize("flag, words", [("connected", "is not connected"),
                                         ("training", "is training")])
def test_diff_plans_names_flags(flag: str, words: str) -> None:
    before = reference()
    after = copy.deepcopy(before)
    pi = next(f for f in after["fellows"] if f["name"] == "pi-1")
    pi[flag] = flag == "training"
    lines = diff_plans(make(MID, before).to_dict(), make(MID, after).to_dict())
    assert f"fellow pi-1 {words}" in lines
