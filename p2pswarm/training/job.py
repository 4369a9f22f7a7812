"""A training job as a value: ``job.json`` read, checked and turned into frozen config.

Every field is checked once, here, with a ConfigError that says what to write instead;
the rest of ``training/`` trusts these values. Paths in ``job.json`` are relative to the
file's directory. ``JobConfig.to_dict`` is canonical (sorted, defaults filled in), so
two fellows that read the same job agree byte for byte on what they run.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from p2pswarm.errors import ConfigError
from p2pswarm.models.hub import is_hub_id
from p2pswarm.names import is_hex_digest

MODES = ("full", "lora")
OPTIMIZERS = ("adamw", "sgd")
SCHEDULES = ("cosine", "constant")
CODECS = ("fp32", "fp16", "int8", "topk", "qsgd")
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
WEIGHT_DTYPES = ("f32", "f16", "bf16")
BASE_DTYPES = ("f32", "f16", "bf16", "int8", "int4")
TOKEN_DTYPES = ("uint16", "int32")
CORPUS = "builtin:corpus"  # the public-domain text shipped with the package
DATA_REF = "sha256:"  # a data file sent with the job, named by its SHA-256 (hex)
MAX_COUNT = 10**9  # the most steps, tokens, replicas... a job may name: beyond any real run
_HEX64 = frozenset("0123456789abcdef")


def is_data_ref(name: str) -> bool:
    """Whether ``name`` names a data file sent with the job (``sha256:`` and 64 hex)."""
    digest = name[len(DATA_REF):]
    return name.startswith(DATA_REF) and len(digest) == 64 and set(digest) <= _HEX64


def local_data_files(data: DataConfig) -> list[str]:
    """The data files ``data`` names on a disk (not the built-in corpus, not sent ones)."""
    return [f for f in (*data.files, *data.token_files) if f != CORPUS and not is_data_ref(f)]


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Which model: a built-in name, a model directory, or a config to start from scratch."""

    name: str | None = None  # built-in name, model directory or cached hub id (ORG/NAME)
    init_config: tuple[tuple[str, Any], ...] | None = None  # HF config.json, random init

    @property
    def from_scratch(self) -> bool:
        return self.init_config is not None

    def to_dict(self) -> Any:
        if self.init_config is not None:
            return {"config": dict(self.init_config)}
        return self.name


@dataclass(frozen=True, slots=True)
class DataConfig:
    """Text files (tokenized with the model's tokenizer) and/or pre-tokenized arrays."""

    files: tuple[str, ...] = (CORPUS,)
    token_files: tuple[str, ...] = ()  # raw little-endian arrays of ``token_dtype``
    token_dtype: str = "uint16"
    holdout_fraction: float = 0.05  # the tail of the tokens, kept out for evaluation


