"""An unload outlives the leader that made it, with real `join` processes on loopback:
four fellows load a model, a fellow that keeps the load's orders is stopped, the load is
unloaded, the leader is killed (SIGKILL) and the stopped fellow started again from its
home, still keeping the orders. The next leader learns of the unload from the fellows it
was handed to (a tombstone, ``tombstones``) and does not bring the load back; the same
model loads again."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import pytest

from p2pswarm.control.client import request
from p2pswarm.errors import SwarmError
from p2pswarm.planner import BUILTIN_MODELS
from p2pswarm.sim.field import free_address, one_leader
from p2pswarm.sim.processes import local_swarm
from tests.real_swarm import poll

pytestmark = pytest.mark.slow  # real processes

NAMES = ["fellow-1", "fellow-2", "fellow-3", "fellow-4"]
LOAD = {"model": {"name": "tiny-llama", "config": BUILTIN_MODELS["tiny-llama"]},
        "kind": "serve", "weights_dtype": "f32", "kv_dtype": "f32", "context": 256,
        "sequences": 1, "exclude": [], "floors_bytes": {}, "maximize": None}
ADOPTION_WINDOW_S = 4.0  # a leader retries an adoption every 2 s: twice that


def _poll(what: str, ready: Callable[[], Any], timeout_s: float = 60.0) -> Any:
    return poll(what, ready, timeout_s, tolerate=(SwarmError,))  # not up, no leader yet


def _cli(home: Any, *args: str) -> str:
    return subprocess.run([sys.executable, "-m", "p2pswarm.cli", *args, "--home", str(home)],
                          capture_output=True, text=True, timeout=60, check=True,
                          env={**os.environ, "COLUMNS": "200"}).stdout


def test_a_load_unloaded_while_a_fellow_was_away_stays_unloaded_under_a_new_leader() -> None:
    with local_swarm(lambda line: None) as swarm:
        addrs = {name: free_address() for name in NAMES}

        def launch(name: str, seeds: tuple[str, ...]) -> None:
            swarm.launch(name, seeds=seeds, extra=("--log-level", "warning"),
                         listen=addrs[name])

        for name in NAMES:
            launch(name, () if name == NAMES[0] else (addrs[NAMES[0]],))
        leader = swarm.wait_formed(NAMES)
        asker = next(n for n in NAMES if n != leader)
        record = _poll("the load", lambda: request(swarm.homes[asker], {
            "op": "load", "request": LOAD}, timeout_s=120), timeout_s=120)
        plan_id = record["plan_id"]
        stage_fellows = {s["fellow"] for s in record["stages"]}
        # the leader now: a busy machine may have moved it since the start
        leader = _poll("one leader for all", lambda: one_leader(swarm, NAMES))[0]

        def keeps(name: str) -> bool:
            return (swarm.homes[name] / "loads" / f"{plan_id}.json").exists()

        # away: a fellow besides the leader keeping the orders (a keeper, if there is one)
        away = _poll("a fellow keeping the load's orders", lambda: next(
            (n for n in sorted(NAMES, key=lambda n: n in stage_fellows)
             if n != leader and keeps(n)), None), timeout_s=10)
        swarm.processes[away].send_signal(signal.SIGINT)  # stopped: it leaves
        swarm.processes[away].wait(timeout=20)
        home = swarm.homes[next(n for n in NAMES if n not in (leader, away))]
        _poll("the leader seeing it gone", lambda: all(
            m["state"] != "alive" for m in swarm.status(leader)["members"]
            if m["name"] == away))
        assert plan_id in _cli(home, "unload")
        assert keeps(away)  # it was away: it keeps them still

        # the leader that unloaded (or the one that leads since, on a busy machine)
        leader = _poll("one leader for the fellows left", lambda: one_leader(
            swarm, [n for n in NAMES if n != away]))[0]
        home = swarm.homes[next(n for n in NAMES if n not in (leader, away))]
        swarm.processes[leader].send_signal(signal.SIGKILL)
        swarm.processes[leader].wait(timeout=10)
        launch(away, (addrs[next(n for n in NAMES if n not in (leader, away))],))
        survivors = [n for n in NAMES if n != leader]
        _poll("a new leader seen by all", lambda: all(
            (swarm.status(n)["leader"] or {}).get("name") in survivors for n in survivors))
        # the new leader learns of the unload, and the fellow away drops its orders
        # (without the tombstone, the new leader adopts the load from them instead)
        _poll(f"{away} dropping the unloaded load's orders, or the load back", lambda:
              request(home, {"op": "loads"}, timeout_s=30)["loads"] or not keeps(away),
              timeout_s=30)
        until = time.monotonic() + ADOPTION_WINDOW_S
        while time.monotonic() < until:  # nothing brings it back meanwhile
            assert request(home, {"op": "loads"}, timeout_s=30)["loads"] == []
            time.sleep(0.25)  # pacing the checks, not waiting for anything
        assert plan_id not in _cli(home, "loads")

        again = _poll("the same model loaded again", lambda: request(
            home, {"op": "load", "request": LOAD}, timeout_s=120), timeout_s=120)
        (shown,) = request(home, {"op": "loads"}, timeout_s=30)["loads"]
        assert shown["plan_id"] == again["plan_id"] and shown["complete"]
