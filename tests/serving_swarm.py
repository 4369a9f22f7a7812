"""A swarm that serves, for the serving tests: three fellows in virtual time with their
torch work inline (it takes no virtual time) and each its own weights cache; the request
they load; the same stages in one process to compare with."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import trio

from p2pswarm.agent import Agent
from p2pswarm.agent.world import AgentWorld, Services
from p2pswarm.models import write_builtin_checkpoint
from p2pswarm.planner import BUILTIN_MODELS
from p2pswarm.planner.profile import RUNTIME_WEIGHTS
from p2pswarm.runtime import LocalPipeline, Stage, StageSpec
from p2pswarm.sim.virtual import Fellow, VirtualSwarm, wait_until
from tests.cpu_swarm import start_cpu_swarm

MODEL = "tiny-llama"
PROMPT = [256, *range(32, 127), *range(40, 240)]  # 296 tokens: two prefill chunks of 256


def request(**extra: Any) -> dict[str, Any]:
    return {"model": {"name": MODEL, "config": BUILTIN_MODELS[MODEL]}, "stages": 3,
            "weights_dtype": "f32", "kv_dtype": "f32", "context": 512, **extra}


async def start_swarm(nursery: trio.Nursery, tmp_path: Path, seed: int,
                      n: int = 3, keep_loads: bool = False) -> VirtualSwarm:
    """``n`` fellows, each with its own weights cache; with ``keep_loads``, each keeps
    the stage orders it is handed in a directory of its own, as under its home (a fellow
    started again reads them back)."""
    def own_weights_cache(fellow: Fellow, world: AgentWorld) -> Agent:
        return Agent(replace(world, services=Services(
            weights_dir=tmp_path / f"cache-{fellow.index}",
            loads_dir=tmp_path / f"loads-{fellow.index}" if keep_loads else None)))

    return await start_cpu_swarm(nursery, n, seed, agent_factory=own_weights_cache)


def reference(plan: dict[str, Any], source: object) -> LocalPipeline:
    """The same stages as the plan, in this process, each in its own weights dtype."""
    runtime = plan["runtime"]
    fields = ("dtype", "quant", "quant_group_size", "kv_dtype", "max_context_tokens",
              "max_sessions", "prefill_chunk_tokens")

    def own(s: dict[str, Any]) -> dict[str, Any]:
        dtype, quant = RUNTIME_WEIGHTS.get(s.get("weights_dtype") or "", (None, None))
        return {k: runtime[k] for k in fields} | (
            {"dtype": dtype, "quant": quant} if dtype else {})

    return LocalPipeline([
        Stage.load(source, StageSpec(s["layers"][0], s["layers"][1],  # type: ignore[arg-type]
                                     **own(s)))
        for s in plan["stages"]])


def nothing_held(swarm: VirtualSwarm) -> bool:
    return all(not a.serving.hosted and a.serving.allocated_bytes() == 0 for a in swarm.live())


async def next_leader(swarm: VirtualSwarm, old_id: bytes, old_term: int,
                      timeout_s: float = 60.0) -> Agent:
    """The one leader every live fellow names, once one other than ``old_id`` leads a term
    after ``old_term``."""
    def found() -> Agent | None:
        seen = swarm.leaders()
        if len(seen) != 1:
            return None
        ((lid, term),) = seen
        if lid is None or lid == old_id or term <= old_term:
            return None
        return next(a for a in swarm.live() if a.node_id == lid)

    await wait_until(lambda: found() is not None, timeout_s=timeout_s)
    new = found()
    assert new is not None
    return new


async def adopted(swarm: VirtualSwarm, old_id: bytes, old_term: int, plan_id: str) -> Agent:
    """The next leader (see ``next_leader``), once it has adopted load ``plan_id``."""
    new = await next_leader(swarm, old_id, old_term)
    await wait_until(lambda: plan_id in new.serving.loads, timeout_s=30)
    return new


def crashing_after(swarm: VirtualSwarm, victim: int, tokens: int, seen: list[int]
                   ) -> Callable[[int, str], None]:
    """A generation's ``on_token`` that keeps each token in ``seen`` and crashes fellow
    ``victim`` once ``tokens`` have come."""
    def on_token(token: int, text: str) -> None:
        seen.append(token)
        if len(seen) == tokens:
            swarm.crash(victim)

    return on_token


def short_grace(swarm: VirtualSwarm) -> None:
    """Every live fellow's failover waits 2 s, not its default, before it re-places the
    stage of a fellow gone silent."""
    for agent in swarm.live():
        agent.serving.failover.grace_s = 2.0


def write_model(tmp_path_factory: Any) -> Path:
    """The built-in model's checkpoint in shards of 4 MB, in a new temporary directory."""
    return write_builtin_checkpoint(MODEL, tmp_path_factory.mktemp("model") / MODEL,
                                    max_shard_bytes=4_000_000)


def random_adapter(out: Path, model: str, config: Any, *, base: str, seeds: tuple[int, int]
                   ) -> Path:
    """LoRA adapters on every layer of built-in ``model`` (saved as for ``base``), with
    random non-zero B: seeds for the A initialisation and for B."""
    import torch

    from p2pswarm.training.lora import apply_lora, save_adapters

    n = int(BUILTIN_MODELS[model]["num_hidden_layers"])
    stage_model = Stage.load(model, StageSpec(0, n, dtype="float32"))._model
    assert stage_model is not None
    apply_lora(stage_model, config, seed=seeds[0])
    generator = torch.Generator().manual_seed(seeds[1])
    with torch.no_grad():
        for name, p in stage_model.named_parameters():
            if name.endswith("lora_B"):
                p.copy_(torch.randn(p.shape, generator=generator) * 0.05)
    return save_adapters([stage_model], config, out, base_model=base)
