"""Brute-force reference searches, to check the planner's own searches against.

Exponential in the number of cards: for tests and ``simulations/bench_planner.py`` on
small clusters only. They enumerate the same plan space as ``placement`` (the usable
cards in pipeline order, any subset, contiguous non-empty layer ranges) and share
nothing with the dynamic programme or the binary search but the cost model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from p2pswarm.planner.placement import Placement, Search


def every_placement(n_slots: int, layers: int, stages: int | None = None) -> Iterator[Placement]:
    """Every placement of ``layers`` on ordered subsets of ``n_slots`` slots."""
    def grow(next_slot: int, start: int, so_far: tuple[tuple[int, int], ...]
             ) -> Iterator[Placement]:
        if start == layers:
            if stages is None or len(so_far) == stages:
                yield so_far
            return
        if stages is not None and len(so_far) >= stages:
            return
        for slot in range(next_slot, n_slots):
            for n in range(1, layers - start + 1):
                yield from grow(slot + 1, start + n, so_far + ((slot, n),))
    yield from grow(0, 0, ())


def fastest_exhaustive(search: Search, stages: int | None = None) -> float | None:
    """The least ``search.time_s`` over every placement that fits, or None."""
    best = None
    for placement in every_placement(len(search.slots), search.layers, stages):
        if search.fits(placement):
            cost = search.time_s(placement)
            if best is None or cost < best:
                best = cost
    return best


def most_tokens_exhaustive(search_at: Callable[[int], Search], max_tokens: int, step: int,
                           stages: int | None = None) -> int:
    """The largest multiple of ``step`` up to ``max_tokens`` that some placement holds.

    Per stage shape (slot, layers, first, last), the largest context it holds is found
    by scanning every context; a placement holds the least of its stages'.
    """
    contexts = list(range(step, max_tokens + 1, step))
    if not contexts:
        return 0
    searches = [search_at(t) for t in contexts]
    base = searches[0]
    shape_most: dict[tuple[int, int, bool, bool], int] = {}

    def most(slot: int, n: int, first: bool, last: bool) -> int:
        key = (slot, n, first, last)
        if key not in shape_most:
            held = 0
            for t, s in zip(contexts, searches):
                if n <= s.cap(slot, first, last):
                    held = t
            shape_most[key] = held
        return shape_most[key]

    best = 0
    for placement in every_placement(len(base.slots), base.layers, stages):
        k = len(placement)
        held = min(most(i, n, pos == 0, pos == k - 1) for pos, (i, n) in enumerate(placement))
        best = max(best, held)
    return best


__all__ = ["every_placement", "fastest_exhaustive", "most_tokens_exhaustive"]
