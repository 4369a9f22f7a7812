"""A job's checkpoint out as files anyone can serve: a Hugging Face model directory, or
LoRA adapters on their own.

The checkpoint's manifest carries the job (``meta.job``) and the stage cut it trained
with (``meta.cut``). A full-training job becomes ``config.json`` (recording the cut as
``p2pswarm_stage_cut``, which the planner then serves on by default) and safetensors,
plus the base directory's tokenizer files when it has them. A LoRA job becomes
``adapter_config.json`` and ``adapter_model.safetensors`` (PEFT's layout), the
adapter config naming the base (``base_model_name_or_path``) and the cut; a base
initialised from scratch is written beside them under ``base/``, since no directory
holds it.

The export is written into a temporary sibling directory and renamed into place, so an
export that fails leaves nothing half written, and an existing non-empty directory is
never touched.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from p2pswarm.errors import ConfigError
from p2pswarm.training.checkpoint import CheckpointStore, atomic_write_bytes

# files a model directory may hold besides weights and config.json (copied when present)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "generation_config.json")
BASE_DIR = "base"


@dataclass(frozen=True, slots=True)
class Exported:
    """What an export wrote."""

    path: Path
    kind: str  # "model" (a Hugging Face directory) or "adapter" (LoRA adapters only)
    job_id: str
    step: int
    cut: tuple[int, ...]
    base: str | None  # adapters: where the base model is
    files: tuple[str, ...]
    holdout_loss: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"path": str(self.path), "kind": self.kind, "job_id": self.job_id,
                "step": self.step, "cut": list(self.cut), "base": self.base,
                "files": list(self.files), "holdout_loss": self.holdout_loss}


def check_out_dir(out_dir: str | Path) -> Path:
    """``out_dir`` as an absolute path, refused when it exists and is not an empty
    directory (an export never overwrites anything)."""
    out = Path(out_dir).expanduser().resolve()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out} is not empty: give a new directory to export into")
    if not out.parent.is_dir():
        raise ConfigError(f"{out.parent} does not exist: create it, or export elsewhere")
    return out


def export_checkpoint(store: CheckpointStore, out_dir: str | Path, *, step: int | None = None,
                      holdout_batches: int = 0) -> Exported:
    """Write checkpoint ``step`` (the latest complete one by default) of the job that wrote
    ``store`` into ``out_dir``. With ``holdout_batches``, also measure the trained model's
    loss on that many held-out batches of the job's data."""
    import torch

    from p2pswarm.training.job import JobConfig

    out = check_out_dir(out_dir)
    if step is None:
        step = store.latest()
        if step is None:
            raise ConfigError(f"no complete checkpoint in {store.directory}: the job has "
                              "not written one yet")
    try:
        meta = store.manifest(step)["meta"]
        job = JobConfig.from_dict(meta["job"])
        cut = tuple(int(c) for c in meta["cut"])
        job_id = str(meta.get("job_id") or "")
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"checkpoint step {step} in {store.directory} is not a job's "
                          f"checkpoint: {exc}") from exc
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            kind, base, holdout = _write(store, step, job, cut, tmp, holdout_batches)
        files = tuple(sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file()))
        if out.exists():
            out.rmdir()  # empty, checked above
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        torch.set_num_threads(threads)
    return Exported(path=out, kind=kind, job_id=job_id, step=step, cut=cut,
                    base=str(out / BASE_DIR) if base == BASE_DIR else base, files=files,
                    holdout_loss=holdout)


def _write(store: CheckpointStore, step: int, job: Any, cut: tuple[int, ...], out: Path,
           holdout_batches: int) -> tuple[str, str | None, float | None]:
    from p2pswarm.training.export import STAGE_CUT_KEY, export_hf
    from p2pswarm.training.lora import ADAPTER_CONFIG, save_adapters
    from p2pswarm.training.replica import build_stages, synced_tensors
    from p2pswarm.training.source import open_job_model
    from p2pswarm.training.sync import write_flat

    source = open_job_model(job.model, job.seed)
    stages = build_stages(job, source, list(cut))
    shards = store.manifest(step)["shards"]
    synced = "replica-1.stage-0" in shards  # a lone replica's keepers never take a round
    for i, stage in enumerate(stages):
        try:
            shard = store.read(step, f"replica-0.stage-{i}")
        except (KeyError, OSError) as exc:
            raise ConfigError(f"checkpoint step {step} lacks stage {i} of replica 0: "
                              f"{exc}") from exc
        stage.load_state_dict(shard["stage"])
        if synced and f"keeper.stage-{i}" in shards:
            # several replicas: the model is the keepers' global parameters (each
            # replica's own are those plus its local steps since its last round)
            write_flat(store.read(step, f"keeper.stage-{i}")["params"], synced_tensors(stage))
    holdout = _holdout(job, stages, holdout_batches) if holdout_batches > 0 else None
    hf_config = dict(getattr(source, "hf_config", None) or source.config.to_hf())
    if job.lora is None:
        export_hf([s.model for s in stages], hf_config, out)
        if not job.model.from_scratch:
            _copy_tokenizer(str(job.model.name), out)
        return "model", None, holdout
    if job.model.from_scratch:
        base = BASE_DIR  # no directory holds a scratch base: write it beside the adapters
        _export_base(job, source, cut, hf_config, out / BASE_DIR)
        base_name = str(out / BASE_DIR)
    else:
        base = base_name = str(job.model.name)
    save_adapters([s.model for s in stages], job.lora, out, base_model=base_name)
    path = out / ADAPTER_CONFIG
    adapter_config = json.loads(path.read_text())
    if cut:
        adapter_config[STAGE_CUT_KEY] = list(cut)
    atomic_write_bytes(path, json.dumps(adapter_config, indent=2, sort_keys=True).encode())
    return "adapter", base, holdout


def _holdout(job: Any, stages: list[Any], batches: int) -> float:
    from p2pswarm.training.pipeline import LocalTrainPipeline
    from p2pswarm.training.run import job_data

    pipeline = LocalTrainPipeline(stages, lr=job.lr)
    pipeline.copy_tied_weight()
    data = job_data(job)
    return float(pipeline.evaluate(data.holdout_batches(job.seq_len, job.micro_batch, batches)))


def _export_base(job: Any, source: Any, cut: tuple[int, ...], hf_config: dict[str, Any],
                 out: Path) -> None:
    """The frozen base a LoRA job trained on, as a Hugging Face directory."""
    from p2pswarm.models.checkpoint import save_checkpoint
    from p2pswarm.training.export import STAGE_CUT_KEY

    assert job.lora is not None
    tensors = [(name, source.tensor(name).float().contiguous())
               for name in source.tensor_names()]
    config = dict(hf_config)
    if cut:
        config[STAGE_CUT_KEY] = list(cut)
    config["torch_dtype"] = "float32"
    save_checkpoint(config, tensors, out)


def _copy_tokenizer(model: str, out: Path) -> None:
    where = Path(model).expanduser()
    if not where.is_dir():
        return  # a built-in model: byte-level, no tokenizer files
    from p2pswarm.models.model_dir import model_file_if_any

    for name in TOKENIZER_FILES:
        if name == "generation_config.json" and (out / name).exists():
            continue
        found = model_file_if_any(where, name)  # never a link out of the directory
        if found is not None:
            shutil.copyfile(found, out / name)


__all__ = ["BASE_DIR", "Exported", "TOKENIZER_FILES", "check_out_dir", "export_checkpoint"]
