"""Batched decode at one stage: the decode steps of the sessions waiting for a stage run
together, as one forward pass.

Every session at a stage has its own task (``stage_session``); a decode step it receives
joins the stage's pending steps. Whichever session finds the stage idle runs the batch:
every step pending once the loop has had one turn, in one call of ``run_batch`` (each
session at its own position). Steps that arrive meanwhile wait for the next batch, which
one of them runs as soon as this one ends.

A batch that holds fewer steps than the stage has sessions decoding (``members``) first
waits a little for the others: at most as long as the last batch took, and never past
``MAX_WAIT_S``. On a machine whose cores the stages share, a stage computing a small
batch only takes the core from its neighbours, and a batch of eight costs little more
than a batch of one; so groups of sessions that drifted apart around the ring merge
again (each wait closes the gap to the group behind), and the pipeline settles into
large batches. A session that lags (its driver's client is slow, it is prefilling) holds
the others up by that bounded wait per step at most; a lone session never waits.

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

MAX_WAIT_S = 0.1  # the most a batch waits for the stage's other decoding sessions


@dataclass
class _Pending(Generic[S, R]):
    item: S
    session: str
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
    _arrived: trio.Event = field(default_factory=trio.Event)  # a step pending, a member left
    members: set[str] = field(default_factory=set)  # sessions decoding at this stage
    last_batch_s: float = 0.0
    batches: int = 0  # batches run, and steps in them (for the figures)
    steps: int = 0

    def leave(self, session: str) -> None:
        """``session`` decodes no more here (it ended): a batch no longer waits for it."""
        self.members.discard(session)
        self._wake()

    def _wake(self) -> None:
        arrived, self._arrived = self._arrived, trio.Event()
        arrived.set()

    async def step(self, item: S, session: str = "") -> R:
        mine: _Pending[S, R] = _Pending(item, session)
        self._pending.append(mine)
        self.members.add(session)
        self._wake()
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
            await self._gather()
            began = trio.current_time()
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
            self.last_batch_s = trio.current_time() - began
        finally:
            self._pending[:0] = [p for p in batch if not p.done]  # cancelled mid-way: again
            self._running = False
            turn, self._turn = self._turn, trio.Event()
            turn.set()

    async def _gather(self) -> None:
        """Wait (bounded) until every decoding session's step is pending, or the step of
        the first of them by name (the group it is in never waits, so groups merge into
        its group rather than each waiting for the other)."""
        wait = min(self.last_batch_s, MAX_WAIT_S)
        if wait <= 0:
            return
        with trio.move_on_after(wait):
            while (len(self._pending) < min(len(self.members), self.max_batch)
                   and min(self.members, default="") not in {p.session for p in self._pending}):
                await self._arrived.wait()

    async def _settle(self, p: _Pending[S, R]) -> None:
        try:
            p.result = await self.run_one(p.item)
        except Exception as exc:
            p.error = exc
        p.done = True
