"""Admission at join, agents in virtual time: a joiner with an invitation gets its
certificate from the admin's fellow over a sealed stream; an invitation of 2 uses admits 2
identities, the third is refused by the issuer; a revoked fellow's agent stops."""

from __future__ import annotations

import random

import pytest
import trio

from p2pswarm.admission_home import IssuerBundle
from p2pswarm.agent import Agent
from p2pswarm.agent.admission import Admission, AdmissionSetup, wall_s
from p2pswarm.agent.world import AgentWorld
from p2pswarm.config import local
from p2pswarm.errors import TokenRefused
from p2pswarm.security import Identity, Keyring, node_id_of
from p2pswarm.security.admission import AdminKey, Certificate, ask_signed_bytes
from p2pswarm.sim.virtual import CERTIFIED_UNTIL_S, VirtualSwarm, wait_until
from p2pswarm.wire.gossip import AdmitAsk, AdmitRefused, Admitted


def joiner(swarm: VirtualSwarm, k: int, invitation: bytes, seed: int = 0) -> Agent:
    addr = f"10.0.8.{k}:7946"
    swarm.net.up(addr)
    assert swarm.admin is not None
    return Agent(AgentWorld(
        name=f"new{k}", transport=swarm.net.transport(addr), keyring=Keyring([swarm.secret]),
        identity=Identity.from_private_bytes(bytes([k]) * 32), config=local(), epoch=1,
        rng=random.Random(k), seeds=(swarm.fellows[seed].addr,),
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


async def test_a_seed_that_cannot_issue_relays_the_ask_to_the_issuer(autojump_clock) -> None:
    swarm = VirtualSwarm(3, seed=6, admission=True)
    assert swarm.admin is not None
    invitation = swarm.admin.invite(bytes(range(16)), 1, CERTIFIED_UNTIL_S).encode()
    async with trio.open_nursery() as nursery:
        await nursery.start(swarm.run)
        for i in range(3):
            await swarm.start(i)
        await wait_until(swarm.converged, timeout_s=60)
        relay = swarm.fellows[2].agent
        assert relay is not None and relay.admission is not None
        assert not relay.admission.issues(wall_s())
        # the admin's fellow says in its signed metadata that it issues
        await wait_until(lambda: relay._issuer_addrs() == [swarm.fellows[0].addr],
                         timeout_s=60)
        new = joiner(swarm, 1, invitation, seed=2)  # knows only the fellow that cannot issue
        await nursery.start(new.run)
        await wait_until(lambda: "new1" in names(relay), timeout_s=60)
        assert new.admission is not None
        cert = Certificate.decode(new.admission.certificate)
        assert cert.issuer_key == swarm.admin.public_key and cert.delegation is None
        assert relay.admission.relayed_asks == 1
        assert relay.status()["admission"]["issues"] is False  # type: ignore[index]
        nursery.cancel_scope.cancel()


async def test_a_delegated_issuer_admits_and_its_certificates_verify_offline(
        autojump_clock) -> None:
    swarm = VirtualSwarm(2, seed=7, admission=True)
    admin = swarm.admin
    assert admin is not None
    key = Identity.from_private_bytes(b"\x42" * 32)
    bundle = IssuerBundle(key, admin.delegate(key.public_key, CERTIFIED_UNTIL_S))
    plain = swarm._admission

    def with_delegate(i: int) -> AdmissionSetup | None:
        setup = plain(i)
        if i == 1 and setup is not None:
            return AdmissionSetup(setup.admin_key, setup.certificate, delegate=bundle)
        return setup

    swarm._admission = with_delegate  # type: ignore[method-assign]
    invitation = admin.invite(bytes(range(16)), 1, CERTIFIED_UNTIL_S).encode()
    async with trio.open_nursery() as nursery:
        await nursery.start(swarm.run)
        for i in range(2):
            await swarm.start(i)
        await wait_until(swarm.converged, timeout_s=60)
        issuer = swarm.fellows[1].agent
        assert issuer is not None and issuer.admission is not None
        assert issuer.status()["admission"]["issues"] is True  # type: ignore[index]
        new = joiner(swarm, 1, invitation, seed=1)
        await nursery.start(new.run)
        seed = swarm.fellows[0].agent
        assert seed is not None
        await wait_until(lambda: "new1" in names(seed), timeout_s=60)
        assert new.admission is not None
        cert = Certificate.decode(new.admission.certificate)
        assert cert.issuer_key == key.public_key and cert.delegation == bundle.delegation
        assert cert.problem(admin.public_key, wall_s()) is None  # the admin key is enough
        nursery.cancel_scope.cancel()


def test_a_relayed_ask_with_a_swapped_key_is_refused() -> None:
    admin = AdminKey.from_private_bytes(b"\x01" * 32)
    issuer = Admission("f000", admin.identity, None,
                       AdmissionSetup(admin.public_key, issuer=admin))
    invitation = admin.invite(bytes(16), 2, wall_s() + 3600).encode()
    joiner_key = Identity.from_private_bytes(b"\x02" * 32)
    relay_key = Identity.from_private_bytes(b"\x03" * 32)
    now = wall_s()
    signed = AdmitAsk(invitation, joiner_key.public_key, "new", 0, now, joiner_key.sign(
        ask_signed_bytes(invitation, joiner_key.public_key, "new", 0, now)))
    relay = node_id_of(relay_key.public_key)
    # the relay swaps in its own key (or another's), keeping the joiner's signature
    swapped = AdmitAsk(signed.invitation, relay_key.public_key[::-1], "new", 0, now,
                       signed.signature)
    assert isinstance(issuer._answer(swapped, relay), AdmitRefused)
    unsigned = AdmitAsk(invitation, joiner_key.public_key, "new", 0)
    refused = issuer._answer(unsigned, relay)
    assert isinstance(refused, AdmitRefused) and "no signature" in refused.reason
    stale = AdmitAsk(invitation, joiner_key.public_key, "new", 0, now - 3600, joiner_key.sign(
        ask_signed_bytes(invitation, joiner_key.public_key, "new", 0, now - 3600)))
    assert isinstance(issuer._answer(stale, relay), AdmitRefused)
    renamed = AdmitAsk(invitation, joiner_key.public_key, "other", 0, now, signed.signature)
    assert isinstance(issuer._answer(renamed, relay), AdmitRefused)
    got = issuer._answer(signed, relay)  # the joiner's own ask, relayed: its key admitted
    assert isinstance(got, Admitted)
    assert Certificate.decode(got.certificate).public_key == joiner_key.public_key


async def test_a_seed_relays_one_ask_at_a_time_per_joiner_address_within_a_budget(
        autojump_clock) -> None:
    admin = AdminKey.from_private_bytes(b"\x01" * 32)
    seed = Admission("f001", Identity.from_private_bytes(b"\x05" * 32), None,
                     AdmissionSetup(admin.public_key))
    asked: list[str] = []

    async def silent_issuer(addr: str, msg: object, *, timeout_s: float) -> object:
        asked.append(addr)
        await trio.sleep_forever()  # an issuer that takes the ask and never answers

    seed.call = silent_issuer
    seed.issuer_addrs = lambda: ["10.0.0.1:7946", "10.0.0.2:7946"]
    ask = AdmitAsk(b"\x01", Identity.from_private_bytes(b"\x06" * 32).public_key, "new", 0)
    replies: list[object] = []

    async def relay(addr: str) -> None:
        replies.append(await seed._relay(ask, addr))

    began = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(relay, "10.0.8.1")
        await trio.sleep(1)
        nursery.start_soon(relay, "10.0.8.1")  # the same joiner again: nothing to say
        nursery.start_soon(relay, "10.0.8.2")  # another joiner: relayed too
    assert replies[0] is None  # the second ask of 10.0.8.1, at once
    assert replies == [None, None, None]
    assert trio.current_time() - began <= 1 + 8.0 + 0.01  # the relay's whole budget
    assert asked == ["10.0.0.1:7946", "10.0.0.1:7946"]  # one issuer at a time, per joiner
    assert seed.relayed_asks == 2
