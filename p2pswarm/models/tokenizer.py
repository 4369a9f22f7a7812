"""Text to token ids and back: bytes for built-in models, ``tokenizer.json`` for real ones."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Protocol

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

        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
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


def load_tokenizer(model: str | Path) -> ByteTokenizer | HFTokenizer:
    """The tokenizer of a built-in model name, a model directory or a cached hub id."""
    from p2pswarm.models.hub import cached_snapshot, is_hub_id
    from p2pswarm.planner.profile import BUILTIN_MODELS

    if isinstance(model, str) and model in BUILTIN_MODELS:
        return ByteTokenizer()
    if isinstance(model, str) and is_hub_id(model) and not Path(model).expanduser().exists():
        return HFTokenizer(cached_snapshot(model))
    return HFTokenizer(model)


def _special_ids(model_dir: Path) -> tuple[int | None, tuple[int, ...]]:
    # config.json names them for the model; generation_config.json may list more stops
    bos: int | None = None
    eos: list[int] = []
    for name in ("config.json", "generation_config.json"):
        try:
            data = json.loads((model_dir / name).read_text())
        except (OSError, ValueError):
            continue
        if bos is None and isinstance(data.get("bos_token_id"), int):
            bos = data["bos_token_id"]
        found = data.get("eos_token_id")
        for i in found if isinstance(found, list) else [found]:
            if isinstance(i, int) and i not in eos:
                eos.append(i)
    return bos, tuple(eos)
