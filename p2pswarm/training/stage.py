"""One stage of a pipeline, trained: forward and backward per micro-batch, its own optimizer.

The first stage takes token ids (B, T); the others take hidden states (B, T, hidden)
from the stage before. Every stage but the last returns hidden states for the next; the
last computes the mean cross-entropy of its micro-batch against the targets. ``backward``
takes the gradient of the stage's output (the last stage starts from its loss) and
returns the gradient of its input for the stage before. Tensors in and out are plain
CPU-or-device tensors; the network layer carries them with ``runtime.encode_tensor``.

A stage keeps, per micro-batch in flight, its input and output with their autograd
graph until the backward; the schedule bounds how many are in flight.

Tied embeddings across a cut: when the head shares the embedding's weight and the two
sit on different stages, each stage holds a copy. After the backwards, the pipeline adds
the two gradients (``tied_grad``/``set_tied_grad``) so both copies take the same step
and stay equal, as Megatron-LM does; the sum is counted once in the global grad norm.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from p2pswarm.errors import RemoteProtocolError
from p2pswarm.models.families import AnyStageModel as StageModel
from p2pswarm.training.job import OptimizerConfig

# A stage built anew mid-job (its replica placed again on a fellow that lost its state)
# has an optimizer without moments: AdamW's first steps then move every weight by about
# the learning rate whatever the gradient's noise. Its learning rate ramps up over this
# many steps (resetting the moments every 25 steps of 600 cost +1.5 % and +7.7 % held-out
# loss on two seeds, +0.0 % and +3.4 % with the ramp: docs/training.md).
FRESH_RAMP_STEPS = 8


# what each optimizer keeps per parameter (``make_optimizer``); the moments travel in bf16
OPTIMIZER_STATE_KEYS = {"adamw": {"step", "exp_avg", "exp_avg_sq"}, "sgd": {"momentum_buffer"}}
MOMENT_KEYS = {"exp_avg", "exp_avg_sq", "momentum_buffer"}
MAX_BORROWED_STEP = 1 << 40


def fresh_ramp(steps_since_fresh: int) -> float:
    """The learning-rate factor of a fresh optimizer's step ``steps_since_fresh`` (0, 1...)."""
    return min(1.0, (steps_since_fresh + 1) / FRESH_RAMP_STEPS)


