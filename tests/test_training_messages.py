"""Training's operations on the wire: one message type each, bounded, terms stamped last."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from typing import Any

import pytest
import trio

from p2pswarm import wire
from p2pswarm.agent.streams import send_message
from p2pswarm.agent.training.links import receive_answer, send_long
from p2pswarm.errors import ProtocolError
from p2pswarm.wire import jobs, message_types, training
from p2pswarm.wire.orders import pack_doc

CALLS_AND_ORDERS = [jobs.JobPlanAsk, jobs.JobSubmit, jobs.JobsAsk, jobs.JobCancel,
                    jobs.JobConfigAsk, jobs.TrainPrepare, jobs.TrainRelease, jobs.JobKeep,
                    jobs.JobsKeptAsk, jobs.JobCopyAsk]


@pytest.mark.parametrize("cls", CALLS_AND_ORDERS)
def test_every_job_call_and_order_carries_its_term_last(cls: type) -> None:
    """``term`` closes the fields a message was born with; fields appended since (the wire
    only grows at the end) follow it, each with a default."""
    fields = dataclasses.fields(cls)
    names = [f.name for f in fields]
    assert "term" in names and fields[names.index("term")].default == 0
    assert all(f.default is not dataclasses.MISSING for f in fields[names.index("term"):])


def test_job_messages_use_their_own_tags() -> None:
    tags = {wire.tag_of(cls) for cls in vars(jobs).values()
            if isinstance(cls, type) and cls.__module__ == jobs.__name__
            and cls not in (jobs.StageKey, jobs.KeptCopy)}
    # 150-179: calls and orders between fellows; 250-269: the local control API's ops
    assert tags and all(150 <= t <= 179 or 250 <= t <= 269 for t in tags)


def test_the_untyped_command_and_the_one_frame_state_are_retired() -> None:
    assert not {112, 125, 126} & set(message_types())
    assert not hasattr(training, "TrainCtl") and not hasattr(training, "State")
    commands = [training.StepRun, training.StepReport, training.StepApply, training.TakeDelta,
                training.Delta, training.Update, training.ParamsAsk, training.Params,
                training.StateAsk, training.StateHead, training.StateLoadHead,
                training.StatePart, training.Reset, training.MomentsAsk,
                training.MomentsLoadHead,
                training.TiedAsk, training.Tied, training.TiedWeight, training.Ack,
                training.Stop]
    tags = [wire.tag_of(cls) for cls in commands]
    assert len(set(tags)) == len(tags)
    assert all(116 <= t <= 129 or 180 <= t <= 199 for t in tags)


@pytest.mark.parametrize("msg", [
    training.StepRun(3, 4, 0.001), training.StepReport(3, True, 1.5, 2.25),
    training.StepApply(3, 0.5), training.TakeDelta(), training.Delta(7, b"\x01\x02"),
    training.Update(8, b"u"), training.Reset(8, b"p"), training.Ack(3), training.Stop(),
    training.StateHead(1 << 40, "ab" * 32), training.StateLoadHead(5, "cd" * 32),
    training.StatePart(1 << 33, b"part"), training.Params(b"p", 1 << 30),
    training.MomentsAsk(), training.MomentsLoadHead(1 << 31, "ef" * 32),
    training.Delta(3, b"d", 5),
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
    with pytest.raises(ProtocolError):  # a state travels in parts, none above the chunk
        wire.encode(training.StatePart(0, bytes(training.SHARD_CHUNK_BYTES + 1)))


def test_importing_the_agent_does_not_import_torch() -> None:
    code = ("import sys, p2pswarm.agent.agent, p2pswarm.agent.training; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


class _Pipe:
    """One direction of a stream: frames in, frames out, in order."""

    def __init__(self) -> None:
        self.send_channel, self.receive_channel = trio.open_memory_channel[bytes](1000)
        self.sent: list[int] = []  # each frame's length

    async def send_frame(self, frame: bytes) -> None:
        self.sent.append(len(frame))
        await self.send_channel.send(frame)

    async def receive_frame(self) -> bytes:
        return await self.receive_channel.receive()


async def test_a_blob_longer_than_a_part_travels_in_parts_and_comes_back_whole() -> None:
    pipe: Any = _Pipe()
    blob = bytes(range(256)) * ((2 * training.SHARD_CHUNK_BYTES + 12345) // 256)
    await send_long(pipe, training.Params(blob))
    assert len(pipe.sent) == 3  # what went on the wire: three frames, none past a part
    assert all(n < training.SHARD_CHUNK_BYTES + 1024 for n in pipe.sent)
    got = await receive_answer(pipe, training.Params, "the stage")
    assert got == training.Params(blob)
    activation = training.TrainTensor("activation", 7, 1, blob[:training.SHARD_CHUNK_BYTES + 1])
    await send_long(pipe, activation)
    assert await receive_answer(pipe, training.TrainTensor, "the stage before") == activation
    await send_long(pipe, training.Update(4, b"short"))  # one frame as before
    assert await receive_answer(pipe, training.Update, "the driver") == training.Update(4,
                                                                                      b"short")


async def test_a_part_out_of_place_is_refused() -> None:
    pipe: Any = _Pipe()
    first = bytes(training.SHARD_CHUNK_BYTES)
    await send_message(pipe, training.Delta(1, first, 10))
    await send_message(pipe, training.StatePart(training.SHARD_CHUNK_BYTES + 1, b"x" * 9))
    with pytest.raises(ProtocolError, match="out of place"):
        await receive_answer(pipe, training.Delta, "the stage")
    await send_message(pipe, training.Delta(1, b"short first part", 10))
    with pytest.raises(ProtocolError, match="announced"):
        await receive_answer(pipe, training.Delta, "the stage")
