"""The decoder, its configs, checkpoint reading, built-ins, quantization and tokenizers."""

from __future__ import annotations

import ctypes
import hashlib
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from p2pswarm.errors import ConfigError
from p2pswarm.models import (
    BUILTIN_MODELS,
    BuiltinModel,
    ByteTokenizer,
    Checkpoint,
    HFTokenizer,
    ModelConfig,
    RopeScaling,
    hf_tensor_map,
    linear_weight_bytes,
    load_stage_model,
    load_tokenizer,
    read_tensor_bytes,
    save_checkpoint,
    stage_tensor_names,
    stage_tensors,
    tensor_sha256,
    write_builtin_checkpoint,
)
from p2pswarm.models import checkpoint as checkpoint_module
from p2pswarm.models.llama import hf_tensor_shape, rope_inv_freq
from p2pswarm.models.quant import (
    ERROR_BOUND,
    DequantWorkspace,
    Int4Linear,
    Int8Linear,
    default_kernel,
    packed_bytes,
    quantize_linear,
)
from p2pswarm.shapes.footprint import dequant_workspace_bytes

SMALL = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
         "num_attention_heads": 4, "max_position_embeddings": 512, "rms_norm_eps": 1e-6}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def random_checkpoint(tmp_path: Path, hf: dict, *, std: float = 0.1, seed: int = 0,
                      max_shard_bytes: int | None = None) -> Checkpoint:
    """A model directory with random weights for ``hf`` (no transformers needed)."""
    config = ModelConfig.from_hf(hf)
    generator = torch.Generator().manual_seed(seed)
    tensors = []
    for name in hf_tensor_map(config, 0, config.num_layers):
        shape = hf_tensor_shape(config, name)
        if name.endswith("norm.weight"):
            t = 1 + 0.1 * torch.randn(shape, generator=generator)
        else:
            t = std * torch.randn(shape, generator=generator)
        tensors.append((name, t))
    return Checkpoint(save_checkpoint(hf, tensors, tmp_path / "model",
                                      max_shard_bytes=max_shard_bytes))


# --- config -------------------------------------------------------------------------------


