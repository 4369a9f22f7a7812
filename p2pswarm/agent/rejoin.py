"""Finding the swarm again: fellows lost to a partition, and seeds that refuse us.

A partition longer than the tombstone time leaves each side with no trace of the other,
so gossip alone would never mend it; calling a lost address again does (like Serf's
reconnect). ``Rejoin`` remembers where each fellow declared dead was, and picks one such
address (or a seed, when this fellow is alone) to sync with now and then.

A seed that refuses our handshake before any let us in is counted: after
``JOIN_REFUSALS`` in a row the token is not the seeds' swarm, and retrying forever would
only hide it. A seed that does not answer at all may be down or may be a wrong address:
joining goes on trying, and after ``SEED_HINT_AFTER`` failed tries (then now and then)
says which address it tried and what happened, so a mistyped port does not look like a
swarm that is slow to answer.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Collection

from p2pswarm.config import DEFAULT_PORT
from p2pswarm.errors import TokenRefused

log = logging.getLogger("p2pswarm.agent")

JOIN_REFUSALS = 3  # handshakes seeds refuse, none let in, before joining gives up
SEED_HINT_AFTER = 3  # failed tries to reach a seed, before we are in, before the hint
SEED_HINT_AGAIN = frozenset({10, 30, 100, 300, 1000})  # then at these tries (not each one)


class Rejoin:
    def __init__(self, name: str, seeds: tuple[str, ...], rng: random.Random) -> None:
        self._name = name
        self._seeds = seeds
        self._rng = rng
        self._lost: dict[bytes, str] = {}  # fellows declared dead -> their last address
        self.refusals = 0  # seeds' refused handshakes in a row, before we are in
        self._unreached: dict[str, int] = {}  # seed -> failed tries, before we are in

    def lost(self, node_id: bytes, addr: str) -> None:
        """The fellow ``node_id`` was declared dead; it was last at ``addr``."""
        self._lost[node_id] = addr

    def pick(self, present: Collection[bytes]) -> str | None:
        """An address to sync with now, given the fellows ``present`` (this one among
        them): a lost fellow's that is not back, or a seed's when alone; None: none."""
        for node_id in [n for n in self._lost if n in present]:
            del self._lost[node_id]
        candidates = sorted(set(self._lost.values()))
        if len(present) <= 1:
            candidates = sorted(set(candidates) | set(self._seeds))
        if candidates:
            return self._rng.choice(candidates)
        return None

    def refused(self, addr: str, joined: bool) -> TokenRefused | None:
        """``addr`` answered our handshake with a key refusal bound to our hello (never a
        close or silence, which a busy or flooded seed gives too). A seed's, before we are
        in, counts; at ``JOIN_REFUSALS`` in a row, the failure that stops this fellow."""
        if joined or addr not in self._seeds:
            return None
        self.refusals += 1
        if self.refusals < JOIN_REFUSALS:
            log.warning("%s: the seed %s refused our handshake (%d of %d): is the join token "
                        "this swarm's?", self._name, addr, self.refusals, JOIN_REFUSALS)
            return None
        return TokenRefused(
            f"the seed {addr} refused this fellow's handshake {self.refusals} times: "
            "the join token is not its swarm's. Use the token `p2pswarm init` printed for "
            "that swarm: p2pswarm join SEED --token TOKEN")

    def unreached(self, addr: str, joined: bool, why: str) -> None:
        """A try to reach ``addr`` failed (``why``: what the transport said). A seed's,
        before we are in, counts; at ``SEED_HINT_AFTER`` tries, and now and then after,
        a warning names the address and hints that it may be wrong. Joining goes on."""
        if joined or addr not in self._seeds:
            return
        tries = self._unreached[addr] = self._unreached.get(addr, 0) + 1
        if tries == SEED_HINT_AFTER or tries in SEED_HINT_AGAIN or tries % 10_000 == 0:
            log.warning("%s: the seed %s did not answer %d tries to join (last: %s): is the "
                        "address right? Give a fellow's HOST:PORT as its `p2pswarm status` "
                        "shows it (the port is %s unless its --listen changed it); still "
                        "trying", self._name, addr, tries, why[:200], DEFAULT_PORT)

    def let_in(self) -> None:
        """A stream request went through: refusals and unanswered tries start over."""
        self.refusals = 0
        self._unreached.clear()


__all__ = ["JOIN_REFUSALS", "SEED_HINT_AFTER", "Rejoin"]
