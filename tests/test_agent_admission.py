"""Admission at join, agents in virtual time: a joiner with an invitation gets its
certificate from the admin's fellow over a sealed stream; an invitation of 2 uses admits 2
identities, the third is refused by the issuer; a revoked fellow's agent stops."""

from __future__ import annotations

import random

import pytest
import trio

from p2pswarm.agent import Agent
from p2pswarm.agent.admission import AdmissionSetup
from p2pswarm.agent.world import AgentWorld
from p2pswarm.config import local
from p2pswarm.errors import TokenRefused
from p2pswarm.security import Identity, Keyring
from p2pswarm.sim.virtual import CERTIFIED_UNTIL_S, VirtualSwarm, wait_until


def joiner(swarm: VirtualSwarm, k: int, invitation: bytes) -> Agent:
    addr = f"10.0.8.{k}:7946"
    swarm.net.up(addr)
    assert swarm.admin is not None
    return Agent(AgentWorld(
        name=f"new{k}", transport=swarm.net.transport(addr), keyring=Keyring([swarm.secret]),
        identity=Identity.from_private_bytes(bytes([k]) * 32), config=local(), epoch=1,
        rng=random.Random(k), seeds=(swarm.fellows[0].addr,),
        admission=AdmissionSetup(swarm.admin.public_key, invitation=invitation)))


def names(agent: Agent) -> set[str]:
    return {m.name for m in agent.members() if m.present}


async def test_an_invitation_admits_its_uses_and_no_more(autojump_clock) -> None:
    swarm = VirtualSwarm(2, seed=5, admission=True)
    assert swarm.admin is not None
    invitation = swarm.admin.invite(bytes(range(16)), 2, CERTIFIED_UNTIL_S).encode()
    async with trio.open_nursery() as nursery:
        await nursery.start(swarm.run)
        for i in range(2):
            await swarm.start(i)
        await wait_until(swarm.converged, timeout_s=60)
        admitted = [joiner(swarm, k, invitation) for k in (1, 2)]
        for agent in admitted:
            await nursery.start(agent.run)
        seed = swarm.fellows[0].agent
        assert seed is not None
        await wait_until(lambda: names(seed) == {"f000", "f001", "new1", "new2"},
                         timeout_s=60)
        assert all(a.admission is not None and a.admission.certificate for a in admitted)
        late = joiner(swarm, 3, invitation)
        with pytest.raises(TokenRefused, match="the invitation is used up"):
            await late.run()  # the issuer's answer, before anything else starts
        assert "new3" not in names(seed)
        # the admin revokes new1: out of every view, and its agent stops, saying why
        assert swarm.admin is not None
        rev = swarm.admin.revoke(0, name="new1").encode()
        seed.membership.revoke(rev, trio.current_time())  # type: ignore[union-attr]
        began = trio.current_time()
        await wait_until(lambda: all("new1" not in names(a) for a in (seed, admitted[1])),
                         timeout_s=30)
        assert trio.current_time() - began <= 10.0
        await wait_until(admitted[0].stopped.is_set, timeout_s=30)
        assert "revoked" in str(admitted[0].failure)
        nursery.cancel_scope.cancel()
