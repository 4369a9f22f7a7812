"""A job's record and a closed round's entry in it: their documents and back."""

from __future__ import annotations

import math

import pytest

from p2pswarm.agent.training.job_record import Job, JobReport, JobReportDoc
from p2pswarm.agent.training.job_state import JobSnapshot, JobSnapshotDoc
from p2pswarm.agent.training.placed import BatchShape, ReplicaPlacement, StagePlacement
from p2pswarm.agent.training.round_entry import LateContribution, RoundEntry
from p2pswarm.errors import RemoteProtocolError
from p2pswarm.planner import BUILTIN_MODELS
from p2pswarm.training.job import JobConfig
from p2pswarm.wire.orders import pack_doc, unpack_doc


def test_round_entry_document_round_trip() -> None:
    entry = RoundEntry(12, 3, 41.25, ("r0", "r1"), ("r2",),
                       (LateContribution("r2", 2, 64, 0.25, False),))
    doc = entry.to_doc()
    assert doc == {"step": 12, "version": 3, "closed_at_s": 41.25,
                   "replicas": ["r0", "r1"], "dropped": ["r2"],
                   "late": [{"replica": "r2", "staleness": 2, "samples": 64,
                             "weight": 0.25, "dropped": False}]}
    assert list(doc) == ["step", "version", "closed_at_s", "replicas", "dropped", "late"]
    assert RoundEntry.from_doc(doc) == entry


@pytest.mark.parametrize("bad", [
    None, {}, {"step": -1, "version": 0, "closed_at_s": 0.0, "replicas": [], "dropped": [],
               "late": []},
    {"step": 1, "version": 0, "closed_at_s": float("nan"), "replicas": [], "dropped": [],
     "late": []},
    {"step": 1, "version": 0, "closed_at_s": 1.0, "replicas": [3], "dropped": [],
     "late": []},
    {"step": 1, "version": 0, "closed_at_s": 1.0, "replicas": [], "dropped": [],
     "late": [{"replica": "r0"}]},
])
def test_a_malformed_round_entry_is_refused(bad: object) -> None:
    with pytest.raises(RemoteProtocolError):
        RoundEntry.from_doc(bad)


RECORD_KEYS = ["job_id", "state", "reason", "step", "steps", "loss", "losses", "tokens_per_s",
               "replicas", "bytes_sent", "samples", "plan_id", "pinned", "model",
               "checkpoint", "checkpoint_dir", "checkpoint_copies", "seq_len", "rejoins",
               "paused_times", "rounds", "replica_steps", "moved", "moves", "stages"]


def _job(model: object = "tiny-llama") -> Job:
    config = JobConfig.from_dict({"model": model, "steps": 9})
    stage = StagePlacement(0, "ab" * 16, "f000", "10.0.0.1:7000", (0, 2), "cpu", 0, "CPU",
                           1 << 20)
    entry = RoundEntry(12, 3, 41.25, ("r0",), (), (LateContribution("r1", 2, 64, 0.5, True),))
    return Job("job-0000abcd", config, "ab" * 8, pinned=True, stages=None,
               state="running", step=7, losses=[3.0, 2.5], loss=2.5, rounds=[entry],
               copies={"replica-0.stage-0": ["f001"]}, replica_steps={"replica-0": 7},
               moves=["taken over from f009"],
               placement=(ReplicaPlacement((stage,), BatchShape.of_job(config)),))


def test_a_job_record_document_round_trips() -> None:
    for job in (_job(), _job({"config": dict(BUILTIN_MODELS["tiny-llama"])})):
        report = job.report()
        doc = report.to_doc()
        assert list(doc) == RECORD_KEYS and doc["moved"] == "taken over from f009"
        assert doc["stages"] == [[{"stage": 0, "fellow": "f000", "layers": [0, 2],
                                   "card": "CPU"}]]
        back = JobReport.from_doc(unpack_doc(pack_doc(doc)))
        assert back == report and back.to_doc() == doc and not back.ended


def test_the_job_documents_have_exactly_their_typed_keys() -> None:
    assert list(JobReportDoc.__annotations__) == RECORD_KEYS
    copy = JobSnapshot.of(_job(), None, "f000")
    doc = copy.to_doc()
    assert list(doc) == list(JobSnapshotDoc.__annotations__)
    assert JobSnapshot.read(copy.packed()).to_doc() == doc


def test_a_job_record_keeps_a_diverged_loss_and_refuses_what_is_malformed() -> None:
    doc = _job().report().to_doc()
    assert math.isnan(JobReport.from_doc({**doc, "loss": float("nan")}).loss or 0.0)
    assert JobReport.from_doc({**doc, "state": "finished"}).ended
    for change in ({"job_id": None}, {"state": "exploded"}, {"step": -1},
                   {"stages": [[{"stage": 0}]]}, {"model": 3}, {"losses": ["x"]}):
        with pytest.raises(RemoteProtocolError, match="a job record's"):
            JobReport.from_doc({**doc, **change})
