"""Finding a model's config: a built-in name, a model directory, or a config.json path.

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
from p2pswarm.planner.profile import ModelProfile, builtin_config, known_names, profile_from_config


def read_model_config(spec: str) -> tuple[str, dict[str, Any]]:
    """(name, HF config dict) for a built-in name, a model directory or a config.json."""
    config = builtin_config(spec)
    if config is not None:
        return spec, config
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / "config.json"
        name = Path(spec).expanduser().resolve().name
    else:
        name = path.resolve().parent.name if path.name == "config.json" else path.stem
    if not path.is_file():
        raise ConfigError(
            f"unknown model {spec!r}: give a model directory, a config.json path, or one of "
            f"{', '.join(known_names())}"
        )
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as exc:  # RecursionError: nested too deep
        raise ConfigError(f"cannot read {path} ({exc}): it must be a JSON config.json") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a JSON object")
    return name, data


def load_profile(spec: str) -> ModelProfile:
    name, config = read_model_config(spec)
    return profile_from_config(config, name)


__all__ = ["load_profile", "read_model_config"]
