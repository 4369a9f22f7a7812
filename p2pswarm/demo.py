"""`p2pswarm demo`: a real swarm of separate agent processes on loopback serves a model
across all of them, then everything is cleaned up.

Three fellows start as `p2pswarm join` processes, each offering its CPU capped at
``DEMO_CPU_MEMORY`` (``join --cpu-memory``). The model is ``demo-llama``, shipped in the
package (``DEMO_MODEL_DIR``): a 1.2 M-parameter byte-level llama this project trained on
its own public-domain corpus with ``demo --train`` as a pipeline of three stages; its
``config.json`` records that cut, and the planner keeps a trained cut, so the plan puts
one stage on each fellow. The demo shows the status and the plan, loads exactly that
plan (``--plan-id``), generates, checks the tokens against the same model run in this
one process, and leaves.

``demo --train`` starts the fellows with more room (training plans keep the planner's
1 GB floor), trains a small llama from scratch on the shipped corpus as one pipeline over
all of them (the job pinned to the plan it shows), exports the job's final checkpoint as
a Hugging Face directory recording the cut, serves that on the same cut with a pinned
plan, generates after two prompts, and leaves.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from p2pswarm.control.client import request, stream
from p2pswarm.errors import SwarmError
from p2pswarm.sim.processes import LocalSwarm, Say, local_swarm

Show = Callable[[dict[str, Any]], None]

# made by `p2pswarm demo --train --steps 600 --out DIR` (a copy of what it exports)
DEMO_MODEL_DIR = Path(__file__).resolve().parent / "models" / "demo-llama"
DEMO_MODEL = DEMO_MODEL_DIR.name
DEMO_CPU_MEMORY = "360MB"  # per fellow: a small slice, with the OS headroom
DEMO_FLOOR = "250MB"  # the planner's default floor (1 GB) would leave these small cards out
DEMO_PROMPT = "We the People"
DEMO_MAX_TOKENS = 64


def run_apart(swarm: LocalSwarm) -> None:
    """Start the fellows in the swarm's own directory, not the caller's: they run as
    ``python -m``, which imports from the current directory first, and the folder that
    holds a clone of p2pswarm would shadow the installed package with the clone's root.
    Relative entries of PYTHONPATH are made absolute, so they still name what they named."""
    swarm.cwd = swarm.root
    path = os.environ.get("PYTHONPATH")
    if path:
        swarm.env["PYTHONPATH"] = os.pathsep.join(
            os.path.abspath(entry) if entry else os.getcwd() for entry in path.split(os.pathsep))


def form_swarm(swarm: LocalSwarm, names: list[str], cap: tuple[str, ...], memory: str,
               say: Say, started: float) -> dict[str, Any]:
    """Start ``names`` as fellows joining through the first; the status once every one
    sees all the others alive and a leader."""
    say(f"starting {len(names)} fellows on loopback in {swarm.root}, each offering "
        f"{memory} of RAM")
    seed = swarm.start(names[0], extra=cap)
    say(f"{names[0]} listening on {seed}")
    for name in names[1:]:
        swarm.launch(name, seeds=(seed,), extra=cap)
    for name in names[1:]:
        say(f"{name} listening on {swarm.address(name)}, joining through {seed}")
    for name in names:
        swarm.wait_for(name, lambda s: s["leader"] is not None and sum(
            m["state"] == "alive" for m in s["members"]) == len(names), timeout_s=60,
            what="the swarm to form and elect a leader")
    say(f"swarm formed in {time.monotonic() - started:.1f} s")
    return swarm.status(names[0])


def demo_request(model_dir: Path = DEMO_MODEL_DIR) -> dict[str, Any]:
    """The plan request the demo loads: float32 weights, the planner's other defaults."""
    from p2pswarm.models.files import read_model_config

    name, config = read_model_config(str(model_dir))
    return {"model": {"name": name, "config": config}, "kind": "serve",
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
        run_apart(swarm)
        status = form_swarm(swarm, names, cap, DEMO_CPU_MEMORY, say, started)
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
        record = stream(home, {"op": "load", "request": message, "plan_id": plan["plan_id"],
                               "path": str(DEMO_MODEL_DIR)}, progress, timeout_s=120)
        say(f"loaded in {time.monotonic() - load_began:.1f} s")

        say(f"generating {max_tokens} tokens after {prompt!r} ({DEMO_MODEL} is a byte-level "
            "llama of 1.2 M parameters this project trained on the founding documents it "
            "ships: `p2pswarm demo --train` trains one like it):")
        if write is not None:
            write(prompt)
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
            "load": record, "generation": result, "text": prompt + "".join(pieces),
            "same_as_one_process": same,
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
            Stage.from_checkpoint(DEMO_MODEL_DIR, StageSpec(s["layers"][0], s["layers"][1],
                                                            **{k: runtime[k] for k in fields}))
            for s in plan["stages"]])
        tokenizer = ByteTokenizer()
        generation = pipeline.generate(tokenizer.encode(prompt), max_tokens, Sampler.greedy(),
                                       stop_token_ids=tokenizer.eos_ids)
    finally:
        torch.set_num_threads(threads)
    return list(generation.token_ids)


