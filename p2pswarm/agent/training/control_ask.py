"""The training control ops' requests made from a plain request map (``typed_op``'s
``from_map``): job.json and the flags beside it, checked in the words and the order a
client that sends maps has always met, then made into the ops' messages
(``wire.jobs.JobPlanRequest`` and kin). A client that sends the messages themselves skips
this; both reach the same handler, which reads fields only.

Job.json's launch fields (``exclude_cards``, ``maximize``, ``plan_id``) move out of the job
and into the request, where a flag given in the request wins."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from p2pswarm.agent.training.job_record import job_config
from p2pswarm.control.requests import RequestMap
from p2pswarm.errors import ConfigError
from p2pswarm.training.job import split_launch
from p2pswarm.wire.jobs import (
    JobCancelRequest,
    JobExportRequest,
    JobPlanRequest,
    JobsRequest,
    JobSubmitRequest,
)
from p2pswarm.wire.orders import pack_doc

MAX_STAGES = 65535  # the most stages a job may ask each pipeline to take


@dataclass(frozen=True, slots=True)
class _Launch:
    """A request's job.json (launch fields moved out) and its launch flags, as given."""

    config: Any
    exclude_cards: Any
    maximize: Any
    plan_id: Any
    stages: Any

    @classmethod
    def of(cls, request: RequestMap) -> _Launch:
        config = request.get("config")
        exclude, maximize, plan_id = (request.get("exclude_cards"), request.get("maximize"),
                                      request.get("plan_id"))
        if isinstance(config, dict):
            config, launch = split_launch(config)
            exclude = exclude or list(launch.exclude_cards)
            maximize = maximize or launch.maximize
            plan_id = plan_id or launch.plan_id
        return cls(config, exclude, maximize, plan_id, request.get("stages"))

    def checked_exclude_cards(self) -> tuple[str, ...]:
        exclude = self.exclude_cards or []
        if not isinstance(exclude, list) or not all(isinstance(e, str) for e in exclude):
            raise ConfigError("exclude_cards must be a list of \"FELLOW:INDEX\" strings")
        return tuple(exclude)

    def checked_stages(self) -> int | None:
        stages = self.stages
        if stages is not None and (isinstance(stages, bool) or not isinstance(stages, int)
                                   or not 1 <= stages <= MAX_STAGES):
            raise ConfigError(f"stages must be a whole number of at least 1, got {stages!r}")
        return stages

    def checked_config(self) -> bytes:
        """job.json as the request's ``Doc``: a bad one is refused here, before the leader
        is asked."""
        job_config(self.config)
        return pack_doc(self.config)


def _text(request: RequestMap, name: str, what: str) -> str:
    """Field ``name``: a non-empty string, or ConfigError saying ``what``."""
    value = request.get(name)
    if not isinstance(value, str) or not value:
        raise ConfigError(what)
    return value


def job_plan_request(request: RequestMap) -> JobPlanRequest:
    ask = _Launch.of(request)
    exclude = ask.checked_exclude_cards()
    maximize = ask.maximize
    if maximize not in (None, "seq_len", "speed"):
        raise ConfigError(f"maximize {maximize!r} must be \"seq_len\", \"speed\" or null")
    config = ask.checked_config()
    return JobPlanRequest(config, ask.checked_stages(), maximize or "", exclude)


def job_submit_request(request: RequestMap) -> JobSubmitRequest:
    ask = _Launch.of(request)
    resume = request.get("resume")
    config = None if resume and ask.config is None else ask.checked_config()
    stages = ask.checked_stages()
    plan_id = ask.plan_id
    if plan_id is not None and not isinstance(plan_id, str):
        raise ConfigError("plan_id must be a string")
    maximize = ask.maximize
    if maximize not in (None, "seq_len"):
        raise ConfigError(f"maximize {maximize!r} for a job must be \"seq_len\" or null")
    return JobSubmitRequest(config, plan_id or "", stages, str(resume or ""), maximize or "",
                            ask.checked_exclude_cards())


def jobs_request(request: RequestMap) -> JobsRequest:
    return JobsRequest()


def job_cancel_request(request: RequestMap) -> JobCancelRequest:
    return JobCancelRequest(_text(request, "job_id", "job_cancel needs a \"job_id\""))


def job_export_request(request: RequestMap) -> JobExportRequest:
    return JobExportRequest(_text(request, "job_id", "job_export needs a \"job_id\""),
                            _text(request, "out", "job_export needs an \"out\" directory"))


__all__ = ["MAX_STAGES", "job_cancel_request", "job_export_request", "job_plan_request",
           "job_submit_request", "jobs_request"]
