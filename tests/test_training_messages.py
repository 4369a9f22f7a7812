"""Training's operations on the wire: one message type each, bounded, terms stamped last."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from p2pswarm import wire
from p2pswarm.errors import ProtocolError
from p2pswarm.wire import jobs, message_types, training
from p2pswarm.wire.orders import pack_doc

CALLS_AND_ORDERS = [jobs.JobPlanAsk, jobs.JobSubmit, jobs.JobsAsk, jobs.JobCancel,
                    jobs.JobConfigAsk, jobs.TrainPrepare, jobs.TrainRelease, jobs.JobKeep,
                    jobs.JobsKeptAsk, jobs.JobCopyAsk]


@pytest.mark.parametrize("cls", CALLS_AND_ORDERS)
def test_every_job_call_and_order_carries_its_term_last(cls: type) -> None:
    last = dataclasses.fields(cls)[-1]
    assert last.name == "term" and last.default == 0


def test_job_messages_use_their_own_tags() -> None:
    tags = {wire.tag_of(cls) for cls in vars(jobs).values()
            if isinstance(cls, type) and cls.__module__ == jobs.__name__
            and cls not in (jobs.StageKey, jobs.KeptCopy)}
    assert tags and all(150 <= t <= 179 for t in tags)


def test_the_untyped_training_command_is_retired() -> None:
    assert 112 not in message_types()
    assert not hasattr(training, "TrainCtl")
    commands = [training.StepRun, training.StepReport, training.StepApply, training.TakeDelta,
                training.Delta, training.Update, training.ParamsAsk, training.Params,
                training.StateAsk, training.State, training.StateLoad, training.Reset,
                training.TiedAsk, training.Tied, training.TiedWeight, training.Ack,
                training.Stop]
    tags = [wire.tag_of(cls) for cls in commands]
    assert len(set(tags)) == len(tags)
    assert all(116 <= t <= 129 or 180 <= t <= 199 for t in tags)


@pytest.mark.parametrize("msg", [
    training.StepRun(3, 4, 0.001), training.StepReport(3, True, 1.5, 2.25),
    training.StepApply(3, 0.5), training.TakeDelta(), training.Delta(7, b"\x01\x02"),
    training.Update(8, b"u"), training.Reset(8, b"p"), training.Ack(3), training.Stop(),
    jobs.TrainPrepare("job-0000abcd", 1, 2, 3, "ab" * 16, 4, 8, "cuda", 0, 1 << 30,
                      "10.0.0.2:7000", pack_doc({"steps": 3}), 2, 9),
    jobs.TrainRelease("job-0000abcd", None, None, 4),
    jobs.TrainReleased((jobs.StageKey(1, 2),)),
    jobs.JobSubmit(None, "", None, "job-0000abcd"),
    jobs.JobList((pack_doc({"job_id": "job-0000abcd"}),)),
    jobs.JobKeep("job-0000abcd", 3, pack_doc({"step": 4}), (10, 12), "ab" * 32, 7),
    jobs.JobOuterChunk("job-0000abcd", 3, 10, b"xy"), jobs.JobKept("job-0000abcd", 3),
    jobs.JobsKept((jobs.KeptCopy("job-0000abcd", 7, 3, "running"),)),
    jobs.JobsKeptAsk(2), jobs.JobCopyAsk("job-0000abcd", 2),
])
def test_training_messages_round_trip(msg: object) -> None:
    (back,) = wire.decode(wire.encode(msg), max_bytes=1 << 20)
    assert back == msg


def test_values_out_of_bounds_are_refused() -> None:
    with pytest.raises(ProtocolError):
        wire.encode(training.StepReport(1, True, float("nan"), 0.0))
    with pytest.raises(ProtocolError):
        wire.encode(jobs.JobCancel(""))


def test_importing_the_agent_does_not_import_torch() -> None:
    code = ("import sys, p2pswarm.agent.agent, p2pswarm.agent.training; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
