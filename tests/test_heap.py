"""The C heap of a long-lived fellow: tuned for frames, its free pages handed back."""

from __future__ import annotations

import platform

import pytest
import trio
import trio.testing

from p2pswarm.agent import heap

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's allocator")


@glibc
def test_the_allocator_takes_every_setting_and_trims() -> None:
    assert heap.tune_allocator()
    trim = heap.heap_trimmer()
    assert trim is not None
    held = [bytearray(1 << 20) for _ in range(64)]
    del held[::2]  # holes in the heap: free pages for the trim to hand back
    assert isinstance(trim(), bool)


async def test_free_pages_are_handed_back_after_a_minute_not_before(
        monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.testing.MockClock) -> None:
    calls: list[int] = []

    def trim() -> bool:
        calls.append(1)
        return True

    monkeypatch.setattr(heap, "heap_trimmer", lambda: trim)
    with trio.move_on_after(59):
        await heap.give_back_free_heap(every_s=60)
    assert not calls
    with trio.move_on_after(61):
        await heap.give_back_free_heap(every_s=60)
    assert calls


async def test_off_glibc_nothing_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(heap, "_libc", lambda: None)
    assert not heap.tune_allocator()
    await heap.give_back_free_heap(every_s=0)  # returns at once
