"""What the CLI's own agent is asked by the training control ops, as one value read once
from the request document (``TrainingAsk.from_doc``): job.json and the flags beside it.

Job.json's launch fields (``exclude_cards``, ``maximize``, ``plan_id``) move out of the job
and into the ask, where a flag given in the request wins. Each op checks what it takes, in
the order it always did, so the first mistake named is the same."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from p2pswarm.errors import ConfigError
from p2pswarm.training.job import split_launch

MAX_STAGES = 65535  # the most stages a job may ask each pipeline to take


@dataclass(frozen=True, slots=True)
class TrainingAsk:
    """One training control request, as given (each op checks the fields it uses)."""

    config: Any = None  # job.json's contents, launch fields moved out
    exclude_cards: Any = None
    maximize: Any = None
    plan_id: Any = None
    stages: Any = None
    resume: Any = None
    job_id: Any = None
    out: Any = None

    @classmethod
    def from_doc(cls, request: Mapping[str, Any]) -> TrainingAsk:
        config = request.get("config")
        exclude, maximize, plan_id = (request.get("exclude_cards"), request.get("maximize"),
                                      request.get("plan_id"))
        if isinstance(config, dict):
            config, launch = split_launch(config)
            exclude = exclude or list(launch.exclude_cards)
            maximize = maximize or launch.maximize
            plan_id = plan_id or launch.plan_id
        return cls(config, exclude, maximize, plan_id, request.get("stages"),
                   request.get("resume"), request.get("job_id"), request.get("out"))

    def checked_exclude_cards(self) -> list[str]:
        exclude = self.exclude_cards or []
        if not isinstance(exclude, list) or not all(isinstance(e, str) for e in exclude):
            raise ConfigError("exclude_cards must be a list of \"FELLOW:INDEX\" strings")
        return list(exclude)

    def checked_stages(self) -> int | None:
        stages = self.stages
        if stages is not None and (isinstance(stages, bool) or not isinstance(stages, int)
                                   or not 1 <= stages <= MAX_STAGES):
            raise ConfigError(f"stages must be a whole number of at least 1, got {stages!r}")
        return stages

    def checked_text(self, name: str, what: str) -> str:
        """Field ``name`` (``job_id``, ``out``): a non-empty string, or ConfigError."""
        value = self.job_id if name == "job_id" else self.out
        if not isinstance(value, str) or not value:
            raise ConfigError(what)
        return value


__all__ = ["MAX_STAGES", "TrainingAsk"]
