"""A training pipeline in one process: the reference a placed pipeline must equal.

``train_step`` runs one optimizer step: the step's micro-batches through every stage in
the order the schedule gives each stage, then the exchanges the stages need between the
backwards and the step (tied-embedding gradients, the global gradient norm for
clipping), then every stage's optimizer. Over the network the same happens with the
activations, gradients and those two small exchanges travelling between fellows.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

import torch

from p2pswarm.errors import ConfigError
from p2pswarm.training.job import LrSchedule
from p2pswarm.training.schedule import Op, stage_ops
from p2pswarm.training.stage import TrainStage, clip_coefficient


class LocalTrainPipeline:
    def __init__(self, stages: Sequence[TrainStage], *, lr: LrSchedule,
                 grad_clip: float = 1.0, schedule: str = "1f1b") -> None:
        if not stages:
            raise ConfigError("a pipeline needs at least one stage")
        if not stages[0].is_first or not stages[-1].is_last:
            raise ConfigError("a pipeline must start at layer 0 and end at the last layer")
        for before, after in itertools.pairwise(stages):
            if before.end_layer != after.start_layer:
                raise ConfigError(f"stages [{before.start_layer}, {before.end_layer}) and "
                                  f"[{after.start_layer}, {after.end_layer}) do not chain")
        self.stages = tuple(stages)
        self.lr = lr
        self.grad_clip = grad_clip
        self.schedule = schedule
        stage_ops(schedule, 0, 1, 1)  # refuse an unknown schedule now
        self.steps = 0

    @property
    def cut(self) -> list[int]:
        """Layer boundaries between stages (``p2pswarm_stage_cut``)."""
        return [s.start_layer for s in self.stages[1:]]

    def train_step(self, batch: torch.Tensor, lr: float | None = None) -> float:
        """One optimizer step on ``batch`` (micro_batches, micro_batch, seq_len + 1);
        returns the step's mean loss. ``lr`` overrides the schedule (DiLoCo replicas)."""
        if batch.dim() != 3:
            raise ConfigError("a step's batch is (micro_batches, micro_batch, seq_len + 1)")
        inputs, targets = batch[..., :-1], batch[..., 1:]
        n_micro, n_stages = batch.shape[0], len(self.stages)
        ops = [stage_ops(self.schedule, s, n_stages, n_micro) for s in range(n_stages)]
        losses = self._run(ops, inputs, targets)
        self._sync_tied_grads()
        coef = clip_coefficient([s.grad_sq_norm() for s in self.stages], self.grad_clip)
        step_lr = self.lr.lr_at(self.steps) if lr is None else lr
        for stage in self.stages:
            stage.step(step_lr, coef)
        self.steps += 1
        return sum(losses) / n_micro

    def _run(self, ops: list[list[Op]], inputs: torch.Tensor,
             targets: torch.Tensor) -> list[float]:
        n_micro, last = inputs.shape[0], len(self.stages) - 1
        activations: list[dict[int, torch.Tensor]] = [{} for _ in self.stages]
        grads: list[dict[int, torch.Tensor]] = [{} for _ in self.stages]
        losses = [0.0] * n_micro
        cursor = [0] * len(self.stages)
        while any(c < len(o) for c, o in zip(cursor, ops)):
            progressed = False
            for s, stage in enumerate(self.stages):
                while cursor[s] < len(ops[s]):
                    op = ops[s][cursor[s]]
                    m = op.micro
                    if op.kind == "F":
                        x = inputs[m] if s == 0 else activations[s].pop(m, None)
                        if x is None:
                            break
                        out = stage.forward(m, x, targets[m] if s == last else None)
                        if s == last:
                            losses[m] = float(out)
                        else:
                            activations[s + 1][m] = out
                    else:
                        g = None if s == last else grads[s].pop(m, None)
                        if s != last and g is None:
                            break
                        grad_in = stage.backward(m, g, loss_scale=1.0 / n_micro)
                        if s > 0:
                            assert grad_in is not None
                            grads[s - 1][m] = grad_in
                    cursor[s] += 1
                    progressed = True
            if not progressed:
                raise RuntimeError("pipeline schedule deadlocked")  # a bug in the schedule
        return losses

    def _sync_tied_grads(self) -> None:
        first, last = self.stages[0], self.stages[-1]
        if first is last or first.tied_name is None or last.tied_name is None:
            return
        g_first, g_last = first.tied_grad(), last.tied_grad()
        if g_first is None or g_last is None:
            return
        total = g_first + g_last.to(g_first.device)
        first.set_tied_grad(total)
        last.set_tied_grad(total)

    def copy_tied_weight(self) -> None:
        """Make the last stage's tied head equal the first stage's embedding (after a
        sync round, which syncs the tied weight on the first stage only)."""
        first, last = self.stages[0], self.stages[-1]
        if first is last or first.tied_name is None or last.tied_name is None:
            return
        with torch.no_grad():
            dict(last.named_trainable)[last.tied_name].copy_(
                dict(first.named_trainable)[first.tied_name])

    @torch.no_grad()
    def evaluate(self, batches: Iterable[torch.Tensor]) -> float:
        """Mean loss over (batch, seq_len + 1) batches, no gradients, weights untouched."""
        total, count = 0.0, 0
        for batch in batches:
            x: torch.Tensor = batch[:, :-1]
            for stage in self.stages:
                x = stage.model(x.to(stage.device))
            loss = torch.nn.functional.cross_entropy(
                x.reshape(-1, x.shape[-1]), batch[:, 1:].reshape(-1).to(x.device))
            total += float(loss)
            count += 1
        return total / max(count, 1)
