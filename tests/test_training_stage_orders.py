"""Two orders for one training stage on one fellow: the newer placement wins, whichever
lands first. A deposed leader and its successor can both order a stage while the first
order's stage is still being built (on a worker thread); the successor's order must not
be refused as "taken twice", or the job waits for its fellows for minutes."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Callable

import pytest

from p2pswarm.agent.training.stage_host import StageHosts, TrainHost
from p2pswarm.errors import PlacementError
from p2pswarm.wire.jobs import TrainPrepare
from p2pswarm.wire.orders import pack_doc

NODE = bytes(range(32))
CONFIG = pack_doc({"model": "tiny-llama", "seq_len": 16, "micro_batch": 2, "steps": 4})


def order(term: int, generation: int) -> TrainPrepare:
    return TrainPrepare("job-1", 0, 0, 2, NODE.hex(), 0, 4, "cpu", 0, 1 << 20, "", CONFIG,
                        generation, term)


def stage_hosts(landing: list[TrainPrepare]) -> StageHosts:
    """A fellow's stage hosts whose stage build lets ``landing``'s orders take the stage
    meanwhile, as a concurrent order does on a real worker thread."""
    hosts = StageHosts.__new__(StageHosts)

    async def run(fn: Callable[[], Any], limiter: Any = None) -> Any:
        built = fn()
        for other in landing:
            hosts.hosts[(other.job_id, other.replica, other.stage)] = TrainHost(
                other, None, SimpleNamespace(stage=None))  # type: ignore[arg-type]
        return built

    card = SimpleNamespace(kind="cpu", index=0, name="CPU", free_bytes=8 << 30)
    hosts.agent = SimpleNamespace(
        node_id=NODE, name="fellow-1", extra_metadata={}, publish_metadata=lambda: None,
        compute=SimpleNamespace(run=run),
        serving=SimpleNamespace(_live_cards=lambda: [card], hosted=False))
    hosts.training = SimpleNamespace(runtime=SimpleNamespace(
        build_stage=lambda order, job: SimpleNamespace(stage=order.term)))
    hosts.hosts = {}
    return hosts


async def test_the_newer_order_wins_whichever_lands_first() -> None:
    older, newer = order(term=1, generation=1), order(term=2, generation=2)
    # the newer order builds while the older one lands: it supersedes it
    hosts = stage_hosts([older])
    await hosts.prepare(newer)
    held = hosts.hosts[("job-1", 0, 0)]
    assert held.term == 2 and held.compute.stage == 2
    # the older order builds while the newer one lands: the older is refused, the newer kept
    hosts = stage_hosts([newer])
    with pytest.raises(PlacementError, match="already holds stage 0"):
        await hosts.prepare(older)
    assert hosts.hosts[("job-1", 0, 0)].term == 2


async def test_an_order_as_new_as_the_stage_held_is_refused() -> None:
    hosts = stage_hosts([])
    await hosts.prepare(order(term=2, generation=2))
    with pytest.raises(PlacementError, match="already holds stage 0"):
        await hosts.prepare(order(term=2, generation=2))
    superseded = hosts.hosts[("job-1", 0, 0)]
    await hosts.prepare(order(term=3, generation=3))  # a later placement takes it over
    assert superseded.superseded and superseded.done.is_set()
    assert hosts.hosts[("job-1", 0, 0)].term == 3