@dataclass(frozen=True, slots=True)
class LrSchedule:
    """Linear warmup to ``peak_lr``, then cosine down to ``min_lr`` at ``total_steps``."""

    peak_lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 0
    total_steps: int = 1000
    kind: str = "cosine"  # "cosine" | "constant"

    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step ``step`` (0-based); float arithmetic only,
        so every fellow computes the same value."""
        if step < self.warmup_steps:
            return self.peak_lr * (step + 1) / self.warmup_steps
        if self.kind == "constant":
            return self.peak_lr
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        return self.min_lr + 0.5 * (self.peak_lr - self.min_lr) * (1 + math.cos(math.pi * progress))


@dataclass(frozen=True, slots=True)
class OptimizerConfig:
    name: str = "adamw"
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.0  # on matrices (embeddings too); norms and biases stay free
    momentum: float = 0.9  # sgd only
    grad_clip: float = 1.0  # global L2 norm over every stage; 0 turns clipping off


@dataclass(frozen=True, slots=True)
class LoraConfig:
    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = ("q_proj", "v_proj")
    base_dtype: str = "f32"  # the frozen base: f32/f16/bf16, or int8/int4 quantized

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


@dataclass(frozen=True, slots=True)
class SyncConfig:
    """DiLoCo-style sync between replicas of each stage."""

    inner_steps: int = 50  # H: local steps of the fastest replica per round
    # "auto" (the default): the fleet plan sizes the round to the links and the leader
    # sets inner_steps from it before placing; 50 where no fleet plan gives one
    inner_steps_auto: bool = False
    outer_lr: float = 0.7
    outer_momentum: float = 0.9  # Nesterov
    codec: str = "int8"  # replicas' deltas, keeper-bound
    codec_options: tuple[tuple[str, Any], ...] = ()
    update_codec: str | None = None  # the keeper's update to every replica; None: as codec
    update_codec_options: tuple[tuple[str, Any], ...] = ()
    staleness_bound: int = 2  # rounds; older contributions are dropped
    staleness_decay: float = 0.5  # weight of a contribution s rounds late: decay ** s
    round_deadline_s: float = 60.0  # a round closes then with whatever arrived
    speed_aware: bool = True  # slower replicas take fewer local steps per round

    def codec_kwargs(self) -> dict[str, Any]:
        return dict(self.codec_options)

    def update_codec_name(self) -> str:
        return self.update_codec or self.codec

    def update_codec_kwargs(self) -> dict[str, Any]:
        if self.update_codec is None:
            return dict(self.codec_options)
        return dict(self.update_codec_options)


@dataclass(frozen=True, slots=True)
class CheckpointConfig:
    dir: str | None = None
    interval_steps: int = 100
    keep: int = 3  # complete checkpoints kept on disk
    copies: int = 2  # fellows holding each stage shard


@dataclass(frozen=True, slots=True)
class JobLaunch:
    """How to start the job, the same as ``p2pswarm train``'s flags: cards to leave out
    (``--exclude``), ``maximize: "seq_len"`` (``--maximize-seq-len``), and the plan it
    must start on (``--plan-id``). A flag given on the command line (or in the request
    of the API or MCP) overrides the field in job.json; a flag not given leaves it."""

    exclude_cards: tuple[str, ...] = ()
    maximize: str | None = None
    plan_id: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.exclude_cards:
            out["exclude_cards"] = list(self.exclude_cards)
        if self.maximize is not None:
            out["maximize"] = self.maximize
        if self.plan_id is not None:
            out["plan_id"] = self.plan_id
        return out


@dataclass(frozen=True, slots=True)
class JobConfig:
    model: ModelSpec
    data: DataConfig = field(default_factory=DataConfig)
    seq_len: int = 128
    micro_batch: int = 8  # with auto_batch: where no plan gives one (evaluation, one process)
    micro_batches: int = 1  # per optimizer step, per pipeline
    auto_batch: bool = False  # "micro_batch": "auto": each replica's from its cards
    steps: int = 1000
    lr: LrSchedule = field(default_factory=LrSchedule)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    mode: str = "full"
    lora: LoraConfig | None = None
    weights_dtype: str = "f32"  # trained weights (full mode)
    replicas: int | None = None  # None: as many as the cards hold ("auto")
    sync: SyncConfig = field(default_factory=SyncConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    seed: int = 0
    launch: JobLaunch = field(default_factory=lambda: JobLaunch())

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.micro_batch * self.micro_batches

    @classmethod
    def from_json(cls, source: str | Path) -> JobConfig:
        """Read ``job.json`` (a path) or JSON text; relative paths are resolved against
        the file's directory."""
        path: Path | None = None
        text = str(source)
        if isinstance(source, Path) or not text.lstrip().startswith("{"):
            path = Path(source).expanduser().resolve()
            try:
                text = path.read_text()
            except OSError as exc:
                raise ConfigError(f"cannot read job file {path}: {exc.strerror}") from exc
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as exc:  # RecursionError: nested too deep
            where = path or "job"
            raise ConfigError(f"{where} is not valid JSON: {exc}") from exc
        return cls.from_dict(data, base_dir=path.parent if path else None)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], base_dir: Path | None = None) -> JobConfig:
        return _job(data, base_dir)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "model": self.model.to_dict(),
            "data": {"files": list(self.data.files), "token_files": list(self.data.token_files),
                     "token_dtype": self.data.token_dtype,
                     "holdout_fraction": self.data.holdout_fraction},
            "seq_len": self.seq_len,
            "micro_batch": "auto" if self.auto_batch else self.micro_batch,
            "micro_batches": self.micro_batches, "steps": self.steps,
            "lr": {"peak": self.lr.peak_lr, "min": self.lr.min_lr,
                   "warmup_steps": self.lr.warmup_steps, "schedule": self.lr.kind},
            "optimizer": {"name": self.optimizer.name, "betas": list(self.optimizer.betas),
                          "eps": self.optimizer.eps,
                          "weight_decay": self.optimizer.weight_decay,
                          "momentum": self.optimizer.momentum,
                          "grad_clip": self.optimizer.grad_clip},
            "mode": self.mode, "weights_dtype": self.weights_dtype,
            "replicas": "auto" if self.replicas is None else self.replicas,
            "sync": {"inner_steps": "auto" if self.sync.inner_steps_auto
                     else self.sync.inner_steps, "outer_lr": self.sync.outer_lr,
                     "outer_momentum": self.sync.outer_momentum, "codec": self.sync.codec,
                     "codec_options": dict(self.sync.codec_options),
                     "update_codec": self.sync.update_codec,
                     "update_codec_options": dict(self.sync.update_codec_options),
                     "staleness_bound": self.sync.staleness_bound,
                     "staleness_decay": self.sync.staleness_decay,
                     "round_deadline_s": self.sync.round_deadline_s,
                     "speed_aware": self.sync.speed_aware},
            "checkpoint": {"dir": self.checkpoint.dir,
                           "interval_steps": self.checkpoint.interval_steps,
                           "keep": self.checkpoint.keep, "copies": self.checkpoint.copies},
            "seed": self.seed,
        }
        out.update(self.launch.to_dict())
        if self.lora is not None:
            out["lora"] = {"rank": self.lora.rank, "alpha": self.lora.alpha,
                           "targets": list(self.lora.targets),
                           "base_dtype": self.lora.base_dtype}
        return out

    def plan_request(self) -> dict[str, Any]:
        """The planner's ``kind="train"`` request for this job (see planner/request.py)."""
        request: dict[str, Any] = {
            "kind": "train", "seq_len": self.seq_len, "micro_batch": self.micro_batch,
            "micro_batches": self.micro_batches, "steps": self.steps,
            "optimizer": self.optimizer.name, "method": self.mode,
        }
        if self.lora is not None:
            request.update(lora_rank=self.lora.rank, lora_targets=list(self.lora.targets),
                           weights_dtype=self.lora.base_dtype)
        else:
            request["weights_dtype"] = self.weights_dtype
        return request

    def fleet_request(self) -> dict[str, Any]:
        """The planner's fleet request (``planner.fleet``): the training request with
        the replicas, the batch rule and the sync settings."""
        sync = self.sync
        return {**self.plan_request(),
                "micro_batch": "auto" if self.auto_batch else self.micro_batch,
                "replicas": "auto" if self.replicas is None else self.replicas,
                "inner_steps": "auto" if sync.inner_steps_auto else sync.inner_steps,
                "codec": sync.codec,
                "codec_options": dict(sync.codec_options), "update_codec": sync.update_codec,
                "update_codec_options": dict(sync.update_codec_options)}


