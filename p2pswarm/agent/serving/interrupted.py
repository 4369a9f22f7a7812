"""Caches a stage keeps for a while after a session's stream broke, so that a generation
resumed after a failover continues from them instead of replaying its tokens here.

A session whose stream breaks (a neighbour lost, the driver's stream gone) without a
``SessionEnd`` is not ended at a surviving stage: its cache is *kept*, like a chat's
between turns (``KVCache.keep``), so it stays within the slots the plan gave the stage and
is the first to go when a new session needs one. It is dropped when ``keep_s`` passes
without the session coming back, and whenever a ``SessionOpen`` for it arrives (which
takes it back, or starts it afresh). Whether a cache may be reused is decided by the
stage when the resumed session opens: the same session id, and at least the positions the
driver resumes from (``Stage.resume_session``); anything else starts afresh.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import trio

if TYPE_CHECKING:
    from p2pswarm.agent.serving.ports import InterruptedPort
    from p2pswarm.agent.serving.records import HostedStage

KEEP_INTERRUPTED_S = 120.0  # a broken session's cache waits this long for its driver

Key = tuple[str, int, str]  # plan, stage, session


class InterruptedCaches:
    def __init__(self, agent: InterruptedPort) -> None:
        self.agent = agent
        self.keep_s = KEEP_INTERRUPTED_S
        self._marks: dict[Key, object] = {}
        self.dropped = 0  # caches dropped because their grace ran out
        self.taken_over = 0  # runs a resumed session ended here (their neighbour silent)

    @staticmethod
    def key(hosted: HostedStage, session: str) -> Key:
        return hosted.order.plan_id, hosted.order.stage, session

    def __contains__(self, key: Key) -> bool:
        return key in self._marks

    async def keep(self, hosted: HostedStage, session: str) -> None:
        """Keep ``session``'s cache at ``hosted`` for ``keep_s`` (call it when the session
        is no longer running there)."""
        stage = hosted.stage
        if stage is None or session not in stage.sessions:
            return
        await self.agent.compute.run(lambda: stage.keep_session(session), hosted.limiter)
        mark = object()
        self._marks[self.key(hosted, session)] = mark
        self.agent.spawn(self._drop_after_grace, hosted, session, mark)

    def claim(self, hosted: HostedStage, session: str) -> None:
        """A ``SessionOpen`` for ``session`` arrived: its cache is no longer waiting."""
        self._marks.pop(self.key(hosted, session), None)

    async def _drop_after_grace(self, hosted: HostedStage, session: str,
                                mark: object) -> None:
        await trio.sleep(self.keep_s)
        key = self.key(hosted, session)
        if self._marks.get(key) is not mark:
            return  # taken back (or started afresh) in the meantime
        del self._marks[key]
        stage = hosted.stage
        if stage is None or session in stage.sessions:
            return  # unloaded; or running again (it never is without a claim)
        self.dropped += 1
        await self.agent.compute.run(lambda: stage.end_session(session), hosted.limiter)


__all__ = ["KEEP_INTERRUPTED_S", "InterruptedCaches"]
