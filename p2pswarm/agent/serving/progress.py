"""Load progress: stage fellows report how far they are with ``LoadProgress`` datagrams
(best effort) to the fellow whose ``load`` is waiting, which streams them to its CLI."""

from __future__ import annotations

from typing import TYPE_CHECKING

from p2pswarm.control.server import Emit
from p2pswarm.errors import SwarmError
from p2pswarm.wire.serving import LoadProgress

if TYPE_CHECKING:
    from p2pswarm.agent.serving.ports import ProgressPort
    from p2pswarm.agent.serving.records import StageOrder


class Progress:
    def __init__(self, agent: ProgressPort) -> None:
        self.agent = agent
        self._sinks: dict[str, Emit] = {}  # ticket -> the waiting CLI's emitter
        agent.on_datagram(LoadProgress, self._on_progress)

    def new_ticket(self, sink: Emit | None) -> str:
        ticket = f"{self.agent.rng.getrandbits(64):016x}"
        if sink is not None:
            self._sinks[ticket] = sink
        return ticket

    def done(self, ticket: str) -> None:
        self._sinks.pop(ticket, None)

    def _on_progress(self, msg: LoadProgress, sender: bytes, addr: str) -> None:
        sink = self._sinks.get(msg.ticket)
        if sink is not None:
            sink({"progress": {"stage": msg.stage, "fellow": msg.fellow, "phase": msg.phase,
                               "done_bytes": msg.done_bytes, "total_bytes": msg.total_bytes}})

    async def report(self, order: StageOrder, phase: str, done: int, total: int) -> None:
        """Tell the fellow waiting on ``order``'s load how far this stage is."""
        if not order.progress_addr or not order.ticket:
            return
        msg = LoadProgress(order.ticket, order.stage, self.agent.name, phase, done, total)
        if order.progress_addr == self.agent.addr:
            self._on_progress(msg, self.agent.node_id, self.agent.addr)
            return
        try:
            await self.agent.send(order.progress_addr, msg)
        except SwarmError:
            pass  # progress is best effort
