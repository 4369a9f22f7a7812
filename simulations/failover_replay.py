"""Failover with a long context: how long a generation pauses when a stage's fellow is
lost, with the surviving stages continuing from the session's kept cache, against every
stage replaying the session's tokens (as before), side by side.

Four agents in this process, each on its own UDP+TCP sockets on 127.0.0.1 (sealed streams,
real compute, one torch thread each), hold a model in three stages with one spare: the
leader's card, left out of the plan, so that it drives the generation and heals the load
whatever stage is lost. A session with a prompt of ``--context`` tokens generates; at its
fourth token one stage's agent is stopped (its sockets close, as a killed process's do:
the driver and the leader find nothing listening at once), the leader re-places the stage
on the spare, and the driver resumes. The figure is the time from the stop to the next
token, and of it the time from the leader's answer (the stage re-placed) to the next
token; beside them, what a busy machine does not blur: the CPU time this process (every
agent) spent from the stop to the next token, and the positions the stages computed in it.
The rounds alternate between the two ways of resuming, each on a fresh swarm, and each
round checks the greedy tokens against the same prompt run undisturbed first. Which stages
replayed is the result's ``replayed_stages``.

    python simulations/failover_replay.py [--model small-llama] [--context 1000]
                                          [--rounds 1] [--json]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # one torch thread per agent, as fellows

import argparse
import json
import random
import statistics
import time
from typing import Any

import trio

from p2pswarm.agent import Agent
from p2pswarm.agent.world import AgentWorld
from p2pswarm.cards import Card
from p2pswarm.config import local
from p2pswarm.inventory import FakeCardSource
from p2pswarm.planner import BUILTIN_MODELS
from p2pswarm.security import Identity, Keyring, SwarmSecret
from p2pswarm.transport.udp_tcp import open_udp_tcp_transport

KILL_AT = 4  # the token after which a stage's agent stops
TOKENS = 12


class StoppableSwarm:
    """Agents in this process on loopback sockets, each of which can be stopped alone."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.secret = SwarmSecret.generate()
        self.config = local()
        self.agents: list[Agent] = []
        self.scopes: list[trio.CancelScope] = []

    async def _agent(self, i: int, seeds: tuple[str, ...], *, task_status: Any) -> None:
        with trio.CancelScope() as scope:
            async with open_udp_tcp_transport("127.0.0.1:0", self.config.transport) as t:
                cards = FakeCardSource((Card(index=0, kind="cpu", name="CPU", uuid="",
                                             total_bytes=16 * 10**9, free_bytes=16 * 10**9),))
                agent = Agent(AgentWorld(
                    name=f"fellow-{i + 1}", transport=t, keyring=Keyring([self.secret]),
                    identity=Identity.generate(), config=self.config,
                    epoch=time.time_ns() // 1000, rng=random.Random(i), card_source=cards,
                    seeds=seeds))
                async with trio.open_nursery() as nursery:
                    await nursery.start(agent.run)
                    task_status.started((agent, scope, t.local_addr))

    async def start(self, nursery: trio.Nursery) -> None:
        seeds: tuple[str, ...] = ()
        for i in range(self.n):
            agent, scope, addr = await nursery.start(self._agent, i, seeds)
            seeds = seeds or (addr,)
            self.agents.append(agent)
            self.scopes.append(scope)
        while not all(a.leader() is not None and a.membership is not None and sum(
                m.state == "alive" for m in a.membership.members()) == self.n
                for a in self.agents):
            await trio.sleep(0.05)

    def stop(self, name: str) -> None:
        i = next(i for i, a in enumerate(self.agents) if a.name == name)
        self.scopes[i].cancel()

    def leader(self) -> Agent:
        leader = self.agents[0].leader()
        assert leader is not None
        return next(a for a in self.agents if a.node_id.hex() == leader["id"])