class TrainStage:
    def __init__(self, model: StageModel, optimizer: OptimizerConfig) -> None:
        self.model = model
        self.config = model.config
        self.is_first = model.is_first
        self.is_last = model.is_last
        self.start_layer = model.start_layer
        self.end_layer = model.end_layer
        self.optimizer_config = optimizer
        self.named_trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        # the tied copy is this stage's only when the other end lives on another stage
        self.tied_name: str | None = None
        if self.config.tie_word_embeddings and self.is_first != self.is_last:
            self.tied_name = "embed_tokens.weight" if self.is_first else "lm_head.weight"
            if self.tied_name not in dict(self.named_trainable):
                self.tied_name = None  # frozen (LoRA): nothing to keep in step
        self.optimizer = make_optimizer(self.named_trainable, optimizer)
        self.steps = 0
        self._inputs: dict[int, torch.Tensor] = {}
        self._outputs: dict[int, torch.Tensor] = {}

    @property
    def trainable(self) -> list[torch.nn.Parameter]:
        return [p for _, p in self.named_trainable]

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    # --- one micro-batch -----------------------------------------------------------------

    def forward(self, micro: int, inputs: torch.Tensor,
                targets: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states for the next stage, or on the last stage the micro-batch's mean
        loss (a detached scalar); keeps what ``backward(micro)`` needs."""
        if micro in self._outputs:
            raise RemoteProtocolError("duplicate-micro-batch", f"micro-batch {micro} is in flight")
        if self.is_first:
            x = inputs.to(self.device, torch.long)
        else:
            x = inputs.detach().to(self.device).requires_grad_(True)
        out: torch.Tensor = self.model(x)
        if self.is_last:
            if targets is None:
                raise RemoteProtocolError("missing-targets", "the last stage needs targets")
            out = F.cross_entropy(out.reshape(-1, out.shape[-1]),
                                  targets.to(self.device, torch.long).reshape(-1))
        self._inputs[micro] = x
        self._outputs[micro] = out
        return out.detach()

    def backward(self, micro: int, grad_output: torch.Tensor | None = None, *,
                 loss_scale: float = 1.0) -> torch.Tensor | None:
        """Accumulate this micro-batch's gradients; the gradient for the stage before
        (None on the first stage)."""
        try:
            x, out = self._inputs.pop(micro), self._outputs.pop(micro)
        except KeyError:
            raise RemoteProtocolError("unknown-micro-batch",
                                      f"no forward of micro-batch {micro} to go back through"
                                      ) from None
        if self.is_last:
            torch.autograd.backward(out * loss_scale)
        else:
            if grad_output is None:
                raise RemoteProtocolError("missing-gradient", "a middle stage needs grad_output")
            torch.autograd.backward(out, grad_output.to(out.device, out.dtype))
        return None if self.is_first else x.grad

    def drop_in_flight(self) -> None:
        """Forget micro-batches whose backward will never come (a peer vanished)."""
        self._inputs.clear()
        self._outputs.clear()

    # --- the step ------------------------------------------------------------------------

    def tied_grad(self) -> torch.Tensor | None:
        if self.tied_name is None:
            return None
        grad = dict(self.named_trainable)[self.tied_name].grad
        return grad if grad is not None else None

    def set_tied_grad(self, grad: torch.Tensor) -> None:
        assert self.tied_name is not None
        dict(self.named_trainable)[self.tied_name].grad = grad.to(self.device).clone()

    def grad_sq_norm(self) -> float:
        """Sum of squared gradient elements; a tied head counts on the first stage only."""
        total = 0.0
        for name, p in self.named_trainable:
            if p.grad is None or (self.is_last and name == self.tied_name):
                continue
            total += float(p.grad.detach().float().pow(2).sum())
        return total

    def step(self, lr: float, clip_coef: float = 1.0) -> None:
        """One optimizer step at ``lr``, gradients first scaled by ``clip_coef``."""
        if clip_coef != 1.0:
            for p in self.trainable:
                if p.grad is not None:
                    p.grad.mul_(clip_coef)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1

    # --- state ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "start_layer": self.start_layer, "end_layer": self.end_layer, "steps": self.steps,
            "params": {n: p.detach().cpu().clone() for n, p in self.named_trainable},
            "optimizer": self.optimizer.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if (state["start_layer"], state["end_layer"]) != (self.start_layer, self.end_layer):
            raise RemoteProtocolError(
                "stage-mismatch", f"shard of layers [{state['start_layer']}, "
                f"{state['end_layer']}) given to stage [{self.start_layer}, {self.end_layer})")
        params = dict(self.named_trainable)
        if set(state["params"]) != set(params):
            raise RemoteProtocolError("stage-mismatch", "shard holds other parameters")
        with torch.no_grad():
            for name, value in state["params"].items():
                params[name].copy_(value)
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps = int(state["steps"])

    # --- moments, lent to a stage of another replica ----------------------------------------

    def moments(self) -> dict[str, Any]:
        """The optimizer's state per parameter name, its moments in bfloat16: what the same
        stage of another replica, built anew, borrows rather than start without any (half
        the bytes of fp32; an estimate of gradient statistics needs no more)."""
        out: dict[str, dict[str, torch.Tensor]] = {}
        for name, p in self.named_trainable:
            state = {k: (v.detach().to("cpu", torch.bfloat16) if k in MOMENT_KEYS
                         else v.detach().to("cpu", torch.float32))
                     for k, v in self.optimizer.state.get(p, {}).items() if v is not None}
            if state:
                out[name] = state
        return {"start_layer": self.start_layer, "end_layer": self.end_layer,
                "optimizer": self.optimizer_config.name, "moments": out}

    def borrow_moments(self, lent: dict[str, Any]) -> int:
        """Take another replica's ``moments`` of this stage, checked as hostile (layers,
        optimizer, names, keys, shapes, finite values, second moments not negative)
        before any is kept; how many parameters took them."""
        if (lent.get("start_layer"), lent.get("end_layer")) != (self.start_layer,
                                                               self.end_layer):
            raise RemoteProtocolError("stage-mismatch", "moments of other layers")
        if lent.get("optimizer") != self.optimizer_config.name:
            raise RemoteProtocolError("stage-mismatch", "moments of another optimizer")
        keys = OPTIMIZER_STATE_KEYS[self.optimizer_config.name]
        params = dict(self.named_trainable)
        moments = lent.get("moments")
        if not isinstance(moments, dict) or not set(moments) <= set(params):
            raise RemoteProtocolError("stage-mismatch", "moments of other parameters")
        taken: dict[torch.nn.Parameter, dict[str, torch.Tensor]] = {}
        for name, state in moments.items():
            p = params[name]
            if not isinstance(state, dict) or set(state) != keys:
                raise RemoteProtocolError("bad-moments", f"{name}: not the state of "
                                          f"{self.optimizer_config.name}")
            kept: dict[str, torch.Tensor] = {}
            for key, value in state.items():
                shape = () if key == "step" else tuple(p.shape)
                if not isinstance(value, torch.Tensor) or tuple(value.shape) != shape \
                        or not value.is_floating_point() or not bool(value.isfinite().all()):
                    raise RemoteProtocolError("bad-moments", f"{name}.{key}: not a finite "
                                              f"tensor of shape {list(shape)}")
                if key == "step":
                    if not 0 <= float(value) <= MAX_BORROWED_STEP:
                        raise RemoteProtocolError("bad-moments", f"{name}: step {float(value)}")
                    kept[key] = value.to(torch.float32)
                    continue
                if key == "exp_avg_sq" and bool((value < 0).any()):  # its root divides
                    raise RemoteProtocolError("bad-moments", f"{name}: a negative second "
                                              "moment")
                kept[key] = value.to(p.device, p.dtype)
            taken[p] = kept
        for p, kept in taken.items():
            self.optimizer.state[p] = kept
        return len(taken)


def clip_coefficient(sq_norms: list[float], max_norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_'s factor from every stage's squared grad norm."""
    if max_norm <= 0:
        return 1.0
    total = math.sqrt(sum(sq_norms))
    return min(1.0, max_norm / (total + 1e-6))


def make_optimizer(named: list[tuple[str, torch.nn.Parameter]],
                    config: OptimizerConfig) -> torch.optim.Optimizer:
    decay = [p for _, p in named if p.dim() >= 2]
    no_decay = [p for _, p in named if p.dim() < 2]
    groups: list[dict[str, Any]] = [
        {"params": decay, "weight_decay": config.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]] or [{"params": [], "weight_decay": 0.0}]
    if config.name == "sgd":
        return torch.optim.SGD(groups, lr=0.0, momentum=config.momentum)
    return torch.optim.AdamW(groups, lr=0.0, betas=config.betas, eps=config.eps)
