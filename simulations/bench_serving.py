"""Serving across fellows, measured on this machine: pipeline speed, memory, weights, demo.

1. Decode tokens/s of a three-stage pipeline across three agents on real loopback
   sockets (sealed TCP streams, one process), and across three `p2pswarm join`
   processes, each against the same stages chained in one process (``LocalPipeline``),
   runs alternating, from the median time between two tokens; the added latency per hop
   is the difference per token over the hops a token crosses (driver -> stage 0 ->
   stage 1 -> stage 2 -> driver: 4).
2. The planner's memory claim for each stage on a CPU card (weights, embeddings/head/
   buffers, KV cache) against what a fresh process lastingly grows by (RSS, freed heap
   trimmed) when it loads the stage and fills its KV cache with a full-context prefill.
3. Stage weights streamed from the fellow holding a model directory to one that lacks
   it, on loopback: sealed, hashed, written to the cache.
4. The demo (`p2pswarm demo`): time from `load` to the first generated token.
5. Single-stream speed against `transformers`' own `generate` with all cores in one
   process, a 68 M-parameter Llama, 128 new tokens, one and two `join` fellows, runs
   alternating (``single_stream.py``), with the load average beside it.

5. Failover: four `join` processes, three stages and a spare; a stage fellow killed
   mid-generation (SIGKILL): time from the kill to the next token, as its stage moves to
   the spare (the killed fellow is started again as the next round's spare); and a stage
   fellow frozen (SIGSTOP) for 5 s, then continued: whether its stage moved, and the time
   from its return to the next token. ``--only-failover`` runs this section alone.
   ``--failover-context N`` instead measures a failover of a session with N tokens of
   context, the surviving stages continuing from their kept cache against every stage
   replaying, side by side (``failover_replay.py``, agents in one process on loopback).
6. Many clients (``--many``; ``--only-many`` alone): on three `join` processes holding
   small-llama with eight session slots, the decode tokens/s of one client against eight
   at once (aggregate, while all eight decode), and a five-turn `chat` (each turn resends
   the conversation): the fifth turn's time to first token against the first's, with the
   stages keeping the session's cache between turns and, side by side, without
   (``--only-chat`` alone, ``--chats N`` of them): as the driver times it, as the client
   sees it, the stages' prefill compute (wall), the fellows' CPU time over a fifth turn
   and another chat's first turn beside it, and the same two prefills in one process.

One torch thread per stage everywhere, as on a machine whose cores the fellows share; on
a machine other processes keep busy the figures are pessimistic.

    python simulations/bench_serving.py [--models tiny-llama small-llama] [--tokens 64]
                                        [--skip-processes] [--skip-demo]
                                        [--skip-single-stream] [--only-single-stream]
                                        [--only-failover] [--kills 3] [--many]
                                        [--failover-context 1000 [--rounds 1]]
                                        [--only-many] [--only-chat] [--chats 3]
                                        [--json | --markdown]
"""

from __future__ import annotations

import os

# One torch thread per stage, in every thread: OpenMP reads this once, when torch loads.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import itertools
import json
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import trio

from p2pswarm.agent import Agent
from p2pswarm.agent.heap import tune_allocator
from p2pswarm.agent.weights import WeightsCache, fetch
from p2pswarm.agent.world import AgentWorld
from p2pswarm.cards import Card
from p2pswarm.config import local
from p2pswarm.inventory import FakeCardSource
from p2pswarm.planner import BUILTIN_MODELS, cluster_from_dict, plan_message
from p2pswarm.runtime import Sampler
from p2pswarm.security import Identity, Keyring, SwarmSecret
from p2pswarm.transport.udp_tcp import open_udp_tcp_transport

HOPS = 4  # driver -> stage 0 -> stage 1 -> stage 2 -> driver
SPARE_SETTLE_S = 15.0  # failover: a restarted fellow's torch import and warm-up
RUNS = 5
RUNTIME_FIELDS = ("dtype", "quant", "quant_group_size", "kv_dtype", "max_context_tokens",
                  "max_sessions", "prefill_chunk_tokens")


def params(model: str) -> str:
    from p2pswarm.planner import profile_from_config

    n = profile_from_config(BUILTIN_MODELS[model], model).total_params()
    return f"{n / 1e6:.1f}M"


def serve_request(model: str, **extra: Any) -> dict[str, Any]:
    return {"model": {"name": model, "config": BUILTIN_MODELS[model]}, "stages": 3,
            "weights_dtype": "f32", "kv_dtype": "f32", "context": 1024, **extra}


class Ticks:
    """When each token came, over several runs: a decode step is the time between two
    tokens of one run, and the median step is robust to a busy machine's hiccups."""

    def __init__(self) -> None:
        self.runs: list[list[float]] = []

    def run(self) -> Any:
        times: list[float] = []
        self.runs.append(times)
        return lambda *token: times.append(time.perf_counter())

    def per_s(self) -> float:
        steps = [b - a for times in self.runs for a, b in itertools.pairwise(times)]
        return 1.0 / statistics.median(steps)


def _on_token_event(tick: Any, event: dict[str, Any]) -> None:
    if "token" in event:
        tick()


def local_pipeline(plan: dict[str, Any], model: str) -> Any:
    """The plan's stages chained in this process, warmed up."""
    from p2pswarm.runtime import LocalPipeline, Stage, StageSpec

    runtime = plan["runtime"]
    pipeline = LocalPipeline([
        Stage.from_builtin(model, StageSpec(s["layers"][0], s["layers"][1],
                                            **{k: runtime[k] for k in RUNTIME_FIELDS}))
        for s in plan["stages"]])
    pipeline.generate([1, 2, 3, 4], 4, Sampler.greedy(), stop_token_ids=())
    return pipeline


# --- 1. a pipeline of agents on real loopback sockets ------------------------------------


