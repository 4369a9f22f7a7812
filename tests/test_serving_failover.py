"""Failover in virtual time: a stage whose fellow is lost mid-generation moves to the spare
fellow and the generation goes on with the tokens an undisturbed run gives; a fellow cut
off for less than the grace window keeps its stage, and a sampled generation resumed
across the cut draws the undisturbed run's tokens. The stages that kept the session's
cache do not replay it (positions each stage computed are counted)."""

from __future__ import annotations

import pytest
import trio

from p2pswarm.agent.serving.moves import spare_cards
from p2pswarm.errors import PlacementError
from p2pswarm.planner.cluster import cluster_view, fellow_view
from p2pswarm.runtime import Sampler
from p2pswarm.sim.virtual import wait_until
from tests.serving_swarm import MODEL, PROMPT, crashing_after, reference, request, start_swarm

GB = 10**9


def _positions(swarm, plan_id: str) -> dict[int, int]:  # type: ignore[no-untyped-def]
    """Positions each stage of the load has computed so far, on the live fellows."""
    counts: dict[int, int] = {}
    for agent in swarm.live():
        for (plan, stage), n in agent.serving.sessions.positions_run.items():
            if plan == plan_id:
                counts[stage] = counts.get(stage, 0) + n
    return counts


def _stage_fellow(swarm, plan, leader_id):  # type: ignore[no-untyped-def]
    """A stage's fellow that is not the leader (the driver): its index and name."""
    for s in plan["stages"]:
        i = next(i for i, f in enumerate(swarm.fellows) if f.name == s["fellow"])
        if swarm.fellows[i].identity.node_id != leader_id:
            return i, s["stage"], s["fellow"]
    raise AssertionError("every stage is on the leader")


async def test_a_stage_cut_off_for_5_s_stays_and_a_crashed_one_moves_to_the_spare(
        autojump_clock, tmp_path) -> None:
    async with trio.open_nursery() as nursery:
        swarm = await start_swarm(nursery, tmp_path, seed=31, n=4)
        ((leader_id, _),) = swarm.leaders()
        driver = next(a for a in swarm.live() if a.node_id == leader_id)
        plan = await driver.planning.ask_plan(request())
        await driver.serving.load(request(), plan_id=plan["plan_id"])
        one_process = reference(plan, MODEL)
        local = one_process.generate(PROMPT[:30], 12, Sampler.greedy(), stop_token_ids=())
        # sampled, so that the resumed session's draws are checked too (seed and position)
        sampled = one_process.generate(PROMPT[:30], 12, Sampler(0.9, top_k=50, seed=5),
                                       stop_token_ids=())
        assert sampled.token_ids != local.token_ids
        victim, stage, name = _stage_fellow(swarm, plan, leader_id)
        spare = next(f.name for f in swarm.fellows
                     if f.name not in {s["fellow"] for s in plan["stages"]})

        # cut off for 5 s (a radio fade; the grace window is longer): it keeps its stage
        cut = swarm.fellows[victim].addr
        others = [f.addr for f in swarm.fellows if f.addr != cut]
        cut_at: list[float] = []
        heard: list[int] = []

        def cut_after_five(token: int, text: str) -> None:
            heard.append(token)
            if len(heard) == 5:
                swarm.net.partition([cut], others)
                cut_at.append(trio.current_time())

        async def heal_after_five_seconds() -> None:
            await wait_until(lambda: bool(cut_at), timeout_s=60)
            await trio.sleep(5.0)
            swarm.net.heal()

        nursery.start_soon(heal_after_five_seconds)
        before = _positions(swarm, plan["plan_id"])
        result = await driver.serving.generate(prompt_ids=PROMPT[:30], max_tokens=12,
                                               stop_token_ids=(), on_token=cut_after_five,
                                               temperature=0.9, top_k=50, seed=5)
        # its streams broke: the session was opened again and replayed, and drew the same
        assert cut_at and result.resumes == 1 and result.token_ids == sampled.token_ids
        # every stage kept the session's cache when its streams broke: none replayed (30
        # prompt positions and 11 tokens fed back; the fifth token's again, at most)
        after = _positions(swarm, plan["plan_id"])
        assert result.replayed_stages == (0,)
        assert all(41 <= after[i] - before.get(i, 0) <= 42 for i in range(3)), (before, after)
        assert [r["fellow"] for r in result.route] == [s["fellow"] for s in plan["stages"]]
        (record,) = await driver.serving.list_loads()
        assert not record.get("moves") and not record.get("waiting")

        # crashed: silent past the grace window (shortened here), its stage moves
        driver.serving.failover.grace_s = 2.0
        await wait_until(lambda: swarm.states_seen_by_all(victim) == {"alive"}, timeout_s=30)
        seen: list[int] = []
        crash_after_five = crashing_after(swarm, victim, 5, seen)

        before = _positions(swarm, plan["plan_id"])
        result = await driver.serving.generate(prompt_ids=PROMPT[:30], max_tokens=12,
                                               stop_token_ids=(), on_token=crash_after_five)
        assert result.token_ids == local.token_ids and tuple(seen) == local.token_ids
        assert result.resumes == 1 and result.route[stage]["fellow"] == spare
        # the moved stage rebuilt the 34 positions before the fifth token's; the stages
        # before it recomputed them for it; the stages after it kept theirs
        after = _positions(swarm, plan["plan_id"])
        assert result.replayed_stages == (stage + 1,)
        assert after[stage] == 34 + 1 + 6  # rebuilt, then the fifth token and six more
        for other in set(range(3)) - {stage}:
            ran = after[other] - before[other]
            assert ran == (34 + 41 if other < stage else 41), (other, stage, before, after)
        (record,) = await driver.serving.list_loads()
        (move,) = record["moves"]
        assert (move["stage"], move["from"], move["to"]) == (stage, name, spare)
        assert f"{name} was silent for 2 s" in move["why"] and record["complete"]
        # the next generation runs on the healed load from the start
        again = await driver.serving.generate(prompt_ids=PROMPT[:30], max_tokens=12,
                                              stop_token_ids=())
        assert again.token_ids == local.token_ids and again.resumes == 0
        # equal cards everywhere: no live move to propose, and a move is refused
        assert "faster" not in record
        with pytest.raises(PlacementError, match="no markedly faster placement"):
            await driver.control_ops["load_move"]({"op": "load_move",
                                                   "plan_id": plan["plan_id"]})
        nursery.cancel_scope.cancel()


