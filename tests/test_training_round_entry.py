"""A closed round's entry in a job record: its document and back."""

from __future__ import annotations

import pytest

from p2pswarm.agent.training.round_entry import LateContribution, RoundEntry
from p2pswarm.errors import RemoteProtocolError


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


def test_following_a_job_reads_its_headline() -> None:
    from p2pswarm.agent.training.job_record import JobHeadline
    from p2pswarm.errors import ConfigError

    assert JobHeadline.from_doc({"job_id": "job-1", "state": "running", "step": 3}) == \
        JobHeadline("job-1", "running")
    assert JobHeadline.from_doc({"job_id": "job-1", "state": "finished"}).ended
    with pytest.raises(ConfigError):
        JobHeadline.from_doc({"state": "running"})