class LoopbackSwarm:
    """Agents in this process, each on its own UDP+TCP sockets on 127.0.0.1."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.secret = SwarmSecret.generate()
        self.agents: list[Agent] = []

    async def run(self, body: Any) -> Any:
        config = local()
        async with trio.open_nursery() as nursery:
            transports = []
            for _ in range(self.n):
                transports.append(await nursery.start(_transport, config))
            for i, transport in enumerate(transports):
                cards = FakeCardSource((Card(index=0, kind="cpu", name="CPU", uuid="",
                                             total_bytes=16 * 10**9, free_bytes=16 * 10**9),))
                agent = Agent(AgentWorld(
                    name=f"fellow-{i + 1}", transport=transport,
                    keyring=Keyring([self.secret]), identity=Identity.generate(),
                    config=config, epoch=time.time_ns() // 1000,
                    rng=random.Random(i), card_source=cards,
                    seeds=() if i == 0 else (transports[0].local_addr,)))
                self.agents.append(agent)
                await nursery.start(agent.run)
            while not self._ready():
                await trio.sleep(0.05)
            result = await body(self)
            nursery.cancel_scope.cancel()
        return result

    def _ready(self) -> bool:
        for agent in self.agents:
            if agent.leader() is None or agent.membership is None:
                return False
            if sum(m.state == "alive" for m in agent.membership.members()) != self.n:
                return False
        return True

    def by_name(self, name: str) -> Agent:
        return next(a for a in self.agents if a.name == name)


async def _transport(config: Any, *, task_status: Any) -> None:
    async with open_udp_tcp_transport("127.0.0.1:0", config.transport) as transport:
        task_status.started(transport)
        await trio.sleep_forever()


def pipeline_in_process(model: str, tokens: int, prompt: list[int]) -> dict[str, Any]:
    async def body(swarm: LoopbackSwarm) -> dict[str, Any]:
        message = serve_request(model)
        plan = await swarm.agents[0].planning.ask_plan(message)
        began = time.perf_counter()
        await swarm.agents[0].serving.load(message, plan_id=plan["plan_id"])
        load_s = time.perf_counter() - began
        driver = swarm.by_name(plan["stages"][0]["fellow"])
        local = local_pipeline(plan, model)
        await driver.serving.generate(prompt_ids=prompt[:8], max_tokens=4, stop_token_ids=())
        swarm_ticks, local_ticks = Ticks(), Ticks()
        for _ in range(RUNS):  # alternate, so both see the same load on a busy machine
            await driver.serving.generate(prompt_ids=prompt, max_tokens=tokens,
                                          stop_token_ids=(), on_token=swarm_ticks.run())
            await trio.to_thread.run_sync(partial(
                local.generate, prompt, tokens, Sampler.greedy(), stop_token_ids=(),
                on_token=local_ticks.run()))
        await swarm.agents[0].serving.unload()
        return {"plan": plan, "load_s": load_s, "tokens_per_s": swarm_ticks.per_s(),
                "local_tokens_per_s": local_ticks.per_s()}

    return trio.run(LoopbackSwarm(3).run, body)


def pipeline_in_processes(model: str, tokens: int, prompt_text: str) -> dict[str, Any]:
    """Three `p2pswarm join` processes, driven through the control API as the CLI does."""
    from p2pswarm.control.client import request, stream
    from p2pswarm.demo import local_swarm
    from p2pswarm.models import ByteTokenizer

    with local_swarm(lambda text: None) as swarm:
        names = ["fellow-1", "fellow-2", "fellow-3"]
        seed = swarm.start(names[0], extra=("--log-level", "warning"))
        for name in names[1:]:
            swarm.start(name, seeds=(seed,), extra=("--log-level", "warning"))
        for name in names:
            swarm.wait_for(name, lambda s: s["leader"] is not None and sum(
                m["state"] == "alive" for m in s["members"]) == 3, timeout_s=60,
                what="the swarm")
        message = serve_request(model, floors_bytes={"cpu": "100MB"})
        home = swarm.homes[names[0]]
        plan = request(home, {"op": "plan", "request": message}, timeout_s=30)
        driver = swarm.homes[plan["stages"][0]["fellow"]]
        stream(home, {"op": "load", "request": message, "plan_id": plan["plan_id"]},
               lambda e: None, timeout_s=300)
        ask = {"op": "generate", "prompt": prompt_text, "max_tokens": tokens,
               "stop_token_ids": []}
        request(driver, {**ask, "max_tokens": 4}, timeout_s=120)
        local = local_pipeline(plan, model)
        prompt = ByteTokenizer().encode(prompt_text)
        swarm_ticks, local_ticks = Ticks(), Ticks()
        for _ in range(RUNS):
            tick = swarm_ticks.run()
            stream(driver, ask, partial(_on_token_event, tick), timeout_s=120)
            local.generate(prompt, tokens, Sampler.greedy(), stop_token_ids=(),
                           on_token=local_ticks.run())
        request(home, {"op": "unload"}, timeout_s=60)
    return {"plan": plan, "tokens_per_s": swarm_ticks.per_s(),
            "local_tokens_per_s": local_ticks.per_s()}


# --- 2. memory claims against a process's growth ------------------------------------------

_MEASURE = r"""
import ctypes, gc, json, sys, psutil, torch
torch.set_num_threads(1)
libc = ctypes.CDLL("libc.so.6")
def settled_rss():
    # freed heap goes back to the OS first, so RSS counts what is live (and fragmentation)
    gc.collect()
    libc.malloc_trim(0)
    return process.memory_info().rss
from p2pswarm.runtime import Stage, StageSpec
args = json.loads(sys.argv[1])
process = psutil.Process()
# torch's one-time costs (kernels, thread pool, allocator) are not the stage's: run a
# one-layer first and last stage of the same kind through a chunk, and drop them
warm = dict(args["spec"], max_context_tokens=args["spec"]["prefill_chunk_tokens"])
n = args["layers"]
for a, b in ((0, 1), (n - 1, n)):
    s = Stage.from_builtin(args["model"], StageSpec(**dict(warm, start_layer=a, end_layer=b)))
    x = [1] * warm["max_context_tokens"] if s.is_first else torch.zeros(
        warm["max_context_tokens"], s.config.hidden_size, dtype=s.dtype)
    s.prefill("warm", x)
    s.unload()
    del s, x
