"""Transports: the protocol, real UDP/TCP sockets, and the in-memory network."""

from p2pswarm.transport.base import Stream, StreamHandler, Transport, run_stream_handler
from p2pswarm.transport.memory import (
    Bernoulli,
    FixedDelay,
    GilbertElliott,
    LinkModel,
    LognormalDelay,
    MemoryNetwork,
    MemoryStream,
    MemoryTransport,
    PacketRecord,
    ParetoDelay,
    UniformDelay,
)
from p2pswarm.transport.udp_tcp import TcpStream, UdpTcpTransport, open_udp_tcp_transport

__all__ = [
    "Bernoulli",
    "FixedDelay",
    "GilbertElliott",
    "LinkModel",
    "LognormalDelay",
    "MemoryNetwork",
    "MemoryStream",
    "MemoryTransport",
    "PacketRecord",
    "ParetoDelay",
    "Stream",
    "StreamHandler",
    "TcpStream",
    "Transport",
    "UdpTcpTransport",
    "UniformDelay",
    "open_udp_tcp_transport",
    "run_stream_handler",
]
