"""Wire figures: codec + sealing per datagram, gossip decode, sealed stream throughput.

    python simulations/bench_wire.py [--json]

Prints a table (figure, value, target). Timings are medians over many batches.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import trio

from p2pswarm import wire
from p2pswarm.agent.heap import tune_allocator
from p2pswarm.config import local
from p2pswarm.security import DatagramSealer, Identity, Keyring, SwarmSecret
from p2pswarm.transport.secure import secure_accept, secure_connect
from p2pswarm.transport.udp_tcp import open_udp_tcp_transport
from p2pswarm.wire.base import Refusal


def median_us(fn, *, batch: int = 2000, batches: int = 25) -> float:
    samples = []
    for _ in range(batches):
        start = time.perf_counter_ns()
        for _ in range(batch):
            fn()
        samples.append((time.perf_counter_ns() - start) / batch / 1000)
    return statistics.median(samples)


def seal_open_1kib() -> float:
    keyring = Keyring([SwarmSecret.generate()])
    a = DatagramSealer(keyring, b"a" * 16, epoch=1)
    b = DatagramSealer(keyring, b"b" * 16, epoch=1)
    messages = [Refusal(1, 0, "x" * 500), Refusal(1, 0, "y" * 500)]  # ~1 KiB envelope
    assert 1000 <= len(wire.encode(*messages)) <= 1100

    def once() -> None:
        wire.decode(b.open(a.seal(wire.encode(*messages)))[1])

    return median_us(once)


def typical_gossip_datagram() -> tuple[bytes, int]:
    """A probe with 8 piggybacked membership updates, as the agent sends it."""
    from p2pswarm.wire.gossip import Alive, Ping, Suspect

    def node(i: int) -> bytes:
        return bytes([i]) * 16

    updates: list[object] = []
    for i in range(8):
        if i % 2:
            updates.append(Suspect(node(i), 3, node(99), silent_ms=1200))
        else:
            updates.append(Alive(node(i), 3, f"fellow-{i}", f"192.0.2.{i}:7946",
                                 bytes([i]) * 32, meta_version=5, priority=0))
    messages = [Ping(7, node(1), node(0)), *updates]
    return wire.encode(*messages), len(messages)


def gossip_decode() -> tuple[float, int]:
    data, _ = typical_gossip_datagram()
    return median_us(lambda: wire.decode(data)), len(data)


async def stream_throughput(frame_bytes: int, total_bytes: int) -> float:
    config = local()
    keyring = Keyring([SwarmSecret.generate()])
    ids = Identity.generate(), Identity.generate()
    payload = os.urandom(frame_bytes)
    frames = total_bytes // frame_bytes
    done = trio.Event()

    async def sink(raw) -> None:
        stream = await secure_accept(raw, keyring, ids[1], 5.0)
        for _ in range(frames):
            await stream.receive_frame()
        done.set()
        await stream.aclose()

    async with open_udp_tcp_transport("127.0.0.1:0", config.transport) as a, \
            open_udp_tcp_transport("127.0.0.1:0", config.transport) as b:
        async with trio.open_nursery() as nursery:
            await nursery.start(b.serve_streams, sink)
            stream = await secure_connect(await a.open_stream(b.local_addr), keyring, ids[0], 5.0)
            start = time.perf_counter()
            for _ in range(frames):
                await stream.send_frame(payload)
            await done.wait()
            elapsed = time.perf_counter() - start
            await stream.aclose()
            nursery.cancel_scope.cancel()
    return frames * frame_bytes / elapsed / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    tune_allocator()  # as every agent does at start
    rows = [("seal + open of a 1 KiB datagram, with codec (median)",
             f"{seal_open_1kib():.1f} µs", "<= 15 µs")]
    us, size = gossip_decode()
    rows.append((f"decode + validate, gossip datagram of 8 updates ({size} B)",
                 f"{us:.1f} µs", "<= 15 µs"))
    mbps = max(trio.run(stream_throughput, 1 << 20, 256 << 20) for _ in range(3))
    rows.append(("sealed stream throughput, 1 MiB frames, loopback", f"{mbps:.0f} MB/s",
                 ">= 400 MB/s"))
    machine = f"{platform.machine()}, {os.cpu_count()} cores, Python {sys.version.split()[0]}"
    if args.json:
        print(json.dumps({"machine": machine, "rows": rows}, indent=2))
        return
    print(f"machine: {machine}")
    width = max(len(r[0]) for r in rows)
    for figure, value, target in rows:
        print(f"{figure:<{width}}  {value:>12}  (target {target})")


if __name__ == "__main__":
    main()
