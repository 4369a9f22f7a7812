"""What is loaded, as the ``loads`` listing shows it: a led load is its record with each
stage's state, a gossiped one its first stage's blocks with the route it says; the
documents keep the keys and their order a plain map had."""

from __future__ import annotations

from p2pswarm.agent.fellow_meta import FellowSays
from p2pswarm.agent.serving.leader_load import LeaderLoad
from p2pswarm.agent.serving.load_view import LoadView, ViewHop
from p2pswarm.agent.serving.records import LoadRecord, route_entry, runtime_block, runtime_doc
from p2pswarm.wire.loads import RouteHop

PLAN = "0123456789abcdef"
HOPS = (RouteHop(0, "aa", "a", "10.0.0.1:1", 0, 2, "cpu", 10, 9, 8, 0.5),
        RouteHop(1, "bb", "b", "10.0.0.2:1", 2, 4, "cpu", 10, 9, 0, 0.0))
RUNTIME = runtime_block({"dtype": "float32", "max_sessions": 3, "max_context_tokens": 512})
MODEL = {"kind": "builtin", "name": "tiny"}


def test_a_led_load_shows_its_record_with_each_stage_state() -> None:
    load = LeaderLoad(PLAN, MODEL, RUNTIME, HOPS)
    load.set_load_s(1.5)
    view = LoadView(PLAN, (ViewHop.led(HOPS[0], "alive"), ViewHop.led(HOPS[1], "dead")), load)
    doc = view.to_doc()
    assert list(doc) == ["plan_id", "model", "runtime", "stages", "load_s", "complete"]
    assert doc["stages"][0] == {
        "stage": 0, "fellow_id": "aa", "fellow": "a", "addr": "10.0.0.1:1", "layers": [0, 2],
        "card": "cpu", "claim_bytes": 10, "allocated_bytes": 9, "fetched_bytes": 8,
        "fetch_s": 0.5, "state": "alive"}
    assert list(doc["stages"][0])[-1] == "state"
    assert doc["complete"] is False and view.live == {0: ("aa", "a", "10.0.0.1:1")}
    assert [h.fellow_id for h in LoadRecord.from_doc(doc).stages] == ["aa", "bb"]


def test_a_gossiped_load_shows_the_route_its_first_stage_says() -> None:
    entry = {"plan_id": PLAN, "stage": 0, "n_stages": 2, "layers": [0, 2], "card": "cpu",
             "claim_bytes": 10, "allocated_bytes": 9, "runtime": runtime_doc(RUNTIME),
             "model": MODEL, "route": [route_entry(h) for h in HOPS]}
    (said,) = FellowSays.from_doc({"stages": [entry]}).stages
    assert said.route is not None
    hops = [ViewHop.said(h, h.fellow_id, h.fellow, h.addr) for h in said.route]
    own = ViewHop.said(said, "aa", "a-renamed", "10.0.0.9:1")
    stages = (hops[0].over(own).with_state("alive"), hops[1].with_state("suspect"))
    view = LoadView(PLAN, stages, said)
    doc = view.to_doc()
    assert list(doc) == ["plan_id", "model", "runtime", "stages", "complete"]
    assert doc["stages"][0] == {
        "stage": 0, "fellow_id": "aa", "fellow": "a-renamed", "addr": "10.0.0.9:1",
        "layers": [0, 2], "card": "cpu", "claim_bytes": 10, "allocated_bytes": 9,
        "state": "alive"}
    assert doc["runtime"] == runtime_doc(RUNTIME) and doc["complete"] is True
    assert sorted(view.live) == [0, 1]
    # a fellow that says less of a hop shows less
    bare = ViewHop(1, "bb", "b", "10.0.0.2:1", (2, 4))
    assert list(bare.to_doc()) == ["stage", "fellow_id", "fellow", "addr", "layers", "state"]
