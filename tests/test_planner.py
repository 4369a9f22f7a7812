"""The planner's promises: segments add up, layers cover [0, L), order never matters,
each reason in its exact words, the limit sentence, maximize context / seq_len."""

from __future__ import annotations

import copy
import json
import random
import re
from dataclasses import replace
from itertools import pairwise
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p2pswarm.errors import ConfigError, PlacementError
from p2pswarm.models.files import load_profile
from p2pswarm.planner import (
    Plan,
    cluster_from_dict,
    plan,
    plan_message,
    profile_from_config,
    request_from_dict,
)
from p2pswarm.planner.plan import SEGMENT_NAMES
from tests.planner_cases import (
    GB,
    MB,
    MID,
    MID_CONFIG,
    REFERENCE,
    card,
    cluster,
    fellow,
    make,
    random_cluster,
    reference,
)

LOW_FLOORS = {"cuda": 100 * MB, "cpu": 100 * MB}


def check_invariants(p: Plan) -> None:
    """Segments add up; layers cover [0, L) once, contiguously, in pipeline order."""
    d = p.to_dict()
    for c in d["cards"]:
        seg = c["segments"]
        assert set(seg) == set(SEGMENT_NAMES)
        assert all(v >= 0 for v in seg.values())
        parts = sum(v for k, v in seg.items() if k != "does_not_fit")
        assert parts == c["total_bytes"] + seg["does_not_fit"]
        if seg["does_not_fit"]:
            assert seg["free"] == 0 and not p.fits
        assert c["used"] == (c["reason"] is None)
        if not c["used"]:
            assert seg["free"] == c["free_bytes"] and seg["weights"] == 0
    ranges = [tuple(s["layers"]) for s in d["stages"]]
    if d["stages"]:
        assert ranges[0][0] == 0 and ranges[-1][1] == p.model.layers
        assert all(a[1] == b[0] for a, b in pairwise(ranges))
        assert all(a < b for a, b in ranges)
    used = [c for c in d["cards"] if c["used"]]
    assert [tuple(c["layers"]) for c in sorted(used, key=lambda c: c["stage"])] == ranges
    # grouped by fellow: a fellow's cards are next to each other
    seen: list[str] = []
    for c in d["cards"]:
        if not seen or seen[-1] != c["fellow_id"]:
            assert c["fellow_id"] not in seen
            seen.append(c["fellow_id"])
    assert re.fullmatch(r"[0-9a-f]{16}", p.plan_id)
    assert d["layout"]["limit"]["sentence"] == p.limit.sentence
    assert_round_trip(p)


def assert_round_trip(p: Plan) -> None:
    """A plan's document reads back as the same value, through JSON too."""
    doc = p.to_dict()
    assert Plan.from_doc(doc) == p
    assert Plan.from_doc(json.loads(json.dumps(doc))) == p
    assert Plan.from_doc(doc).to_dict() == doc


# --- random clusters -----------------------------------------------------------------------

def random_request(rng: random.Random) -> dict[str, Any]:
    request: dict[str, Any] = {
        "context": rng.choice([512, 1024, 2048, 4096]), "sequences": rng.randint(1, 8),
        "weights_dtype": rng.choice(["f32", "f16", "bf16", "int8", "int4"]),
        "kv_dtype": rng.choice(["f32", "f16", "int8"]), "floors_bytes": LOW_FLOORS,
        "maximize": rng.choice([None, None, "speed", "context"]),
    }
    if rng.random() < 0.2:
        request["stages"] = rng.randint(1, 3)
    return request


def shuffled(data: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    out = copy.deepcopy(data)
    rng.shuffle(out["fellows"])
    for f in out["fellows"]:
        rng.shuffle(f["cards"])
    links = list(out.get("links", {}).items())
    rng.shuffle(links)
    out["links"] = dict(links)
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32), st.integers(1, 6))
def test_invariants_and_shuffle_invariance_on_random_clusters(seed: int, n_cards: int) -> None:
    rng = random.Random(seed)
    data = random_cluster(rng, n_cards)
    request = random_request(rng)
    try:
        first = make(MID, data, **request)
    except PlacementError:  # --stages more than the usable cards: refused, not planned
        assert request.get("stages", 0) > 1
        return
    check_invariants(first)
    again = make(MID, shuffled(data, rng), **request)
    assert again.plan_id == first.plan_id
    assert json.dumps(again.to_dict()) == json.dumps(first.to_dict())


