"""Protocol versions and capabilities: which fellows share a swarm, and what each speaks.

The policy (docs/versions.md): every release carries one protocol version, an integer.
A release and the one before it form one swarm; two fellows further apart refuse each
other with one line naming both versions. The newer fellow speaks down: it sends a
message kind, or a field, added after protocol 1 only to a fellow that announced the
capability naming it (``speaks``).

Where the numbers travel. The release's protocol is the ``minor`` of every envelope
(``[major, minor, body]``): protocol 1's decoder (commit 675ee12) reads only the major
and takes any minor, and its envelopes say 1, so the receiver knows its peer's version
from the first bytes of every datagram and frame, before it decodes anything. The
capabilities, and the protocol again, ride in a fellow's signed metadata map (keys
``protocol`` and ``speaks``), which protocol 1 passes through untouched; a fellow whose
metadata says neither is protocol 1, and speaks nothing added since.

Pure: no I/O, no trio.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

PROTOCOL = 2  # this release's protocol: 1 is commit 675ee12, which announced none
OLDEST_PROTOCOL = PROTOCOL - 1  # the oldest this release speaks down to
NEWEST_PROTOCOL = PROTOCOL + 1  # the newest that speaks down to this release
UNANNOUNCED_PROTOCOL = 1  # a fellow whose metadata names no protocol

# --- capabilities: what was added after protocol 1, one name each ------------------------
# A name is never reused nor removed while a release that lacks it may share a swarm.
UNSUPPORTED_REPLY = "unsupported-reply"  # answers an unknown kind with Unsupported (tag 3)
VERSION_REFUSAL = "version-refusal"  # refuses fellows two protocols away, on streams too
ALLREDUCE = "allreduce"  # replicas average their deltas by the ring (tags 186-189, 197, 198)

# what this release speaks
CAPABILITIES: tuple[str, ...] = (UNSUPPORTED_REPLY, VERSION_REFUSAL, ALLREDUCE)
MAX_CAPABILITIES = 64  # names one fellow may announce
MAX_CAPABILITY_CHARS = 48

# Metadata keys (the signed map a fellow gossips about itself)
PROTOCOL_KEY = "protocol"
SPEAKS_KEY = "speaks"


def compatible(mine: int, theirs: int) -> bool:
    """Whether fellows at protocols ``mine`` and ``theirs`` share a swarm: a release and
    the one before it do, two further apart do not."""
    return abs(mine - theirs) <= 1


def refusal_line(mine: int, theirs: int) -> str:
    """The one line a refused fellow gets (and the refusing one logs): it names both
    versions, and which side to upgrade, in words true on either side."""
    older, newer = min(mine, theirs), max(mine, theirs)
    return (f"protocol {theirs} cannot share a swarm with protocol {mine}: a release talks "
            f"only to the one before it and the one after; upgrade the fellow of protocol "
            f"{older} to a release of protocol {newer - 1} or later")


@dataclass(frozen=True, slots=True)
class Release:
    """What a fellow announced of its release: its protocol and the capabilities it
    speaks (names added after protocol 1)."""

    protocol: int = UNANNOUNCED_PROTOCOL
    speaks: frozenset[str] = frozenset()

    @classmethod
    def from_doc(cls, meta: Mapping[Any, Any]) -> Release:
        """From a fellow's decoded metadata map; anything missing or malformed reads as
        protocol 1, speaking nothing new (a hostile value only makes it look older)."""
        protocol = meta.get(PROTOCOL_KEY, UNANNOUNCED_PROTOCOL)
        if type(protocol) is not int or not 1 <= protocol <= 2**16 - 1:
            return cls()
        names = meta.get(SPEAKS_KEY, [])
        if type(names) is not list or len(names) > MAX_CAPABILITIES:
            return cls(protocol)
        speaks = frozenset(n for n in names
                           if type(n) is str and 0 < len(n) <= MAX_CAPABILITY_CHARS)
        return cls(protocol, speaks)

    def to_doc(self) -> dict[str, Any]:
        """The metadata entries that announce it (names sorted: metadata bytes are
        deterministic)."""
        return {PROTOCOL_KEY: self.protocol, SPEAKS_KEY: sorted(self.speaks)}


THIS_RELEASE = Release(PROTOCOL, frozenset(CAPABILITIES))


def speaks(release: Release, capability: str) -> bool:
    """Whether a fellow that announced ``release`` speaks ``capability``: the one check a
    sender makes before sending a kind or a field added after protocol 1."""
    if capability not in CAPABILITIES:
        raise ValueError(f"{capability!r} is not a capability this release knows")
    return capability in release.speaks


# --- what a stage needs of the fellow that runs it -----------------------------------------
# A kernel, a weights dtype or a feature a stage can use only on a fellow that speaks it,
# keyed by the name the load request or plan gives it. Protocol 1 runs every weights dtype
# this release runs (bf16, f16, f32, int8, int4), so nothing is listed yet; a release that
# adds one lists it here and the planner leaves fellows without it out.
STAGE_NEEDS: Mapping[str, str] = {}


def runs(release: Release, features: tuple[str, ...],
         needs: Mapping[str, str] = STAGE_NEEDS) -> str | None:
    """None if a fellow of ``release`` can run a stage using ``features``; else the first
    capability it lacks."""
    for feature in features:
        capability = needs.get(feature)
        if capability is not None and capability not in release.speaks:
            return capability
    return None


def range_line() -> str:
    """What ``p2pswarm --version`` says of the protocol."""
    return (f"protocol {PROTOCOL} (shares a swarm with protocols {OLDEST_PROTOCOL} to "
            f"{NEWEST_PROTOCOL})")


__all__ = ["ALLREDUCE", "CAPABILITIES", "NEWEST_PROTOCOL", "OLDEST_PROTOCOL", "PROTOCOL",
           "PROTOCOL_KEY", "SPEAKS_KEY", "STAGE_NEEDS", "THIS_RELEASE", "UNANNOUNCED_PROTOCOL",
           "UNSUPPORTED_REPLY", "VERSION_REFUSAL", "Release", "compatible", "range_line",
           "refusal_line", "runs", "speaks"]
