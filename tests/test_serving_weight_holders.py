"""A re-placed stage fetches its tensors from any fellow that holds them, in virtual time:
the fellow that offered the model led the swarm and leaves, then a stage's fellow dies
mid-generation; the spare takes the stage with tensors from the fellows that cached them
(one of which serves a corrupted tensor, refused and fetched from the next), and the
generation ends with the undisturbed run's greedy tokens."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import trio

from p2pswarm import wire
from p2pswarm.agent.serving.records import WeightsOrigin
from p2pswarm.agent.weight_holders import ask_holders, first_unheld, gather
from p2pswarm.agent.weights import Manifest, ManifestTensor, WeightsCache
from p2pswarm.errors import PlacementError, TransportError
from p2pswarm.models import Checkpoint, stage_tensor_names, write_builtin_checkpoint
from p2pswarm.runtime import Sampler
from p2pswarm.sim.virtual import wait_until
from p2pswarm.wire.serving import WeightsByHash, WeightsHeld, WeightsHeldAsk, WeightsRefused
from tests.serving_swarm import MODEL, PROMPT, adopted, reference, request, short_grace, start_swarm

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]


def _cache_copy(cache: WeightsCache, model_dir: Path, manifest: Manifest, names: list[str],
                rot: str | None = None) -> None:
    """Put ``names`` into ``cache`` as a load of the model would have (one of them, ``rot``,
    with a byte flipped: a rotten disk, or a fellow that lies)."""
    for name in names:
        t = manifest.tensor(name)
        with (model_dir / t.file).open("rb") as f:
            f.seek(t.offset_bytes)
            data = bytearray(f.read(t.nbytes))
        if name == rot:
            data[7] ^= 0xFF
        path = cache.path(t.sha256)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(bytes(data))


async def test_the_spare_fetches_a_lost_stage_from_the_fellows_that_hold_it_when_the_source_is_gone(  # noqa: E501
        autojump_clock, tmp_path, tmp_path_factory) -> None:
    model_dir = write_builtin_checkpoint(MODEL, tmp_path_factory.mktemp("model") / MODEL,
                                         max_shard_bytes=4_000_000)
    checkpoint = Checkpoint(model_dir)
    async with trio.open_nursery() as nursery:
        swarm = await start_swarm(nursery, tmp_path, seed=41, n=5)
        ((old_id, old_term),) = swarm.leaders()
        offerer = next(i for i, f in enumerate(swarm.fellows) if f.identity.node_id == old_id)
        leader = swarm.fellows[offerer].agent
        assert leader is not None
        for agent in swarm.live():  # the caches below are placed by hand, not copied ahead
            agent.serving.copies.wanted = 0
        # the leader offers the model (its laptop has the files) and holds no stage
        ask = {**request(exclude=[f"{swarm.fellows[offerer].name}:cpu"]),
               "model": {"name": MODEL, "config": checkpoint.hf_config}}
        plan = await leader.planning.ask_plan(ask)
        loaded = await leader.serving.load(ask, plan_id=plan["plan_id"],
                                           model_dir=str(model_dir))
        manifest = leader.serving.weights.offers[loaded["model"]["key"]]
        plan_id = plan["plan_id"]
        staged = [s["fellow"] for s in plan["stages"]]
        agents = {a.name: a for a in swarm.live()}
        (spare,) = [n for n in agents if n != leader.name and n not in staged]
        lost = staged[1]
        lost_names = stage_tensor_names(checkpoint.config, *plan["stages"][1]["layers"])
        rotten = next(n for n in lost_names if n.endswith("q_proj.weight"))
        # stage 2's fellow cached all of stage 1's tensors before (one has rotted since);
        # stage 0's fellow only the one that rotted there
        _cache_copy(agents[staged[2]].serving.weights_cache(), model_dir, manifest,
                    lost_names, rot=rotten)
        _cache_copy(agents[staged[0]].serving.weights_cache(), model_dir, manifest, [rotten])
        local = reference(plan, checkpoint).generate(PROMPT[:30], 12, Sampler.greedy(),
                                                     stop_token_ids=())
        short_grace(swarm)

        await swarm.leave(offerer)  # the laptop that offered the model and led goes home

        await adopted(swarm, old_id, old_term, plan_id)
        driver = agents[staged[0]]
        seen: list[int] = []

        def crash_after_five(token: int, text: str) -> None:
            seen.append(token)
            if len(seen) == 5:  # then stage 1's fellow dies mid-generation
                swarm.crash(next(i for i, f in enumerate(swarm.fellows) if f.name == lost))

        result = await driver.serving.generate(prompt_ids=PROMPT[:30], max_tokens=12,
                                               stop_token_ids=(), on_token=crash_after_five)
        assert result.token_ids == local.token_ids and tuple(seen) == local.token_ids
        assert result.resumes >= 1
        assert [r["fellow"] for r in result.route] == [staged[0], spare, staged[2]]
        # the spare holds stage 1's tensors, each verified: the rotten one was refused
        # from stage 2's fellow and came from stage 0's
        held = agents[spare].serving.weights_cache().held()
        assert sorted({manifest.tensor(n).sha256 for n in lost_names}) == held
        assert agents[spare].counters.drops["weights-hash-mismatch"] == 1
        (record,) = await driver.serving.list_loads()
        (move,) = record["moves"]
        assert (move["stage"], move["from"], move["to"]) == (1, lost, spare)
        hop = record["stages"][1]
        assert hop["fetched_bytes"] >= sum({manifest.tensor(n).sha256: manifest.tensor(n).nbytes
                                            for n in lost_names}.values())
        await wait_until(lambda: record["complete"], timeout_s=10)
        nursery.cancel_scope.cancel()


def _tensor(name: str, data: bytes) -> ManifestTensor:
    return ManifestTensor(name, "model.safetensors", "U8", (len(data),), 0, len(data),
                          hashlib.sha256(data).hexdigest())


def _put(cache: WeightsCache, t: ManifestTensor, data: bytes) -> None:
    path = cache.path(t.sha256)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


async def test_tensors_come_from_the_holders_by_hash_and_hostile_answers_cost_nothing(
        autojump_clock, tmp_path) -> None:
    data = {f"t{i}": bytes([i]) * (1000 + i) for i in range(1, 5)}
    tensors = {n: _tensor(n, d) for n, d in data.items()}
    manifest = Manifest("ab" * 8, "toy", "/nowhere", {}, tuple(tensors.values()), ())
    gone = "ee" * 16  # the fellow that offered it: not in the swarm
    async with trio.open_nursery() as nursery:
        swarm = await start_swarm(nursery, tmp_path, seed=43, n=3)
        fetcher, full, rotten = swarm.live()
        caches = {a.name: a.serving.weights_cache() for a in swarm.live()}
        # one fellow holds t1-t3 with t2 rotten (same size), another a good t2; t4 nobody
        for n in ("t1", "t2", "t3"):
            _put(caches[rotten.name], tensors[n], data[n] if n != "t2" else b"x" * 1002)
        _put(caches[full.name], tensors["t2"], data["t2"])
        run = fetcher.compute.run

        got = await gather(fetcher, manifest, ["t1", "t2", "t3"], caches[fetcher.name], run,
                           source_id=gone, source_name="laptop")
        assert got.senders == (rotten.name, full.name)  # the one holding most first
        assert fetcher.counters.drops["weights-hash-mismatch"] == 1
        assert caches[fetcher.name].held() == sorted(tensors[n].sha256 for n in
                                                     ("t1", "t2", "t3"))
        with pytest.raises(PlacementError, match=r"1 of the 1 tensors of toy this stage lacks "
                                                 r"came from no fellow, t4 first: laptop "
                                                 r"\(which offered them\) is not connected"):
            await gather(fetcher, manifest, ["t1", "t4"], caches[fetcher.name], run,
                         source_id=gone, source_name="laptop")
        # a source that refuses (it offers no such model any more): the holders give it
        fresh = WeightsCache(tmp_path / "fresh")
        got = await gather(fetcher, manifest, ["t1"], fresh, run,
                           source_id=full.node_id.hex(), source_name=full.name)
        assert got.senders == (rotten.name,) and fresh.held() == [tensors["t1"].sha256]
        # what a prepare asks when the source is gone: does any connected fellow hold them
        assert await first_unheld(full, manifest, ["t1", "t3"], caches[full.name],
                                  gone) is None
        assert await first_unheld(full, manifest, ["t2", "t4"], caches[full.name],
                                  gone) == "t4"
        block = WeightsOrigin.of({"source_id": gone, "source": "laptop"})
        assert await full.serving.host._unreachable(manifest, ["t4"], block, "the model "
                                                    "files") == (
            "the model files are not here, laptop (which offered them) is not connected, "
            "and no connected fellow holds t4")
        assert await full.serving.host._unreachable(manifest, ["t1"], block, "") is None

        # a hash that is not 64 lowercase hex digits never becomes a path: the stream ends
        async def ask_raw(msg: object) -> list[object]:
            stream = await fetcher.open_secure(full.addr)
            try:
                await stream.send_frame(wire.encode(msg))
                try:
                    return list(wire.decode(await stream.receive_frame()))
                except TransportError:
                    return []
            finally:
                await stream.aclose()

        assert await ask_raw(WeightsHeldAsk(("../" + "a" * 61,))) == []
        assert full.counters.drops["frame-unsafe-name"] == 1
        (held,) = await ask_raw(WeightsHeldAsk((tensors["t4"].sha256, tensors["t2"].sha256)))
        assert held == WeightsHeld(bytes([0b10]))
        (refused,) = await ask_raw(WeightsByHash((tensors["t4"].sha256,)))
        assert isinstance(refused, WeightsRefused)

        # a holder answering out of form (a bitmap too long) holds nothing
        async def out_of_form(msg: WeightsHeldAsk, stream: object) -> WeightsHeld:
            return WeightsHeld(b"\xff" * 8)

        full.on_stream(WeightsHeldAsk, out_of_form)
        assert await ask_holders(fetcher, [m for m in fetcher.fellows()
                                           if m.node_id == full.node_id],
                                 [tensors["t2"].sha256]) == []
        assert fetcher.counters.drops["weights-held-unfit"] == 1
        nursery.cancel_scope.cancel()