before = settled_rss()
stage = Stage.from_builtin(args["model"], StageSpec(**args["spec"]))
prompt = [1 + i % 250 for i in range(args["spec"]["max_context_tokens"])]
x = prompt if stage.is_first else torch.zeros(len(prompt), stage.config.hidden_size,
                                               dtype=stage.dtype)
stage.prefill("fill", x)  # the whole context: every page of the KV cache is touched
del x
print(json.dumps({"rss_bytes": settled_rss() - before,
                  "allocated_bytes": stage.allocated_bytes()}))
"""


def memory_rows(model: str, weights: str, kv: str, context: int) -> list[dict[str, Any]]:
    view = cluster_from_dict({"fellows": [
        {"id": f"{i:02x}", "name": f"fellow-{i + 1}",
         "cards": [{"index": 0, "kind": "cpu", "name": "CPU", "total_bytes": "16GB"}]}
        for i in range(3)]})
    plan = plan_message(serve_request(model, weights_dtype=weights, kv_dtype=kv,
                                      context=context), view)
    runtime = plan["runtime"]
    cards = {c["fellow_id"]: c for c in plan["cards"] if c["used"]}
    rows = []
    for s in plan["stages"]:
        seg = cards[s["fellow_id"]]["segments"]
        spec = {"start_layer": s["layers"][0], "end_layer": s["layers"][1],
                **{k: runtime[k] for k in RUNTIME_FIELDS}}
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        out = subprocess.run([sys.executable, "-c", _MEASURE,
                              json.dumps({"model": model, "spec": spec,
                                          "layers": plan["model"]["layers"]})],
                             capture_output=True, text=True, check=True, env=env)
        measured = json.loads(out.stdout.strip().splitlines()[-1])
        claim = seg["weights"] + seg["embeddings_head_buffers"] + seg["kv_cache"]
        rows.append({"model": model, "weights": weights, "kv": kv, "context": context,
                     "stage": s["stage"], "layers": s["layers"], "claim_bytes": claim,
                     "activations_bytes": seg["activations"],
                     "allocated_bytes": measured["allocated_bytes"],
                     "rss_bytes": measured["rss_bytes"]})
    return rows


# --- 3. weights streamed between two fellows ----------------------------------------------


def weights_throughput(model: str, runs: int = 3) -> dict[str, Any]:
    from p2pswarm.models import write_builtin_checkpoint

    with tempfile.TemporaryDirectory(prefix="p2pswarm-bench-") as tmp:
        model_dir = write_builtin_checkpoint(model, Path(tmp) / model,
                                             max_shard_bytes=200_000_000)

        async def body(swarm: LoopbackSwarm) -> list[tuple[int, float]]:
            source, sink = swarm.agents
            manifest = await source.serving.offer(str(model_dir))
            names = [t.name for t in manifest.tensors]
            out = []
            for run in range(runs):
                cache = WeightsCache(Path(tmp) / f"cache-{run}")
                began = time.perf_counter()
                received = await fetch(sink, source.addr, source.node_id, source.name,
                                       manifest, names, cache, sink.serving.run)
                out.append((received, time.perf_counter() - began))
            return out

        results = trio.run(LoopbackSwarm(2).run, body)
    best = max(results, key=lambda r: r[0] / r[1])
    return {"bytes": best[0], "seconds": best[1], "mb_per_s": best[0] / best[1] / 1e6}


def weights_in_a_load(model: str) -> dict[str, Any]:
    """A real `load` of a model directory across two `join` processes: the fellow without
    the files fetches its stage from the one that has them."""
    from p2pswarm.control.client import request, stream
    from p2pswarm.demo import local_swarm
    from p2pswarm.models import write_builtin_checkpoint

    with local_swarm(lambda text: None) as swarm:
        model_dir = write_builtin_checkpoint(model, swarm.root / "model" / model,
                                             max_shard_bytes=200_000_000)
        seed = swarm.start("fellow-1", extra=("--log-level", "warning"))
        swarm.start("fellow-2", seeds=(seed,), extra=("--log-level", "warning"))
        for name in ("fellow-1", "fellow-2"):
            swarm.wait_for(name, lambda s: s["leader"] is not None and sum(
                m["state"] == "alive" for m in s["members"]) == 2, timeout_s=60,
                what="the swarm")
        home = swarm.homes["fellow-1"]
        message = {**serve_request(model, stages=2),
                   "model": {"name": model, "config": json.loads(
                       (model_dir / "config.json").read_text())}}
        runs = []
        for _ in range(3):
            record = stream(home, {"op": "load", "request": message, "path": str(model_dir)},
                            lambda e: None, timeout_s=300)
            request(home, {"op": "unload"}, timeout_s=60)
            (fetched,) = [s for s in record["stages"] if s["fetched_bytes"]]
            runs.append((fetched["fetched_bytes"], fetched["fetch_s"]))
            shutil.rmtree(swarm.homes[fetched["fellow"]] / "weights")  # fetch it all again
    best = max(runs, key=lambda r: r[0] / r[1])
    return {"bytes": best[0], "seconds": best[1], "mb_per_s": best[0] / best[1] / 1e6}


# --- 4. the demo ------------------------------------------------------------------------------


def demo_figures() -> dict[str, Any]:
    from p2pswarm.demo import run_demo

    result = run_demo(lambda text: None, lambda data: None)
    return {"load_s": result["load"]["load_s"],
            "load_to_first_token_s": result["load_to_first_token_s"],
            "first_token_s": result["generation"]["time_to_first_token_s"],
            "same": result["same_as_one_process"], "elapsed_s": result["elapsed_s"]}


# --- 5. failover ------------------------------------------------------------------------


def failover_figures(model: str = "small-llama", kills: int = 3) -> dict[str, Any]:
    """Kill (and freeze) a stage fellow mid-generation; the pauses the driver sees."""
    import signal
    import threading

    from p2pswarm.control.client import request, stream
    from p2pswarm.demo import local_swarm
    from p2pswarm.errors import SwarmError

    names = ["fellow-1", "fellow-2", "fellow-3", "fellow-4"]
    quiet = ("--log-level", "warning")
    with local_swarm(lambda text: None, start_timeout_s=120) as swarm:
        seed = swarm.start(names[0], extra=quiet)
        for name in names[1:]:
            swarm.start(name, seeds=(seed,), extra=quiet)

        def formed() -> None:
            swarm.wait_formed(names)

        formed()
        home = swarm.homes[names[0]]
        message = serve_request(model, floors_bytes={"cpu": "100MB"})
        for attempt in range(3):  # a busy machine may change leaders mid-load
            try:
                record = stream(home, {"op": "load", "request": {**message, "stages": 3}},
                                lambda e: None, timeout_s=300)
                break
            except SwarmError:
                if attempt == 2:
                    raise
                formed()
        plan_id = record["plan_id"]
        ask = {"op": "generate", "prompt": "The swarm " * 4, "max_tokens": 48,
               "stop_token_ids": []}
        want = request(home, ask, timeout_s=120)["token_ids"]

        def victim() -> str:
            leader = swarm.status(names[0])["leader"]["name"]
            (load,) = request(home, {"op": "loads"}, timeout_s=30)["loads"]
            return next(s["fellow"] for s in load["stages"]
                        if s["fellow"] not in (leader, names[0]))

        def disturbed(act: Any) -> tuple[list[float], float, list[int]]:
            """Token arrival times, when ``act`` (run at the 8th token) ended, tokens."""
            times: list[float] = []
            tokens: list[int] = []
            acted: list[float] = []

            def on_event(event: dict[str, Any]) -> None:
                if "token" in event:
                    times.append(time.monotonic())
                    tokens.append(event["token"])
                    if len(times) == 8:
                        threading.Thread(target=lambda: acted.append(act())).start()

            stream(home, ask, on_event, timeout_s=300)
            while not acted:
                time.sleep(0.05)
            return times, acted[0], tokens

        out: dict[str, Any] = {"model": model, "kills": []}
        for _ in range(kills):
            name = victim()
            pid = swarm.processes[name].pid

            def kill() -> float:
                os.kill(pid, signal.SIGKILL)
                return time.monotonic()

            times, killed_at, tokens = disturbed(kill)
            pause = next(t for t in times if t > killed_at) - killed_at
            out["kills"].append({"fellow": name, "kill_to_next_token_s": pause,
                                 "same_tokens": tokens == want})
            swarm.processes[name].wait()
            swarm.launch(name, seeds=(seed,), extra=quiet)  # the next round's spare
            formed()
            # a spare up for a while has torch imported and warm; a fellow started a
            # moment ago is still importing it: let it settle as such a spare would be
            time.sleep(SPARE_SETTLE_S)
        name = victim()
        process = swarm.processes[name]

        def freeze() -> float:
            process.send_signal(signal.SIGSTOP)
            time.sleep(5.0)
            process.send_signal(signal.SIGCONT)
            return time.monotonic()

        (before,) = request(home, {"op": "loads"}, timeout_s=30)["loads"]
        times, back_at, tokens = disturbed(freeze)
        (after,) = request(home, {"op": "loads"}, timeout_s=30)["loads"]
        out["freeze"] = {"fellow": name, "moved": len(after.get("moves", []))
                         != len(before.get("moves", [])),
                         "return_to_next_token_s": next(t for t in times if t > back_at)
                         - back_at if times[-1] > back_at else 0.0,
                         "same_tokens": tokens == want}
        out["moves"] = after.get("moves", [])
        request(home, {"op": "unload", "plan_id": plan_id}, timeout_s=60)
    pauses = [k["kill_to_next_token_s"] for k in out["kills"]]
    out["kill_to_next_token_p50_s"] = statistics.median(pauses)
    out["load_average"] = os.getloadavg()
    return out


def failover_rows(out: dict[str, Any]) -> list[tuple[str, str, str]]:
    pauses = ", ".join(f"{k['kill_to_next_token_s']:.1f}" for k in out["kills"])
    same = all(k["same_tokens"] for k in out["kills"]) and out["freeze"]["same_tokens"]
    load = ", ".join(f"{x:.1f}" for x in out["load_average"])
    freeze = out["freeze"]
    return [
        (f"failover: {out['model']}, 3 stages and a spare (4 `join` processes): a stage's "
         f"process killed mid-generation to the next token, p50 of {len(out['kills'])} "
         f"(load average {load})",
         f"{out['kill_to_next_token_p50_s']:.1f} s ({pauses}); greedy tokens "
         f"{'equal' if same else 'DIFFER'}", "<= 5 s"),
        ("failover: a stage fellow frozen 5 s (SIGSTOP), then continued: re-placed?; its "
         "return to the next token",
         f"{'moved' if freeze['moved'] else 'not moved'}; "
         f"{freeze['return_to_next_token_s']:.2f} s", "not moved; <= 1 s"),
    ]


# --- 6. many clients at once, and a chat that remembers ------------------------------------


def _streamed(home: Path, ask: dict[str, Any]) -> tuple[list[float], dict[str, Any]]:
    """Run a generating op over the control socket: when each token came, and the result."""
    from p2pswarm.control.client import stream

    times: list[float] = []

    def on_event(event: dict[str, Any]) -> None:
        if "token" in event:
            times.append(time.perf_counter())

    result = stream(home, ask, on_event, timeout_s=600)
    return times, result


def many_clients(model: str, tokens: int, clients: int = 8) -> dict[str, Any]:
    """One client, then ``clients`` at once, on a three-stage load with that many slots."""
    import threading

    from p2pswarm.control.client import request
    from p2pswarm.demo import local_swarm

    with local_swarm(lambda text: None) as swarm:
        home, driver = _three_fellow_load(swarm, model, clients)
        prompts = [f"Client {i} asks the swarm: " * 3 for i in range(clients)]

        def ask(i: int) -> dict[str, Any]:
            return {"op": "generate", "prompt": prompts[i], "max_tokens": tokens,
                    "stop_token_ids": []}

        request(driver, {**ask(0), "max_tokens": 4}, timeout_s=120)  # warm every stage
        single = []
        for _ in range(3):
            times, _ = _streamed(driver, ask(0))
            single.append((len(times) - 1) / (times[-1] - times[0]))
        runs: list[list[float]] = [[] for _ in range(clients)]

        def client(i: int) -> None:
            runs[i] = _streamed(driver, ask(i))[0]

        threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        # the steady state: from the last client's first token to the first client's end
        start, end = max(r[0] for r in runs), min(r[-1] for r in runs)
        together = sum(sum(start < t <= end for t in r) for r in runs) / (end - start)
        request(home, {"op": "unload"}, timeout_s=60)
    one = statistics.median(single)
    return {"single_tokens_per_s": one, "aggregate_tokens_per_s": together,
            "ratio": together / one, "clients": clients}



def _three_fellow_load(swarm: Any, model: str, slots: int) -> tuple[Path, Path]:
    """Three `join` fellows holding ``model`` in three stages with ``slots`` session
    slots: the home of the fellow that led the load and of the one driving (stage 0)."""
    from p2pswarm.control.client import request, stream

    swarm.start_timeout_s = 180.0  # a machine other work keeps busy starts slowly
    names = ["fellow-1", "fellow-2", "fellow-3"]
    # three fellows computing all the time on a shared 2-core machine answer probes
    # late: the WiFi preset's patience, so that starvation is not taken for a loss
    extra = ("--log-level", "warning", "--preset", "wifi")
    seed = swarm.start(names[0], extra=extra)
    for name in names[1:]:
        swarm.start(name, seeds=(seed,), extra=extra)
    for name in names:
        swarm.wait_for(name, lambda s: s["leader"] is not None and sum(
            m["state"] == "alive" for m in s["members"]) == 3, timeout_s=180,
            what="the swarm")
    message = serve_request(model, floors_bytes={"cpu": "100MB"}, sequences=slots)
    home = swarm.homes[names[0]]
    plan = request(home, {"op": "plan", "request": message}, timeout_s=30)
    driver = swarm.homes[plan["stages"][0]["fellow"]]
    stream(home, {"op": "load", "request": message, "plan_id": plan["plan_id"]},
           lambda e: None, timeout_s=300)
    return home, driver


def stage_batch_speed(model: str, sessions: int = 8, steps: int = 16) -> dict[str, Any]:
    """One stage of the whole model in this process: decode tokens/s of ``sessions``
    sessions stepped one at a time, against the same steps as one batch."""
    import torch

    from p2pswarm.runtime import Stage, StageSpec

    layers = BUILTIN_MODELS[model]["num_hidden_layers"]
    stage = Stage.load(model, StageSpec(0, layers, max_sessions=sessions,
                                        max_context_tokens=256))
    names = [f"s{i}" for i in range(sessions)]
    for i, name in enumerate(names):
        stage.prefill(name, [1 + (i * 7 + j) % 250 for j in range(40 + i)])
    began = time.perf_counter()
    for _ in range(steps):
        for name in names:
            stage.decode(name, 5, stage.session_length(name))
    alone = sessions * steps / (time.perf_counter() - began)
    began = time.perf_counter()
    for _ in range(steps):
        stage.decode_batch(names, torch.full((sessions,), 5),
                           [stage.session_length(n) for n in names])
    batched = sessions * steps / (time.perf_counter() - began)
    return {"alone_tokens_per_s": alone, "batched_tokens_per_s": batched,
            "ratio": batched / alone}


def chat_figures(model: str, chats: int = 3, slots: int = 8) -> dict[str, Any]:
    """``chats`` five-turn chats on a three-stage load, the session's cache kept and not,
    alternating chat by chat so both see the same machine; with each turn's prefill in
    one process beside it (the compute floor)."""
    from p2pswarm.control.client import request
    from p2pswarm.demo import local_swarm

    with local_swarm(lambda text: None) as swarm:
        home, driver = _three_fellow_load(swarm, model, slots)
        request(driver, {"op": "generate", "prompt": "warm", "max_tokens": 4,
                         "stop_token_ids": []}, timeout_s=120)  # warm every stage
        runs: dict[bool, list[dict[str, Any]]] = {True: [], False: []}
        pids = [swarm.processes[name].pid for name in sorted(swarm.processes)]
        for chat in range(chats):
            for kept in (True, False):
                runs[kept].append(_one_chat(driver, kept, 5, chat, pids))
        request(home, {"op": "unload"}, timeout_s=60)
    out: dict[str, Any] = {kept: _chat_summary(runs[kept]) for kept in (True, False)}
    last = runs[True][-1]
    new = last["prompt_tokens"][-1] - last["cached_tokens"][-1]
    out["in_process_staged"] = prefill_in_process(model, new, last["cached_tokens"][-1],
                                                  last["prompt_tokens"][0], stages=3,
                                                  slots=slots)
    out["in_process"] = prefill_in_process(model, new, last["cached_tokens"][-1],
                                           last["prompt_tokens"][0])
    return out


def _chat_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each turn's median over the chats: the driver's time to first token (from its
    first frame to stage 0 to the token), the client's (from the request to the token),
    and the stages' prefill compute."""
    turns = len(runs[0]["ttft_s"])

    def median(key: str) -> list[float]:
        return [statistics.median(r[key][t] for r in runs) for t in range(turns)]

    ttft, client, compute = median("ttft_s"), median("client_ttft_s"), median("prefill_s")
    beside = [r["ttft_s"][-1] / r["first_beside_s"] for r in runs]
    cpu = [sum(r["fifth_cpu_s"]) / sum(r["first_beside_cpu_s"]) for r in runs]
    return {"ttft_s": ttft, "client_ttft_s": client, "prefill_s": compute,
            "beside_ratios": beside, "beside_ratio": statistics.median(beside),
            "cpu_ratios": cpu, "cpu_ratio": statistics.median(cpu),
            "fifth_cpu_s": statistics.median(sum(r["fifth_cpu_s"]) for r in runs),
            "first_beside_cpu_s": statistics.median(sum(r["first_beside_cpu_s"])
                                                    for r in runs),
            "cached_tokens": [r["cached_tokens"] for r in runs],
            "prompt_tokens": runs[-1]["prompt_tokens"], "ratio": ttft[-1] / ttft[0],
            "client_ratio": client[-1] / client[0], "compute_ratio": compute[-1] / compute[0],
            "ratios": [r["ttft_s"][-1] / r["ttft_s"][0] for r in runs],
            "load_average": [r["load_average"] for r in runs], "runs": runs}


