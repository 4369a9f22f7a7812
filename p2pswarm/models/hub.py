"""Models by hub id (``Qwen/Qwen2.5-0.5B-Instruct``), found in the local Hugging Face cache.

A swarm must not depend on reaching the hub, so nothing is downloaded here: an id is
looked up in the cache that ``huggingface-cli download`` fills, and a model that is not
there gets one line saying how to get it. The cache is read by its documented layout
(``huggingface_hub`` is not a dependency):

    $HF_HUB_CACHE, else $HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub,
    else ~/.cache/huggingface/hub
      models--ORG--NAME/refs/main          the commit the main branch points at
      models--ORG--NAME/snapshots/COMMIT/  config.json, *.safetensors (links to ../../blobs)

ORG and NAME pass the safe-name check before they become part of a path, and the commit
read from ``refs/main`` must be 40 hex digits.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from p2pswarm.errors import ConfigError
from p2pswarm.names import is_hex_digest, is_safe_name

MAX_PART_CHARS = 96  # the hub's own bound on an organisation or repository name
REF_BYTES = 256  # refs/main holds one commit hash; read no more than this


def is_hub_id(spec: str) -> bool:
    """Whether ``spec`` reads as ``ORG/NAME`` with two safe parts."""
    parts = spec.split("/")
    return len(parts) == 2 and all(is_safe_name(p, MAX_PART_CHARS) for p in parts)


def hub_cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """The hub cache directory, from the variables the hub's own tools read.

    The variables are read here rather than by the CLI alone because every process that
    resolves a hub id (the CLI, an agent's HTTP API, the MCP server, a fellow opening a
    job's model) must find the cache ``huggingface-cli`` wrote."""
    env = os.environ if environ is None else environ
    if env.get("HF_HUB_CACHE"):
        return Path(env["HF_HUB_CACHE"]).expanduser()
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser() / "hub"
    if env.get("XDG_CACHE_HOME"):
        return Path(env["XDG_CACHE_HOME"]).expanduser() / "huggingface" / "hub"
    return Path("~/.cache/huggingface/hub").expanduser()


def cached_snapshot(hub_id: str, cache_dir: Path | None = None) -> Path:
    """The snapshot directory of ``hub_id`` on its main branch; ConfigError, in one line
    saying how to get it, when the cache does not hold it."""
    if not is_hub_id(hub_id):
        raise ConfigError(f"{hub_id[:100]!r} is not a hub id like Qwen/Qwen2.5-0.5B-Instruct")
    cache = hub_cache_dir() if cache_dir is None else cache_dir
    org, name = hub_id.split("/")
    repo = cache / f"models--{org}--{name}"
    missing = ConfigError(f"{hub_id} is not in the Hugging Face cache at {cache}: get it with "
                          f"`huggingface-cli download {hub_id}` (or give a model directory)")
    snapshot = _main_snapshot(repo)
    if snapshot is None or not (snapshot / "config.json").is_file():
        raise missing
    return snapshot


def _main_snapshot(repo: Path) -> Path | None:
    """``snapshots/<refs/main>``, or the only snapshot when there is no ref."""
    try:
        with (repo / "refs" / "main").open("rb") as f:
            commit = f.read(REF_BYTES).decode("ascii", "replace").strip()
    except OSError:
        commit = None
    if commit is not None:
        if not is_hex_digest(commit, 40):
            raise ConfigError(f"{repo / 'refs' / 'main'} does not hold a commit hash")
        return repo / "snapshots" / commit
    try:
        found = [p for p in (repo / "snapshots").iterdir() if is_hex_digest(p.name, 40)]
    except OSError:
        return None
    return found[0] if len(found) == 1 else None


__all__ = ["cached_snapshot", "hub_cache_dir", "is_hub_id"]
