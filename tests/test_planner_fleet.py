"""The fleet training plan: replicas of different shapes over the whole cluster, a
micro-batch per replica, the round's sync bytes, and the file shaped like the target
fleet. Pure planner tests, fast."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from p2pswarm.planner import (
    BUILTIN_MODELS,
    REFERENCE_CONFIGS,
    cluster_from_dict,
    plan,
    profile_from_config,
    request_from_dict,
)
from p2pswarm.planner.fleet import FleetRequest, fleet_request_from_dict, plan_fleet
from p2pswarm.planner.sync_cost import encoded_bytes

CLUSTERS = Path(__file__).resolve().parent.parent / "simulations" / "clusters"
GB = 10**9
TINYLLAMA = profile_from_config(REFERENCE_CONFIGS["tinyllama-1.1b"], "tinyllama-1.1b")


def cpu_fellows(frees: list[int], flops: float = 1e11) -> dict[str, Any]:
    return {"fellows": [{"id": f"f{i}", "name": f"f{i}", "cards": [
        {"kind": "cpu", "index": 0, "name": "CPU", "total_bytes": 16 * GB, "free_bytes": free,
         "flops": flops, "mem_bandwidth": 1e10}]} for i, free in enumerate(frees)]}


def two_fellows_of_different_memory() -> Any:
    """tiny-llama on two CPUs whose free memory differs: their batches must differ."""
    view = cluster_from_dict(cpu_fellows([450_000_000, 420_000_000]))
    profile = profile_from_config(BUILTIN_MODELS["tiny-llama"], "tiny-llama")
    request = request_from_dict({"kind": "train", "seq_len": 32, "weights_dtype": "f32",
                                 "floors_bytes": {"cpu": 10**6}})
    return plan_fleet(profile, view, request, FleetRequest(replicas=2, auto_batch=True,
                                                           inner_steps=4))


def test_auto_batch_gives_fellows_of_different_memory_different_batches() -> None:
    fleet = two_fellows_of_different_memory()
    assert fleet.fits and len(fleet.replicas) == 2
    by_fellow = {r.plan.stages[0].fellow: r.micro_batch for r in fleet.replicas}
    assert by_fellow["f0"] > by_fellow["f1"] >= 1, by_fellow
    shown = fleet.to_dict()["replicas"]
    assert [r["micro_batch"] for r in shown] == [r.micro_batch for r in fleet.replicas]


def test_the_fleet_file_is_planned_over_replicas_of_different_shapes() -> None:
    view = cluster_from_dict(json.loads((CLUSTERS / "fleet.json").read_text()))
    kinds = {c.name.split()[0] for f in view.fellows for c in f.cards}
    assert len(view.fellows) == 38 and {"Intel", "Raspberry"} <= kinds
    request = request_from_dict({"kind": "train", "seq_len": 256, "weights_dtype": "bf16"})
    fleet = plan_fleet(TINYLLAMA, view, request, FleetRequest(auto_batch=True,
                                                              inner_steps=100))
    shapes = sorted({r.stages for r in fleet.replicas})
    assert fleet.fits and len(fleet.replicas) > 8 and shapes[0] == 1 and shapes[-1] >= 4
    batches = {r.plan.stages[0].fellow.split("-")[0]: r.micro_batch for r in fleet.replicas}
    assert batches["server"] > batches["pi"]  # a batch per device
    # every card is in one replica, or left out with its reason
    cards = fleet.to_dict()["cards"]
    assert all((c["replica"] is None) == (c["reason"] is not None) for c in cards)
    assert sum(c["used"] for c in cards) == sum(r.stages for r in fleet.replicas)
    assert fleet.round is not None and fleet.round.comm_s < fleet.round.compute_s
    assert fleet.tokens_per_s > fleet.single_pipeline_tokens_per_s


def test_a_1b_rwkv7_trains_over_the_whole_fleet() -> None:
    """The job the fleet exists for: every card in a replica, the Pis in pipelines."""
    config = json.loads((CLUSTERS.parent / "models" / "rwkv7-1b" / "config.json").read_text())
    rwkv = profile_from_config(config, "rwkv7-1b")
    view = cluster_from_dict(json.loads((CLUSTERS / "fleet.json").read_text()))
    request = request_from_dict({"kind": "train", "seq_len": 256, "weights_dtype": "bf16"})
    fleet = plan_fleet(rwkv, view, request, FleetRequest(auto_batch=True, inner_steps=100))
    assert fleet.fits and rwkv.recurrent
    assert all(c["replica"] is not None for c in fleet.to_dict()["cards"])
    pis = [r for r in fleet.replicas if r.plan.stages[0].fellow.startswith("pi")]
    assert pis and all(r.stages >= 4 for r in pis)
    assert fleet.round is not None and fleet.round.comm_s < fleet.round.compute_s / 3


def test_the_fleet_plan_is_deterministic_whatever_the_order() -> None:
    data = cpu_fellows([12 * GB, 7 * GB, 7 * GB, 3 * GB, 3 * GB, 3 * GB, 3 * GB],
                       flops=1.2e10)
    request = request_from_dict({"kind": "train", "seq_len": 128, "weights_dtype": "bf16"})
    profile = profile_from_config(REFERENCE_CONFIGS["smollm-135m"], "smollm-135m")
    ids = set()
    for seed in range(2):
        shuffled = dict(data, fellows=random.Random(seed).sample(data["fellows"], 7))
        fleet = plan_fleet(profile, cluster_from_dict(shuffled), request,
                           FleetRequest(auto_batch=True))
        ids.add(json.dumps(fleet.to_dict(), sort_keys=True))
    assert len(ids) == 1


def test_a_fixed_replica_count_that_does_not_fit_says_so() -> None:
    view = cluster_from_dict(cpu_fellows([2 * GB]))
    profile = profile_from_config(BUILTIN_MODELS["tiny-llama"], "tiny-llama")
    fleet = plan_fleet(profile, view, request_from_dict({"kind": "train", "seq_len": 32}),
                       FleetRequest(replicas=3))
    assert not fleet.fits and len(fleet.replicas) == 1
    assert "only 1 of the 3 replicas" in fleet.sentence


def test_on_a_cluster_with_gpus_the_training_plan_uses_them() -> None:
    """LoRA on Llama-3-8B on the home cluster: one pipeline by the old rule starts on the
    old server's CPU; the fleet plan's first replica runs on the RTX 3090 and 3060."""
    view = cluster_from_dict(json.loads((CLUSTERS / "home.json").read_text()))
    profile = profile_from_config(REFERENCE_CONFIGS["llama-3-8b"], "llama-3-8b")
    fleet_part, rest = fleet_request_from_dict({"kind": "train", "method": "lora",
                                                "lora_rank": 16})
    request = request_from_dict(rest)
    single = plan(profile, view, request)
    # the single-pipeline default is the fastest plan that fits: the GPUs too
    assert {s.kind for s in single.stages} == {"cuda"}
    fleet = plan_fleet(profile, view, request, fleet_part)
    first = fleet.replicas[0]
    assert {s.kind for s in first.plan.stages} == {"cuda"}
    assert {s.name for s in first.plan.stages} == {"RTX 3090", "RTX 3060"}


def test_bad_fleet_fields_are_refused() -> None:
    with pytest.raises(Exception, match="replicas must be"):
        fleet_request_from_dict({"replicas": "many"})
    with pytest.raises(Exception, match="codec"):
        fleet_request_from_dict({"codec": "zip"})
    for options in ({"fraction": "lots"}, {"fraction": 0}, [1]):
        with pytest.raises(Exception, match="fraction|object"):
            fleet_request_from_dict({"codec": "topk", "codec_options": options})
    with pytest.raises(Exception, match="bucket"):
        fleet_request_from_dict({"codec": "qsgd", "codec_options": {"bucket": 0}})


@pytest.mark.parametrize("codec, options", [
    ("fp32", {}), ("fp16", {}), ("int8", {}), ("qsgd", {"bits": 2}), ("qsgd", {}),
    ("topk", {"fraction": 0.05}),
])
def test_sync_bytes_are_what_the_codec_sends(codec: str, options: dict[str, Any]) -> None:
    torch = pytest.importorskip("torch")
    from p2pswarm.training.codec import make_codec

    n = 10_007
    encoded = make_codec(codec, **options).encode(torch.randn(n, generator=torch.Generator()
                                                              .manual_seed(1)))
    estimate = encoded_bytes(codec, options, n)
    if codec == "topk":  # positions are varints of data-dependent gaps
        assert abs(estimate - encoded.nbytes) <= 0.1 * encoded.nbytes
    else:
        assert estimate == encoded.nbytes
