"""DiLoCo-style sync of one stage across replicas, asynchronous and compressed.

Theory of operation. Every replica of a stage trains on its own; the stage's global
parameters live with its ``OuterSync`` (held by one fellow, the stage's keeper) as
version ``v``. A replica's ``LocalSync`` mirrors the global parameters bit for bit
(``anchor``) and remembers where it last took a delta (``snapshot``).

1. After its step budget a replica takes ``delta = snapshot - params`` (a
   pseudo-gradient: the opposite of its progress since the last delta), compresses it
   with error feedback and sends it tagged with the version it is anchored on. It goes
   on training at once: nothing waits for the network.
2. The keeper's round ``v`` collects contributions until every member has sent a fresh
   one or the round's deadline passes (``close_round(now)``). A contribution ``s``
   versions old weighs ``samples * decay**s``; beyond the staleness bound it is dropped.
3. Closing the round: ``g = sum(weight * delta) / sum(samples)``; outer Nesterov
   momentum (DiLoCo, Douillard et al. 2023): ``m = mu m + g``,
   ``u = -lr (g + mu m)``. ``u`` is compressed with the keeper's own error feedback and
   the decoded update is what the keeper adds to the global parameters and what every
   replica adds to its anchor, so all stay equal bit for bit at version ``v + 1``.
4. A replica applying update ``v`` sets ``params = anchor + (params - snapshot)``: the
   new global parameters plus the progress it has not sent yet; nothing is counted twice
   and nothing is lost unless the keeper dropped it as too stale.

A round with no contribution stays open (its deadline moves on): the version only
advances with an update. A replica that missed updates asks for the ones it lacks
(``updates_since``) or, when those are gone, the whole state (``join``). Everything here
is plain tensors and numbers: time comes in as ``now``, so the network layer and a
virtual-time simulation drive it alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from p2pswarm.errors import RemoteProtocolError
from p2pswarm.training.codec import Codec, Encoded, ErrorFeedback, make_codec
from p2pswarm.training.job import SyncConfig
from p2pswarm.training.round_rule import delta_weight
from p2pswarm.training.round_rule import step_budgets as step_budgets

HISTORY_UPDATES = 8  # updates a keeper keeps for replicas catching up


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One float32 CPU vector of ``tensors`` in order."""
    if not tensors:
        return torch.zeros(0)
    return torch.cat([t.detach().reshape(-1).to("cpu", torch.float32) for t in tensors])


