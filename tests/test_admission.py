"""Admission records on their own: sign, verify offline, expiry, tampering, the slot rule."""

from __future__ import annotations

import pytest

from p2pswarm.errors import AuthenticationError, ConfigError
from p2pswarm.membership.gate import AdmissionGate, SignatureBudget
from p2pswarm.security.admission import (
    AdminKey,
    Certificate,
    Invitation,
    Revocation,
    SlotHolders,
    certificate_problem,
    labels_of,
)
from p2pswarm.security.identity import Identity
from p2pswarm.wire import gossip as g

NOW = 1_800_000_000
INV_ID = bytes(range(16))


def _admin() -> AdminKey:
    return AdminKey.generate()


def _cert(admin: AdminKey, inv: Invitation, who: Identity, slot: int, *, issued: int = NOW,
          issuer: Identity | None = None, name: str = "pc", **kw: object) -> Certificate:
    return Certificate.issue(issuer or admin.identity, inv, who.public_key, name, slot, issued,
                             NOW + 3600, **kw)  # type: ignore[arg-type]


def test_invitation_round_trips_and_verifies_offline() -> None:
    admin = _admin()
    inv = admin.invite(INV_ID, 3, NOW + 86400, max_priority=5,
                       labels=labels_of({"kind": "rpi"}))
    back = Invitation.decode(inv.encode())
    assert back == inv and back.labels == (("kind", "rpi"),)
    assert back.problem(admin.public_key, NOW) is None
    assert back.problem(admin.public_key, NOW + 86400) == "it has expired"
    assert back.problem(_admin().public_key, NOW) is not None  # another swarm's


def test_tampered_records_do_not_verify() -> None:
    admin = _admin()
    inv = admin.invite(INV_ID, 3, NOW + 86400, max_priority=5)
    raw = bytearray(inv.encode())
    raw[len(b"p2pswarm-invitation\x00") + 19] ^= 1  # the uses: 3 becomes 2
    assert Invitation.decode(bytes(raw)).problem(admin.public_key, NOW) is not None
    who = Identity.generate()
    cert = _cert(admin, inv, who, 0)
    raw = bytearray(cert.encode())
    raw[-70] ^= 1
    assert certificate_problem(bytes(raw), admin.public_key, who.public_key, NOW)[1] is not None
    for cut in (0, 10, len(raw) - 1):
        with pytest.raises(AuthenticationError):
            Certificate.decode(bytes(raw[:cut]))
    with pytest.raises(AuthenticationError):
        Certificate.decode(cert.encode() + b"\x00")


def test_certificate_binds_key_caps_priority_and_expires() -> None:
    admin = _admin()
    inv = admin.invite(INV_ID, 2, NOW + 86400, max_priority=5)
    who = Identity.generate()
    cert = _cert(admin, inv, who, 1, max_priority=2**31 - 1)
    assert cert.max_priority == 5  # never more than the invitation allows
    data = cert.encode()
    assert Certificate.decode(data) == cert
    assert certificate_problem(data, admin.public_key, who.public_key, NOW) == (cert, None)
    assert certificate_problem(data, admin.public_key, Identity.generate().public_key,
                               NOW)[1] == "it was issued to another key"
    assert certificate_problem(data, admin.public_key, who.public_key,
                               NOW + 3600)[1] == "it has expired"
    with pytest.raises(ConfigError):
        _cert(admin, inv, who, 2)  # slot beyond the uses


def test_delegated_issuer_counts_only_with_the_admins_delegation() -> None:
    admin = _admin()
    inv = admin.invite(INV_ID, 2, NOW + 86400)
    leader, who = Identity.generate(), Identity.generate()
    delegation = admin.delegate(leader.public_key, NOW + 7200)
    cert = _cert(admin, inv, who, 0, issuer=leader, delegation=delegation)
    assert cert.problem(admin.public_key, NOW) is None
    assert Certificate.decode(cert.encode()).problem(admin.public_key, NOW) is None
    rogue = _cert(admin, inv, who, 0, issuer=Identity.generate())
    assert rogue.problem(admin.public_key, NOW) is not None
    stolen = _cert(admin, inv, who, 0, issuer=Identity.generate(), delegation=delegation)
    assert stolen.problem(admin.public_key, NOW) is not None  # delegation names another
    assert cert.problem(admin.public_key, NOW + 7200) is not None  # delegation expired


