"""A fellow holding the token tries to lead without votes, forge votes, run the term out
and give orders; live agents in virtual time refuse all of it, count it, and carry on."""

from __future__ import annotations

import random

import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p2pswarm import wire
from p2pswarm.agent import Agent
from p2pswarm.agent.agent import fellow_signed
from p2pswarm.agent.training.checkpoints import MANIFEST
from p2pswarm.agent.training.stage_host import TrainHost
from p2pswarm.config import ElectionConfig
from p2pswarm.election import LEADER_ROLE, MAX_TERM_STEP, Election
from p2pswarm.membership import Member
from p2pswarm.security import Identity
from p2pswarm.security.ballots import Signatures, ballot_statement, request_statement
from p2pswarm.sim.virtual import VirtualSwarm, wait_until
from p2pswarm.wire import gossip as g
from p2pswarm.wire import message_types
from p2pswarm.wire.jobs import JobKeep, TrainPrepare, TrainRelease
from p2pswarm.wire.loads import StageLoad, StageRelease
from p2pswarm.wire.orders import CallFailed
from p2pswarm.wire.training import TrainError, TrainOpen, TrainShard
from tests.adversary.rogue import MAX_TERM_U64, Rogue, rogue_factory
from tests.wire_strategies import for_class

N, ROGUE = 5, 4  # four honest fellows and the rogue


def refused(agent: Agent) -> dict[str, int]:
    return agent.status()["counters"]["refused"]


def total_refused(rogue: Rogue, reason: str) -> int:
    return sum(refused(a).get(reason, 0) for a in rogue.honest())


def led_by(rogue: Rogue) -> set[tuple[bytes | None, int]]:
    return {(a.election.status().leader_id, a.election.term) for a in rogue.honest()
            if a.election is not None}


def all_alive(swarm: VirtualSwarm) -> bool:
    return all(f.agent is not None and not f.agent.stopped.is_set()
               and f.agent.failure is None for f in swarm.fellows)


async def led_swarm(nursery: trio.Nursery, seed: int
                    ) -> tuple[VirtualSwarm, Rogue, bytes, int]:
    """The swarm with its rogue, run in ``nursery`` and started, once every honest fellow
    follows one honest leader: with that leader and its term."""
    swarm = VirtualSwarm(N, seed=seed, agent_factory=rogue_factory(ROGUE))
    rogue = Rogue(swarm, ROGUE)
    await nursery.start(swarm.run)
    await swarm.start_all()
    await wait_until(lambda: len(led_by(rogue)) == 1 and None not in
                     {lid for lid, _ in led_by(rogue)}, timeout_s=60)
    ((leader, term),) = led_by(rogue)
    assert leader != rogue.node_id
    return swarm, rogue, leader, term


async def test_a_rogue_cannot_announce_itself_or_forge_a_proof(autojump_clock) -> None:
    async with trio.open_nursery() as nursery:
        swarm, rogue, leader, term = await led_swarm(nursery, 3)
        for t in (term, term + 1, term + 5, term + 1000, MAX_TERM_U64):
            rogue.announce_itself(t)
            rogue.claim_with_forged_proof(t)
            await trio.sleep(2)
        await trio.sleep(10)
        # the same leader; its own "proof" of a later term can make the leader stand
        # again above it, once in 240 s (docs/election.md): no more than that
        ((still, now_term),) = led_by(rogue)
        assert still == leader and now_term <= term + MAX_TERM_STEP + 1
        assert sum(a.election.stats.get("restands", 0) for a in rogue.honest()) <= 1
        assert all(a.election.role != LEADER_ROLE for a in rogue.honest()
                   if a.node_id != leader)
        assert total_refused(rogue, "election-unproven-leader") > 0
        assert total_refused(rogue, "election-bad-signature") > 0
        assert all_alive(swarm)
        nursery.cancel_scope.cancel()


async def test_a_rogue_cannot_run_the_term_out_or_depose_the_leader(autojump_clock) -> None:
    async with trio.open_nursery() as nursery:
        swarm, rogue, leader, term = await led_swarm(nursery, 4)
        for t in (MAX_TERM_U64, MAX_TERM_U64 - 1, term + MAX_TERM_STEP + 1, term + 10**9):
            rogue.push_term(t, pre_vote=True)
            rogue.push_term(t)
        for t in range(term + 1, term + MAX_TERM_STEP + 1):  # within the step: a live leader
            rogue.push_term(t)
        rogue.depose(leader, term)
        await trio.sleep(15)
        assert led_by(rogue) == {(leader, term)}
        assert total_refused(rogue, "election-term-too-far") >= 4 * 4
        assert total_refused(rogue, "election-vote-while-led") > 0
        assert total_refused(rogue, "election-bad-signature") > 0  # the forged step-down
        assert all_alive(swarm)
        nursery.cancel_scope.cancel()