def write_flat(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy ``flat`` back into ``tensors`` (in place, in their dtype and device)."""
    offset = 0
    with torch.no_grad():
        for t in tensors:
            n = t.numel()
            t.copy_(flat[offset:offset + n].view_as(t))
            offset += n
    if offset != flat.numel():
        raise RemoteProtocolError("bad-delta", f"{flat.numel()} values for {offset} parameters")


@dataclass(frozen=True, slots=True)
class Verdict:
    accepted: bool
    staleness: int
    reason: str = ""  # "stale" | "future" when refused


@dataclass(frozen=True, slots=True)
class Applied:
    replica: str
    round: int  # the version the contribution was anchored on
    samples: int
    weight: float  # samples * decay**staleness


@dataclass(frozen=True, slots=True)
class RoundResult:
    version: int  # the new global version; replicas at version - 1 apply ``update``
    update: Encoded
    applied: tuple[Applied, ...]
    dropped: tuple[Applied, ...]  # too stale by the time the round closed
    closed_at: float

    @property
    def samples(self) -> int:
        """Samples whose gradients went into this update (useful work)."""
        return sum(a.samples for a in self.applied)


@dataclass(frozen=True, slots=True)
class JoinState:
    """What a joining replica pulls: the global parameters at ``version`` (and, for a
    fellow that may take over as keeper, the outer state)."""

    version: int
    params: torch.Tensor
    momentum: torch.Tensor

    @property
    def nbytes(self) -> int:
        return 4 * self.params.numel()


class OuterSync:
    """The keeper of one stage's global parameters: rounds, deadlines, outer optimizer."""

    def __init__(self, params: torch.Tensor, config: SyncConfig, *, now: float = 0.0,
                 codec: Codec | None = None) -> None:
        self.config = config
        self.params = params.detach().to("cpu", torch.float32).clone()
        self.momentum = torch.zeros_like(self.params)
        self.compressor = ErrorFeedback(
            codec or make_codec(config.update_codec_name(), **config.update_codec_kwargs()),
            self.params.numel())
        self.version = 0
        self.deadline = now + config.round_deadline_s
        self.members: set[str] = set()
        self._pending: dict[tuple[str, int], tuple[torch.Tensor, int]] = {}
        self._fresh: set[str] = set()
        self._history: dict[int, Encoded] = {}

    # --- membership ----------------------------------------------------------------------

    def join(self, replica: str) -> JoinState:
        """Count ``replica`` in for the rounds to come; the state it starts from."""
        self.members.add(replica)
        return JoinState(self.version, self.params.clone(), self.momentum.clone())

    def leave(self, replica: str) -> None:
        """Stop waiting for ``replica``; what it already sent still counts."""
        self.members.discard(replica)
        self._fresh.discard(replica)

    # --- rounds --------------------------------------------------------------------------

    def contribute(self, replica: str, round: int, delta: torch.Tensor, samples: int,
                   now: float | None = None) -> Verdict:
        """A replica's decoded pseudo-gradient, anchored on version ``round``."""
        if delta.numel() != self.params.numel():
            raise RemoteProtocolError("bad-delta", f"{delta.numel()} values, the stage has "
                                      f"{self.params.numel()}")
        staleness = self.version - round
        if staleness < 0:
            return Verdict(False, staleness, "future")
        if staleness > self.config.staleness_bound:
            return Verdict(False, staleness, "stale")
        key = (replica, round)
        if key in self._pending:  # a second delta on the same anchor: progress adds up
            total, n = self._pending[key]
            self._pending[key] = (total + delta.float(), n + samples)
        else:
            self._pending[key] = (delta.detach().to("cpu", torch.float32).clone(), samples)
        if staleness == 0:
            self._fresh.add(replica)
        return Verdict(True, staleness)

    def ready(self, now: float) -> bool:
        """Whether the round should close now: everyone sent, or the deadline passed (with
        something arrived); ``round_rule.round_closes`` is the whole rule."""
        if not self._pending:
            return False
        return now >= self.deadline or (bool(self.members) and self.members <= self._fresh)

    def next_deadline(self) -> float:
        return self.deadline

    def close_round(self, now: float) -> RoundResult | None:
        """Apply what arrived; None (and the deadline moved on) when nothing did."""
        if not self._pending:
            self.deadline = now + self.config.round_deadline_s
            return None
        applied: list[Applied] = []
        dropped: list[Applied] = []
        grad = torch.zeros_like(self.params)
        total_samples = 0
        # sorted, not arrival order: the same contributions give the same sum to the bit
        for (replica, round), (delta, samples) in sorted(self._pending.items()):
            staleness = self.version - round
            weight = delta_weight(samples, staleness, self.config.staleness_decay,
                                  self.config.staleness_bound)
            if staleness > self.config.staleness_bound:
                dropped.append(Applied(replica, round, samples,
                                       samples * self.config.staleness_decay ** staleness))
                continue
            entry = Applied(replica, round, samples, weight)
            grad.add_(delta, alpha=weight)
            total_samples += samples
            applied.append(entry)
        self._pending.clear()
        self._fresh.clear()
        if total_samples:
            grad.div_(total_samples)
        mu = self.config.outer_momentum
        self.momentum.mul_(mu).add_(grad)
        wanted = -self.config.outer_lr * (grad + mu * self.momentum)
        encoded, update = self.compressor.compress(wanted)
        self.params.add_(update)
        self._history[self.version] = encoded
        self._history.pop(self.version - HISTORY_UPDATES, None)
        self.version += 1
        self.deadline = now + self.config.round_deadline_s
        return RoundResult(self.version, encoded, tuple(applied), tuple(dropped), now)

    def adopt(self, encoded: Encoded) -> None:
        """Take an update to ``version + 1`` that another keeper of the same parameters
        closed (one that vanished after sending it to some replicas), instead of closing
        the round again: the contributions anchored before it are in it already."""
        self.advance(self.compressor.codec.decode(encoded), encoded)

    def advance(self, update: torch.Tensor, encoded: Encoded | None = None) -> None:
        """Take a decoded update to ``version + 1`` closed elsewhere (``adopt``; the parts
        of a sharded all-reduce, kept by the driver of a job that syncs by it)."""
        if update.numel() != self.params.numel():
            raise RemoteProtocolError("bad-update", f"{update.numel()} values, the keeper "
                                      f"has {self.params.numel()}")
        self.params.add_(update)
        if encoded is not None:
            self._history[self.version] = encoded
        self._history.pop(self.version - HISTORY_UPDATES, None)
        self.version += 1
        self._pending = {k: v for k, v in self._pending.items() if k[1] >= self.version}
        self._fresh.clear()

    def updates_since(self, version: int) -> list[Encoded] | None:
        """The updates taking a replica from ``version`` to now, or None if some are
        gone (then it must ``join`` again)."""
        wanted = range(version, self.version)
        if any(v not in self._history for v in wanted):
            return None
        return [self._history[v] for v in wanted]

    # --- state ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": self.version, "params": self.params.clone(),
            "momentum": self.momentum.clone(), "compressor": self.compressor.state_dict(),
            "history": {v: e.to_bytes() for v, e in self._history.items()},
        }

    def load_state_dict(self, state: dict[str, Any], now: float = 0.0) -> None:
        self.version = int(state["version"])
        self.params = state["params"].clone().float()
        self.momentum = state["momentum"].clone().float()
        self.compressor.load_state_dict(state["compressor"])
        self._history = {int(v): Encoded.from_bytes(b) for v, b in state["history"].items()}
        self._pending.clear()
        self._fresh.clear()
        self.deadline = now + self.config.round_deadline_s


