"""The leader's load record: its document keeps the keys, values and order a plain map
had, and reads back as the same record."""

from __future__ import annotations

from p2pswarm.agent.serving.leader_load import LeaderLoad
from p2pswarm.wire.loads import RouteHop

HOPS = (RouteHop(0, "aa", "a", "10.0.0.1:1", 0, 2, "cuda:0 (X)", 10, 9, 8, 0.5),
        RouteHop(1, "bb", "b", "10.0.0.2:1", 2, 4, "cpu", 10, 9, 0, 0.0))


def _load() -> LeaderLoad:
    return LeaderLoad("p1", {"kind": "builtin", "name": "tiny"}, {"dtype": "float32"}, HOPS)


def test_a_brought_up_load_is_the_document_it_was() -> None:
    load = _load()
    load.set_load_s(1.5)
    load.set_adapter({"name": "x"})
    doc = load.to_doc()
    assert list(doc) == ["plan_id", "model", "runtime", "stages", "load_s", "adapter"]
    assert doc["stages"][0] == {
        "stage": 0, "fellow_id": "aa", "fellow": "a", "addr": "10.0.0.1:1", "layers": [0, 2],
        "card": "cuda:0 (X)", "claim_bytes": 10, "allocated_bytes": 9, "fetched_bytes": 8,
        "fetch_s": 0.5}
    back = LeaderLoad.from_doc(doc)
    assert back.to_doc() == doc and list(back.to_doc()) == list(doc)
    assert back.stages == HOPS and back.fellow_ids == ("aa", "bb")


def test_optional_keys_keep_the_order_they_were_set_in() -> None:
    load = _load()
    load.set_adopted({"at": 1.0, "term": 3, "leader": "a"})
    load.set_waiting("no card")
    load.set_faster({"plan_id": "p2"})
    load.add_move({"stage": 0}, kept=2)
    load.set_waiting("")  # popped: a later one goes last
    load.set_copies(({"stage": 1, "state": "held"},))
    load.set_waiting("still no card")
    load.add_move({"stage": 1}, kept=2)
    load.add_move({"stage": 0}, kept=2)  # the oldest goes; the key keeps its place
    doc = load.to_doc()
    assert list(doc)[4:] == ["adopted", "faster", "moves", "copies", "waiting"]
    assert doc["moves"] == [{"stage": 1}, {"stage": 0}]
    load.set_faster(None)
    load.set_copies(())
    assert list(load.to_doc())[4:] == ["adopted", "moves", "waiting"]
    back = LeaderLoad.from_doc(load.to_doc())
    assert list(back.to_doc()) == list(load.to_doc()) and back.waiting == "still no card"


def test_a_re_cut_load_names_its_former_plans() -> None:
    load = _load()
    load.set_load_s(0.25)
    load.set_moves(({"recut": True},))
    load.set_recut_from(("p0",))
    doc = load.to_doc()
    assert doc["recut_from"] == ["p0"] and list(doc)[-2:] == ["moves", "recut_from"]
    assert LeaderLoad.from_doc(doc).recut_from == ("p0",)
