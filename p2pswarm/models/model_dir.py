"""The one way a file of a model (or adapter) directory becomes a path.

A model directory comes from git repositories, tarballs and downloads, which carry
symlinks: a ``generation_config.json`` that links to ``~/.p2pswarm/identity.json`` would
otherwise be hashed into the model's manifest and served by hash to any fellow, private
key included. Every file a directory contributes (``config.json``, the weights and their
index, ``generation_config.json``, tokenizer files, vocabularies, adapters) is opened
through ``model_file``: a plain file name, and, symlinks followed, inside the directory,
or, for a Hugging Face hub snapshot (``models--ORG--NAME/snapshots/REV``, whose files
link to ``../../blobs``), inside its repository folder. Anything else is refused in one
line naming the file.
"""

from __future__ import annotations

from pathlib import Path

from p2pswarm.errors import ConfigError
from p2pswarm.names import UnsafeName, contained, safe_name


class OutsideModelDir(UnsafeName):
    """A model directory's file that leads (by a symlink or its name) outside it."""


def link_root(model_dir: str | Path) -> Path:
    """How far a model directory's files may lead by symlinks: the directory itself, or
    the repository folder of a hub snapshot (``models--org--name/snapshots/REV``)."""
    resolved = Path(model_dir).expanduser().resolve()
    if resolved.parent.name == "snapshots" and resolved.parent.parent.name.startswith(
            "models--"):
        return resolved.parent.parent
    return resolved


def model_file(model_dir: str | Path, name: str, what: str = "model file name") -> Path:
    """``model_dir / name`` resolved, when ``name`` is one plain file name that stays
    inside the directory (see ``link_root``); OutsideModelDir, in one line naming the
    file and where it leads, otherwise. The file need not exist."""
    directory = Path(model_dir).expanduser()
    try:
        safe_name(name, what)
    except ConfigError as exc:
        raise OutsideModelDir(f"{directory}: {exc}") from None
    path = directory.resolve() / name
    try:
        return contained(link_root(directory), path)
    except UnsafeName:
        raise OutsideModelDir(
            f"{path} leads outside its model directory (to {path.resolve()}): refused; a "
            "model's files must be inside its directory, not links to elsewhere") from None


def model_file_if_any(model_dir: str | Path, name: str) -> Path | None:
    """``model_file`` when that file exists (None when it does not); OutsideModelDir as
    ``model_file``, also for a link whose target is missing or elsewhere."""
    path = Path(model_dir).expanduser() / name
    if not path.exists() and not path.is_symlink():
        return None
    found = model_file(model_dir, name)
    return found if found.is_file() else None


__all__ = ["OutsideModelDir", "link_root", "model_file", "model_file_if_any"]
