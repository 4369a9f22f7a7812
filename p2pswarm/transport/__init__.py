"""Transports: the protocol, real UDP/TCP sockets, and the in-memory network."""

from p2pswarm.transport.base import Stream, StreamHandler, Transport

__all__ = ["Stream", "StreamHandler", "Transport"]