def _one_chat(driver: Path, kept: bool, turns: int, chat: int,
              pids: list[int]) -> dict[str, Any]:
    """One chat's turns; and just before its last turn, the first turn of another chat
    of the same length (the same machine's moment for both: a busy machine's load moves
    within the seconds between a chat's first turn and its fifth). Those two turns stop
    at their first token, and the fellows' CPU time over each is taken (``pids``): the
    turn's work (the prefill and the fixed costs around it) as the processes spent it,
    which waiting for a busy core does not stretch as it stretches the wall time."""
    messages: list[dict[str, str]] = []
    out: dict[str, Any] = {k: [] for k in ("ttft_s", "client_ttft_s", "prefill_s",
                                           "cached_tokens", "prompt_tokens")}
    for turn in range(turns):
        last = turn == turns - 1
        if last:
            before = processes_cpu_s(pids)
            side = _turn(driver, kept, [_user(f"Side {chat}", 0)], max_tokens=1)[0]
            out["first_beside_cpu_s"] = _minus(processes_cpu_s(pids), before)
            out["first_beside_s"] = side["time_to_first_token_s"]
        messages.append(_user(f"Chat {chat}", turn))
        before = processes_cpu_s(pids)
        result, client_s = _turn(driver, kept, messages, max_tokens=1 if last else 24)
        if last:
            out["fifth_cpu_s"] = _minus(processes_cpu_s(pids), before)
        out["ttft_s"].append(result["time_to_first_token_s"])
        out["client_ttft_s"].append(client_s)
        out["prefill_s"].append(sum(s.get("prefill_ms", 0.0) for s in result["stages"]) / 1e3)
        out["cached_tokens"].append(result.get("cached_tokens", 0))
        out["prompt_tokens"].append(result["prompt_tokens"])
        messages.append({"role": "assistant", "content": result["text"]})
    out["load_average"] = os.getloadavg()[0]
    return out


