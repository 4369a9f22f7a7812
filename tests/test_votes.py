"""The election record a fellow keeps on disk across restarts."""

from __future__ import annotations

import pytest

from p2pswarm.agent.votes import VoteRecord
from p2pswarm.errors import ConfigError


def test_a_vote_kept_on_disk_is_read_back(tmp_path) -> None:
    path = tmp_path / "election.json"
    assert VoteRecord.open(path) == VoteRecord(path)  # no file yet: term 0, no vote
    record = VoteRecord.open(path)
    record.keep(7, b"\x01" * 32, 5)
    assert VoteRecord.open(path) == VoteRecord(path, 7, b"\x01" * 32, 5)
    record.keep(8, None, 5)  # a later term, no vote in it yet
    assert VoteRecord.open(path) == VoteRecord(path, 8, None, 5)
    assert not path.with_suffix(".tmp").exists()


def test_an_unreadable_record_says_how_to_start_over(tmp_path) -> None:
    path = tmp_path / "election.json"
    path.write_text("{ half written")
    with pytest.raises(ConfigError, match="remove it to start over"):
        VoteRecord.open(path)
