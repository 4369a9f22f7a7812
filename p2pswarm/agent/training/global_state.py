"""A replica put on the keepers' global state: every stage takes its keeper's global
parameters and version, the tied head the synced embedding, and the local steps it took
since its last delta are forgotten (its data goes back to where they began).

The rounds keeper does this when a replica is too far behind to catch up or rejoins; the
checkpoint keeper when a resumed checkpoint says a replica stood in on the global state;
a new leader when it resumes a job's rounds from a copy."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import trio

from p2pswarm.agent.training.jobs import model_source
from p2pswarm.errors import SwarmError
from p2pswarm.wire.training import Ack, Reset, Tied, TiedAsk, TiedWeight

if TYPE_CHECKING:
    from p2pswarm.agent.training.ports import DriverPort
    from p2pswarm.agent.training.replica import Replica

log = logging.getLogger("p2pswarm.training")


class GlobalState:
    """Puts a driver's replicas on its keepers' global state."""

    def __init__(self, driver: DriverPort) -> None:
        self._driver = driver

    async def send(self, r: Replica) -> None:
        """Every stage of replica ``r`` takes its keeper's global parameters and version."""
        driver = self._driver
        for link, keeper in zip(r.links, driver.keepers):
            version, params, nbytes = keeper.join_state(r.name)
            await link.ask(Reset(version, params), Ack)
            driver.job.bytes_sent += nbytes

    async def put(self, r: Replica) -> bool:
        """Bring replica ``r`` to the keepers' global state: every stage takes its
        keeper's global parameters and version, the tied head the synced embedding, and
        the replica stands at that version with nothing unsent. False (the replica
        paused) when a stage fails or falls silent."""
        driver = self._driver
        try:
            with trio.fail_after(driver.training.timings.step_timeout_s):
                await self.send(r)
                await self.copy_tied(r)
        except (SwarmError, trio.TooSlowError) as exc:
            await driver.pause(r, exc)
            return False
        r.version = r.rounds_done = driver.keepers[0].version
        self.forget_local_steps(r)
        return True

    def forget_local_steps(self, r: Replica) -> None:
        """Replica ``r``'s stages took the global parameters: the local steps it took
        since its last delta (and a step cut short by a lost fellow) are gone, so its
        data goes back to where they began and those samples are trained again, not
        skipped (a replica that lost a fellow skipped up to a round of its data at
        every rejoin), nor counted in the job's length."""
        if r.data is not None:
            r.stream.position = r.kept_position
        job = self._driver.job
        job.samples = max(0, job.samples - r.samples_unsent)
        r.samples_unsent = r.steps_unsent = 0

    async def copy_tied(self, r: Replica) -> None:
        """The last stage's tied head takes the first stage's synced embedding."""
        if len(r.links) < 2 or not _tied(self._driver):
            return
        first, last = r.links[0], r.links[-1]
        weight = (await first.ask(TiedAsk(), Tied)).blob
        await last.ask(TiedWeight(weight), Ack)


def _tied(driver: DriverPort) -> bool:
    """Whether the job's model ties its head to its embedding (and trains them whole)."""
    cfg = driver.cfg
    model = model_source(cfg).config
    return bool(model.get("tie_word_embeddings")) and cfg.lora is None


__all__ = ["GlobalState"]