# --- reading -----------------------------------------------------------------------------

LAUNCH_KEYS = ("exclude_cards", "maximize", "plan_id")
_TOP_KEYS = {"model", "data", "seq_len", "micro_batch", "micro_batches", "steps", "lr",
             "optimizer", "mode", "lora", "weights_dtype", "replicas", "sync", "checkpoint",
             "seed", *LAUNCH_KEYS}
MAX_EXCLUDED_CARDS = 1024
MAX_CARD_NAME_CHARS = 200


def split_launch(config: Mapping[str, Any]) -> tuple[dict[str, Any], JobLaunch]:
    """job.json without its launch fields, and those fields, checked: what the leader
    plans is the job itself; how to start it travels beside it, as the flags do."""
    if not isinstance(config, Mapping):
        raise ConfigError("job.json must hold a JSON object")
    return ({k: v for k, v in config.items() if k not in LAUNCH_KEYS}, _launch(config))


def _launch(data: Mapping[str, Any]) -> JobLaunch:
    exclude = data.get("exclude_cards") or []
    if (not isinstance(exclude, list) or len(exclude) > MAX_EXCLUDED_CARDS
            or not all(isinstance(e, str) and 0 < len(e) <= MAX_CARD_NAME_CHARS
                       for e in exclude)):
        raise ConfigError('exclude_cards must list cards as "FELLOW:INDEX" strings, e.g. '
                          '["pi-3:cpu", "rig:0"]')
    maximize = data.get("maximize")
    if maximize not in (None, "seq_len"):
        raise ConfigError(f'maximize {str(maximize)[:40]!r}: a job maximizes "seq_len" or '
                          "nothing (null)")
    plan_id = data.get("plan_id")
    if plan_id is not None and not is_hex_digest(plan_id, 16):
        raise ConfigError(f"plan_id {str(plan_id)[:40]!r} must be 16 lowercase hex digits, as "
                          "`p2pswarm train --plan` prints it")
    return JobLaunch(exclude_cards=tuple(exclude), maximize=maximize, plan_id=plan_id)