def processes_cpu_s(pids: list[int]) -> list[float]:
    """Each process's CPU time so far, its live threads' together, in nanoseconds' detail
    (``/proc/PID/task/TID/schedstat``; ``/proc/PID/stat`` counts only 10 ms ticks)."""
    out = []
    for pid in pids:
        total = 0
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                total += int((task / "schedstat").read_text().split()[0])
            except (OSError, ValueError, IndexError):
                pass  # a thread that ended meanwhile
        out.append(total / 1e9)
    return out


def _minus(after: list[float], before: list[float]) -> list[float]:
    return [a - b for a, b in zip(after, before)]


def _user(chat: str, turn: int) -> dict[str, str]:
    return {"role": "user", "content": f"{chat}, turn {turn}: tell the swarm more. " * 3}


def _turn(driver: Path, kept: bool, messages: list[dict[str, str]], max_tokens: int = 24
          ) -> tuple[dict[str, Any], float]:
    """One turn, through the chat op (the session kept) or generate on the same prompt:
    its result, and the time from the request to the first token as the client sees it."""
    from p2pswarm.control.client import stream
    from p2pswarm.models.chat_template import plain_prompt

    options = {"max_tokens": max_tokens, "stop_token_ids": [], "temperature": 0.0}
    ask = ({"op": "chat", "messages": messages, **options} if kept else
           {"op": "generate", "prompt": plain_prompt(messages), **options})
    first: list[float] = []

    def on_event(event: dict[str, Any]) -> None:
        if "token" in event and not first:
            first.append(time.perf_counter())

    sent = time.perf_counter()
    result = stream(driver, ask, on_event, timeout_s=600)
    return result, first[0] - sent


