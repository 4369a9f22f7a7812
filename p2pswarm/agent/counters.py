"""Traffic counters: what came in, what went out, and what was dropped and why."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from p2pswarm.agent.status_doc import CountersDoc


class Counters:
    def __init__(self) -> None:
        self.datagrams_in = 0
        self.datagrams_out = 0
        self.bytes_in = 0
        self.bytes_out = 0
        self.streams_in = 0
        self.streams_out = 0
        self.frames_in = 0
        self.frames_out = 0
        self.drops: Counter[str] = Counter()  # reason -> count
        self.refused: Counter[str] = Counter()  # well-formed but not obeyed: reason -> count

    def drop(self, reason: str) -> None:
        self.drops[reason] += 1

    def refuse(self, reason: str) -> None:
        self.refused[reason] += 1

    def to_dict(self, election_refused: Mapping[str, int] | None = None) -> CountersDoc:
        """The counters as ``status`` shows them; ``election_refused``: what the election
        refused, shown among ``refused`` as ``election-REASON``."""
        refused = dict(self.refused)
        for reason, n in (election_refused or {}).items():
            refused[f"election-{reason}"] = n
        return {
            "datagrams_in": self.datagrams_in, "datagrams_out": self.datagrams_out,
            "bytes_in": self.bytes_in, "bytes_out": self.bytes_out,
            "streams_in": self.streams_in, "streams_out": self.streams_out,
            "frames_in": self.frames_in, "frames_out": self.frames_out,
            "drops": dict(sorted(self.drops.items())),
            "refused": dict(sorted(refused.items())),
        }