def _job(data: Mapping[str, Any], base_dir: Path | None) -> JobConfig:
    if not isinstance(data, Mapping):
        raise ConfigError("job.json must hold a JSON object")
    _no_unknown(data, _TOP_KEYS, "job")
    if "model" not in data:
        raise ConfigError('job: "model" is required: a built-in name such as "tiny-llama", '
                          'a model directory, or {"config": {...}} to start from scratch')
    steps = _int(data, "steps", 1000, "steps")
    mode = data.get("mode", "full")
    if mode not in MODES:
        raise ConfigError(f'mode {mode!r} must be "full" or "lora"')
    lora = _lora(data.get("lora") or {}) if mode == "lora" else None
    if mode == "full" and data.get("lora") is not None:
        raise ConfigError('job: "lora" settings given but mode is "full": add "mode": "lora"')
    weights = str(data.get("weights_dtype", "f32"))
    if weights not in WEIGHT_DTYPES:
        raise ConfigError(f"weights_dtype {weights!r}: full training needs one of "
                          f"{', '.join(WEIGHT_DTYPES)} (quantized bases are for mode lora)")
    replicas_raw = data.get("replicas", "auto")
    replicas = None if replicas_raw == "auto" else _int(data, "replicas", 1, "replicas")
    # "auto" is the default: each replica's batch from its cards (a number still wins)
    auto_batch = data.get("micro_batch", "auto") in ("auto", None)
    if isinstance(data.get("micro_batch"), str) and not auto_batch:
        raise ConfigError(f"micro_batch must be a whole number or \"auto\" (each replica's "
                          f"from its cards), got {str(data['micro_batch'])[:40]!r}")
    seed = data.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ConfigError(f"seed must be a whole number from 0 to 2**63-1, got {seed!r:.40}")
    return JobConfig(
        model=_model(data["model"], base_dir),
        data=_data(data.get("data") or {}, base_dir),
        seq_len=_int(data, "seq_len", 128, "seq_len"),
        micro_batch=8 if auto_batch else _int(data, "micro_batch", 8, "micro_batch"),
        auto_batch=auto_batch,
        micro_batches=_int(data, "micro_batches", 1, "micro_batches"),
        steps=steps, lr=_lr(data.get("lr") or {}, steps),
        optimizer=_optimizer(data.get("optimizer") or {}),
        mode=mode, lora=lora, weights_dtype=weights, replicas=replicas,
        sync=_sync(data.get("sync") or {}),
        checkpoint=_checkpoint(data.get("checkpoint") or {}, base_dir), seed=seed,
        launch=_launch(data),
    )