# --- `p2pswarm demo --train` ---------------------------------------------------------------

# A llama shaped to learn the shipped corpus (39 KB of founding documents, byte-level) in
# about a minute of two CPU cores: 6 layers of width 128, 1.2 M parameters.
DEMO_TRAIN_MODEL: dict[str, Any] = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 128,
    "intermediate_size": 384, "num_hidden_layers": 6, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "hidden_act": "silu",
    "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "tie_word_embeddings": True, "vocab_size": 259, "bos_token_id": 256,
    "eos_token_id": 257, "pad_token_id": 258,
}
DEMO_TRAIN_STEPS = 300
DEMO_TRAIN_MEMORY = "1500MB"  # per fellow: above the planner's 1 GB floor for training
DEMO_TRAIN_PROMPTS = ("We the People", "Congress shall")
DEMO_TRAIN_TOKENS = 64
LIVE_EVERY_S = 5.0  # a progress line this often when the output is not a terminal


def demo_job(steps: int, checkpoint_dir: Path) -> dict[str, Any]:
    """The demo's job.json: one pipeline over the fellows, on the shipped corpus."""
    return {"model": {"config": DEMO_TRAIN_MODEL}, "seq_len": 128, "micro_batch": 4,
            "micro_batches": 1, "steps": steps, "replicas": 1,
            "lr": {"peak": 4e-3, "min": 4e-4, "warmup_steps": min(10, steps - 1)},
            "checkpoint": {"dir": str(checkpoint_dir), "interval_steps": steps, "keep": 1,
                           "copies": 2}, "seed": 0}


def progress_line(record: dict[str, Any]) -> str:
    """One line of a training job's progress."""
    loss = record.get("loss")
    return (f"step {record.get('step', 0)}/{record.get('steps', 0)}"
            + (f"  loss {loss:.3f}" if isinstance(loss, (int, float)) else "")
            + f"  {record.get('tokens_per_s', 0.0):,.0f} tokens/s"
            + f"  {record.get('replicas', 0)} replica(s)"
            + f"  {record.get('bytes_sent', 0) / 1e6:,.2f} MB exchanged")


