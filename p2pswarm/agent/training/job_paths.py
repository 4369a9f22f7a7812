"""Which paths of a job the leader may touch, by who submitted it.

A job names paths: where checkpoints go (``checkpoint.dir``), the model (a directory or
a ``config.json``), and, resuming, a checkpoint directory. They mean something only on
the disk of whoever wrote them. The leader writes checkpoints and reads model configs on
its own disk, so a path from another fellow (a token holder, honest or not) would let
that fellow make the leader write, delete or read files anywhere. The rule:

- submitted by the leader's own user (its control socket, the CLI on its machine, or its
  HTTP API, which admits such paths only inside ``--http-allow-dir`` directories): the
  paths are honoured as written;
- from any other fellow: checkpoints go to the leader's own state directory,
  ``<home>/job-checkpoints/<job id>/`` (the job record's ``checkpoint_dir`` says where;
  the copies on fellows are as for any job, and ``jobs export`` or ``--resume JOB`` reach
  them from any fellow); the model must be a built-in name, a config given inline, or a
  model directory this leader offers itself (one it serves); a resume must name a job id.
  Anything else is refused in one line and counted.

A new leader taking a job over always keeps its checkpoints in its own state directory:
a path in a copy was written for another fellow's disk (``Training.checkpoint_dir``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

from p2pswarm.errors import ConfigError
from p2pswarm.names import contained, safe_name
from p2pswarm.planner.profile import builtin_config, known_names
from p2pswarm.training.job import JobConfig

JOB_ID = re.compile(r"job-[0-9a-f]{8}")
JOB_ID_CHARS = 64  # a job id as checkpoint copies bound it


class JobPathRefused(ConfigError):
    """A job from another fellow names a path on the leader's disk."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason  # the counter it is refused under


def leader_checkpoint_dir(root: Path, job_id: str) -> Path:
    """Where a leader keeps job ``job_id``'s checkpoints under its own ``root``."""
    return contained(root, safe_name(job_id, "job id", JOB_ID_CHARS))


def check_resume_from_fellow(resume: str) -> None:
    """A resume from another fellow names a job id, never a directory."""
    if resume and not JOB_ID.fullmatch(resume):
        raise JobPathRefused(
            "job-resume-path",
            f"resume {resume[:80]!r} refused: a fellow other than the leader resumes a job "
            "by its id (job-xxxxxxxx; `p2pswarm jobs` lists them), never by a directory on "
            "the leader's disk; to resume from a checkpoint directory, run `train --resume "
            "DIR` on the leader's machine")


def check_model_from_fellow(job: JobConfig, offered: Iterable[str]) -> None:
    """A model from another fellow: built in, inline, or a directory this leader offers."""
    name = job.model.name
    if name is None or builtin_config(name) is not None:
        return
    mine = {str(Path(d).resolve()) for d in offered}
    path = Path(name)
    if path.is_absolute() and str(path.resolve()) in mine:
        return
    raise JobPathRefused(
        "job-model-path",
        f"model {name[:80]!r} refused: a job from a fellow other than the leader names a "
        f"built-in model ({', '.join(known_names())}), a model config given inline "
        '({"config": {...}}), or a model directory the leader serves (load it there first)')


__all__ = ["JOB_ID", "JobPathRefused", "check_model_from_fellow", "check_resume_from_fellow",
           "leader_checkpoint_dir"]
