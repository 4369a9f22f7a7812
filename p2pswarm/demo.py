"""`p2pswarm demo`: a real swarm of separate agent processes on loopback serves a model
none of them could hold alone, then everything is cleaned up.

Three fellows start as `p2pswarm join` processes, each offering its CPU capped at
``DEMO_CPU_MEMORY`` (``join --cpu-memory``). The planner keeps a quarter of a gigabyte
of every CPU card as headroom for the operating system, so each fellow has room for
about a third of the built-in ``small-llama`` at float32 (12 layers, 38 M parameters,
0.15 GB of weights, plus its KV cache): the plan needs all three. The demo shows the
status and the plan, loads exactly that plan (``--plan-id``), generates, checks the
tokens against the same model run in this one process, and leaves.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from p2pswarm.control.client import request, stream
from p2pswarm.errors import ControlError, SwarmError
from p2pswarm.home import Home
from p2pswarm.security import SwarmSecret

Say = Callable[[str], None]
Show = Callable[[dict[str, Any]], None]

DEMO_MODEL = "small-llama"
DEMO_CPU_MEMORY = "360MB"  # per fellow: a third of the model each, with the OS headroom
DEMO_FLOOR = "250MB"  # the planner's default floor (1 GB) would leave these small cards out
DEMO_PROMPT = "The swarm"
DEMO_MAX_TOKENS = 32


@dataclass
class LocalSwarm:
    """Fellows as child processes, each with its own state directory under ``root``."""

    root: Path
    secret: SwarmSecret
    say: Say
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    homes: dict[str, Path] = field(default_factory=dict)

    def start(self, name: str, seeds: tuple[str, ...] = (), extra: tuple[str, ...] = ()) -> str:
        """Start a fellow and return its address once its agent answers."""
        self.launch(name, seeds, extra)
        return self.address(name)

    def address(self, name: str) -> str:
        """A launched fellow's address, once its agent answers."""
        status = self.wait_for(name, lambda s: True, timeout_s=30, what="its agent to start")
        return str(status["self"]["addr"])

    def launch(self, name: str, seeds: tuple[str, ...] = (), extra: tuple[str, ...] = ()) -> None:
        """Start a fellow's process (see ``address`` to wait for it)."""
        home = self.root / name
        Home(home).join_swarm(self.secret)
        log = open(self.root / f"{name}.log", "wb")
        command = [sys.executable, "-m", "p2pswarm.cli", "join", *seeds, "--listen",
                   "127.0.0.1:0", "--name", name, "--preset", "local", "--home", str(home),
                   *extra]
        # several fellows share this machine's cores: one torch thread each, or their
        # threads spend the time waiting for each other
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        self.processes[name] = subprocess.Popen(command, stdout=log, stderr=log,
                                                stdin=subprocess.DEVNULL, env=env)
        self.homes[name] = home

    def status(self, name: str) -> dict[str, Any]:
        return request(self.homes[name], {"op": "status"}, timeout_s=5)  # type: ignore[no-any-return]

    def wait_for(self, name: str, ready: Callable[[dict[str, Any]], bool], *, timeout_s: float,
                 what: str) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            process = self.processes[name]
            if process.poll() is not None:
                log = (self.root / f"{name}.log").read_text(errors="replace")[-2000:]
                raise SwarmError(f"fellow {name} exited with {process.returncode}:\n{log}")
            try:
                status = self.status(name)
                if ready(status):
                    return status
            except ControlError:
                pass
            if time.monotonic() > deadline:
                raise SwarmError(f"fellow {name}: gave up waiting for {what} after {timeout_s:g} s")
            time.sleep(0.1)

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGINT)
        for name, process in self.processes.items():
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.say(f"fellow {name} did not leave within 10 s; killing it")
                process.kill()
                process.wait()


