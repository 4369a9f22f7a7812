"""A recurrent load generates past its `context`: RWKV-7's state does not grow.

Two fellows in virtual time serve an RWKV-7 given as the authors' ``.pth`` (converted
once under the state dir, as `load PATH.pth` does, then shipped stage by stage) with a
context of 16 tokens; a generation of 12 prompt tokens and 24 new ones (36 in all) runs
and equals the ``.pth`` read directly in one process. One generation is still bounded
(RECURRENT_GENERATION_TOKENS), and a Llama load keeps its context as before.
"""

from __future__ import annotations

import pytest
import trio
import trio.testing

from p2pswarm.agent.serving.records import RECURRENT_GENERATION_TOKENS, generation_tokens
from p2pswarm.errors import PlacementError
from p2pswarm.models.files import read_model_config
from p2pswarm.models.loader import open_model
from p2pswarm.models.pth_cache import PTH_DIR, offered_model
from p2pswarm.models.rwkv7_pth import save_pth
from p2pswarm.runtime import Sampler
from tests.serving_swarm import reference, request, start_swarm
from tests.test_rwkv7 import CONFIG, random_tensors

MODEL = "tiny-rwkv7"
PROMPT = [1, *range(40, 51)]

pytestmark = [pytest.mark.usefixtures("one_torch_thread")]


async def test_a_recurrent_load_generates_past_its_context(autojump_clock, tmp_path) -> None:
    pth = save_pth(random_tensors(CONFIG, seed=9), True, tmp_path / "rwkv7-small.pth")
    converted = offered_model(str(pth), tmp_path / "home" / PTH_DIR)
    name, config = read_model_config(converted)
    assert name == "rwkv7-small"
    ask = request(model={"name": name, "config": config}, stages=2, context=16)
    async with trio.open_nursery() as nursery:
        swarm = await start_swarm(nursery, tmp_path, seed=43, n=2)
        driver = swarm.live()[0]
        loaded = await driver.serving.load(ask, model_dir=converted)
        assert loaded["runtime"]["max_context_tokens"] == 16
        for a in swarm.live():  # every fellow's record (gossip too) says recurrent
            assert a.serving.loads_view()[0].to_doc()["model"]["recurrent"] is True
        result = await driver.serving.generate(prompt_ids=PROMPT, max_tokens=24,
                                               stop_token_ids=(), keep_logits=True)
        assert len(PROMPT) + len(result.token_ids) > 16 and len(result.token_ids) == 24
        plan = await driver.planning.ask_plan(ask)
        want = reference(plan, open_model(pth)).generate(PROMPT, 24, Sampler.greedy(),
                                               stop_token_ids=(), keep_logits=True)
        assert result.token_ids == want.token_ids
        for got, expected in zip(result.logits, want.logits):
            assert (got - expected).abs().max().item() <= 1e-4
        with pytest.raises(PlacementError, match=r"exceed the 1,048,576 tokens one generation "
                                                  "of a recurrent model may reach"):
            await driver.serving.generate(prompt_ids=PROMPT,
                                          max_tokens=RECURRENT_GENERATION_TOKENS)
        nursery.cancel_scope.cancel()


def test_only_a_recurrent_model_reaches_past_the_context() -> None:
    runtime = {"max_context_tokens": 16}
    llama = {"model": {"kind": "builtin", "name": "tiny-llama"}, "runtime": runtime}
    rwkv = {"model": {"kind": "builtin", "name": MODEL, "recurrent": True}, "runtime": runtime}
    assert generation_tokens(llama) == (16, "the load's context of 16 tokens")
    assert generation_tokens(rwkv)[0] == RECURRENT_GENERATION_TOKENS
    odd = {"model": {"kind": "builtin", "name": MODEL, "recurrent": "yes"}, "runtime": runtime}
    assert generation_tokens(odd)[0] == 16
