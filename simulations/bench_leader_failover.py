"""Serving failover when the fellow lost is the leader itself: time from its kill to the next token.

Four `join` processes on loopback, three stages and a spare; the leader hosts a stage (on
a home swarm the leader is often the machine the user sits at). A generation driven from
another stage's fellow has the leader killed (SIGKILL) mid-generation: the driver's heal
finds the leader gone, waits for the next one (an election) and asks it, and the new
leader adopts the load and moves the stage to the spare. Each round restarts the killed
fellow as the next round's spare; the new leader then hosts a stage itself (every
survivor does), so it is the next round's victim. Reports the pause from the kill to the
next token, each round's, and whether the tokens equal an undisturbed run's.

    python simulations/bench_leader_failover.py [--kills 3] [--model small-llama] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import threading
import time
from typing import Any

from p2pswarm.planner import BUILTIN_MODELS

SPARE_SETTLE_S = 15.0  # a restarted fellow's torch import and warm-up, as bench_serving's
NAMES = ["fellow-1", "fellow-2", "fellow-3", "fellow-4"]


def leader_failover(model: str, kills: int) -> dict[str, Any]:
    from p2pswarm.control.client import request, stream
    from p2pswarm.demo import local_swarm
    from p2pswarm.errors import SwarmError

    quiet = ("--log-level", "warning")
    with local_swarm(lambda text: None, start_timeout_s=120) as swarm:
        seed = swarm.start(NAMES[0], extra=quiet)
        for name in NAMES[1:]:
            swarm.start(name, seeds=(seed,), extra=quiet)

        def formed() -> str:
            return swarm.wait_formed(NAMES)

        leader = formed()
        spare = next(n for n in NAMES if n != leader)  # left out, so the leader hosts one
        message = {"model": {"name": model, "config": BUILTIN_MODELS[model]}, "stages": 3,
                   "weights_dtype": "f32", "kv_dtype": "f32", "context": 1024,
                   "exclude": [f"{spare}:cpu"], "floors_bytes": {"cpu": "100MB"}}
        for attempt in range(3):  # a busy machine may change leaders mid-load
            try:
                record = stream(swarm.homes[leader], {"op": "load", "request": message},
                                lambda e: None, timeout_s=300)
                break
            except SwarmError:
                if attempt == 2:
                    raise
                leader = formed()
        ask = {"op": "generate", "prompt": "The swarm " * 4, "max_tokens": 48,
               "stop_token_ids": []}
        want = request(swarm.homes[leader], ask, timeout_s=120)["token_ids"]
        out: dict[str, Any] = {"model": model, "kills": []}
        for _ in range(kills):
            leader = formed()
            (load,) = request(swarm.homes[leader], {"op": "loads"}, timeout_s=30)["loads"]
            staged = [s["fellow"] for s in load["stages"]]
            if leader not in staged:
                raise SystemExit(f"the leader {leader} hosts no stage of {staged}")
            driver = next(n for n in staged if n != leader)
            pid = swarm.processes[leader].pid
            times: list[float] = []
            tokens: list[int] = []
            killed: list[float] = []

            def kill() -> None:
                os.kill(pid, signal.SIGKILL)
                killed.append(time.monotonic())

            def on_event(event: dict[str, Any]) -> None:
                if "token" in event:
                    times.append(time.monotonic())
                    tokens.append(event["token"])
                    if len(times) == 8:
                        threading.Thread(target=kill).start()

            stream(swarm.homes[driver], ask, on_event, timeout_s=300)
            pause = next(t for t in times if t > killed[0]) - killed[0]
            (after,) = request(swarm.homes[driver], {"op": "loads"}, timeout_s=30)["loads"]
            move = after.get("moves", [{}])[-1]
            out["kills"].append({"leader": leader, "kill_to_next_token_s": pause,
                                 "same_tokens": tokens == want,
                                 "moved": f"{move.get('from')} -> {move.get('to')}"})
            swarm.processes[leader].wait()
            swarm.launch(leader, seeds=(swarm.address(driver),), extra=quiet)
            formed()
            time.sleep(SPARE_SETTLE_S)  # let it settle as a spare up for a while would be
        request(swarm.homes[driver], {"op": "unload", "plan_id": record["plan_id"]},
                timeout_s=60)
    out["kill_to_next_token_p50_s"] = statistics.median(
        k["kill_to_next_token_s"] for k in out["kills"])
    out["load_average"] = os.getloadavg()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small-llama")
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    out = leader_failover(args.model, args.kills)
    if args.json:
        print(json.dumps(out, indent=2))
        return
    pauses = ", ".join(f"{k['kill_to_next_token_s']:.1f}" for k in out["kills"])
    same = all(k["same_tokens"] for k in out["kills"])
    load = ", ".join(f"{x:.1f}" for x in out["load_average"])
    print(f"serving failover, the leader (hosting a stage) killed mid-generation to the next "
          f"token, {out['model']}, 4 `join` processes, p50 of {len(out['kills'])} (load "
          f"average {load})\n    {out['kill_to_next_token_p50_s']:.1f} s ({pauses}); greedy "
          f"tokens {'equal' if same else 'DIFFER'}; moves: "
          + ", ".join(k["moved"] for k in out["kills"]))


if __name__ == "__main__":
    main()
