"""The planner on the newer families: per-stage claims equal what the runtime allocates,
sliding layers included, and a Llama's profile (so its plan_id) is what it was."""

from __future__ import annotations

import pytest

from p2pswarm.errors import ConfigError
from p2pswarm.models.files import load_profile
from p2pswarm.planner.costs import CostModel
from p2pswarm.planner.profile import (
    REFERENCE_CONFIGS,
    RUNTIME_KV,
    RUNTIME_WEIGHTS,
    profile_from_config,
)
from p2pswarm.planner.request import request_from_dict, resolve

FAMILIES = ["qwen3-0.6b", "gemma-2-2b", "gemma-3-1b", "phi-3-mini-4k", "mistral-7b-v0.1"]


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("context", [256, 4096])
def test_claims_are_what_the_runtime_allocates(name: str, context: int) -> None:
    memory = pytest.importorskip("p2pswarm.runtime.memory")
    spec_module = pytest.importorskip("p2pswarm.runtime.spec")
    profile = load_profile(name)
    r = resolve(request_from_dict({"weights_dtype": "int8", "kv_dtype": "f16",
                                   "context": context, "sequences": 2}), profile)
    model = CostModel(profile, r, context)
    for start, n in [(0, 5), (5, 6), (11, profile.n_layers - 11), (0, profile.n_layers)]:
        first, last = start == 0, start + n == profile.n_layers
        claims = model.claims("cuda", n, first, last, start=start)
        dtype, quant = RUNTIME_WEIGHTS["int8"]
        spec = spec_module.StageSpec(start_layer=start, end_layer=start + n, dtype=dtype,
                                     quant=quant, kv_dtype=RUNTIME_KV["f16"],
                                     max_context_tokens=context, max_sessions=2)
        held = memory.stage_memory(profile.model_config(), spec)
        assert (claims.weights, claims.embeddings_head_buffers, claims.kv_cache) == \
            (held.weights_bytes, held.embeddings_head_buffers_bytes, held.kv_cache_bytes)
        # the search's per-layer claim never undercounts a stage
        assert model.claims("cuda", n, first, last).kv_cache >= claims.kv_cache


def test_a_window_bounds_the_cache_and_a_llama_profile_is_unchanged() -> None:
    phi = load_profile("phi-3-mini-4k")
    assert phi.kv_tokens_per_layer(100_000) == 2047 and phi.kv_tokens_per_layer(100) == 100
    gemma = load_profile("gemma-3-1b")
    assert gemma.kv_tokens_of(0, 6, 4096) == 5 * 512 + 4096  # five sliding, one global
    assert set(load_profile("llama-3-8b").to_dict()) == {
        "name", "model_type", "n_layers", "hidden", "intermediate", "n_heads", "n_kv_heads",
        "head_dim", "vocab", "tied", "qkv_bias", "o_bias", "mlp_bias", "max_context",
        "trained_cut"}
    assert gemma.to_dict()["sliding_window"] == 512


@pytest.mark.parametrize("change, words", [
    ({"model_type": "gemma3"}, "gemma3_text"),
    ({"partial_rotary_factor": 0.75}, "partial rotary"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 4.0}}, "longrope"),
    ({"hidden_act": "gelu"}, "activation"),
    ({"sliding_window": 0}, "sliding_window"),
    ({"layer_types": ["full_attention"]}, "layer_types"),
])
def test_what_a_family_cannot_run_is_refused_in_one_line(change: dict, words: str) -> None:
    base = REFERENCE_CONFIGS["phi-3-mini-4k"]
    with pytest.raises(ConfigError, match=words) as caught:
        profile_from_config({**base, **change}, "x")
    assert "\n" not in str(caught.value)
