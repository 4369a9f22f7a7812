"""Leader election: terms, PreVote, deputies and a lease, as a sans-I/O state machine.

Theory of operation.

Terms and votes (Raft). Time is cut into terms; a candidate for term t needs votes from
more than half of the electorate, and every node votes at most once per term (``term``
and ``voted_for`` are the state to persist), so a term has at most one leader. Every
election message carries its term; a node that sees a newer term adopts it, and orders
carrying an older term are refused (``accepts_term``).

PreVote. Before it raises its term, a would-be candidate asks "would you vote for me in
t + 1?". Nothing changes at a voter for a PreVote, and a voter says yes only if it has no
live leader itself. So a fellow coming back from a partition, or one whose own radio is
flapping, cannot bump the term and depose a healthy leader: it never gets past PreVote.

Who notices a dead leader, and fast. The leader sends a small beat every heartbeat
interval to its deputies only: the first few fellows in the order of succession (highest
``leader_priority`` first, then node id). A deputy that has missed beats for the election
timeout (plus its rank times a spacing, so the first in line goes first) asks for
PreVotes. A voter that still sees the leader alive in membership does not take the
deputy's word for it: it sends the leader a ``LeaderCheck`` itself and grants only if no
answer comes within the check timeout. Leadership therefore moves only when the leader is
dead or gone according to membership, or when a majority independently cannot reach it,
i.e. its lease truly lapsed; never because a datagram or two were lost. Any fellow (not
only deputies) starts an election when membership declares the leader dead or left, or
when it knows no leader at all.

The electorate (the denominator of "majority"). Each node keeps the set of fellows it has
seen present (alive or suspect), itself included, with when it last saw each. A fellow
that leaves gracefully leaves the set at once; a fellow that is dead (or reaped) stays in
it for ``electorate_dead_after_s`` after it was last seen, then leaves it too. The set is
kept across restarts with the vote, and a restored entry counts as seen at the restart: a
fellow restarted while the others are down would otherwise be a majority of one. So a
minority side, e.g. 2 of 5 after a partition, cannot elect while the other 3 are recent:
"no leader: this side sees 2 of 5 fellows"; and a swarm whose fellows come and go always
has a leader once a majority of its recently live fellows is up. The price of the bound:
a partition that outlasts it lets each side, having dropped the other, elect its own
leader; when they meet again the order of succession decides which one stays (see
docs/election.md).

Settling. A fellow that has just joined (or founded, or restarted) neither runs nor
votes for ``settle_s`` unless it learns of a leader first: it asks around (``LeaderQuery``)
and waits for the fellows knocking at its door. So a seed started after its joiners, or
a whole swarm restarted at once, forms one electorate before anyone counts votes, and a
fellow that has never seen the swarm cannot win a term alone while others are arriving.

Local health (Lifeguard's, for the election). A fellow whose CPU is starved wakes late:
its timers ring while the leader's beats and answers still wait in its socket. The driver
tells it how late each timer rang (``note_lag``), and a deputy's wait for beats and a
voter's wait for its check stretch by ``lag_stretch_mult`` times the larger of its own
recent lateness and how late its leader's beats have come beyond one lost beat, by at
most ``lag_stretch_max_s``, fading with ``lag_half_life_s`` (``stretch``). So a fellow
does not blame the leader for its own lateness, a starved leader is waited for, and a
crashed one is still replaced within seconds. In virtual time timers ring on time: 0.

The lease. A leader that sees no majority present (alive or suspect) for
``leader_lease_s`` steps down on its own; and at once when the present fellows that may
still follow it are no majority because the others' own signed vote requests showed them
in a later term (``Leading.deposed``: a leader thawed from a freeze after its successor
died).

Priority. The order of succession puts a higher ``leader_priority`` first, so a wired,
always-on machine is the first deputy and wins the elections it runs; candidates that
lose a round try again in that order, a rank apart, so rounds do not keep splitting. A
leader that sees a fellow of higher priority alive for ``handover_after_s`` hands over
on purpose (``StepDown``): a planned change, never one caused by loss.

Announcements. A new leader sends ``LeaderIs`` to every present fellow at once, again a
few times shortly after (datagrams get lost), and every ``announce_interval_s``; a fellow
that knows no leader asks a random fellow with ``LeaderQuery``.

Proofs (leadership is earned). The token only says a datagram came from some fellow, not
which one, so every message that speaks for a fellow is signed by its identity over a
statement binding what it says (``security.ballots``): vote requests, every vote answer,
beats, step-downs, and the acks followers send. A fellow follows a leader only once it
holds a proof for that term and leader: signed ballots from more than half of its *own*
electorate (granted votes, and signed acks of fellows that checked an earlier proof, so
the proof grows with the swarm and fellows that arrive later can check it too). The
leader sends its proof (``LeaderProof``, a dozen ballots a datagram) with its
``LeaderIs`` to every fellow that has not acked it yet; a fellow shown a leader without
one asks that leader (``LeaderQuery``). So a fellow holding the token cannot announce
itself: its own ballot is one of an electorate of at least two. A fellow that follows no
live leader and whose own ballot is all a proof lacks (restarted, it still counts fellows
that left while it was down) gives that leader its vote in that term, once, and counts
it (``Following.vote_to_follow``). When sides meet after a partition longer than the electorate's
bound, a leader whose ballots are no longer a majority gives way to one whose are; a
proven leader shown a later term it cannot follow (its proof still short a second later,
asked for again meanwhile: a new leader's first proof is only a majority of its own
electorate until its followers' acks are in) stands again above it (``Leading.restand``), so
both sides end up behind one proof. So does a proven leader asked for a PreVote by a
fellow in a later term (one whose candidacy above the leader failed): that fellow can
never follow a leader of an earlier term.

Terms move by little. A vote request more than ``MAX_TERM_STEP`` above this fellow's
term is refused; a real (not Pre-) vote request for a higher term is taken only by a
fellow with no live leader, that granted that candidate's PreVote for that term, or from
its own leader standing again (below); a leader takes none. Only a proof moves a term
further at once. So a fellow holding the token can neither depose a live leader with one
request nor push the term towards 2^64 - 1: each step costs a message, and a live leader
stops them all. Terms past
``MAX_TERM`` are refused everywhere (and in ``election.json``).

Modules, leaves first: ``constants`` (bounds and role names), ``electorate`` (who votes,
majorities, the succession), ``health`` (the leader's liveness as this fellow sees it:
beats, checks, its own lag), ``proofs`` (signatures, ballots, the tally and the checks'
budget), ``candidacy`` and ``leading`` (each role's own state), and ``machine``
(``Election``: the transitions between roles and the table of the messages each role
answers).
"""

from p2pswarm.election.constants import (
    CANDIDATE,
    FOLLOWER,
    LEADER_ROLE,
    MAX_TERM,
    MAX_TERM_STEP,
    MAX_VOTERS,
)
from p2pswarm.election.machine import Election, ElectionStatus

__all__ = [
    "CANDIDATE",
    "FOLLOWER",
    "LEADER_ROLE",
    "MAX_TERM",
    "MAX_TERM_STEP",
    "MAX_VOTERS",
    "Election",
    "ElectionStatus",
]
