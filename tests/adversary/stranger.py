"""A stranger: no join token, only a TCP socket. What it can try against a listening
agent (tests and ``simulations/bench_security.py`` share these).

Each helper connects from ``source_host`` (any 127.0.0.0/8 address on Linux), so the
agent's per-host caps see the stranger apart from honest fellows on 127.0.0.1.
"""

from __future__ import annotations

import socket as stdlib_socket
import struct

import trio

from p2pswarm.transport.udp_tcp import parse_addr

MIB = 1024 * 1024


async def connect(addr: str, source_host: str = "127.0.0.2") -> trio.socket.SocketType:
    host, port = parse_addr(addr)
    sock = trio.socket.socket(stdlib_socket.AF_INET, stdlib_socket.SOCK_STREAM)
    try:
        await sock.bind((source_host, 0))
        await sock.connect((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


async def closed_by_peer(sock: trio.socket.SocketType) -> bool:
    """Whether the other end has closed (or reset) the connection: reads to the end."""
    try:
        while await sock.recv(65536):
            pass
    except OSError:
        pass
    return True


async def announce_frame(addr: str, size: int = 64 * MIB, *, body_bytes: int = 1024,
                         source_host: str = "127.0.0.2") -> trio.socket.SocketType:
    """Connect and announce a frame of ``size`` bytes, then send ``body_bytes`` of it and
    stop, as if the rest were on its way. Returns the socket, left open."""
    sock = await connect(addr, source_host)
    try:
        await sock.send(struct.pack("!I", size) + bytes(body_bytes))
    except OSError:
        pass  # already cut off
    return sock


async def slow_loris(addr: str, interval_s: float, *, source_host: str = "127.0.0.2",
                     max_bytes: int = 1000) -> float:
    """Dribble a plausible client hello one byte per ``interval_s``; return how long the
    agent kept the connection open."""
    sock = await connect(addr, source_host)
    started = trio.current_time()
    with sock:
        try:
            await sock.send(struct.pack("!I", 100))
            for _ in range(max_bytes):
                await sock.send(b"\x01")
                with trio.move_on_after(interval_s):
                    if not await sock.recv(1):  # the agent closed it
                        break
        except OSError:
            pass
    return trio.current_time() - started


async def flood(addr: str, count: int, *, source_host: str = "127.0.0.2"
                ) -> list[trio.socket.SocketType]:
    """Open ``count`` connections and say nothing on them; the caller closes them."""
    socks = []
    for _ in range(count):
        try:
            socks.append(await connect(addr, source_host))
        except OSError:
            break  # the backlog is full, or we ran out of descriptors ourselves
    return socks
