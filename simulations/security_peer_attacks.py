"""What a fellow's costly asks cost the victim: ``bench_security.py``'s ``peer_attacks``.

    python simulations/bench_security.py --only peer_attacks

Two real ``p2pswarm join`` processes on loopback. The fellow that does not lead attacks:

- ``PlanAsk`` of a model with 2^24 layers, then 2^31-1 (before the planner's bounds:
  +1.3 GB and a 25 s frozen loop, then the leader killed by the OOM killer);
- ``DataPut`` of a job data file as big as the store, from a fellow that does not lead
  (before: taken, evicting other jobs' data);
- ``load`` of a model directory whose ``generation_config.json`` links to the fellow's
  ``identity.json`` (before: hashed and served by hash to any token holder).

Per attack: the victim's loop lag (the most its self watch saw, sampled every 0.1 s from
``status`` while the attack ran and a second after) and its RSS growth, against the
targets (<= 100 ms, <= 64 MiB), and whether the attack was refused with the victim alive.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import trio

from p2pswarm import wire
from p2pswarm.control.client import request
from p2pswarm.errors import SwarmError
from p2pswarm.home import Home
from p2pswarm.models.files import SHIPPED_MODELS
from p2pswarm.sim.processes import LocalSwarm, local_swarm
from p2pswarm.transport.secure import secure_connect
from p2pswarm.transport.udp_tcp import open_udp_tcp_transport
from p2pswarm.wire.training import DataPut

Row = tuple[str, str, str, bool]  # figure, value, target, met
MIB = 1024 * 1024
LAG_TARGET_MS = 100.0
GROWTH_TARGET_BYTES = 64 * MIB
NAMES = ("victim", "rogue")
CONFIG = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 1024,
          "intermediate_size": 2816, "num_attention_heads": 8, "num_key_value_heads": 4,
          "max_position_embeddings": 8192}


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


@contextmanager
def watching(swarm: LocalSwarm, name: str) -> Iterator[dict[str, float]]:
    """While the block runs (and a second after): the victim's largest loop lag (ms) its
    self watch showed, and its largest RSS growth (bytes)."""
    pid = swarm.processes[name].pid
    seen = {"lag_ms": 0.0, "growth": 0.0}
    base = rss_bytes(pid)
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            try:
                watch = swarm.status(name)["self_watch"]
                seen["lag_ms"] = max(seen["lag_ms"], float(watch["loop_lag_ms"]))
                seen["growth"] = max(seen["growth"], float(rss_bytes(pid) - base))
            except (SwarmError, OSError, KeyError):
                pass
            stop.wait(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield seen
        time.sleep(1.0)  # a lag the attack left shows on the next ticks
    finally:
        stop.set()
        sampler.join()


def rows_of(what: str, seen: dict[str, float], refused: bool, alive: bool) -> list[Row]:
    return [
        (f"{what}: victim loop lag", f"{seen['lag_ms']:.0f} ms", "<= 100 ms",
         seen["lag_ms"] <= LAG_TARGET_MS),
        (f"{what}: victim memory growth", f"{seen['growth'] / MIB:.1f} MiB", "<= 64 MiB",
         seen["growth"] <= GROWTH_TARGET_BYTES),
        (f"{what}: refused, victim alive", f"{refused}, {alive}", "True, True",
         refused and alive),
    ]


def plan_attack(swarm: LocalSwarm, victim: str, rogue: str, layers: int,
                label: str) -> list[Row]:
    message = {"model": {"name": "deep", "config": {**CONFIG, "num_hidden_layers": layers}}}
    with watching(swarm, victim) as seen:
        try:
            request(swarm.homes[rogue], {"op": "plan", "request": message}, timeout_s=120)
            refused = False
        except SwarmError as exc:
            refused = "num_layers" in str(exc)
    alive = swarm.processes[victim].poll() is None and \
        swarm.status(victim)["leader"]["name"] == victim
    return rows_of(f"PlanAsk of {label} layers", seen, refused, alive)


def data_put_attack(swarm: LocalSwarm, victim: str, rogue: str) -> list[Row]:
    home = Home(swarm.homes[rogue])
    addr = str(swarm.status(victim)["self"]["addr"])
    sha = hashlib.sha256(b"not the data").hexdigest()

    async def put() -> bool:
        async with open_udp_tcp_transport("127.0.0.1:0") as transport:
            raw = await transport.open_stream(addr)
            stream = await secure_connect(raw, home.load_keyring(), home.load_identity(), 5.0)
            async with stream:
                await stream.send_frame(wire.encode(DataPut(sha, 4 << 30)))
                reply = wire.decode(await stream.receive_frame(), max_bytes=1 << 20)
            return "only the leader" in str(reply)

    with watching(swarm, victim) as seen:
        refused = trio.run(put)
    counted = swarm.status(victim)["counters"]["refused"].get("data-put-not-leader", 0) >= 1
    alive = swarm.processes[victim].poll() is None
    return rows_of("DataPut from a fellow not leading", seen, refused and counted, alive)


def symlink_attack(swarm: LocalSwarm, victim: str, scratch: Path) -> list[Row]:
    model = scratch / "leaky"
    shutil.copytree(SHIPPED_MODELS["demo-llama"], model)
    (model / "generation_config.json").symlink_to(swarm.homes[victim] / "identity.json")

    def load() -> bool:
        loaded = subprocess.run([sys.executable, "-m", "p2pswarm.cli", "load", str(model),
                                 "--floor", "cpu=200MB", "--weights-dtype", "f32", "--home",
                                 str(swarm.homes[victim])], capture_output=True, text=True,
                                timeout=120)
        return loaded.returncode != 0 and "leads outside its model directory" in loaded.stderr

    # the first load a fellow reads imports torch on a thread, which holds the loop for
    # its import once per process: shown apart, the attack is measured after it
    with watching(swarm, victim) as first:
        refused_first = load()
    with watching(swarm, victim) as seen:
        refused = load() and refused_first
    alive = swarm.processes[victim].poll() is None
    return [("model dir linking to identity.json, first load: victim loop lag",
             f"{first['lag_ms']:.0f} ms", "information (torch imported once)", True),
            *rows_of("model dir linking to identity.json", seen, refused, alive)]


def peer_attacks() -> list[Row]:
    scratch = Path(tempfile.mkdtemp(prefix="p2pswarm-peer-attacks-"))
    rows: list[Row] = []
    try:
        with local_swarm(lambda text: None) as swarm:
            quiet = ("--http", "off", "--cpu-memory", "300MB", "--log-level", "warning")
            seed = swarm.start(NAMES[0], extra=quiet)
            swarm.start(NAMES[1], seeds=(seed,), extra=quiet)
            leader = swarm.wait_formed(list(NAMES))
            other = next(n for n in NAMES if n != leader)
            rows += plan_attack(swarm, leader, other, 2**24, "2^24")
            rows += plan_attack(swarm, leader, other, 2**31 - 1, "2^31-1")
            rows += data_put_attack(swarm, leader, other)  # the leader takes it from no one
            rows += symlink_attack(swarm, other, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return rows


__all__ = ["peer_attacks"]
