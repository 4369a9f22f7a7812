"""A stage built anew mid-job (its replica placed again) borrows a training replica's
optimizer moments, or where none trains ramps its learning rate up: a fresh AdamW moves
every weight by about the learning rate on its first steps. A stage that starts with
the job, or kept, loaded or borrowed its optimizer state, takes the driver's rate."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from p2pswarm.agent.training.torch_runtime import TorchStage
from p2pswarm.errors import RemoteProtocolError
from p2pswarm.training.checkpoint import read_shard_bytes, shard_bytes
from p2pswarm.training.job import JobConfig
from p2pswarm.training.replica import build_stages, synced_tensors
from p2pswarm.training.source import ScratchModel
from p2pswarm.training.stage import FRESH_RAMP_STEPS
from p2pswarm.training.sync import LocalSync

MODEL = {"model_type": "llama", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
         "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
         "head_dim": 8, "max_position_embeddings": 32, "rms_norm_eps": 1e-5,
         "tie_word_embeddings": False}
JOB = JobConfig.from_dict({"model": {"config": MODEL}, "seq_len": 8, "micro_batch": 2,
                           "steps": 100, "seed": 0})
LR = 1e-3


def whole_stage() -> TorchStage:
    stage = build_stages(JOB, ScratchModel(MODEL, 0), [])[0]
    return TorchStage(stage, LocalSync(synced_tensors(stage), JOB.sync))


def step_lrs(stage: TorchStage, steps: range) -> list[float]:
    """The learning rate each optimizer step took, the driver asking for ``LR``."""
    out = []
    for step in steps:
        batch = torch.randint(0, 64, (2, 9))
        loss = stage.stage.forward(0, batch[:, :-1], batch[:, 1:])
        stage.stage.backward(0)
        assert torch.isfinite(loss)
        stage.apply(LR, 1.0, None, step)
        out.append(stage.stage.optimizer.param_groups[0]["lr"])
    return out


def test_a_stage_built_anew_mid_job_ramps_its_learning_rate_up() -> None:
    lrs = step_lrs(whole_stage(), range(40, 40 + FRESH_RAMP_STEPS + 2))
    assert lrs[0] == LR / FRESH_RAMP_STEPS and lrs[1] == 2 * LR / FRESH_RAMP_STEPS
    assert lrs[FRESH_RAMP_STEPS - 1:] == [LR] * 3


def test_a_stage_that_starts_with_the_job_or_kept_its_state_takes_the_drivers_rate() -> None:
    assert step_lrs(whole_stage(), range(0, 3)) == [LR] * 3  # the job's own schedule
    trained = whole_stage()
    step_lrs(trained, range(0, 2))
    restored = whole_stage()  # built anew, its state loaded (a checkpoint's)
    restored.load_state(trained.state())
    assert step_lrs(restored, range(2, 5)) == [LR] * 3


def test_a_stage_built_anew_borrows_a_training_replicas_moments_and_takes_the_drivers_rate(
        ) -> None:
    lender = whole_stage()
    step_lrs(lender, range(0, 30))
    joiner = whole_stage()
    assert joiner.borrow_moments(lender.moments()) == len(joiner.stage.named_trainable)
    theirs = {n: lender.stage.optimizer.state[p] for n, p in lender.stage.named_trainable}
    for name, p in joiner.stage.named_trainable:
        ours = joiner.stage.optimizer.state[p]
        assert float(ours["step"]) == 30.0 and ours["exp_avg"].dtype == torch.float32
        for key in ("exp_avg", "exp_avg_sq"):  # bf16 on the way: 3 significant digits
            torch.testing.assert_close(ours[key], theirs[name][key], rtol=1e-2, atol=1e-12)
    assert step_lrs(joiner, range(40, 43)) == [LR] * 3  # warm moments: no ramp


def lent_with(change: Callable[[dict[str, Any]], object]) -> bytes:
    lender = whole_stage()
    step_lrs(lender, range(0, 2))
    lent = read_shard_bytes(lender.moments())
    change(lent)
    return shard_bytes(lent)


def first(lent: dict[str, Any]) -> dict[str, Any]:
    moments: dict[str, dict[str, Any]] = lent["moments"]
    return next(iter(moments.values()))


@pytest.mark.parametrize("change", [
    lambda lent: lent.update(end_layer=lent["end_layer"] + 1),  # another stage's
    lambda lent: lent.update(optimizer="sgd"),
    lambda lent: lent["moments"].update({"layers.9.mlp.up_proj.weight": {}}),
    lambda lent: first(lent).update(exp_avg=first(lent)["exp_avg"][:1]),  # wrong shape
    lambda lent: first(lent)["exp_avg_sq"].view(-1).__setitem__(0, float("nan")),
    lambda lent: first(lent).update(step=torch.tensor(-1.0)),
    lambda lent: first(lent)["exp_avg_sq"].view(-1).__setitem__(0, -1.0),
    lambda lent: first(lent).update(extra=torch.zeros(1)),
    lambda lent: first(lent).pop("exp_avg"),
    lambda lent: lent.update(moments=[1, 2]),
])
def test_hostile_moments_are_refused_and_leave_the_stage_fresh(
        change: Callable[[dict[str, Any]], object]) -> None:
    joiner = whole_stage()
    with pytest.raises(RemoteProtocolError):
        joiner.borrow_moments(lent_with(change))
    assert not joiner.stage.optimizer.state  # nothing half-taken: it ramps as fresh
