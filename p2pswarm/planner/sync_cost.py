"""What a DiLoCo sync round sends, in bytes and seconds, without torch.

No fellow is a hub: replicas average their deltas with a sharded all-reduce. Every
stage's flat vector is split into parts, one per replica; the fellow of replica ``k``
holding a range of layers reduces part ``k`` of it (reduce-scatter: every other replica's
fellow holding those layers sends it that part of its delta) and sends the part's update
back (all-gather). Between fellow ``A`` of one replica and fellow ``B`` of another whose
layers overlap in ``P`` parameters, each direction carries ``P / R`` elements of delta and
``P / R`` of update, so a fellow sends, and receives, ``(R - 1) / R`` of its own stage's
delta plus update a round: about twice its compressed delta, whatever the number of
replicas ``R`` (``round_traffic``).

Seconds: a fellow's sends go out one after another on its links (and its receipts come
in so), each link at its bandwidth, plus two latencies (the two phases); fellows behind
one WiFi access point (``ClusterView.access_points``) share its airtime, every byte a
member sends or receives counting once against its capacity. The round's communication
is its slowest fellow or access point.

The encoded sizes follow ``training.codec`` exactly, so the
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
from dataclasses import dataclass
from typing import Any

from p2pswarm.errors import ConfigError
from p2pswarm.planner.cluster import ClusterView

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


@dataclass(frozen=True, slots=True)
class FellowTraffic:
    fellow_id: str
    sent_bytes: int
    received_bytes: int
    seconds: float  # its sends or its receipts, whichever take longer, and two latencies


@dataclass(frozen=True, slots=True)
class AccessPointTraffic:
    name: str
    air_bytes: int  # its members' bytes sent and received over the air
    seconds: float


@dataclass(frozen=True, slots=True)
class RoundTraffic:
    fellows: tuple[FellowTraffic, ...]  # sorted by id
    access_points: tuple[AccessPointTraffic, ...]
    seconds: float  # the slowest fellow or access point
    limit: str  # what sets it: "fellow ID" or "access point NAME"

    @property
    def total_sent_bytes(self) -> int:
        return sum(f.sent_bytes for f in self.fellows)

    @property
    def busiest(self) -> FellowTraffic | None:
        """The fellow that sends the most (ties: the lowest id)."""
        return min(self.fellows, key=lambda f: (-f.sent_bytes, -f.received_bytes,
                                               f.fellow_id), default=None)


def share_bytes(codec: str, options: Mapping[str, Any], overlap_params: int,
                replicas: int) -> int:
    """One direction between two fellows of different replicas whose layers overlap in
    ``overlap_params``: one part (``1 / replicas``) of the delta encoded with ``codec``."""
    if replicas < 1 or overlap_params <= 0:
        return 0
    return encoded_bytes(codec, options, math.ceil(overlap_params / replicas))


def round_traffic(flows: Mapping[tuple[str, str], int], view: ClusterView) -> RoundTraffic:
    """The round's seconds from its ``flows`` (bytes from fellow A to fellow B)."""
    sent: dict[str, int] = {}
    received: dict[str, int] = {}
    send_s: dict[str, float] = {}
    receive_s: dict[str, float] = {}
    latency: dict[str, float] = {}
    air: dict[str, int] = {}
    for (a, b), nbytes in sorted(flows.items()):
        if nbytes <= 0:
            continue
        link = view.link(a, b)
        seconds = nbytes / link.bandwidth_bytes_s
        sent[a] = sent.get(a, 0) + nbytes
        received[b] = received.get(b, 0) + nbytes
        send_s[a] = send_s.get(a, 0.0) + seconds
        receive_s[b] = receive_s.get(b, 0.0) + seconds
        for x in (a, b):
            latency[x] = max(latency.get(x, 0.0), link.latency_s)
        if a != b:  # two cards of one fellow never go over the air
            for x in (a, b):
                ap = view.access_point(x)
                if ap is not None:
                    air[ap.name] = air.get(ap.name, 0) + nbytes
    fellows = tuple(FellowTraffic(
        fellow_id=x, sent_bytes=sent.get(x, 0), received_bytes=received.get(x, 0),
        seconds=max(send_s.get(x, 0.0), receive_s.get(x, 0.0)) + 2 * latency.get(x, 0.0))
        for x in sorted({*sent, *received}))
    aps = tuple(AccessPointTraffic(name=ap.name, air_bytes=air[ap.name],
                                   seconds=air[ap.name] / ap.capacity_bytes_s)
                for ap in view.access_points if ap.name in air)
    seconds, limit = 0.0, ""
    for f in fellows:
        if f.seconds > seconds:
            seconds, limit = f.seconds, f"fellow {f.fellow_id}"
    for t in aps:
        if t.seconds > seconds:
            seconds, limit = t.seconds, f"access point {t.name}"
    return RoundTraffic(fellows=fellows, access_points=aps, seconds=seconds, limit=limit)


__all__ = ["CODECS", "HEADER_BYTES", "AccessPointTraffic", "FellowTraffic", "RoundTraffic",
           "encoded_bytes", "round_traffic", "share_bytes"]
