"""`load tiny-rwkv7 --adapter DIR`: a LoRA adapter trained on RWKV-7, served over two stages.

The adapter sits on the time-mix's r/k/v/o maps and the channel-mix's key/value, as a
training job on RWKV-7 exports it. Two fellows in virtual time serve base + adapter
(merged into each stage's weights); greedy tokens and logits must equal the one-process
model with the same adapter. A wrong-shaped adapter, or one for Llama's maps, is refused
with one line before anything is reserved.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import trio
import trio.testing

from p2pswarm.agent.adapter import read_adapter
from p2pswarm.errors import ConfigError
from p2pswarm.planner import BUILTIN_MODELS
from p2pswarm.runtime import Sampler
from p2pswarm.training.job import LoraConfig
from p2pswarm.training.lora import ADAPTER_WEIGHTS, load_adapters
from p2pswarm.wire.loads import UnloadAsk, Unloaded
from tests.serving_swarm import (
    nothing_held,
    random_adapter,
    reference,
    request,
    start_swarm,
)

MODEL = "tiny-rwkv7"
PROMPT = [256, *range(32, 80)]
LORA = LoraConfig(rank=4, alpha=8.0,
                  targets=("r_proj", "k_proj", "v_proj", "o_proj", "key", "value"))

pytestmark = [pytest.mark.usefixtures("one_torch_thread")]


def rwkv_request(**extra: object) -> dict[str, object]:
    return request(model={"name": MODEL, "config": BUILTIN_MODELS[MODEL]}, stages=2, **extra)


def make_adapter(out: Path, config: LoraConfig = LORA) -> Path:
    """Adapters on every layer of the built-in RWKV-7, with random non-zero B."""
    return random_adapter(out, MODEL, config, base=MODEL, seeds=(5, 13))


async def test_rwkv7_adapter_over_two_fellows_equals_one_process(autojump_clock,
                                                                 tmp_path) -> None:
    adapter = make_adapter(tmp_path / "adapter")
    names = {t.name for t in read_adapter(adapter).manifest.tensors}
    assert "base_model.model.model.layers.0.ffn.key.lora_A.weight" in names
    async with trio.open_nursery() as nursery:
        swarm = await start_swarm(nursery, tmp_path, seed=41, n=2)
        driver = swarm.live()[0]
        sha = read_adapter(adapter).sha256
        plan = await driver.planning.ask_plan(rwkv_request(adapter=sha))
        assert len(plan["stages"]) == 2 and plan["adapter"] == sha
        loaded = await driver.serving.load(rwkv_request(), plan_id=plan["plan_id"],
                                           adapter_dir=str(adapter))
        for s in loaded["stages"]:  # merged: no bytes beyond the plan's claim
            assert s["allocated_bytes"] == s["claim_bytes"] > 0
        result = await driver.serving.generate(prompt_ids=PROMPT, max_tokens=8,
                                               stop_token_ids=(), keep_logits=True)
        local = reference(plan, MODEL)
        for stage in local.stages:
            load_adapters(stage._model, adapter)  # type: ignore[arg-type]
        want = local.generate(PROMPT, 8, Sampler.greedy(), stop_token_ids=(), keep_logits=True)
        assert result.token_ids == want.token_ids and len(result.token_ids) == 8
        for got, expected in zip(result.logits, want.logits):
            assert (got - expected).abs().max().item() <= 1e-4
        base = reference(plan, MODEL).generate(PROMPT, 1, Sampler.greedy(),
                                               stop_token_ids=(), keep_logits=True)
        assert (result.logits[0] - base.logits[0]).abs().max().item() > 1e-3  # it did act
        await driver.leadership.ask(UnloadAsk(plan["plan_id"]), Unloaded)
        assert nothing_held(swarm)
        nursery.cancel_scope.cancel()


async def test_a_wrong_rwkv7_adapter_is_refused_in_one_line(autojump_clock, tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    good = make_adapter(tmp_path / "good", LoraConfig(rank=2, targets=("key",)))
    bad_shape = tmp_path / "shape"
    bad_shape.mkdir()
    (bad_shape / "adapter_config.json").write_text((good / "adapter_config.json").read_text())
    tensors = {k: torch.zeros(v.shape[0], v.shape[1] + 8) if ".lora_A." in k else v
               for k, v in load_file(str(good / ADAPTER_WEIGHTS)).items()}
    save_file(tensors, str(bad_shape / ADAPTER_WEIGHTS))
    llama_maps = tmp_path / "llama"  # Llama's names on an RWKV-7 base
    llama_maps.mkdir()
    raw = json.loads((good / "adapter_config.json").read_text())
    (llama_maps / "adapter_config.json").write_text(
        json.dumps({**raw, "target_modules": ["up_proj"]}))
    save_file({k.replace("ffn.key", "mlp.up_proj"): v
               for k, v in load_file(str(good / ADAPTER_WEIGHTS)).items()},
              str(llama_maps / ADAPTER_WEIGHTS))
    async with trio.open_nursery() as nursery:
        swarm = await start_swarm(nursery, tmp_path, seed=42, n=2)
        driver = swarm.live()[0]
        for where, words in [(bad_shape, r"ffn\.key\.lora_A\.weight has shape \[2, 264\], "
                                         r"tiny-rwkv7 needs \[2, 256\]"),
                             (llama_maps, r"mlp\.up_proj\.lora_A\.weight is not among its "
                                          r"target_modules as tiny-rwkv7 names them")]:
            with pytest.raises(ConfigError, match=words) as refused:
                await driver.serving.load(rwkv_request(), adapter_dir=str(where))
            assert "\n" not in str(refused.value)
            assert nothing_held(swarm) and not driver.serving.loads_view()
        nursery.cancel_scope.cancel()


def test_llama_named_targets_mean_rwkv7_maps(tmp_path) -> None:
    from p2pswarm.agent.adapter import check_adapter

    # a job on RWKV-7 given Llama's target names saves them as given, tensors on its maps
    adapter = read_adapter(make_adapter(tmp_path / "a", LoraConfig(
        rank=2, targets=("q_proj", "down_proj"))))
    assert adapter.targets == ("down_proj", "q_proj")
    assert {t.name.split(".")[6] for t in adapter.manifest.tensors} == {"r_proj", "value"}
    check_adapter(adapter, dict(BUILTIN_MODELS[MODEL]), MODEL)  # accepted
    with pytest.raises(ConfigError, match="is for the base 'tiny-rwkv7', not 'tiny-llama'"):
        check_adapter(adapter, dict(BUILTIN_MODELS["tiny-llama"]), "tiny-llama")
