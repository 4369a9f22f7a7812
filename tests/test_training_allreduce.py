"""The sharded all-reduce of a stage's deltas over in-process fellows, in virtual time."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import trio

from p2pswarm.agent.training.allreduce import AllReduceFellow, MemoryPartNet, inline
from p2pswarm.agent.training.ring import StageRing
from p2pswarm.errors import RemoteProtocolError
from p2pswarm.training.allreduce import (
    PartedSync,
    merge_outer,
    pack_outer,
    part_bounds,
    split_outer,
    unpack_outer,
)
from p2pswarm.training.codec import make_codec
from p2pswarm.training.job import SyncConfig
from p2pswarm.training.sync import LocalSync
from p2pswarm.wire.training import RingRound

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# outer SGD at learning rate 1, no momentum: the update is the plain average of the deltas
PLAIN = SyncConfig(outer_lr=1.0, outer_momentum=0.0, codec="int8", round_deadline_s=60.0)


@dataclass
class Fellows:
    net: MemoryPartNet
    fellows: list[AllReduceFellow]
    params: list[torch.Tensor]
    start: torch.Tensor


def make_fellows(n: int, numel: int, config: SyncConfig = PLAIN, seed: int = 0,
                 bandwidth_bps: float = 0.0, backup_every_rounds: int = 0) -> Fellows:
    generator = torch.Generator().manual_seed(seed)
    start = torch.randn(numel, generator=generator)
    net = MemoryPartNet(latency_s=0.01, bandwidth_bps=bandwidth_bps)
    names = [f"f{i}" for i in range(n)]
    fellows, params = [], []
    for i, name in enumerate(names):
        p = start.clone()
        local = LocalSync([p], config, noise_seed=i)
        # its local training since the last round
        p.add_(0.01 * torch.randn(numel, generator=generator))
        fellows.append(AllReduceFellow(name, names, PartedSync(local, n), net,
                                       net.attach(name),
                                       round_deadline_s=config.round_deadline_s,
                                       backup_every_rounds=backup_every_rounds))
        params.append(p)
    return Fellows(net, fellows, params, start)


def test_part_bounds_are_contiguous_and_cover_the_vector() -> None:
    assert part_bounds(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert part_bounds(2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]
    with pytest.raises(ValueError):
        part_bounds(10, 0)


async def test_all_reduce_equals_the_plain_average_and_replicas_stay_bit_equal(
        autojump_clock: trio.testing.MockClock) -> None:
    setup = make_fellows(5, 20_000)
    expected = torch.stack(setup.params).mean(dim=0)
    async with trio.open_nursery() as nursery:
        for f in setup.fellows:
            await nursery.start(f.run)
        async with trio.open_nursery() as rounds:
            for f in setup.fellows:
                rounds.start_soon(f.reduce, 8)
        nursery.cancel_scope.cancel()
    anchors = [f.sync.params() for f in setup.fellows]  # type: ignore[attr-defined]
    for a in anchors[1:]:
        assert torch.equal(a, anchors[0])
    for f, p in zip(setup.fellows, setup.params, strict=True):
        assert f.sync.version == 1
        assert torch.equal(p, anchors[0])  # nothing unsent: the params are the anchor
    moved = expected - setup.start
    error = (anchors[0] - expected).norm() / moved.norm()
    assert error < 0.05, error  # two int8 encodings (delta, update) of the average
    assert trio.current_time() < 1.0  # every fellow sent: no waiting for the deadline


async def test_a_fellow_killed_mid_reduction_does_not_stall_the_round(
        autojump_clock: trio.testing.MockClock) -> None:
    setup = make_fellows(4, 4_000)
    victim = setup.fellows[1]  # keeps part 1
    survivors = [f for f in setup.fellows if f is not victim]
    finished: dict[str, float] = {}

    async def reduce(f: AllReduceFellow) -> None:
        await f.reduce(8)
        finished[f.name] = trio.current_time()

    async with trio.open_nursery() as nursery:
        scopes = {}
        for f in setup.fellows:
            scope = trio.CancelScope()
            scopes[f.name] = scope

            async def run(f: AllReduceFellow = f, scope: trio.CancelScope = scope,
                          *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                          ) -> None:
                with scope:
                    await f.run(task_status=task_status)
            await nursery.start(run)
        async with trio.open_nursery() as rounds:
            for f in survivors:
                rounds.start_soon(reduce, f)
            victim_round = trio.CancelScope()

            async def victim_reduce() -> None:
                with victim_round:
                    await victim.reduce(8)
            rounds.start_soon(victim_reduce)
            await trio.sleep(0.015)  # its first part is out, the others not yet
            setup.net.kill(victim.name)
            victim_round.cancel()
            scopes[victim.name].cancel()
            await trio.sleep(0.5)  # the membership notices
            for f in survivors:
                f.down(victim.name)
        nursery.cancel_scope.cancel()
    assert set(finished) == {f.name for f in survivors}
    assert max(finished.values()) < 1.0  # well before the round's deadline (60 s)
    anchors = [f.sync.params() for f in survivors]  # type: ignore[attr-defined]
    for a in anchors[1:]:
        assert torch.equal(a, anchors[0])
    assert all(f.owners[1] == "f2" for f in survivors)  # the next in the ring keeps it
    # the rounds go on without it
    for f in survivors:
        f.sync.local.tensors[0].add_(0.01)  # type: ignore[attr-defined]
    async with trio.open_nursery() as nursery:
        for f in survivors:
            await nursery.start(f.run)
        async with trio.open_nursery() as rounds:
            for f in survivors:
                rounds.start_soon(f.reduce, 8)
        nursery.cancel_scope.cancel()
    assert {f.sync.version for f in survivors} == {2}
    anchors = [f.sync.params() for f in survivors]  # type: ignore[attr-defined]
    for a in anchors[1:]:
        assert torch.equal(a, anchors[0])


async def test_a_keeper_killed_after_sending_some_updates_is_adopted_not_redone(
        autojump_clock: trio.testing.MockClock) -> None:
    """A keeper that closed its part and reached only some fellows before vanishing: its
    heir adopts that update (passed on by those that got it), so no fellow applies two
    different updates of one round."""
    setup = make_fellows(4, 4_000, bandwidth_bps=1e6)  # a part's update: ~10 ms
    victim = setup.fellows[3]  # keeps part 3; its heir is f0
    survivors = setup.fellows[:3]
    async with trio.open_nursery() as nursery:
        scopes = {}
        for f in setup.fellows:
            scope = trio.CancelScope()
            scopes[f.name] = scope

            async def run(f: AllReduceFellow = f, scope: trio.CancelScope = scope,
                          *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                          ) -> None:
                with scope:
                    await f.run(task_status=task_status)
            await nursery.start(run)
        async with trio.open_nursery() as rounds:
            for f in survivors:
                rounds.start_soon(f.reduce, 8)
            victim_round = trio.CancelScope()

            async def victim_reduce() -> None:
                with victim_round:
                    await victim.reduce(8)
            rounds.start_soon(victim_reduce)
            # the victim's update leaves on its uplink one fellow after another: kill it
            # once the first has it
            def has_part_3(f: AllReduceFellow) -> bool:
                return f.sync.version >= 1 or 3 in f._updates.get(1, {})
            for _ in range(5000):
                if any(has_part_3(f) for f in survivors):
                    break
                await trio.sleep(0.001)
            assert any(has_part_3(f) for f in survivors), [
                (f.name, f.sync.version, sorted(f._updates.get(1, {}))) for f in setup.fellows]
            assert not all(has_part_3(f) for f in survivors)
            setup.net.kill(victim.name)
            scopes[victim.name].cancel()
            victim_round.cancel()
            await trio.sleep(0.5)
            for f in survivors:
                f.down(victim.name)
        nursery.cancel_scope.cancel()
    anchors = [f.sync.params() for f in survivors]  # type: ignore[attr-defined]
    for a in anchors[1:]:
        assert torch.equal(a, anchors[0])
    assert {f.sync.version for f in survivors} == {1}


async def test_bytes_per_fellow_stay_bounded_as_fellows_grow(
        autojump_clock: trio.testing.MockClock) -> None:
    """The busiest fellow sends and receives at most three compressed deltas a round,
    for 4 to 32 fellows (about 2 (R - 1) / R, and the codec's overhead per part)."""
    numel = 1 << 17
    config = SyncConfig(codec="int8", round_deadline_s=60.0)
    one_delta = make_codec("int8").encode(
        torch.randn(numel)).nbytes
    ratios = {}
    for n in (4, 8, 16, 32):
        setup = make_fellows(n, numel, config, seed=n)
        async with trio.open_nursery() as nursery:
            for f in setup.fellows:
                await nursery.start(f.run)
            async with trio.open_nursery() as rounds:
                for f in setup.fellows:
                    rounds.start_soon(f.reduce, 8)
            nursery.cancel_scope.cancel()
        busiest = max(max(setup.net.sent_bytes.values()), max(setup.net.received_bytes.values()))
        ratios[n] = busiest / one_delta
    assert max(ratios.values()) <= 3.0, ratios


async def test_a_new_keeper_goes_on_from_the_outer_state_its_predecessor_handed_it(
        autojump_clock: trio.testing.MockClock) -> None:
    config = SyncConfig(outer_lr=0.7, outer_momentum=0.9, codec="int8")
    setup = make_fellows(4, 4_000, config, backup_every_rounds=1)
    async with trio.open_nursery() as nursery:
        for f in setup.fellows:
            await nursery.start(f.run)
        async with trio.open_nursery() as rounds:
            for f in setup.fellows:
                rounds.start_soon(f.reduce, 8)
        await trio.sleep(1.0)  # the backups arrive
        nursery.cancel_scope.cancel()
    kept = setup.fellows[1].keepers[1].outer  # type: ignore[attr-defined]
    heir = setup.fellows[2]
    assert 1 in heir._backups and heir._backups[1].version == 1
    setup.net.kill("f1")
    for f in (setup.fellows[0], setup.fellows[2], setup.fellows[3]):
        f.down("f1")
    taken = heir.keepers[1].outer  # type: ignore[attr-defined]
    assert taken.version == kept.version == 1
    assert torch.equal(taken.momentum, kept.momentum) and kept.momentum.abs().sum() > 0
    assert torch.equal(taken.params, kept.params)
    assert torch.equal(taken.compressor.residual, kept.compressor.residual)


async def test_a_fellow_back_in_the_ring_gets_the_update_it_missed_and_parts_stay_put(
        autojump_clock: trio.testing.MockClock) -> None:
    """The driver's word moves a gone fellow's part to the next one (``regroup``); when it
    comes back with a delta of a round that closed without it, the part's keeper sends it
    that round's update, and the part stays with its new keeper."""
    setup = make_fellows(3, 3_000)
    a, b, c = setup.fellows
    async with trio.open_nursery() as nursery:
        for f in setup.fellows:
            await nursery.start(f.run)
        for f in (a, c):
            f.regroup(["f0", "f2"], ["f0", "f2", "f2"])  # b gone: its part to c
        async with trio.open_nursery() as rounds:
            for f in (a, c):
                rounds.start_soon(f.reduce, 8)
        assert a.sync.version == c.sync.version == 1 and b.sync.version == 0
        # b comes back (the driver lists it again), sends its stale delta, catches up
        for f in (a, c):
            f.regroup(["f0", "f1", "f2"], ["f0", "f2", "f2"])
        b.regroup(["f0", "f1", "f2"], ["f0", "f2", "f2"])
        assert 1 not in b.keepers and 1 in c.keepers
        version = await b.start(8)
        assert version == 0
        with trio.fail_after(5):
            assert await b.finish(version) == 1
        nursery.cancel_scope.cancel()
    assert torch.equal(a.sync.params(), b.sync.params())  # type: ignore[attr-defined]
    assert torch.equal(a.sync.params(), c.sync.params())  # type: ignore[attr-defined]


def test_outer_state_splits_into_parts_and_merges_back_whole() -> None:
    generator = torch.Generator().manual_seed(1)
    momentum, residual = torch.randn(1_001, generator=generator), torch.randn(1_001)
    parts = split_outer(momentum, residual, 3)
    assert sorted(parts) == [0, 1, 2]
    packed = unpack_outer(pack_outer(parts), 3)
    again_m, again_r = torch.zeros(1_001), torch.zeros(1_001)
    merge_outer(again_m, again_r, packed, 3)
    assert torch.equal(again_m, momentum) and torch.equal(again_r, residual)
    with pytest.raises(RemoteProtocolError):
        unpack_outer(b"not a torch file", 3)
    with pytest.raises(RemoteProtocolError):
        unpack_outer(pack_outer({5: b"x"}), 3)
    with pytest.raises(RemoteProtocolError):  # a part of another size
        merge_outer(torch.zeros(10), torch.zeros(10), {0: parts[0]}, 3)


@pytest.mark.parametrize("addrs,fellows,owners,replica", [
    ((), (), (), 0),  # no ring
    (("a:1", "b:2"), ("x",), (0, 1), 0),  # a fellow missing
    (("a:1", "b:2"), ("x", "y"), (0, 2), 0),  # a part kept outside the ring
    (("a:1", ""), ("x", ""), (0, 1), 0),  # a part kept by a replica out of the rounds
    (("a:1", "b:2"), ("x", "y"), (0, 1), 2),  # this replica not in it
])
def test_a_malformed_ring_round_is_refused(addrs: tuple[str, ...], fellows: tuple[str, ...],
                                           owners: tuple[int, ...], replica: int) -> None:
    with pytest.raises(RemoteProtocolError):
        StageRing.check(RingRound(1, 1.0, addrs, fellows, owners), replica)


async def test_a_last_round_whose_update_never_comes_ends_where_the_ring_stands(
        autojump_clock: trio.testing.MockClock) -> None:
    """A last round waits for its own update at most ``wait_s``, then answers with the
    version its stage stands at: a job ends from what its ring closed, never stalls nor
    pauses a replica at its end (here part 1's keeper never closes its round)."""
    from typing import Any, cast

    from p2pswarm.agent.training.ring import RingTraffic, StreamPartNet

    net = MemoryPartNet()
    p = torch.ones(64)
    mine = AllReduceFellow("0", ["0", "1"], PartedSync(LocalSync([p], PLAIN), 2), net,
                           net.attach("0"), round_deadline_s=PLAIN.round_deadline_s)
    net.attach("1")  # its fellow never answers
    p.add_(0.01)  # its local training
    ring = StageRing(mine, StreamPartNet(cast(Any, None), "job", 0, RingTraffic()),
                     trio.open_memory_channel[Any](0)[0], ("aa", "bb"))
    msg = RingRound(4, 5.0, ("a:1", "b:2"), ("aa", "bb"), (0, 1), last=True)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(mine.run)  # its own part closes; the other fellow is silent
        began = trio.current_time()
        assert await ring.round(msg, inline) == 0
        assert 5.0 <= trio.current_time() - began < 6.0
        assert ring.in_flight is None and not ring.failed
        nursery.cancel_scope.cancel()
