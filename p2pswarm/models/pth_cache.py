"""The RWKV authors' ``.pth`` files, offered to a swarm as a Hugging Face directory.

A swarm ships a model stage by stage from a directory (``config.json`` and safetensors):
each fellow fetches only its own layers' tensors, byte ranges checked by SHA-256. A
``.pth`` is one pickle-framed file that cannot be cut that way, so the fellow that offers
it converts it once (``rwkv7_pth.convert_to_hf``: tensors only, no pickled code) into a
directory under its state dir named by the file's SHA-256, and offers that. The same
file converts once, wherever it lies (its name names the model); a changed file gets a
new directory. Conversion writes into a private temporary directory first and renames it
into place, so a reader never sees half a model and two conversions at once do not clash.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from p2pswarm.errors import ConfigError
from p2pswarm.models.files import pth_file

PTH_DIR = "pth"  # under the state dir: the converted .pth files
_HASH_CHUNK_BYTES = 1 << 22


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    try:
        with path.open("rb") as f:
            while chunk := f.read(_HASH_CHUNK_BYTES):
                digest.update(chunk)
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from None
    return digest.hexdigest()


def converted_pth(pth: Path, cache_root: Path) -> Path:
    """The directory ``pth`` converts to under ``cache_root``, converting it on first use:
    ``cache_root/<sha256[:16]>/<file stem>`` (the stem names the model)."""
    from p2pswarm.models.rwkv7_pth import convert_to_hf  # imports torch

    sha = file_sha256(pth)
    home = cache_root / sha[:16]
    target = home / pth.stem
    if (target / "config.json").is_file():
        return target
    try:
        home.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=".converting-", dir=home))
    except OSError as exc:
        raise ConfigError(f"cannot convert {pth} under {cache_root}: {exc}") from None
    try:
        convert_to_hf(pth, scratch / "model")
        if file_sha256(pth) != sha:
            raise ConfigError(f"{pth} changed while it was converted: try again")
        try:
            os.rename(scratch / "model", target)
        except OSError:
            if not (target / "config.json").is_file():  # not a twin conversion that won
                raise
    except OSError as exc:
        raise ConfigError(f"cannot convert {pth} under {cache_root}: {exc}") from None
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def offered_model(spec: str, cache_root: Path) -> str:
    """``spec`` as plan and load read it: an authors' ``.pth`` (or a directory holding
    one and no config.json) becomes its converted directory; anything else is unchanged."""
    found = pth_file(Path(spec).expanduser())
    return spec if found is None else str(converted_pth(found.resolve(), cache_root))


__all__ = ["PTH_DIR", "converted_pth", "file_sha256", "offered_model"]
