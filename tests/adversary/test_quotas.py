"""Quotas on what other fellows can make this one store (issue 19, part 7): the weights
cache, checkpoint copies and job data stay under their caps by evicting the least
recently used, never what a live stage or job uses, and refuse what still does not fit."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from p2pswarm.agent.training.checkpoints import TrainCopies
from p2pswarm.agent.training.job_data import JobData
from p2pswarm.agent.weights import WeightsCache
from p2pswarm.config import StorageConfig, SwarmConfig, TransportConfig
from p2pswarm.disk_budget import SHARES
from p2pswarm.errors import ConfigError, PlacementError


def _put(cache: WeightsCache, data: bytes, age_s: int) -> str:
    sha = hashlib.sha256(data).hexdigest()
    writer = cache.writer(sha, len(data))
    writer.write(data)
    assert writer.commit()
    os.utime(cache.path(sha), (1_000_000 + age_s, 1_000_000 + age_s))
    return sha


def test_the_weights_cache_evicts_the_least_recently_used(tmp_path: Path) -> None:
    live: set[str] = set()
    cache = WeightsCache(tmp_path / "w", cap_bytes=100, in_use=lambda: live)
    a = _put(cache, b"a" * 40, 1)
    b = _put(cache, b"b" * 40, 2)
    live.add(a)  # a live stage reads a: it stays although it is the oldest
    c = _put(cache, b"c" * 40, 3)
    assert cache.held() == sorted([a, c])
    assert cache.evicted == 1 and not cache.has(b, 40)
    os.utime(cache.path(c), (1_000_000, 1_000_000))
    assert cache.has(c, 40)  # asking marks it used: now the newest
    live.clear()
    d = _put(cache, b"d" * 40, 4)
    assert cache.held() == sorted([c, d])


def test_the_weights_cache_refuses_what_cannot_fit(tmp_path: Path) -> None:
    live: set[str] = set()
    cache = WeightsCache(tmp_path / "w", cap_bytes=100, in_use=lambda: live)
    live.add(_put(cache, b"a" * 60, 1))
    with pytest.raises(PlacementError, match="storage.weights_cache_bytes"):
        cache.writer(hashlib.sha256(b"x" * 50).hexdigest(), 50)
    with pytest.raises(PlacementError, match="over the 100 bytes"):
        cache.writer(hashlib.sha256(b"x" * 101).hexdigest(), 101)
    assert [p.name for p in (tmp_path / "w").rglob(".part-*")] == []


def _agent(tmp_path: Path, **storage: Any) -> Any:
    config = SwarmConfig(storage=StorageConfig(**storage),
                         transport=TransportConfig(max_job_data_bytes=100))
    def state_dir(name: str) -> Path:
        (tmp_path / name).mkdir(exist_ok=True)
        return tmp_path / name

    return SimpleNamespace(home=tmp_path, config=config, on_stream=lambda *a: None,
                           name="holder", state_dir=state_dir)


def _step(copies: TrainCopies, job: str, step: int, nbytes: int, age_s: int) -> Path:
    directory = copies.step_dir(job, step)
    directory.mkdir(parents=True)
    (directory / "a.stage-0.pt").write_bytes(b"x" * nbytes)
    (directory / "manifest.json").write_bytes(b"{}")
    for f in directory.iterdir():
        os.utime(f, (1_000_000 + age_s, 1_000_000 + age_s))
    return directory


def test_checkpoint_copies_stay_under_their_cap(tmp_path: Path) -> None:
    copies = TrainCopies(_agent(tmp_path, checkpoint_copies_bytes=300),
                         SimpleNamespace())  # type: ignore[arg-type]
    old_other = _step(copies, "job-00000001", 1, 98, 1)
    newest_mine = _step(copies, "job-00000002", 4, 98, 2)
    newer_other = _step(copies, "job-00000001", 2, 98, 3)
    copies.make_room("job-00000002", 5, 100)
    assert not old_other.exists() and newest_mine.exists() and newer_other.exists()
    # the step being written and its job's newest whole step are never dropped
    with pytest.raises(ConfigError, match="storage.checkpoint_copies_bytes"):
        copies.make_room("job-00000002", 5, 250)
    assert newest_mine.exists()


def test_job_data_never_evicts_what_a_live_job_uses(tmp_path: Path) -> None:
    live: set[str] = set()
    data = JobData(_agent(tmp_path), lambda: live)
    names = []
    for i, byte in enumerate(b"ab"):
        body = bytes([byte]) * 45
        sha = hashlib.sha256(body).hexdigest()
        data.path(sha).write_bytes(body)
        os.utime(data.path(sha), (1_000_000 + i, 1_000_000 + i))
        names.append(sha)
    live.add(names[0])
    data._make_room(40)
    assert data.has(names[0]) and not data.has(names[1])
    with pytest.raises(ConfigError, match="max_job_data_bytes"):
        data._make_room(60)


def test_the_storage_defaults_are_documented() -> None:
    text = (Path(__file__).parents[2] / "docs" / "security.md").read_text()
    for share in SHARES:
        assert f"storage.{share.config_field}" in text
        assert f"`HOME/{share.store}`" in text
        assert f"{round(share.fraction * 100)} % of its disk" in text
        assert f"{share.ceiling_bytes >> 30} GiB" in text
