"""A certificate travels once per fellow: relays leave it out of the Alives they pass on,
and a receiver that lacks it keeps the Alive pending and asks the sender
(membership.certificates). The gate's guarantees hold: nothing without a valid
certificate becomes a member."""

from __future__ import annotations

import dataclasses
from typing import Any

from p2pswarm.effects import SendDatagram
from p2pswarm.membership.certificates import MAX_PENDING, PENDING_S
from p2pswarm.membership.sync import record_alive
from p2pswarm.sim.gossip_lab import GossipLab, LabNode
from p2pswarm.wire import gossip as g


def _own_alive(node: LabNode) -> g.Alive:
    return record_alive(node.membership.self_record())


def _sent(effects: list[Any], addr: str, kind: type) -> list[Any]:
    return [m for e in effects if isinstance(e, SendDatagram) and e.addr == addr
            for m in e.messages if isinstance(m, kind)]


def _names(node: LabNode) -> set[str]:
    return {m.name for m in node.membership.members() if m.present and not m.is_self}


def test_a_relayed_alive_waits_for_its_certificate_and_asks_the_sender() -> None:
    lab = GossipLab(4, seed=5, admission=True)
    a, b, c = lab.nodes[0], lab.nodes[1], lab.nodes[2]
    alive_c = _own_alive(c)
    assert alive_c.certificate  # its own Alive carries it
    # a hears c first hand: admitted, and what a relays of c leaves the certificate out
    a.membership.handle_datagram([alive_c], c.addr, 1.0)
    assert c.name in _names(a)
    relayed = [m for m in a.membership.piggyback(100_000, 1.0)
               if isinstance(m, g.Alive) and m.node == c.node_id]
    assert relayed and all(m.certificate == b"" for m in relayed)
    # b hears c only relayed by a: not a member yet, asks a
    out = b.membership.handle_datagram([relayed[0]], a.addr, 1.1)
    assert c.name not in _names(b)
    asks = _sent(out, a.addr, g.CertificateAsk)
    assert [x.nodes for x in asks] == [(c.node_id,)]
    assert b.membership.counters()["certificate_waits"] == 1
    # a answers; b admits c
    answer = _sent(a.membership.handle_datagram(asks, b.addr, 1.2), b.addr, g.Certificates)
    assert answer and answer[0].certificates[0].certificate == alive_c.certificate
    b.membership.handle_datagram(answer, a.addr, 1.3)
    assert c.name in _names(b)
    # held by key, for that name only: another name is asked for again
    gate = b.membership.admission
    assert gate is not None
    assert gate.known(c.public_key, c.name, 1.4) == alive_c.certificate
    assert gate.known(c.public_key, "renamed", 1.4) == b""


def test_a_wrong_certificate_admits_nobody_and_unasked_ones_are_counted() -> None:
    lab = GossipLab(4, seed=5, admission=True)
    a, b, c, d = lab.nodes
    alive_d = dataclasses.replace(_own_alive(d), certificate=b"")
    b.membership.handle_datagram([alive_d], a.addr, 1.0)
    # the answer names d but carries c's certificate (another key): refused
    forged = g.Certificates((g.CertificateOf(d.node_id, _own_alive(c).certificate),))
    b.membership.handle_datagram([forged], a.addr, 1.1)
    assert d.name not in _names(b)
    assert b.membership.counters()["bad_certificates"] == 1
    # nothing waits for c: its certificate is dropped unchecked
    unasked = g.Certificates((g.CertificateOf(c.node_id, _own_alive(c).certificate),))
    b.membership.handle_datagram([unasked], a.addr, 1.2)
    assert c.name not in _names(b)
    assert b.membership.counters()["certificates_unasked"] == 1


def test_the_pending_table_is_bounded_and_expires() -> None:
    lab = GossipLab(4, seed=5, admission=True)
    a, b = lab.nodes[0], lab.nodes[1]
    base = dataclasses.replace(_own_alive(lab.nodes[2]), certificate=b"")
    for i in range(MAX_PENDING + 40):
        ghost = dataclasses.replace(base, node=i.to_bytes(2, "big") * 8)
        b.membership.handle_datagram([ghost], a.addr, 1.0)
    counters = b.membership.counters()
    assert counters["certificate_waits"] == MAX_PENDING + 40
    assert counters["certificate_waits_dropped"] == 40
    later = dataclasses.replace(base, node=b"\xff" * 16)
    b.membership.handle_datagram([later], a.addr, 1.0 + PENDING_S + 0.1)
    assert b.membership.counters()["certificate_waits_expired"] == MAX_PENDING
    assert len(b.membership.members()) == 1  # nobody got in


def test_a_join_wave_with_certificates_converges_and_relays_carry_none() -> None:
    n = 30
    lab = GossipLab(n, seed=11, admission=True)
    lab.start(stagger_s=0.0)
    lab.run_until(5.0)
    assert all(len(_names(x)) == n - 1 for x in lab.nodes)
    asks = sum(x.membership.counters()["certificate_asks_sent"] for x in lab.nodes)
    assert asks > 0
    for x in lab.nodes:
        for m in x.membership.piggyback(100_000, lab.now):
            if isinstance(m, g.Alive) and m.node != x.node_id:
                assert m.certificate == b""