def test_spare_cards_fastest_first_and_never_a_busy_or_full_one() -> None:
    def fellow(fid: str, free_gb: float, bandwidth: float, connected: bool = True):  # type: ignore[no-untyped-def]
        card = {"index": 0, "kind": "cpu", "name": "CPU", "total_bytes": 16 * GB,
                "free_bytes": int(free_gb * GB), "mem_bandwidth": bandwidth, "flops": 1e11}
        return fellow_view(fid, f"n{fid}", {"cards": [card]}, None, connected=connected,
                           training=False)

    view = cluster_view([fellow("aa", 8, 2e10), fellow("bb", 8, 5e10), fellow("cc", 0.1, 9e10),
                         fellow("dd", 8, 9e10), fellow("ee", 8, 9e10, connected=False)])
    picked = [f.id for f, _ in spare_cards(view, GB, busy={"dd"})]
    assert picked == ["bb", "aa"]  # the faster first; cc too full, dd busy, ee gone
    assert [f.id for f, _ in spare_cards(view, GB, busy=set())] == ["dd", "bb", "aa"]
    # the same swarm heard in another order chooses the same card
    shuffled = cluster_view(list(reversed(view.fellows)))
    assert [f.id for f, _ in spare_cards(shuffled, GB, busy={"dd"})] == picked


def test_a_markedly_faster_free_card_is_proposed_for_the_slowest_stage() -> None:
    from p2pswarm.agent.serving.moves import faster_placement
    from p2pswarm.agent.serving.records import StageOrder, runtime_block

    def fellow(fid: str, kind: str, bandwidth: float, free_gb: float = 8):  # type: ignore[no-untyped-def]
        card = {"index": 0, "kind": kind, "name": f"{fid}-{kind}", "total_bytes": 16 * GB,
                "free_bytes": int(free_gb * GB), "mem_bandwidth": bandwidth, "flops": 1e12}
        return fellow_view(fid, f"n{fid}", {"cards": [card]})

    def order(stage: int, fid: str, kind: str = "cpu") -> StageOrder:
        return StageOrder("p" * 16, stage, 3, fid, (stage * 4, stage * 4 + 4), kind, 0, "x",
                          claim_bytes=GB, need_bytes=GB, runtime=runtime_block({}), model={})

    orders = [order(0, "aa"), order(1, "bb"), order(2, "cc")]
    slow = [fellow("aa", "cpu", 2e10), fellow("bb", "cpu", 1.6e10), fellow("cc", "cpu", 2e10)]
    assert faster_placement(cluster_view(slow), orders) is None  # no spare at all
    # a CPU a little faster than the slowest joins: not markedly faster, no move
    assert faster_placement(cluster_view([*slow, fellow("dd", "cpu", 2e10)]), orders) is None
    # a GPU joins: the slowest stage goes there, and a token takes markedly less
    proposal = faster_placement(cluster_view([*slow, fellow("ee", "cuda", 5e11)]), orders)
    assert proposal is not None and [(m.stage, m.fellow.id) for m in proposal.moves] == [
        (1, "ee")]
    assert proposal.after_s < 0.75 * proposal.now_s
    assert proposal.to_dict()["moves"][0]["to"] == "nee"
    # the GPU is full: nothing to propose
    full = fellow("ee", "cuda", 5e11, free_gb=0.5)
    assert faster_placement(cluster_view([*slow, full]), orders) is None