def _model(raw: Any, base_dir: Path | None) -> ModelSpec:
    from p2pswarm.planner.profile import BUILTIN_MODELS

    if isinstance(raw, str) and raw:
        if raw in BUILTIN_MODELS:
            return ModelSpec(name=raw)
        path = _path(raw, base_dir)
        if is_hub_id(raw) and not path.exists():  # ORG/NAME: from the Hugging Face cache
            return ModelSpec(name=raw)
        return ModelSpec(name=str(path))
    if isinstance(raw, Mapping) and set(raw) == {"config"} and isinstance(raw["config"], Mapping):
        from p2pswarm.shapes.model_config import ModelConfig

        config = dict(raw["config"])
        ModelConfig.from_hf(config)  # refuse a model the runtime cannot build, now
        return ModelSpec(init_config=tuple(sorted(config.items())))
    raise ConfigError('model must be a built-in name ("tiny-llama", "small-llama"), a model '
                      'directory, a hub id in the Hugging Face cache ("Qwen/Qwen3-0.6B"), '
                      'or {"config": {...config.json...}} to start from scratch')


def _data(raw: Any, base_dir: Path | None) -> DataConfig:
    if not isinstance(raw, Mapping):
        raise ConfigError('data must be an object such as {"files": ["notes.txt"]}')
    _no_unknown(raw, {"files", "token_files", "token_dtype", "holdout_fraction"}, "data")
    files = _str_list(raw, "files", "data")
    token_files = _str_list(raw, "token_files", "data")
    if files is None and token_files is None:
        files = [CORPUS]
    resolved = tuple(_data_file(f, base_dir) for f in files or ())
    tokens = tuple(_data_file(f, base_dir) for f in token_files or ())
    if not resolved and not tokens:
        raise ConfigError("data: give at least one text file or token file")
    dtype = raw.get("token_dtype", "uint16")
    if dtype not in TOKEN_DTYPES:
        raise ConfigError(f"data.token_dtype {dtype!r} must be one of {', '.join(TOKEN_DTYPES)}")
    holdout = _float(raw, "holdout_fraction", 0.05, "data", lo=0.0, hi=0.5)
    return DataConfig(files=resolved, token_files=tokens, token_dtype=dtype,
                      holdout_fraction=holdout)


def _lr(raw: Any, steps: int) -> LrSchedule:
    if not isinstance(raw, Mapping):
        raise ConfigError('lr must be an object such as {"peak": 0.001, "warmup_steps": 50}')
    _no_unknown(raw, {"peak", "min", "warmup_steps", "schedule"}, "lr")
    peak = _float(raw, "peak", 1e-3, "lr", lo=0.0, open_lo=True)
    low = _float(raw, "min", peak / 10, "lr", lo=0.0)
    if low > peak:
        raise ConfigError(f"lr.min {low} is above lr.peak {peak}")
    warmup = _int(raw, "warmup_steps", 0, "lr.warmup_steps", minimum=0)
    if warmup >= steps:
        raise ConfigError(f"lr.warmup_steps {warmup} must be fewer than the {steps} steps")
    kind = raw.get("schedule", "cosine")
    if kind not in SCHEDULES:
        raise ConfigError(f"lr.schedule {kind!r} must be one of {', '.join(SCHEDULES)}")
    return LrSchedule(peak_lr=peak, min_lr=low, warmup_steps=warmup, total_steps=steps,
                      kind=kind)