def test_slot_rule_admits_at_most_uses_identities_even_with_two_issuers() -> None:
    admin = _admin()
    inv = admin.invite(INV_ID, 2, NOW + 86400)
    a, b = Identity.generate(), Identity.generate()
    delegation_a = admin.delegate(a.public_key, NOW + 86400)
    delegation_b = admin.delegate(b.public_key, NOW + 86400)
    # two issuers, unaware of each other, each give both slots to fellows of their own
    certs = [
        _cert(admin, inv, Identity.generate(), slot, issued=NOW + k, issuer=issuer,
              delegation=d)
        for k, (issuer, d) in enumerate(((a, delegation_a), (b, delegation_b)))
        for slot in range(2)
    ]
    orders = [certs, certs[::-1], [certs[1], certs[2], certs[0], certs[3]]]
    held: list[set[bytes]] = []
    for order in orders:
        holders = SlotHolders()
        for c in order:
            holders.offer(c)
        held.append({c.public_key for c in holders.holders()})
    assert all(len(h) == 2 for h in held)
    assert held[0] == held[1] == held[2]  # every view picks the same two


def test_revocation_signed_by_the_admin_only() -> None:
    admin = _admin()
    who = Identity.generate()
    rev = admin.revoke(NOW, node_id=who.node_id)
    back = Revocation.decode(rev.encode())
    assert back == rev and back.valid(admin.public_key)
    assert back.covers(who.node_id, "anything") and not back.covers(b"\x00" * 16, "pc")
    by_name = Revocation.decode(admin.revoke(NOW, name="pc").encode())
    assert by_name.covers(b"\x01" * 16, "pc") and by_name.valid(admin.public_key)
    forged = _admin().revoke(NOW, name="pc")
    assert not forged.valid(admin.public_key)


def test_gate_refuses_uncertified_capped_revoked_and_counts() -> None:
    admin = _admin()
    inv = admin.invite(INV_ID, 1, NOW + 86400, max_priority=3)
    who = Identity.generate()
    cert = _cert(admin, inv, who, 0).encode()
    gate = AdmissionGate(admin.public_key, wall_offset_s=NOW)

    def alive(priority: int, certificate: bytes, key: bytes = who.public_key) -> g.Alive:
        return g.Alive(who.node_id, 1, "pc", "10.0.0.1:1", key, 0, priority,
                       certificate=certificate)

    assert gate.admits(alive(0, b""), 0.0) == (False, None)
    assert gate.admits(alive(2**31 - 1, cert), 0.0) == (False, None)
    assert gate.admits(alive(3, cert), 0.0) == (True, None)
    other = Identity.generate()
    second = _cert(admin, inv, other, 0, issued=NOW + 1).encode()  # the same slot, later
    assert gate.admits(alive(0, second, other.public_key), 0.0) == (False, None)
    assert gate.revoke(admin.revoke(NOW, node_id=who.node_id).encode()) is not None
    assert gate.admits(alive(3, cert), 0.0) == (False, None)
    assert gate.admits(alive(0, second, other.public_key), 0.0) == (True, None)  # slot freed
    assert gate.revoke(_admin().revoke(NOW, name="pc").encode()) is None
    assert {k: gate.stats[k] for k in ("uncertified", "priority_beyond_certificate",
                                       "slot_taken", "revoked_refused", "bad_revocations")} \
        == {"uncertified": 1, "priority_beyond_certificate": 1, "slot_taken": 1,
            "revoked_refused": 1, "bad_revocations": 1}


