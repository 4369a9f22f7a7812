"""Datagrams on their way out: sealed here, queued for one sender task, counted.

A transport that takes a datagram without waiting (``MemoryNetwork``) is sent to
directly, with no queue and no task. Otherwise datagrams wait in a bounded queue
(``OUTBOX_DATAGRAMS``; past it new ones are dropped and counted) for the sender task, and
a leaver can wait until every datagram posted so far has been handed on (``flush``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import trio

from p2pswarm import wire
from p2pswarm.agent.counters import Counters
from p2pswarm.errors import SwarmError, TransportError
from p2pswarm.security import DatagramSealer
from p2pswarm.transport.base import SendsNowait, Transport

log = logging.getLogger("p2pswarm.agent")

OUTBOX_DATAGRAMS = 4096  # datagrams waiting for the sender task before new ones are dropped


class Outbox:
    """Seals messages into datagrams and hands them to the transport, in order."""

    def __init__(self, transport: Transport, sealer: DatagramSealer, counters: Counters,
                 max_datagram_bytes: int, capacity: int = OUTBOX_DATAGRAMS) -> None:
        self._transport = transport
        self._sealer = sealer
        self._counters = counters
        self._max_datagram_bytes = max_datagram_bytes
        self._in, self._out = trio.open_memory_channel[tuple[str, bytes]](capacity)
        # a transport that takes a datagram without waiting (in memory) is sent to directly
        self._send_now: Callable[[str, bytes], None] | None = \
            transport.send_datagram_nowait if isinstance(transport, SendsNowait) else None
        self._posted = 0  # datagrams queued, and handed on from the queue:
        self._handled = 0  # equal when it is empty (a leaver waits for that)
        self._progress: trio.Event | None = None

    @property
    def needs_sender(self) -> bool:
        """Whether ``run`` must drain the queue (the transport may make us wait)."""
        return self._send_now is None

    def post(self, addr: str, messages: tuple[Any, ...]) -> None:
        """Seal ``messages`` into one datagram to ``addr``."""
        try:
            plaintext = wire.encode(*messages)
        except SwarmError as exc:
            log.warning("not sent to %s: %s", addr, exc)
            self._counters.drop("encode-failed")
            return
        self.post_sealed(addr, self._sealer.seal(plaintext))

    def post_packed(self, addr: str, messages: tuple[Any, ...]) -> None:
        """Seal ``messages`` to ``addr``, several to a datagram where they fit."""
        budget = self._max_datagram_bytes - self._sealer.overhead_bytes
        packets, too_large = wire.pack_compound(messages, budget)
        for msg in too_large:
            log.warning("not sent to %s: %s does not fit in a datagram", addr, type(msg).__name__)
        for plaintext in packets:
            self.post_sealed(addr, self._sealer.seal(plaintext))

    def post_sealed(self, addr: str, packet: bytes) -> None:
        if self._send_now is not None:  # a transport that never waits: no sender task
            try:
                self._send_now(addr, packet)
            except TransportError as exc:
                self._send_failed(addr, exc)
            else:
                self._sent(packet)
            return
        try:
            self._in.send_nowait((addr, packet))
        except trio.WouldBlock:
            self._counters.drop("outbox-full")
        else:
            self._posted += 1

    async def run(self) -> None:
        """The sender task: hand each queued datagram to the transport."""
        async for addr, packet in self._out:
            try:
                await self._transport.send_datagram(addr, packet)
            except TransportError as exc:
                self._send_failed(addr, exc)
            else:
                self._sent(packet)
            self._handled += 1
            if self._progress is not None:
                self._progress.set()

    async def flush(self) -> None:
        """Until every datagram posted so far has been handed to the transport."""
        posted = self._posted
        while self._handled < posted:
            self._progress = trio.Event()
            await self._progress.wait()

    def _sent(self, packet: bytes) -> None:
        self._counters.datagrams_out += 1
        self._counters.bytes_out += len(packet)

    def _send_failed(self, addr: str, exc: TransportError) -> None:
        log.debug("send to %s failed: %s", addr, exc)
        self._counters.drop("send-failed")


__all__ = ["OUTBOX_DATAGRAMS", "Outbox"]
