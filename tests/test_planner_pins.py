"""The planner's side of pins: equal cards tie by id, not by free memory; exclusions are
hashed by fellow id; a shown placement re-evaluated on a view where memory moved."""

from __future__ import annotations

import copy
from typing import Any

from p2pswarm.planner import cluster_from_dict, pin_from_plan, plan_pinned, request_from_dict
from tests.planner_cases import GB, MB, MID, card, cluster, fellow, make

LOW_FLOORS = {"cuda": 100 * MB, "cpu": 100 * MB}


def three_alike(free: tuple[float, float, float]) -> dict[str, Any]:
    return cluster(*(fellow(f"f{i}", card(0, free=f, total=4.0)) for i, f in enumerate(free)))


def pinned(data: dict[str, Any], shown: Any, **request: Any) -> Any:
    pin = pin_from_plan(shown.to_dict())
    assert pin is not None
    return plan_pinned(MID, cluster_from_dict(data), request_from_dict(request), pin)


def test_an_exclusion_by_name_or_by_id_is_one_plan() -> None:
    data = cluster(fellow("id-1", card(0, free=8), name="box"),
                   fellow("id-2", card(0, free=8), name="other"))
    by_name = make(MID, data, exclude=["box:0"])
    by_id = make(MID, data, exclude=["id-1:0"])
    assert by_name.plan_id == by_id.plan_id
    assert by_name.request.exclude == ("id-1:0",)


def test_equal_cards_tie_by_id_whatever_their_free_memory_says() -> None:
    request = {"floors_bytes": LOW_FLOORS, "context": 2048, "stages": 2}
    base = make(MID, three_alike((3.0, 3.0, 3.0)), **request)
    assert [s.fellow_id for s in base.stages] == ["f0", "f1"]
    for noise in ((3.2, 2.9, 3.1), (2.8, 3.0, 3.25), (2.9, 3.1, 3.3)):
        assert make(MID, three_alike(noise), **request).plan_id == base.plan_id
    # where the room matters (less than the whole model would claim), a card materially
    # roomier is preferred and takes more layers
    roomy = make(MID, three_alike((0.7, 0.7, 1.4)), **request)
    assert [(s.fellow_id, s.layers) for s in roomy.stages] == [("f0", (0, 6)), ("f2", (6, 16))]


def test_a_shown_placement_holds_while_memory_moves_within_its_headroom() -> None:
    # a context that fills the cards: free memory decides how the layers are split
    request = {"floors_bytes": LOW_FLOORS, "context": 8192, "sequences": 8}
    shown = make(MID, three_alike((3.0, 3.0, 3.0)), **request)
    assert shown.fits and len(shown.stages) >= 2
    moved = three_alike((3.6, 2.7, 3.4))  # past the band: a new plan splits otherwise
    assert make(MID, moved, **request).plan_id != shown.plan_id
    held = pinned(moved, shown, **request)
    assert held is not None and held.plan_id == shown.plan_id
    assert [(s.fellow_id, s.layers) for s in held.stages] == \
        [(s.fellow_id, s.layers) for s in shown.stages]
    # its cards show the memory as it is now
    assert {c.fellow_id: c.free_bytes for c in held.cards} == \
        {"f0": int(3.6 * GB), "f1": int(2.7 * GB), "f2": int(3.4 * GB)}


def claims_of(shown: Any, fellow_id: str) -> int:
    used = next(c for c in shown.cards if c.fellow_id == fellow_id)
    return used.total_bytes - used.segments.other_programs - used.segments.free


def test_a_shown_placement_no_longer_holds_after_a_real_change() -> None:
    request = {"floors_bytes": LOW_FLOORS, "context": 2048, "stages": 2}
    data = three_alike((3.0, 3.0, 3.0))
    shown = make(MID, data, **request)
    used = shown.stages[0].fellow_id
    # its card filled to one byte under its claims
    full = copy.deepcopy(data)
    target = next(f for f in full["fellows"] if f["id"] == used)["cards"][0]
    target["free_bytes"] = claims_of(shown, used) - 1
    assert pinned(full, shown, **request) is None
    target["free_bytes"] = claims_of(shown, used)  # exactly its claims: it holds
    assert pinned(full, shown, **request).plan_id == shown.plan_id
    # below the floor, still above its claims: it holds (the floor is for new plans)
    floor = {**request, "floors_bytes": {"cuda": 2 * GB, "cpu": 2 * GB}}
    shown_floor = make(MID, data, **floor)
    low = copy.deepcopy(data)
    next(f for f in low["fellows"] if f["id"] == used)["cards"][0]["free_bytes"] = int(1.5 * GB)
    assert pinned(low, shown_floor, **floor).plan_id == shown_floor.plan_id
    # its fellow gone, not connected, or training
    gone = copy.deepcopy(data)
    gone["fellows"] = [f for f in gone["fellows"] if f["id"] != used]
    assert pinned(gone, shown, **request) is None
    for flag, value in (("connected", False), ("training", True)):
        flagged = copy.deepcopy(data)
        next(f for f in flagged["fellows"] if f["id"] == used)[flag] = value
        assert pinned(flagged, shown, **request) is None
    # asked for with its card excluded, or for another request: not the shown plan
    assert pinned(data, shown, **request, exclude=[f"{used}:0"]) is None
    other = pinned(data, shown, **{**request, "context": 1024})
    assert other is None or other.plan_id != shown.plan_id


def test_a_maximised_context_is_pinned_at_the_context_it_was_shown_with() -> None:
    request = {"floors_bytes": LOW_FLOORS, "maximize": "context", "sequences": 8}
    shown = make(MID, three_alike((1.0, 1.0, 1.0)), **request)
    roomier = three_alike((1.6, 1.6, 1.6))  # the cards now hold a longer context
    again = make(MID, roomier, **request)
    assert again.request.context > shown.request.context
    held = pinned(roomier, shown, **request)
    assert held is not None and held.plan_id == shown.plan_id
    assert held.request.context == shown.request.context