def prefill_in_process(model: str, new: int, cached: int, first: int, runs: int = 9,
                       stages: int = 1, slots: int = 2) -> dict[str, Any]:
    """The fifth turn's prefill in one process (``new`` tokens after ``cached``) against
    the first's (``first`` tokens, nothing cached), all layers, one thread, runs
    alternating; the thread's CPU time too, which other processes' work disturbs less.
    With ``stages`` > 1 the layers are cut as a load cuts them and the hidden states go
    from stage to stage as frames, as between fellows (``slots`` sessions each)."""
    from p2pswarm.runtime import Stage, StageSpec
    from p2pswarm.runtime.frame import decode_tensor, encode_tensor

    layers = BUILTIN_MODELS[model]["num_hidden_layers"]
    cuts = [layers * i // stages for i in range(stages + 1)]
    chain = [Stage.load(model, StageSpec(a, b, max_sessions=slots, max_context_tokens=1024))
             for a, b in zip(cuts, cuts[1:])]
    ids = [1 + (i * 7) % 250 for i in range(cached + new)]

    def prefill(session: str, tokens: list[int]) -> None:
        x: Any = tokens
        for i, stage in enumerate(chain):
            if i:
                x = decode_tensor(bytes(encode_tensor(x)))
            x = stage.prefill(session, x)

    def end(session: str) -> None:
        for stage in chain:
            stage.end_session(session)

    prefill("long", ids[:cached])

    def fresh() -> tuple[float, float]:
        end("short")
        wall, cpu = time.perf_counter(), time.thread_time()
        prefill("short", ids[:first])
        return time.perf_counter() - wall, time.thread_time() - cpu

    def continued() -> tuple[float, float]:
        end("long")
        prefill("long", ids[:cached])
        wall, cpu = time.perf_counter(), time.thread_time()
        prefill("long", ids[cached:])
        return time.perf_counter() - wall, time.thread_time() - cpu

    fresh(), continued()
    a, b = [], []
    for _ in range(runs):
        a.append(fresh())
        b.append(continued())
    wall_a, wall_b = (statistics.median(t[0] for t in x) for x in (a, b))
    cpu_a, cpu_b = (statistics.median(t[1] for t in x) for x in (a, b))
    return {"new": new, "cached": cached, "first": first, "stages": stages, "first_s": wall_a,
            "fifth_s": wall_b, "ratio": wall_b / wall_a, "first_cpu_s": cpu_a,
            "fifth_cpu_s": cpu_b, "cpu_ratio": cpu_b / cpu_a,
            "load_average": os.getloadavg()[0]}


def chat_rows(chat: dict[Any, Any]) -> list[tuple[str, str, str]]:
    rows = []
    for kept in (True, False):
        c = chat[kept]
        how = "kept between turns" if kept else "not kept (for comparison)"
        loads = ", ".join(f"{x:.1f}" for x in c["load_average"])
        rows.append((f"chat of 5 turns, the session's cache {how}: fifth turn's time to "
                     f"first token, against the first's (medians of {len(c['ratios'])} chats)",
                     f"{c['ttft_s'][-1]:.3f} / {c['ttft_s'][0]:.3f} s = {c['ratio']:.2f} "
                     f"(chats: {', '.join(f'{r:.2f}' for r in c['ratios'])}; as the client "
                     f"sees it {c['client_ttft_s'][-1]:.3f} / {c['client_ttft_s'][0]:.3f} s = "
                     f"{c['client_ratio']:.2f}; the stages' prefill compute "
                     f"{c['prefill_s'][-1]:.3f} / {c['prefill_s'][0]:.3f} s = "
                     f"{c['compute_ratio']:.2f}; each fifth turn against another chat's "
                     f"first turn just before it: median "
                     f"{c['beside_ratio']:.2f} "
                     f"({', '.join(f'{r:.2f}' for r in c['beside_ratios'])}); "
                     f"the fellows' CPU time over those two turns: "
                     f"{c['fifth_cpu_s']:.3f} / {c['first_beside_cpu_s']:.3f} s, median "
                     f"{c['cpu_ratio']:.2f} ({', '.join(f'{r:.2f}' for r in c['cpu_ratios'])}); "
                     f"fifth turn cached "
                     f"{[r[-1] for r in c['cached_tokens']]} of {c['prompt_tokens'][-1]} "
                     f"tokens; load average {loads})", "<= 1.2" if kept else "reported"))
    for key, how in (("in_process", "one stage"),
                     ("in_process_staged", "three stages, frames between them")):
        p = chat[key]
        rows.append((f"... the fifth turn's prefill in one process, {how} ({p['new']} new "
                     f"tokens after {p['cached']} cached) against the first's ({p['first']} "
                     "tokens)",
                     f"{p['fifth_s'] * 1e3:.0f} / {p['first_s'] * 1e3:.0f} ms = "
                     f"{p['ratio']:.2f} (thread CPU time {p['cpu_ratio']:.2f}; load average "
                     f"{p['load_average']:.1f})", "reported (the floor)"))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["tiny-llama", "small-llama"])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--skip-processes", action="store_true")
    parser.add_argument("--skip-demo", action="store_true")
    parser.add_argument("--skip-single-stream", action="store_true")
    parser.add_argument("--only-single-stream", action="store_true")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--markdown", action="store_true", help="the table for the docs")
    parser.add_argument("--only-failover", action="store_true", help="section 5 alone")
    parser.add_argument("--kills", type=int, default=3, help="failover: kills measured")
    parser.add_argument("--many", action="store_true", help="add section 6 (many clients)")
    parser.add_argument("--only-many", action="store_true", help="section 6 alone")
    parser.add_argument("--only-chat", action="store_true", help="section 6's chat alone")
    parser.add_argument("--chats", type=int, default=3, help="chat: chats of five turns")
    parser.add_argument("--failover-context", type=int, default=0, metavar="N",
                        help="failover of a session with N tokens of context, survivors "
                        "keeping their cache against every stage replaying, alone")
    parser.add_argument("--rounds", type=int, default=1, help="--failover-context: rounds")
    args = parser.parse_args()
    if args.failover_context:
        import failover_replay  # beside this file

        replay = failover_replay.figures("small-llama", args.failover_context, args.rounds)
        if args.json:
            print(json.dumps(replay, indent=2))
            return
        for stage in range(3):
            s = replay[f"stage_{stage}"]
            print(f"failover, stage {stage} lost, {args.failover_context} tokens of context: "
                  f"kill to next token {s['kill_to_next_token_kept_p50_s']:.2f} s, every "
                  f"stage replaying {s['kill_to_next_token_every_p50_s']:.2f} s; CPU time "
                  f"{s['cpu_kept_p50_s']:.2f} s against {s['cpu_every_p50_s']:.2f} s")
        print("load average", ", ".join(f"{x:.1f}" for x in os.getloadavg()))
        return
    if args.only_failover:
        out = failover_figures(kills=args.kills)
        if args.json:
            print(json.dumps(out, indent=2))
            return
        for figure, value, target in failover_rows(out):
            print(f"| {figure} | {target} | {value} |" if args.markdown
                  else f"{figure}\n    {value}  (target {target})")
        return
    import torch

    torch.set_num_threads(1)
    tune_allocator()
    prompt = [256, *range(32, 32 + 39)]  # 40 tokens
    rows: list[tuple[str, str, str]] = []
    data: dict[str, Any] = {"machine": f"{platform.machine()}, {os.cpu_count()} cores, "
                            f"Python {sys.version.split()[0]}, torch {torch.__version__}, "
                            "one torch thread per stage"}

    def speed_rows(model: str, where: str, pipeline_tps: float, local_tps: float) -> None:
        ratio = pipeline_tps / local_tps
        hop_ms = (1e3 / pipeline_tps - 1e3 / local_tps) / HOPS
        size = f"{model} ({params(model)} parameters, f32)"
        rows.append((f"{size}, 3 stages {where}: decode tokens/s, against one process",
                     f"{pipeline_tps:.1f} / {local_tps:.1f} = {ratio:.2f}", ">= 0.8"))
        rows.append((f"{size}, 3 stages {where}: added latency per hop ({HOPS} a token)",
                     f"{hop_ms:.2f} ms", "<= 1.5 ms"))

    if args.only_single_stream or args.only_many or args.only_chat:
        args.models, args.skip_processes, args.skip_demo = [], True, True
        args.skip_single_stream = (args.skip_single_stream or args.only_many
                                   or args.only_chat)
    if args.many or args.only_many:
        compute = stage_batch_speed("small-llama")
        data["stage_batch"] = compute
        rows.append(("small-llama, all 12 layers as one stage in this process: decode "
                     "tokens/s of 8 sessions as one batch, against one at a time",
                     f"{compute['batched_tokens_per_s']:.1f} / "
                     f"{compute['alone_tokens_per_s']:.1f} = {compute['ratio']:.2f}",
                     "reported"))
        many = many_clients("small-llama", args.tokens)
        data["many"] = many
        rows.append(("small-llama, 3 stages (3 `join` processes, 8 slots): aggregate decode "
                     "tokens/s of 8 clients at once, against one client",
                     f"{many['aggregate_tokens_per_s']:.1f} / "
                     f"{many['single_tokens_per_s']:.1f} = {many['ratio']:.2f}", ">= 3"))
    if args.many or args.only_many or args.only_chat:
        chat = chat_figures("small-llama", chats=args.chats)
        data["chat"] = chat
        rows += chat_rows(chat)
    for model in args.models:
        out = pipeline_in_process(model, args.tokens, prompt)
        data[f"pipeline_{model}"] = {k: v for k, v in out.items() if k != "plan"}
        speed_rows(model, "(agents on loopback sockets)", out["tokens_per_s"],
                   out["local_tokens_per_s"])
        if not args.skip_processes:
            procs = pipeline_in_processes(model, args.tokens, "The swarm " * 4)
            data[f"processes_{model}"] = {k: v for k, v in procs.items() if k != "plan"}
            speed_rows(model, "(3 `join` processes)", procs["tokens_per_s"],
                       procs["local_tokens_per_s"])
    memory = []
    only = args.only_single_stream or args.only_many or args.only_chat
    stages = () if only else (("tiny-llama", "f32", "f32", 2048),
                                                 ("small-llama", "f32", "f16", 2048),
                                                 ("small-llama", "f16", "f16", 4096),
                                                 ("small-llama", "int8", "int8", 2048))
    for model, weights, kv, context in stages:
        memory += memory_rows(model, weights, kv, context)
    data["memory"] = memory
    if memory:
        worst = max(memory, key=lambda r: abs(r["rss_bytes"] / r["claim_bytes"] - 1))
        figure = ("memory: a process's lasting growth (RSS) from loading a stage and a "
                  f"full-context prefill, over the plan's claim (worst of {len(memory)} "
                  "stages)")
        rows.append((figure, f"{worst['rss_bytes'] / worst['claim_bytes']:.3f}",
                     "within 10%"))
        exact = all(r["allocated_bytes"] == r["claim_bytes"] for r in memory)
        figure = "memory: tensors a stage holds = the plan's weights + embeddings + KV cache"
        rows.append((figure, f"{'all' if exact else 'NOT all'} {len(memory)} equal", "exact"))
    if not only:
        stream = weights_throughput("small-llama")
        data["weights"] = stream
        figure = (f"weights streamed between two agents in one process on loopback "
                  f"({stream['bytes'] / 1e6:.0f} MB, sealed, SHA-256 checked, cached)")
        rows.append((figure, f"{stream['mb_per_s']:.0f} MB/s", ">= 200 MB/s"))
    if not args.skip_processes:
        loaded = weights_in_a_load("small-llama")
        data["weights_in_a_load"] = loaded
        figure = (f"stage weights fetched by a fellow during a `load`, two `join` processes "
                  f"({loaded['bytes'] / 1e6:.0f} MB)")
        rows.append((figure, f"{loaded['mb_per_s']:.0f} MB/s", ">= 200 MB/s"))
    if not args.skip_processes:
        failover = failover_figures(kills=args.kills)
        data["failover"] = failover
        rows += failover_rows(failover)
    if not args.skip_demo:
        demo = demo_figures()
        data["demo"] = demo
        figure = "`p2pswarm demo` (demo-llama, 3 processes): from `load` to the first token"
        rows.append((figure, f"{demo['load_to_first_token_s']:.1f} s", "reported"))
    if not args.skip_single_stream:
        from single_stream import measure

        single = measure()
        data["single_stream"] = single
        tps = single["tokens_per_s"]
        figure = ("single stream, 68 M Llama f32, 128 tokens: 2 `join` fellows against "
                  f"transformers' generate ({single['transformers_threads']} threads), "
                  "side by side")
        rows.append((figure, f"{tps['2 fellows']:.1f} / {tps['transformers']:.1f} = "
                     f"{single['ratio_2_fellows']:.2f} (1 fellow {tps['1 fellow']:.1f}, "
                     f"2 fellows with every core each {tps['2 fellows, all cores each']:.1f}; "
                     f"load {single['load_average']:.1f}; same tokens: "
                     f"{single['same_tokens']})", ">= 0.9"))
    if args.json:
        print(json.dumps({**data, "rows": rows}, indent=2))
        return
    if args.markdown:
        print(f"machine: {data['machine']}\n\n| figure | target | measured |\n|---|---|---|")
        for figure, value, target in rows:
            print(f"| {figure} | {target} | {value} |")
        return
    print(f"machine: {data['machine']}")
    width = max(len(r[0]) for r in rows)
    for figure, value, target in rows:
        print(f"{figure:<{width}}  {value:>22}  (target {target})")
    print("\nmemory per stage (MB): claim = weights + embeddings/head/buffers + KV cache (the "
          "plan's activations, transient, are claimed on top)")
    for r in memory:
        print(f"  {r['model']:<12} {r['weights']:>4} kv {r['kv']:<4} ctx {r['context']:>5} "
              f"stage {r['stage']} layers {r['layers'][0]:>2}-{r['layers'][1] - 1:<2}  "
              f"claim {r['claim_bytes'] / 1e6:7.1f}  rss {r['rss_bytes'] / 1e6:7.1f}  "
              f"ratio {r['rss_bytes'] / r['claim_bytes']:.3f}")


if __name__ == "__main__":
    main()
