"""What a DiLoCo sync round sends, in bytes, without torch.

A replica's stage sends one encoded pseudo-gradient (a delta) per round to its keeper
and receives one encoded update. The sizes follow ``training.codec`` exactly, so the
planner's bytes per round are the bytes the swarm sends (a test encodes real tensors and
compares): a 12-byte header, 8 bytes per float of metadata, then the payload:

- ``fp32``: 4 bytes an element; ``fp16``: 2 bytes an element and a scale;
- ``int8``: a 256-entry f32 codebook and one byte an element;
- ``topk``: ``k = ceil(fraction * n)`` f16 values and their positions as varint gaps
  (estimated at the mean gap, the one data-dependent size here);
- ``qsgd``: an f32 norm per bucket and ``bits`` bits an element.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from p2pswarm.errors import ConfigError

HEADER_BYTES = 12  # codec.Encoded's header: version, codec, meta count, element count
CODECS = ("fp32", "fp16", "int8", "topk", "qsgd")
INT8_BUCKETS = 256


def _varint_bytes(gap: int) -> int:
    return max(1, math.ceil(max(0, gap).bit_length() / 7))


def encoded_bytes(codec: str, options: Mapping[str, Any], numel: int) -> int:
    """Bytes of one vector of ``numel`` elements encoded with ``codec``."""
    if numel < 0:
        raise ConfigError("a vector has zero or more elements")
    if codec == "fp32":
        return HEADER_BYTES + 4 * numel
    if codec == "fp16":
        return HEADER_BYTES + 8 + 2 * numel
    if codec == "int8":
        return HEADER_BYTES + 4 * INT8_BUCKETS + numel
    if codec == "topk":
        if numel == 0:
            return HEADER_BYTES + 24
        fraction = float(options.get("fraction", 0.01))
        k = min(numel, max(1, math.ceil(fraction * numel)))
        positions = k * _varint_bytes(numel // k - 1)  # gaps between kept positions
        return HEADER_BYTES + 24 + positions + 2 * k
    if codec == "qsgd":
        bits = int(options.get("bits", 4))
        bucket = int(options.get("bucket", 512))
        if bits not in (2, 4, 8) or bucket < 1:
            raise ConfigError(f"qsgd codec: bits must be 2, 4 or 8, got {bits!r}")
        per_byte = 8 // bits
        return HEADER_BYTES + 4 * math.ceil(numel / bucket) + math.ceil(numel / per_byte)
    raise ConfigError(f"codec {codec!r} must be one of {', '.join(CODECS)}")


__all__ = ["CODECS", "HEADER_BYTES", "encoded_bytes"]
