"""The training control ops' requests: a plain request map made into its message once, at
the edge, with the checks and words a map client has always met; the message the same
whether it came as a map or encoded."""

from __future__ import annotations

from typing import Any

import pytest

from p2pswarm.agent.training.control_ask import (
    job_cancel_request,
    job_export_request,
    job_plan_request,
    job_submit_request,
    jobs_request,
)
from p2pswarm.control.requests import checked, decoded, request_map
from p2pswarm.errors import ConfigError
from p2pswarm.wire.jobs import (
    JobCancelRequest,
    JobExportRequest,
    JobPlanRequest,
    JobsRequest,
    JobSubmitRequest,
)
from p2pswarm.wire.orders import unpack_doc

CONFIG = {"model": "tiny-llama", "steps": 4, "seq_len": 32}


def test_a_plan_request_takes_the_files_launch_fields_and_flags_win() -> None:
    msg = job_plan_request({"config": {**CONFIG, "exclude_cards": ["f1:cpu"],
                                       "maximize": "seq_len"}, "stages": 2})
    assert (msg.stages, msg.maximize, msg.exclude_cards) == (2, "seq_len", ("f1:cpu",))
    assert unpack_doc(msg.config) == CONFIG
    flagged = job_plan_request({"config": {**CONFIG, "exclude_cards": ["f1:cpu"]},
                                "exclude_cards": ["f2:0"]})
    assert flagged.exclude_cards == ("f2:0",) and flagged.stages is None


def test_a_submit_request_without_a_config_resumes() -> None:
    msg = job_submit_request({"resume": "job-0000abcd", "stages": 3})
    assert msg == JobSubmitRequest(None, "", 3, "job-0000abcd", "", ())
    full = job_submit_request({"config": {**CONFIG, "plan_id": "0123456789abcdef"}})
    assert full.plan_id == "0123456789abcdef" and unpack_doc(full.config or b"") == CONFIG


@pytest.mark.parametrize("request_, words", [
    ({"config": {"steps": 3}}, "model"),
    ({"config": CONFIG, "stages": 0}, "stages must be a whole number"),
    ({"config": CONFIG, "maximize": "speedy"}, "maximize"),
    ({"config": CONFIG, "exclude_cards": "f1:cpu"}, "exclude_cards"),
    ({"config": CONFIG, "plan_id": 7}, "plan_id must be a string"),
])
def test_a_bad_map_is_refused_in_its_own_words(request_: dict[str, Any], words: str) -> None:
    maker = job_submit_request if "plan_id" in request_ else job_plan_request
    with pytest.raises(ConfigError, match=words):
        maker(request_)


def test_cancel_and_export_name_what_they_miss() -> None:
    assert job_cancel_request({"job_id": "job-1"}) == JobCancelRequest("job-1")
    with pytest.raises(ConfigError, match="job_cancel needs a \"job_id\""):
        job_cancel_request({})
    assert job_export_request({"job_id": "job-1", "out": "/tmp/x"}) == \
        JobExportRequest("job-1", "/tmp/x")
    with pytest.raises(ConfigError, match="an \"out\" directory"):
        job_export_request({"job_id": "job-1"})
    assert jobs_request({}) == JobsRequest()


def test_every_request_reads_the_same_from_a_map_or_encoded() -> None:
    for op, msg in [("job_plan", job_plan_request({"config": CONFIG, "stages": 2})),
                    ("job_submit", job_submit_request({"config": CONFIG})),
                    ("jobs", jobs_request({})),
                    ("job_cancel", job_cancel_request({"job_id": "job-1"})),
                    ("job_export", job_export_request({"job_id": "job-1", "out": "o"}))]:
        assert checked(msg) == msg
        assert decoded(request_map(op, msg)["msg"], type(msg)) == msg


def test_the_codec_bounds_what_the_checks_let_through() -> None:
    with pytest.raises(ConfigError, match="JobPlanRequest"):
        checked(job_plan_request({"config": CONFIG, "exclude_cards": ["x" * 200]}))
    assert isinstance(job_plan_request({"config": CONFIG}), JobPlanRequest)
