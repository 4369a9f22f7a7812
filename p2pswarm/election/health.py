"""Health: whether this fellow's leader is alive and reachable, as this fellow sees it.

A deputy hears the leader's beats and misses them after the election timeout (plus its
rank times a spacing); a voter asked for a PreVote while it still sees the leader checks
it (``LeaderCheck``) before it believes the candidate. Both waits stretch with local
health (Lifeguard's, for the election): a fellow whose CPU is starved wakes late, its
timers ringing while the leader's beats still wait in its socket, so it waits longer by
``lag_stretch_mult`` times the larger of its own recent lateness and how late its
leader's beats have come beyond one lost beat, at most ``lag_stretch_max_s``, fading
with ``lag_half_life_s``. In virtual time timers ring on time: 0."""

from __future__ import annotations

from p2pswarm.config import ElectionConfig
from p2pswarm.election.constants import INF
from p2pswarm.wire.gossip import VoteRequest

# requests for a vote waiting on a check of the leader: (from address, request)
Waiting = list[tuple[str, VoteRequest]]


class Health:
    """The leader's beats as a deputy hears them, the voter's checks of the leader, and
    how late this fellow's own loop and its leader's beats run."""

    def __init__(self, config: ElectionConfig, check_seq: int) -> None:
        self.config = config
        self.last_beat_at = -INF  # as a deputy
        self.last_beat_term = -1  # ... the term of that beat
        # each as (level in seconds, when noted): how late this fellow's own loop ran
        # lately, and how late its leader's beats came in past one lost beat
        self._own_lag = (0.0, -INF)
        self._beat_lag = (0.0, -INF)
        self.rank = -1  # our place in the succession, from the leader's beats
        self.deputy_term = -1  # the term we are a deputy in (-1: none)
        self.beats_lost = False  # a deputy that missed the leader's beats
        # voter's checks of the leader: seq -> (deadline, waiting requests)
        self.checks: dict[int, tuple[float, Waiting]] = {}
        self.check_seq = check_seq
        self.check_result: tuple[float, bool] = (-INF, False)  # (when, leader answered)

    # --- beats ---------------------------------------------------------------------------

    def note_beat(self, term: int, rank: int, now: float) -> None:
        """A beat of the leader we follow in ``term``, ranking us ``rank``."""
        if self.last_beat_term == term:  # a beat late past one lost beat: the
            # leader (or this fellow) is starved, not gone; wait longer for a while
            late = now - self.last_beat_at - 2 * self.config.heartbeat_interval_s
            self._beat_lag = self._raised(self._beat_lag, late, now)
        self.last_beat_at, self.last_beat_term = now, term
        self.rank = rank
        self.deputy_term = term

    def beat_timeout_at(self) -> float:
        return (self.last_beat_at + self.config.election_timeout_min_s
                + max(0, self.rank) * self.config.tuning.rank_spacing_s + self.stretch())

    def beats(self, term: int, now: float) -> bool:
        """Whether, a deputy in ``term``, we heard the leader beat within the timeout."""
        return self.deputy_term == term and \
            now - self.last_beat_at < self.config.election_timeout_min_s + self.stretch()

    # --- checks of the leader ------------------------------------------------------------

    def join_check(self, addr: str, msg: VoteRequest) -> bool:
        """Wait on the check under way, if one is: True."""
        for _, waiting in self.checks.values():
            waiting.append((addr, msg))
            return True
        return False

    def open_check(self, addr: str, msg: VoteRequest, now: float) -> int:
        """A new check of the leader with ``msg`` waiting on it: its sequence number."""
        self.check_seq = (self.check_seq + 1) % 2**32
        self.checks[self.check_seq] = (
            now + self.config.tuning.check_timeout_s + self.stretch(), [(addr, msg)])
        return self.check_seq

    def checking(self, candidate: bytes) -> bool:
        """Whether ``candidate``'s request waits on a check (its answer is on the way)."""
        for _, waiting in self.checks.values():
            if any(req.candidate == candidate for _, req in waiting):
                return True
        return False

    def next_check_at(self, t: float) -> float:
        """The earlier of ``t`` and the next check's deadline."""
        for deadline, _ in self.checks.values():
            t = min(t, deadline)
        return t

    def lapsed(self, now: float) -> list[Waiting]:
        """The checks the leader did not answer by ``now``, taken out."""
        out = []
        for seq in [s for s, (d, _) in self.checks.items() if d <= now]:
            _, waiting = self.checks.pop(seq)
            self.check_result = (now, False)
            out.append(waiting)
        return out

    def answered(self, seq: int, now: float) -> Waiting:
        """The leader answered check ``seq``: the requests that waited on it."""
        _, waiting = self.checks.pop(seq)
        self.check_result = (now, True)
        return waiting

    # --- local health --------------------------------------------------------------------

    def note_lag(self, lag_s: float, now: float) -> None:
        """This fellow's own loop woke ``lag_s`` late at ``now``."""
        self._own_lag = self._raised(self._own_lag, lag_s, now)

    def stretch(self) -> float:
        """How much longer than configured to wait for the leader's beats and answers:
        the lag mult times the larger of our own loop's recent lag and our leader's
        beats' recent lateness, at most ``lag_stretch_max_s``."""
        lag = max(self._own_lag[0], self._beat_lag[0])
        return min(self.config.tuning.lag_stretch_max_s,
                   self.config.tuning.lag_stretch_mult * lag)

    def _raised(self, level: tuple[float, float], lag_s: float,
                now: float) -> tuple[float, float]:
        """``level`` decayed to ``now`` (halved every ``lag_half_life_s``), raised to
        ``lag_s`` if that is more."""
        held, at = level
        if held > 0.0 and now > at:
            held *= 0.5 ** ((now - at) / self.config.tuning.lag_half_life_s)
        if held < 1e-3:
            held = 0.0
        lag = lag_s if 0.0 < lag_s < INF else 0.0  # (a NaN or negative lag is none)
        return (max(held, lag), now)


__all__ = ["Health", "Waiting"]
