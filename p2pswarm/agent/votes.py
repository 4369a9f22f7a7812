"""The election state a fellow keeps across restarts: its term, whom it voted for, and
the electorate (the fellows it has recently seen).

A term has at most one leader only if every fellow votes at most once in it, and that
holds across a crash only if the restarted fellow remembers its vote; and a fellow
restarted while the others are down must remember how many they were, or it is a
majority of one. So the agent keeps ``(term, voted_for, electorate)`` here and writes
it, atomically and synced to disk, before anything the new state produced leaves the
agent (a vote granted, a candidacy announced).

With no file (virtual fellows in the harness), the record lives in memory: whoever
restarts the fellow hands the same record to the new agent.

What is kept was checked: the election moves its term only by a vote request within
``MAX_TERM_STEP`` or by a proof of a majority, so a fellow holding the token cannot get a
poisoned term written here; a file edited by hand with a term past ``MAX_TERM``, a
``voted_for`` that is no fellow id or an electorate that is not a list of them is refused
with one line saying so.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from p2pswarm.election import MAX_TERM, MAX_VOTERS
from p2pswarm.errors import ConfigError
from p2pswarm.security.identity import NODE_ID_BYTES

VOTES_FILE = "election.json"


@dataclass
class VoteRecord:
    path: Path | None = None
    term: int = 0
    voted_for: bytes | None = None
    electorate: tuple[bytes, ...] = ()

    @classmethod
    def open(cls, path: Path) -> VoteRecord:
        """The record kept in ``path`` (a fresh one if there is no file yet)."""
        try:
            data = json.loads(path.read_text())
            voted = data["voted_for"]
            return cls(path, _term(data["term"]), _fellow(voted),
                       _fellows(data.get("electorate", [])))
        except FileNotFoundError:
            return cls(path)
        except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
            raise ConfigError(
                f"cannot read this fellow's election record {path} ({e}): remove it to "
                "start over, which is safe once the fellow has been down for longer than "
                "an election") from None

    def keep(self, term: int, voted_for: bytes | None, electorate: tuple[bytes, ...]) -> None:
        """Record the election's persistent state; on disk before this returns."""
        if (term, voted_for, electorate) == (self.term, self.voted_for, self.electorate):
            return
        self.term, self.voted_for, self.electorate = term, voted_for, electorate
        if self.path is None:
            return
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            json.dump({"term": term, "voted_for": None if voted_for is None
                       else voted_for.hex(), "electorate": [v.hex() for v in electorate]}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)


def _term(value: object) -> int:
    """A term as kept: a whole number the election could have reached (``MAX_TERM``), so
    a record someone wrote 2^64 - 1 into cannot stop this fellow's elections."""
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_TERM:
        raise ValueError(f"term is not a whole number from 0 to {MAX_TERM}")
    return value


def _fellow(value: object) -> bytes | None:
    if value is None:
        return None
    if not isinstance(value, str) or len(value) != 2 * NODE_ID_BYTES:
        raise ValueError("voted_for is not a fellow id")
    return bytes.fromhex(value)


def _fellows(value: object) -> tuple[bytes, ...]:
    """The electorate as kept: hex fellow ids (an older record kept only a count, which
    says nothing about whom: it restores no one, and the fellow settles as if new)."""
    if isinstance(value, int):
        return ()
    if not isinstance(value, list) or len(value) > MAX_VOTERS:
        raise ValueError("electorate is not a list of at most "
                         f"{MAX_VOTERS} fellow ids")
    ids = tuple(bytes.fromhex(v) for v in value if isinstance(v, str))
    if len(ids) != len(value) or any(len(i) != NODE_ID_BYTES for i in ids):
        raise ValueError("electorate holds something other than fellow ids")
    return ids


__all__ = ["VOTES_FILE", "VoteRecord"]
