"""The seam between serving and compute: torch stays out until a stage needs it."""

from __future__ import annotations

import os
import subprocess
import sys

from p2pswarm.agent.serving.runtime import StageRuntime, TorchOnFirstUse


def test_importing_the_agent_does_not_import_torch() -> None:
    code = ("import sys, p2pswarm.agent.agent, p2pswarm.cli; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={**os.environ}).stdout.strip()
    assert out == "False"


def test_the_torch_runtime_builds_a_stage_and_draws_what_one_process_draws() -> None:
    from p2pswarm.agent.serving.records import StageOrder, runtime_block
    from p2pswarm.planner import BUILTIN_MODELS
    from p2pswarm.runtime import LocalPipeline, Sampler, Stage, StageSpec

    runtime: StageRuntime = TorchOnFirstUse()
    layers = int(BUILTIN_MODELS["tiny-llama"]["num_hidden_layers"])
    order = StageOrder("p" * 16, 0, 1, "f" * 32, (0, layers), "cpu", 0, "CPU", 0, 0,
                       runtime_block({"max_context_tokens": 64}),
                       {"kind": "builtin", "name": "tiny-llama"})
    stage = runtime.build(order, "tiny-llama", None)
    assert stage.is_last and stage.allocated_bytes() > 0
    prompt = [256, 72, 105]
    first = runtime.step(stage, "s", runtime.token_frame(prompt), 0,
                         runtime.sampler(0.0, 0, 1.0, 0), True)
    assert first.token is not None and first.frame == b"" and first.logits
    assert stage.sessions == ("s",)
    local = LocalPipeline([Stage.load("tiny-llama", StageSpec(0, layers, max_context_tokens=64))])
    expected = local.generate(prompt, 1, Sampler.greedy(), stop_token_ids=(), keep_logits=True)
    assert [first.token] == list(expected.token_ids)
    assert runtime.read_logits(first.logits).equal(expected.logits[0])
    stage.end_session("s")
    stage.unload()
