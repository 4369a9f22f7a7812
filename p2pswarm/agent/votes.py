"""The election state a fellow keeps across restarts: its term, whom it voted for, and
the electorate its leader last announced.

A term has at most one leader only if every fellow votes at most once in it, and that
holds across a crash only if the restarted fellow remembers its vote; and a fellow
restarted while the others are down must remember how many they were, or it is a
majority of one. So the agent keeps ``(term, voted_for, electorate)`` here and writes
it, atomically and synced to disk, before anything the new state produced leaves the
agent (a vote granted, a candidacy announced).

With no file (virtual fellows in the harness), the record lives in memory: whoever
restarts the fellow hands the same record to the new agent.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from p2pswarm.errors import ConfigError

VOTES_FILE = "election.json"


@dataclass
class VoteRecord:
    path: Path | None = None
    term: int = 0
    voted_for: bytes | None = None
    electorate: int = 0

    @classmethod
    def open(cls, path: Path) -> VoteRecord:
        """The record kept in ``path`` (a fresh one if there is no file yet)."""
        try:
            data = json.loads(path.read_text())
            voted = data["voted_for"]
            return cls(path, int(data["term"]), None if voted is None else bytes.fromhex(voted),
                       int(data.get("electorate", 0)))
        except FileNotFoundError:
            return cls(path)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConfigError(
                f"cannot read this fellow's election record {path} ({e}): remove it to "
                "start over, which is safe once the fellow has been down for longer than "
                "an election") from None

    def keep(self, term: int, voted_for: bytes | None, electorate: int) -> None:
        """Record the election's persistent state; on disk before this returns."""
        if (term, voted_for, electorate) == (self.term, self.voted_for, self.electorate):
            return
        self.term, self.voted_for, self.electorate = term, voted_for, electorate
        if self.path is None:
            return
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            json.dump({"term": term, "voted_for": None if voted_for is None
                       else voted_for.hex(), "electorate": electorate}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)


__all__ = ["VOTES_FILE", "VoteRecord"]