def test_reference_plans_hold_the_invariants() -> None:
    for model in ("tiny-llama", "small-llama", "llama-3-8b", "llama-2-13b", "llama-3.1-70b"):
        for request in ({}, {"maximize": "speed"}, {"maximize": "context"},
                        {"weights_dtype": "int4", "context": 2048}):
            check_invariants(make(load_profile(model), reference(), **request))
        check_invariants(make(load_profile(model), reference(), kind="train", method="lora",
                              weights_dtype="int4"))


def test_plan_documents_read_back_as_the_plan() -> None:
    """Serving and training plans, fitting or not, and one with an adapter on top."""
    cases = [make(MID, reference()),
             make(load_profile("llama-3.1-70b"), reference(), weights_dtype="f16"),
             make(MID, reference(), kind="train", method="lora", weights_dtype="int4"),
             make(load_profile("llama-3.1-70b"), reference(), kind="train")]
    assert not cases[1].fits
    for p in cases:
        assert_round_trip(p)
    adapted = replace(cases[0], plan_id="0" * 16, adapter="a" * 64, base_plan_id=cases[0].plan_id)
    assert_round_trip(adapted)
    assert adapted.to_dict()["base_plan_id"] == cases[0].plan_id


@pytest.mark.parametrize("broken", [
    lambda d: d.pop("plan_id"), lambda d: d.update(fits="yes"),
    lambda d: d["stages"][0].update(layers=[0]), lambda d: d["cards"][0].pop("segments"),
    lambda d: d["layout"]["limit"].update(holds=1.5), lambda d: d["estimate"].pop("hops"),
    lambda d: d["model"].update(recurrent=None), lambda d: d.update(notes=[1]),
])
def test_a_broken_plan_document_is_a_config_error(broken: Any) -> None:
    doc = make(MID, reference()).to_dict()
    broken(doc)
    with pytest.raises(ConfigError):
        Plan.from_doc(doc)


# --- plan_id ---------------------------------------------------------------------------------

def test_plan_id_survives_noise_and_changes_when_a_segment_boundary_is_crossed() -> None:
    data = cluster(fellow("a", card(0, free=1.2)), fellow("b", card(0, free=1.0)))
    base = make(MID, data, floors_bytes=LOW_FLOORS, context=2048)
    used = next(c for c in base.cards if c.used)
    claimed = used.total_bytes - used.segments.other_programs - used.segments.free
    # 10 MB less free, still the roomiest card and above its claims: the same plan
    noisy = copy.deepcopy(data)
    target = next(f for f in noisy["fellows"] if f["id"] == used.fellow_id)["cards"][0]
    target["free_bytes"] -= 10 * MB
    assert make(MID, noisy, floors_bytes=LOW_FLOORS, context=2048).plan_id == base.plan_id
    # one byte under its claims: the card cannot keep its layers, the plan changes
    target["free_bytes"] = claimed - 1
    moved = make(MID, noisy, floors_bytes=LOW_FLOORS, context=2048)
    assert moved.plan_id != base.plan_id


def test_plan_id_depends_on_request_and_model() -> None:
    data = reference()
    a = make(MID, data, context=1024)
    assert make(MID, data, context=1280).plan_id != a.plan_id
    assert make(MID, data, context=1024, kv_dtype="int8").plan_id != a.plan_id
    other = profile_from_config({**MID_CONFIG, "vocab_size": 32001}, "mid")
    assert plan(other, cluster_from_dict(data), request_from_dict({"context": 1024})).plan_id \
        != a.plan_id


# --- reasons, in their exact words -----------------------------------------------------------

def reasons(p: Plan) -> dict[tuple[str, str, int], str | None]:
    return {(c.fellow, c.kind, c.index): c.reason for c in p.cards}