def loss_curve_text(losses: list[float], points: int = 10) -> str:
    """The mean loss of ``points`` equal spans of the run, first to last."""
    if not losses:
        return "no steps"
    n = min(points, len(losses))
    spans = [losses[len(losses) * i // n:len(losses) * (i + 1) // n] for i in range(n)]
    return " -> ".join(f"{sum(s) / len(s):.2f}" for s in spans if s)


def run_train_demo(say: Say, render_status: Show, render_plan: Show | None = None,
                   write: Callable[[str], None] | None = None,
                   live: Callable[[str], None] | None = None, *, fellows: int = 3,
                   keep: bool = False, steps: int = DEMO_TRAIN_STEPS,
                   max_tokens: int = DEMO_TRAIN_TOKENS,
                   out: Path | None = None) -> dict[str, Any]:
    """Form a swarm of ``fellows`` processes on loopback, train a small model as one
    pipeline across all of them on the shipped corpus, export it, serve it on the cut it
    trained with (a pinned plan), generate, and clean up. ``live`` gets the progress line
    as it changes (a terminal rewrites it in place); without it, ``say`` gets one every
    few seconds. ``out``: a new directory the trained model is copied to (how the model
    the plain demo ships was made)."""
    from p2pswarm.training.job import JobConfig
    from p2pswarm.training.job_export import check_out_dir

    if out is not None:
        out = check_out_dir(out)

    if steps < 1:
        raise SwarmError(f"steps must be at least 1, got {steps}")
    layers = int(DEMO_TRAIN_MODEL["num_hidden_layers"])
    if fellows > layers:
        raise SwarmError(f"the demo model has {layers} layers: train it on at most {layers} "
                         f"fellows, not {fellows}")
    started = time.monotonic()
    names = [f"fellow-{i + 1}" for i in range(fellows)]
    cap = ("--cpu-memory", DEMO_TRAIN_MEMORY, "--log-level", "warning")
    with local_swarm(say, keep) as swarm:
        run_apart(swarm)
        status = form_swarm(swarm, names, cap, DEMO_TRAIN_MEMORY, say, started)
        render_status(status)
        home = swarm.homes[names[0]]
        job = JobConfig.from_dict(demo_job(steps, swarm.root / "checkpoints")).to_dict()

        plan = request(home, {"op": "job_plan", "config": job, "stages": fellows},
                       timeout_s=60)
        if render_plan is not None:
            render_plan(plan)
        if not plan["fits"]:
            raise SwarmError(f"the demo job does not fit: {plan['layout']['limit']['sentence']}")
        say(f"training a {_params(DEMO_TRAIN_MODEL) / 1e6:.1f} M-parameter llama for {steps} "
            f"steps on the shipped corpus, one pipeline of {fellows} stages: "
            f"{plan['layout']['strip_text']} (train --plan-id {plan['plan_id']})")

        shown = {"line": "", "at": time.monotonic()}

        def progress(event: dict[str, Any]) -> None:
            record = event.get("job")
            if not isinstance(record, dict) or record.get("state") != "running":
                return
            line = progress_line(record)
            if line == shown["line"]:
                return
            shown["line"] = line
            if live is not None:
                live(line)
            elif time.monotonic() - shown["at"] >= LIVE_EVERY_S:
                shown["at"] = time.monotonic()
                say("  " + line)

        train_began = time.monotonic()
        record = stream(home, {"op": "job_submit", "config": job, "plan_id": plan["plan_id"],
                               "stages": fellows}, progress, timeout_s=300)
        train_s = time.monotonic() - train_began
        if live is not None:
            live("")
        if record["state"] != "finished":
            raise SwarmError(f"the demo job ended {record['state']}: {record['reason']}")
        losses = [float(x) for x in record["losses"]]
        final = sum(losses[-10:]) / len(losses[-10:])
        say(f"trained {record['step']} steps in {train_s:.1f} s "
            f"({record['tokens_per_s']:,.0f} tokens/s)")
        say(f"loss {loss_curve_text(losses)} (first step {losses[0]:.2f}, last ten "
            f"{final:.2f})")

        # where the leader kept it: the job's checkpoint.dir when fellow-1 leads, else the
        # leader's state directory (a job from another fellow), on this same machine
        model_dir, cut, holdout = export_trained(record["checkpoint_dir"],
                                                 swarm.root / "trained")
        say(f"exported to {model_dir} (a Hugging Face directory recording the cut "
            f"{cut}); held-out loss {holdout:.2f}")
        if out is not None:
            shutil.copytree(model_dir, out, dirs_exist_ok=True)
            say(f"copied to {out}")

        from p2pswarm.models.files import read_model_config

        name, config = read_model_config(str(model_dir))
        message = {"model": {"name": name, "config": config}, "kind": "serve",
                   "weights_dtype": "f32", "floors_bytes": {"cpu": DEMO_FLOOR}}
        serve_plan = request(home, {"op": "plan", "request": message}, timeout_s=30)
        if not serve_plan["fits"]:
            raise SwarmError("the trained model does not fit: "
                             + serve_plan["layout"]["limit"]["sentence"])
        served_cut = [s["layers"][0] for s in serve_plan["stages"][1:]]
        say(f"serving it on the cut it trained with ({served_cut}): load {model_dir.name} "
            f"--plan-id {serve_plan['plan_id']}")
        stream(home, {"op": "load", "request": message, "plan_id": serve_plan["plan_id"],
                      "path": str(model_dir)}, lambda event: None, timeout_s=120)
        samples: dict[str, str] = {}
        for prompt in DEMO_TRAIN_PROMPTS:
            pieces: list[str] = []

            def token(event: dict[str, Any]) -> None:
                if isinstance(event.get("text"), str):
                    pieces.append(event["text"])
                    if write is not None:
                        write(event["text"])

            if write is not None:
                write(prompt)
            stream(home, {"op": "generate", "prompt": prompt, "max_tokens": max_tokens},
                   token, timeout_s=120)
            if write is not None:
                write("\n")
            samples[prompt] = prompt + "".join(pieces)
        request(home, {"op": "unload", "plan_id": serve_plan["plan_id"]}, timeout_s=30)
        say("unloaded; leaving")
    return {"status": status, "plan_id": plan["plan_id"], "job": record,
            "loss_curve": losses, "final_loss": final, "first_loss": losses[0],
            "holdout_loss": holdout, "train_s": train_s, "cut": cut,
            "serve_plan_id": serve_plan["plan_id"], "served_cut": served_cut,
            "samples": samples, "elapsed_s": time.monotonic() - started}


def _params(config: dict[str, Any]) -> int:
    h, i, n = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h
    return n * per_layer + config["vocab_size"] * h + h


def export_trained(checkpoint_dir: str, out_dir: Path) -> tuple[Path, list[int], float]:
    """The job's latest checkpoint (in ``checkpoint_dir``, its record's) as a Hugging
    Face directory (``jobs export``): (its path, the cut, the held-out loss of the trained
    model)."""
    from p2pswarm.training.checkpoint import CheckpointStore
    from p2pswarm.training.job_export import export_checkpoint

    store = CheckpointStore(checkpoint_dir)
    if store.latest() is None:
        raise SwarmError(f"the job left no complete checkpoint in {checkpoint_dir}")
    exported = export_checkpoint(store, out_dir, holdout_batches=8)
    assert exported.holdout_loss is not None
    return exported.path, list(exported.cut), exported.holdout_loss
