"""What is asked of the planner: serve or train, how much context, which dtypes, what to
maximise, which cards to leave out.

``request_from_dict`` is what the CLI sends and the agent receives; it checks every
field and raises ConfigError with the fix. ``PlanRequest.to_dict`` is canonical: it
goes into the plan and into its ``plan_id``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from p2pswarm.cards import CARD_KINDS, MAX_SIZE_BYTES, parse_size
from p2pswarm.errors import ConfigError
from p2pswarm.planner.profile import (
    AUTO,
    KV_DTYPES,
    LORA_MODULES,
    SERVING_DTYPE,
    WEIGHT_CHOICES,
    ModelProfile,
    normalize_dtype,
)

KINDS = ("serve", "train")
MAXIMIZE = {"serve": ("speed", "context"), "train": ("speed", "seq_len")}
OPTIMIZERS = ("adamw", "sgd")
METHODS = ("full", "lora")
GRANULARITY_TOKENS = 256  # maximize context / seq_len are exact at this step
DEFAULT_CONTEXT = 4096
DEFAULT_SEQ_LEN = 1024
# Least free memory a card must have to be considered at all, per kind (overridable).
DEFAULT_FLOORS_BYTES = {"cuda": 1_000_000_000, "cpu": 1_000_000_000}


@dataclass(frozen=True, slots=True)
class PlanRequest:
    kind: str = "serve"
    context: int | None = None  # serve: tokens per sequence; None: min(4096, model max)
    sequences: int = 1  # serve: sequences decoded together
    stages: int | None = None  # fix the number of stages
    # None: auto to serve (per stage: f16 where the card holds it, else int8, then int4),
    # bf16 to train; an explicit dtype holds for every stage
    weights_dtype: str | None = None
    kv_dtype: str = "f16"
    maximize: str | None = None  # "speed" | "context" (serve) | "seq_len" (train)
    exclude: tuple[str, ...] = ()  # "fellow:index" or "fellow:cpu"
    floors_bytes: tuple[tuple[str, int], ...] = ()  # per card kind, overriding the default
    # training
    seq_len: int | None = None
    micro_batch: int = 1
    micro_batches: int = 1  # per step, per pipeline
    steps: int = 1000
    optimizer: str = "adamw"
    method: str = "full"
    lora_rank: int = 16
    lora_targets: tuple[str, ...] = ("q_proj", "v_proj")
    checkpointing: bool = True

    def floor_bytes(self, kind: str) -> int:
        return dict(self.floors_bytes).get(kind, DEFAULT_FLOORS_BYTES[kind])

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "kind": self.kind, "weights_dtype": self.weights_dtype, "stages": self.stages,
            "maximize": self.maximize, "exclude": list(self.exclude),
            "floors_bytes": {k: v for k, v in self.floors_bytes},
        }
        if self.kind == "serve":
            data.update(context=self.context, sequences=self.sequences, kv_dtype=self.kv_dtype)
        else:
            data.update(seq_len=self.seq_len, micro_batch=self.micro_batch,
                        micro_batches=self.micro_batches, steps=self.steps,
                        optimizer=self.optimizer, method=self.method,
                        checkpointing=self.checkpointing)
            if self.method == "lora":
                data.update(lora_rank=self.lora_rank, lora_targets=list(self.lora_targets))
        return data


MAX_COUNT = 10**9  # more tokens, sequences, stages or steps than any request means
# Fields whose size the planner's work grows with get their own, tighter bounds (a plan
# request comes from any fellow's ``PlanAsk``): each is far beyond any real request.
MAX_STAGES = 256  # a stage is a card; the longest published pipelines have 35-64 stages
MAX_TOKENS = 2**30  # context or sequence length; the longest published context is ~10M
MAX_SEQUENCES = 1 << 20  # the planner searches sessions up to this many
MAX_LORA_RANK = 65_536  # published LoRA ranks are 4 to 256
MAX_EXCLUDED = 1024  # cards left out by name
BOUNDS = {"stages": MAX_STAGES, "context": MAX_TOKENS, "seq_len": MAX_TOKENS,
          "sequences": MAX_SEQUENCES, "micro_batch": MAX_SEQUENCES, "lora_rank": MAX_LORA_RANK}


def _int(data: Mapping[str, Any], key: str, default: Any, minimum: int = 1) -> Any:
    value = data.get(key, default)
    if value is None:
        return None
    most = BOUNDS.get(key, MAX_COUNT)
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= most:
        flag = "--" + key.replace("_", "-")
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        raise ConfigError(f"{flag} must be a whole number from {minimum} to {most:,}, "
                          f"got {shown}")
    return value


def request_from_dict(data: Mapping[str, Any]) -> PlanRequest:
    """A request from its dict form, every field checked (model-independent checks)."""
    if not isinstance(data, Mapping):
        raise ConfigError("a plan request must be a JSON object")
    kind = data.get("kind", "serve")
    if kind not in KINDS:
        raise ConfigError(f"kind {kind!r} must be \"serve\" or \"train\"")
    maximize = data.get("maximize")
    if maximize is not None and maximize not in MAXIMIZE[kind]:
        raise ConfigError(f"--maximize {maximize} does not apply to a {kind} plan: use "
                          f"{' or '.join(MAXIMIZE[kind])}")
    weights = data.get("weights_dtype")
    weights = normalize_dtype(weights, WEIGHT_CHOICES, "--weights-dtype") if weights else None
    kv = normalize_dtype(data.get("kv_dtype") or "f16", KV_DTYPES, "--kv-dtype")
    exclude = data.get("exclude") or data.get("exclude_cards") or ()
    if isinstance(exclude, str) or not isinstance(exclude, (list, tuple)) \
            or not all(isinstance(e, str) for e in exclude):
        raise ConfigError("exclude must be a list of \"FELLOW:INDEX\" strings")
    if len(exclude) > MAX_EXCLUDED:
        raise ConfigError(f"--exclude names {len(exclude):,} cards; at most {MAX_EXCLUDED:,}")
    for item in exclude:
        fellow, _, index = item.rpartition(":")
        if not fellow or not (index.isdigit() or index in CARD_KINDS):
            raise ConfigError(f"--exclude {item!r} must be FELLOW:INDEX, e.g. fxserver:0 "
                              f"or fxserver:cpu")
    floors: dict[str, int] = {}
    for key, value in dict(data.get("floors_bytes") or {}).items():
        if key not in CARD_KINDS:
            raise ConfigError(f"--floor {key}: the kind must be cuda or cpu, e.g. cuda=2GB")
        if isinstance(value, str):
            floors[key] = parse_size(value)
        elif isinstance(value, int) and not isinstance(value, bool) \
                and 0 <= value <= MAX_SIZE_BYTES:
            floors[key] = value
        else:
            raise ConfigError(f"--floor {key}: give a size such as \"2GB\" or a number of "
                              f"bytes, got {str(value)[:40]!r}")
    optimizer = data.get("optimizer", "adamw")
    if optimizer not in OPTIMIZERS:
        raise ConfigError(f"--optimizer {optimizer!r} must be one of {', '.join(OPTIMIZERS)}")
    method = data.get("method", "full")
    if method not in METHODS:
        raise ConfigError(f"method {method!r} must be full or lora")
    targets = tuple(data.get("lora_targets") or ("q_proj", "v_proj"))
    unknown = [t for t in targets if t not in LORA_MODULES]
    if unknown:
        raise ConfigError(f"--lora-targets {','.join(unknown)} unknown: use some of "
                          f"{', '.join(LORA_MODULES)}")
    if kind == "train" and method == "full" and weights in ("int8", "int4"):
        raise ConfigError(f"full training needs f32, f16 or bf16 weights, not {weights}: "
                          f"add --lora-rank 16 to train LoRA adapters on {weights} weights")
    return PlanRequest(
        kind=kind, context=_int(data, "context", None), sequences=_int(data, "sequences", 1),
        stages=_int(data, "stages", None), weights_dtype=weights, kv_dtype=kv,
        maximize=maximize, exclude=tuple(sorted(set(exclude))),
        floors_bytes=tuple(sorted(floors.items())), seq_len=_int(data, "seq_len", None),
        micro_batch=_int(data, "micro_batch", 1), micro_batches=_int(data, "micro_batches", 1),
        steps=_int(data, "steps", 1000), optimizer=optimizer, method=method,
        lora_rank=_int(data, "lora_rank", 16), lora_targets=tuple(sorted(set(targets))),
        checkpointing=bool(data.get("checkpointing", True)),
    )


def serving_dtype(request: PlanRequest) -> str:
    """The dtype a stage keeps where its card holds it: the one asked for, or f16."""
    weights = request.weights_dtype
    return SERVING_DTYPE if weights in (None, AUTO) else weights


def resolve(request: PlanRequest, profile: ModelProfile) -> PlanRequest:
    """Fill the model-dependent defaults and check the request against the model."""
    weights = request.weights_dtype or (AUTO if request.kind == "serve" else "bf16")
    if weights == AUTO and request.kind == "train":
        weights = "bf16"  # a trained stage's weights are not quantised behind one's back
    r = replace(request, weights_dtype=weights)
    if r.stages is not None and r.stages > profile.n_layers:
        raise ConfigError(f"--stages {r.stages} is more than the model's {profile.n_layers} "
                          f"layers: use --stages {profile.n_layers} or fewer")
    limit = profile.max_context
    if r.kind == "serve":
        context = r.context if r.context is not None else min(DEFAULT_CONTEXT, limit)
        if context > limit:
            raise ConfigError(f"--context {context:,} is more than {profile.name}'s maximum "
                              f"of {limit:,}: use --context {limit} or less")
        return replace(r, context=context)
    seq_len = r.seq_len if r.seq_len is not None else min(DEFAULT_SEQ_LEN, limit)
    if seq_len > limit:
        raise ConfigError(f"--seq-len {seq_len:,} is more than {profile.name}'s maximum "
                          f"of {limit:,}: use --seq-len {limit} or less")
    return replace(r, seq_len=seq_len)


__all__ = [
    "BOUNDS",
    "DEFAULT_FLOORS_BYTES",
    "GRANULARITY_TOKENS",
    "MAXIMIZE",
    "PlanRequest",
    "request_from_dict",
    "resolve",
    "serving_dtype",
]
