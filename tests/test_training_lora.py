"""LoRA: the base never changes, adapters learn, only adapters are synced and saved, and
saved adapters reproduce the trained model on top of the base (float or quantized)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from p2pswarm.models.loader import load_stage_model
from p2pswarm.models.quant import DequantWorkspace, Int4Linear
from p2pswarm.training.data import TokenData
from p2pswarm.training.job import JobConfig, LoraConfig
from p2pswarm.training.lora import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    FrozenQuantizedLinear,
    apply_lora,
    base_tensors,
    load_adapters,
    read_adapter_config,
)
from p2pswarm.training.run import LocalRun
from p2pswarm.training.source import ScratchModel, trainable_stage
from tests.byte_llama import byte_llama, byte_token_data

MODEL = byte_llama(hidden_size=64, layers=4, positions=64, tied=False)


pytestmark = pytest.mark.usefixtures("one_torch_thread_per_module")


@pytest.fixture(scope="module")
def data() -> TokenData:
    return byte_token_data()


def lora_job(base_dtype: str, codec: str = "fp32") -> JobConfig:
    return JobConfig.from_dict({
        "model": {"config": MODEL}, "seq_len": 32, "micro_batch": 4, "steps": 12,
        "lr": {"peak": 1e-2}, "mode": "lora",
        "lora": {"rank": 4, "alpha": 8, "targets": ["q_proj", "v_proj", "down_proj"],
                 "base_dtype": base_dtype},
        "sync": {"inner_steps": 4, "codec": codec}})


def base_digest(run: LocalRun) -> str:
    digest = hashlib.sha256()
    for replica in run.replicas:
        for stage in replica.stages:
            for name, tensor in base_tensors(stage.model):
                digest.update(name.encode())
                digest.update(tensor.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


@pytest.mark.parametrize("base_dtype", ["f32", "int8", "int4"])
def test_base_frozen_adapters_learn_and_only_adapters_travel(base_dtype: str,
                                                             data: TokenData) -> None:
    job = lora_job(base_dtype)
    run = LocalRun(job, replicas=2, cut=[2], data=data)
    before = base_digest(run)
    adapters_before = [p.detach().clone() for s in run.replicas[0].stages for p in s.trainable]
    losses = run.run()
    assert base_digest(run) == before  # not one bit of the base moved
    adapters_after = [p.detach() for s in run.replicas[0].stages for p in s.trainable]
    assert all(not torch.equal(a, b) for a, b in zip(adapters_before, adapters_after))
    assert losses[-1] < losses[0]
    # what is synced is the adapters, nothing else: per stage, 2 layers x 3 targets
    per_stage = 2 * (4 * 64 + 64 * 4 + 4 * 64 + 32 * 4 + 4 * 128 + 64 * 4)
    for stage, sync in zip(run.replicas[0].stages, run.replicas[0].syncs):
        names = [n for n, _ in stage.named_trainable]
        assert all(".lora_A" in n or ".lora_B" in n for n in names)
        assert sync.numel == per_stage
    # fp32 frames: 12-byte header and 4 bytes a value, up from each replica and back down
    rounds = job.steps // job.sync.inner_steps
    assert run.bytes_sent == rounds * 2 * 2 * 2 * (12 + 4 * per_stage)


def test_adapters_alone_are_saved_and_reproduce_the_model(tmp_path: Path,
                                                          data: TokenData) -> None:
    job = lora_job("int8", codec="int8")
    run = LocalRun(job, replicas=2, cut=[1], data=data)
    run.run()
    out = run.save_adapters(tmp_path / "adapters")
    assert sorted(p.name for p in out.iterdir()) == [ADAPTER_CONFIG, ADAPTER_WEIGHTS]
    saved = load_file(str(out / ADAPTER_WEIGHTS))
    assert all(".lora_A.weight" in n or ".lora_B.weight" in n for n in saved)
    assert {n.split(".")[4] for n in saved} == {"0", "1", "2", "3"}  # global layer numbers
    assert sum(t.numel() for t in saved.values()) == sum(
        s.numel for s in run.replicas[0].syncs)
    config = read_adapter_config(out)
    assert config == LoraConfig(rank=4, alpha=8.0, targets=("q_proj", "v_proj", "down_proj"),
                                base_dtype="int8")
    # serving: the base as the runtime loads it, adapters on top, one stage for all layers
    served = load_stage_model(run.source, 0, 4, quant="int8")
    load_adapters(served, out)
    ids = data.holdout[:33].unsqueeze(0)
    with torch.no_grad():
        x = ids[:, :-1]
        for stage in run.replicas[0].stages:
            x = stage.model(x)
        assert torch.allclose(served(ids[:, :-1]), x, atol=1e-4)


def test_a_fresh_adapter_changes_nothing() -> None:
    source = ScratchModel(MODEL, seed=3)
    plain = trainable_stage(source, 0, 4)
    adapted = trainable_stage(source, 0, 4)
    names = apply_lora(adapted, LoraConfig(rank=2, targets=("k_proj", "up_proj")), seed=0)
    assert len(names) == 4 * 2 * 2
    ids = torch.randint(0, 259, (2, 16))
    with torch.no_grad():
        assert torch.equal(plain(ids), adapted(ids))


def test_lora_on_a_4bit_base_learns_as_on_a_float_base(data: TokenData) -> None:
    """QLoRA: the same samples, the same adapters' start; the loss falls on the 4-bit base
    as on the float32 one (stated margin: the 4-bit run's final loss within 10% of the
    float run's, and at least 80% of its fall). Gradients reach the input through the
    packed weight: the input's gradient equals the one through its dequantized weight."""
    falls = {}
    finals = {}
    for base in ("f32", "int4"):
        losses = LocalRun(lora_job(base), replicas=1, cut=[2], data=data).run()
        falls[base], finals[base] = losses[0] - losses[-1], losses[-1]
    assert falls["f32"] > 0 and falls["int4"] >= 0.8 * falls["f32"]
    assert abs(finals["int4"] - finals["f32"]) <= 0.1 * finals["f32"]
    weight = torch.randn(48, 64) * 0.05
    workspace = DequantWorkspace(48 * 64, torch.float32, torch.device("cpu"))
    layer = Int4Linear.from_float(weight, None, workspace, 32)
    x = torch.randn(3, 64, requires_grad=True)
    FrozenQuantizedLinear(layer)(x).pow(2).sum().backward()
    assert x.grad is not None
    x2 = x.detach().clone().requires_grad_(True)
    torch.nn.functional.linear(x2, layer.dequantize().clone()).pow(2).sum().backward()
    assert x2.grad is not None
    assert torch.allclose(x.grad, x2.grad, rtol=1e-4, atol=1e-5)
