"""job.json's launch fields: exclude_cards, maximize and plan_id mean what the flags mean.

The rule: a flag given (on the command line, in an API or MCP request) overrides the
field in job.json; a flag not given leaves the file's field in force. The fields travel
beside the job, never inside what the leader plans, so a job with the fields and the
same job with the flags get the same plan_id.
"""

from __future__ import annotations

import pytest
import trio

from p2pswarm.errors import ConfigError, PlanChanged
from p2pswarm.training.job import JobConfig, JobLaunch, split_launch
from tests.training_swarm import job_config, start_swarm


def test_the_fields_are_read_checked_and_split_off() -> None:
    job = JobConfig.from_dict(job_config(exclude_cards=["pi-3:cpu"], maximize="seq_len",
                                         plan_id="0123456789abcdef"))
    assert job.launch == JobLaunch(("pi-3:cpu",), "seq_len", "0123456789abcdef")
    assert JobConfig.from_dict(job.to_dict()) == job
    assert JobConfig.from_dict(job_config()).launch == JobLaunch()
    plain, launch = split_launch(job_config(plan_id="0123456789abcdef"))
    assert plain == job_config() and launch.plan_id == "0123456789abcdef"
    for bad in ({"exclude_cards": "pi-3:cpu"}, {"exclude_cards": [3]},
                {"maximize": "speed"}, {"plan_id": "XYZ"}, {"plan_id": "0123"}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            JobConfig.from_dict(job_config(**bad))


@pytest.mark.slow
async def test_fields_in_the_file_act_as_flags_and_flags_win(autojump_clock) -> None:
    config = job_config(steps=1000)
    async with trio.open_nursery() as nursery:
        swarm = await start_swarm(nursery)
        ops = swarm.live()[1].control_ops
        asker_plan, asker_submit = ops["job_plan"], ops["job_submit"]
        whole = await asker_plan({"config": config, "stages": 2})
        first = f"{whole['stages'][0]['fellow_id']}:cpu"
        second = f"{whole['stages'][1]['fellow_id']}:cpu"
        by_flag = await asker_plan({"config": config, "stages": 2,
                                    "exclude_cards": [first]})
        in_file = job_config(steps=1000, exclude_cards=[first])
        by_file = await asker_plan({"config": in_file, "stages": 2})
        assert by_file["plan_id"] == by_flag["plan_id"] != whole["plan_id"]
        # a flag given wins over the file's field
        other = await asker_plan({"config": in_file, "stages": 2,
                                  "exclude_cards": [second]})
        alone = await asker_plan({"config": config, "stages": 2,
                                  "exclude_cards": [second]})
        assert other["plan_id"] == alone["plan_id"] != by_file["plan_id"]
        longest = await asker_plan({"config": config, "maximize": "seq_len"})
        assert (await asker_plan({"config": job_config(steps=1000, maximize="seq_len")})
                )["plan_id"] == longest["plan_id"]
        # the file's plan_id pins the job; a stale one in the file is refused...
        with pytest.raises(PlanChanged):
            await asker_submit({"config": {**in_file, "plan_id": whole["plan_id"]},
                                "stages": 2})
        # ...unless the flag names the plan to start on
        record = await asker_submit({"config": {**in_file, "plan_id": whole["plan_id"]},
                                     "stages": 2, "plan_id": by_file["plan_id"]})
        assert record["plan_id"] == by_file["plan_id"]
        await ops["job_cancel"]({"job_id": record["job_id"]})
        nursery.cancel_scope.cancel()
