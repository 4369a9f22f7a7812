"""Re-sharding a checkpoint onto another cut: per layer, the parameters and optimizer
state are the checkpoint's to the bit, and training goes on from them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from p2pswarm.errors import ConfigError
from p2pswarm.planner.profile import BUILTIN_MODELS
from p2pswarm.training import JobConfig, LocalRun
from p2pswarm.training.checkpoint import CheckpointStore
from p2pswarm.training.reshard import reshard_checkpoint, reshard_stages

pytestmark = [pytest.mark.usefixtures("one_torch_thread")]


# a tiny-llama shrunk further: eight layers, tied head, byte vocabulary
SMALL = {**BUILTIN_MODELS["tiny-llama"], "hidden_size": 64, "intermediate_size": 128,
         "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32}


def _job(tmp_path: Path, name: str = "ckpt", **extra: Any) -> JobConfig:
    return JobConfig.from_dict({
        "model": {"config": SMALL}, "seq_len": 16, "micro_batch": 2, "micro_batches": 1,
        "steps": 4, "lr": {"peak": 0.003, "schedule": "constant"}, "seed": 3,
        "sync": {"inner_steps": 1, "codec": "fp32"},
        "checkpoint": {"dir": str(tmp_path / name), "interval_steps": 2}, **extra})


def _equal(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (where, set(a) ^ set(b))
        for k in a:
            _equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def _per_layer(states: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each parameter of the whole model (global layer index) with its AdamW state."""
    out: dict[str, dict[str, Any]] = {}
    for shard in states:
        stage = shard["stage"]
        names = list(stage["params"])
        decay = [n for n in names if stage["params"][n].dim() >= 2]
        rest = [n for n in names if stage["params"][n].dim() < 2]
        ordered = [n for g in (decay, rest) if g for n in g]
        ids = [i for g in stage["optimizer"]["param_groups"] for i in g["params"]]
        for n, i in zip(ordered, ids, strict=True):
            key = n
            if n.startswith("layers."):
                _, index, rest_name = n.split(".", 2)
                key = f"layers.{int(index) + stage['start_layer']}.{rest_name}"
            out.setdefault(key, {"param": stage["params"][n],
                                 "adam": stage["optimizer"]["state"][i]})
    return out


def test_per_layer_state_survives_a_new_cut_and_comes_back_to_the_bit(
        tmp_path: Path) -> None:
    job = _job(tmp_path)
    run = LocalRun(job, cut=[4], replicas=2)
    run.run(until_step=2)
    store = CheckpointStore(tmp_path / "ckpt")
    old = [store.read(2, f"replica-0.stage-{s}") for s in range(2)]
    new, _ = reshard_stages(old, [2, 5])
    assert [(s["stage"]["start_layer"], s["stage"]["end_layer"]) for s in new] == \
        [(0, 2), (2, 5), (5, 8)]
    before, after = _per_layer(old), _per_layer(new)
    assert set(before) == set(after) and "lm_head.weight" in after  # the tied head too
    _equal(after, before)
    # and back onto the old cut: every stage's state (sync vectors included) as it was
    back, _ = reshard_stages(new, [4])
    for s in range(2):
        for key in ("start_layer", "end_layer", "steps", "params", "optimizer"):
            _equal(back[s]["stage"][key], old[s]["stage"][key], f"stage {s} {key}")
        for key in ("anchor", "snapshot", "version"):
            _equal(back[s]["sync"][key], old[s]["sync"][key], f"stage {s} sync {key}")
        _equal(back[s]["sync"]["compressor"]["residual"],
               old[s]["sync"]["compressor"]["residual"])
    # the keepers' global parameters and momentum, split the same way
    moved = reshard_checkpoint(store, 2, [2, 5])
    home = reshard_checkpoint(moved, 2, [4])
    for s in range(2):
        want, got = store.read(2, f"keeper.stage-{s}"), home.read(2, f"keeper.stage-{s}")
        for key in ("version", "params", "momentum"):
            _equal(got[key], want[key], f"keeper {s} {key}")


def test_a_run_resumed_on_another_cut_goes_on_as_it_would_have(tmp_path: Path) -> None:
    calm = LocalRun(_job(tmp_path, "calm"), cut=[4], replicas=2).run()
    job = _job(tmp_path)
    LocalRun(job, cut=[4], replicas=2).run(until_step=2)
    moved = reshard_checkpoint(CheckpointStore(tmp_path / "ckpt"), 2, [2, 5])
    assert moved.manifest(2)["meta"]["cut"] == [2, 5]
    resumed = LocalRun.resume(JobConfig.from_dict(
        {**job.to_dict(), "checkpoint": {"dir": str(moved.directory), "interval_steps": 2}}))
    assert resumed.cut == [2, 5] and resumed.step == 2
    losses = resumed.run()
    assert losses == pytest.approx(calm[2:], abs=1e-5)


def test_a_damaged_stage_state_is_refused_with_why(tmp_path: Path) -> None:
    run = LocalRun(_job(tmp_path), cut=[4])
    run.run(until_step=2)
    store = CheckpointStore(tmp_path / "ckpt")
    old = [store.read(2, f"replica-0.stage-{s}") for s in range(2)]
    old[1]["sync"]["anchor"] = old[1]["sync"]["anchor"][:-1]
    with pytest.raises(ConfigError, match="sync anchor"):
        reshard_stages(old, [2])


def test_lora_adapters_re_shard_too(tmp_path: Path) -> None:
    lora = {"mode": "lora", "lora": {"rank": 2}, "lr": {"peak": 0.01, "schedule": "constant"}}
    calm = LocalRun(_job(tmp_path, "calm", **lora), cut=[4], replicas=2).run()
    LocalRun(_job(tmp_path, **lora), cut=[4], replicas=2).run(until_step=2)
    moved = reshard_checkpoint(CheckpointStore(tmp_path / "ckpt"), 2, [2, 5])
    params = moved.read(2, "replica-0.stage-1")["stage"]["params"]
    assert params and all(".lora_" in n for n in params)  # adapters only, the base frozen
    resumed = LocalRun.resume(_job(tmp_path, **{**lora, "checkpoint": {
        "dir": str(moved.directory), "interval_steps": 2}}))
    assert resumed.run() == pytest.approx(calm[2:], abs=1e-5)
