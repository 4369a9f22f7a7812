"""Who a fellow is (``LocalNode``) and what this node knows of each fellow (``Member``)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Literal

from p2pswarm.membership.states import PRESENT_NAMES

MemberState = Literal["alive", "suspect", "dead", "left"]
STATE_NAMES: tuple[MemberState, ...] = ("alive", "suspect", "dead", "left")


def node_id_of(public_key: bytes) -> bytes:
    """A node's id: the first 16 bytes of the SHA-256 of its Ed25519 public key."""
    return hashlib.sha256(public_key).digest()[:16]


@dataclass(frozen=True, slots=True)
class LocalNode:
    """This node as it presents itself to the swarm."""

    node_id: bytes
    name: str
    addr: str
    public_key: bytes
    priority: int = 0  # leader priority: a wired, always-on machine gets a higher one
    certificate: bytes = b""  # its admission (security.admission.Certificate), if any


@dataclass(frozen=True, slots=True)
class Member:
    """One fellow as this node sees it (a snapshot; the machine keeps its own state)."""

    node_id: bytes
    name: str
    addr: str
    state: MemberState
    incarnation: int
    metadata: bytes  # the newest version this node holds (b"" before the first pull)
    meta_version: int  # the version of ``metadata``
    announced_meta_version: int  # the newest version gossip has announced
    last_heard_s: float | None  # when this node last heard from it first hand
    state_since_s: float  # when it entered ``state`` (as this node saw it)
    priority: int = 0
    public_key: bytes = b""
    is_self: bool = False

    @property
    def present(self) -> bool:
        """Alive or suspect: still counted as part of the swarm."""
        return self.state in PRESENT_NAMES


__all__ = ["STATE_NAMES", "LocalNode", "Member", "MemberState", "node_id_of"]
