"""RWKV-7: the rwkv package's logits, chunked and step forms, stages, checkpoints, plans."""

from __future__ import annotations

import importlib
import itertools
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from p2pswarm.models import ModelConfig, save_checkpoint
from p2pswarm.models.loader import load_stage_model, open_model
from p2pswarm.models.rwkv7 import hf_tensor_map, hf_tensor_shape, wkv_chunked, wkv_step
from p2pswarm.models.rwkv7_pth import PthCheckpoint, convert_to_hf, save_pth
from p2pswarm.runtime import LocalPipeline, Sampler, Stage, StageSpec, stage_memory

HF = {"model_type": "rwkv7", "vocab_size": 97, "hidden_size": 64, "head_dim": 16,
      "num_hidden_layers": 6, "intermediate_size": 192, "decay_low_rank_dim": 8,
      "a_low_rank_dim": 8, "v_low_rank_dim": 4, "gate_low_rank_dim": 12}
CONFIG = ModelConfig.from_hf(HF)
PROMPT = [3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71, 73, 79]


pytestmark = pytest.mark.usefixtures("one_torch_thread_per_module")


def random_tensors(config: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Hugging Face names -> weights big enough that every part of the layer matters."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name in hf_tensor_map(config, 0, config.num_layers):
        shape = hf_tensor_shape(config, name)
        noise = torch.randn(shape, generator=generator)
        if name.endswith("norm.weight"):
            tensors[name] = 1 + 0.1 * noise
        elif len(shape) == 1:
            tensors[name] = 0.5 * noise
        else:
            tensors[name] = noise / shape[-1] ** 0.5
    return tensors


def with_layer0_values(tensors: dict[str, torch.Tensor], config: ModelConfig
                       ) -> dict[str, torch.Tensor]:
    """Some published files carry layer 0's (unused) value maps; add them."""
    C, rank = config.hidden_size, config.v_low_rank_dim
    extra = {"model.layers.0.attn.v_lora.lora.0.weight": torch.randn(rank, C),
             "model.layers.0.attn.v_lora.lora.2.weight": torch.randn(C, rank),
             "model.layers.0.attn.v_lora.lora.2.bias": torch.randn(C)}
    return {**tensors, **extra}


@pytest.fixture(scope="module")
def pth(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tensors = with_layer0_values(random_tensors(CONFIG, 1), CONFIG)
    return save_pth(tensors, True, tmp_path_factory.mktemp("pth") / "model.pth")


def import_rwkv() -> ModuleType:
    """The ``rwkv`` package's model module in RWKV-7 mode, CPU, no CUDA kernel."""
    saved = {k: os.environ.get(k) for k in ("RWKV_V7_ON", "RWKV_JIT_ON", "RWKV_CUDA_ON")}
    os.environ.update(RWKV_V7_ON="1", RWKV_JIT_ON="1", RWKV_CUDA_ON="0")
    try:
        sys.modules.pop("rwkv.model", None)
        return importlib.import_module("rwkv.model")
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


# --- the reference ---------------------------------------------------------------------------


def test_logits_equal_the_rwkv_package(pth: Path) -> None:
    pytest.importorskip("rwkv")
    reference = import_rwkv().RWKV(str(pth.with_suffix("")), "cpu fp32")
    one = LocalPipeline([Stage.load(PthCheckpoint(pth), StageSpec(0, CONFIG.num_layers,
                                                                  prefill_chunk_tokens=8))])
    ours = one.generate(PROMPT, 32, Sampler.greedy(), stop_token_ids=(), keep_logits=True)
    logits, state = reference.forward(PROMPT, None)
    expected = [logits]
    for token in ours.token_ids[:-1]:
        logits, state = reference.forward([token], state)
        expected.append(logits)
    assert len(ours.logits) == 32 and len(set(ours.token_ids)) > 3
    for step, (a, b) in enumerate(zip(ours.logits, expected)):
        assert (a.reshape(-1) - b).abs().max().item() < 1e-4, step
        assert int(b.argmax()) == ours.token_ids[step]


# --- the two forms ---------------------------------------------------------------------------


@pytest.mark.parametrize("T", [1, 5, 16, 37])
def test_chunked_and_step_forms_agree(T: int) -> None:
    generator = torch.Generator().manual_seed(T)
    B, H, N = 2, 3, 8

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator)

    r, k, v = randn(B, T, H, N), randn(B, T, H, N), randn(B, T, H, N)
    log_w = -0.606531 * torch.sigmoid(randn(B, T, H, N))
    kk = torch.nn.functional.normalize(randn(B, T, H, N), dim=-1)
    rate = torch.sigmoid(randn(B, T, H, N))
    state = randn(B, H, N, N)
    y1, s1 = wkv_step(state, r, log_w, k, v, -kk, kk * rate)
    y2, s2 = wkv_chunked(state, r, log_w, k, v, -kk, kk * rate)
    assert (y1 - y2).abs().max().item() < 1e-4 * max(1.0, y1.abs().max().item())
    assert (s1 - s2).abs().max().item() < 1e-4 * max(1.0, s1.abs().max().item())


def test_prefill_then_decode_equals_decoding_every_token(pth: Path) -> None:
    source = PthCheckpoint(pth)
    whole = Stage.load(source, StageSpec(0, CONFIG.num_layers, prefill_chunk_tokens=8))
    stepped = Stage.load(source, StageSpec(0, CONFIG.num_layers, prefill_chunk_tokens=1))
    a = whole.prefill("s", PROMPT, all_logits=True)
    b = stepped.prefill("s", PROMPT, all_logits=True)
    assert (a - b).abs().max().item() < 1e-4


# --- stages ----------------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["pth", "tiny-rwkv7"])
def test_three_stages_equal_one(model: str, pth: Path) -> None:
    source: object = PthCheckpoint(pth) if model == "pth" else model
    n = CONFIG.num_layers if model == "pth" else 6
    split = [(0, 2), (2, 4), (4, 6)] if model == "pth" else [(0, 1), (1, 4), (4, 6)]
    spec = {"prefill_chunk_tokens": 8, "max_sessions": 2}
    one = LocalPipeline([Stage.load(source, StageSpec(0, n, **spec))])  # type: ignore[arg-type]
    three = LocalPipeline([Stage.load(source, StageSpec(a, b, **spec))  # type: ignore[arg-type]
                           for a, b in split])
    x = one.generate(PROMPT, 20, Sampler.greedy(), stop_token_ids=(), keep_logits=True)
    y = three.generate(PROMPT, 20, Sampler.greedy(), stop_token_ids=(), keep_logits=True)
    assert x.token_ids == y.token_ids and len(y.token_ids) == 20
    for a, b in zip(x.logits, y.logits):
        assert (a - b).abs().max().item() <= 1e-4


def test_sessions_keep_their_own_state_and_the_memory_claim_is_exact(pth: Path) -> None:
    stage = Stage.load(PthCheckpoint(pth), StageSpec(0, CONFIG.num_layers, max_sessions=2,
                                                     max_context_tokens=64))
    alone = stage.prefill("a", PROMPT)
    stage.prefill("b", PROMPT[:5])
    stage.end_session("a")
    again = stage.prefill("a", PROMPT)  # a reused slot starts from the zero state
    assert torch.equal(alone, again)
    # a session may run past max_context_tokens: its state does not grow
    for _ in range(3):
        stage.prefill("b", PROMPT * 2)
    assert stage.session_length("b") == 5 + 3 * 2 * len(PROMPT) > 64
    for a, b in [(0, 2), (2, 5), (5, 6), (0, 6)]:
        part = Stage.load(PthCheckpoint(pth), StageSpec(a, b, max_sessions=3))
        assert part.allocated_bytes() == stage_memory(part.config, part.spec).total_bytes


# --- checkpoints -----------------------------------------------------------------------------


def test_every_layout_loads_to_the_same_model(pth: Path, tmp_path: Path) -> None:
    tensors = random_tensors(CONFIG, 1)
    reference = load_stage_model(PthCheckpoint(pth), 0, CONFIG.num_layers)
    ids = torch.tensor([PROMPT])
    expected = reference(ids)
    # the authors' layout without layer 0's value maps, found as a directory's one .pth
    (tmp_path / "bare").mkdir()
    save_pth(tensors, True, tmp_path / "bare" / "rwkv-x070.pth")
    # Hugging Face layout: vectors as (1, 1, C), layer 0's value maps present, bf16 too
    hf = {n: t.view(1, 1, -1) if n.rsplit(".", 1)[-1] in ("x_r", "x_k", "k_k") else t
          for n, t in with_layer0_values(tensors, CONFIG).items()}
    save_checkpoint(HF, list(hf.items()), tmp_path / "hf")
    save_checkpoint(HF, [(n, t.bfloat16()) for n, t in hf.items()], tmp_path / "bf16")
    save_pth({n: t.bfloat16() for n, t in tensors.items()}, True, tmp_path / "bf16.pth")
    convert_to_hf(tmp_path / "bare" / "rwkv-x070.pth", tmp_path / "converted")
    for where, tolerance in [("bare", 1e-6), ("hf", 1e-6), ("converted", 1e-6), ("bf16", 0.5),
                             ("bf16.pth", 0.5)]:
        model = load_stage_model(open_model(tmp_path / where), 0, CONFIG.num_layers)
        got = model(ids)
        assert (got - expected).abs().max().item() < tolerance, where
        if tolerance < 1:
            assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_a_file_that_is_not_rwkv7_gets_one_line(tmp_path: Path) -> None:
    from p2pswarm.errors import ConfigError

    torch.save({"emb.weight": torch.zeros(4, 4)}, tmp_path / "x.pth")
    with pytest.raises(ConfigError, match="not an RWKV-7 checkpoint"):
        open_model(tmp_path / "x.pth")
    (tmp_path / "bad.pth").write_bytes(b"not a pickle")
    with pytest.raises(ConfigError, match="cannot read"):
        open_model(tmp_path / "bad.pth")


# --- training --------------------------------------------------------------------------------


def test_three_stage_training_equals_one_process() -> None:
    from p2pswarm.training.job import LrSchedule, OptimizerConfig
    from p2pswarm.training.pipeline import LocalTrainPipeline
    from p2pswarm.training.source import ScratchModel, trainable_stage
    from p2pswarm.training.stage import TrainStage

    optimizer = OptimizerConfig(weight_decay=0.1, grad_clip=1.0)
    lr = LrSchedule(peak_lr=3e-3, min_lr=3e-4, warmup_steps=4, total_steps=20)
    config = {**HF, "vocab_size": 32, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 3}
    source = ScratchModel(config, seed=0)
    generator = torch.Generator().manual_seed(0)
    # a learnable stream: each token is the one before plus one, modulo the vocabulary
    starts = torch.randint(0, 32, (20, 2, 2, 1), generator=generator)
    batches = [(s + torch.arange(17)) % 32 for s in starts]

    def run(cut: list[int]) -> list[float]:
        bounds = [0, *cut, 3]
        stages = [TrainStage(trainable_stage(source, a, b), optimizer)
                  for a, b in itertools.pairwise(bounds)]
        pipeline = LocalTrainPipeline(stages, lr=lr, schedule="1f1b")
        return [pipeline.train_step(batch) for batch in batches]

    one, three = run([]), run([1, 2])
    assert max(abs(a - b) for a, b in zip(one, three)) < 1e-4
    assert three[-1] < three[0] - 1.0  # and it learns


# --- the plan --------------------------------------------------------------------------------


def test_plan_shows_state_bytes_that_do_not_grow_with_context() -> None:
    from p2pswarm.planner.costs import CostModel
    from p2pswarm.planner.profile import BUILTIN_MODELS, profile_from_config
    from p2pswarm.planner.request import PlanRequest, resolve

    profile = profile_from_config(BUILTIN_MODELS["tiny-rwkv7"], "tiny-rwkv7")
    claims = []
    for context in (1024, 16384):
        request = resolve(PlanRequest(kind="serve", context=context, sequences=3), profile)
        claims.append(CostModel(profile, request, context).claims("cpu", 6, True, True))
    assert claims[0].kv_cache == claims[1].kv_cache > 0
    config = profile.model_config()
    per_session = 6 * (2 * config.hidden_size * 2 + 4 * config.num_heads * config.head_dim**2)
    assert claims[0].kv_cache == 3 * per_session  # f16 shifts, f32 WKV matrices


# --- the World tokenizer ---------------------------------------------------------------------


def test_world_tokenizer_takes_the_longest_match(tmp_path: Path) -> None:
    from p2pswarm.errors import ConfigError
    from p2pswarm.models.tokenizer import WORLD_VOCAB_FILE, WorldTokenizer, load_tokenizer

    lines = ["1 'a' 1", "2 'b' 1", "3 'ab' 2", "4 'abb' 3", "5 b'\\xc3' 1", "6 b'\\xa9' 1",
             "7 '\\n' 1", "8 'é' 2"]
    (tmp_path / WORLD_VOCAB_FILE).write_text("\n".join(lines) + "\n", encoding="utf-8")
    tokenizer = load_tokenizer(tmp_path)
    assert isinstance(tokenizer, WorldTokenizer)
    assert tokenizer.encode("abbab\na") == [4, 3, 7, 1]
    assert tokenizer.encode("é") == [8] and tokenizer.decode([5, 6]) == "é"
    assert tokenizer.eos_ids == (0,) and tokenizer.vocab_size == 9
    with pytest.raises(ConfigError, match="no token"):
        tokenizer.encode("c")
    for bad in ["1 __import__('os') 1", "x 'a' 1", "1 'ab' 1", "0 'a' 1"]:
        (tmp_path / "bad.txt").write_text(bad + "\n", encoding="utf-8")
        with pytest.raises(ConfigError, match="bad.txt:1"):
            WorldTokenizer(tmp_path / "bad.txt")


def test_world_tokenizer_equals_the_rwkv_package() -> None:
    pytest.importorskip("rwkv")
    from rwkv.rwkv_tokenizer import TRIE_TOKENIZER

    from p2pswarm.models.tokenizer import WORLD_VOCAB_FILE, WorldTokenizer

    vocab = Path(importlib.import_module("rwkv").__file__ or "").parent / WORLD_VOCAB_FILE
    ours, theirs = WorldTokenizer(vocab), TRIE_TOKENIZER(str(vocab))
    for text in ["Hello, world!", "The Goose 🪿 says: über —\n\n   spaces\t", "\x00\xff"]:
        ids = ours.encode(text)
        assert ids == theirs.encode(text) and ours.decode(ids) == text


# --- served by a swarm: two stages on two fellows, token-id prompts --------------------------


def test_a_swarm_serves_rwkv7_over_two_fellows_from_token_ids(tmp_path: Path) -> None:
    import openai

    from p2pswarm.runtime import Stage as LocalStage
    from tests.http_swarm import LoopbackSwarm, serve_message

    ids = [72, 101, 108, 108, 111]
    whole = LocalPipeline([LocalStage.load("tiny-rwkv7", StageSpec(0, 6))])
    expected = whole.generate(ids, 8, Sampler.greedy(), stop_token_ids=())
    with LoopbackSwarm(tmp_path) as swarm:
        agent = swarm.agents[1]
        loaded = swarm.call(agent.control_ops["load"],
                            {"op": "load", "request": serve_message("tiny-rwkv7")})
        assert len(loaded["stages"]) == 2  # v_first crosses the network with the hidden state
        got = swarm.call(agent.control_ops["generate"], {
            "op": "generate", "prompt_ids": ids, "max_tokens": 8, "temperature": 0.0,
            "stop_token_ids": []})
        assert got["token_ids"] == list(expected.token_ids)
        text = swarm.call(agent.control_ops["generate"], {
            "op": "generate", "prompt": "Hello", "max_tokens": 8, "temperature": 0.0,
            "stop_token_ids": []})
        assert text["prompt_tokens"] == 6  # bos, then the five bytes
        with openai.OpenAI(base_url=f"{swarm.url(1)}/v1", api_key="unused", max_retries=0,
                           timeout=60) as client:
            answer = client.completions.create(model="tiny-rwkv7", prompt=ids, max_tokens=8,
                                               temperature=0)
            assert answer.usage is not None and answer.usage.prompt_tokens == len(ids)
            with pytest.raises(openai.BadRequestError, match="token ids"):
                client.completions.create(model="tiny-rwkv7", prompt=[1, -2], max_tokens=2)
        with pytest.raises(Exception, match="prompt_ids"):
            swarm.call(agent.control_ops["generate"], {"op": "generate", "prompt_ids": [],
                                                       "max_tokens": 2})


def test_generate_takes_prompt_ids_or_a_prompt_not_both() -> None:
    from typer.testing import CliRunner

    from p2pswarm.cli import app

    runner = CliRunner()
    for args, words in [(["hi", "--prompt-ids", "1,2"], "one of the two"),
                        ([], "one of the two"), (["--prompt-ids", "1,x"], "separated by commas"),
                        (["--prompt-ids", "-3"], "none negative")]:
        result = runner.invoke(app, ["generate", *args])
        assert result.exit_code != 0 and words in result.output, (args, result.output)


def test_lora_adapts_rwkv7_linear_maps() -> None:
    from p2pswarm.errors import ConfigError
    from p2pswarm.training.job import LoraConfig
    from p2pswarm.training.lora import LoRALinear, apply_lora
    from p2pswarm.training.source import trainable_stage

    model = trainable_stage(open_model("tiny-rwkv7"), 0, 6)
    ids = torch.tensor([[256, 72, 105]])
    before = model(ids).detach()
    names = apply_lora(model, LoraConfig(rank=4, targets=("q_proj", "v_proj", "down_proj")), 0)
    adapted = {n.rsplit(".", 1)[0] for n in names}
    assert adapted == {f"layers.{i}.{m}" for i in range(6)
                       for m in ("attn.r_proj", "attn.v_proj", "ffn.value")}
    assert all(isinstance(model.get_submodule(n), LoRALinear) for n in adapted)
    after = model(ids)
    assert torch.equal(after.detach(), before)  # B starts at zero
    after.sum().backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if n in names)
    with pytest.raises(ConfigError, match="not a linear map"):
        apply_lora(trainable_stage(open_model("tiny-rwkv7"), 0, 1),
                   LoraConfig(rank=2, targets=("w_lora",)), 0)


def test_trained_stages_export_to_a_directory_that_loads(tmp_path: Path) -> None:
    from p2pswarm.training.export import export_hf
    from p2pswarm.training.source import ScratchModel, trainable_stage

    source = ScratchModel(HF, seed=2)
    stages = [trainable_stage(source, a, b) for a, b in [(0, 2), (2, 6)]]
    out = export_hf(stages, HF, tmp_path / "exported")
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        expected = stages[1](stages[0](ids))
        got = load_stage_model(open_model(out), 0, CONFIG.num_layers)(ids)
    assert torch.equal(got, expected)
