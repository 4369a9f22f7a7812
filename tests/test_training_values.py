"""A job's placement as values: one document form per type, read back exactly; the batch
shape resolved once (never "auto", never 0); a malformed copy refused."""

from __future__ import annotations

import pytest

from p2pswarm.agent.training.checkpoint_meta import (
    CheckpointMeta,
    StagePosition,
    shard_digests,
)
from p2pswarm.agent.training.placed import (
    BatchShape,
    ReplicaPlacement,
    StagePlacement,
    placement_from_doc,
    placement_to_doc,
)
from p2pswarm.config import SwarmConfig, TrainingConfig, training_sim
from p2pswarm.errors import ConfigError, RemoteProtocolError
from p2pswarm.training.job import JobConfig

JOB = JobConfig.from_dict({"model": "tiny-llama", "micro_batch": 4, "micro_batches": 2})


def stage(i: int, start: int, end: int) -> StagePlacement:
    return StagePlacement(i, f"{i:02x}" * 8, f"fellow-{i}", f"10.0.0.{i}:7782", (start, end),
                          "cpu", 0, "CPU", 1000 * (i + 1))


def test_a_placement_reads_back_as_it_was_written() -> None:
    placement = (ReplicaPlacement((stage(0, 0, 2), stage(1, 2, 4)), BatchShape.of_job(JOB)),
                 ReplicaPlacement((stage(2, 0, 3), stage(3, 3, 4)), BatchShape(16, 1)))
    doc = placement_to_doc(placement, JOB)
    assert "micro_batch" not in doc[0][0]  # the job's own shape is not repeated
    assert doc[1][1]["micro_batch"] == 16
    assert placement_from_doc(doc, JOB) == placement
    assert placement[0].cut == [2] and placement[1].addrs == ["10.0.0.2:7782", "10.0.0.3:7782"]


def test_a_batch_shape_is_never_zero() -> None:
    with pytest.raises(ValueError):
        BatchShape(0, 1)
    assert BatchShape(4, 3).sequences == 12


@pytest.mark.parametrize("bad", [
    [[{"stage": 0}]],
    [[{**stage(0, 0, 2).to_doc(), "layers": [0]}]],
    [[{**stage(0, 0, 2).to_doc(), "micro_batch": 0}]],
    [[{**stage(0, 0, 2).to_doc(), "fellow": "x" * 300}]],
    "not a list",
])
def test_a_malformed_placement_is_refused(bad: object) -> None:
    with pytest.raises(RemoteProtocolError):
        placement_from_doc(bad, JOB)


def test_training_timings_have_presets_and_live_in_the_config() -> None:
    assert SwarmConfig().training == TrainingConfig()
    sim = training_sim(0.5)
    assert (sim.step_timeout_s, sim.retry_s, sim.simulated_step_s) == (5.0, 2.0, 0.5)
    assert TrainingConfig().simulating(0.0) == TrainingConfig()


def test_a_checkpoints_meta_reads_back_and_old_shard_positions_still_read() -> None:
    meta = CheckpointMeta(8, 64, 1234, (3.5, 3.25), (2,), 2, JOB, "job-0000abcd",
                          {"replica-0.stage-0": StagePosition(64, 8, 0, 0, 2),
                           "replica-1.stage-0": StagePosition(32, 4, 0, 0, 2,
                                                              global_state=True)})
    doc = meta.to_doc()
    assert list(doc) == ["step", "samples", "bytes_sent", "losses", "cut", "replicas", "job",
                         "job_id", "positions"]
    assert "global_state" not in doc["positions"]["replica-0.stage-0"]
    assert CheckpointMeta.from_doc(doc) == meta
    old = {"data_position": 5, "pipeline_steps": 1, "samples_unsent": 2, "steps_unsent": 1,
           "sync": {"version": 3}}
    assert StagePosition.from_doc(old) == StagePosition(5, 1, 2, 1, 3)


def test_a_checkpoint_manifest_gives_its_meta_and_its_shards() -> None:
    meta = CheckpointMeta(8, 64, 1234, (3.5,), (), 1, JOB, "job-0000abcd",
                          {"replica-0.stage-0": StagePosition(64, 8, 0, 0, 2)})
    manifest = {"format": 1, "step": 8, "shards": {"replica-0.stage-0": "ab" * 32},
                "meta": meta.to_doc()}
    assert CheckpointMeta.of_manifest(manifest) == meta
    assert shard_digests(manifest) == {"replica-0.stage-0": "ab" * 32}
    with pytest.raises(ConfigError, match="damaged"):
        CheckpointMeta.of_manifest({"shards": {}})
    with pytest.raises(KeyError):
        shard_digests({"meta": {}})
    with pytest.raises(TypeError):
        shard_digests({"shards": ["x"]})
