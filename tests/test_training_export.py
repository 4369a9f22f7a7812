"""`jobs export`: a job's checkpoint out as a Hugging Face directory that records its cut
(served on that cut by default), or as LoRA adapters on their own."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from p2pswarm.cli import app
from p2pswarm.errors import ConfigError
from p2pswarm.models.files import read_model_config
from p2pswarm.planner import plan_message
from p2pswarm.planner.profile import profile_from_config
from p2pswarm.training import JobConfig, LocalRun
from p2pswarm.training.checkpoint import CheckpointStore
from p2pswarm.training.job_export import export_checkpoint
from p2pswarm.training.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, adapter_tensors
from p2pswarm.training.sync import write_flat

runner = CliRunner()
CUT = [3, 6]


pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]


def job(tmp_path: Path, **extra: Any) -> JobConfig:
    return JobConfig.from_dict({
        "model": "tiny-llama", "seq_len": 16, "micro_batch": 2, "steps": 2, "seed": 3,
        "lr": {"peak": 0.01, "schedule": "constant"},
        "checkpoint": {"dir": str(tmp_path / "ckpt"), "interval_steps": 2}, **extra})


@pytest.fixture(scope="module")
def trained_full(tmp_path_factory: pytest.TempPathFactory) -> tuple[LocalRun, Path]:
    root = tmp_path_factory.mktemp("full")
    run = LocalRun(job(root), cut=CUT)
    run.run()
    return run, root / "ckpt"


@pytest.fixture(scope="module")
def trained_lora(tmp_path_factory: pytest.TempPathFactory) -> tuple[LocalRun, Path]:
    root = tmp_path_factory.mktemp("lora")
    run = LocalRun(job(root, mode="lora", lora={"rank": 4, "alpha": 8,
                                                "targets": ["q_proj", "v_proj"]}), cut=CUT)
    run.run()
    return run, root / "ckpt"


def test_full_export_is_the_trained_model_and_records_its_cut(trained_full, tmp_path) -> None:
    run, ckpt = trained_full
    exported = export_checkpoint(CheckpointStore(ckpt), tmp_path / "out")
    assert exported.kind == "model" and exported.step == 2 and list(exported.cut) == CUT
    assert {"config.json", "model.safetensors"} <= set(exported.files)
    name, config = read_model_config(str(exported.path))
    assert config["p2pswarm_stage_cut"] == CUT
    # the exported weights give the trained model's loss exactly
    again = LocalRun(JobConfig.from_dict({**run.job.to_dict(), "model": str(exported.path),
                                          "checkpoint": {}}), cut=[4], data=run.data)
    assert abs(again.evaluate(4) - run.evaluate(4)) <= 1e-5
    # training changed the weights: the export is not the base model
    base = LocalRun(JobConfig.from_dict({**run.job.to_dict(), "checkpoint": {}}), cut=[4],
                    data=run.data)
    assert abs(base.evaluate(4) - run.evaluate(4)) > 1e-3
    # the planner serves it on the cut it trained with unless told otherwise
    cluster = {"fellows": [{"id": f"{i:02x}", "name": f"fellow-{i + 1}", "cards": [
        {"index": 0, "kind": "cpu", "name": "CPU", "total_bytes": "16GB",
         "free_bytes": "16GB"}]} for i in range(3)]}
    from p2pswarm.planner import cluster_from_dict
    view = cluster_from_dict(cluster)
    assert profile_from_config(config, name).trained_cut == tuple(CUT)
    plan = plan_message({"model": {"name": name, "config": config}, "kind": "serve"}, view)
    assert [s["layers"][0] for s in plan["stages"][1:]] == CUT
    two = plan_message({"model": {"name": name, "config": config}, "kind": "serve",
                        "stages": 2}, view)
    assert len(two["stages"]) == 2


def test_the_chaos_runs_final_loss_is_the_newest_checkpoint_on_held_out_data(
        trained_full, tmp_path) -> None:
    from p2pswarm.sim.chaos import held_out_loss

    run, ckpt = trained_full
    got = held_out_loss(ckpt, batches=4)
    assert got is not None and got["step"] == 2
    assert abs(got["loss"] - run.evaluate(4)) <= 1e-5  # the trained model, held-out batches
    assert held_out_loss(tmp_path) is None  # no checkpoint: nothing to measure


def test_a_several_replica_export_is_the_keepers_global_model(tmp_path) -> None:
    """DiLoCo: each replica's parameters are the global ones plus its own local steps since
    its last round; the job's model is the keepers' (the chaos run's final loss measured
    replica 0's, which a replica placed again just before it made worse)."""
    from p2pswarm.training.replica import synced_tensors

    run = LocalRun(job(tmp_path, steps=4, sync={"inner_steps": 4, "codec": "fp16"}),
                   replicas=2, cut=CUT)
    run.run()  # the checkpoint of step 2 is written halfway through the first round
    store = CheckpointStore(tmp_path / "ckpt")
    keepers = [store.read(2, f"keeper.stage-{s}")["params"] for s in range(len(CUT) + 1)]
    exported = export_checkpoint(store, tmp_path / "out", step=2, holdout_batches=4)

    def loss_with(params: list[torch.Tensor] | None) -> float:
        model = LocalRun(job(tmp_path / "again"), cut=CUT, data=run.data)
        for s, stage in enumerate(model.replicas[0].stages):
            if params is None:  # replica 0's own, as the checkpoint holds them
                stage.load_state_dict(store.read(2, f"replica-0.stage-{s}")["stage"])
            else:
                write_flat(params[s], synced_tensors(stage))
        model.replicas[0].pipeline.copy_tied_weight()
        return model.evaluate(4)

    assert exported.holdout_loss is not None
    assert abs(exported.holdout_loss - loss_with(keepers)) <= 1e-5
    assert abs(exported.holdout_loss - loss_with(None)) > 1e-4  # not replica 0's


def test_lora_export_writes_the_adapters_alone_and_names_the_base(trained_lora,
                                                                   tmp_path) -> None:
    run, ckpt = trained_lora
    exported = export_checkpoint(CheckpointStore(ckpt), tmp_path / "adapters")
    assert exported.kind == "adapter" and exported.base == "tiny-llama"
    assert set(exported.files) == {ADAPTER_CONFIG, ADAPTER_WEIGHTS}
    adapter_config = json.loads((exported.path / ADAPTER_CONFIG).read_text())
    assert adapter_config["base_model_name_or_path"] == "tiny-llama"
    assert adapter_config["p2pswarm_stage_cut"] == CUT and adapter_config["r"] == 4
    from safetensors.torch import load_file
    saved = load_file(str(exported.path / ADAPTER_WEIGHTS))
    trained: dict[str, torch.Tensor] = {}
    for stage in run.replicas[0].stages:
        trained.update(adapter_tensors(stage.model))
    assert set(saved) == set(trained) and len(saved) == 8 * 2 * 2
    assert all(torch.equal(saved[n], trained[n]) for n in saved)
    assert any(n.endswith("lora_B.weight") and saved[n].abs().sum() > 0 for n in saved)


def test_lora_export_of_a_scratch_base_writes_the_base_beside(tmp_path) -> None:
    from p2pswarm.planner.profile import BUILTIN_MODELS
    config = dict(BUILTIN_MODELS["tiny-llama"], num_hidden_layers=2)
    run = LocalRun(job(tmp_path, model={"config": config}, mode="lora",
                       lora={"rank": 2, "alpha": 2, "targets": ["q_proj"]}), cut=[1])
    run.run()
    exported = export_checkpoint(CheckpointStore(tmp_path / "ckpt"), tmp_path / "out")
    assert exported.base == str(exported.path / "base")
    assert {"base/config.json", "base/model.safetensors", ADAPTER_CONFIG} <= set(exported.files)
    assert json.loads((exported.path / "base" / "config.json").read_text())[
        "p2pswarm_stage_cut"] == [1]


def test_bad_exports_are_refused_and_touch_nothing(trained_full, tmp_path) -> None:
    _, ckpt = trained_full
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    with pytest.raises(ConfigError, match="is not empty"):
        export_checkpoint(CheckpointStore(ckpt), full)
    assert [p.name for p in full.iterdir()] == ["keep.txt"]
    with pytest.raises(ConfigError, match="no complete checkpoint"):
        export_checkpoint(CheckpointStore(tmp_path / "empty"), tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["full"]  # no temporary left behind


# --- the CLI ---------------------------------------------------------------------------------


def test_cli_exports_a_checkpoint_directory_without_an_agent(trained_full, tmp_path,
                                                             agent) -> None:
    _, ckpt = trained_full
    out = tmp_path / "model"
    result = runner.invoke(app, ["jobs", "export", str(ckpt), "--out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    shown = json.loads(result.stdout)
    assert shown["kind"] == "model" and shown["cut"] == CUT and shown["path"] == str(out)
    assert (out / "model.safetensors").is_file() and agent.requests == []
    again = runner.invoke(app, ["jobs", "export", str(ckpt), "--out", str(out)])
    assert again.exit_code == 2 and "is not empty" in again.output
    assert len(again.output.strip().splitlines()) == 1


def test_cli_asks_the_agent_for_a_job_id(agent, tmp_path) -> None:
    out = tmp_path / "model"
    agent.answers["job_export"] = {"path": str(out), "kind": "adapter", "job_id": "job-1",
                                   "step": 4, "cut": [4], "base": "tiny-llama",
                                   "files": [ADAPTER_CONFIG], "holdout_loss": None}
    result = runner.invoke(app, ["jobs", "export", "job-1", "--out", str(out)])
    assert result.exit_code == 0, result.output
    (req,) = agent.requests
    assert req == {"op": "job_export", "job_id": "job-1", "out": str(out)}
    assert "load tiny-llama --adapter" in result.output
    agent.answers["job_export"] = ConfigError("no job 'job-2'; jobs: job-1")
    result = runner.invoke(app, ["jobs", "export", "job-2", "--out", str(out)])
    assert result.exit_code == 2
    assert result.output.strip() == "error: no job 'job-2'; jobs: job-1"


# --- the agent: a job trained on the swarm, exported from any fellow --------------------------


async def test_a_swarm_job_exports_from_a_fellow_that_does_not_lead(autojump_clock,
                                                                    tmp_path) -> None:
    import shutil

    import trio

    from tests.training_swarm import SMALL_LLAMA, finished, job_config, leader_of, start_swarm

    config = job_config(model={"config": {**SMALL_LLAMA, "num_hidden_layers": 3}}, steps=2,
                        checkpoint={"dir": str(tmp_path / "ckpt"), "interval_steps": 2,
                                    "copies": 2})
    async with trio.open_nursery() as nursery:
        swarm = await start_swarm(nursery)
        leader = leader_of(swarm)
        other = next(a for a in swarm.live() if not a.leadership.is_leader())
        with pytest.raises(ConfigError, match="no job 'job-nope'"):
            await other.training.export("job-nope", str(tmp_path / "nope"))
        record = await other.training.submit(config, stages=3)
        record = await finished(other, record["job_id"])
        assert record["state"] == "finished", record["reason"]
        # the leader's own copy (in its state directory: the job came from a fellow) is
        # gone: the fellows holding copies give it back
        assert not (tmp_path / "ckpt").exists()
        shutil.rmtree(record["checkpoint_dir"])
        exported = await other.training.export(record["job_id"], str(tmp_path / "out"))
        assert exported.kind == "model" and exported.step == 2
        assert exported.job_id == record["job_id"]
        cut = [s["layers"][0] for s in record["stages"][0][1:]]
        assert list(exported.cut) == cut and len(cut) == 2
        _, hf = read_model_config(str(tmp_path / "out"))
        assert hf["p2pswarm_stage_cut"] == cut
        with pytest.raises(ConfigError, match="is not empty"):
            await leader.training.export(record["job_id"], str(tmp_path / "out"))
        nursery.cancel_scope.cancel()
    # the same weights as the job trained in one process
    local = LocalRun(JobConfig.from_dict({**config, "checkpoint": {}}), cut=cut)
    local.run()
    again = LocalRun(JobConfig.from_dict({**config, "model": str(tmp_path / "out"),
                                          "checkpoint": {}}), cut=cut, data=local.data)
    assert abs(again.evaluate(4) - local.evaluate(4)) <= 1e-4
