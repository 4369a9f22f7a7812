"""What the roles (candidacy, voting, leading, following) use of the election machine
they are part of, as one Protocol: the machine's shared state (term, vote, role, leader),
its leaves (electorate, health, proofs), the other roles they hand over to, and the few
transitions only the machine makes. The role modules import this leaf, never the
machine, so the machine imports its roles and nothing imports back."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from p2pswarm.config import ElectionConfig, ElectionTuning
    from p2pswarm.effects import Effect
    from p2pswarm.election.electorate import Electorate
    from p2pswarm.election.health import Health
    from p2pswarm.election.proofs import Proofs
    from p2pswarm.randomness import Rng
    from p2pswarm.wire.gossip import LeaderIs, VoteRequest


class CandidacyRole(Protocol):
    """The candidacy, as another role starts it."""

    def start(self, pre: bool, now: float, out: list[Effect]) -> None: ...


class VotingRole(Protocol):
    """The voter, as a follower answers a vote request it held back."""

    def answer_vote(self, msg: VoteRequest, addr: str, now: float, *,
                    leader_alive: bool) -> list[Effect]: ...


class LeadingRole(Protocol):
    """The leader's duties, as the voter and the follower consult them."""

    def note_ahead(self, msg: VoteRequest, now: float, out: list[Effect]) -> None: ...

    def restand(self, seen: int, now: float, out: list[Effect], why: str) -> None: ...

    def proof_short(self) -> bool: ...


class ElectionPort(Protocol):
    """The machine as its roles see it (``machine.Election`` is the one there is)."""

    term: int
    voted_term: int
    voted_for: bytes | None
    role: str
    leader: bytes | None
    stats: dict[str, int]
    # the machine's timers, shared by the roles (private to the package)
    _election_at: float
    _settle_until: float

    # what the roles read and never replace (properties: a role may be a subtype)
    @property
    def node_id(self) -> bytes: ...

    @property
    def config(self) -> ElectionConfig: ...

    @property
    def tuning(self) -> ElectionTuning: ...

    @property
    def rng(self) -> Rng: ...

    @property
    def priority(self) -> int: ...

    @property
    def _electorate(self) -> Electorate: ...

    @property
    def _health(self) -> Health: ...

    @property
    def _proofs(self) -> Proofs: ...

    @property
    def _candidacy(self) -> CandidacyRole: ...

    @property
    def _voting(self) -> VotingRole: ...

    @property
    def _leading(self) -> LeadingRole: ...

    def electorate(self) -> int: ...

    def present(self) -> int: ...

    def settled(self, now: float) -> bool: ...

    def _leader_is(self) -> LeaderIs: ...

    def _tell_leader(self, addr: str, node: bytes | None, out: list[Effect],
                     *also: Any) -> None: ...

    def _leader_gone(self) -> bool: ...

    def _rank_delay(self) -> float: ...

    def _reconsider(self, now: float) -> None: ...

    def _become_leader(self, now: float, out: list[Effect]) -> None: ...

    def _become_follower(self, now: float, out: list[Effect], why: str) -> None: ...

    def _adopt_term(self, term: int, now: float, out: list[Effect]) -> None: ...
