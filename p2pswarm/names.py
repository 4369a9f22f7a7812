"""Names that come from the network, checked before they touch the file system.

A fellow holding the token can still send any string where a hash, a file name, a model
key or a checkpoint name belongs. Every such name passes one of these checks before it
becomes part of a path: a hex digest of an exact length, a safe name (one path
component of letters, digits and ``._-``, no leading dot, bounded length), or, for a
path read from a local file that may name others (a model's ``index.json``), a
containment check that resolves symlinks first.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from p2pswarm.errors import ConfigError

MAX_NAME_CHARS = 128  # a safe name's default bound
_SAFE_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*")
_LOWER_HEX = frozenset("0123456789abcdef")


class UnsafeName(ConfigError):
    """A name from the network (or a file) that may not become a path."""


def _shown(value: object) -> str:
    """A bad value as an error message shows it: quoted, escaped, cut short."""
    return repr(value[:80] if isinstance(value, str) else value)[:90]


def is_hex_digest(value: object, length: int) -> bool:
    """Whether ``value`` is exactly ``length`` lowercase hex digits."""
    return isinstance(value, str) and len(value) == length and set(value) <= _LOWER_HEX


def hex_digest(value: object, length: int = 64, what: str = "SHA-256") -> str:
    """``value`` if it is ``length`` lowercase hex digits; UnsafeName otherwise."""
    if not is_hex_digest(value, length):
        raise UnsafeName(f"bad {what} {_shown(value)}: {length} lowercase hex digits expected")
    assert isinstance(value, str)
    return value


def sha256_hex(value: object, what: str = "SHA-256") -> str:
    """A SHA-256 in hex (64 lowercase digits), as content-addressed stores name files."""
    return hex_digest(value, 64, what)


def is_safe_name(value: object, max_chars: int = MAX_NAME_CHARS) -> bool:
    """One path component: letters, digits, ``._-``, no leading dot, 1..``max_chars``."""
    return (isinstance(value, str) and 0 < len(value) <= max_chars
            and _SAFE_NAME.fullmatch(value) is not None)


def safe_name(value: object, what: str = "name", max_chars: int = MAX_NAME_CHARS) -> str:
    """``value`` if it is a safe name (``is_safe_name``); UnsafeName otherwise."""
    if not is_safe_name(value, max_chars):
        raise UnsafeName(f"bad {what} {_shown(value)}: letters, digits, '.', '_' and '-' "
                         f"only, no leading dot, at most {max_chars} characters")
    assert isinstance(value, str)
    return value


def contained(root: str | os.PathLike[str], path: str | os.PathLike[str]) -> Path:
    """``path`` (relative paths are taken under ``root``) resolved, symlinks followed, if it
    stays inside ``root`` resolved; UnsafeName otherwise."""
    base = Path(root).resolve()
    target = (base / path).resolve()
    if target != base and base not in target.parents:
        raise UnsafeName(f"{_shown(str(path))} points outside {base}")
    return target


__all__ = ["MAX_NAME_CHARS", "UnsafeName", "contained", "hex_digest", "is_hex_digest",
           "is_safe_name", "safe_name", "sha256_hex"]
