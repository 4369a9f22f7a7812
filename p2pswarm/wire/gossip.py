"""Membership (tags 10-49) and election (tags 50-69) messages.

Datagrams carry the small, frequent messages: probes (``Ping``, ``Ack``, ``Nack``,
``PingReq``), liveness updates piggybacked on them (``Alive``, ``Suspect``, ``Dead``,
``Left``), and the election's beats, votes and announcements. Streams carry the rest: the
stream ping fallback (a ``Ping`` answered by an ``Ack``), anti-entropy (``SyncDigest`` ->
``SyncSame`` | ``SyncSummary``; ``SyncRecords`` -> ``SyncRecords``), metadata pulls
(``MetaPull`` -> ``MetaPush``) and a refutation pushed to its accuser (``Alive`` ->
``Noted``).

A fellow's admission certificate rides in its own ``Alive``s and in records; relays leave
it out, and a receiver that lacks it asks the sender (``CertificateAsk`` ->
``Certificates``, datagrams).

A fellow's metadata (cards, benchmarks, role, ...) is opaque bytes here, signed by its
owner and versioned; a datagram only ever carries its version number.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

from p2pswarm.wire.codec import message, struct
from p2pswarm.wire.schema import (
    U8,
    U32,
    U64,
    Addr,
    Digest,
    Elided,
    Items,
    Name,
    NodeId,
    PublicKey,
    Range,
    Reason,
    Signature,
    Size,
)

I32 = Annotated[int, Range(-(2**31), 2**31 - 1)]
StateCode = Annotated[int, Range(0, 3)]  # 0 alive, 1 suspect, 2 dead, 3 left
Metadata = Annotated[bytes, Size(0, 256 * 1024)]
CertificateBytes = Annotated[bytes, Size(0, 1024), Elided()]  # off the wire when empty
ElidedSignature = Annotated[Signature | None, Elided()]
MAX_MEMBERS_PER_MESSAGE = 65536

STATE_ALIVE, STATE_SUSPECT, STATE_DEAD, STATE_LEFT = 0, 1, 2, 3

MEMBERSHIP_TAGS = range(10, 50)
ELECTION_TAGS = range(50, 70)

# --- probes ------------------------------------------------------------------------------


@message(10)
@dataclass(frozen=True, slots=True)
class Ping:
    """Are you there? ``target`` guards against an address now used by someone else."""

    seq: U32
    target: NodeId
    source: NodeId


@message(11)
@dataclass(frozen=True, slots=True)
class Ack:
    seq: U32


@message(12)
@dataclass(frozen=True, slots=True)
class Nack:
    """From a fellow asked to ping on our behalf: 'I tried, no answer' (so my link works)."""

    seq: U32


@message(13)
@dataclass(frozen=True, slots=True)
class PingReq:
    """Please ping ``target`` at ``target_addr`` and relay its ack (or a nack) as ``seq``."""

    seq: U32
    target: NodeId
    target_addr: Addr
    source: NodeId
    incarnation: U32 = 0  # the target's incarnation as the asker knows it (older: tell it)


# --- liveness updates (piggybacked, gossiped) ---------------------------------------------


@message(14)
@dataclass(frozen=True, slots=True)
class Alive:
    """A fellow is alive at ``incarnation`` (it says so itself, first hand or relayed).

    Signed by the fellow itself and relayed with that signature: nobody else can move it,
    rename it or invent it."""

    node: NodeId
    incarnation: U32
    name: Name
    addr: Addr
    public_key: PublicKey
    meta_version: U32  # newest metadata version; pull the bytes over a stream if not below
    priority: I32 = 0  # leader priority: higher is preferred in an election
    metadata: Metadata = b""  # that version's bytes, when small enough to ride along
    meta_signature: Signature | None = None  # the owner's signature over them (None: absent)
    epoch: U64 = 0  # the owner's datagram epoch when it signed (proves its datagrams' epoch)
    signature: Signature | None = None  # the owner's signature over every field above but
    # metadata and meta_signature (membership.proofs.alive_signed_bytes); None: refused
    certificate: CertificateBytes = b""  # its admission (security.admission.Certificate)


@message(15)
@dataclass(frozen=True, slots=True)
class Suspect:
    node: NodeId
    incarnation: U32
    source: NodeId  # who failed to reach it (distinct sources confirm)
    silent_ms: U32 = 0  # how long the source has failed to reach it without a break


@message(16)
@dataclass(frozen=True, slots=True)
class Dead:
    node: NodeId
    incarnation: U32
    source: NodeId


@message(17)
@dataclass(frozen=True, slots=True)
class Left:
    """A graceful goodbye: the fellow is gone on purpose, not failed. Where admission is
    on, it counts only with the fellow's own signature (membership.proofs.left_signed_bytes).
    """

    node: NodeId
    incarnation: U32
    signature: ElidedSignature = None


# --- anti-entropy and metadata (streams) -------------------------------------------------


@struct
@dataclass(frozen=True, slots=True)
class MemberSummary:
    node: NodeId
    incarnation: U32
    state: StateCode
    meta_version: U32


@struct
@dataclass(frozen=True, slots=True)
class MemberRecord:
    """Everything known of one fellow, including its signed metadata (if known)."""

    node: NodeId
    incarnation: U32
    state: StateCode
    name: Name
    addr: Addr
    public_key: PublicKey
    priority: I32
    meta_version: U32  # the version of ``metadata`` below (0: none)
    metadata: Metadata
    meta_signature: Signature | None
    # the owner's signed Alive at ``incarnation``: its meta version, epoch and signature
    alive_meta_version: U32 = 0
    alive_epoch: U64 = 0
    alive_signature: Signature | None = None
    certificate: CertificateBytes = b""  # its admission (security.admission.Certificate)
    left_signature: ElidedSignature = None  # its own goodbye, when it left


@message(20)
@dataclass(frozen=True, slots=True)
class SyncDigest:
    """Anti-entropy, step one: the hash of my view. Same hash: nothing to do."""

    source: NodeId
    digest: Digest
    count: U32


@message(21)
@dataclass(frozen=True, slots=True)
class SyncSame:
    pass


@message(22)
@dataclass(frozen=True, slots=True)
class SyncSummary:
    """Step two: one line per member; the asker then sends only what differs."""

    entries: Annotated[tuple[MemberSummary, ...], Items(MAX_MEMBERS_PER_MESSAGE)]


@message(23)
@dataclass(frozen=True, slots=True)
class SyncRecords:
    """Records the other side lacks, and the ids whose records I want back.

    ``want_all`` (a join) asks for every record the answerer holds.
    """

    source: NodeId
    records: Annotated[tuple[MemberRecord, ...], Items(MAX_MEMBERS_PER_MESSAGE)]
    want: Annotated[tuple[NodeId, ...], Items(MAX_MEMBERS_PER_MESSAGE)] = ()
    want_all: bool = False


@message(24)
@dataclass(frozen=True, slots=True)
class MetaPull:
    nodes: Annotated[tuple[NodeId, ...], Items(1024)]


@message(25)
@dataclass(frozen=True, slots=True)
class MetaPush:
    records: Annotated[tuple[MemberRecord, ...], Items(1024)]


@message(26)
@dataclass(frozen=True, slots=True)
class Noted:
    """A stream request was taken in (the reply to a pushed refutation)."""


# --- admission ---------------------------------------------------------------------------


@message(27)
@dataclass(frozen=True, slots=True)
class Revoked:
    """An admin-signed revocation (security.admission.Revocation), gossiped and kept."""

    revocation: Annotated[bytes, Size(1, 1024)]


@message(28)
@dataclass(frozen=True, slots=True)
class AdmitAsk:
    """A joiner holding an invitation asks for its certificate (over a stream)."""

    invitation: Annotated[bytes, Size(1, 4096)]
    public_key: PublicKey
    name: Name
    priority: I32 = 0  # the leader priority it would like (capped by the invitation)
    # the joiner's signature over its key, name and the time it asked: an issuer takes an
    # ask a seed relayed only with it, so no relay can swap in a key of its own
    asked_at_s: U64 = 0
    signature: Annotated[bytes, Size(0, 64), Elided()] = b""


@message(29)
@dataclass(frozen=True, slots=True)
class Admitted:
    certificate: CertificateBytes


@message(30)
@dataclass(frozen=True, slots=True)
class AdmitRefused:
    reason: Reason


MAX_CERTIFICATES_PER_MESSAGE = 4  # four certificates fit one datagram with room to spare


@message(40)
@dataclass(frozen=True, slots=True)
class CertificateAsk:
    """Please send me the admission certificates of ``nodes``: a relayed ``Alive`` of
    theirs came without one (relays leave it out; see membership.certificates)."""

    nodes: Annotated[tuple[NodeId, ...], Items(MAX_CERTIFICATES_PER_MESSAGE)]


@struct
@dataclass(frozen=True, slots=True)
class CertificateOf:
    node: NodeId
    certificate: Annotated[bytes, Size(1, 1024)]  # security.admission.Certificate


@message(41)
@dataclass(frozen=True, slots=True)
class Certificates:
    """The answer to a ``CertificateAsk``: what the sender holds of those asked for."""

    certificates: Annotated[tuple[CertificateOf, ...], Items(MAX_CERTIFICATES_PER_MESSAGE)]


# --- election ----------------------------------------------------------------------------


@message(50)
@dataclass(frozen=True, slots=True)
class LeaderBeat:
    """The leader to its deputies (and the answer to a ``LeaderCheck``)."""

    term: U64
    leader: NodeId
    seq: U32
    electorate: U32
    rank: U8  # the deputy's place in the succession (0 first); 255 for a check answer
    signature: Signature | None = None  # the leader's (security.ballots.beat_statement)


@message(51)
@dataclass(frozen=True, slots=True)
class LeaderCheck:
    """A voter asked to depose a leader first checks, itself, whether it answers."""

    term: U64
    seq: U32
    source: NodeId


@message(52)
@dataclass(frozen=True, slots=True)
class VoteRequest:
    term: U64  # the term the candidate would lead
    candidate: NodeId
    priority: I32
    electorate: U32  # how many fellows the candidate counts
    pre_vote: bool  # PreVote: 'would you?', changes nothing at the voter
    signature: Signature | None = None  # the candidate's (ballots.request_statement)


@message(53)
@dataclass(frozen=True, slots=True)
class VoteReply:
    term: U64
    voter: NodeId
    granted: bool
    pre_vote: bool
    electorate: U32
    reason: Reason = ""
    candidate: NodeId | None = None  # whom the answer is for (bound by the signature)
    # the voter's: a granted vote signs ``ballots.ballot_statement`` (it is a ballot of
    # the winner's proof), any other answer ``ballots.reply_statement``
    signature: Signature | None = None


@message(54)
@dataclass(frozen=True, slots=True)
class LeaderIs:
    """Announcement: ``leader`` leads ``term``, counting ``electorate`` fellows."""

    term: U64
    leader: NodeId
    electorate: U32


@message(55)
@dataclass(frozen=True, slots=True)
class LeaderQuery:
    """'Who leads?' from a fellow that knows no leader; answered with ``LeaderIs``."""

    term: U64
    source: NodeId


@message(56)
@dataclass(frozen=True, slots=True)
class StepDown:
    """The leader leaves or loses its majority: elect another now."""

    term: U64
    leader: NodeId
    electorate: U32
    signature: Signature | None = None  # the leader's (ballots.step_down_statement)


@message(57)
@dataclass(frozen=True, slots=True)
class LeaderAck:
    """A fellow got the leader's ``LeaderIs``; the leader stops resending it there. Signed,
    it is also a ballot: ``source`` follows ``leader`` in ``term`` (having checked its
    proof), and the leader adds it to the proof it shows fellows that arrive later."""

    term: U64
    source: NodeId
    leader: NodeId | None = None
    signature: Signature | None = None  # the source's ``ballots.ballot_statement``


MAX_PROOF_BALLOTS = 12  # ballots in one LeaderProof datagram (it fits one MTU)


@struct
@dataclass(frozen=True, slots=True)
class Ballot:
    """``voter`` backs the leader of a term: its signature over the ballot statement."""

    voter: NodeId
    signature: Signature


@message(58)
@dataclass(frozen=True, slots=True)
class LeaderProof:
    """Part of the proof that ``leader`` was elected for ``term``: ballots of a majority
    (granted votes, and signed ``LeaderAck``s of fellows that checked an earlier proof).
    The leader sends it with its ``LeaderIs`` to fellows that have not acked yet; it is
    self-certifying, so whoever relays it need not be trusted."""

    term: U64
    leader: NodeId
    ballots: Annotated[tuple[Ballot, ...], Items(MAX_PROOF_BALLOTS)]


def is_election(msg: Any) -> bool:
    """Whether a decoded message belongs to the election (else to membership)."""
    return isinstance(msg, _ELECTION_TYPES)


_ELECTION_TYPES = (LeaderBeat, LeaderCheck, VoteRequest, VoteReply, LeaderIs, LeaderQuery,
                   StepDown, LeaderAck, LeaderProof)

__all__ = [
    "ELECTION_TAGS",
    "MAX_CERTIFICATES_PER_MESSAGE",
    "MAX_PROOF_BALLOTS",
    "MEMBERSHIP_TAGS",
    "STATE_ALIVE",
    "STATE_DEAD",
    "STATE_LEFT",
    "STATE_SUSPECT",
    "Ack",
    "AdmitAsk",
    "AdmitRefused",
    "Admitted",
    "Alive",
    "Ballot",
    "CertificateAsk",
    "CertificateOf",
    "Certificates",
    "Dead",
    "LeaderAck",
    "LeaderBeat",
    "LeaderCheck",
    "LeaderIs",
    "LeaderProof",
    "LeaderQuery",
    "Left",
    "MemberRecord",
    "MemberSummary",
    "MetaPull",
    "MetaPush",
    "Nack",
    "Noted",
    "Ping",
    "PingReq",
    "Revoked",
    "StepDown",
    "Suspect",
    "SyncDigest",
    "SyncRecords",
    "SyncSame",
    "SyncSummary",
    "VoteReply",
    "VoteRequest",
    "is_election",
]