def test_each_reason_in_its_exact_words() -> None:
    data = cluster(
        fellow("a1", card(0, free=20, total=24), name="rig"),
        fellow("b2", card(0, free=0.05, total=24.5,
                          held=[{"pid": 9, "name": "/app/llama-server", "bytes": 23_400_000_000}]),
               name="busy"),
        fellow("c3", card(0, kind="cpu", free=1.0, total=16), name="laptop"),
        fellow("d4", card(0, free=8), name="gone", connected=False),
        fellow("e5", card(0, free=8), name="trainer", training=True),
        fellow("f6", card(0, free=8), card(1, free=8), name="spare"),
        fellow("g7", card(0, free=0.7, total=2), name="small"),
    )
    p = make(load_profile("llama-3-8b"), data, context=4096, exclude=["spare:1"],
             floors_bytes={"cpu": 4 * GB, "cuda": GB // 2}, weights_dtype="f16")
    got = reasons(p)
    assert got[("busy", "cuda", 0)] == "23.4 GB held by /app/llama-server (not p2pswarm)"
    assert got[("laptop", "cpu", 0)] == "1.0 GB free, below the 4.0 GB floor"
    assert got[("gone", "cuda", 0)] == "fellow not connected"
    assert got[("trainer", "cuda", 0)] == "fellow training"
    assert got[("spare", "cuda", 1)] == "left out by you"
    assert got[("spare", "cuda", 0)] == "not needed: the plan fits without it"
    assert re.fullmatch(r"less than the \d+\.\d GB a stage needs free", got[("small", "cuda", 0)])
    assert got[("rig", "cuda", 0)] is None
    check_invariants(p)


def test_a_program_is_blamed_only_when_the_card_would_clear_the_floor_without_it() -> None:
    data = cluster(fellow("a", card(0, free=20, total=24)),
                   fellow("b", card(0, free=0.5, total=1.0,
                                    held=[{"pid": 3, "name": "game", "bytes": 300 * MB}])))
    p = make(MID, data)
    assert reasons(p)[("b", "cuda", 0)] == "0.5 GB free, below the 1.0 GB floor"


def test_exclude_by_id_or_name_and_unknown_cards() -> None:
    data = cluster(fellow("id-1", card(0, free=8), card(0, kind="cpu", free=8), name="box"))
    by_name = make(MID, data, exclude=["box:0"])
    by_id = make(MID, data, exclude=["id-1:0"])
    assert reasons(by_name)[("box", "cuda", 0)] == "left out by you"
    assert by_name.plan_id == make(MID, data, exclude=["box:0"]).plan_id
    assert reasons(by_id)[("box", "cuda", 0)] == "left out by you"
    assert reasons(make(MID, data, exclude=["box:cpu"]))[("box", "cpu", 0)] == "left out by you"
    with pytest.raises(ConfigError, match="no fellow 'nobody'"):
        make(MID, data, exclude=["nobody:0"])
    with pytest.raises(ConfigError, match="has no such card"):
        make(MID, data, exclude=["box:3"])
    with pytest.raises(ConfigError, match="FELLOW:INDEX"):
        request_from_dict({"exclude": ["box"]})


def test_exclude_cpu_finds_the_cpu_card_whatever_its_index() -> None:
    # an inventory may number its CPU card after the GPUs (cuda 0, cuda 1, cpu 2)
    data = cluster(fellow("id-1", card(0, free=8), card(1, free=8), card(2, kind="cpu", free=8),
                          name="box"))
    assert reasons(make(MID, data, exclude=["box:cpu"]))[("box", "cpu", 2)] == "left out by you"
    with pytest.raises(ConfigError, match="has no such card"):
        make(MID, data, exclude=["box:2"])  # a GPU index: there is no third GPU


# --- the limit sentence -----------------------------------------------------------------------

SENTENCE = re.compile(
    r"(Context [\d,]+ tokens( for \d+ sequences)?|Sequence length [\d,]+ tokens, micro-batch \d+)"
    r"( does not fit)?; the cards hold ([\d,]+|none: .+), limited by (.+)\.$")


def test_limit_sentence_names_the_card_that_fills_first() -> None:
    data = reference()
    p = make(load_profile("llama-3.1-8b"), data, context=32768, sequences=8)
    assert SENTENCE.match(p.limit.sentence), p.limit.sentence
    assert p.limit.limited_by == "card"
    holds = p.limit.holds
    who = p.limit.card
    assert who is not None
    assert p.limit.sentence == (f"Context 32,768 tokens for 8 sequences; the cards hold "
                                f"{holds:,}, limited by {who['fellow']}'s CPU ({who['name']}).")
    assert holds % 256 == 0 and 32768 <= holds < 131072
    # the same cluster with the 1050 Ti the only GPU in play: the documented example's form
    gpu_only = cluster(fellow("f1", card(0, free=3.9, total=4.3, name="GTX 1050 Ti"),
                              name="fxserver"),
                       fellow("f2", card(0, free=7.0, total=8.0, name="RTX 3070"), name="rig"))
    q = make(load_profile("llama-3.1-8b"), gpu_only, context=8192, weights_dtype="int4")
    assert re.fullmatch(r"Context 8,192 tokens; the cards hold [\d,]+, limited by "
                        r"(fxserver's GTX 1050 Ti #0|rig's RTX 3070 #0)\.", q.limit.sentence), \
        q.limit.sentence


def test_limit_sentence_form_for_model_layers_and_no_fit() -> None:
    data = reference()
    capped = make(load_profile("llama-3-8b"), data)
    assert capped.limit.sentence == ("Context 4,096 tokens; the cards hold 8,192, limited by "
                                     "the model's maximum context.")
    tiny = cluster(*(fellow(f"f{i:02d}", card(0, free=0.55, total=1.0)) for i in range(20)))
    layers = make(MID, tiny, maximize="context", floors_bytes=LOW_FLOORS, sequences=8)
    assert layers.limit.limited_by == "layers"
    assert layers.limit.sentence.endswith(
        "limited by layers: each of the 16 layers already has a card of its own.")
    nothing = make(load_profile("llama-3-70b"), data, context=8192, weights_dtype="f16")
    assert not nothing.fits
    assert nothing.limit.sentence.startswith("Context 8,192 tokens does not fit; the cards hold "
                                             "none: the weights alone need ")
    train = make(MID, data, kind="train", seq_len=1024, micro_batch=2)
    assert SENTENCE.match(train.limit.sentence), train.limit.sentence
    assert train.limit.sentence.startswith("Sequence length 1,024 tokens, micro-batch 2; ")


def test_does_not_fit_plans_show_the_overflow() -> None:
    p = make(load_profile("llama-3-70b"), reference(), context=8192, weights_dtype="f16")
    check_invariants(p)
    assert not p.fits and any(c.segments.does_not_fit > 0 for c in p.cards)
    assert "does not fit" in p.limit.sentence
    assert "past its end" in p.summary


# --- maximize context / seq_len ---------------------------------------------------------------

@pytest.mark.parametrize("model, request_", [
    ("llama-3.1-8b", {"sequences": 4, "weights_dtype": "f16"}),
    ("llama-3.1-70b", {"weights_dtype": "int4"}),
    ("llama-3.1-8b", {"sequences": 16, "stages": 2, "weights_dtype": "f16"}),
    ("mid", {"sequences": 64, "kv_dtype": "f32", "weights_dtype": "f16"}),
])
def test_maximize_context_fits_and_256_more_does_not(model: str, request_: dict[str, Any]) -> None:
    profile = MID if model == "mid" else load_profile(model)
    data = reference()
    best = make(profile, data, maximize="context", **request_)
    assert best.fits
    check_invariants(best)
    top = best.request.context
    assert top % 256 == 0 and top == best.limit.holds
    assert make(profile, data, context=top, **request_).fits
    if top + 256 <= profile.max_context:
        assert not make(profile, data, context=top + 256, **request_).fits


def test_maximize_seq_len_fits_and_256_more_does_not() -> None:
    data = reference()
    profile = load_profile("llama-3-8b")
    for model, extra in ((profile, {"method": "lora", "weights_dtype": "int4",
                                    "micro_batch": 8}),
                         (MID, {"micro_batch": 64, "checkpointing": False})):
        best = make(model, data, kind="train", maximize="seq_len", **extra)
        assert best.fits
        top = best.request.seq_len
        assert top % 256 == 0
        assert make(model, data, kind="train", seq_len=top, **extra).fits
        if top + 256 <= model.max_context:
            assert not make(model, data, kind="train", seq_len=top + 256, **extra).fits


# --- placement modes ----------------------------------------------------------------------

def test_default_uses_the_fewest_cards_in_proportion_to_room() -> None:
    data = cluster(fellow("a", card(0, free=1.3, total=2)), fellow("b", card(0, free=1.3, total=2)),
                   fellow("c", card(0, free=1.6, total=3)))
    p = make(MID, data, floors_bytes=LOW_FLOORS, context=8192, sequences=4)
    used = [c for c in p.cards if c.used]
    assert p.fits and len(used) == 2
    sizes = {c.fellow_id: c.layers[1] - c.layers[0] for c in used if c.layers}
    assert sizes["c"] > max(v for k, v in sizes.items() if k != "c")


def test_stage_count_is_honoured_and_checked() -> None:
    data = reference()
    p = make(MID, data, stages=3)
    assert len(p.stages) == 3 and p.fits
    q = make(MID, data, stages=3, maximize="speed")
    assert len(q.stages) == 3
    with pytest.raises(ConfigError, match="more than the model's 16 layers"):
        make(MID, data, stages=17)
    with pytest.raises(PlacementError, match="usable cards"):
        make(MID, cluster(fellow("a", card(0, free=8))), stages=2)


def test_maximize_speed_is_no_slower_than_the_default() -> None:
    for model in ("llama-3-8b", "llama-2-13b", "tinyllama-1.1b"):
        profile = load_profile(model)
        fast = make(profile, reference(), maximize="speed")
        plain = make(profile, reference())
        assert fast.estimate.time_per_token_s <= plain.estimate.time_per_token_s * (1 + 1e-12)


def test_the_default_is_about_as_fast_as_maximize_speed() -> None:
    for model in ("llama-3-8b", "llama-2-13b", "tinyllama-1.1b"):
        profile = load_profile(model)
        fast = make(profile, reference(), maximize="speed")
        plain = make(profile, reference())
        assert plain.estimate.time_per_token_s <= fast.estimate.time_per_token_s * 1.01


def test_the_default_plan_on_the_home_cluster_uses_the_gpus() -> None:
    # a desktop with a busy RTX 3090 and an RTX 3060, an old server with 128 GB of RAM: the
    # fewest cards by room would put half of Llama-3-8B on the server's CPU
    home = json.loads((REFERENCE.parent / "home-busy.json").read_text())
    p = make(load_profile("llama-3-8b"), home)
    assert p.fits and {(s.fellow_id, s.kind) for s in p.stages} == {("3a91c0", "cuda")}
    assert 40 < p.estimate.tokens_per_s < 55
    assert "would be" not in p.summary
    assert p.plan_id == make(load_profile("llama-3-8b"), home).plan_id


def test_a_trained_cut_is_kept_and_the_summary_says_how_much_faster_the_fastest_is() -> None:
    data = cluster(fellow("gpu", card(0, free=8.0, flops=5e13, bw=8e11)),
                   fellow("old", card(0, kind="cpu", free=64.0, flops=2e11, bw=1.4e10)))
    fastest = make(MID, data, context=1024)
    assert [(s.fellow_id, s.layers) for s in fastest.stages] == [("gpu", (0, 16))]
    assert "would be" not in fastest.summary
    cut = profile_from_config({**MID_CONFIG, "p2pswarm_stage_cut": [8]}, "cut")
    kept = make(cut, data, context=1024)
    assert [s.layers for s in kept.stages] == [(0, 8), (8, 16)]
    ratio = kept.estimate.time_per_token_s / fastest.estimate.time_per_token_s
    assert ratio >= 1.5
    assert (f"the fastest plan that fits (--maximize speed) would be {ratio:.1f}x faster"
            in kept.summary)
    assert "would be" not in make(cut, data, context=1024, maximize="speed").summary


def test_trained_cut_is_used_when_the_model_carries_one() -> None:
    profile = profile_from_config({**MID_CONFIG, "p2pswarm_stage_cut": [5, 11]}, "cut")
    p = make(profile, reference(), context=1024)
    assert [s.layers for s in p.stages] == [(0, 5), (5, 11), (11, 16)]
    with pytest.raises(ConfigError, match="p2pswarm_stage_cut"):
        profile_from_config({**MID_CONFIG, "p2pswarm_stage_cut": [0, 16]}, "bad")


def test_training_plans_claim_optimizer_and_lora() -> None:
    data = reference()
    full = make(MID, data, kind="train", seq_len=1024)
    lora = make(MID, data, kind="train", seq_len=1024, method="lora", lora_rank=8,
                weights_dtype="int4")
    assert full.fits and lora.fits
    assert sum(c.segments.optimizer for c in full.cards) > sum(
        c.segments.optimizer for c in lora.cards) > 0
    assert sum(c.segments.lora for c in lora.cards) > 0
    assert all(c.segments.kv_cache == 0 for c in full.cards)
    assert full.estimate.time_per_step_s > 0 and full.to_dict()["estimate"]["tokens_per_step"] \
        == 1024
    with pytest.raises(ConfigError, match="--lora-rank"):
        request_from_dict({"kind": "train", "weights_dtype": "int4"})
    with pytest.raises(ConfigError, match="--maximize context does not apply to a train plan"):
        request_from_dict({"kind": "train", "maximize": "context"})


def test_unmeasured_speeds_are_flagged() -> None:
    data = cluster(fellow("a", card(0, free=8, flops=None, bw=None), name="new-box"))
    p = make(MID, data)
    assert p.notes and "new-box's GPU #0 is an estimate" in p.notes[0]
    assert "p2pswarm bench" in p.summary


def test_context_over_the_model_maximum_is_refused() -> None:
    with pytest.raises(ConfigError, match="use --context 8192 or less"):
        make(MID, reference(), context=9000)


def test_plan_dict_shape() -> None:
    d = make(MID, reference(), context=2048).to_dict()
    for key in ("plan_id", "kind", "fits", "request", "cards", "stages", "layout", "summary",
                "estimate"):
        assert key in d
    assert set(d["layout"]["limit"]) >= {"sentence", "requested", "holds", "limited_by"}
    for c in d["cards"]:
        assert set(c) >= {"fellow_id", "fellow", "index", "name", "total_bytes", "used",
                          "reason", "layers", "segments"}
    assert d["estimate"]["time_per_token_s"] > 0 and d["estimate"]["tokens_per_s"] > 0
    json.dumps(d)  # plain JSON all the way down


def test_plan_message_is_what_the_agent_answers() -> None:
    view = cluster_from_dict(reference())
    message = {"model": {"name": "mid", "config": MID_CONFIG}, "context": 2048,
               "maximize": "speed"}
    answer = plan_message(message, view)
    assert answer == make(MID, reference(), context=2048, maximize="speed").to_dict()
    with pytest.raises(ConfigError, match="model"):
        plan_message({"context": 5}, view)


def test_cluster_file_round_trip_and_errors() -> None:
    view = cluster_from_dict(reference())
    assert cluster_from_dict(view.to_dict()) == view
    assert cluster_from_dict(json.loads(json.dumps(view.to_dict()))) == view
    sized = cluster(fellow("a", {"index": 0, "kind": "cpu", "total_bytes": "16GB",
                                 "free_bytes": "6GB"}))
    (only,) = cluster_from_dict(sized).fellows[0].cards
    assert (only.total_bytes, only.free_bytes, only.speed_measured) == (16 * GB, 6 * GB, False)
    for bad, words in [
        ({"fellows": "x"}, "\"fellows\" list"),
        (cluster(fellow("a", {"kind": "cuda"})), "fellows[0].cards[0] has no total_bytes"),
        (cluster(fellow("a", card(0, free=5, total=4))), "more than total_bytes"),
        (cluster(fellow("a", card(0)), fellow("a", card(0))), "appears twice"),
        (cluster(fellow("a", card(0), card(0))), "same card twice"),
        (cluster(fellow("a", card(0)), links={"a|zz": {"bandwidth_bytes_s": 1e6}}),
         "not in the cluster"),
        (cluster(fellow("a", card(0)), links={"default": {"latency_s": 1}}), "bandwidth"),
        (cluster(fellow("a", {**card(0), "kind": "tpu"})), "\"cuda\" or \"cpu\""),
    ]:
        with pytest.raises(ConfigError, match=re.escape(words)):
            cluster_from_dict(bad)


def test_a_view_from_membership_metadata() -> None:
    from p2pswarm.cards import Benchmark, Card, Holder, Inventory
    from p2pswarm.planner import cluster_view, fellow_view

    gpu = Card(0, "cuda", "RTX 3090", "GPU-1", 24 * GB, 20 * GB,
               (Holder(7, "/usr/bin/Xorg", 300 * MB),))
    cpu = Card(0, "cpu", "Ryzen", "cpu-1", 32 * GB, 20 * GB)
    measured = {"cuda:0": Benchmark(6e13, 8e11, "f16", True, "fp", 2.0)}
    fellows = [
        fellow_view("id-rig", "rig", Inventory((gpu, cpu)), measured),
        fellow_view("id-lap", "laptop", Inventory((cpu,)).to_dict(), None, connected=False),
    ]
    view = cluster_view(fellows, {"rig|laptop": {"bandwidth_bytes_s": 5e7, "latency_s": 0.01}})
    rig = view.fellow("id-rig")
    assert rig is not None and [c.key for c in rig.cards] == ["cuda:0", "cpu:0"]
    assert rig.cards[0].speed_measured and not rig.cards[1].speed_measured
    assert view.link("id-lap", "id-rig").bandwidth_bytes_s == 5e7
    p = plan(MID, view, request_from_dict({}))
    assert reasons(p)[("laptop", "cpu", 0)] == "fellow not connected"
    assert p.fits and p.stages[0].fellow == "rig"