@contextmanager
def local_swarm(say: Say, keep: bool = False) -> Iterator[LocalSwarm]:
    root = Path(tempfile.mkdtemp(prefix="p2pswarm-demo-"))
    swarm = LocalSwarm(root=root, secret=SwarmSecret.generate(), say=say)
    try:
        yield swarm
    finally:
        swarm.stop()
        if keep:
            say(f"state and logs kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


def demo_request(model: str = DEMO_MODEL) -> dict[str, Any]:
    """The plan request the demo loads: float32 weights, the planner's other defaults."""
    from p2pswarm.planner import BUILTIN_MODELS

    return {"model": {"name": model, "config": BUILTIN_MODELS[model]}, "kind": "serve",
            "weights_dtype": "f32", "floors_bytes": {"cpu": DEMO_FLOOR}}


def run_demo(say: Say, render_status: Show, render_plan: Show | None = None,
             write: Callable[[str], None] | None = None, *, fellows: int = 3,
             keep: bool = False, prompt: str = DEMO_PROMPT,
             max_tokens: int = DEMO_MAX_TOKENS) -> dict[str, Any]:
    """Form a swarm of ``fellows`` processes on loopback, load the demo model across them
    with the plan it shows, generate, and clean up. ``write`` streams the text."""
    started = time.monotonic()
    names = [f"fellow-{i + 1}" for i in range(fellows)]
    cap = ("--cpu-memory", DEMO_CPU_MEMORY, "--log-level", "warning")
    with local_swarm(say, keep) as swarm:
        say(f"starting {fellows} fellows on loopback in {swarm.root}, each offering "
            f"{DEMO_CPU_MEMORY} of RAM")
        seed = swarm.start(names[0], extra=cap)
        say(f"{names[0]} listening on {seed}")
        for name in names[1:]:
            swarm.launch(name, seeds=(seed,), extra=cap)
        for name in names[1:]:
            say(f"{name} listening on {swarm.address(name)}, joining through {seed}")
        for name in names:
            swarm.wait_for(name, lambda s: s["leader"] is not None and sum(
                m["state"] == "alive" for m in s["members"]) == fellows, timeout_s=60,
                what="the swarm to form and elect a leader")
        status = swarm.status(names[0])
        say(f"swarm formed in {time.monotonic() - started:.1f} s")
        render_status(status)

        home = swarm.homes[names[0]]
        message = demo_request()
        plan = request(home, {"op": "plan", "request": message}, timeout_s=30)
        if render_plan is not None:
            render_plan(plan)
        used = sorted({s["fellow"] for s in plan["stages"]})
        if not plan["fits"]:
            raise SwarmError(f"the demo model does not fit: {plan['layout']['limit']['sentence']}")
        say(f"{DEMO_MODEL} needs {len(used)} of the {fellows} fellows; loading plan "
            f"{plan['plan_id']} (load {DEMO_MODEL} --plan-id {plan['plan_id']})")

        def progress(event: dict[str, Any]) -> None:
            p = event.get("progress") or {}
            if p.get("phase") == "ready":
                say(f"  stage {p['stage']} on {p['fellow']}: ready, "
                    f"{p['done_bytes'] / 1e6:,.1f} MB allocated (plan claimed "
                    f"{p['total_bytes'] / 1e6:,.1f} MB)")

        load_began = time.monotonic()
        record = stream(home, {"op": "load", "request": message, "plan_id": plan["plan_id"]},
                        progress, timeout_s=120)
        say(f"loaded in {time.monotonic() - load_began:.1f} s")

        say(f"generating {max_tokens} tokens after {prompt!r} (the built-in model's weights "
            "are random: expect noise, the same noise one process makes):")
        pieces: list[str] = []

        def token(event: dict[str, Any]) -> None:
            if isinstance(event.get("text"), str):
                pieces.append(event["text"])
                if write is not None:
                    write(event["text"])

        result = stream(home, {"op": "generate", "prompt": prompt, "max_tokens": max_tokens},
                        token, timeout_s=120)
        first_token_s = time.monotonic() - load_began
        if write is not None:
            write("\n")
        say(f"{len(result['token_ids'])} tokens: first after "
            f"{result['time_to_first_token_s']:.2f} s, then "
            f"{result['decode_tokens_per_s']:.1f} tokens/s")
        say("per token: " + ", ".join(
            f"stage {s['stage']} on {s['fellow']} (layers {s['layers'][0]}-"
            f"{s['layers'][1] - 1}) {s['ms_per_token']:.1f} ms" for s in result["stages"])
            + f", network {result['network_ms_per_token']:.1f} ms over {result['hops']} hops")
        same = result["token_ids"] == one_process_tokens(plan, prompt, max_tokens)
        say("checked against the same model in one process: "
            + ("the same tokens" if same else "DIFFERENT tokens"))
        request(home, {"op": "unload", "plan_id": plan["plan_id"]}, timeout_s=30)
        say("unloaded; leaving")
    return {"status": status, "plan_id": plan["plan_id"], "fellows_used": used,
            "load": record, "generation": result, "same_as_one_process": same,
            "load_to_first_token_s": first_token_s,
            "elapsed_s": time.monotonic() - started}


def one_process_tokens(plan: dict[str, Any], prompt: str, max_tokens: int) -> list[int]:
    """What the planned stages give when chained in this process (greedy)."""
    import torch

    from p2pswarm.models import ByteTokenizer
    from p2pswarm.runtime import LocalPipeline, Sampler, Stage, StageSpec

    runtime = plan["runtime"]
    fields = ("dtype", "quant", "quant_group_size", "kv_dtype", "max_context_tokens",
              "max_sessions", "prefill_chunk_tokens")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        pipeline = LocalPipeline([
            Stage.from_builtin(DEMO_MODEL, StageSpec(s["layers"][0], s["layers"][1],
                                                     **{k: runtime[k] for k in fields}))
            for s in plan["stages"]])
        tokenizer = ByteTokenizer()
        generation = pipeline.generate(tokenizer.encode(prompt), max_tokens, Sampler.greedy(),
                                       stop_token_ids=tokenizer.eos_ids)
    finally:
        torch.set_num_threads(threads)
    return list(generation.token_ids)