def _optimizer(raw: Any) -> OptimizerConfig:
    if isinstance(raw, str):
        raw = {"name": raw}
    if not isinstance(raw, Mapping):
        raise ConfigError('optimizer must be "adamw", "sgd" or an object with "name"')
    _no_unknown(raw, {"name", "betas", "eps", "weight_decay", "momentum", "grad_clip"},
                "optimizer")
    name = raw.get("name", "adamw")
    if name not in OPTIMIZERS:
        raise ConfigError(f"optimizer {name!r} must be one of {', '.join(OPTIMIZERS)}")
    betas = raw.get("betas", [0.9, 0.95])
    if (not isinstance(betas, (list, tuple)) or len(betas) != 2
            or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in betas)):
        raise ConfigError(f"optimizer.betas must be two numbers in [0, 1), got {betas!r}")
    return OptimizerConfig(
        name=name, betas=(float(betas[0]), float(betas[1])),
        eps=_float(raw, "eps", 1e-8, "optimizer", lo=0.0, open_lo=True),
        weight_decay=_float(raw, "weight_decay", 0.0, "optimizer", lo=0.0),
        momentum=_float(raw, "momentum", 0.9, "optimizer", lo=0.0, hi=1.0, open_hi=True),
        grad_clip=_float(raw, "grad_clip", 1.0, "optimizer", lo=0.0),
    )


def _lora(raw: Any) -> LoraConfig:
    if not isinstance(raw, Mapping):
        raise ConfigError('lora must be an object such as {"rank": 8, "targets": ["q_proj"]}')
    _no_unknown(raw, {"rank", "alpha", "targets", "base_dtype"}, "lora")
    rank = _int(raw, "rank", 8, "lora.rank")
    targets = _str_list(raw, "targets", "lora") or ["q_proj", "v_proj"]
    unknown = [t for t in targets if t not in LORA_TARGETS]
    if unknown:
        raise ConfigError(f"lora.targets {', '.join(unknown)} unknown: use some of "
                          f"{', '.join(LORA_TARGETS)}")
    base = str(raw.get("base_dtype", "f32"))
    if base not in BASE_DTYPES:
        raise ConfigError(f"lora.base_dtype {base!r} must be one of {', '.join(BASE_DTYPES)}")
    return LoraConfig(rank=rank, alpha=_float(raw, "alpha", 2.0 * rank, "lora", lo=0.0,
                                              open_lo=True),
                      targets=tuple(sorted(set(targets), key=LORA_TARGETS.index)),
                      base_dtype=base)


def _sync(raw: Any) -> SyncConfig:
    if not isinstance(raw, Mapping):
        raise ConfigError('sync must be an object such as {"inner_steps": 50, "codec": "int8"}')
    _no_unknown(raw, {"inner_steps", "outer_lr", "outer_momentum", "codec", "codec_options",
                      "update_codec", "update_codec_options", "staleness_bound",
                      "staleness_decay", "round_deadline_s", "speed_aware"}, "sync")
    codec, options = _codec(raw, "codec", "int8")
    update_codec, update_options = (None, {}) if raw.get("update_codec") is None else (
        _codec(raw, "update_codec", "int8"))
    inner_auto = raw.get("inner_steps", "auto") in ("auto", None)
    return SyncConfig(
        inner_steps=50 if inner_auto else _int(raw, "inner_steps", 50, "sync.inner_steps"),
        inner_steps_auto=inner_auto,
        outer_lr=_float(raw, "outer_lr", 0.7, "sync", lo=0.0, open_lo=True),
        outer_momentum=_float(raw, "outer_momentum", 0.9, "sync", lo=0.0, hi=1.0, open_hi=True),
        codec=codec, codec_options=tuple(sorted(options.items())),
        update_codec=update_codec, update_codec_options=tuple(sorted(update_options.items())),
        staleness_bound=_int(raw, "staleness_bound", 2, "sync.staleness_bound", minimum=0),
        staleness_decay=_float(raw, "staleness_decay", 0.5, "sync", lo=0.0, hi=1.0),
        round_deadline_s=_float(raw, "round_deadline_s", 60.0, "sync", lo=0.0, open_lo=True),
        speed_aware=_bool(raw, "speed_aware", True, "sync"),
    )


