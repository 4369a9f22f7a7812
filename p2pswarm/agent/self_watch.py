"""The agent watches itself: its own loop's lag, and what each fellow makes it hold.

Theory of operation. A small task sleeps ``loop_watch_interval_s`` at a time and compares
when it woke with when it asked to: the difference is how long the loop was busy with
something else (a decode, a plan, a signature check), the lag every timer of the agent
suffers. The last lag, the most in the last minute and since start, and how often it
passed the warning level are kept; a lag past the warning level is logged (once a minute
at most), naming the fellow whose messages cost the loop most lately, if one did.

What a fellow makes this agent hold is, as far as the agent sees it, the streams it keeps
open here and the bytes those streams hold in frames not yet complete (``Links`` says;
the transport knows its buffers). Each watch tick looks at it: a fellow past
``HELD_BUDGET_BYTES`` is logged, and so is a message whose decode alone held the loop
longer than ``MESSAGE_BUDGET_S`` (``charge``). Both show in ``status --json`` under
``self_watch`` and in the status table.

Virtual worlds (MemoryNetwork under a MockClock) do not run the task: virtual time has no
lag, and a ticking task would only add events to every simulation.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypedDict

import trio

log = logging.getLogger("p2pswarm.agent")

HELD_BUDGET_BYTES = 64 * 1024 * 1024  # what one fellow may make this agent hold
MESSAGE_BUDGET_S = 0.05  # the loop time one message may cost
WINDOW_S = 60.0  # "lately": the recent maximum covers this long
LOG_EVERY_S = 60.0  # the same complaint is logged at most this often


@dataclass(frozen=True, slots=True)
class Held:
    """What one fellow makes this agent hold now."""

    streams: int
    bytes: int


class HeldDoc(TypedDict):
    name: str
    streams: int
    bytes: int


class SelfWatchDoc(TypedDict):
    """``status``'s ``self_watch``: loop lag in ms, and what fellows make this agent hold."""

    loop_lag_ms: float
    loop_lag_recent_max_ms: float
    loop_lag_max_ms: float
    loop_lag_over_warn: int
    ticks: int
    held_bytes: int
    held_by_fellow: dict[str, HeldDoc]  # by fellow id (hex)
    over_budget: dict[str, int]  # what: times a fellow's messages cost past their budget


HeldSource = Callable[[], Mapping[bytes, Held]]
NameOf = Callable[[bytes], str]


class SelfWatch:
    def __init__(self, name: str, interval_s: float, warn_s: float) -> None:
        self.name = name
        self.interval_s = interval_s
        self.warn_s = warn_s
        self.last_s = 0.0
        self.max_s = 0.0
        self.over_warn = 0
        self.ticks = 0
        self._recent: list[tuple[float, float]] = []  # (when, lag), the last WINDOW_S
        self._held: HeldSource = dict
        self._name_of: NameOf = lambda fellow: fellow.hex()[:8]
        self.over_budget: Counter[str] = Counter()
        self._cost_s: dict[bytes, float] = {}  # loop time fellows' messages cost lately
        self._logged: dict[str, float] = {}

    def watch(self, held: HeldSource, name_of: NameOf) -> None:
        """Where what fellows make this agent hold is read, and how fellows are named."""
        self._held = held
        self._name_of = name_of

    async def run(self) -> None:
        """Tick forever: each tick notes how late it woke and looks at what is held."""
        while True:
            expected = trio.current_time() + self.interval_s
            await trio.sleep(self.interval_s)
            now = trio.current_time()
            self.note(max(0.0, now - expected), now)
            self.check_held(now)

    def note(self, lag_s: float, now: float) -> None:
        self.ticks += 1
        self.last_s = lag_s
        self.max_s = max(self.max_s, lag_s)
        self._recent = [(t, x) for t, x in self._recent if now - t <= WINDOW_S]
        self._recent.append((now, lag_s))
        if lag_s > self.warn_s:
            self.over_warn += 1
            costly = max(self._cost_s.items(), key=lambda kv: kv[1], default=None)
            blamed = (f"; lately {self._name_of(costly[0])}'s messages cost it most "
                      f"({costly[1] * 1000:.0f} ms)") if costly else ""
            self._log("lag", now, "%s: the agent's loop woke %.0f ms late (over %.0f ms)%s",
                      self.name, lag_s * 1000, self.warn_s * 1000, blamed)
        if not self.ticks % max(1, round(WINDOW_S / max(self.interval_s, 1e-3))):
            self._cost_s.clear()  # "lately" starts again each window

    def charge(self, fellow: bytes, what: str, cost_s: float, now: float) -> None:
        """A message of ``fellow`` (``what``) held the loop ``cost_s``: past
        ``MESSAGE_BUDGET_S`` it is logged and counted."""
        self._cost_s[fellow] = self._cost_s.get(fellow, 0.0) + cost_s
        if cost_s > MESSAGE_BUDGET_S:
            self.over_budget[what] += 1
            self._log(f"cost-{fellow.hex()}", now, "%s: a %s from %s held the loop %.0f ms, "
                      "over the %.0f ms a message may cost", self.name, what,
                      self._name_of(fellow), cost_s * 1000, MESSAGE_BUDGET_S * 1000)

    def check_held(self, now: float) -> None:
        for fellow, held in self._held().items():
            if held.bytes > HELD_BUDGET_BYTES:
                self.over_budget["held-bytes"] += 1
                self._log(f"held-{fellow.hex()}", now, "%s: %s makes this agent hold %.1f "
                          "MiB in %d streams, over its %.0f MiB budget", self.name,
                          self._name_of(fellow), held.bytes / 2**20, held.streams,
                          HELD_BUDGET_BYTES / 2**20)

    def _log(self, key: str, now: float, message: str, *args: object) -> None:
        if now - self._logged.get(key, -math.inf) >= LOG_EVERY_S:
            self._logged[key] = now
            log.warning(message, *args)

    def to_doc(self) -> SelfWatchDoc:
        held = self._held()
        return {
            "loop_lag_ms": round(self.last_s * 1000, 1),
            "loop_lag_recent_max_ms": round(max((x for _, x in self._recent), default=0.0)
                                            * 1000, 1),
            "loop_lag_max_ms": round(self.max_s * 1000, 1),
            "loop_lag_over_warn": self.over_warn,
            "ticks": self.ticks,
            "held_bytes": sum(h.bytes for h in held.values()),
            "held_by_fellow": {fellow.hex(): HeldDoc(name=self._name_of(fellow),
                                                     streams=h.streams, bytes=h.bytes)
                               for fellow, h in sorted(held.items())},
            "over_budget": dict(sorted(self.over_budget.items())),
        }


__all__ = ["HELD_BUDGET_BYTES", "MESSAGE_BUDGET_S", "Held", "HeldDoc", "SelfWatch",
           "SelfWatchDoc"]
