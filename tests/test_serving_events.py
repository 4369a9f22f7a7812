"""Load events run their listeners in the order they subscribed, awaited one by one; the
weights in use are the union of every source's."""

from __future__ import annotations

from p2pswarm.agent.serving.events import LoadEvents, WeightsInUse


async def test_listeners_run_in_the_order_they_subscribed() -> None:
    events, heard = LoadEvents(), []
    events.on_loaded(lambda: heard.append("watch"))
    events.on_loaded(lambda: heard.append("copies"))
    events.on_unloaded(lambda plan_id: heard.append(f"forget {plan_id}"))

    async def hand_out(plan_id: str, generation: str) -> None:
        heard.append(f"tombstone {plan_id}/{generation}")

    events.on_forgotten(hand_out)
    events.loaded()
    events.unloaded("p")
    await events.forgotten("p", "00ff")
    assert heard == ["watch", "copies", "forget p", "tombstone p/00ff"]


async def test_nothing_subscribed_is_nothing_done() -> None:
    events = LoadEvents()
    events.loaded()
    events.unloaded("p")
    await events.forgotten("p", "00ff")
    assert WeightsInUse()() == set()


def test_the_weights_in_use_are_every_sources() -> None:
    in_use = WeightsInUse()
    in_use.add(lambda: {"a", "b"})
    in_use.add(lambda: frozenset({"b", "c"}))
    assert in_use() == {"a", "b", "c"}
