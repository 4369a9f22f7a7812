"""`join` with another swarm's token, on real processes: the seed refuses the handshake,
join says so in one line and stops; the home is left as it was, so the right token then
simply works; a home holding another swarm names the option that replaces it. And a
running agent picks up the speeds `bench` writes, with no restart."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from p2pswarm.bench import BenchmarkCache
from p2pswarm.cards import Benchmark, fingerprint
from p2pswarm.cli import app
from p2pswarm.control import client as control_client
from p2pswarm.home import Home
from p2pswarm.inventory import local_card_source
from p2pswarm.security import SwarmSecret
from p2pswarm.sim.commands import join, poll, refused_line, status_of, stop
from p2pswarm.sim.field import free_port

pytestmark = pytest.mark.slow  # real processes

SEED_SECRET = SwarmSecret(bytes(range(32)))
OTHER_SECRET = SwarmSecret(bytes(range(1, 33)))



def wait_for_fellows(home: Path, process: subprocess.Popen[str], n: int) -> dict[str, Any]:
    """``home``'s status once it shows ``n`` fellows alive (start-up takes what it takes
    on a busy machine); fails at once if ``process`` exits."""
    def seen() -> dict[str, Any] | None:
        assert process.poll() is None, (process.communicate()[1] or "")[-2000:]
        data = status_of(home)
        return data if data and sum(m["state"] == "alive" for m in data["members"]) >= n \
            else None

    return poll(f"{n} fellows alive", seen, 90)  # type: ignore[no-any-return]


def laptop_joins(home: Path, port: int) -> None:
    """A fellow "laptop" joins the seed at ``port`` with the seed's token, from ``home``;
    both are seen alive together; then it stops."""
    laptop = join(home, f"127.0.0.1:{port}", "--name", "laptop", "--token",
                  SEED_SECRET.token())
    try:
        data = wait_for_fellows(home, laptop, 2)
        assert {m["name"] for m in data["members"]} == {"seed", "laptop"}
    finally:
        stop(laptop)


def test_a_token_of_another_swarm_is_refused_and_the_right_one_then_works(
        tmp_path: Path) -> None:
    seed_home, home = tmp_path / "seed", tmp_path / "laptop"
    Home(seed_home).join_swarm(SEED_SECRET)
    port = free_port()
    seed = join(seed_home, "--name", "seed", listen=f"127.0.0.1:{port}")
    try:
        wait_for_fellows(seed_home, seed, 1)
        began = time.monotonic()
        wrong = join(home, f"127.0.0.1:{port}", "--name", "laptop", "--token",
                     OTHER_SECRET.token())
        try:
            line = refused_line(wrong)
        finally:
            stop(wrong)
        assert time.monotonic() - began < 60
        assert f"the seed 127.0.0.1:{port} refused this fellow's handshake 3 times: the " \
               "join token is not its swarm's" in line
        assert not Home(home).has_swarm()  # the refused token is not kept
        # so the right token needs no --force
        laptop_joins(home, port)
    finally:
        stop(seed)


def test_a_home_of_another_swarm_names_the_option_that_replaces_it(tmp_path: Path) -> None:
    runner = CliRunner()
    env = {"P2PSWARM_TOKEN": "", "P2PSWARM_HOME": ""}
    Home(tmp_path).join_swarm(OTHER_SECRET)
    result = runner.invoke(app, ["join", "--home", str(tmp_path), "--token",
                                 SEED_SECRET.token(), "--listen", "127.0.0.1:0"], env=env)
    assert result.exit_code == 2
    assert "already holds another swarm; to leave it and join this one, run join again " \
           "with --force" in result.output
    assert "--force" in runner.invoke(app, ["join", "--help"], env=env).output
    result = runner.invoke(app, ["join", "--home", str(tmp_path), "--force"], env=env)
    assert result.exit_code == 2 and "give --token too" in result.output
    assert Home(tmp_path).load_keyring().secrets == (OTHER_SECRET,)  # nothing changed


def test_join_force_replaces_the_swarm_a_home_holds_and_bench_needs_no_restart(
        tmp_path: Path) -> None:
    home = tmp_path / "h"
    Home(home).join_swarm(OTHER_SECRET)
    process = join(home, "--name", "solo", "--token", SEED_SECRET.token(), "--force",
                   cards=("--cpu-memory", "1GB", "--gpus", "none"))
    try:
        wait_for_fellows(home, process, 1)
        assert Home(home).load_keyring().secrets == (SEED_SECRET,)
        # what `p2pswarm bench --cpu-memory 1GB` writes, while the agent runs
        (cpu,) = local_card_source(cpu_memory="1GB", gpus="none").read()
        measured = Benchmark(flops=1.25e11, mem_bandwidth=3.5e9, dtype="f32", measured=True,
                             fingerprint=fingerprint(cpu))
        BenchmarkCache(home).save({fingerprint(cpu): measured})

        def measured_speed_shown() -> bool:  # at the agent's next inventory refresh
            cluster = control_client.request(home, {"op": "cluster"}, timeout_s=10)
            cards = [c for f in cluster["fellows"] for c in f["cards"]]
            return bool(cards) and cards[0].get("flops") == 1.25e11

        poll("the measured speed in the cluster view", measured_speed_shown, 60)
    finally:
        stop(process)