async def test_orders_and_pushes_from_a_fellow_not_leading_are_refused(autojump_clock) -> None:
    async with trio.open_nursery() as nursery:
        swarm, rogue, leader, term = await led_swarm(nursery, 5)
        victim = next(a for a in rogue.honest() if a.node_id != leader)
        before = refused(victim).get("order-not-from-leader", 0)
        for order in (StageRelease("0123456789abcdef", term), StageLoad("0123456789abcdef", 0,
                                                                         term),
                      TrainRelease("job-1", None, None, term)):
            reply = await rogue.order(victim.addr, order)
            assert isinstance(reply, CallFailed) and "only the leader" in reply.text
        keep = JobKeep("job-1", 1, b"\x80", (), "", term)
        assert isinstance(await rogue.order(victim.addr, keep), CallFailed)
        shard = TrainShard("job-1", 1, MANIFEST, "0" * 64, 0, 3, b"abc")
        answer = await rogue.push(victim.addr, shard)
        assert isinstance(answer, TrainError) and "only the leader" in answer.reason
        assert not (victim.training.copies.root / "job-1").exists()
        answer = await rogue.push(victim.addr, TrainOpen("job-1", 0, 0, "control"))
        assert isinstance(answer, TrainError)
        assert refused(victim).get("order-not-from-leader", 0) - before >= 5
        assert led_by(rogue) == {(leader, term)}
        assert all_alive(swarm)
        nursery.cancel_scope.cancel()


async def test_only_the_previous_stage_feeds_a_training_stage(autojump_clock) -> None:
    """A stage's data stream (activations in, gradients out) is taken only from the fellow
    the leader placed on the stage before it."""
    async with trio.open_nursery() as nursery:
        swarm, rogue, leader, term = await led_swarm(nursery, 7)
        upstream, victim = [a for a in rogue.honest() if a.node_id != leader][:2]
        order = TrainPrepare("job-1", 0, 1, 2, victim.node_id.hex(), 2, 4, "cpu", 0, 0, "",
                             b"\x80", 0, term, prev_fellow=upstream.node_id.hex())
        host = TrainHost(order, None, None)  # type: ignore[arg-type]  # no compute needed
        victim.training.stages.hosts[host.key] = host
        answer = await rogue.push(victim.addr, TrainOpen("job-1", 0, 1, "data"))
        assert isinstance(answer, TrainError) and "previous stage" in answer.reason
        assert host.upstream is None
        assert refused(victim)["train-data-not-from-upstream"] == 1
        async with await upstream.open_secure(victim.addr) as stream:
            await stream.send_frame(wire.encode(TrainOpen("job-1", 0, 1, "data")))
            await wait_until(lambda: host.upstream is not None, timeout_s=5)
        assert refused(victim)["train-data-not-from-upstream"] == 1
        host.done.set()
        nursery.cancel_scope.cancel()


async def test_the_leader_orders_in_its_term_only(autojump_clock) -> None:
    """The seam itself: the leader's identity with a stale or future term is refused too."""
    async with trio.open_nursery() as nursery:
        swarm, rogue, leader, term = await led_swarm(nursery, 6)
        boss = next(a for a in rogue.honest() if a.node_id == leader)
        victim = next(a for a in rogue.honest() if a.node_id != leader)
        for t in (term - 1, term + 1):
            reply = await boss.call(victim.addr, StageRelease("0123456789abcdef", t))
            assert isinstance(reply, CallFailed) and f"of term {t} refused" in reply.text
        reply = await boss.call(victim.addr, StageRelease("0123456789abcdef", term))
        assert not isinstance(reply, CallFailed)
        assert refused(victim)["order-stale-term"] == 2
        nursery.cancel_scope.cancel()


# --- the machine alone, with real signatures ---------------------------------------------

IDENTITIES = [Identity.from_private_bytes(bytes([i + 1]) * 32) for i in range(5)]
IDS = [i.node_id for i in IDENTITIES]
ME, LEADER, ROGUE_ID = 0, 1, 4
SIGNED = ElectionConfig()


def member(i: int) -> Member:
    return Member(IDS[i], f"n{i}", f"10.0.0.{i}:7946", "alive", 0, b"", 0, 0, None, 0.0, 0,
                  IDENTITIES[i].public_key, is_self=i == ME)


