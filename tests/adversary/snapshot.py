"""A file tree's snapshot: every path under a directory with its size and content hash, so
a test can say nothing was written, changed or deleted outside a state directory."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def tree(root: Path, skip: Path | None = None) -> dict[str, tuple[int, str]]:
    """Relative path -> (size, SHA-256) of every file under ``root`` (``skip``'s subtree
    left out); directories appear with size -1 so one made or removed shows too."""
    out: dict[str, tuple[int, str]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        if skip is not None and (here == skip or skip in here.parents):
            dirnames[:] = []
            continue
        out[str(here.relative_to(root))] = (-1, "")
        for name in filenames:
            path = here / name
            if path.is_symlink():
                out[str(path.relative_to(root))] = (-2, os.readlink(path))
                continue
            data = path.read_bytes()
            out[str(path.relative_to(root))] = (len(data), hashlib.sha256(data).hexdigest())
    return out
