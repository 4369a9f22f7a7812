"""A live agent on real sockets, fed 100,000 bad datagrams and garbage TCP connections,
keeps answering `status` over its control socket, and counts every drop by reason."""

from __future__ import annotations

import random

import trio

from p2pswarm import wire
from p2pswarm.agent import Agent
from p2pswarm.agent.world import AgentWorld
from p2pswarm.config import local, split_addr
from p2pswarm.control.client import request
from p2pswarm.security import DatagramSealer, Identity, Keyring, SwarmSecret
from p2pswarm.transport.udp_tcp import open_udp_tcp_transport
from p2pswarm.wire.base import Hello

SECRET = SwarmSecret(bytes(range(32)))
TOTAL = 100_000
BATCH = 250


def bad_datagrams(rng: random.Random, sealer: DatagramSealer, node_id: bytes):
    """Random bytes, bit-flipped sealed packets, and sealed garbage (passes the AEAD)."""
    valid = wire.encode(*[Hello(i, node_id, "fuzz", "127.0.0.1:9") for i in range(3)])
    for i in range(TOTAL):
        kind = i % 4
        if kind == 0:
            yield rng.randbytes(rng.randrange(0, 1400))
        elif kind == 1:
            packet = bytearray(sealer.seal(valid))
            packet[rng.randrange(len(packet))] ^= 1 << rng.randrange(8)
            yield bytes(packet)
        elif kind == 2:
            plain = bytearray(valid)
            for _ in range(rng.randrange(1, 4)):
                plain[rng.randrange(len(plain))] = rng.randrange(256)
            yield sealer.seal(bytes(plain))
        else:
            yield sealer.seal(rng.randbytes(rng.randrange(0, 200)))


async def test_live_agent_survives_fuzzing_and_keeps_answering(tmp_path) -> None:
    config = local()
    rng = random.Random(11)
    async with open_udp_tcp_transport("127.0.0.1:0", config.transport) as transport:
        agent = Agent(AgentWorld(name="target", transport=transport, keyring=Keyring([SECRET]),
                                 identity=Identity.generate(), config=config, epoch=1,
                                 rng=random.Random(1), home=tmp_path))
        sender_identity = Identity.generate()
        sealer = DatagramSealer(Keyring([SECRET]), sender_identity.node_id, epoch=1)
        host, port = split_addr(transport.local_addr)
        async with trio.open_nursery() as nursery:
            await nursery.start(agent.run)
            sock = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_DGRAM)
            sent = 0
            with trio.fail_after(300):
                for data in bad_datagrams(rng, sealer, sender_identity.node_id):
                    await sock.sendto(data, (host, port))
                    sent += 1
                    if sent % BATCH == 0:  # let the agent keep up, so the kernel drops none
                        while agent.counters.datagrams_in + _queue_drops(transport) < sent - 50:
                            await trio.sleep(0.001)
                    if sent % 20_000 == 0:
                        status = await trio.to_thread.run_sync(request, tmp_path, {"op": "status"})
                        assert status["self"]["name"] == "target"
                for _ in range(20):  # garbage TCP: random bytes, a huge length, connect-close
                    stream = await trio.open_tcp_stream(host, port)
                    await stream.send_all(rng.choice([rng.randbytes(64), b"\xff" * 4, b""]))
                    await stream.aclose()
                while agent.counters.datagrams_in + _queue_drops(transport) < sent - 200:
                    await trio.sleep(0.01)
            status = await trio.to_thread.run_sync(request, tmp_path, {"op": "status"})
            counters = status["counters"]
            dropped = sum(counters["drops"].values())
            assert counters["datagrams_in"] >= TOTAL * 0.95
            # Nearly every datagram was dropped, each for a named reason; the rest are sealed
            # garbage that happens to decode to a valid Hello from the (keyed) fuzzer itself.
            assert dropped >= 0.99 * counters["datagrams_in"]
            assert {"malformed", "bad-seal", "invalid-field"} <= set(counters["drops"])
            assert {m["name"] for m in status["members"]} == {"target"}
            nursery.cancel_scope.cancel()


def _queue_drops(transport) -> int:
    return int(getattr(transport, "counters", {}).get("datagrams_dropped_queue_full", 0))