def _codec(raw: Mapping[str, Any], key: str, default: str) -> tuple[str, dict[str, Any]]:
    codec = raw.get(key, default)
    if codec not in CODECS:
        raise ConfigError(f"sync.{key} {codec!r} must be one of {', '.join(CODECS)}")
    options = raw.get(f"{key}_options") or {}
    if not isinstance(options, Mapping):
        raise ConfigError(f'sync.{key}_options must be an object, e.g. {{"fraction": 0.01}}')
    from p2pswarm.training.codec import make_codec

    make_codec(codec, **dict(options))  # refuse unknown or out-of-range options now
    return codec, dict(options)


def _checkpoint(raw: Any, base_dir: Path | None) -> CheckpointConfig:
    if not isinstance(raw, Mapping):
        raise ConfigError('checkpoint must be an object such as {"dir": "ckpt", '
                          '"interval_steps": 100}')
    _no_unknown(raw, {"dir", "interval_steps", "keep", "copies"}, "checkpoint")
    directory = raw.get("dir")
    if directory is not None and (not isinstance(directory, str) or not directory):
        raise ConfigError("checkpoint.dir must be a directory path")
    return CheckpointConfig(
        dir=None if directory is None else str(_path(directory, base_dir)),
        interval_steps=_int(raw, "interval_steps", 100, "checkpoint.interval_steps"),
        keep=_int(raw, "keep", 3, "checkpoint.keep"),
        copies=_int(raw, "copies", 2, "checkpoint.copies"),
    )


# --- field checks --------------------------------------------------------------------------


def _no_unknown(raw: Mapping[str, Any], known: set[str], where: str) -> None:
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f"{where}: unknown setting {', '.join(map(repr, unknown))}; "
                          f"known: {', '.join(sorted(known))}")


def _int(raw: Mapping[str, Any], key: str, default: int, name: str, minimum: int = 1,
         maximum: int = MAX_COUNT) -> int:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        raise ConfigError(f"{name} must be a whole number from {minimum} to {maximum:,}, "
                          f"got {shown}")
    return value


def _float(raw: Mapping[str, Any], key: str, default: float, where: str, *,
           lo: float | None = None, hi: float | None = None, open_lo: bool = False,
           open_hi: bool = False) -> float:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{where}.{key} must be a number, got {value!r}")
    value = float(value)
    if lo is not None and (value < lo or (open_lo and value == lo)):
        raise ConfigError(f"{where}.{key} must be {'above' if open_lo else 'at least'} {lo}, "
                          f"got {value}")
    if hi is not None and (value > hi or (open_hi and value == hi)):
        raise ConfigError(f"{where}.{key} must be {'below' if open_hi else 'at most'} {hi}, "
                          f"got {value}")
    return value


def _bool(raw: Mapping[str, Any], key: str, default: bool, where: str) -> bool:
    value = raw.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"{where}.{key} must be true or false, got {value!r}")
    return value


def _str_list(raw: Mapping[str, Any], key: str, where: str) -> list[str] | None:
    value = raw.get(key)
    if value is None:
        return None
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ConfigError(f"{where}.{key} must be a list of strings")
    return list(value)


def _data_file(raw: str, base_dir: Path | None) -> str:
    """A data file as the job keeps it: the corpus, a file sent with the job, or a path
    (relative ones against the job file's directory)."""
    if raw == CORPUS or is_data_ref(raw):
        return raw
    if raw.startswith(DATA_REF):
        raise ConfigError(f"data file {raw[:80]!r}: a sent file is named sha256: and 64 "
                          "lowercase hex digits")
    return str(_path(raw, base_dir))


def _path(raw: str, base_dir: Path | None) -> Path:
    path = Path(raw).expanduser()
    return path if path.is_absolute() or base_dir is None else base_dir / path
