"""The HTTP API and the OpenAI endpoint, measured on this machine.

1. First streamed token: over ``/v1/chat/completions`` with ``stream: true`` through the
   ``openai`` client, the time from the pipeline's own first token (the moment the last
   stage's token reaches the fellow that drives the session, where the ``generate`` op
   emits it) to the first chunk with text at the client. Agents (two fellows, two stages,
   real loopback sockets) and client share one process and one clock. Target: <= 50 ms.
2. Plan round trip: ``POST /api/models/plan`` for an 80-layer model on a simulated swarm
   of 64 fellows x 4 cards (the leader plans on that cluster view instead of its own),
   from the client's request to the parsed plan, asked of the leader and of a fellow
   that forwards to it. Target: <= 300 ms.

    python simulations/bench_http.py [--runs 20] [--json]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import openai

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_planner import big_cluster  # noqa: E402

from p2pswarm.control.server import current_emitter, emitting_to  # noqa: E402
from p2pswarm.planner import cluster_from_dict  # noqa: E402
from tests.http_swarm import LoopbackSwarm, serve_message  # noqa: E402

FIRST_TOKEN_TARGET_MS = 50.0
PLAN_TARGET_MS = 300.0


def summary(values_ms: list[float]) -> dict[str, float]:
    ordered = sorted(values_ms)
    return {"median_ms": round(statistics.median(ordered), 2),
            "p90_ms": round(ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))], 2),
            "max_ms": round(ordered[-1], 2), "runs": len(ordered)}


def first_token(swarm: LoopbackSwarm, runs: int) -> dict[str, Any]:
    agent = swarm.agents[1]
    swarm.call(agent.control_ops["load"], {"op": "load", "request": serve_message()})
    original = agent.control_ops["generate"]
    stamps: list[float] = []

    async def timed(request: dict[str, Any]) -> Any:
        outer = current_emitter()

        def tap(event: dict[str, Any]) -> None:
            if "token" in event and event.get("text") and len(stamps) == len(gaps):
                stamps.append(time.perf_counter())
            if outer is not None:
                outer(event)

        with emitting_to(tap):
            return await original(request)

    swarm.run_sync(agent.control_ops.__setitem__, "generate", timed)
    gaps: list[float] = []
    client = openai.OpenAI(base_url=f"{swarm.url(1)}/v1", api_key="unused", max_retries=0)
    messages: Any = [{"role": "user", "content": "Where do the layers run?"}]
    for run in range(runs + 2):  # two to warm up
        seen = None
        stream = client.chat.completions.create(model="tiny-llama", messages=messages,
                                                max_tokens=16, temperature=0, stream=True)
        for chunk in stream:
            if seen is None and chunk.choices and chunk.choices[0].delta.content:
                seen = time.perf_counter()
        assert seen is not None and len(stamps) == len(gaps) + 1
        gaps.append((seen - stamps[-1]) * 1e3)
        if run < 2:
            gaps.pop()
            stamps.pop()
    client.close()
    return {**summary(gaps), "target_ms": FIRST_TOKEN_TARGET_MS,
            "met": statistics.median(gaps) <= FIRST_TOKEN_TARGET_MS}


def plan_round_trip(swarm: LoopbackSwarm, runs: int) -> dict[str, Any]:
    view = cluster_from_dict(big_cluster(seed=1))
    leader = swarm.leader()
    swarm.run_sync(setattr, leader.planning, "view", lambda: view)
    follower = next(i for i, a in enumerate(swarm.agents) if a is not leader)
    body = {"model": "llama-3.1-70b", "context": 8192, "sequences": 8}
    out: dict[str, Any] = {"fellows": len(view.fellows),
                           "cards": sum(len(f.cards) for f in view.fellows)}
    for who, i in (("leader", swarm.agents.index(leader)), ("forwarded", follower)):
        for label, extra in (("default", {}), ("maximize_context", {"maximize": "context"})):
            times = []
            with httpx.Client(base_url=swarm.url(i), timeout=60) as c:
                for run in range(runs + 1):
                    began = time.perf_counter()
                    response = c.post("/api/models/plan", json={**body, **extra})
                    plan = response.json()
                    elapsed = (time.perf_counter() - began) * 1e3
                    assert response.status_code == 200, plan
                    if run:
                        times.append(elapsed)
            out[f"{who}_{label}"] = {**summary(times), "bytes": len(response.content),
                                     "limit": plan["layout"]["limit"]["sentence"]}
    worst = max(v["median_ms"] for k, v in out.items() if isinstance(v, dict))
    out.update(target_ms=PLAN_TARGET_MS, met=worst <= PLAN_TARGET_MS)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, LoopbackSwarm(Path(tmp)) as swarm:
        results = {"first_streamed_token": first_token(swarm, args.runs),
                   "plan_round_trip_64_fellows": plan_round_trip(swarm, args.runs)}
    if args.json:
        print(json.dumps(results, indent=2))
        return
    ft = results["first_streamed_token"]
    print(f"first streamed token after the pipeline's: median {ft['median_ms']} ms, "
          f"p90 {ft['p90_ms']} ms, max {ft['max_ms']} ms over {ft['runs']} runs "
          f"(target <= {FIRST_TOKEN_TARGET_MS:g} ms: {'met' if ft['met'] else 'MISSED'})")
    pr = results["plan_round_trip_64_fellows"]
    print(f"plan round trip over HTTP, {pr['fellows']} fellows / {pr['cards']} cards:")
    for key, value in pr.items():
        if isinstance(value, dict):
            print(f"  {key}: median {value['median_ms']} ms, p90 {value['p90_ms']} ms, "
                  f"{value['bytes']} bytes; {value['limit']}")
    print(f"  (target <= {PLAN_TARGET_MS:g} ms: {'met' if pr['met'] else 'MISSED'})")


if __name__ == "__main__":
    main()
