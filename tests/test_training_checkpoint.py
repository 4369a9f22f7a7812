"""Checkpoints: resume continues the loss trajectory exactly, a crash mid-write loses
nothing, damage is caught, every shard survives the loss of any one fellow, and a trained
model exports as a Hugging Face directory that records its stage cut."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from p2pswarm.errors import ConfigError
from p2pswarm.models.checkpoint import Checkpoint
from p2pswarm.models.loader import load_stage_model
from p2pswarm.planner.profile import profile_from_config
from p2pswarm.training import checkpoint as checkpoint_module
from p2pswarm.training.checkpoint import CheckpointStore, atomic_write_bytes, shard_holders
from p2pswarm.training.data import TokenData
from p2pswarm.training.job import JobConfig
from p2pswarm.training.run import LocalRun
from tests.byte_llama import byte_llama, byte_token_data

MODEL = byte_llama(hidden_size=32, layers=4, positions=64, tied=True)


pytestmark = pytest.mark.usefixtures("one_torch_thread_per_module")


@pytest.fixture(scope="module")
def data() -> TokenData:
    return byte_token_data()


def job_in(directory: Path, **checkpoint: object) -> JobConfig:
    return JobConfig.from_dict({
        "model": {"config": MODEL}, "seq_len": 32, "micro_batch": 4, "micro_batches": 2,
        "steps": 14, "lr": {"peak": 3e-3, "warmup_steps": 2},
        # error feedback residuals and qsgd's random state must both come back exactly
        "sync": {"inner_steps": 4, "codec": "topk", "codec_options": {"fraction": 0.1},
                 "update_codec": "qsgd", "update_codec_options": {"bits": 8}},
        "checkpoint": {"dir": str(directory), "interval_steps": 5, **checkpoint}})


def test_resume_continues_the_same_loss_trajectory(tmp_path: Path, data: TokenData) -> None:
    job = job_in(tmp_path / "ckpt", keep=5)
    uninterrupted = LocalRun(job, replicas=2, cut=[1, 3], data=data).run()
    assert CheckpointStore(tmp_path / "ckpt").steps() == [5, 10]
    # every process stopped after step 5 (mid-round: deltas not yet sent) or 10
    for step in (5, 10):
        resumed = LocalRun.resume(job, step=step, data=data)
        assert resumed.step == step and resumed.losses == uninterrupted[:step]
        assert resumed.run() == uninterrupted[step:]  # exactly, not approximately
    latest = LocalRun.resume(job, data=data)
    assert latest.step == 10


def test_resume_refuses_another_job(tmp_path: Path, data: TokenData) -> None:
    job = job_in(tmp_path / "ckpt")
    LocalRun(job, replicas=2, cut=[2], data=data).run(until_step=5)
    other = JobConfig.from_dict({**job.to_dict(), "seed": 9})
    with pytest.raises(ConfigError, match="different job.json"):
        LocalRun.resume(other, data=data)
    with pytest.raises(ConfigError, match="no complete checkpoint"):
        LocalRun.resume(job_in(tmp_path / "empty"), data=data)


def test_a_crash_while_writing_leaves_the_last_complete_checkpoint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = CheckpointStore(tmp_path, keep=2)
    store.write(1, {"a": {"x": torch.ones(3)}, "b": {"y": 2}})
    real = checkpoint_module.atomic_write_bytes

    def crash_at_manifest(path: str | Path, payload: bytes) -> None:
        if Path(path).name == "manifest.json":
            raise OSError("power cut")
        real(path, payload)

    monkeypatch.setattr(checkpoint_module, "atomic_write_bytes", crash_at_manifest)
    with pytest.raises(OSError):
        store.write(2, {"a": {"x": torch.zeros(3)}, "b": {"y": 3}})
    monkeypatch.undo()
    assert store.latest() == 1 and (tmp_path / "LATEST").read_text() == "step-00000001"
    assert torch.equal(store.read(1, "a")["x"], torch.ones(3))
    assert not [p for p in tmp_path.rglob("*") if ".tmp-" in p.name]
    # damage is caught by the manifest's digests
    shard = tmp_path / "step-00000001" / "a.pt"
    shard.write_bytes(shard.read_bytes()[:-3] + b"xyz")
    with pytest.raises(ConfigError, match="does not match its manifest"):
        store.read(1, "a")
    # old checkpoints are pruned to ``keep``
    for step in (3, 4, 5):
        store.write(step, {"a": {"x": torch.ones(1)}})
    assert store.steps() == [4, 5]


def test_atomic_write_replaces_whole(tmp_path: Path) -> None:
    target = tmp_path / "f.bin"
    atomic_write_bytes(target, b"old")
    atomic_write_bytes(target, b"new contents")
    assert target.read_bytes() == b"new contents"
    assert [p.name for p in tmp_path.iterdir()] == ["f.bin"]


@given(n_fellows=st.integers(2, 9), n_shards=st.integers(1, 12),
       lost=st.integers(0, 8))
def test_every_shard_survives_the_loss_of_any_one_fellow(n_fellows: int, n_shards: int,
                                                         lost: int) -> None:
    fellows = [f"fellow-{i}" for i in range(n_fellows)]
    shards = [f"replica-0.stage-{i}" for i in range(n_shards)]
    holders = shard_holders(shards, fellows, copies=2)
    gone = fellows[lost % n_fellows]
    for shard in shards:
        assert len(set(holders[shard])) == 2
        assert [f for f in holders[shard] if f != gone]
    # stable: a fellow joining moves a shard only onto itself
    more = shard_holders(shards, [*fellows, "newcomer"], copies=2)
    for shard in shards:
        assert set(more[shard]) - set(holders[shard]) <= {"newcomer"}


def test_export_records_the_cut_and_serves_the_same_model(tmp_path: Path,
                                                          data: TokenData) -> None:
    job = job_in(tmp_path / "ckpt")
    run = LocalRun(job, replicas=2, cut=[1, 3], data=data)
    run.run(until_step=8)
    out = run.export(tmp_path / "model")
    config = json.loads((out / "config.json").read_text())
    assert config["p2pswarm_stage_cut"] == [1, 3]
    assert profile_from_config(config, "trained").trained_cut == (1, 3)
    checkpoint = Checkpoint(out)
    assert "lm_head.weight" not in checkpoint.tensor_names()  # tied: written once
    served = load_stage_model(checkpoint, 0, 4)
    ids = data.holdout[:32].unsqueeze(0)
    with torch.no_grad():
        x = ids
        for stage in run.replicas[0].stages:
            x = stage.model(x)
        assert torch.allclose(served(ids), x, atol=1e-5)
