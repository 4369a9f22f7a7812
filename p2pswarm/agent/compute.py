"""Where blocking compute (torch) runs: on worker threads below the loop, or inline.

Real agents run a stage's forward pass or a training step on a worker thread so the trio
loop keeps gossiping. Those threads are the agent's own pool, not trio's shared thread
cache, and each lowers its own priority by ``nice`` levels when it starts (Linux nice is
per thread, and threads torch's OpenMP starts from one inherit it): while a fellow trains
on every core, the loop that beats, answers probes and votes still gets a core when it
wakes, instead of queueing behind the training. Raising one's own nice needs no
privilege (a user, a container); lowering it back would, so trio's cached threads, which
run other work too, are left alone.

Simulations run compute inline: virtual time does not pass during it, and a thread
would make the run depend on the real clock.
"""

from __future__ import annotations

import contextvars
import logging
import os
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, TypeVar

import trio

from p2pswarm.config import ComputeConfig

T = TypeVar("T")
log = logging.getLogger("p2pswarm.agent")
MAX_WORKERS = 40  # as trio's default thread limit: compute callers rarely hold a limiter
MAX_NICE = 19


def lower_priority(nice: int) -> int | None:
    """Lower the calling thread's priority by ``nice`` levels (at most to 19); the nice
    value it now has, or None where a thread's own cannot be set (not Linux, or refused)."""
    if nice <= 0 or not sys.platform.startswith("linux"):
        return None
    thread = threading.get_native_id()
    try:
        # on Linux, PRIO_PROCESS with a thread id is that thread alone
        now = os.getpriority(os.PRIO_PROCESS, thread)
        wanted = min(MAX_NICE, now + nice)
        if wanted > now:
            os.setpriority(os.PRIO_PROCESS, thread, wanted)
        return os.getpriority(os.PRIO_PROCESS, thread)
    except OSError as exc:  # a sandbox that forbids it: compute runs as before
        log.warning("cannot lower the compute threads' priority (%s); they compete with "
                    "the agent's loop", exc)
        return None


class Compute:
    def __init__(self, *, inline: bool = False, nice: int = ComputeConfig().nice) -> None:
        self.inline = inline
        self.nice = max(0, min(MAX_NICE, nice))
        self._pool: ThreadPoolExecutor | None = None

    async def run(self, fn: Callable[[], T], limiter: trio.CapacityLimiter | None = None) -> T:
        """``fn()`` on a worker thread (one at a time under ``limiter``), or inline."""
        if not self.inline:
            if limiter is None:
                return await self._on_worker(fn)
            holder = object()  # as trio.to_thread: the thread, not this task, holds it
            await limiter.acquire_on_behalf_of(holder)
            try:
                return await self._on_worker(fn)
            finally:
                limiter.release_on_behalf_of(holder)
        if limiter is None:
            return fn()
        async with limiter:
            return fn()

    async def _on_worker(self, fn: Callable[[], T]) -> T:
        """``fn()`` on one of the pool's threads; like ``trio.to_thread.run_sync``, a
        cancellation waits for it to return (torch cannot be interrupted midway)."""
        await trio.lowlevel.checkpoint_if_cancelled()
        token = trio.lowlevel.current_trio_token()
        done = trio.Event()

        def wake(_: Future[T]) -> None:
            try:
                token.run_sync_soon(done.set)
            except trio.RunFinishedError:
                pass

        future = self._workers().submit(contextvars.copy_context().run, fn)
        future.add_done_callback(wake)
        with trio.CancelScope(shield=True):
            await done.wait()
        return future.result()

    def _workers(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(MAX_WORKERS, thread_name_prefix="p2pswarm-compute",
                                            initializer=lower_priority,
                                            initargs=(self.nice,))
        return self._pool

    def close(self) -> None:
        """Let the idle worker threads go (a running one finishes its work first)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None


__all__ = ["Compute", "lower_priority"]
