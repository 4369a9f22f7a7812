"""Membership and election where the swarm has an admin key, in the gossip lab (virtual time):
only certified fellows count, as far as their certificates allow."""

from __future__ import annotations

from p2pswarm.membership import LocalNode, Membership
from p2pswarm.membership.proofs import alive_signed_bytes
from p2pswarm.security.admission import Certificate
from p2pswarm.sim.gossip_lab import LAB_EXPIRY_S, GossipLab, fake_keys, fake_sign_for
from p2pswarm.wire import gossip as g


def _leader(lab: GossipLab, i: int) -> bytes | None:
    e = lab.nodes[i].election
    assert e is not None
    return e.status().leader_id


def _present(lab: GossipLab, i: int) -> set[str]:
    return {m.name for m in lab.nodes[i].membership.members() if m.present}


def _settled(n: int = 5, **kw: object) -> GossipLab:
    lab = GossipLab(n, seed=7, admission=True, **kw)  # type: ignore[arg-type]
    lab.start()
    lab.run_until(30.0)
    leaders = {_leader(lab, i) for i in range(n)}
    assert len(leaders) == 1 and None not in leaders
    return lab


def _made_up(k: int, seed: int = 99, priority: int = 0,
             certificate: bytes = b"") -> list[g.MemberRecord]:
    """``k`` self-signed fellows nobody admitted."""
    out = []
    for i in range(k):
        key, node = fake_keys(seed, i)
        name, addr = f"ghost{i}", f"10.9.{i // 250}.{i % 250}:7946"
        sig = fake_sign_for(key)(alive_signed_bytes(node, 1, name, addr, key, 0, priority, 0))
        out.append(g.MemberRecord(node, 1, g.STATE_ALIVE, name, addr, key, priority, 0, b"",
                                  None, 0, 0, sig, certificate))
    return out


def test_uncertified_fellows_are_no_members_and_do_not_pin_health() -> None:
    lab = _settled()
    leader = _leader(lab, 0)
    victim = lab.nodes[1]
    ghosts = _made_up(1500)
    reply, _ = victim.membership.handle_stream(
        g.SyncRecords(lab.nodes[2].node_id, tuple(ghosts)), lab.nodes[2].addr, lab.now)
    assert reply is not None
    assert len(victim.membership.members()) == 5
    assert victim.membership.counters()["uncertified"] == 1500
    lab.run_for(20.0)
    assert victim.membership.health_score == 0
    # the leader dies: it is still replaced, by a certified fellow
    old = next(n for n in lab.nodes if n.node_id == leader)
    lab.crash(old.index)
    lab.run_for(30.0)
    alive = [n.index for n in lab.nodes if n.up]
    leaders = {_leader(lab, i) for i in alive}
    assert len(leaders) == 1 and leader not in leaders and None not in leaders


def test_priority_beyond_the_certificate_does_not_win() -> None:
    lab = GossipLab(5, seed=3, admission=True)  # the invitation allows priority 0
    rogue = lab.nodes[4]
    rogue.priority = 2**31 - 1  # it claims the most, signing its own Alive
    rogue.membership = lab._new_membership(4, rogue.addr, rogue.public_key, rogue.node_id,
                                           rogue.priority, rogue.rng)
    rogue.election = lab._new_election(rogue)
    lab.start()
    lab.run_until(40.0)
    honest = range(4)
    assert all(rogue.name not in _present(lab, i) for i in honest)
    leaders = {_leader(lab, i) for i in honest}
    assert len(leaders) == 1 and rogue.node_id not in leaders and None not in leaders
    assert lab.nodes[0].membership.counters()["priority_beyond_certificate"] >= 1


def test_an_unsigned_left_about_the_leader_is_ignored() -> None:
    lab = _settled()
    leader = _leader(lab, 0)
    assert leader is not None
    lead = next(n for n in lab.nodes if n.node_id == leader)
    inc = lab.nodes[0].membership.member(leader)
    assert inc is not None
    for n in lab.nodes:
        if n is not lead:
            lab._call(n, n.membership.handle_datagram(
                [g.Left(leader, inc.incarnation + 5)], lab.nodes[0].addr, lab.now))
    lab.run_for(10.0)
    for n in lab.nodes:
        assert lead.name in _present(lab, n.index)
        assert _leader(lab, n.index) == leader
    assert sum(n.membership.counters()["unsigned_lefts"] for n in lab.nodes) >= 4


