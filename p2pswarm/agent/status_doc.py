"""The ``status`` document (the control API's answer, ``status --json``, the HTTP API's
``/api/status``): its exact keys, typed, so a renamed key is a type error where the
document is made and where it is read. The agent fills it from its values in one place
(``Agent.status``); nothing inside the agent reads it back."""

from __future__ import annotations

from typing import TypedDict

from p2pswarm.agent.self_watch import SelfWatchDoc
from p2pswarm.cards import CardDoc


class SelfDoc(TypedDict):
    """This fellow: its node id in hex, name, advertised and listening addresses."""

    id: str
    name: str
    addr: str
    listen: str


class MemberRow(TypedDict):
    """One fellow as membership knows it (``cards``: as ``Card.to_dict`` writes them)."""

    id: str
    name: str
    addr: str
    state: str
    incarnation: int
    cards: list[CardDoc]
    last_heard_s: float | None
    in_state_s: float
    self: bool
    protocol: int  # its release's protocol (wire.versions; 1: it announced none)
    speaks: list[str]  # the capabilities it announced


class LeaderDoc(TypedDict):
    """The leader this fellow follows."""

    id: str
    name: str | None
    term: int


class ElectorateDoc(TypedDict):
    """What a leader needs (votes of a majority of ``voters``) and this side ``sees``."""

    voters: int
    needs: int
    sees: int
    dead_leave_after_s: float
    shrinks_in_s: float | None


class HeldStageDoc(TypedDict):
    """One stage this fellow holds, with its claims."""

    plan_id: str
    stage: int
    state: str
    claim_bytes: int
    allocated_bytes: int
    sessions: int


class CountersDoc(TypedDict):
    """The traffic counters; ``drops`` and ``refused``: reason -> count, by reason."""

    datagrams_in: int
    datagrams_out: int
    bytes_in: int
    bytes_out: int
    streams_in: int
    streams_out: int
    frames_in: int
    frames_out: int
    drops: dict[str, int]
    refused: dict[str, int]


class StoreUseDoc(TypedDict):
    """One store under the fellow's home against its cap (None: bounded by count)."""

    store: str
    used_bytes: int
    cap_bytes: int | None


class CertificateDoc(TypedDict):
    """This fellow's certificate: its invitation (id prefix), slot, uses, expiry, the
    leader priority it allows, and who signed it ("admin", or the delegate's node id)."""

    invitation: str
    slot: int
    uses: int
    expires_at_s: int
    max_priority: int
    issuer: str


class _AdmissionSaid(TypedDict):
    """What admission says of itself (``Admission.status``): the admin key (a prefix),
    whether this fellow issues and under a delegation, what it kept, refused, relayed
    and issued, and its certificate (None: none it can read)."""

    admin_key: str
    issues: bool
    delegated: bool
    revocations: int
    refused_asks: int
    relayed_asks: int
    issued: int
    certificate: CertificateDoc | None


class AdmissionStateDoc(_AdmissionSaid, total=False):
    """``_AdmissionSaid``, and, for a delegated issuer holding a certificate, when its
    delegation expires."""

    delegation_expires_at_s: int


class AdmissionDoc(AdmissionStateDoc):
    """The ``admission`` section: admission's own state, and what the gate refused,
    by counter."""

    refused: dict[str, int]


class StatusDoc(TypedDict):
    """The whole ``status`` answer."""

    self: SelfDoc
    preset: str
    uptime_s: float
    health: int
    members: list[MemberRow]
    leader: LeaderDoc | None
    leader_note: str
    electorate: ElectorateDoc | None
    stages_held: list[HeldStageDoc]
    role: str
    counters: CountersDoc
    transport: dict[str, int]
    membership: dict[str, int]
    loop_lag: dict[str, float]
    self_watch: SelfWatchDoc
    admission: AdmissionDoc | None  # None: a swarm made before invitations
    disks: list[StoreUseDoc]  # as the control op last measured them ([]: not yet)


__all__ = ["AdmissionDoc", "AdmissionStateDoc", "CertificateDoc", "CountersDoc", "ElectorateDoc",
           "HeldStageDoc", "LeaderDoc", "MemberRow", "SelfDoc", "StatusDoc", "StoreUseDoc"]
