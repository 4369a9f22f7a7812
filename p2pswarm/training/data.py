"""Training data: token ids from text files or token arrays, in a deterministic,
resumable order.

All files are tokenized and concatenated into one stream of ids (a text file begins
with the tokenizer's bos). Its tail (``holdout_fraction``) is kept out for evaluation.
Training samples are windows of ``seq_len + 1`` tokens starting every ``seq_len``
tokens; each epoch visits every window once, in an order drawn from a generator seeded
by (seed, stream, epoch). A stream's whole state is one number, its ``position`` (how
many samples it has handed out), so resuming is exact, and two stages that read the
same stream at the same position (the first for inputs, the last for targets) see the
same batch without sending it to each other.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch

from p2pswarm.errors import ConfigError
from p2pswarm.models.tokenizer import Tokenizer
from p2pswarm.training.job import CORPUS, DataConfig

CORPUS_DIR = Path(__file__).parent / "corpus"
# uint16 is read as int16 and unwrapped, which works on torch releases without uint16
_TOKEN_DTYPES = {"uint16": torch.int16, "int32": torch.int32}


def corpus_files() -> list[Path]:
    """The public-domain texts shipped with the package, in a fixed order."""
    return sorted(CORPUS_DIR.glob("*.txt"))


def corpus_text() -> str:
    return "\n\n".join(p.read_text(encoding="utf-8") for p in corpus_files())


def load_tokens(config: DataConfig, tokenizer: Tokenizer) -> torch.Tensor:
    """Every text file tokenized and every token file read, concatenated (int64)."""
    parts: list[torch.Tensor] = []
    for name in config.files:
        paths = corpus_files() if name == CORPUS else [Path(name)]
        for path in paths:
            try:
                text = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise ConfigError(f"cannot read training text {path}: {exc}") from exc
            parts.append(torch.tensor(tokenizer.encode(text, add_bos=True), dtype=torch.long))
    dtype = _TOKEN_DTYPES[config.token_dtype]
    for name in config.token_files:
        try:
            raw = bytearray(Path(name).read_bytes())
        except OSError as exc:
            raise ConfigError(f"cannot read token file {name}: {exc.strerror}") from exc
        itemsize = torch.empty((), dtype=dtype).element_size()
        if len(raw) % itemsize:
            raise ConfigError(f"token file {name}: {len(raw)} bytes is not a whole number of "
                              f"{config.token_dtype} tokens")
        ids = (torch.frombuffer(raw, dtype=dtype).to(torch.long) if raw
               else torch.empty(0, dtype=torch.long))
        parts.append(ids & 0xFFFF if config.token_dtype == "uint16" else ids)
    tokens = torch.cat(parts) if parts else torch.empty(0, dtype=torch.long)
    if tokens.numel() and (tokens.min() < 0 or tokens.max() >= tokenizer.vocab_size):
        raise ConfigError(f"training data holds token ids outside the model's vocabulary of "
                          f"{tokenizer.vocab_size}")
    return tokens


@dataclass(frozen=True, slots=True)
class TokenData:
    """Training and held-out token ids, split once."""

    train: torch.Tensor
    holdout: torch.Tensor

    @classmethod
    def split(cls, tokens: torch.Tensor, holdout_fraction: float, seq_len: int) -> TokenData:
        n_holdout = int(tokens.numel() * holdout_fraction)
        train, holdout = tokens[: tokens.numel() - n_holdout], tokens[tokens.numel() - n_holdout:]
        if train.numel() < seq_len + 1:
            raise ConfigError(f"{train.numel()} training tokens do not make one sample of "
                              f"seq_len {seq_len} + 1: add data or lower seq_len")
        return cls(train, holdout)

    def holdout_batches(self, seq_len: int, batch: int,
                        max_batches: int | None = None) -> list[torch.Tensor]:
        """Consecutive windows of the held-out tokens, (batch, seq_len + 1) each, in order."""
        n = (self.holdout.numel() - 1) // seq_len
        windows = [self.holdout[i * seq_len: i * seq_len + seq_len + 1] for i in range(n)]
        batches = [torch.stack(windows[i:i + batch]) for i in range(0, n - batch + 1, batch)]
        return batches[:max_batches] if max_batches is not None else batches


class SampleStream:
    """Windows of ``seq_len + 1`` tokens in a seeded order, from ``position`` on."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, *, seed: int, stream: int = 0,
                 position: int = 0) -> None:
        if tokens.numel() < seq_len + 1:
            raise ConfigError(f"{tokens.numel()} tokens do not make one sample of seq_len "
                              f"{seq_len} + 1")
        self.tokens = tokens
        self.seq_len = seq_len
        self.seed = seed
        self.stream = stream
        self.position = position
        self.windows = (tokens.numel() - 1) // seq_len
        self._order_epoch = -1
        self._order = torch.empty(0, dtype=torch.long)

    def _epoch_order(self, epoch: int) -> torch.Tensor:
        if epoch != self._order_epoch:
            digest = hashlib.sha256(f"{self.seed}/{self.stream}/{epoch}".encode()).digest()
            generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
            self._order = torch.randperm(self.windows, generator=generator)
            self._order_epoch = epoch
        return self._order

    def window_start(self, position: int) -> int:
        """Where sample ``position`` starts in the tokens."""
        epoch, index = divmod(position, self.windows)
        return int(self._epoch_order(epoch)[index]) * self.seq_len

    def sample_at(self, position: int) -> torch.Tensor:
        start = self.window_start(position)
        return self.tokens[start: start + self.seq_len + 1]

    def next_batch(self, batch: int) -> torch.Tensor:
        """(batch, seq_len + 1) token ids; advances ``position`` by ``batch``."""
        rows = [self.sample_at(self.position + i) for i in range(batch)]
        self.position += batch
        return torch.stack(rows)

    def next_micro_batches(self, micro_batches: int, micro_batch: int) -> torch.Tensor:
        """(micro_batches, micro_batch, seq_len + 1): one optimizer step's data."""
        return torch.stack([self.next_batch(micro_batch) for _ in range(micro_batches)])
