"""The leader's load record: its document keeps the keys, values and order a plain map
had, and a driver reads it back (``LoadRecord.from_doc``) as the same load."""

from __future__ import annotations

from p2pswarm.agent.serving.leader_load import (
    Adopted,
    CopyAhead,
    CopyTaken,
    LeaderLoad,
    LoadRecut,
    StageMoved,
)
from p2pswarm.agent.serving.records import LoadRecord, runtime_block
from p2pswarm.planner.plan_values import StagePlan
from p2pswarm.wire.loads import RouteHop
from p2pswarm.wire.orders import pack_doc, unpack_doc

HOPS = (RouteHop(0, "aa", "a", "10.0.0.1:1", 0, 2, "cuda:0 (X)", 10, 9, 8, 0.5),
        RouteHop(1, "bb", "b", "10.0.0.2:1", 2, 4, "cpu", 10, 9, 0, 0.0))
RUNTIME = runtime_block({"dtype": "float32", "max_sessions": 3, "prefill_chunk_tokens": 64,
                         "max_context_tokens": 512})


def _load() -> LeaderLoad:
    return LeaderLoad("p1", {"kind": "builtin", "name": "tiny"}, RUNTIME, HOPS)


def _moved(stage: int) -> StageMoved:
    return StageMoved(1.0, stage, (0, 2), "a", "aa", "c", "cc", "cpu", "lost", 0.25)


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
    record = LoadRecord.from_doc(unpack_doc(pack_doc(doc)))  # as a driver reads it
    assert record.plan_id == "p1" and record.stages == HOPS
    assert (record.max_sessions, record.prefill_chunk_tokens, record.context_tokens) == \
        (3, 64, 512)


def test_optional_keys_keep_the_order_they_were_set_in() -> None:
    load = _load()
    load.set_adopted(Adopted(1.0, 3, "a"))
    load.set_waiting("no card")
    load.set_faster(None)
    load.add_move(_moved(0), kept=2)
    load.set_waiting("")  # popped: a later one goes last
    load.set_copies((CopyAhead(1, "c", "cc", taken=CopyTaken(5, 4, 0.5, 2.0)),
                     CopyAhead(0, "d", "dd", since=3.0)))
    load.set_waiting("still no card")
    load.add_move(_moved(1), kept=2)
    load.add_move(_moved(0), kept=2)  # the oldest goes; the key keeps its place
    doc = load.to_doc()
    assert list(doc)[4:] == ["adopted", "moves", "copies", "waiting"]
    assert doc["adopted"] == {"at": 1.0, "term": 3, "leader": "a"}
    assert [m["stage"] for m in doc["moves"]] == [1, 0]
    assert doc["moves"][0] == {"at": 1.0, "stage": 1, "layers": [0, 2], "from": "a",
                               "from_id": "aa", "to": "c", "to_id": "cc", "card": "cpu",
                               "why": "lost", "took_s": 0.25}
    assert doc["copies"] == [
        {"stage": 1, "fellow": "c", "fellow_id": "cc", "state": "held", "bytes": 5,
         "fetched_bytes": 4, "took_s": 0.5, "at": 2.0},
        {"stage": 0, "fellow": "d", "fellow_id": "dd", "state": "copying", "since": 3.0}]
    load.set_copies(())
    assert list(load.to_doc())[4:] == ["adopted", "moves", "waiting"]


def test_a_re_cut_load_names_its_former_plans() -> None:
    load = _load()
    load.set_load_s(0.25)
    stage = StagePlan(0, "aa", "a", 0, "cuda", "X", (0, 4), 0.01)
    recut = LoadRecut(2.0, "p0", "p1", 3, (stage,), 4.0, 2.0, "faster", 1.0)
    load.set_moves((recut,))
    load.set_recut_from(("p0",))
    doc = load.to_doc()
    assert doc["recut_from"] == ["p0"] and list(doc)[-2:] == ["moves", "recut_from"]
    assert list(doc["moves"][0]) == ["at", "recut", "from_plan", "to_plan", "stages_before",
                                     "stages", "ms_per_token_now", "ms_per_token_after",
                                     "why", "took_s"]
    assert doc["moves"][0]["stages"] == [{"stage": 0, "layers": [0, 4], "fellow": "a",
                                          "fellow_id": "aa", "card": "X"}]
    record = LoadRecord.from_doc(doc)
    assert record.recut_from == ("p0",) and record.continues(
        LoadRecord.from_doc({**doc, "plan_id": "p0"}))