def test_a_graceful_leave_is_still_seen() -> None:
    lab = _settled()
    lab.leave(3)
    lab.run_for(10.0)
    for i in (0, 1, 2, 4):
        m = {x.name: x.state for x in lab.nodes[i].membership.members()}
        assert m.get("n003", "left") == "left"


def test_a_certificate_of_another_key_or_expired_admits_nobody() -> None:
    lab = _settled(3)
    admin = lab.admin
    assert admin is not None
    key, node = fake_keys(42, 0)
    stolen = lab.certificates[0]  # a real fellow's certificate, under another key
    late = Certificate.issue(admin.identity, lab.invitation, key, "ghost0", 0, 0, 1).encode()
    for cert in (stolen, late):
        recs = _made_up(1, seed=42, certificate=cert)
        lab.nodes[1].membership.merge_records(recs, lab.now)
        assert "ghost0" not in _present(lab, 1)
    assert lab.nodes[1].membership.counters()["bad_certificates"] >= 1
    assert LAB_EXPIRY_S > lab.now


def test_a_revoked_fellow_is_out_of_every_view_within_10_s() -> None:
    lab = _settled()
    admin = lab.admin
    assert admin is not None
    target = lab.nodes[3]
    rev = admin.revoke(0, node_id=target.node_id).encode()
    lab._call(lab.nodes[0], lab.nodes[0].membership.revoke(rev, lab.now))
    start = lab.now
    while lab.now < start + 10.0 and any(
            target.name in _present(lab, i) for i in (0, 1, 2, 4)):
        lab.run_for(0.25)
    assert lab.now - start <= 10.0
    # it stays out: its own Alives are refused from then on
    lab.run_for(20.0)
    assert all(target.name not in _present(lab, i) for i in (0, 1, 2, 4))
    assert all(lab.nodes[i].membership.revocations() == (rev,) for i in (0, 1, 2, 4))
    # and a fellow restarted with the revocations it kept takes them in again
    lab.crash(1)
    lab.restart(1)
    lab._call(lab.nodes[1], lab.nodes[1].membership.revoke(rev, lab.now))
    lab.run_for(15.0)
    assert target.name not in _present(lab, 1)


def test_without_an_admin_key_nothing_changes() -> None:
    local = LocalNode(b"\x01" * 16, "a", "10.0.0.1:1", b"\x02" * 32)
    m = Membership(local, GossipLab(1).config.gossip, __import__("random").Random(1),
                   sign=fake_sign_for(b"\x02" * 32), verify=lambda *a: True)
    assert m.admission is None and m.revocations() == ()


def test_a_flood_of_bad_signatures_costs_its_sender_its_allowance() -> None:
    import dataclasses

    lab = _settled(3)
    admin = lab.admin
    assert admin is not None
    victim = lab.nodes[1]
    ghosts = []
    for i, r in enumerate(_made_up(2000, seed=5)):
        cert = Certificate.issue(admin.identity, lab.invitation, r.public_key, r.name, 0, 0,
                                 LAB_EXPIRY_S)
        forged = dataclasses.replace(cert, signature=bytes(64)).encode()  # checks, fails
        ghosts.append(dataclasses.replace(r, certificate=forged))
    sender = lab.nodes[2]
    victim.membership.handle_stream(g.SyncRecords(sender.node_id, tuple(ghosts)), sender.addr,
                                    lab.now)
    counters = victim.membership.counters()
    assert counters["bad_certificates"] <= 256  # the message's cap on fresh checks
    assert counters["signature_checks_refused"] >= 2000 - 256
    # another sender keeps its own allowance, and the honest view is whole
    assert {m.name for m in victim.membership.members()} == {"n000", "n001", "n002"}
    lab.run_for(10.0)
    assert _present(lab, 1) == {"n000", "n001", "n002"}


def test_a_fellow_revoked_while_it_was_down_is_told_when_it_speaks_again() -> None:
    lab = _settled(4)
    admin = lab.admin
    assert admin is not None
    target = lab.nodes[3]
    lab.crash(3)
    rev = admin.revoke(0, name=target.name).encode()
    lab._call(lab.nodes[0], lab.nodes[0].membership.revoke(rev, lab.now))
    lab.run_for(60.0)  # the revocation's gossip is long over when it comes back
    lab.restart(3)
    lab.run_for(10.0)
    assert target.membership.revocations() == (rev,)  # told: its agent then stops
    assert all(target.name not in _present(lab, i) for i in (0, 1, 2))
