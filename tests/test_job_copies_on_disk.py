"""Job copies on a fellow's disk (agent.training.kept_store): written as kept, read back
when the agent starts, and what does not read back whole is dropped, bounded."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import trio
import trio.testing

from p2pswarm.agent.training.handover import JobCopy
from p2pswarm.agent.training.kept_store import MAX_HEAD_BYTES, KeptStore
from p2pswarm.wire.jobs import MAX_KEPT_JOBS, JobKeep
from p2pswarm.wire.orders import pack_doc


def copy_of(job_id: str, seq: int, outer: bytes = b"", term: int = 3) -> JobCopy:
    parts = (len(outer) // 2, len(outer) - len(outer) // 2) if outer else ()
    digest = hashlib.sha256(outer).hexdigest() if outer else ""
    return JobCopy(JobKeep(job_id, seq, pack_doc({"job_id": job_id, "seq": seq}), parts,
                           digest, term), outer)


async def inline(fn: Any) -> Any:
    return fn()


def written(root: Path, *copies: JobCopy | tuple[str, None]) -> KeptStore:
    """A store at ``root`` that has written ``copies`` (a (job id, None) deletes)."""
    async def go() -> KeptStore:
        async with trio.open_nursery() as nursery:
            store = KeptStore(root, inline, nursery.start_soon)
            for c in copies:
                if isinstance(c, JobCopy):
                    store.put(c)
                else:
                    store.drop(c[0])
                await trio.testing.wait_all_tasks_blocked()
        return store

    return trio.run(go)


def test_copies_read_back_as_written_the_newest_of_each_job(tmp_path: Path) -> None:
    a1, a2 = copy_of("job-a", 1, b"x" * 1000), copy_of("job-a", 2, b"y" * 999)
    b = copy_of("job-b", 5)
    written(tmp_path, a1, a2, b, copy_of("job-c", 1), ("job-c", None))
    back = {c.head.job_id: c for c in KeptStore(tmp_path, inline, lambda *a: None).load()}
    assert sorted(back) == ["job-a", "job-b"]
    assert back["job-a"] == a2 and back["job-b"] == b


def test_outer_state_that_does_not_match_is_left_out_not_trusted(tmp_path: Path) -> None:
    written(tmp_path, copy_of("job-a", 1, b"z" * 4096), copy_of("job-b", 1, b"w" * 64))
    (tmp_path / "job-a.outer").write_bytes(b"q" * 4096)  # same size, other bytes
    (tmp_path / "job-b.outer").write_bytes(b"w" * 63)  # cut short
    back = {c.head.job_id: c for c in KeptStore(tmp_path, inline, lambda *a: None).load()}
    assert back["job-a"].outer == b"" and back["job-a"].head.outer_bytes == ()
    assert back["job-b"].outer == b"" and back["job-b"].head.seq == 1


def test_what_is_not_a_copy_is_dropped_and_the_count_is_bounded(tmp_path: Path) -> None:
    copies = [copy_of(f"job-{i:03d}", 1) for i in range(MAX_KEPT_JOBS + 5)]
    written(tmp_path, *copies)
    (tmp_path / "..evil.head").write_bytes(b"\x00")  # a name that may not be a path part
    (tmp_path / "job-zz.head").write_bytes(b"not msgpack at all")
    (tmp_path / "job-big.head").write_bytes(b"\x00" * (MAX_HEAD_BYTES + 1))
    (tmp_path / "job-other.head").write_bytes((tmp_path / "job-000.head").read_bytes())
    back = KeptStore(tmp_path, inline, lambda *a: None).load()
    assert len(back) <= MAX_KEPT_JOBS
    assert all(c.head.job_id.startswith("job-0") for c in back)
    for name in ("..evil.head", "job-zz.head", "job-big.head", "job-other.head"):
        assert not (tmp_path / name).exists(), name
    assert len(list(tmp_path.glob("*.head"))) == MAX_KEPT_JOBS


def test_a_copy_is_deleted_at_once_when_asked_before_the_agent_runs(tmp_path: Path) -> None:
    written(tmp_path, copy_of("job-a", 1, b"o" * 10))
    KeptStore(tmp_path, inline, lambda *a: None).drop_now("job-a")
    KeptStore(tmp_path, inline, lambda *a: None).drop_now("../x")  # never a path: ignored
    assert list(tmp_path.iterdir()) == []
