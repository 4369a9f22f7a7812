"""Batched decode at one stage: the decode steps of the sessions waiting for a stage run
together, as one forward pass.

Every session at a stage has its own task (``stage_session``); a decode step it receives
joins the stage's pending steps. Whichever session finds the stage idle runs the batch:
every step pending once the loop has had one turn, in one call of ``run_batch`` (each session at its own
position). Steps that arrive meanwhile wait for the next batch, which one of them runs as
soon as this one ends. So with a pipeline of three stages, three groups of sessions keep
all three busy: while stage 1 runs one group's step, stage 0 runs the next group's.

A batch of one is the single-session step, exactly as before batching. A batch that fails
is run again step by step, so an error lands on the session that caused it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import trio

S = TypeVar("S")  # one step's input
R = TypeVar("R")  # one step's result


@dataclass
class _Pending(Generic[S, R]):
    item: S
    done: bool = False
    result: R | None = None
    error: BaseException | None = None


@dataclass
class DecodeBatcher(Generic[S, R]):
    """``run_one`` runs a single step, ``run_batch`` several (one result each, in order);
    both are awaited, under the stage's own limiter."""

    run_one: Callable[[S], Awaitable[R]]
    run_batch: Callable[[Sequence[S]], Awaitable[list[R]]]
    max_batch: int = 64
    _pending: list[_Pending[S, R]] = field(default_factory=list)
    _running: bool = False
    _turn: trio.Event = field(default_factory=trio.Event)
    batches: int = 0  # batches run, and steps in them (for the figures)
    steps: int = 0

    async def step(self, item: S) -> R:
        mine: _Pending[S, R] = _Pending(item)
        self._pending.append(mine)
        try:
            while not mine.done:
                if self._running:
                    await self._turn.wait()
                    continue
                await self._run_next()
        finally:
            if not mine.done and mine in self._pending:  # cancelled while it waited
                self._pending.remove(mine)
        if mine.error is not None:
            raise mine.error
        return mine.result  # type: ignore[return-value]

    async def _run_next(self) -> None:
        self._running = True
        batch: list[_Pending[S, R]] = []
        try:
            # one turn of the loop first: sessions whose steps have already arrived (a
            # step run inline holds the loop, so they queue up behind it) join this batch
            await trio.lowlevel.checkpoint()
            batch, self._pending = (self._pending[:self.max_batch],
                                    self._pending[self.max_batch:])
            if not batch:
                return
            if len(batch) == 1:
                await self._settle(batch[0])
            else:
                try:
                    results = await self.run_batch([p.item for p in batch])
                except Exception:  # one session's bad step: find it, step by step
                    for p in batch:
                        await self._settle(p)
                else:
                    for p, r in zip(batch, results):
                        p.result, p.done = r, True
            self.batches += 1
            self.steps += len(batch)
        finally:
            self._pending[:0] = [p for p in batch if not p.done]  # cancelled mid-way: again
            self._running = False
            turn, self._turn = self._turn, trio.Event()
            turn.set()

    async def _settle(self, p: _Pending[S, R]) -> None:
        try:
            p.result = await self.run_one(p.item)
        except Exception as exc:
            p.error = exc
        p.done = True
