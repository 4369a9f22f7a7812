"""The torch side of a sharded all-reduce of one stage's deltas: no fellow is a hub.

Theory of operation. A stage's flat parameter vector is split into ``parts`` contiguous
slices (``part_bounds``: deterministic, every fellow computes the same split). Each part
has one keeper (``PartKeeper``): an ``OuterSync`` over that slice only, so it holds the
slice's global parameters, outer momentum and the error feedback of its update, and
closes its round exactly as the single keeper of ``training.sync`` closes the whole
vector (weighted average, outer Nesterov, compressed update with error feedback).

A replica (``PartedSync``, over its ``LocalSync``) takes its delta as one encoded blob
per part, each compressed with error feedback on its own slice of the residual, sends
part ``j`` to part ``j``'s keeper (reduce-scatter) and gets every part's update back
(all-gather). It applies the decoded parts, concatenated, exactly as ``LocalSync.apply``
applies a whole update: every replica decodes the same bytes, so all stay bit-equal.

A fellow sends ``(parts - 1) / parts`` of its delta and receives as much of the updates;
its keeper receives ``parts - 1`` slices and sends its update slice ``parts - 1`` times:
about twice one compressed delta per fellow per round, whatever the number of fellows.

Everything crosses this module as bytes (``Encoded.to_bytes``), so the trio side
(``agent.training.allreduce``) never touches a tensor.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

import torch

from p2pswarm.errors import RemoteProtocolError
from p2pswarm.training.codec import Encoded, make_codec
from p2pswarm.training.job import SyncConfig
from p2pswarm.training.sync import LocalSync, OuterSync, Verdict, flatten

MAX_PARTS = 4096


def part_bounds(numel: int, parts: int) -> list[tuple[int, int]]:
    """[(start, end)] of ``parts`` contiguous slices of ``numel`` values, the first
    ``numel % parts`` one value longer: the same on every fellow."""
    if not 1 <= parts <= MAX_PARTS:
        raise ValueError(f"parts must be within 1..{MAX_PARTS}, got {parts}")
    base, extra = divmod(numel, parts)
    bounds = []
    start = 0
    for j in range(parts):
        end = start + base + (1 if j < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


class PartedSync:
    """A replica's side of a sharded round for one stage, over its ``LocalSync``."""

    def __init__(self, local: LocalSync, parts: int) -> None:
        self.local = local
        self.bounds = part_bounds(local.numel, parts)
        self.update_codec = local.update_codec

    @property
    def parts(self) -> int:
        return len(self.bounds)

    @property
    def version(self) -> int:
        return self.local.version

    def params(self) -> torch.Tensor:
        """The global parameters this replica mirrors (its anchor)."""
        return self.local.anchor

    def take_parts(self) -> tuple[int, list[bytes]]:
        """(the version the delta is anchored on, one encoded blob per part); each part
        is compressed with error feedback on its own slice of the residual."""
        local = self.local
        now = flatten(local.tensors)
        delta = local.snapshot - now
        local.snapshot = now
        feedback = local.compressor
        total = delta + feedback.residual
        blobs = []
        for start, end in self.bounds:
            encoded = feedback.codec.encode(total[start:end])
            if feedback.codec.error_feedback:
                feedback.residual[start:end] = total[start:end] - feedback.codec.decode(encoded)
            blobs.append(encoded.to_bytes())
        if not feedback.codec.error_feedback:
            feedback.residual.zero_()
        return local.version, blobs

    def decode_update(self, blobs: Sequence[bytes]) -> torch.Tensor:
        """The whole update from every part's blob, in part order; a blob of the wrong
        size is refused."""
        if len(blobs) != self.parts:
            raise RemoteProtocolError("bad-update", f"{len(blobs)} parts for {self.parts}")
        pieces = []
        for (start, end), blob in zip(self.bounds, blobs, strict=True):
            encoded = Encoded.from_bytes(blob)
            if encoded.numel != end - start:
                raise RemoteProtocolError("bad-update", f"a part of {encoded.numel} values "
                                          f"for a slice of {end - start}")
            pieces.append(self.update_codec.decode(encoded))
        return torch.cat(pieces) if pieces else torch.zeros(0)

    def apply_parts(self, version: int, blobs: Sequence[bytes]) -> None:
        """Apply every part's update to ``version`` (from ``version - 1``)."""
        self.local.apply(self.decode_update(blobs), version)

    def keeper(self, part: int, now: float, state: bytes | None = None) -> PartKeeper:
        """A keeper of part ``part`` starting from this replica's anchor (the global
        parameters, equal on every replica) at its version, with the part's outer state
        when one was handed over (else a fresh momentum and error feedback)."""
        start, end = self.bounds[part]
        keeper = PartKeeper(part, self.local.anchor[start:end], self.local.config,
                            version=self.local.version, now=now)
        if state is not None:
            keeper.load_outer(state)
        return keeper


