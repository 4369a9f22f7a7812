"""Datagrams as they arrive: opened, decoded, their epoch proved, refused or dropped.

A datagram arrives sealed; it is opened (wrong key, tampering, replays are dropped and
counted by reason) and decoded (malformed ones likewise). One from another protocol
version is answered with a ``Refusal``, logged once per address. A datagram sealed under
an epoch the sealer has not seen proved is dropped unless the sender's own signed
``Alive`` in it proves that epoch. Messages neither machine takes go to the handler
registered for their type (``on_datagram``); one with none is dropped and counted.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from p2pswarm import wire
from p2pswarm.agent.counters import Counters
from p2pswarm.errors import AuthenticationError, RemoteProtocolError, VersionMismatch
from p2pswarm.security import DatagramSealer, OpenedDatagram
from p2pswarm.wire.base import Refusal
from p2pswarm.wire.gossip import Alive

log = logging.getLogger("p2pswarm.agent")

DatagramHandler = Callable[[Any, bytes, str], None]  # (message, sender node id, sender addr)
Post = Callable[[str, tuple[Any, ...]], None]  # seal messages into a datagram to addr


_LOGGED_REFUSALS_MAX = 1024  # (address, reason) pairs remembered so each logs once


class Intake:
    def __init__(self, sealer: DatagramSealer, counters: Counters, max_datagram_bytes: int,
                 post: Post) -> None:
        self._sealer = sealer
        self._counters = counters
        self._max_datagram_bytes = max_datagram_bytes
        self._post = post
        self._handlers: dict[type, DatagramHandler] = {Refusal: self._on_refusal}
        self._refused_addrs: set[str] = set()
        self._refusals_logged: set[tuple[str, str]] = set()

    def on_datagram(self, message_type: type, handler: DatagramHandler) -> None:
        self._handlers[message_type] = handler

    def _on_refusal(self, msg: Refusal, sender: bytes, addr: str) -> None:
        """A peer refused us: counted every time, logged once per address and reason (a
        refusing peer answers every datagram)."""
        self._counters.drop("refused-by-peer")
        key = (addr, msg.reason)
        if key in self._refusals_logged or len(self._refusals_logged) >= _LOGGED_REFUSALS_MAX:
            return
        self._refusals_logged.add(key)
        log.warning("%s refused us: %s", addr, msg.reason)

    def open(self, data: bytes, addr: str) -> tuple[OpenedDatagram, list[Any]] | None:
        """The datagram ``data`` from ``addr`` opened and decoded; None: dropped."""
        self._counters.datagrams_in += 1
        self._counters.bytes_in += len(data)
        try:
            opened = self._sealer.open_datagram(data)
            messages = wire.decode(opened.plaintext, max_bytes=self._max_datagram_bytes)
        except VersionMismatch as exc:
            self._counters.drop("version")
            self._refuse(addr, exc)
            return None
        except (AuthenticationError, RemoteProtocolError) as exc:
            self._counters.drop(exc.reason)
            return None
        return opened, messages

    def proves_epoch(self, opened: OpenedDatagram, messages: list[Any],
                     alive_proven: Callable[[Alive], bool]) -> bool:
        """Let the sender's own signed Alive, naming this datagram's epoch, prove that
        epoch to the sealer (see ``security.datagrams``). False: a stale datagram that
        proves nothing, to drop."""
        for msg in messages:
            if type(msg) is Alive and msg.node == opened.sender and msg.epoch == opened.epoch \
                    and alive_proven(msg):
                return self._sealer.confirm(opened.sender, opened.epoch, msg.incarnation,
                                            opened.seq if opened.stale else None) \
                    or not opened.stale
        return not opened.stale

    def dispatch(self, msg: Any, sender: bytes, addr: str) -> None:
        """Hand a message neither machine takes to its handler (none: dropped)."""
        handler = self._handlers.get(type(msg))
        if handler is None:
            self._counters.drop("unexpected-message")
        else:
            handler(msg, sender, addr)

    def _refuse(self, addr: str, exc: VersionMismatch) -> None:
        if addr not in self._refused_addrs:  # say it once per address, not per packet
            self._refused_addrs.add(addr)
            log.warning("refusing %s: %s", addr, exc.detail)
        self._post(addr, (Refusal(wire.PROTOCOL_MAJOR, wire.PROTOCOL_MINOR, exc.detail),))


__all__ = ["DatagramHandler", "Intake"]