class LocalSync:
    """A replica's side of one stage's sync: anchor, snapshot and its error feedback."""

    def __init__(self, params: Sequence[torch.Tensor], config: SyncConfig, *, version: int = 0,
                 codec: Codec | None = None, noise_seed: int = 0) -> None:
        self.tensors = list(params)
        self.config = config
        self.anchor = flatten(self.tensors)
        self.snapshot = self.anchor.clone()
        self.version = version
        self.compressor = ErrorFeedback(
            codec or make_codec(config.codec, **config.codec_kwargs()), self.anchor.numel())
        self.update_codec = make_codec(config.update_codec_name(), **config.update_codec_kwargs())
        generator = getattr(self.compressor.codec, "generator", None)
        if isinstance(generator, torch.Generator):  # replicas must not share rounding noise
            generator.manual_seed(noise_seed)

    @property
    def numel(self) -> int:
        return self.anchor.numel()

    def take_delta(self) -> tuple[Encoded, torch.Tensor, int]:
        """(what to send, what the keeper will decode, the version it is anchored on)."""
        now = flatten(self.tensors)
        delta = self.snapshot - now
        self.snapshot = now
        encoded, decoded = self.compressor.compress(delta)
        return encoded, decoded, self.version

    def apply(self, update: Encoded | torch.Tensor, version: int) -> None:
        """Apply the keeper's update that produced ``version`` (from ``version - 1``)."""
        if version != self.version + 1:
            raise RemoteProtocolError("sync-gap", f"update to version {version} given to a "
                                      f"replica at version {self.version}")
        u = self.update_codec.decode(update) if isinstance(update, Encoded) else update
        unsent = flatten(self.tensors) - self.snapshot
        self.anchor.add_(u)
        self.snapshot = self.anchor.clone()
        write_flat(self.anchor + unsent, self.tensors)
        self.version = version

    def reset(self, state: JoinState) -> None:
        """Start over from the keeper's state (a replica joining or rejoining)."""
        self.anchor = state.params.clone()
        self.snapshot = self.anchor.clone()
        write_flat(self.anchor, self.tensors)
        self.version = state.version
        self.compressor.residual.zero_()

    def state_dict(self) -> dict[str, Any]:
        return {"anchor": self.anchor.clone(), "snapshot": self.snapshot.clone(),
                "version": self.version, "compressor": self.compressor.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.anchor = state["anchor"].clone().float()
        self.snapshot = state["snapshot"].clone().float()
        self.version = int(state["version"])
        self.compressor.load_state_dict(state["compressor"])