async def one_round(model: str, context: int, stage: int, replay_everything: bool
                    ) -> dict[str, Any]:
    """One fresh swarm: the pause when stage ``stage``'s agent stops at the fourth token."""
    swarm = StoppableSwarm(4)
    prompt = [256, *(random.Random(context).randrange(0, 256) for _ in range(context - 1))]
    async with trio.open_nursery() as nursery:
        await swarm.start(nursery)
        driver = swarm.leader()
        message = {"model": {"name": model, "config": BUILTIN_MODELS[model]}, "stages": 3,
                   "weights_dtype": "f32", "kv_dtype": "f32",
                   "context": max(1024, context + 64), "exclude": [f"{driver.name}:cpu"]}
        plan = await driver.planning.ask_plan(message)
        await driver.serving.load(message, plan_id=plan["plan_id"])
        victim = plan["stages"][stage]["fellow"]
        gen = driver.serving.driver
        gen.replay_everything = replay_everything
        healed: list[float] = []
        heal = gen._heal

        async def timed_heal(*args: Any) -> Any:  # when the leader answered
            out = await heal(*args)
            healed.append(time.perf_counter())
            return out

        gen._heal = timed_heal  # type: ignore[method-assign,assignment]
        want = await driver.serving.generate(prompt_ids=prompt, max_tokens=TOKENS,
                                             stop_token_ids=())
        times: list[float] = []
        stopped: list[float] = []
        cpu: list[float] = []
        positions: list[int] = []

        def computed() -> int:
            return sum(n for a in swarm.agents
                       for n in a.serving.sessions.positions_run.values())

        def on_token(token: int, text: str) -> None:
            times.append(time.perf_counter())
            if len(times) in (KILL_AT, KILL_AT + 1):
                cpu.append(time.process_time())
                positions.append(computed())
            if len(times) == KILL_AT:
                swarm.stop(victim)
                stopped.append(time.perf_counter())

        result = await driver.serving.generate(prompt_ids=prompt, max_tokens=TOKENS,
                                               stop_token_ids=(), on_token=on_token)
        pause = times[KILL_AT] - stopped[0]
        resumed = times[KILL_AT] - healed[-1]
        (record,) = await driver.serving.list_loads()
        nursery.cancel_scope.cancel()
    return {"stage": stage, "replay_everything": replay_everything,
            "kill_to_next_token_s": pause, "healed_to_next_token_s": resumed,
            "cpu_s": cpu[1] - cpu[0], "positions": positions[1] - positions[0],
            "same_tokens": result.token_ids == want.token_ids, "resumes": result.resumes,
            "replayed_stages": [3] if replay_everything else list(result.replayed_stages),
            "moved": [(m["stage"], m["from"], m["to"]) for m in record.get("moves", [])],
            "load_average": os.getloadavg()}


def figures(model: str, context: int, rounds: int) -> dict[str, Any]:
    runs = []
    for _ in range(rounds):
        for stage in range(3):
            for everything in (False, True):  # alternate: both see the same machine
                out = trio.run(one_round, model, context, stage, everything)
                runs.append(out)
                print(json.dumps(out), flush=True)
    summary: dict[str, Any] = {"model": model, "context": context, "runs": runs}
    for stage in range(3):
        mine = [r for r in runs if r["stage"] == stage]
        summary[f"stage_{stage}"] = {
            f"{key}_{way}_p50_s": statistics.median(
                r[f"{key}_s"] for r in mine if r["replay_everything"] == (way == "every"))
            for key in ("kill_to_next_token", "healed_to_next_token", "cpu")
            for way in ("kept", "every")}
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small-llama", choices=sorted(BUILTIN_MODELS))
    parser.add_argument("--context", type=int, default=1000, help="prompt tokens")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if not 2 <= args.context <= 4000 or args.rounds < 1:
        parser.error("--context takes 2-4000 tokens, --rounds at least 1")
    out = figures(args.model, args.context, args.rounds)
    if args.json:
        print(json.dumps(out, indent=2))
        return
    for stage in range(3):
        s = out[f"stage_{stage}"]
        print(f"stage {stage} lost, {args.context} tokens of context, survivors keeping their "
              "cache against every stage replaying: kill to next token "
              f"{s['kill_to_next_token_kept_p50_s']:.2f} s / "
              f"{s['kill_to_next_token_every_p50_s']:.2f} s; of it, the leader's answer to "
              f"the next token {s['healed_to_next_token_kept_p50_s']:.2f} s / "
              f"{s['healed_to_next_token_every_p50_s']:.2f} s; CPU time in it "
              f"{s['cpu_kept_p50_s']:.2f} s / {s['cpu_every_p50_s']:.2f} s")
    print("load average", ", ".join(f"{x:.1f}" for x in os.getloadavg()))


if __name__ == "__main__":
    main()
