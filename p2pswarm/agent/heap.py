"""The C heap of a long-lived fellow: fast for megabyte frames, bounded over days.

glibc trims the heap each time a megabyte-sized frame buffer is freed and grows it again
for the next one, which costs more than sealing the frame; so ``tune_allocator`` pads the
heap top and raises the trim threshold (1 MiB frames 3-4x faster). The price is that each
arena then keeps up to the threshold plus the pad of freed memory, and glibc gives every
thread that allocates at once its own arena, up to eight per core: a fellow that writes
checkpoints and runs torch in worker threads held a gigabyte more after an hour of
leading. So the arenas are capped, and ``give_back_free_heap`` hands freed pages back
every so often, between frames rather than after each one.
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections.abc import Callable

import trio

log = logging.getLogger("p2pswarm.agent")

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -2, -3, -8
ARENAS = 2  # the loop's thread and one worker at a time: more only holds more free memory
GIVE_BACK_EVERY_S = 60.0


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    return libc if all(hasattr(libc, f) for f in ("mallopt", "malloc_trim")) else None


def tune_allocator(pad_bytes: int = 64 * 1024 * 1024) -> bool:
    """Keep freed heap memory for the next frame, in at most ``ARENAS`` arenas. No-op off
    glibc."""
    libc = _libc()
    if libc is None:
        return False
    # Setting any of these turns off glibc's adaptive mmap threshold, so set that one too:
    # frames up to 32 MiB (glibc's ceiling) come from the heap, not from fresh mmaps.
    return all(libc.mallopt(option, value) == 1 for option, value in (
        (M_MMAP_THRESHOLD, 32 * 1024 * 1024),
        (M_TRIM_THRESHOLD, 4 * pad_bytes),
        (M_TOP_PAD, pad_bytes),
        (M_ARENA_MAX, ARENAS),
    ))


def heap_trimmer() -> Callable[[], bool] | None:
    """A call that hands every arena's free pages back to the OS; None off glibc."""
    libc = _libc()
    if libc is None:
        return None
    trim = libc.malloc_trim
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda: bool(trim(0))


async def give_back_free_heap(every_s: float = GIVE_BACK_EVERY_S) -> None:
    """Every ``every_s``, in a worker thread, hand freed heap pages back to the OS."""
    trim = heap_trimmer()
    if trim is None:
        return
    while True:
        await trio.sleep(every_s)
        began = time.perf_counter()
        await trio.to_thread.run_sync(trim)
        log.debug("heap trimmed in %.1f ms", 1000 * (time.perf_counter() - began))