def test_config_reads_transformers_4_layout() -> None:
    hf = {**SMALL, "model_type": "llama", "num_key_value_heads": 2, "rope_theta": 500000.0,
          "rope_scaling": {**LLAMA3, "rope_type": "llama3"}, "eos_token_id": [5, 6],
          "bos_token_id": 1, "tie_word_embeddings": True}
    c = ModelConfig.from_hf(hf)
    assert (c.num_kv_heads, c.head_dim, c.rope_theta) == (2, 16, 500000.0)
    assert c.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 64)
    assert c.eos_token_ids == (5, 6) and c.bos_token_id == 1 and c.tie_word_embeddings
    old = ModelConfig.from_hf({**SMALL, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert old.rope_scaling == RopeScaling("linear", 2.0)
    assert ModelConfig.from_hf(c.to_hf()) == c


def test_config_biases_by_family() -> None:
    qwen = ModelConfig.from_hf({**SMALL, "model_type": "qwen2", "num_key_value_heads": 2})
    assert qwen.qkv_bias and not qwen.o_bias
    llama = ModelConfig.from_hf({**SMALL, "attention_bias": True, "mlp_bias": True})
    assert llama.qkv_bias and llama.o_bias and llama.mlp_bias


@pytest.mark.parametrize("bad", [
    {"model_type": "gpt2"},
    {"hidden_act": "gelu"},
    {"model_type": "qwen2", "use_sliding_window": True},
    {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
    {"num_key_value_heads": 3},
    {"hidden_size": None},
])
def test_config_refuses_what_it_cannot_run(bad: dict) -> None:
    with pytest.raises(ConfigError):
        ModelConfig.from_hf({**SMALL, **bad})


def test_config_names_a_missing_key() -> None:
    with pytest.raises(ConfigError, match="vocab_size"):
        ModelConfig.from_hf({k: v for k, v in SMALL.items() if k != "vocab_size"})


def test_llama3_rope_matches_its_formula_in_all_three_bands() -> None:
    c = ModelConfig.from_hf({**SMALL, "rope_theta": 500000.0, "rope_scaling": LLAMA3})
    plain = rope_inv_freq(ModelConfig.from_hf({**SMALL, "rope_theta": 500000.0}))
    scaled = rope_inv_freq(c)
    wavelen = 2 * math.pi / plain
    high, low = wavelen < 64 / 4, wavelen > 64 / 1
    middle = ~high & ~low
    assert high.any() and low.any() and middle.any()
    assert torch.equal(scaled[high], plain[high])
    assert torch.allclose(scaled[low], plain[low] / 8)
    smooth = (64 / wavelen[middle] - 1) / (4 - 1)
    expected = (1 - smooth) * plain[middle] / 8 + smooth * plain[middle]
    assert torch.allclose(scaled[middle], expected)
    linear = ModelConfig.from_hf({**SMALL, "rope_scaling": {"rope_type": "linear", "factor": 4}})
    assert torch.allclose(rope_inv_freq(linear),
                          rope_inv_freq(ModelConfig.from_hf(SMALL)) / 4)


# --- equality with transformers ------------------------------------------------------------

HF_CASES = {
    "llama-gqa-tied-llama3": ("llama", {"num_key_value_heads": 2, "tie_word_embeddings": True,
                                        "rope_theta": 500000.0, "rope_scaling": LLAMA3}),
    "llama-mha-untied-linear": ("llama", {"num_key_value_heads": 4,
                                          "rope_scaling": {"rope_type": "linear",
                                                           "factor": 4.0}}),
    "llama-gqa-untied-bias": ("llama", {"num_key_value_heads": 1, "attention_bias": True,
                                        "mlp_bias": True, "head_dim": 32}),
    "qwen2-gqa-bias-untied": ("qwen2", {"num_key_value_heads": 2}),
    "qwen2-mha-bias-tied": ("qwen2", {"num_key_value_heads": 4, "tie_word_embeddings": True}),
}


@pytest.mark.parametrize("case", sorted(HF_CASES))
def test_logits_equal_transformers(case: str, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers", reason="transformers is a test extra")
    family, extra = HF_CASES[case]
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[family]
    hf_config = config_cls(**SMALL, **extra)
    torch.manual_seed(0)
    reference = model_cls(hf_config).eval()
    with torch.no_grad():
        for name, p in reference.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    state = reference.state_dict()
    if hf_config.tie_word_embeddings:
        state.pop("lm_head.weight")
    save_checkpoint(hf_config.to_dict(), list(state.items()), tmp_path,
                    max_shard_bytes=60_000 if "gqa" in case else None)
    ours = load_stage_model(Checkpoint(tmp_path), 0, SMALL["num_hidden_layers"])
    ids = torch.randint(0, SMALL["vocab_size"], (2, 80), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(ids).logits
        got = ours(ids)
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() <= 1e-5


# --- checkpoints ---------------------------------------------------------------------------


class ReadRecorder:
    """Stands in for safe_open and notes every tensor read."""

    def __init__(self, real_safe_open) -> None:  # type: ignore[no-untyped-def]
        self.real_safe_open = real_safe_open
        self.names: list[str] = []

    def __call__(self, path: str, framework: str, device: str):  # type: ignore[no-untyped-def]
        recorder, handle = self, self.real_safe_open(path, framework=framework, device=device)

        class Handle:
            def __enter__(self):  # type: ignore[no-untyped-def]
                self.inner = handle.__enter__()
                return self

            def __exit__(self, *exc):  # type: ignore[no-untyped-def]
                return handle.__exit__(*exc)

            def get_tensor(self, name: str) -> torch.Tensor:
                recorder.names.append(name)
                return self.inner.get_tensor(name)

        return Handle()


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> ReadRecorder:
    rec = ReadRecorder(checkpoint_module.safe_open)
    monkeypatch.setattr(checkpoint_module, "safe_open", rec)
    return rec


def layer_tensor_names(i: int) -> set[str]:
    return {f"model.layers.{i}.{part}" for part in (
        "input_layernorm.weight", "post_attention_layernorm.weight",
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
        "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
        "mlp.down_proj.weight")}


@pytest.mark.parametrize("tied", [False, True])
def test_stage_reads_only_its_tensors_from_a_sharded_checkpoint(
        tmp_path: Path, recorder: ReadRecorder, tied: bool) -> None:
    hf = {**SMALL, "num_key_value_heads": 2, "tie_word_embeddings": tied}
    ckpt = random_checkpoint(tmp_path, hf, max_shard_bytes=50_000)
    assert (tmp_path / "model" / "model.safetensors.index.json").exists()
    whole = load_stage_model(ckpt, 0, 4)
    recorder.names.clear()
    last = load_stage_model(ckpt, 2, 4)
    head = "model.embed_tokens.weight" if tied else "lm_head.weight"
    expected = layer_tensor_names(2) | layer_tensor_names(3) | {"model.norm.weight", head}
    assert sorted(recorder.names) == sorted(expected)  # each once, nothing else
    recorder.names.clear()
    load_stage_model(ckpt, 0, 1)
    assert sorted(recorder.names) == sorted(layer_tensor_names(0) | {"model.embed_tokens.weight"})
    recorder.names.clear()
    load_stage_model(ckpt, 1, 2)
    assert sorted(recorder.names) == sorted(layer_tensor_names(1))
    # the tied head of a last stage equals the first stage's embedding
    head = last.lm_head.weight if last.lm_head is not None else None
    assert head is not None and whole.embed_tokens is not None
    assert torch.equal(head, whole.embed_tokens.weight) == tied


def test_stage_tensor_listing_gives_files_sizes_and_hashes(tmp_path: Path) -> None:
    from safetensors import safe_open

    hf = {**SMALL, "num_key_value_heads": 2, "model_type": "qwen2"}
    ckpt = random_checkpoint(tmp_path, hf, max_shard_bytes=40_000)
    entries = stage_tensors(ckpt, 1, 3)
    assert [e.name for e in entries] == stage_tensor_names(ckpt.config, 1, 3)
    assert "model.layers.1.self_attn.q_proj.bias" in {e.name for e in entries}
    assert len({e.file for e in entries}) > 1
    for e in entries:
        with safe_open(str(ckpt.model_dir / e.file), framework="pt", device="cpu") as f:
            t = f.get_tensor(e.name)
        raw = bytes(t.contiguous().reshape(-1).view(torch.uint8).tolist())
        assert e.nbytes == len(raw) and e.shape == tuple(t.shape) and e.dtype == "F32"
        assert read_tensor_bytes(ckpt, e) == raw
        assert tensor_sha256(ckpt, e) == hashlib.sha256(raw).hexdigest()


def test_checkpoint_errors_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config.json"):
        Checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(SMALL))
    with pytest.raises(ConfigError, match="safetensors"):
        Checkpoint(tmp_path)
    ckpt = random_checkpoint(tmp_path, SMALL)
    with pytest.raises(ConfigError, match="no tensor"):
        ckpt.entry("model.layers.9.mlp.up_proj.weight")
    wrong = {**SMALL, "intermediate_size": 128}
    (ckpt.model_dir / "config.json").write_text(json.dumps(wrong))
    with pytest.raises(ConfigError, match="shape"):
        load_stage_model(Checkpoint(ckpt.model_dir), 0, 1)


# --- built-in models -----------------------------------------------------------------------


def test_builtin_weights_do_not_depend_on_the_split(tmp_path: Path) -> None:
    whole = load_stage_model(BuiltinModel("tiny-llama"), 0, 8)
    middle = load_stage_model(BuiltinModel("tiny-llama"), 3, 5)
    for j, i in enumerate((3, 4)):
        for (name, a), (_, b) in zip(whole.layers[i].named_parameters(),
                                     middle.layers[j].named_parameters()):
            assert torch.equal(a, b), name
    # and a saved copy loads to the same weights
    saved = load_stage_model(Checkpoint(write_builtin_checkpoint("tiny-llama", tmp_path)), 3, 5)
    for a, b in zip(middle.parameters(), saved.parameters()):
        assert torch.equal(a, b)


def test_builtin_configs() -> None:
    tiny = BuiltinModel("tiny-llama").config
    assert (tiny.num_layers, tiny.hidden_size, tiny.num_heads, tiny.num_kv_heads,
            tiny.vocab_size, tiny.max_context_tokens) == (8, 256, 4, 2, 259, 2048)
    assert tiny.bos_token_id == ByteTokenizer.bos_id and tiny.eos_token_ids == (257,)
    small = BuiltinModel("small-llama").config
    assert small.num_layers > tiny.num_layers and small.hidden_size > tiny.hidden_size
    assert set(BUILTIN_MODELS) >= {"tiny-llama", "small-llama"}
    with pytest.raises(ConfigError, match="built-in"):
        BuiltinModel("huge-llama")


# --- quantization --------------------------------------------------------------------------


KERNELS = ["reference"] + (["fbgemm"] if default_kernel("int8") == "fbgemm" else [])


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("shape", [(96, 128), (100, 70)])  # (out, in): groups fit, or not
@pytest.mark.parametrize("scheme,group,tolerance", [
    ("int8", 32, 0.03), ("int4", 32, 0.15), ("int4", 64, 0.15)])
def test_quantized_linear_is_close_and_takes_the_stated_bytes(
        scheme: str, group: int, tolerance: float, shape: tuple[int, int], kernel: str) -> None:
    """Stated tolerance: relative error of the output (bias taken out) below 3% for int8
    (fbgemm keeps 7-bit activations: about 1.5%; the reference about 0.7%), 15% for 4-bit
    (about 8%), at one row (decode), a few (batched decode) and many (prefill)."""
    out_f, in_f = shape
    g = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(out_f, in_f, generator=g) * 0.05, torch.randn(out_f, generator=g)
    workspace = DequantWorkspace(out_f * in_f, torch.float32, torch.device("cpu"))
    layer: Int8Linear | Int4Linear = (
        Int8Linear.from_float(weight, bias, workspace, kernel) if scheme == "int8"
        else Int4Linear.from_float(weight, bias, workspace, group, kernel))
    assert layer.kernel == kernel
    for rows in (1, 3, 40):
        x = torch.randn(rows, in_f, generator=g)
        exact = torch.nn.functional.linear(x, weight, bias)
        error = (layer(x) - exact).norm() / (exact - bias).norm()
        assert error < tolerance, rows
        assert layer(x.view(1, rows, in_f)).shape == (1, rows, out_f)
    held = sum(b.numel() * b.element_size() for b in layer.buffers()) + packed_bytes(layer)
    stated = linear_weight_bytes(in_f, out_f, scheme=scheme, dtype_bytes=4, group_size=group)
    if scheme == "int8" and kernel == "reference":
        assert held == out_f * in_f + 4 * out_f  # unpadded: less than the packed layout
    else:
        assert held == stated
    if scheme == "int4":
        assert held == -(-out_f // group) * in_f * (group // 2 + 4)
    # the weight itself is close, and dequantizing twice gives the same weight: the
    # workspace is scratch, not state
    assert (layer.dequantize() - weight).norm() / weight.norm() < ERROR_BOUND[scheme] / 2
    assert torch.equal(layer.dequantize().clone(), layer.dequantize())


@pytest.mark.skipif(KERNELS == ["reference"] or not Path("/proc/self").exists(),
                    reason="fbgemm's layout on x86 with glibc")
def test_packed_int8_bytes_are_what_fbgemm_allocates() -> None:
    """malloc's own count of what prepacking allocates equals the stated bytes (within
    the allocator's headers), for shapes that are and are not multiples of its blocks."""
    libc = ctypes.CDLL("libc.so.6")

    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in
                    "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks "
                    "keepcost".split()]

    libc.mallinfo2.restype = MallInfo2

    def in_use() -> int:
        info = libc.mallinfo2()
        return int(info.uordblks + info.hblkhd)

    workspace = DequantWorkspace(1, torch.float32, torch.device("cpu"))
    kept = []
    for out_f, in_f in ((2816, 1024), (1024, 2816), (300, 1000)):
        weight = torch.randn(out_f, in_f) * 0.02
        q = torch.round(weight * 100).clamp(-127, 127).to(torch.int8)
        scales = torch.full((out_f,), 0.01)
        before = in_use()
        kept.append(Int8Linear(q, scales, None, workspace, "fbgemm"))
        grown = in_use() - before
        stated = linear_weight_bytes(in_f, out_f, scheme="int8", dtype_bytes=4)
        assert abs(grown - stated) < 8192, (out_f, in_f, grown, stated)


def test_quantized_stage_logits_stay_close(tmp_path: Path) -> None:
    """Whole-model tolerance on random weights, where nothing hides the rounding noise:
    relative logit error below 8% for int8 (fbgemm's 7-bit activations: about 6%; the
    reference kernel's about 3%) and 45% for int4, same direction overall."""
    hf = {**SMALL, "num_key_value_heads": 2, "intermediate_size": 128}
    ckpt = random_checkpoint(tmp_path, hf, std=0.05)
    ids = torch.randint(0, SMALL["vocab_size"], (1, 40), generator=torch.Generator().manual_seed(2))
    exact = load_stage_model(ckpt, 0, 4)(ids)
    for scheme, group, tolerance in (("int8", 32, 0.08), ("int4", 32, 0.45),
                                     ("int4", 64, 0.45)):
        model = load_stage_model(ckpt, 0, 4, quant=scheme, group_size=group)
        assert isinstance(model.layers[0].mlp.up_proj, Int8Linear if scheme == "int8"
                          else Int4Linear)
        assert model.workspace is not None
        assert model.workspace.buffer.numel() * 4 == dequant_workspace_bytes(
            ckpt.config, dtype="float32")
        got = model(ids)
        assert (got - exact).norm() / exact.norm() < tolerance, (scheme, group)
        assert torch.cosine_similarity(got.flatten(), exact.flatten(), dim=0) > 0.9


def test_quantization_refuses_bad_settings(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        load_stage_model(BuiltinModel("tiny-llama"), 0, 1, quant="int4", group_size=48)
    with pytest.raises(ConfigError):
        load_stage_model(BuiltinModel("tiny-llama"), 0, 1, quant="int3")
    ckpt = random_checkpoint(tmp_path, SMALL)  # intermediate 96 does not split into 64s:
    load_stage_model(ckpt, 0, 1, quant="int4", group_size=64)  # padded, not refused
    # weights too small for 4-bit's float16 scales (they would all read as zero), and a
    # weight that is not finite: refused, with the error and the bound in one line
    workspace = DequantWorkspace(64 * 64, torch.float32, torch.device("cpu"))
    tiny = torch.randn(64, 64) * 1e-9
    with pytest.raises(ConfigError, match=r"by 100\.0% \(bound 25%\)"):
        quantize_linear(tiny, None, scheme="int4", group_size=32, workspace=workspace)
    quantize_linear(tiny, None, scheme="int8", group_size=32, workspace=workspace)
    broken = torch.randn(64, 64)
    broken[3, 5] = math.inf
    with pytest.raises(ConfigError, match="bound"):
        quantize_linear(broken, None, scheme="int8", group_size=32, workspace=workspace)


def test_reduced_precision_stage_runs_close_to_float32() -> None:
    ids = torch.arange(30).unsqueeze(0)
    exact = load_stage_model(BuiltinModel("tiny-llama"), 0, 8)(ids)
    half = load_stage_model(BuiltinModel("tiny-llama"), 0, 8, dtype="bfloat16")
    assert half.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    assert (half(ids) - exact).abs().max() < 0.05 * exact.abs().max()


# --- tokenizers ----------------------------------------------------------------------------


def test_byte_tokenizer_round_trips() -> None:
    tok = ByteTokenizer()
    ids = tok.encode("héllo, swarm ☃")
    assert ids[0] == tok.bos_id and all(0 <= i < 256 for i in ids[1:])
    assert tok.decode(ids + [tok.eos_id, tok.pad_id]) == "héllo, swarm ☃"
    assert tok.decode([0xE2, 0x98]) == "\ufffd"  # a cut-off character shows, never raises
    assert load_tokenizer("tiny-llama") == tok


def test_hf_tokenizer_reads_tokenizer_json(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "swarm": 4}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(["<s>", "</s>"])
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 1)])
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "config.json").write_text(json.dumps({**SMALL, "bos_token_id": 1,
                                                      "eos_token_id": [2]}))
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, HFTokenizer)
    assert tok.encode("hello swarm") == [1, 3, 4]
    assert tok.encode("hello swarm", add_bos=False) == [3, 4]
    assert tok.decode([1, 3, 4, 2]) == "hello swarm"
    assert (tok.bos_id, tok.eos_ids, tok.vocab_size) == (1, (2,), 5)
    with pytest.raises(ConfigError):
        HFTokenizer(tmp_path / "missing")


def test_pure_parts_import_without_torch() -> None:
    code = ("import sys, p2pswarm.shapes, p2pswarm.shapes.model_config, p2pswarm.shapes.footprint, "
            "p2pswarm.runtime.spec, p2pswarm.runtime.memory; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
