"""Text to token ids and back: bytes for built-in models, ``tokenizer.json`` for real ones,
and the RWKV "World" vocabulary (``rwkv_vocab_v20230424.txt``) for RWKV models."""

from __future__ import annotations

import ast
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol

from p2pswarm.errors import ConfigError

BYTE_VOCAB_SIZE = 259  # 256 byte values, then bos, eos, pad


class Tokenizer(Protocol):
    @property
    def vocab_size(self) -> int: ...

    @property
    def bos_id(self) -> int | None: ...

    @property
    def eos_ids(self) -> tuple[int, ...]: ...

    def encode(self, text: str, *, add_bos: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


@dataclass(frozen=True, slots=True)
class ByteTokenizer:
    """Token i < 256 is the byte i of the UTF-8 text; 256, 257, 258 are bos, eos, pad."""

    vocab_size: ClassVar[int] = BYTE_VOCAB_SIZE
    bos_id: ClassVar[int] = 256
    eos_id: ClassVar[int] = 257
    pad_id: ClassVar[int] = 258

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return (self.eos_id,)

    def encode(self, text: str, *, add_bos: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_id, *ids] if add_bos else ids

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        """The bytes behind ``ids``, special tokens dropped (for incremental decoding)."""
        return bytes(i for i in ids if 0 <= i < 256)

    def decode(self, ids: Sequence[int]) -> str:
        # a random or cut-off model may emit invalid UTF-8; show it, do not fail on it
        return self.decode_bytes(ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A model directory's ``tokenizer.json`` through the ``tokenizers`` package."""

    def __init__(self, model_dir: str | Path) -> None:
        from tokenizers import Tokenizer as _Tokenizer

        from p2pswarm.models.model_dir import model_file

        model_dir = Path(model_dir)
        path = model_file(model_dir, "tokenizer.json")
        try:
            self._tokenizer = _Tokenizer.from_file(str(path))
        except Exception as exc:  # the Rust side raises plain Exception
            raise ConfigError(f"cannot load {path}: {exc}") from exc
        bos, eos = _special_ids(model_dir)
        self._bos_id = bos
        self._eos_ids = eos

    @property
    def vocab_size(self) -> int:
        return int(self._tokenizer.get_vocab_size(with_added_tokens=True))

    @property
    def bos_id(self) -> int | None:
        return self._bos_id

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return self._eos_ids

    def encode(self, text: str, *, add_bos: bool = True) -> list[int]:
        # the tokenizer's own post-processor decides where bos goes (Llama adds it)
        return list(self._tokenizer.encode(text, add_special_tokens=add_bos).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tokenizer.decode(list(ids), skip_special_tokens=True))


MAX_PROMPT_IDS = 1 << 20  # more token ids than any context holds


def token_id_list(raw: Any, what: str) -> list[int]:
    """A non-empty list of token ids from the network: bounded, whole, non-negative."""
    if (not isinstance(raw, list) or not 0 < len(raw) <= MAX_PROMPT_IDS
            or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**31
                       for t in raw)):
        raise ConfigError(f"{what} must be a non-empty list of at most {MAX_PROMPT_IDS:,} "
                          "token ids (whole numbers from 0)")
    return list(raw)


WORLD_VOCAB_FILE = "rwkv_vocab_v20230424.txt"
MAX_WORLD_TOKEN_BYTES = 1024
MAX_WORLD_VOCAB = 1 << 20


class WorldTokenizer:
    """The RWKV "World" vocabulary: each line ``<id> <Python str or bytes literal>
    <byte length>``; text is encoded greedily, always taking the longest token that
    matches at the current byte (a trie walk), as the RWKV authors' tokenizer does.
    Id 0 is the end of text and has no line."""

    END_OF_TEXT = 0

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        self._bytes: dict[int, bytes] = {}
        self._trie: dict[int, Any] = {}
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read {path}: {exc}") from None
        if len(lines) > MAX_WORLD_VOCAB:
            raise ConfigError(f"{path}: more than {MAX_WORLD_VOCAB:,} tokens")
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            token_id, token = _world_line(line, path, number)
            self._bytes[token_id] = token
            node = self._trie
            for byte in token:
                node = node.setdefault(byte, {})
            node[-1] = token_id  # key -1: a token ends here
        self._vocab_size = max(self._bytes, default=0) + 1

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def bos_id(self) -> int | None:
        return None

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return (self.END_OF_TEXT,)

    def encode(self, text: str, *, add_bos: bool = True) -> list[int]:
        data = text.encode("utf-8")
        ids: list[int] = []
        at = 0
        while at < len(data):
            node, found, end = self._trie, None, at
            for i in range(at, len(data)):
                child = node.get(data[i])
                if child is None:
                    break
                node = child
                if -1 in node:
                    found, end = node[-1], i + 1
            if found is None:
                raise ConfigError(f"byte {data[at]} has no token in the World vocabulary")
            ids.append(found)
            at = end
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return b"".join(self._bytes.get(i, b"") for i in ids).decode("utf-8", errors="replace")


def _world_line(line: str, path: Path, number: int) -> tuple[int, bytes]:
    first, last = line.find(" "), line.rfind(" ")
    where = f"{path}:{number}"
    literal = line[first:last].strip()
    token: Any
    try:
        token_id, length = int(line[:first]), int(line[last:])
        if len(literal) > 1 and literal[0] == literal[-1] == "'" and not (
                "\\" in literal or "'" in literal[1:-1]):
            token = literal[1:-1]  # most lines: a plain quoted string
        else:  # a literal, never code: ast.literal_eval evaluates nothing else
            token = ast.literal_eval(literal)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        raise ConfigError(f"{where}: not a World vocabulary line") from None
    if isinstance(token, str):
        token = token.encode("utf-8")
    if (not isinstance(token, bytes) or len(token) != length or not token
            or len(token) > MAX_WORLD_TOKEN_BYTES or not 0 < token_id < MAX_WORLD_VOCAB):
        raise ConfigError(f"{where}: not a World vocabulary line")
    return token_id, token


def load_tokenizer(model: str | Path) -> ByteTokenizer | HFTokenizer | WorldTokenizer:
    """The tokenizer of a built-in model name, a model directory, an RWKV ``.pth`` or a
    cached hub id: a directory (or the ``.pth``'s) holding the World vocabulary file
    uses it."""
    from p2pswarm.models.hub import cached_snapshot, is_hub_id
    from p2pswarm.models.model_dir import model_file_if_any
    from p2pswarm.planner.profile import BUILTIN_MODELS

    if isinstance(model, str) and model in BUILTIN_MODELS:
        return ByteTokenizer()
    where = Path(model)
    folder = where.parent if where.suffix == ".pth" else where
    vocab = model_file_if_any(folder, WORLD_VOCAB_FILE) if folder.is_dir() else None
    if vocab is not None and model_file_if_any(folder, "tokenizer.json") is None:
        return WorldTokenizer(vocab)
    if isinstance(model, str) and is_hub_id(model) and not Path(model).expanduser().exists():
        return HFTokenizer(cached_snapshot(model))
    return HFTokenizer(model)


def _special_ids(model_dir: Path) -> tuple[int | None, tuple[int, ...]]:
    # config.json names them for the model; generation_config.json may list more stops
    from p2pswarm.models.model_dir import model_file_if_any

    bos: int | None = None
    eos: list[int] = []
    for name in ("config.json", "generation_config.json"):
        path = model_file_if_any(model_dir, name)  # a link out of the directory: refused
        if path is None:
            continue
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if bos is None and isinstance(data.get("bos_token_id"), int):
            bos = data["bos_token_id"]
        found = data.get("eos_token_id")
        for i in found if isinstance(found, list) else [found]:
            if isinstance(i, int) and i not in eos:
                eos.append(i)
    return bos, tuple(eos)
