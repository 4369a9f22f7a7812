"""What the real-process chaos run measures, on made-up answers: a job that falls back to
step 0 and stays there while pending counts as one restart, not one per poll."""

from __future__ import annotations

from typing import Any

from p2pswarm.sim.chaos import JobWatch


class Answers:
    """Stands in for the run's ``Field``: each ``jobs`` ask gets the next record."""

    def __init__(self, records: list[dict[str, Any]]) -> None:
        self.records = records

    def ask(self, message: dict[str, Any], timeout_s: float = 10) -> list[dict[str, Any]]:
        assert message == {"op": "jobs"}
        return [self.records.pop(0)]


def test_a_job_back_at_step_0_for_many_polls_is_one_restart() -> None:
    steps = [(3, "running"), (20, "running"), (0, "pending"), (0, "pending"),
             (0, "running"), (4, "running"), (9, "running"), (0, "pending"),
             (12, "running"), (520, "finished")]
    swarm = Answers([{"job_id": "job-1", "step": step, "state": state}
                     for step, state in steps])
    watch = JobWatch("job-1")
    for _ in steps:
        watch.poll(swarm)  # type: ignore[arg-type]
    assert watch.restarts() == 2 and watch.highest_step == 520 and watch.ended()
