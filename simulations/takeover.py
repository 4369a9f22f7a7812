"""What killing the leader mid-job costs: rounds lost and extra wall time, in virtual time.

Three fellows with one CPU card each train ``tiny-llama`` as three replicas (one stage
each, DiLoCo rounds every 2 steps, 1 virtual second a step) for ``--steps`` steps; the
leader (which hosts one replica and keeps the outer state) is killed once the job reaches
``--kill-at``, and does not come back. A new leader takes the job over from the copy the
old one left on fellows. For each seed the same job runs once undisturbed and once with
the kill; the report gives:

- the step and sync round (keeper version) when the leader died, the step and round the
  new leader resumed from, and the rounds and steps lost (the differences: the copy is
  made as each round closes, so what the replicas trained since is trained again);
- the virtual seconds from the kill until the job ran again, and the extra virtual wall
  time of the whole job against the undisturbed run;
- both final losses (mean of the last 4 steps) and their difference.

    python simulations/takeover.py [--seeds 0 1] [--steps 20] [--kill-at 8] [--json]

About 2 minutes of real time per seed on two free cores.
"""

from __future__ import annotations

import argparse
import json
import logging
from typing import Any

import torch
import trio
import trio.testing

from p2pswarm.agent.world import Services
from p2pswarm.sim.virtual import VirtualSwarm, cpu_card, wait_until

SERVICES = Services(training_step_s=1.0, training_step_timeout_s=10.0, training_retry_s=2.0)


def job(steps: int, seed: int) -> dict[str, Any]:
    return {"model": "tiny-llama", "seq_len": 32, "micro_batch": 2, "micro_batches": 2,
            "steps": steps, "lr": {"peak": 0.003, "schedule": "constant"}, "seed": seed,
            "replicas": "auto", "sync": {"inner_steps": 2, "codec": "fp16"}}


def leader_of(swarm: VirtualSwarm) -> Any:
    return next((a for a in swarm.live() if a.leadership.is_leader()), None)


async def one_run(seed: int, steps: int, kill_at: int | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    async with trio.open_nursery() as nursery:
        swarm = VirtualSwarm(3, seed=seed + 5, inline_compute=True, services=SERVICES)
        for fellow in swarm.fellows:
            fellow.cards.cards = (cpu_card(16.0, name=f"{fellow.name} CPU"),)
        await nursery.start(swarm.run)
        for i in range(3):
            await swarm.start(i)
        await wait_until(lambda: swarm.converged() and len(swarm.leaders()) == 1
                         and None not in {lid for lid, _ in swarm.leaders()}, timeout_s=30)
        leader = leader_of(swarm)
        began = trio.current_time()
        record = await leader.training.submit(job(steps, seed))
        job_id = record["job_id"]
        running = leader.training.jobs[job_id]
        if kill_at is not None:
            await wait_until(lambda: running.step >= kill_at, timeout_s=600, step_s=0.01)
            assert running.driver is not None
            out["killed_at_step"] = running.step
            out["killed_at_round"] = running.driver.keepers[0].version
            killed_s = trio.current_time()
            swarm.crash(next(i for i, f in enumerate(swarm.fellows) if f.agent is leader))

            def taken() -> bool:
                new = leader_of(swarm)
                j = new.training.jobs.get(job_id) if new is not None else None
                return j is not None and j.state == "running" and j.driver is not None

            await wait_until(taken, timeout_s=600, step_s=0.05)
            leader = leader_of(swarm)
            running = leader.training.jobs[job_id]
            assert running.driver is not None
            out["resumed_at_step"] = running.step
            out["resumed_at_round"] = running.driver.keepers[0].version
            out["rounds_lost"] = out["killed_at_round"] - out["resumed_at_round"]
            out["steps_lost"] = out["killed_at_step"] - out["resumed_at_step"]
            out["running_again_after_s"] = round(trio.current_time() - killed_s, 2)
            out["moved"] = running.moves[-1] if running.moves else ""
        with trio.fail_after(3600):
            while running.state not in ("finished", "failed", "cancelled"):
                await trio.sleep(0.5)
        out["state"] = running.state
        out["took_s"] = round(trio.current_time() - began, 2)
        out["final_loss"] = sum(running.losses[-4:]) / 4
        out["steps"] = len(running.losses)
        nursery.cancel_scope.cancel()
    return out


def measure(seed: int, steps: int, kill_at: int) -> dict[str, Any]:
    def run(kill: int | None) -> dict[str, Any]:
        return trio.run(one_run, seed, steps, kill,
                        clock=trio.testing.MockClock(autojump_threshold=0))

    calm, killed = run(None), run(kill_at)
    return {"seed": seed, "calm": calm, "killed": killed,
            "extra_wall_s": round(killed["took_s"] - calm["took_s"], 2),
            "loss_change": round(killed["final_loss"] / calm["final_loss"] - 1, 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--kill-at", type=int, default=8)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    torch.set_num_threads(1)
    rows = [measure(seed, args.steps, args.kill_at) for seed in args.seeds]
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print("| seed | killed at step (round) | resumed at step (round) | rounds (steps) lost | "
          "running again after | extra wall time | final loss calm / killed |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        k, c = r["killed"], r["calm"]
        print(f"| {r['seed']} | {k['killed_at_step']} ({k['killed_at_round']}) | "
              f"{k['resumed_at_step']} ({k['resumed_at_round']}) | {k['rounds_lost']} "
              f"({k['steps_lost']}) | "
              f"{k['running_again_after_s']:.1f} s | {r['extra_wall_s']:+.1f} s "
              f"({c['took_s']:.0f} s calm) | {c['final_loss']:.4f} / {k['final_loss']:.4f} "
              f"({r['loss_change']:+.2%}) |")


if __name__ == "__main__":
    main()
