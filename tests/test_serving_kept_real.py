"""A load outlives its swarm's restart, with real `join` processes on loopback: three
fellows load a model, all three are killed (SIGKILL) at once and started again from the
same homes, and `generate` answers as before. Each fellow kept the load's route and stage
orders in its home (``HOME/loads/``); the new leader adopts the load from them and puts
its stages back."""

from __future__ import annotations

import signal
from collections.abc import Callable
from typing import Any

import pytest

from p2pswarm.control.client import request
from p2pswarm.errors import SwarmError
from p2pswarm.planner import BUILTIN_MODELS
from p2pswarm.sim.field import free_address
from p2pswarm.sim.processes import local_swarm
from tests.real_swarm import poll

pytestmark = pytest.mark.slow  # real processes

NAMES = ["fellow-1", "fellow-2", "fellow-3"]
LOAD = {"model": {"name": "tiny-llama", "config": BUILTIN_MODELS["tiny-llama"]},
        "kind": "serve", "weights_dtype": "f32", "kv_dtype": "f32", "context": 256,
        "sequences": 1, "exclude": [], "floors_bytes": {}, "maximize": None}
GENERATE = {"op": "generate", "prompt": "The swarm", "max_tokens": 8}


def _poll(what: str, ready: Callable[[], Any], timeout_s: float = 60.0) -> Any:
    return poll(what, ready, timeout_s, tolerate=(SwarmError,))  # not up, no leader yet


def test_a_load_is_served_again_after_every_fellow_was_killed_and_started_again() -> None:
    with local_swarm(lambda line: None) as swarm:
        addrs = {name: free_address() for name in NAMES}
        seed = addrs[NAMES[0]]

        def start_all() -> None:
            for name in NAMES:
                swarm.launch(name, seeds=() if name == NAMES[0] else (seed,),
                             extra=("--log-level", "warning"), listen=addrs[name])

        start_all()
        swarm.wait_formed(NAMES)
        home = swarm.homes[NAMES[1]]
        record = _poll("the load", lambda: request(home, {"op": "load", "request": LOAD},
                                                    timeout_s=120), timeout_s=120)
        want = request(home, GENERATE, timeout_s=60)
        # its stage fellows, its keepers and its leader keep its orders on their disks
        _poll("every fellow keeping the load's orders", lambda: all(
            (swarm.homes[name] / "loads" / f"{record['plan_id']}.json").exists()
            for name in NAMES), timeout_s=10)

        for process in swarm.processes.values():
            process.send_signal(signal.SIGKILL)
        for process in swarm.processes.values():
            process.wait(timeout=10)
        start_all()  # from the same homes and addresses; generate asks until it answers

        got = _poll("generate after the restart", lambda: request(home, GENERATE,
                                                                  timeout_s=60), timeout_s=90)
        assert got["token_ids"] == want["token_ids"]
        (after,) = request(home, {"op": "loads"}, timeout_s=30)["loads"]
        assert after["plan_id"] == record["plan_id"] and after["complete"]
        assert [s["fellow"] for s in after["stages"]] == [s["fellow"] for s in record["stages"]]
