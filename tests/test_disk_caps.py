"""Disk caps: each store a fellow keeps is capped by a share of its disk (faked
``disk_usage``), a tiny configured cap refuses checkpoint copies with one line while the
job goes on and keeps its own checkpoints, and status shows the stores against caps."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import pytest
import trio

from p2pswarm.cli.swarm import disks_line
from p2pswarm.config import StorageConfig
from p2pswarm.disk_budget import (
    DiskUsage,
    cap_bytes,
    default_caps,
    disk_bytes,
    store_uses,
)
from p2pswarm.training.checkpoint import CheckpointStore
from tests.test_agent_checkpoints import SMALL
from tests.training_swarm import disks_under, finished, job_config, leader_and_asker, start_swarm

SD_CARD = 32_000_000_000  # a "32 GB" card as sold


def sd_card(path: str) -> DiskUsage:
    # a card's filesystem: a little less than sold, 5 % reserved for root
    return DiskUsage(total=SD_CARD, used=8_000_000_000, free=SD_CARD - 8_000_000_000
                     - SD_CARD // 20)


def test_the_default_caps_on_a_32_gb_volume_are_shares_of_it(tmp_path: Path) -> None:
    size = disk_bytes(tmp_path, sd_card)
    assert size == SD_CARD - SD_CARD // 20  # used + free: root's reserve left out
    storage = StorageConfig()
    caps = {store: cap_bytes(store, tmp_path / store, storage, sd_card)
            for store in ("weights", "checkpoint-copies", "job-checkpoints", "job-data")}
    assert caps == default_caps(size)
    assert caps["weights"] == int(size * 0.35) < 64 << 30
    assert caps["checkpoint-copies"] == int(size * 0.15)
    assert caps["job-checkpoints"] == caps["job-data"] == int(size * 0.10)
    assert sum(caps.values()) < 0.75 * size  # room left for the OS and everything else
    # a big disk: each at most the old fixed default
    assert default_caps(4 << 40) == {"weights": 64 << 30, "checkpoint-copies": 64 << 30,
                                     "job-checkpoints": 64 << 30, "job-data": 4 << 30}


def test_a_configured_cap_wins_but_never_passes_the_disk(tmp_path: Path) -> None:
    size = disk_bytes(tmp_path, sd_card)
    assert size is not None
    small = StorageConfig(weights_cache_bytes=1000)
    assert cap_bytes("weights", tmp_path, small, sd_card) == 1000
    huge = StorageConfig(weights_cache_bytes=1 << 50)
    assert cap_bytes("weights", tmp_path, huge, sd_card) == size

    def unreadable(path: str) -> DiskUsage:
        raise OSError("no such filesystem")

    # nothing readable: the old fixed default, never an error
    assert cap_bytes("weights", tmp_path, StorageConfig(), unreadable) == 64 << 30
    seen: list[str] = []

    def only_root(path: str) -> DiskUsage:
        seen.append(path)
        if path != "/":
            raise FileNotFoundError(path)
        return sd_card(path)

    # a store not made yet: the disk its nearest existing parent is on
    assert disk_bytes(Path("/no/such/dir"), only_root) == size
    assert seen[-1] == "/"


def test_status_shows_each_store_against_its_cap(tmp_path: Path) -> None:
    (tmp_path / "weights" / "ab").mkdir(parents=True)
    (tmp_path / "weights" / "ab" / "x").write_bytes(b"w" * 300)
    (tmp_path / "job-checkpoints").mkdir()
    (tmp_path / "job-checkpoints" / "m").write_bytes(b"c" * 50)
    uses = {u.store: u for u in store_uses(tmp_path, StorageConfig(), sd_card)}
    assert uses["weights"].used_bytes == 300
    assert uses["weights"].cap_bytes == default_caps(disk_bytes(tmp_path, sd_card) or 0)[
        "weights"]
    assert uses["checkpoint-copies"].used_bytes == 0  # not made yet: nothing used
    assert uses["job-checkpoints"].used_bytes == 50
    assert uses["loads"].cap_bytes is None  # bounded by count
    line = disks_line([u.to_dict() for u in uses.values()])
    assert line.startswith("disk: weights 0.00/10.6 GB, checkpoint-copies 0.00/4.6 GB, "
                           "job-checkpoints 0.00/3.0 GB, job-data 0.00/3.0 GB")
    assert "loads 0.00 GB" in line
    assert disks_line([]) == "" and disks_line(None) == ""


@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
async def test_a_full_copy_store_refuses_the_copy_and_the_job_goes_on(
        autojump_clock, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "p2pswarm.training")
    config = job_config(model={"config": SMALL}, steps=4, checkpoint={
        "dir": str(tmp_path / "ckpt"), "interval_steps": 2, "copies": 1, "keep": 2})
    async with trio.open_nursery() as nursery:
        swarm = await start_swarm(nursery, n=3)
        disks_under(swarm, tmp_path / "copies")
        for agent in swarm.live():  # room for no shard at all
            storage = replace(agent.config.storage, checkpoint_copies_bytes=1000)
            agent.world = replace(agent.world, config=replace(agent.config, storage=storage))
        leader, asker = leader_and_asker(swarm)
        record = await asker.training.submit(config, stages=1)
        record = await finished(asker, record["job_id"])
        assert record["state"] == "finished", record["reason"]
        assert record["checkpoint_copies"] and not any(record["checkpoint_copies"].values())
        # the leader's own checkpoints are all there, whole
        store = CheckpointStore(Path(record["checkpoint_dir"]))
        assert store.steps() == [2, 4] and store.latest() == 4
        refused = sum(a.counters.to_dict()["refused"].get("checkpoint-copies-full", 0)
                      for a in swarm.live())
        assert refused >= 2  # one a checkpoint
        lines = [r.getMessage() for r in caplog.records if "refused shard" in r.getMessage()]
        assert lines and all("no room for checkpoint copies" in m for m in lines)
        assert all("\n" not in m for m in lines)
        assert leader.training.copies.full_at  # passed over next time while others have room
        assert not list((tmp_path / "copies").rglob("*.pt"))
        nursery.cancel_scope.cancel()


def test_a_kept_run_says_what_it_leaves(tmp_path: Path) -> None:
    from p2pswarm.sim.processes import kept_lines

    (tmp_path / "f0" / "checkpoint-copies" / "j").mkdir(parents=True)
    (tmp_path / "f0" / "checkpoint-copies" / "j" / "s.pt").write_bytes(b"x" * 2_000_000)
    (tmp_path / "f0" / "weights").mkdir()
    (tmp_path / "f0" / "weights" / "t").write_bytes(b"w" * 1_000_000)
    (tmp_path / "f0.log").write_bytes(b"l" * 500_000)
    lines = kept_lines(tmp_path)
    assert lines == [f"state and logs kept in {tmp_path}: 3.5 MB in all",
                     "  f0: 3.0 MB (checkpoint-copies 2.0 MB, weights 1.0 MB)",
                     "  logs (*.log): 0.5 MB"]


def test_a_killed_agents_unfinished_writes_are_swept_at_start(tmp_path: Path) -> None:
    import os

    from p2pswarm.disk_budget import sweep_leftovers

    old = [tmp_path / "job-copies" / ".job-1.outer.tmp-4242",
           tmp_path / "weights" / "ab" / ".part-x1y2",
           tmp_path / "checkpoint-copies" / "job-1" / "step-00000002" / ".a.pt.77-7f.tmp",
           tmp_path / "checkpoint-copies" / ".incoming" / "job-1" / "r.stage-0.pt"]
    kept = [tmp_path / "job-copies" / "job-1.outer",
            tmp_path / "weights" / "ab" / ("ab" + "0" * 62),
            tmp_path / "checkpoint-copies" / "job-1" / "step-00000002" / "manifest.json"]
    for path in old + kept:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x" * 10)
        os.utime(path, (1_000_000, 1_000_000))
    mine = tmp_path / "job-copies" / ".job-2.outer.tmp-99"  # this agent's, written since
    mine.write_bytes(b"y")
    assert sweep_leftovers(tmp_path, before_s=2_000_000) == (4, 40)
    assert not any(p.exists() for p in old)
    assert all(p.exists() for p in kept)
    os.utime(mine, (3_000_000, 3_000_000))
    assert sweep_leftovers(tmp_path, before_s=2_000_000) == (0, 0) and mine.exists()


def test_a_leaders_own_checkpoints_drop_other_jobs_past_their_cap(tmp_path: Path) -> None:
    import os

    from p2pswarm.agent.training.checkpoints import trim_other_jobs

    root = tmp_path / "job-checkpoints"

    def step(job: str, n: int, nbytes: int, age_s: int) -> Path:
        d = root / job / f"step-{n:08d}"
        d.mkdir(parents=True)
        (d / "s.pt").write_bytes(b"x" * nbytes)
        os.utime(d / "s.pt", (1_000_000 + age_s, 1_000_000 + age_s))
        return d

    ended = [step("job-a", 1, 100, 1), step("job-a", 2, 100, 2)]
    other = step("job-b", 7, 100, 3)
    live = [step("job-c", 4, 300, 0), step("job-c", 5, 300, 4)]  # oldest of all, yet kept
    (root / "job-a" / "LATEST").write_bytes(b"step-00000002")
    assert trim_other_jobs(root, root / "job-c", cap=700) == [
        "job-a/step-00000001", "job-a/step-00000002"]
    assert not any(d.exists() for d in ended) and other.exists()
    assert not (root / "job-a").exists()  # the job went with its last step
    assert all(d.exists() for d in live)
    # the live job alone over the cap: all its steps kept, every other job's dropped
    assert trim_other_jobs(root, root / "job-c", cap=100) == ["job-b/step-00000007"]
    assert all(d.exists() for d in live)