def signed_election(term: int = 3) -> Election:
    """Fellow 0 following fellow 1 in ``term``, having checked fellow 1's proof."""
    e = Election(IDS[ME], "n0", SIGNED, random.Random(0),
                 signatures=Signatures(IDENTITIES[ME].sign, fellow_signed))
    e.update_members([member(i) for i in range(5)], 0.0)
    ballots = tuple(g.Ballot(IDS[i], IDENTITIES[i].sign(ballot_statement(term, IDS[LEADER],
                                                                          IDS[i])))
                    for i in (1, 2, 3))
    e.handle(g.LeaderIs(term, IDS[LEADER], 5), member(LEADER).addr, 10.0)
    assert e.status().leader_id is None  # no proof yet: not followed
    e.handle(g.LeaderProof(term, IDS[LEADER], ballots), member(LEADER).addr, 10.1)
    assert e.status().leader_id == IDS[LEADER] and e.term == term
    return e


def test_forged_votes_do_not_elect_a_candidate() -> None:
    e = Election(IDS[ME], "n0", ElectionConfig(), random.Random(1),
                 signatures=Signatures(IDENTITIES[ME].sign, fellow_signed))
    e.update_members([member(i) for i in range(5)], 0.0)
    while e.role != "candidate":  # settled, no leader: it runs (PreVote first)
        deadline = e.next_deadline()
        assert deadline is not None
        e.tick(deadline)
    term = e.term + 1
    for voter in (1, 2, 3):  # 'from' others: the rogue's key, garbage, none at all
        for sig in (IDENTITIES[ROGUE_ID].sign(ballot_statement(term, IDS[ME], IDS[voter])),
                    bytes(64), None):
            for pre in (True, False):
                e.handle(g.VoteReply(term, IDS[voter], True, pre, 5, "", IDS[ME], sig),
                         "10.0.0.4:7946", deadline)
    assert e.role != LEADER_ROLE and e.term == 0  # not even past its PreVote
    # the PreVote answers checked and refused (real ones are not even looked at yet)
    assert e.refused["bad-signature"] == 6 and e.refused["unsigned"] == 3


def test_a_proof_needs_a_majority_of_the_checkers_electorate() -> None:
    e = signed_election()
    rogue = IDENTITIES[ROGUE_ID]
    own = g.Ballot(IDS[ROGUE_ID], rogue.sign(ballot_statement(9, IDS[ROGUE_ID], IDS[ROGUE_ID])))
    two = g.Ballot(IDS[2], IDENTITIES[2].sign(ballot_statement(9, IDS[ROGUE_ID], IDS[2])))
    e.handle(g.LeaderIs(9, IDS[ROGUE_ID], 1), "10.0.0.4:7946", 20.0)
    e.handle(g.LeaderProof(9, IDS[ROGUE_ID], (own, two)), "10.0.0.4:7946", 20.1)
    assert e.status().leader_id == IDS[LEADER] and e.term == 3  # 2 of 5: no proof
    three = g.Ballot(IDS[3], IDENTITIES[3].sign(ballot_statement(9, IDS[ROGUE_ID], IDS[3])))
    e.handle(g.LeaderProof(9, IDS[ROGUE_ID], (three,)), "10.0.0.4:7946", 20.2)
    assert e.status().leader_id == IDS[ROGUE_ID] and e.term == 9  # 3 of 5 backed it: earned


def test_a_vote_request_far_ahead_is_refused_and_changes_nothing() -> None:
    e = signed_election()
    rogue = IDENTITIES[ROGUE_ID]
    for t in (3 + MAX_TERM_STEP + 1, MAX_TERM_U64):
        req = g.VoteRequest(t, IDS[ROGUE_ID], 0, 1, False,
                            rogue.sign(request_statement(t, IDS[ROGUE_ID], False)))
        out = e.handle(req, "10.0.0.4:7946", 30.0)
        (reply,) = [m for x in out for m in x.messages if isinstance(m, g.VoteReply)]
        assert not reply.granted and reply.reason == "term too far ahead"
    assert e.term == 3 and e.status().leader_id == IDS[LEADER]
    assert e.refused["term-too-far"] == 2


# --- the property: any insider sequence, no escape, no leader without a majority ---------

_TERMS = st.sampled_from([0, 2, 3, 4, 3 + MAX_TERM_STEP, 3 + MAX_TERM_STEP + 1, 2**62,
                          2**64 - 1])
_NODES = st.sampled_from(IDS + [bytes(16)])
_SIGS = st.sampled_from(["rogue", "garbage", "none"])


