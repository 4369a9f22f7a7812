"""Pipeline training: schedules, a 3-stage pipeline equal to single-process training, and
the same result with every activation and gradient sent as a tensor frame."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from p2pswarm.errors import ConfigError, RemoteProtocolError
from p2pswarm.models.tokenizer import ByteTokenizer
from p2pswarm.runtime.frame import decode_tensor, encode_tensor
from p2pswarm.training.data import SampleStream, TokenData, load_tokens
from p2pswarm.training.job import DataConfig, LrSchedule, OptimizerConfig
from p2pswarm.training.pipeline import LocalTrainPipeline
from p2pswarm.training.schedule import Op, peak_live_micro_batches, stage_ops
from p2pswarm.training.source import ScratchModel, trainable_stage
from p2pswarm.training.stage import TrainStage, clip_coefficient
from tests.byte_llama import byte_llama

# tied embeddings, grouped-query attention: big enough for three stages of two layers
SMALL = byte_llama(hidden_size=64, layers=6, positions=128, tied=True)
OPTIMIZER = OptimizerConfig(weight_decay=0.1, grad_clip=1.0)
LR = LrSchedule(peak_lr=3e-3, min_lr=3e-4, warmup_steps=4, total_steps=20)


pytestmark = pytest.mark.usefixtures("one_torch_thread_per_module")


@pytest.fixture(scope="module")
def batches() -> list[torch.Tensor]:
    tokens = load_tokens(DataConfig(), ByteTokenizer())
    stream = SampleStream(TokenData.split(tokens, 0.05, 32).train, 32, seed=3)
    return [stream.next_micro_batches(3, 2) for _ in range(20)]


def stages_of(source: object, cut: list[int], optimizer: OptimizerConfig = OPTIMIZER
              ) -> list[TrainStage]:
    n = source.config.num_layers  # type: ignore[attr-defined]
    bounds = [0, *cut, n]
    return [TrainStage(trainable_stage(source, a, b), optimizer)  # type: ignore[arg-type]
            for a, b in itertools.pairwise(bounds)]


# --- schedules -------------------------------------------------------------------------------


@given(n_stages=st.integers(1, 6), n_micro=st.integers(1, 9),
       schedule=st.sampled_from(["gpipe", "1f1b"]))
def test_schedules_run_every_pass_once_in_a_valid_order(n_stages: int, n_micro: int,
                                                        schedule: str) -> None:
    all_ops = [stage_ops(schedule, s, n_stages, n_micro) for s in range(n_stages)]
    for s, ops in enumerate(all_ops):
        assert sorted((o.kind, o.micro) for o in ops) == sorted(
            [("F", m) for m in range(n_micro)] + [("B", m) for m in range(n_micro)])
        backwards = [o.micro for o in ops if o.kind == "B"]
        assert backwards == sorted(backwards)  # the same accumulation order either way
        for m in range(n_micro):
            assert ops.index(Op("F", m)) < ops.index(Op("B", m))
        if schedule == "1f1b":
            assert peak_live_micro_batches(ops) <= min(n_stages - s, n_micro)
        else:
            assert peak_live_micro_batches(ops) == n_micro
    # and the ops can all run: simulate the stages waiting on each other
    done: set[tuple[int, str, int]] = set()
    cursor = [0] * n_stages
    while any(c < len(o) for c, o in zip(cursor, all_ops)):
        moved = False
        for s in range(n_stages):
            while cursor[s] < len(all_ops[s]):
                op = all_ops[s][cursor[s]]
                needs = ((s - 1, "F", op.micro) if op.kind == "F" and s > 0 else
                         (s + 1, "B", op.micro) if op.kind == "B" and s < n_stages - 1 else None)
                if needs is not None and needs not in done:
                    break
                done.add((s, op.kind, op.micro))
                cursor[s] += 1
                moved = True
        assert moved, "schedule deadlocks"


def test_unknown_schedule() -> None:
    with pytest.raises(ConfigError, match="schedule"):
        stage_ops("zero-bubble", 0, 2, 2)


# --- numerically one process -------------------------------------------------------------


def reference_losses(source: ScratchModel, batches: list[torch.Tensor]) -> list[float]:
    """The whole model trained the plain way: one module, one AdamW, torch's clipping."""
    model = trainable_stage(source, 0, source.config.num_layers)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
         {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
        lr=0.0, betas=OPTIMIZER.betas, eps=OPTIMIZER.eps)
    losses = []
    for step, batch in enumerate(batches):
        total = 0.0
        for micro in batch:
            logits = model(micro[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                     micro[:, 1:].reshape(-1))
            (loss / batch.shape[0]).backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        for group in optimizer.param_groups:
            group["lr"] = LR.lr_at(step)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total / batch.shape[0])
    return losses


