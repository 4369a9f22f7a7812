"""`load MODEL --adapter DIR`: LoRA adapters served on top of their base across fellows.

Three fellows load the built-in model with saved adapters as a three-stage pipeline, in
virtual time; greedy tokens and logits must equal the base with the adapters (unmerged
``LoRALinear``) in one process. Adapters for another base are refused before anything
is reserved.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import trio
import trio.testing

from p2pswarm.agent.adapter import read_adapter
from p2pswarm.errors import ConfigError, PlanChanged
from p2pswarm.runtime import LocalPipeline, Sampler
from p2pswarm.training.job import LoraConfig
from p2pswarm.training.lora import ADAPTER_WEIGHTS, load_adapters
from p2pswarm.wire.control import LoadRequest
from p2pswarm.wire.loads import UnloadAsk, Unloaded
from p2pswarm.wire.orders import unpack_doc
from tests.serving_swarm import (
    nothing_held,
    random_adapter,
    reference,
    request,
    start_swarm,
)

MODEL = "tiny-llama"
PROMPT = [256, *range(32, 100)]
LORA = LoraConfig(rank=4, alpha=8.0, targets=("q_proj", "v_proj", "down_proj"))


pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]


def make_adapter(out: Path, *, base: str = MODEL, config: LoraConfig = LORA) -> Path:
    """Adapters on every layer of the built-in model, with random non-zero B."""
    return random_adapter(out, MODEL, config, base=base, seeds=(3, 11))


def with_adapters(plan: dict[str, Any], adapter: Path) -> LocalPipeline:
    pipeline = reference(plan, MODEL)
    for stage in pipeline.stages:
        load_adapters(stage._model, adapter)  # type: ignore[arg-type]
    return pipeline


async def test_adapter_across_three_fellows_equals_one_process(autojump_clock,
                                                               tmp_path) -> None:
    adapter = make_adapter(tmp_path / "adapter")
    async with trio.open_nursery() as nursery:
        swarm = await start_swarm(nursery, tmp_path, seed=31)
        driver = swarm.live()[1]
        base_plan = await driver.planning.ask_plan(request())
        # the plan a load with this adapter shows: its own plan_id
        sha = read_adapter(adapter).sha256
        plan = await driver.planning.ask_plan(request(adapter=sha))
        assert plan["plan_id"] != base_plan["plan_id"] and plan["adapter"] == sha
        assert plan["stages"] == base_plan["stages"] and len(plan["stages"]) == 3
        # a pin made for the base is not taken for the adapter
        with pytest.raises(PlanChanged):
            await driver.serving.load(request(), plan_id=base_plan["plan_id"],
                                      adapter_dir=str(adapter))
        assert nothing_held(swarm)
        loaded = await driver.serving.load(request(), plan_id=plan["plan_id"],
                                           adapter_dir=str(adapter))
        assert loaded["plan_id"] == plan["plan_id"]
        assert loaded["adapter"]["sha256"] == sha and loaded["adapter"]["rank"] == 4
        for s in loaded["stages"]:  # merged: no bytes beyond the plan's claim
            assert s["allocated_bytes"] == s["claim_bytes"] > 0
        # each stage's order carried only its own layers' adapter tensors
        for a in swarm.live():
            for h in a.serving.hosted.values():
                start, end = h.order.layers
                names = [t[0] for t in h.order.adapter["manifest"]["tensors"]]
                layers = {int(n.split(".")[4]) for n in names}
                assert names and layers == set(range(start, end))
        # loads shows the adapter, from every fellow's view (gossip) too
        await wait_complete(swarm)
        for a in swarm.live():
            view = a.serving.loads_view()[0].to_doc()
            assert view["adapter"]["sha256"] == sha

        result = await driver.serving.generate(prompt_ids=PROMPT, max_tokens=10,
                                               stop_token_ids=(), keep_logits=True)
        local = with_adapters(plan, adapter).generate(PROMPT, 10, Sampler.greedy(),
                                                      stop_token_ids=(), keep_logits=True)
        assert result.token_ids == local.token_ids and len(result.token_ids) == 10
        for got, want in zip(result.logits, local.logits):
            assert (got - want).abs().max().item() <= 1e-5
        base = reference(plan, MODEL).generate(PROMPT, 10, Sampler.greedy(),
                                               stop_token_ids=(), keep_logits=True)
        assert (result.logits[0] - base.logits[0]).abs().max().item() > 1e-3  # it did act

        await driver.leadership.ask(UnloadAsk(plan["plan_id"]), Unloaded)
        assert nothing_held(swarm)
        nursery.cancel_scope.cancel()


async def wait_complete(swarm: Any) -> None:
    from p2pswarm.sim.virtual import wait_until

    await wait_until(lambda: all(
        len(a.serving.loads_view()) == 1 and a.serving.loads_view()[0].complete
        for a in swarm.live()), timeout_s=10)


async def test_an_adapter_for_another_base_is_refused(autojump_clock, tmp_path) -> None:
    good = make_adapter(tmp_path / "good")
    other = make_adapter(tmp_path / "other", base="small-llama")
    # same names, another model's shapes
    from safetensors.torch import load_file, save_file

    bad_shape = tmp_path / "shape"
    bad_shape.mkdir()
    (bad_shape / "adapter_config.json").write_text((good / "adapter_config.json").read_text())
    tensors = load_file(str(good / ADAPTER_WEIGHTS))
    tensors = {k: torch.zeros(v.shape[0], v.shape[1] + 8) if ".lora_A." in k else v
               for k, v in tensors.items()}
    save_file(tensors, str(bad_shape / ADAPTER_WEIGHTS))
    no_module = tmp_path / "module"
    no_module.mkdir()
    raw = json.loads((good / "adapter_config.json").read_text())
    (no_module / "adapter_config.json").write_text(
        json.dumps({**raw, "target_modules": [*raw["target_modules"], "c_attn"]}))
    (no_module / ADAPTER_WEIGHTS).write_bytes((good / ADAPTER_WEIGHTS).read_bytes())
    missing = tmp_path / "missing"
    missing.mkdir()
    (missing / "adapter_config.json").write_text((good / "adapter_config.json").read_text())

    async with trio.open_nursery() as nursery:
        swarm = await start_swarm(nursery, tmp_path, seed=32)
        driver = swarm.live()[0]
        cases = [(other, r"is for the base 'small-llama', not 'tiny-llama'"),
                 (bad_shape, r"lora_A.weight has shape \[4, \d+\], tiny-llama needs"),
                 (no_module, r"targets c_attn, which tiny-llama does not have"),
                 (missing, r"has no adapter_model.safetensors"),
                 (tmp_path / "nowhere", r"does not exist")]
        for where, words in cases:
            with pytest.raises(ConfigError, match=words):
                await driver.serving.load(request(), adapter_dir=str(where))
            assert nothing_held(swarm) and not driver.serving.loads_view()
        nursery.cancel_scope.cancel()


def test_cli_load_adapter_sends_it_and_shows_it(agent, tmp_path) -> None:
    from typer.testing import CliRunner

    from p2pswarm.cli import app
    from tests.fakes import RECORD

    adapter = make_adapter(tmp_path / "adapter")
    fake = agent  # the stand-in behind the control client (conftest)
    sha = read_adapter(adapter).sha256
    fake.answers["load"] = {**RECORD, "adapter": {"name": "adapter", "rank": 4, "sha256": sha,
                                                  "targets": ["down_proj", "q_proj", "v_proj"]}}
    runner = CliRunner()
    result = runner.invoke(app, ["load", MODEL, "--adapter", str(adapter)])
    assert result.exit_code == 0, result.output
    sent = fake.sent(LoadRequest)[-1]
    assert sent.adapter == str(adapter.resolve()) and unpack_doc(sent.request)["adapter"] == sha
    assert "with LoRA adapter adapter (rank 4" in result.stdout and sha[:16] in result.stdout

    other = make_adapter(tmp_path / "other", base="small-llama")
    result = runner.invoke(app, ["load", MODEL, "--adapter", str(other)])
    assert result.exit_code == 2 and len(fake.requests) == 1
    assert "is for the base 'small-llama', not 'tiny-llama'" in result.output
