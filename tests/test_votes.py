"""The election record a fellow keeps on disk across restarts."""

from __future__ import annotations

import pytest

from p2pswarm.agent.votes import VoteRecord
from p2pswarm.errors import ConfigError


def test_a_vote_kept_on_disk_is_read_back(tmp_path) -> None:
    path = tmp_path / "election.json"
    assert VoteRecord.open(path) == VoteRecord(path)  # no file yet: term 0, no vote
    record = VoteRecord.open(path)
    fellows = (b"\x02" * 16, b"\x03" * 16)
    record.keep(7, b"\x01" * 16, fellows)
    assert VoteRecord.open(path) == VoteRecord(path, 7, b"\x01" * 16, fellows)
    record.keep(8, None, fellows)  # a later term, no vote in it yet
    assert VoteRecord.open(path) == VoteRecord(path, 8, None, fellows)
    assert not path.with_suffix(".tmp").exists()


def test_an_unreadable_record_says_how_to_start_over(tmp_path) -> None:
    path = tmp_path / "election.json"
    path.write_text("{ half written")
    with pytest.raises(ConfigError, match="remove it to start over"):
        VoteRecord.open(path)


def test_an_older_record_with_a_count_restores_no_one(tmp_path) -> None:
    path = tmp_path / "election.json"
    path.write_text('{"term": 3, "voted_for": null, "electorate": 4}')
    assert VoteRecord.open(path) == VoteRecord(path, 3, None, ())


@pytest.mark.parametrize("electorate", ['["zz"]', '["0102"]', '"abc"', '[1, 2]'])
def test_a_record_with_bad_fellow_ids_is_refused(tmp_path, electorate) -> None:
    path = tmp_path / "election.json"
    path.write_text(f'{{"term": 3, "voted_for": null, "electorate": {electorate}}}')
    with pytest.raises(ConfigError, match="remove it to start over"):
        VoteRecord.open(path)


@pytest.mark.parametrize("term", ["18446744073709551615", str(2**62 + 1), "-1", "true", "3.5",
                                  '"7"'])
def test_a_poisoned_term_is_refused(tmp_path, term) -> None:
    path = tmp_path / "election.json"
    path.write_text(f'{{"term": {term}, "voted_for": null, "electorate": []}}')
    with pytest.raises(ConfigError, match="remove it to start over"):
        VoteRecord.open(path)


@pytest.mark.parametrize("voted", ['"01"', '"' + "ab" * 32 + '"', "7", '"zz' + "0" * 30 + '"'])
def test_a_vote_for_no_fellow_id_is_refused(tmp_path, voted) -> None:
    path = tmp_path / "election.json"
    path.write_text(f'{{"term": 3, "voted_for": {voted}, "electorate": []}}')
    with pytest.raises(ConfigError, match="remove it to start over"):
        VoteRecord.open(path)


def test_a_deeply_nested_record_is_one_line_not_a_traceback(tmp_path) -> None:
    path = tmp_path / "election.json"
    path.write_text('{"term": 3, "voted_for": null, "electorate": ' + "[" * 100_000
                    + "]" * 100_000 + "}")
    with pytest.raises(ConfigError, match="remove it to start over"):
        VoteRecord.open(path)
