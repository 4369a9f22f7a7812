"""Proofs: leadership is earned with signed ballots.

The token only says a datagram came from some fellow, not which one, so every message
that speaks for a fellow is signed by its identity (``security.ballots``). A fellow
follows a leader only once it holds ballots for that term and leader from more than half
of its own electorate; a leader keeps the ballots it was given (votes, and the signed
acks of fellows that checked an earlier proof) and shows them (``LeaderProof``).
Signature checks are budgeted per (signer, address) and ballot checks per address, so a
flood of forged datagrams costs a bounded slice of CPU. The address a message came from
and the time are arguments: nothing here is the machine's per-message context."""

from __future__ import annotations

from p2pswarm.election.constants import CHECKS_PER_S, INF, PROOF_ASK_EVERY_S
from p2pswarm.election.electorate import Electorate
from p2pswarm.security.ballots import CheckBudget, ProofTally, Signatures
from p2pswarm.wire.gossip import MAX_PROOF_BALLOTS, Ballot, LeaderProof


class Proofs:
    """Signing and checking, the ballots checked for leaders we were shown (``tally``),
    and, as the leader, our own ballots (``ballots``) and who acked them (``acked``)."""

    def __init__(self, electorate: Electorate, signatures: Signatures | None) -> None:
        self.sig = signatures  # None: a lab without identities (unsigned, unproven)
        self._electorate = electorate
        self.tally = ProofTally()  # ballots checked for leaders we were shown
        self.ballots: dict[bytes, bytes] = {}  # as leader: voter -> ballot signature
        self.acked: dict[bytes, None] = {}  # as leader: fellows that acked with a ballot
        self._cache: tuple[tuple[int, int, int], list[LeaderProof]] | None = None
        self._asked: dict[tuple[int, bytes], float] = {}
        self.shown: tuple[int, bytes] | None = None  # a leader we were told of, unproven
        # as a leader: (term, leader, since) of a later leader whose proof falls short here
        self.short: tuple[int, bytes, float] | None = None
        self._budget = CheckBudget()  # signature checks per (signer, address)
        # what a fellow sent that was refused, by reason (agent status shows them)
        self.refused: dict[str, int] = {}

    def refuse(self, reason: str) -> None:
        self.refused[reason] = self.refused.get(reason, 0) + 1

    # --- signatures ----------------------------------------------------------------------

    def sign(self, statement: bytes) -> bytes | None:
        return self.sig.sign(statement) if self.sig is not None else None

    def signed_by(self, node: bytes, signature: bytes | None, statement: bytes,
                  addr: str, now: float) -> bool:
        """Whether ``node`` (a fellow we know, with its key) signed ``statement``, sent
        from ``addr`` at ``now``; always, unsigned. A refusal is counted by reason."""
        if self.sig is None:
            return True
        m = self._electorate.members.get(node)
        if signature is None:
            self.refuse("unsigned")
            return False
        if m is None or not m.public_key:
            self.refuse("unknown-signer")
            return False
        if not self._budget.take((node, addr), now, CHECKS_PER_S, 2 * CHECKS_PER_S):
            self.refuse("signature-checks-spent")
            return False
        if not self.sig.verify(node, m.public_key, signature, statement):
            self.refuse("bad-signature")
            return False
        return True

    def may_check(self, addr: str, now: float) -> bool:
        """Ballot checks are budgeted per sending address: twice the electorate at once,
        refilled at the electorate a second (a new leader's proof, and a second one, pass
        at once), so proofs forged by the datagram cost a bounded slice of CPU."""
        total = len(self._electorate.voters) + 16
        if self._budget.take(("proof", addr), now, total, 2.0 * total):
            return True
        self.refuse("ballot-checks-spent")
        return False

    # --- counting ------------------------------------------------------------------------

    def majority(self, term: int, leader: bytes) -> bool:
        """Checked ballots for (term, leader) from more than half of our electorate."""
        voters = self._electorate.voters
        return 2 * self.tally.count(term, leader, voters) > len(voters)

    def ours_short(self) -> bool:
        """Our own ballots (as the leader) are no majority of our electorate."""
        voters = self._electorate.voters
        return 2 * sum(1 for v in self.ballots if v in voters) <= len(voters)

    def short_for_long(self, term: int, leader: bytes, now: float) -> bool:
        """Whether (term, leader)'s checked ballots have fallen short of a majority of our
        electorate for ``PROOF_ASK_EVERY_S`` already, we having asked it for its proof
        meanwhile. A new leader's first proof holds only the votes that elected it, a
        majority of *its* electorate; ours may count a fellow or two more during churn
        (a leave or an expiry we have not heard of yet, our loop running late), and its
        followers' acks make the proof whole a round trip later. Only a proof that stays
        short is a side that cannot prove itself here (a partition healed after the
        electorate's bound), which is what ``Leading.restand`` is for."""
        if self.short is None or self.short[:2] != (term, leader):
            self.short = (term, leader, now)
            return False
        return now >= self.short[2] + PROOF_ASK_EVERY_S

    def may_ask(self, term: int, leader: bytes, now: float) -> bool:
        """Whether to ask ``leader`` for its proof of ``term`` now (at most once a
        ``PROOF_ASK_EVERY_S``); if so, noted as asked."""
        key = (term, leader)
        if now < self._asked.get(key, -INF) + PROOF_ASK_EVERY_S:
            return False
        self._asked[key] = now
        while len(self._asked) > 8:
            del self._asked[next(iter(self._asked))]
        return True

    # --- as the leader -------------------------------------------------------------------

    def lead(self, ballots: dict[bytes, bytes]) -> None:
        """Elected with ``ballots``: our proof starts from them."""
        self.ballots = ballots
        self.acked = {}
        self._cache = None

    def parts(self, term: int, node_id: bytes) -> list[LeaderProof]:
        """Our ballots as a proof: enough of them for a majority of our electorate and a
        margin (fellows count slightly different electorates), present fellows first."""
        electorate = self._electorate
        total = electorate.size()
        key = (term, len(self.ballots), total)
        if self._cache is not None and self._cache[0] == key:
            return self._cache[1]
        need = total // 2 + 1 + max(2, total // 8)
        voters = sorted((v for v in self.ballots if v in electorate.voters),
                        key=lambda v: (not electorate.is_present(v) and v != node_id, v))
        ballots = [Ballot(v, self.ballots[v]) for v in voters[:need]]
        parts = [LeaderProof(term, node_id, tuple(ballots[i:i + MAX_PROOF_BALLOTS]))
                 for i in range(0, len(ballots), MAX_PROOF_BALLOTS)]
        self._cache = (key, parts)
        return parts


__all__ = ["Proofs"]
