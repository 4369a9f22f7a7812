"""Codecs for pseudo-gradients: what one stage's parameter delta costs on the wire.

Every codec turns a float32 vector into an ``Encoded`` value (a few float64 numbers of
meta plus a payload of bytes) and back. ``Encoded.to_bytes`` is the whole wire form and
``Encoded.nbytes`` its exact length, so byte counts in reports are the bytes sent.

Wire form, little-endian::

    u8 version (1) | u8 codec code | u16 meta count M | u64 numel | f64 meta * M | payload

Each codec states a per-element bound on ``|decode(encode(x)) - x|`` (``bound``); the
tests hold each codec to it.

- ``fp32``: exact.
- ``fp16``: ``x / s`` in float16 with ``s = max|x|``; relative 2^-11, plus 2^-25 s for
  elements that fall into float16's subnormal range.
- ``int8``: values clipped to mean +- k sigma (and to the data's range), cut into 256
  equal buckets; a uint8 bucket index per element and a codebook of 256 float32 bucket
  means (the mean of the clipped values that fell in each bucket). Error at most one
  bucket width, plus how far the value lay outside the clip range.
- ``topk``: the k largest magnitudes, values as float16 scaled by their maximum, positions
  as the gaps between them in LEB128 varints (one byte per gap below 128, so about a
  byte per value at 1% density). The others are sent as zero: use it under
  ``ErrorFeedback``, which carries what was not sent into the next round, exactly.
- ``qsgd``: QSGD (Alistarh et al. 2017): per bucket of ``bucket`` elements, its scale in
  float32 (the max magnitude by default; ``norm="l2"`` is the paper's L2 norm, with far
  more variance at few bits) and each element stochastically rounded to one of
  ``2^(bits-1)-1`` levels with its sign; unbiased; error below ``scale / levels`` per
  element. Not used with error feedback (see ``ErrorFeedback``).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from p2pswarm.errors import ConfigError, RemoteProtocolError

WIRE_VERSION = 1
_HEADER = struct.Struct("<BBHQ")
CODEC_CODES = {"fp32": 1, "fp16": 2, "int8": 3, "topk": 4, "qsgd": 5}  # append-only
_NAMES_BY_CODE = {code: name for name, code in CODEC_CODES.items()}


@dataclass(frozen=True, slots=True)
class Encoded:
    """One encoded vector: ``numel`` float32 elements as ``meta`` and ``payload``."""

    codec: str
    numel: int
    meta: tuple[float, ...]
    payload: bytes

    @property
    def nbytes(self) -> int:
        """Exactly ``len(self.to_bytes())``."""
        return _HEADER.size + 8 * len(self.meta) + len(self.payload)

    def to_bytes(self) -> bytes:
        header = _HEADER.pack(WIRE_VERSION, CODEC_CODES[self.codec], len(self.meta), self.numel)
        return header + struct.pack(f"<{len(self.meta)}d", *self.meta) + self.payload

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> Encoded:
        view = memoryview(data).cast("B")
        if len(view) < _HEADER.size:
            raise RemoteProtocolError("bad-delta-frame", f"{len(view)} bytes, no header")
        version, code, n_meta, numel = _HEADER.unpack_from(view, 0)
        if version != WIRE_VERSION:
            raise RemoteProtocolError("bad-delta-frame", f"version {version}")
        if code not in _NAMES_BY_CODE:
            raise RemoteProtocolError("bad-delta-frame", f"codec code {code}")
        start = _HEADER.size + 8 * n_meta
        if len(view) < start:
            raise RemoteProtocolError("bad-delta-frame", "meta cut short")
        meta = struct.unpack_from(f"<{n_meta}d", view, _HEADER.size)
        return cls(_NAMES_BY_CODE[code], numel, tuple(meta), bytes(view[start:]))


class Codec(Protocol):
    name: str
    error_feedback: bool  # whether ErrorFeedback should carry this codec's error

    def encode(self, x: torch.Tensor) -> Encoded: ...

    def decode(self, encoded: Encoded) -> torch.Tensor: ...

    def bound(self, x: torch.Tensor) -> torch.Tensor: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.detach().reshape(-1).to(device="cpu", dtype=torch.float32).contiguous()


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _tensor(data: bytes, dtype: torch.dtype, count: int, offset: int = 0) -> torch.Tensor:
    itemsize = torch.empty((), dtype=dtype).element_size()
    if offset + count * itemsize > len(data):
        raise RemoteProtocolError("bad-delta-frame", "payload cut short")
    if count == 0:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(bytearray(data[offset:offset + count * itemsize]), dtype=dtype)


def _check(encoded: Encoded, name: str, n_meta: int) -> None:
    if encoded.codec != name or len(encoded.meta) != n_meta:
        raise RemoteProtocolError("bad-delta-frame",
                                  f"{encoded.codec} frame given to the {name} codec")


class _Stateless:
    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class Fp32(_Stateless):
    name = "fp32"
    error_feedback = False  # exact: nothing to carry

    def encode(self, x: torch.Tensor) -> Encoded:
        v = _flat(x)
        return Encoded(self.name, v.numel(), (), _bytes(v))

    def decode(self, encoded: Encoded) -> torch.Tensor:
        _check(encoded, self.name, 0)
        return _exact(_tensor(encoded.payload, torch.float32, encoded.numel), encoded)

    def bound(self, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(_flat(x))


class Fp16(_Stateless):
    name = "fp16"
    error_feedback = True

    def encode(self, x: torch.Tensor) -> Encoded:
        v = _flat(x)
        scale = float(v.abs().max()) if v.numel() else 0.0
        scale = scale or 1.0
        return Encoded(self.name, v.numel(), (scale,), _bytes((v / scale).half()))

    def decode(self, encoded: Encoded) -> torch.Tensor:
        _check(encoded, self.name, 1)
        half = _exact(_tensor(encoded.payload, torch.float16, encoded.numel), encoded)
        return half.float() * float(encoded.meta[0])

    def bound(self, x: torch.Tensor) -> torch.Tensor:
        v = _flat(x)
        scale = float(v.abs().max()) if v.numel() else 1.0
        # float16 keeps 11 significant bits; the divide and multiply add float32 rounding
        return v.abs() * (2.0**-11 + 2.0**-22) + (scale or 1.0) * 2.0**-25


class Int8(_Stateless):
    """Uniform buckets over mean +- k sigma, decoded through a codebook of bucket means."""

    name = "int8"
    error_feedback = True
    BUCKETS = 256

    def __init__(self, k_sigma: float = 4.0) -> None:
        if not (isinstance(k_sigma, (int, float)) and k_sigma > 0):
            raise ConfigError(f"int8 codec: k_sigma must be positive, got {k_sigma!r}")
        self.k_sigma = float(k_sigma)

    def clip_range(self, v: torch.Tensor) -> tuple[float, float]:
        if not v.numel():
            return 0.0, 0.0
        mean, std = float(v.double().mean()), float(v.double().std(unbiased=False))
        lo = max(float(v.min()), mean - self.k_sigma * std)
        hi = min(float(v.max()), mean + self.k_sigma * std)
        return lo, hi

    def encode(self, x: torch.Tensor) -> Encoded:
        v = _flat(x)
        lo, hi = self.clip_range(v)
        width = (hi - lo) / self.BUCKETS
        clipped = v.clamp(lo, hi)
        if width > 0:
            index = ((clipped.double() - lo) / width).floor().clamp_(0, self.BUCKETS - 1).long()
        else:
            index = torch.zeros(v.numel(), dtype=torch.long)
        sums = torch.zeros(self.BUCKETS, dtype=torch.float64).index_add_(0, index, clipped.double())
        counts = torch.bincount(index, minlength=self.BUCKETS).double()
        centres = lo + (torch.arange(self.BUCKETS, dtype=torch.float64) + 0.5) * width
        codebook = torch.where(counts > 0, sums / counts.clamp(min=1), centres).float()
        return Encoded(self.name, v.numel(), (),
                       _bytes(codebook) + _bytes(index.to(torch.uint8)))

    def decode(self, encoded: Encoded) -> torch.Tensor:
        _check(encoded, self.name, 0)
        if len(encoded.payload) != 4 * self.BUCKETS + encoded.numel:
            raise RemoteProtocolError("bad-delta-frame", "int8 payload has the wrong length")
        codebook = _tensor(encoded.payload, torch.float32, self.BUCKETS)
        index = _tensor(encoded.payload, torch.uint8, encoded.numel, 4 * self.BUCKETS)
        return codebook[index.long()]

    def bound(self, x: torch.Tensor) -> torch.Tensor:
        v = _flat(x)
        lo, hi = self.clip_range(v)
        outside = (lo - v).clamp(min=0) + (v - hi).clamp(min=0)
        # a bucket mean lies in its bucket; float32 rounding of the codebook on top
        return outside + (hi - lo) / self.BUCKETS + v.abs() * 2.0**-22


class TopK(_Stateless):
    """The ``fraction`` largest magnitudes (at least one element)."""

    name = "topk"
    error_feedback = True

    def __init__(self, fraction: float = 0.01) -> None:
        if not (isinstance(fraction, (int, float)) and 0 < fraction <= 1):
            raise ConfigError(f"topk codec: fraction must be in (0, 1], got {fraction!r}")
        self.fraction = float(fraction)

    def k_of(self, numel: int) -> int:
        return min(numel, max(1, math.ceil(self.fraction * numel)))

    def encode(self, x: torch.Tensor) -> Encoded:
        v = _flat(x)
        n = v.numel()
        if n == 0:
            return Encoded(self.name, 0, (0.0, 0.0, 1.0), b"")
        k = self.k_of(n)
        # stable order: ties go to the lower index, so every fellow picks the same set
        order = torch.sort(v.abs(), descending=True, stable=True).indices[:k]
        index = torch.sort(order).values
        values = v[index]
        scale = float(values.abs().max()) or 1.0
        positions = _varint_gaps(index)
        return Encoded(self.name, n, (float(k), float(len(positions)), scale),
                       positions + _bytes((values / scale).half()))

    def decode(self, encoded: Encoded) -> torch.Tensor:
        _check(encoded, self.name, 3)
        n = encoded.numel
        k, size, scale = int(encoded.meta[0]), int(encoded.meta[1]), encoded.meta[2]
        out = torch.zeros(n, dtype=torch.float32)
        if n == 0:
            return out
        if len(encoded.payload) != size + 2 * k:
            raise RemoteProtocolError("bad-delta-frame", "topk payload does not hold k values")
        index = _from_varint_gaps(encoded.payload[:size], k)
        if k and (index.min() < 0 or index.max() >= n):
            raise RemoteProtocolError("bad-delta-frame", "topk position out of range")
        values = _tensor(encoded.payload, torch.float16, k, size)
        out[index] = values.float() * float(scale)
        return out

    def bound(self, x: torch.Tensor) -> torch.Tensor:
        """Kept elements: float16 rounding; dropped ones: their own magnitude, which is at
        most the smallest kept magnitude."""
        v = _flat(x)
        if not v.numel():
            return v
        k = self.k_of(v.numel())
        order = torch.sort(v.abs(), descending=True, stable=True).indices
        kept = torch.zeros(v.numel(), dtype=torch.bool)
        kept[order[:k]] = True
        scale = float(v.abs().max()) or 1.0
        rounding = v.abs() * (2.0**-11 + 2.0**-22) + scale * 2.0**-25
        return torch.where(kept, rounding, v.abs())


class QSGD:
    """Stochastic rounding to ``levels`` magnitudes per bucket; keeps its own generator."""

    name = "qsgd"
    # unbiased already; carrying its (random, up to one level per element) rounding
    # error into the next round feeds the bucket maxima and can run away
    error_feedback = False

    def __init__(self, bits: int = 4, bucket: int = 512, norm: str = "max", seed: int = 0) -> None:
        if bits not in (2, 4, 8):
            raise ConfigError(f"qsgd codec: bits must be 2, 4 or 8, got {bits!r}")
        if not isinstance(bucket, int) or bucket < 1:
            raise ConfigError(f"qsgd codec: bucket must be a positive whole number, got {bucket!r}")
        if norm not in ("l2", "max"):
            raise ConfigError(f"qsgd codec: norm must be l2 or max, got {norm!r}")
        self.bits, self.bucket, self.norm = bits, bucket, norm
        self.levels = 2 ** (bits - 1) - 1
        self.generator = torch.Generator().manual_seed(seed)

    def _norms(self, v: torch.Tensor) -> torch.Tensor:
        n_buckets = -(-v.numel() // self.bucket)
        padded = torch.zeros(n_buckets * self.bucket)
        padded[: v.numel()] = v
        groups = padded.view(n_buckets, self.bucket)
        norms = groups.norm(dim=1) if self.norm == "l2" else groups.abs().amax(dim=1)
        return norms

    def encode(self, x: torch.Tensor) -> Encoded:
        v = _flat(x)
        n = v.numel()
        norms = self._norms(v) if n else torch.zeros(0)
        per_element = norms.repeat_interleave(self.bucket)[:n]
        safe = torch.where(per_element > 0, per_element, torch.ones_like(per_element))
        ratio = (v.abs() / safe * self.levels).clamp_(0, self.levels)
        low = ratio.floor()
        level = low + (torch.rand(n, generator=self.generator) < ratio - low).float()
        q = (torch.sign(v) * level).to(torch.int64) + self.levels  # in [0, 2 * levels]
        return Encoded(self.name, n, (), _bytes(norms) + _pack(q, self.bits))

    def decode(self, encoded: Encoded) -> torch.Tensor:
        _check(encoded, self.name, 0)
        n = encoded.numel
        n_buckets = -(-n // self.bucket)
        per_byte = 8 // self.bits
        if len(encoded.payload) != 4 * n_buckets + -(-n // per_byte):
            raise RemoteProtocolError("bad-delta-frame", "qsgd payload has the wrong length")
        norms = _tensor(encoded.payload, torch.float32, n_buckets)
        q = _unpack(encoded.payload[4 * n_buckets:], self.bits, n) - self.levels
        per_element = norms.repeat_interleave(self.bucket)[:n]
        out: torch.Tensor = q.float() * per_element / self.levels
        return out

    def bound(self, x: torch.Tensor) -> torch.Tensor:
        v = _flat(x)
        if not v.numel():
            return v
        per_element = self._norms(v).repeat_interleave(self.bucket)[: v.numel()]
        bound: torch.Tensor = per_element / self.levels * (1 + 2.0**-20)
        return bound

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["generator"])


def _varint_gaps(index: torch.Tensor) -> bytes:
    """Sorted positions as LEB128 varints of their gaps (the first gap from -1)."""
    if not index.numel():
        return b""
    gaps = torch.diff(index.long(), prepend=torch.tensor([-1])) - 1  # >= 0
    nbytes = torch.ones_like(gaps)
    for b in range(1, 10):
        nbytes += (gaps >> (7 * b)) > 0
    starts = torch.cumsum(nbytes, 0) - nbytes
    out = torch.zeros(int(nbytes.sum()), dtype=torch.int64)
    for b in range(int(nbytes.max())):
        has = nbytes > b
        more = (nbytes > b + 1).long() << 7
        out[starts[has] + b] = ((gaps[has] >> (7 * b)) & 0x7F) | more[has]
    return _bytes(out.to(torch.uint8))


def _from_varint_gaps(data: bytes, k: int) -> torch.Tensor:
    raw = _tensor(data, torch.uint8, len(data)).long()
    ends = (raw & 0x80) == 0
    if int(ends.sum()) != k or (raw.numel() and not bool(ends[-1])):
        raise RemoteProtocolError("bad-delta-frame", "topk positions do not hold k varints")
    if k == 0:
        return torch.zeros(0, dtype=torch.long)
    group = torch.cumsum(ends.long(), 0) - ends.long()  # which varint each byte is in
    starts = torch.zeros(k, dtype=torch.long)
    ends_at = ends.nonzero().reshape(-1)
    starts[1:] = ends_at[:-1] + 1
    shift = 7 * (torch.arange(raw.numel()) - starts[group])
    if bool((shift > 56).any()):
        raise RemoteProtocolError("bad-delta-frame", "topk position varint too long")
    gaps = torch.zeros(k, dtype=torch.long).index_add_(0, group, (raw & 0x7F) << shift)
    return torch.cumsum(gaps + 1, 0) - 1


def _pack(q: torch.Tensor, bits: int) -> bytes:
    per_byte = 8 // bits
    if per_byte == 1:
        return _bytes(q.to(torch.uint8))
    padded = torch.zeros(-(-q.numel() // per_byte) * per_byte, dtype=torch.int64)
    padded[: q.numel()] = q
    shifts = torch.arange(per_byte, dtype=torch.int64) * bits
    return _bytes((padded.view(-1, per_byte) << shifts).sum(dim=1).to(torch.uint8))


def _unpack(data: bytes, bits: int, n: int) -> torch.Tensor:
    per_byte = 8 // bits
    raw = _tensor(data, torch.uint8, -(-n // per_byte)).to(torch.int64)
    if per_byte == 1:
        return raw
    shifts = torch.arange(per_byte, dtype=torch.int64) * bits
    values: torch.Tensor = ((raw[:, None] >> shifts) & (2**bits - 1)).reshape(-1)[:n]
    return values


def _exact(t: torch.Tensor, encoded: Encoded) -> torch.Tensor:
    if t.numel() * t.element_size() != len(encoded.payload):
        raise RemoteProtocolError("bad-delta-frame", f"{encoded.codec} payload has the wrong "
                                  "length")
    return t


_CODECS: dict[str, Any] = {"fp32": Fp32, "fp16": Fp16, "int8": Int8, "topk": TopK, "qsgd": QSGD}


def make_codec(name: str, **options: Any) -> Codec:
    """A codec by job name, with its options (``sync.codec_options`` in job.json)."""
    try:
        cls = _CODECS[name]
    except KeyError:
        raise ConfigError(f"codec {name!r} unknown: use one of {', '.join(_CODECS)}") from None
    try:
        codec: Codec = cls(**options)
    except TypeError as exc:
        raise ConfigError(f"{name} codec: {exc}") from None
    return codec


class ErrorFeedback:
    """A codec plus the residual it has not sent yet (Seide et al. 2014; Lin et al. 2018).

    Each call sends ``x + residual`` and keeps what the codec dropped:
    ``decoded + new_residual == x + old_residual`` exactly, in float32, for the codecs
    here (the residual of a kept float16 value is exact by Sterbenz's lemma). Codecs
    that are unbiased on their own (QSGD) or exact (fp32) keep no residual.
    """

    def __init__(self, codec: Codec, numel: int) -> None:
        self.codec = codec
        self.residual = torch.zeros(numel, dtype=torch.float32)

    def compress(self, x: torch.Tensor) -> tuple[Encoded, torch.Tensor]:
        """(what to send, what the receiver will decode)."""
        total = _flat(x) + self.residual
        encoded = self.codec.encode(total)
        decoded = self.codec.decode(encoded)
        if self.codec.error_feedback:
            self.residual = total - decoded
        return encoded, decoded

    def state_dict(self) -> dict[str, Any]:
        return {"residual": self.residual.clone(), "codec": self.codec.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.residual = state["residual"].clone().float()
        self.codec.load_state_dict(state["codec"])


__all__ = [
    "CODEC_CODES",
    "QSGD",
    "Codec",
    "Encoded",
    "ErrorFeedback",
    "Fp16",
    "Fp32",
    "Int8",
    "TopK",
    "make_codec",
]
