"""Finding a model's config: a built-in name, a model directory, a config.json path, or a
hub id (``Qwen/Qwen2.5-0.5B-Instruct``) in the local Hugging Face cache.

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
from p2pswarm.planner.profile import (
    BUILTIN_MODELS,
    ModelProfile,
    builtin_config,
    known_names,
    profile_from_config,
)


def read_model_config(spec: str) -> tuple[str, dict[str, Any]]:
    """(name, HF config dict) for a built-in name, a model directory, a config.json or a
    cached hub id (named by its repository: ``Qwen2.5-0.5B-Instruct``)."""
    config = builtin_config(spec)
    if config is not None:
        return spec, config
    path = Path(spec).expanduser()
    if pth_file(path) is not None:
        raise ConfigError(f"{spec[:200]} is an RWKV .pth checkpoint: convert it with `python "
                          "-m p2pswarm.models.rwkv7_pth IN.pth OUT_DIR` and give OUT_DIR "
                          "(`p2pswarm plan` and `load` convert it themselves)")
    hub = _hub_snapshot(spec)
    if hub is not None:
        path, name = hub / "config.json", spec.split("/")[1]
    elif path.is_dir():
        path = path / "config.json"
        name = Path(spec).expanduser().resolve().name
    else:
        name = path.resolve().parent.name if path.name == "config.json" else path.stem
    if not path.is_file():
        raise ConfigError(
            f"unknown model {spec[:200]!r}: give a model directory, a config.json path, a "
            f"hub id like Qwen/Qwen2.5-0.5B-Instruct, or one of {', '.join(known_names())}"
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
    if spec in BUILTIN_MODELS:
        return None
    hub = _hub_snapshot(spec)
    if hub is not None:
        return str(hub)
    where = Path(spec).expanduser()
    return str((where if where.is_dir() else where.parent).resolve())


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


__all__ = ["load_profile", "model_directory", "pth_file", "read_model_config"]
