"""Loads and generation across real agents on MemoryNetwork, in virtual time.

Three fellows load a model as a three-stage pipeline through the leader and generate;
the answers must equal the same model in one process. Torch runs inline
(``VirtualSwarm(inline_compute=True)``), so compute takes no virtual time.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio
import trio.testing

from p2pswarm.errors import PlacementError, TransportError
from p2pswarm.models import Checkpoint, stage_tensor_names, write_builtin_checkpoint
from p2pswarm.runtime import Sampler
from p2pswarm.sim.virtual import cpu_card, wait_until
from p2pswarm.wire.loads import UnloadAsk, Unloaded
from tests.serving_swarm import (
    MODEL,
    PROMPT,
    crashing_after,
    nothing_held,
    reference,
    request,
    start_swarm,
    write_model,
)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]


async def test_auto_weights_load_each_stage_in_its_own_dtype(autojump_clock, tmp_path) -> None:
    """A fellow whose card holds one layer quantized but not in f16 gets a quantized stage
    under ``auto`` (int4 here: at this tiny width int8's packed rows, padded to 512 inputs,
    outweigh f16); the others keep f16; each allocates what the plan claims, and the
    pipeline equals the same mixed stages in one process."""
    async with trio.open_nursery() as nursery:
        swarm = await start_swarm(nursery, tmp_path, seed=23)
        small = swarm.fellows[1]
        # below one middle layer's f16 stage (273.55 MB), above its int4 one
        small.cards.cards = (cpu_card(16.0, free_gb=0.2734, name="small CPU"),)
        auto = request(weights_dtype="auto", floors_bytes={"cpu": "1MB"})
        driver = swarm.live()[0]

        for _ in range(100):  # until the small card's inventory reaches the leader
            plan = await driver.planning.ask_plan(auto)
            if {s["weights_dtype"] for s in plan["stages"]} - {"f16"}:
                break
            await trio.sleep(1)
        assert plan["fits"] and plan["request"]["weights_dtype"] == "auto"
        by_fellow = {s["fellow"]: s["weights_dtype"] for s in plan["stages"]}
        assert by_fellow[small.name] in ("int8", "int4")
        assert list(by_fellow.values()).count("f16") == 2
        loaded = await driver.serving.load(auto, plan_id=plan["plan_id"])
        for s in loaded["stages"]:  # a quantized stage holds exactly what the plan claims, too
            assert s["allocated_bytes"] == s["claim_bytes"] > 0
        await wait_until(lambda: all(
            len(a.serving.loads_view()) == 1 and a.serving.loads_view()[0].complete
            for a in swarm.live()), timeout_s=10)
        result = await driver.serving.generate(prompt_ids=PROMPT[:40], max_tokens=8,
                                               stop_token_ids=())
        local = reference(plan, MODEL).generate(PROMPT[:40], 8, Sampler.greedy(),
                                                stop_token_ids=())
        assert result.token_ids == local.token_ids
        await driver.leadership.ask(UnloadAsk(plan["plan_id"]), Unloaded)
        nursery.cancel_scope.cancel()


async def test_three_stages_across_fellows_equal_one_process(autojump_clock, tmp_path) -> None:
    async with trio.open_nursery() as nursery:
        swarm = await start_swarm(nursery, tmp_path, seed=21)
        driver = swarm.live()[1]
        plan = await driver.planning.ask_plan(request())
        assert plan["fits"] and len({s["fellow"] for s in plan["stages"]}) == 3
        assert plan["runtime"]["prefill_chunk_tokens"] < len(PROMPT)
        loaded = await driver.serving.load(request(), plan_id=plan["plan_id"])
        assert loaded["plan_id"] == plan["plan_id"]
        for s in loaded["stages"]:  # what each stage holds is what the plan claims
            assert s["allocated_bytes"] == s["claim_bytes"] > 0
        await wait_until(lambda: all(
            len(a.serving.loads_view()) == 1 and a.serving.loads_view()[0].complete
            for a in swarm.live()), timeout_s=10)

        streamed: list[int] = []
        began = trio.current_time()
        result = await driver.serving.generate(
            prompt_ids=PROMPT, max_tokens=12, stop_token_ids=(), keep_logits=True,
            on_token=lambda token, text: streamed.append(token))
        one_process = reference(plan, MODEL)
        local = one_process.generate(PROMPT, 12, Sampler.greedy(), stop_token_ids=(),
                                     keep_logits=True)
        assert result.token_ids == local.token_ids and len(result.token_ids) == 12
        assert streamed == list(result.token_ids)
        for got, want in zip(result.logits, local.logits):
            assert (got - want).abs().max().item() <= 1e-5
        assert trio.current_time() - began < 1.0  # virtual: only the links' delays

        # seeded sampling on the last stage equals the sampler in one process
        sampled = await swarm.live()[2].serving.generate(
            prompt_ids=PROMPT[:40], max_tokens=10, temperature=0.9, top_k=50, seed=7,
            stop_token_ids=())
        local_sampled = one_process.generate(PROMPT[:40], 10, Sampler(0.9, top_k=50, seed=7),
                                             stop_token_ids=())
        assert sampled.token_ids == local_sampled.token_ids

        # every stage ended its sessions; unloading frees everything everywhere
        await wait_until(lambda: all(not h.stage.sessions for a in swarm.live()
                                     for h in a.serving.hosted.values()), timeout_s=5)
        await driver.leadership.ask(UnloadAsk(plan["plan_id"]), Unloaded)
        assert nothing_held(swarm)
        nursery.cancel_scope.cancel()


async def test_a_loaded_cpu_stage_is_not_offered_again(autojump_clock, tmp_path) -> None:
    # fake cards report a fixed free size, as a CPU capped with --cpu-memory does
    async with trio.open_nursery() as nursery:
        swarm = await start_swarm(nursery, tmp_path, seed=23)
        asker = swarm.live()[0]
        plan = await asker.planning.ask_plan(request())
        await asker.serving.load(request(), plan_id=plan["plan_id"])
        need = {a.name: sum(h.order.need_bytes for h in a.serving.hosted.values())
                for a in swarm.live()}
        assert all(need.values())

        def everyone_sees_it() -> bool:
            return all(c.free_bytes == 16_000_000_000 - need[f.name]
                       for a in swarm.live() for f in a.planning.view().fellows
                       for c in f.cards)

        await wait_until(everyone_sees_it, timeout_s=30)
        again = await asker.planning.ask_plan(request())  # the plan shows the stage held
        assert all(c["free_bytes"] == 16_000_000_000 - need[c["fellow"]] for c in again["cards"])
        await asker.control_ops["unload"]({"op": "unload", "plan_id": plan["plan_id"]})
        await wait_until(lambda: all(c.free_bytes == 16_000_000_000 for a in swarm.live()
                                     for f in a.planning.view().fellows for c in f.cards),
                         timeout_s=30)
        nursery.cancel_scope.cancel()


async def test_pinned_plan_holds_while_memory_drops_within_its_headroom(
        autojump_clock, tmp_path) -> None:
    # (a card filled past its stage's claim, or a fellow gone, refuses it: tests/test_pins.py)
    async with trio.open_nursery() as nursery:
        swarm = await start_swarm(nursery, tmp_path, seed=22)
        asker = swarm.live()[0]
        plan = await asker.planning.ask_plan(request())
        # f001's memory fills up, below the floor but not past what its stage claims
        target = swarm.fellows[1]
        target.cards.cards = (cpu_card(16.0, free_gb=0.9, name=f"{target.name} CPU"),)

        def leader_sees_it() -> bool:
            return all(next(c for f in a.planning.view().fellows if f.name == target.name
                            for c in f.cards).free_bytes == 900_000_000 for a in swarm.live())

        await wait_until(leader_sees_it, timeout_s=30)
        with pytest.raises(PlacementError, match="usable cards"):
            await asker.planning.ask_plan(request())  # a new plan has no room for 3 stages
        loaded = await asker.serving.load(request(), plan_id=plan["plan_id"])
        assert loaded["plan_id"] == plan["plan_id"]
        assert [s["fellow"] for s in loaded["stages"]] == [s["fellow"] for s in plan["stages"]]
        await asker.control_ops["unload"]({"op": "unload", "plan_id": plan["plan_id"]})
        assert nothing_held(swarm)
        nursery.cancel_scope.cancel()


async def test_one_refusal_aborts_the_whole_load(autojump_clock, tmp_path) -> None:
    async with trio.open_nursery() as nursery:
        swarm = await start_swarm(nursery, tmp_path, seed=23)
        plan = await swarm.live()[0].planning.ask_plan(request())
        # a fellow that started training after the plan was made refuses its stage
        busy = swarm.fellows[2].agent
        busy.extra_metadata["training"] = True
        with pytest.raises(PlacementError, match="f002: refuses stage .*: it is training") as e:
            await swarm.live()[0].serving.load(request(), plan_id=plan["plan_id"])
        assert "nothing loaded" in str(e.value)
        assert nothing_held(swarm)
        busy.extra_metadata.pop("training")
        # and a fellow whose memory went before the leader heard of it refuses too
        low = swarm.fellows[1]
        low.cards.cards = (cpu_card(16.0, free_gb=0.1, name=f"{low.name} CPU"),)
        with pytest.raises(PlacementError, match=r"f001: refuses stage \d: its CPU \(f001 CPU\) "
                                                 r"has 0.1 GB free now, the stage needs"):
            await swarm.live()[0].serving.load(request(), plan_id=plan["plan_id"])
        assert nothing_held(swarm)
        nursery.cancel_scope.cancel()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory)


async def test_fellows_fetch_exactly_their_stage_verified(autojump_clock, tmp_path,
                                                          model_dir) -> None:
    checkpoint = Checkpoint(model_dir)
    async with trio.open_nursery() as nursery:
        swarm = await start_swarm(nursery, tmp_path, seed=24)
        source = swarm.live()[0]  # the model directory is here only
        message = {**request(), "model": {"name": MODEL, "config": checkpoint.hf_config}}
        plan = await source.planning.ask_plan(message)
        loaded = await source.serving.load(message, plan_id=plan["plan_id"],
                                           model_dir=str(model_dir))
        manifest = source.serving.weights.offers[loaded["model"]["key"]]
        for s, agent in ((s, next(a for a in swarm.live() if a.name == s["fellow"]))
                         for s in loaded["stages"]):
            names = stage_tensor_names(checkpoint.config, *s["layers"])
            held = agent.serving.weights_cache().held()
            if agent is source:
                assert held == [] and s["fetched_bytes"] == 0
                continue
            want = {manifest.tensor(n).sha256: manifest.tensor(n).nbytes for n in names}
            assert held == sorted(want)  # exactly its stage's tensors, under their hashes
            assert s["fetched_bytes"] == sum(want.values())  # equal ones fetched once
        result = await swarm.live()[2].serving.generate(prompt_ids=PROMPT[:60], max_tokens=6,
                                                        stop_token_ids=(), keep_logits=True)
        local = reference(plan, checkpoint).generate(PROMPT[:60], 6, Sampler.greedy(),
                                                     stop_token_ids=(), keep_logits=True)
        assert result.token_ids == local.token_ids
        nursery.cancel_scope.cancel()


async def test_a_corrupted_tensor_is_refused(autojump_clock, tmp_path, model_dir,
                                             tmp_path_factory) -> None:
    bad_dir = write_builtin_checkpoint(MODEL, tmp_path_factory.mktemp("bad") / MODEL)
    checkpoint = Checkpoint(bad_dir)
    async with trio.open_nursery() as nursery:
        swarm = await start_swarm(nursery, tmp_path, seed=25)
        source = swarm.live()[0]
        message = {**request(), "model": {"name": MODEL, "config": checkpoint.hf_config}}
        plan = await source.planning.ask_plan(message)
        await source.serving.offer(str(bad_dir))  # hashed while still intact
        # then a byte of one of the last stage's tensors rots on the source's disk, silently
        # (same size, same mtime: the manifest made before still stands)
        last = plan["stages"][-1]
        victim = checkpoint.entry(next(n for n in stage_tensor_names(
            checkpoint.config, *last["layers"]) if n.endswith("q_proj.weight")))
        path = bad_dir / victim.file
        stat = path.stat()
        with path.open("r+b") as f:
            f.seek(victim.offset_bytes + 5)
            byte = f.read(1)
            f.seek(victim.offset_bytes + 5)
            f.write(bytes([byte[0] ^ 0xFF]))
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        with pytest.raises(PlacementError, match=f"tensor {victim.name} from f000 failed its "
                                                 "SHA-256 check"):
            await source.serving.load(message, plan_id=plan["plan_id"], model_dir=str(bad_dir))
        assert nothing_held(swarm)
        receiver = next(a for a in swarm.live() if a.name == last["fellow"])
        manifest = next(iter(source.serving.weights.offers.values()))
        assert manifest.tensor(victim.name).sha256 not in receiver.serving.weights_cache().held()
        nursery.cancel_scope.cancel()


async def test_a_vanished_stage_fellow_ends_generation_with_its_name(autojump_clock,
                                                                     tmp_path) -> None:
    async with trio.open_nursery() as nursery:
        swarm = await start_swarm(nursery, tmp_path, seed=26)
        ((leader_id, _),) = swarm.leaders()
        driver = next(a for a in swarm.live() if a.node_id == leader_id)
        plan = await driver.planning.ask_plan(request())
        await driver.serving.load(request(), plan_id=plan["plan_id"])
        middle = plan["stages"][1]["fellow"]
        victim = next(i for i, f in enumerate(swarm.fellows) if f.name == middle)
        if swarm.fellows[victim].agent is driver:  # crash a stage fellow, not the driver
            middle = plan["stages"][2]["fellow"]
            victim = next(i for i, f in enumerate(swarm.fellows) if f.name == middle)
        seen: list[int] = []
        crash_after_three = crashing_after(swarm, victim, 3, seen)

        began = trio.current_time()
        with pytest.raises(TransportError, match=f"on fellow {middle}") as error:
            await driver.serving.generate(prompt_ids=PROMPT[:30], max_tokens=200,
                                          stop_token_ids=(), on_token=crash_after_three)
        assert f"on fellow {middle} went away" in str(error.value)
        assert str(error.value).endswith("stopped after 3 tokens")
        # no spare card: the leader gave the silent fellow its grace window, then gave up
        grace_s = driver.serving.failover.grace_s
        assert len(seen) == 3 and trio.current_time() - began < grace_s + 5
        record = (await driver.serving.list_loads())[0]
        assert "needs a card with" in record["waiting"] and not record.get("moves")
        # asking again names the dead fellow at once, once membership has its verdict
        await wait_until(lambda: swarm.states_seen_by_all(victim) == {"dead"}, timeout_s=30)
        with pytest.raises(TransportError, match=f"on fellow {middle} is dead"):
            await driver.serving.generate(prompt_ids=PROMPT[:30], max_tokens=4)
        nursery.cancel_scope.cancel()


async def test_a_load_outlives_the_leader_that_made_it(autojump_clock, tmp_path) -> None:
    async with trio.open_nursery() as nursery:
        swarm = await start_swarm(nursery, tmp_path, seed=27, n=4)
        ((leader_id, _),) = swarm.leaders()
        leader = next(a for a in swarm.live() if a.node_id == leader_id)
        message = request(exclude=[f"{leader.name}:cpu"])  # the leader hosts no stage
        plan = await leader.planning.ask_plan(message)
        await leader.serving.load(message, plan_id=plan["plan_id"])
        await swarm.leave(next(i for i, f in enumerate(swarm.fellows)
                               if f.identity.node_id == leader_id))
        await wait_until(lambda: len(swarm.leaders()) == 1 and next(iter(swarm.leaders()))[0]
                         not in (None, leader_id), timeout_s=30)
        # the new leader knows the load only from what its fellows gossip, and that is enough
        loads = await swarm.live()[0].serving.list_loads()
        assert [r["plan_id"] for r in loads] == [plan["plan_id"]] and loads[0]["complete"]
        result = await swarm.live()[0].serving.generate(prompt_ids=PROMPT[:20], max_tokens=5,
                                                        stop_token_ids=())
        local = reference(plan, MODEL).generate(PROMPT[:20], 5, Sampler.greedy(),
                                                stop_token_ids=())
        assert result.token_ids == local.token_ids
        await swarm.live()[0].serving.leadership.ask(UnloadAsk(), Unloaded)
        assert nothing_held(swarm)
        nursery.cancel_scope.cancel()
