"""``micro_batch: "auto"``: each replica trains on its own batch, the outer average
weighs each replica's delta by the samples it saw, and the loss falls as fast as the
fixed-batch run over the same samples."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from p2pswarm.errors import ConfigError
from p2pswarm.training.job import JobConfig
from tests.test_planner_fleet import two_fellows_of_different_memory

torch = pytest.importorskip("torch")

from p2pswarm.training.data import TokenData  # noqa: E402
from p2pswarm.training.run import LocalRun  # noqa: E402

CORPUS = Path(__file__).resolve().parent.parent / "p2pswarm" / "training" / "corpus"

STEPS = 12
SMALL = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
         "max_position_embeddings": 128, "vocab_size": 259, "bos_token_id": 256,
         "eos_token_id": 257, "pad_token_id": 258, "tie_word_embeddings": True}


def job(**extra: Any) -> JobConfig:
    return JobConfig.from_dict({"model": {"config": SMALL}, "seq_len": 32, "steps": STEPS,
                                "lr": {"peak": 3e-3, "schedule": "constant"},
                                "sync": {"inner_steps": 4, "codec": "fp32"}, **extra})


def test_job_json_takes_auto_and_keeps_it() -> None:
    cfg = job(micro_batch="auto")
    assert cfg.auto_batch and cfg.to_dict()["micro_batch"] == "auto"
    assert JobConfig.from_dict(cfg.to_dict()).auto_batch
    assert cfg.fleet_request()["micro_batch"] == "auto"
    with pytest.raises(ConfigError, match="whole number or \"auto\""):
        job(micro_batch="big")


@pytest.mark.usefixtures("one_torch_thread")
def test_auto_batches_train_as_fast_as_fixed_ones_for_the_same_samples() -> None:
    fleet = two_fellows_of_different_memory()
    shapes = [(r.micro_batch, r.micro_batches) for r in fleet.replicas]
    assert shapes[0] != shapes[1]
    # a smaller scale of the plan's batches, same ratio: the test stays fast
    low = min(b * m for b, m in shapes)
    sizes = [b * m * 4 // low for b, m in shapes]  # e.g. 8 and 4 sequences a step
    per_step = sum(sizes)
    assert per_step % 2 == 0
    text = (CORPUS / "1-declaration-of-independence.txt").read_bytes()[:16_000]
    data = TokenData.split(torch.tensor(list(text), dtype=torch.long), 0.1, 32)
    auto = LocalRun(job(micro_batch="auto"), batches=[(n, 1) for n in sizes], data=data)
    fixed = LocalRun(job(micro_batch=per_step // 2), replicas=2, data=data)
    before = auto.evaluate(4)
    auto.run()
    fixed.run()
    assert auto.samples == fixed.samples == STEPS * per_step
    after_auto, after_fixed = auto.evaluate(4), fixed.evaluate(4)
    assert after_auto < before - 0.3  # it learns
    assert after_auto <= after_fixed + 0.05, (after_auto, after_fixed)


def test_the_outer_average_weighs_each_delta_by_its_samples() -> None:
    """A replica that saw 8 samples counts four times one that saw 2."""
    from p2pswarm.training.job import SyncConfig
    from p2pswarm.training.sync import OuterSync

    sync = SyncConfig(outer_lr=1.0, outer_momentum=0.0, codec="fp32")
    keeper = OuterSync(torch.zeros(3), sync)
    keeper.join("big")
    keeper.join("small")
    keeper.contribute("big", 0, torch.tensor([1.0, 1.0, 1.0]), samples=8)
    keeper.contribute("small", 0, torch.tensor([6.0, 1.0, -4.0]), samples=2)
    result = keeper.close_round(0.0)
    assert result is not None and result.samples == 10
    # u = -lr * g, g = (8 * big + 2 * small) / 10
    assert torch.allclose(keeper.params, -torch.tensor([2.0, 1.0, 0.0]))