def test_signature_budget_is_per_sender_and_refills() -> None:
    budget = SignatureBudget(rate_per_s=10.0, burst=5.0)
    assert all(budget.take("a", 0.0) for _ in range(5))
    assert not budget.take("a", 0.0)
    assert budget.take("b", 0.0)  # another sender keeps its own allowance
    assert budget.take("a", 0.1)  # refilled: one more


def test_a_revoked_delegation_ends_what_it_signed_and_the_bundle_round_trips(
        tmp_path: object) -> None:
    from pathlib import Path

    from p2pswarm.admission_home import AdmissionHome, IssuerBundle
    from p2pswarm.security.identity import node_id_of

    admin = _admin()
    delegate = Identity.generate()
    delegation = admin.delegate(delegate.public_key, NOW + 3600)
    home = AdmissionHome(Path(str(tmp_path)))
    home.save_issuer(IssuerBundle(delegate, delegation))
    bundle = home.load_issuer()
    assert bundle is not None and bundle.delegation == delegation
    assert bundle.identity.public_key == delegate.public_key
    inv = admin.invite(INV_ID, 3, NOW + 3600)
    who = Identity.generate()
    cert = Certificate.issue(delegate, inv, who.public_key, "pc", 0, NOW, NOW + 3600,
                             delegation=delegation)
    assert cert.problem(admin.public_key, NOW) is None  # offline, the admin key alone
    assert cert.problem(admin.public_key, NOW + 3600) is not None  # the delegation ended
    gate = AdmissionGate(admin.public_key, wall_offset_s=NOW)
    assert gate.certificate(cert.encode(), who.public_key, "pc", 0.0) is not None
    assert gate.revoke(admin.revoke(NOW, node_id=node_id_of(delegate.public_key)).encode())
    assert gate.certificate(cert.encode(), who.public_key, "pc", 0.0) is None
    assert gate.stats["revoked_refused"] == 1
    # a bundle whose delegation names another key is refused in one line
    other = IssuerBundle(Identity.generate(), delegation)
    home.save_issuer(other)
    with pytest.raises(ConfigError, match="names another key"):
        home.load_issuer()


def test_delegate_writes_a_bundle_join_takes_and_bad_input_gets_one_line(
        tmp_path: object) -> None:
    import json
    import stat
    from pathlib import Path

    from typer.testing import CliRunner

    from p2pswarm.admission_home import AdmissionHome, IssuerBundle
    from p2pswarm.cli import app
    from p2pswarm.cli.admission import take_issuer_file
    from p2pswarm.security.identity import node_id_of

    root = Path(str(tmp_path))
    runner = CliRunner()
    admin_home, out = root / "admin", root / "issuer.json"
    assert runner.invoke(app, ["init", "--home", str(admin_home)]).exit_code == 0
    made = runner.invoke(app, ["delegate", "--home", str(admin_home), "--ttl", "7d",
                               "--out", str(out), "--json"])
    assert made.exit_code == 0, made.output
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    bundle = IssuerBundle.read(out)
    admin = AdmissionHome(admin_home).load_admin()
    assert bundle.delegation.valid(admin.public_key, bundle.delegation.expires_at_s - 1)
    assert json.loads(made.output)["issuer_id"] == node_id_of(bundle.identity.public_key).hex()
    # a fellow of this swarm takes it into its home (0600), whatever the source's mode
    out.chmod(0o444)  # as a Docker secret is given
    take_issuer_file(admin_home, out)
    kept = AdmissionHome(admin_home).load_issuer()
    assert kept is not None and kept.delegation == bundle.delegation
    for args, says in (
            (["delegate", "--home", str(admin_home), "--out", str(out)], "already exists"),
            (["delegate", "--home", str(admin_home), "--out", str(root / "x"), "--ttl", "3q"],
             "is not a duration"),
            (["delegate", "--home", str(root / "none"), "--out", str(root / "y")],
             "does not hold the swarm's admin key")):
        refused = runner.invoke(app, args)
        assert refused.exit_code == 2 and says in refused.output, refused.output
        assert "Traceback" not in refused.output and len(refused.output.splitlines()) == 1
