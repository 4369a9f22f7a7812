"""Finding a model's config: a built-in name, a model shipped in the package
(``demo-llama``), a model directory, a config.json path, or a hub id
(``Qwen/Qwen2.5-0.5B-Instruct``) in the local Hugging Face cache.

Built-in names come in two kinds: models p2pswarm draws its own weights for
(``tiny-llama``), and reference shapes (``llama-3-8b``) that plan on paper and have no
weights: loading one needs the model's own directory (``weights_directory`` says so).

The planner itself reads no files and only sees the dict; this module, beside the model
code that reads checkpoints, turns a name or a path into that dict.
The CLI sends the dict (not the path) to the agent, because the leader that plans may
run on another machine where the path means nothing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from p2pswarm.errors import ConfigError
from p2pswarm.models.hub import cached_snapshot, is_hub_id
from p2pswarm.models.model_dir import model_file
from p2pswarm.planner.profile import (
    BUILTIN_MODELS,
    REFERENCE_CONFIGS,
    ModelProfile,
    builtin_config,
    profile_from_config,
)

# Models whose files ship in the package, by name: a name like the built-ins' for
# `plan` and `load`, read from its directory (weights included).
SHIPPED_MODELS: dict[str, Path] = {"demo-llama": Path(__file__).resolve().parent / "demo-llama"}


def model_names() -> tuple[str, ...]:
    """Every name `plan` and `load` take besides paths and hub ids."""
    return (*BUILTIN_MODELS, *SHIPPED_MODELS, *REFERENCE_CONFIGS)


def is_shape_only(spec: str) -> bool:
    """A reference shape: plans on paper, has no weights to load."""
    return spec in REFERENCE_CONFIGS and spec not in BUILTIN_MODELS \
        and not Path(spec).expanduser().exists()


def read_model_config(spec: str) -> tuple[str, dict[str, Any]]:
    """(name, HF config dict) for a built-in name, a model directory, a config.json or a
    cached hub id (named by its repository: ``Qwen2.5-0.5B-Instruct``)."""
    config = builtin_config(spec)
    if config is not None:
        return spec, config
    if spec in SHIPPED_MODELS and not Path(spec).exists():
        spec = str(SHIPPED_MODELS[spec])
    path = Path(spec).expanduser()
    if pth_file(path) is not None:
        raise ConfigError(f"{spec[:200]} is an RWKV .pth checkpoint: convert it with `python "
                          "-m p2pswarm.models.rwkv7_pth IN.pth OUT_DIR` and give OUT_DIR "
                          "(`p2pswarm plan` and `load` convert it themselves)")
    hub = _hub_snapshot(spec)
    if hub is not None:
        path, name = model_file(hub, "config.json"), spec.split("/")[1]
    elif path.is_dir():
        path = model_file(path, "config.json")
        name = Path(spec).expanduser().resolve().name
    else:
        name = path.resolve().parent.name if path.name == "config.json" else path.stem
    if not path.is_file():
        raise ConfigError(
            f"unknown model {spec[:200]!r}: give a model directory, a config.json path, a "
            f"hub id like Qwen/Qwen2.5-0.5B-Instruct, or one of {', '.join(model_names())}"
        )
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as exc:  # RecursionError: nested too deep
        raise ConfigError(f"cannot read {path} ({exc}): it must be a JSON config.json") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a JSON object")
    return name, data


def _hub_snapshot(spec: str) -> Path | None:
    """The cached snapshot of a hub id; None when ``spec`` is a path that exists or no hub
    id (ConfigError, saying how to download it, when it is an id the cache lacks)."""
    if not is_hub_id(spec) or Path(spec).expanduser().exists():
        return None
    return cached_snapshot(spec)


def model_directory(spec: str) -> str | None:
    """The directory holding a model's files on this machine (None for a
    built-in): the directory named, a config.json's, or a hub id's snapshot."""
    if spec in BUILTIN_MODELS or is_shape_only(spec):
        return None
    if spec in SHIPPED_MODELS and not Path(spec).exists():
        return str(SHIPPED_MODELS[spec])
    hub = _hub_snapshot(spec)
    if hub is not None:
        return str(hub)
    where = Path(spec).expanduser()
    return str((where if where.is_dir() else where.parent).resolve())


def weights_directory(spec: str) -> str | None:
    """``model_directory`` for a load, which needs weights: ConfigError, saying what to
    give instead, for a reference shape (``llama-3-8b``), which has none."""
    if is_shape_only(spec):
        with_weights = ", ".join((*BUILTIN_MODELS, *SHIPPED_MODELS))
        raise ConfigError(
            f"{spec} is a shape-only built-in: `plan {spec}` sizes it on paper, but it has no "
            "weights to load. Give the model's directory (config.json and *.safetensors, "
            "e.g. downloaded with `huggingface-cli download ORG/MODEL`) or a hub id in the "
            f"local cache, or load a model with weights: {with_weights}")
    return model_directory(spec)


def pth_file(path: Path) -> Path | None:
    """The RWKV authors' ``.pth`` a model path names: the file itself, or the one ``.pth``
    of a directory without a ``config.json``; None for anything else."""
    if path.suffix == ".pth" and path.is_file():
        return path
    if path.is_dir() and not (path / "config.json").exists():
        found = sorted(path.glob("*.pth"))
        if len(found) == 1:
            return found[0]
    return None


def load_profile(spec: str) -> ModelProfile:
    name, config = read_model_config(spec)
    return profile_from_config(config, name)


__all__ = ["SHIPPED_MODELS", "is_shape_only", "load_profile", "model_directory", "model_names",
           "pth_file", "read_model_config", "weights_directory"]
