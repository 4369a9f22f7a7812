"""Model profiles against hand-computed numbers, and against the runtime's own accounting."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from p2pswarm.errors import ConfigError
from p2pswarm.models.files import load_profile, read_model_config
from p2pswarm.planner import BUILTIN_MODELS, profile_from_config
from p2pswarm.planner.costs import CostModel
from p2pswarm.planner.request import request_from_dict, resolve

LLAMA_3_8B = {  # Meta-Llama-3-8B/config.json
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
    "hidden_act": "silu", "torch_dtype": "bfloat16", "bos_token_id": 128000,
    "eos_token_id": 128001,
}
LLAMA_3_70B = {**LLAMA_3_8B, "hidden_size": 8192, "intermediate_size": 28672,
               "num_hidden_layers": 80, "num_attention_heads": 64}


def test_llama_3_8b_by_hand() -> None:
    p = profile_from_config(LLAMA_3_8B, "Meta-Llama-3-8B")
    embed = 128256 * 4096
    attention = 4096 * 4096 * 2 + 4096 * 1024 * 2  # q, o; k, v (8 kv heads x 128)
    mlp = 3 * 4096 * 14336
    per_layer = attention + mlp + 2 * 4096
    assert p.layer_params() == per_layer == 218_112_000
    assert p.total_params() == 32 * per_layer + 2 * embed + 4096 == 8_030_261_248
    assert p.kv_bytes_per_token_layer("f16") == 2 * 8 * 128 * 2
    assert p.n_layers * p.kv_bytes_per_token_layer("f16") == 2 * 8 * 128 * 2 * 32 == 131_072
    assert p.n_layers * p.kv_bytes_per_token_layer("f32") == 262_144
    assert p.layer_weight_bytes("f16") == per_layer * 2
    assert p.layer_weight_bytes("bf16") == per_layer * 2
    assert p.layer_weight_bytes("f32") == per_layer * 4


def test_llama_3_70b_by_hand() -> None:
    p = profile_from_config(LLAMA_3_70B, "Meta-Llama-3-70B")
    assert p.total_params() == 70_553_706_496
    assert p.n_layers * p.kv_bytes_per_token_layer("f16") == 2 * 8 * 128 * 2 * 80 == 327_680
    assert p.head_dim == 128 and p.n_kv_heads == 8


@pytest.mark.parametrize("name, params", [
    ("llama-2-7b", 6_738_415_616),
    ("llama-2-13b", 13_015_864_320),
    ("mistral-7b", 7_248_023_552),
    ("qwen2-7b", 7_615_616_512),  # q/k/v biases, untied
    ("qwen2-0.5b", 494_032_768),  # tied head
    ("tinyllama-1.1b", 1_100_048_384),
    ("smollm-135m", 134_515_008),  # tied head
])
def test_reference_models_match_their_published_sizes(name: str, params: int) -> None:
    assert load_profile(name).total_params() == params


def test_qwen2_biases_and_llama_attention_bias() -> None:
    qwen = load_profile("qwen2-7b")
    assert qwen.qkv_bias and not qwen.o_bias
    biased = profile_from_config({**LLAMA_3_8B, "attention_bias": True}, "b")
    plain = profile_from_config(LLAMA_3_8B, "p")
    assert biased.layer_params() - plain.layer_params() == 4096 + 1024 * 2 + 4096


def test_tied_and_untied_heads() -> None:
    tied = load_profile("smollm-135m")
    assert tied.head_params() == 0
    assert tied.head_bytes("f16", shares_embeddings=True) == 576 * 2
    # a tied head on another card than the embeddings needs its own copy
    assert tied.head_bytes("f16", shares_embeddings=False) == 576 * 2 + 49152 * 576 * 2
    untied = load_profile("llama-3-8b")
    assert untied.head_bytes("f16", True) == untied.head_bytes("f16", False)


def test_quantised_bytes() -> None:
    p = profile_from_config(LLAMA_3_8B, "x")
    shapes = [(4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096), (14336, 4096),
              (14336, 4096), (4096, 14336)]  # (out, in)
    # int8: fbgemm's packed layout (inputs up to a multiple of 512) and 12 bytes a row;
    # int4: rows of 32 outputs, 16 bytes of codes and a float16 scale and offset each
    int8 = sum(-(-i // 512) * 512 * o + 12 * o for o, i in shapes) + 2 * 4096 * 2
    int4 = sum(o // 32 * i * (16 + 4) for o, i in shapes) + 2 * 4096 * 2
    assert p.layer_weight_bytes("int8") == int8
    assert p.layer_weight_bytes("int4") == int4
    assert p.stage_buffer_bytes("int4") == 64 * 4 + 14336 * 4096 * 2  # RoPE + dequant buffer
    assert p.kv_bytes_per_token_layer("int8") == 2 * 8 * (128 + 4)  # f32 scale per head


def test_lora_parameters() -> None:
    p = profile_from_config(LLAMA_3_8B, "x")
    assert p.lora_params_layer(16, ("q_proj", "v_proj")) == 16 * (4096 + 4096) + 16 * (4096 + 1024)


def test_builtin_models_are_the_runtime_s() -> None:
    runtime = pytest.importorskip("p2pswarm.models.builtin")
    assert BUILTIN_MODELS == runtime.BUILTIN_MODELS
    assert load_profile("tiny-llama").n_layers == 8


@pytest.mark.parametrize("weights, kv", [("f32", "f32"), ("f16", "int8"), ("int8", "f16"),
                                         ("int4", "bf16")])
@pytest.mark.parametrize("first, last", [(True, False), (False, False), (False, True),
                                         (True, True)])
def test_claims_are_what_the_runtime_allocates(weights: str, kv: str, first: bool,
                                               last: bool) -> None:
    memory = pytest.importorskip("p2pswarm.runtime.memory")
    spec_module = pytest.importorskip("p2pswarm.runtime.spec")
    from p2pswarm.planner.profile import RUNTIME_KV, RUNTIME_WEIGHTS
    for name in BUILTIN_MODELS:
        profile = load_profile(name)
        r = resolve(request_from_dict({"weights_dtype": weights, "kv_dtype": kv,
                                       "context": 1024, "sequences": 3}), profile)
        n = profile.n_layers if first and last else 3
        claims = CostModel(profile, r, 1024).claims("cuda", n, first, last)
        start = 0 if first else profile.n_layers - n if last else 2
        end = start + n
        dtype, quant = RUNTIME_WEIGHTS[weights]
        spec = spec_module.StageSpec(start_layer=start, end_layer=end, dtype=dtype, quant=quant,
                                     kv_dtype=RUNTIME_KV[kv], max_context_tokens=1024,
                                     max_sessions=3)
        held = memory.stage_memory(profile.model_config(), spec)
        assert (claims.weights, claims.embeddings_head_buffers, claims.kv_cache) == \
            (held.weights_bytes, held.embeddings_head_buffers_bytes, held.kv_cache_bytes)


def test_model_from_a_directory_or_a_config_path(tmp_path: Path) -> None:
    model_dir = tmp_path / "Meta-Llama-3-8B"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(LLAMA_3_8B))
    assert load_profile(str(model_dir)).name == "Meta-Llama-3-8B"
    assert load_profile(str(model_dir / "config.json")).total_params() == 8_030_261_248
    name, config = read_model_config("tiny-llama")
    assert name == "tiny-llama" and config == BUILTIN_MODELS["tiny-llama"]


def test_unknown_or_bad_models_say_how_to_fix(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="tiny-llama, small-llama"):
        load_profile("no-such-model")
    (tmp_path / "config.json").write_text("{broken")
    with pytest.raises(ConfigError, match="JSON"):
        load_profile(str(tmp_path))
    with pytest.raises(ConfigError, match="not supported"):
        profile_from_config({**LLAMA_3_8B, "model_type": "gpt2"}, "x")
    with pytest.raises(ConfigError, match="hidden_size"):
        profile_from_config({k: v for k, v in LLAMA_3_8B.items() if k != "hidden_size"}, "x")


def test_the_planner_imports_no_torch_trio_sockets_or_random() -> None:
    import subprocess
    import sys

    code = ("import sys, p2pswarm.planner; "
            "print(sorted(m for m in ('torch', 'trio', 'socket', 'random', 'rich') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "[]"