def test_three_stage_pipeline_equals_one_process(batches: list[torch.Tensor]) -> None:
    source = ScratchModel(SMALL, seed=0)  # the tied embedding and head end up on two stages
    expected = reference_losses(source, batches)
    pipeline = LocalTrainPipeline(stages_of(source, [2, 4]), lr=LR, schedule="1f1b")
    got = [pipeline.train_step(batch) for batch in batches]
    assert len(got) == 20
    assert max(abs(a - b) for a, b in zip(got, expected)) < 1e-4
    assert got[-1] < got[0] - 1.0  # and it learns
    # the tied copies took the same steps
    first, last = pipeline.stages[0].model, pipeline.stages[-1].model
    assert first.embed_tokens is not None and last.lm_head is not None
    assert torch.equal(first.embed_tokens.weight, last.lm_head.weight)


def test_gpipe_and_1f1b_agree_bit_for_bit(batches: list[torch.Tensor]) -> None:
    source = ScratchModel(SMALL, seed=1)
    runs = []
    for schedule in ("gpipe", "1f1b"):
        pipeline = LocalTrainPipeline(stages_of(source, [1, 4]), lr=LR, schedule=schedule)
        runs.append([pipeline.train_step(b) for b in batches[:6]])
    assert runs[0] == runs[1]


def test_stages_over_tensor_frames_equal_the_local_pipeline(batches: list[torch.Tensor]) -> None:
    """What the network layer does: each stage alone, every tensor between stages encoded
    to a frame and decoded, the small exchanges (tied grads, grad norms) by value."""
    source = ScratchModel(SMALL, seed=2)
    local = LocalTrainPipeline(stages_of(source, [2, 4]), lr=LR)
    expected = [local.train_step(b) for b in batches[:4]]
    stages = stages_of(source, [2, 4])
    got = []
    for step, batch in enumerate(batches[:4]):
        n_micro, last = batch.shape[0], len(stages) - 1
        inbox: dict[tuple[int, str, int], bytearray] = {}
        ops = [stage_ops("1f1b", s, len(stages), n_micro) for s in range(len(stages))]
        cursor = [0] * len(stages)
        losses = [0.0] * n_micro
        while any(c < len(o) for c, o in zip(cursor, ops)):
            for s, stage in enumerate(stages):
                while cursor[s] < len(ops[s]):
                    op = ops[s][cursor[s]]
                    if op.kind == "F":
                        if s > 0 and (s, "F", op.micro) not in inbox:
                            break
                        x = (batch[op.micro, :, :-1] if s == 0
                             else decode_tensor(inbox.pop((s, "F", op.micro))))
                        out = stage.forward(op.micro, x,
                                            batch[op.micro, :, 1:] if s == last else None)
                        if s == last:
                            losses[op.micro] = float(out)
                        else:
                            inbox[(s + 1, "F", op.micro)] = encode_tensor(out)
                    else:
                        if s < last and (s, "B", op.micro) not in inbox:
                            break
                        g = None if s == last else decode_tensor(inbox.pop((s, "B", op.micro)))
                        grad = stage.backward(op.micro, g, loss_scale=1 / n_micro)
                        if s > 0:
                            assert grad is not None
                            inbox[(s - 1, "B", op.micro)] = encode_tensor(grad)
                    cursor[s] += 1
        tied = stages[0].tied_grad() + stages[-1].tied_grad()  # type: ignore[operator]
        stages[0].set_tied_grad(tied)
        stages[-1].set_tied_grad(tied)
        coef = clip_coefficient([s.grad_sq_norm() for s in stages], OPTIMIZER.grad_clip)
        for stage in stages:
            stage.step(LR.lr_at(step), coef)
        got.append(sum(losses) / n_micro)
    assert got == expected


def test_stage_refuses_out_of_order_passes() -> None:
    stage = stages_of(ScratchModel(SMALL, seed=0), [3])[1]
    with pytest.raises(RemoteProtocolError, match="no forward"):
        stage.backward(0, torch.zeros(1, 4, 64))
    stage.forward(0, torch.zeros(1, 4, 64), torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(RemoteProtocolError, match="in flight"):
        stage.forward(0, torch.zeros(1, 4, 64), torch.zeros(1, 4, dtype=torch.long))
    stage.drop_in_flight()
    with pytest.raises(RemoteProtocolError, match="targets"):
        stage.forward(1, torch.zeros(1, 4, 64))
    with pytest.raises(ConfigError, match="do not chain"):
        source = ScratchModel(SMALL, seed=0)
        a = stages_of(source, [3])
        b = stages_of(source, [2])
        LocalTrainPipeline([a[0], b[1]], lr=LR)