class PartKeeper:
    """The keeper of one part of a stage: an ``OuterSync`` over its slice, fed bytes."""

    def __init__(self, part: int, params: torch.Tensor, config: SyncConfig, *,
                 version: int = 0, now: float = 0.0) -> None:
        self.part = part
        self.outer = OuterSync(params, config, now=now)
        self.outer.version = version
        self.codec = make_codec(config.codec, **config.codec_kwargs())

    @property
    def version(self) -> int:
        return self.outer.version

    @property
    def members(self) -> set[str]:
        return self.outer.members

    def join(self, replica: str) -> None:
        self.outer.members.add(replica)

    def leave(self, replica: str) -> None:
        self.outer.leave(replica)

    def contribute(self, replica: str, version: int, blob: bytes, samples: int,
                   now: float) -> Verdict:
        encoded = Encoded.from_bytes(blob)
        if encoded.numel != self.outer.params.numel():
            raise RemoteProtocolError("bad-delta", f"a part of {encoded.numel} values for a "
                                      f"slice of {self.outer.params.numel()}")
        return self.outer.contribute(replica, version, self.codec.decode(encoded), samples, now)

    def ready(self, now: float) -> bool:
        return self.outer.ready(now)

    def next_deadline(self) -> float:
        return self.outer.next_deadline()

    def close(self, now: float) -> tuple[int, bytes, tuple[str, ...]] | None:
        """(the new version, the part's encoded update, the replicas it holds) or None
        when nothing arrived (the deadline moved on)."""
        result = self.outer.close_round(now)
        if result is None:
            return None
        return (result.version, result.update.to_bytes(),
                tuple(dict.fromkeys(a.replica for a in result.applied)))

    def adopt(self, version: int, blob: bytes) -> None:
        """Take the part's update to ``version`` that its previous keeper closed (and sent
        some replicas) before it vanished, instead of closing that round again: the
        deltas anchored before it are in it already."""
        if version != self.outer.version + 1:
            raise RemoteProtocolError("sync-gap", f"update to version {version} given to a "
                                      f"keeper at version {self.outer.version}")
        self.outer.adopt(Encoded.from_bytes(blob))

    def outer_state(self) -> bytes:
        """What another fellow needs to keep this part on: momentum and error feedback
        (the global parameters every replica already mirrors), as ``torch.save`` bytes."""
        out = io.BytesIO()
        torch.save({"momentum": self.outer.momentum.clone(),
                    "compressor": self.outer.compressor.state_dict()}, out)
        return out.getvalue()

    def load_outer(self, blob: bytes) -> None:
        """Take a part's outer state (``outer_state``); RemoteProtocolError when it is
        not one of this part's size."""
        try:
            state = torch.load(io.BytesIO(blob), weights_only=True)
            momentum = state["momentum"].float()
            residual = state["compressor"]["residual"]
            codec_state = state["compressor"].get("codec", {})
        except Exception as exc:  # torch.load raises many kinds: all mean a bad state
            raise RemoteProtocolError("bad-state", type(exc).__name__) from None
        n = self.outer.params.numel()
        if momentum.numel() != n or residual.numel() != n:
            raise RemoteProtocolError("bad-state", "a part's outer state of the wrong size")
        try:
            self.outer.compressor.load_state_dict({"residual": residual,
                                                   "codec": codec_state})
        except Exception as exc:  # a codec state of another kind: a bad state too
            raise RemoteProtocolError("bad-state", type(exc).__name__) from None
        self.outer.momentum = momentum.reshape(-1).clone()


def pack_outer(states: dict[int, bytes]) -> bytes:
    """Parts' outer states (``PartKeeper.outer_state``) as one ``torch.save`` blob."""
    out = io.BytesIO()
    torch.save({int(k): torch.frombuffer(bytearray(v), dtype=torch.uint8)
                for k, v in states.items()}, out)
    return out.getvalue()


def unpack_outer(blob: bytes, parts: int) -> dict[int, bytes]:
    """The parts' outer states ``pack_outer`` wrote; RemoteProtocolError when it is not
    that, or names a part out of ``0..parts-1``."""
    try:
        raw = torch.load(io.BytesIO(blob), weights_only=True)
        states = {int(k): v.numpy().tobytes() for k, v in raw.items()}
    except Exception as exc:  # torch.load raises many kinds: all mean a bad blob
        raise RemoteProtocolError("bad-state", type(exc).__name__) from None
    if any(not 0 <= k < parts for k in states):
        raise RemoteProtocolError("bad-state", "outer state of a part out of range")
    return states


def split_outer(momentum: torch.Tensor, residual: torch.Tensor, parts: int,
                codec_state: dict[str, Any] | None = None) -> dict[int, bytes]:
    """A whole stage's outer momentum and update error feedback as each part's outer
    state (what ``PartKeeper.load_outer`` takes): a resumed job's part keepers start
    where its checkpoint's keeper stood."""
    states = {}
    for j, (start, end) in enumerate(part_bounds(momentum.numel(), parts)):
        out = io.BytesIO()
        torch.save({"momentum": momentum[start:end].clone(),
                    "compressor": {"residual": residual[start:end].clone(),
                                   "codec": dict(codec_state or {})}}, out)
        states[j] = out.getvalue()
    return states


def merge_outer(momentum: torch.Tensor, residual: torch.Tensor, states: dict[int, bytes],
                parts: int) -> None:
    """Each part's outer state (``PartKeeper.outer_state``) into the whole stage's
    momentum and error feedback, in place: a checkpoint holds what the keepers hold. A
    part's state of the wrong size is RemoteProtocolError."""
    bounds = part_bounds(momentum.numel(), parts)
    for j, blob in states.items():
        if not 0 <= j < parts:
            raise RemoteProtocolError("bad-state", "outer state of a part out of range")
        start, end = bounds[j]
        try:
            state = torch.load(io.BytesIO(blob), weights_only=True)
            m = state["momentum"].float().reshape(-1)
            r = state["compressor"]["residual"].float().reshape(-1)
        except Exception as exc:  # torch.load raises many kinds: all mean a bad state
            raise RemoteProtocolError("bad-state", type(exc).__name__) from None
        if m.numel() != end - start or r.numel() != end - start:
            raise RemoteProtocolError("bad-state", "a part's outer state of the wrong size")
        momentum[start:end] = m
        residual[start:end] = r


__all__ = ["MAX_PARTS", "PartKeeper", "PartedSync", "merge_outer", "pack_outer",
           "part_bounds", "split_outer", "unpack_outer"]