@st.composite
def insider_messages(draw: st.DrawFn) -> tuple[object, str]:
    """A schema-valid election message with hostile values, signed (if at all) by the
    rogue, the only key it has."""
    term, node, how = draw(_TERMS), draw(_NODES), draw(_SIGS)
    kind = draw(st.sampled_from(["beat", "check", "request", "reply", "is", "query", "step",
                                 "ack", "proof"]))
    seq, rank, pre = draw(st.integers(0, 2**32 - 1)), draw(st.integers(0, 255)), \
        draw(st.booleans())
    sig = {"rogue": IDENTITIES[ROGUE_ID].sign(ballot_statement(term, node, node)),
           "garbage": draw(st.binary(min_size=64, max_size=64)), "none": None}[how]
    if how == "rogue" and kind == "request" and node == IDS[ROGUE_ID]:
        sig = IDENTITIES[ROGUE_ID].sign(request_statement(term, node, pre))
    msg: object = {
        "beat": lambda: g.LeaderBeat(term, node, seq, 1, rank, sig),
        "check": lambda: g.LeaderCheck(term, seq, node),
        "request": lambda: g.VoteRequest(term, node, 2**31 - 1, 1, pre, sig),
        "reply": lambda: g.VoteReply(term, node, True, pre, 2**32 - 1, "", IDS[ME], sig),
        "is": lambda: g.LeaderIs(term, node, 1),
        "query": lambda: g.LeaderQuery(term, node),
        "step": lambda: g.StepDown(term, node, 1, sig),
        "ack": lambda: g.LeaderAck(term, node, node, sig),
        "proof": lambda: g.LeaderProof(term, node, tuple(
            g.Ballot(v, sig or bytes(64)) for v in draw(st.lists(_NODES, max_size=12)))),
    }[kind]()
    return msg, draw(st.sampled_from(["10.0.0.4:7946", "10.0.0.1:7946", "6.6.6.6:1"]))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(insider_messages(), st.floats(0.0, 5.0)), max_size=40))
def test_insider_sequences_never_escape_nor_move_the_leader(sequence) -> None:
    e = signed_election()
    now = 10.0
    for (msg, addr), dt in sequence:
        now += dt
        e.handle(msg, addr, now)
        e.tick(now)
        status = e.status()
        # fellows 1-3 signed nothing but fellow 1's proof for term 3: no other leader can
        # be proven, and this fellow cannot win with its own and the rogue's votes
        assert status.leader_id in (IDS[LEADER], None)
        assert e.role != LEADER_ROLE
        assert e.term <= 3 + MAX_TERM_STEP * len(sequence)


_ANY_ELECTION_MESSAGE = st.one_of(*(for_class(cls) for tag, cls in message_types().items()
                                    if tag in g.ELECTION_TAGS))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(_ANY_ELECTION_MESSAGE, st.sampled_from(
    ["10.0.0.4:7946", "10.0.0.1:7946"]), st.floats(0.0, 3.0)), max_size=30))
def test_any_schema_valid_election_message_is_taken_without_escape(sequence) -> None:
    """Every field anywhere in its range (wire_strategies): nothing escapes, and nothing
    unsigned by fellows 1-3 moves the leader."""
    e = signed_election()
    now = 10.0
    for msg, addr, dt in sequence:
        now += dt
        e.handle(msg, addr, now)
        e.tick(now)
        assert e.status().leader_id in (IDS[LEADER], None) and e.role != LEADER_ROLE


def test_forged_proofs_cost_a_bounded_number_of_signature_checks() -> None:
    e = signed_election()
    garbage = tuple(g.Ballot(IDS[i], bytes([i]) * 64) for i in (2, 3, 4))
    for t in range(4, 4 + 1000):  # a thousand forged proofs in one instant, each new
        e.handle(g.LeaderProof(t, IDS[ROGUE_ID], garbage), "10.0.0.4:7946", 50.0)
    budget = 2 * (5 + 16)
    assert e.refused["bad-signature"] == budget
    assert e.refused["ballot-checks-spent"] > 900
    e.handle(g.LeaderProof(5000, IDS[ROGUE_ID], garbage), "10.0.0.4:7946", 51.0)
    assert e.refused["bad-signature"] == budget + 3  # a second later: refilled
    assert e.status().leader_id == IDS[LEADER]


def test_a_flood_of_signed_requests_spends_only_its_senders_budget() -> None:
    e = signed_election()
    rogue = IDENTITIES[ROGUE_ID]
    req = g.VoteRequest(4, IDS[ROGUE_ID], 0, 1, True,
                        rogue.sign(request_statement(4, IDS[ROGUE_ID], True)))
    answered = sum(1 for _ in range(500) if e.handle(req, "10.0.0.4:7946", 60.0))
    assert answered <= 2 * 16 and e.refused["signature-checks-spent"] >= 500 - 2 * 16
    honest = g.VoteRequest(4, IDS[2], 0, 5, True,
                           IDENTITIES[2].sign(request_statement(4, IDS[2], True)))
    spent = e.refused["signature-checks-spent"]
    e.handle(honest, member(2).addr, 60.0)
    assert e.refused["signature-checks-spent"] == spent  # checked: its own budget
    answers = [x for x in e.tick(70.0) if isinstance(x.messages[0], g.VoteReply)]
    assert member(2).addr in {x.addr for x in answers}  # (after checking the leader)
