"""A rogue holding the swarm key sends every wire message type at its schema's extremes,
and frames built to cost (empty arrays where fields belong, 100,000 nested arrays), to a
live agent on loopback in this process; the victim's loop lag (its longest task step, in
CPU time) stays under 100 ms and its memory (tracemalloc's peak) under 64 MiB above the
start, message by message. A fellow then still gets in past a stranger holding every
handshake slot from 64 source addresses. The full-size run, with 16 MiB extremes, 16 MiB
of 0x90 and twelve 48 MiB frames held back a byte, is
``simulations/security_wire_attacks.py`` (and ``bench_security.py --only wire``)."""

from __future__ import annotations

import sys
import time
import tracemalloc
from pathlib import Path

import pytest

from p2pswarm import wire
from p2pswarm.errors import RemoteProtocolError

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "simulations"))
import security_wire_attacks as attacks  # noqa: E402

MIB = 1 << 20


async def test_every_message_type_at_its_extremes_costs_the_victim_little() -> None:
    costs = await attacks.run_attacks(quick=True)
    covered = {c.attack.split(" (")[0] for c in costs}
    assert {cls.__name__ for cls in wire.message_types().values()} <= covered
    missed = [c for c in costs if not c.met]
    assert not missed, "\n".join(
        f"{c.attack}: {c.lag_s * 1000:.1f} ms, {c.memory_bytes / MIB:.1f} MiB ({c.outcome})"
        for c in missed)
    flood = costs[-1]
    assert flood.attack.startswith("handshake slots") and "got in" in flood.outcome, flood


@pytest.mark.parametrize("tag", sorted(wire.message_types()))
def test_16_mib_of_empty_arrays_costs_nothing_whatever_the_kind(tag: int) -> None:
    """The frame that cost +1.2 GB and 28 s when unpacked before its kind was read."""
    frame = attacks.empty_arrays(tag, 16 * MIB)
    tracemalloc.start()
    began = time.process_time()
    try:
        with pytest.raises(RemoteProtocolError):
            wire.decode(frame, max_bytes=64 * MIB)
        spent_s = time.process_time() - began
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < MIB and spent_s < 0.05
