"""Fused linears (q, k, v as one; gate, up as one) for serving's decode: the same
numbers as the separate linears, bit for bit, and the same bytes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from p2pswarm.models.llama import StageModel
from p2pswarm.models.quant import DequantWorkspace, Int4Linear, Int8Linear, default_kernel, fuse
from p2pswarm.runtime import Stage, StageSpec
from p2pswarm.runtime.memory import stage_memory
from p2pswarm.runtime.stage import _storage_bytes

KERNELS = ["reference"] + (["fbgemm"] if default_kernel("int8") == "fbgemm" else [])


def _parts(scheme: str, kernel: str, bias: bool) -> list[nn.Module]:
    g = torch.Generator().manual_seed(1)
    in_f, outs = 96, (64, 32, 32)
    workspace = DequantWorkspace(max(outs) * in_f, torch.float32, torch.device("cpu"))
    parts: list[nn.Module] = []
    for out_f in outs:
        w = torch.randn(out_f, in_f, generator=g) * 0.05
        b = torch.randn(out_f, generator=g) if bias else None
        if scheme == "none":
            linear = nn.Linear(in_f, out_f, bias=bias)
            linear.weight.data.copy_(w)
            if b is not None:
                linear.bias.data.copy_(b)
            parts.append(linear)
        elif scheme == "int8":
            parts.append(Int8Linear.from_float(w, b, workspace, kernel))
        else:
            parts.append(Int4Linear.from_float(w, b, workspace, 32, kernel))
    return parts


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("scheme", ["none", "int8", "int4"])
def test_a_fused_linear_gives_the_same_numbers_and_holds_the_same_bytes(
        scheme: str, kernel: str, bias: bool) -> None:
    parts = _parts(scheme, kernel, bias)
    fused = fuse(parts)
    if scheme == "int8" and kernel == "reference":
        assert fused is None  # its dequantized weight would not fit the workspace
        return
    assert fused is not None
    g = torch.Generator().manual_seed(2)
    with torch.inference_mode():
        for rows in (1, 3, 40):  # decode, a batch, a prefill chunk
            x = torch.randn(1, rows, 96, generator=g)
            assert torch.equal(fused(x), torch.cat([p(x) for p in parts], dim=-1)), rows

    def held(modules: list[nn.Module]) -> int:
        tensors = [t for m in modules for t in (*m.parameters(), *m.buffers())]
        packed = sum(m.packed_bytes() for m in modules if isinstance(m, Int8Linear))
        return _storage_bytes(tensors) + packed

    assert held([fused]) == held(parts)


def test_linears_that_do_not_fuse_alike_stay_apart() -> None:
    ints = _parts("int8", KERNELS[-1], False)
    floats = _parts("none", "reference", False)
    assert fuse([floats[0], ints[1]]) is None
    assert fuse([_parts("none", "reference", True)[0], floats[1]]) is None


@pytest.mark.parametrize("quant", ["none", "int8", "int4"])
def test_a_stage_fuses_at_its_first_step_and_keeps_its_bytes(quant: str) -> None:
    spec = StageSpec(0, 8, quant=quant, max_context_tokens=64, max_sessions=2)
    stage = Stage.load("tiny-llama", spec)
    before = stage.allocated_bytes()
    assert before == stage_memory(stage.config, spec).total_bytes
    unfused = Stage.load("tiny-llama", spec)
    unfused._fused = True  # as before fusing: the separate linears
    prompt = [256, *range(40, 60)]
    a, b = stage.prefill("s", prompt), unfused.prefill("s", prompt)
    assert torch.equal(a, b)
    model = stage._model
    assert isinstance(model, StageModel)
    assert model.layers[0].self_attn.qkv_proj is not None
    assert model.layers[0].mlp.gate_up_proj is not None
    assert stage.allocated_bytes() == before
    token = int(a[-1].argmax())
    for position in range(len(prompt), len(prompt) + 6):
        a, b = stage.decode("s", token, position), unfused.decode("s", token, position)
        assert torch.equal(a, b)
        token = int(a[-1].argmax())
    # the batched decode goes through the fused linears too
    stage.prefill("t", prompt)
    unfused.prefill("t", prompt)
    x = torch.tensor([token, 7])
    got = stage.decode_batch(["s", "t"], x, [len(prompt) + 6, len(prompt)])
    want = unfused.decode_batch(["s", "t"], x, [len(prompt) + 6, len(prompt)])
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4)
