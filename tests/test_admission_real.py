"""Admission with real `p2pswarm` processes: init, invite --uses 2, two fellows join (the
second through the first, which relays its ask to the admin's fellow), a third with the
same invitation is refused in one line; revoke takes a fellow out within 10 s, and
it stays out across restarts (the admin's, and its own); an expired invitation admits
nobody; a plain token is told to ask for an invitation."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from p2pswarm.admission_home import AdmissionHome
from p2pswarm.home import Home
from p2pswarm.security.invitation_token import InvitationToken
from p2pswarm.sim import commands
from p2pswarm.sim.commands import cli, present, refused_line, status_of, stop, took_s
from p2pswarm.sim.field import free_port

pytestmark = pytest.mark.slow  # real processes


def alive_names(home: Path) -> set[str]:
    return present(status_of(home))


def wait(what: str, ready: Any, timeout_s: float = 90.0) -> float:
    return took_s(what, ready, timeout_s)


def join(home: Path, port: int, *args: str) -> subprocess.Popen[str]:
    return commands.join(home, *args, listen=f"127.0.0.1:{port}")


def test_an_invitation_admits_its_uses_and_revoke_takes_a_fellow_out(tmp_path: Path) -> None:
    admin_home = tmp_path / "admin"
    made = cli("init", "--home", str(admin_home), "--json")
    assert made.returncode == 0, made.stderr
    invited = cli("invite", "--home", str(admin_home), "--uses", "2", "--json")
    assert invited.returncode == 0, invited.stderr
    token = json.loads(invited.stdout)["token"]
    ports = {name: free_port() for name in ("admin", "a", "b", "c")}
    seed = f"127.0.0.1:{ports['admin']}"
    procs: dict[str, subprocess.Popen[str]] = {}
    try:
        procs["admin"] = join(admin_home, ports["admin"], "--name", "admin")
        wait("the admin's fellow", lambda: "admin" in alive_names(admin_home))
        procs["a"] = join(tmp_path / "a", ports["a"], seed, "--name", "a", "--token", token)
        wait("a admitted", lambda: "a" in alive_names(admin_home))
        # b knows only a, which cannot issue: a relays b's signed ask to the admin's fellow
        via_a = f"127.0.0.1:{ports['a']}"
        procs["b"] = join(tmp_path / "b", ports["b"], via_a, "--name", "b", "--token", token)
        wait("two fellows admitted", lambda: alive_names(admin_home) == {"admin", "a", "b"})
        relay, issuer = status_of(tmp_path / "a"), status_of(admin_home)
        assert relay is not None and issuer is not None
        assert relay["admission"]["issues"] is False and relay["admission"]["relayed_asks"] >= 1
        assert issuer["admission"]["issues"] is True
        assert relay["admission"]["certificate"]["uses"] == 2
        # the third with the same invitation, through a too: refused by the issuer, in one
        # line, no keys kept
        third = join(tmp_path / "c", ports["c"], via_a, "--name", "c", "--token", token)
        line = refused_line(third)
        assert "the invitation is used up" in line
        assert not Home(tmp_path / "c").has_swarm()
        # revoke: out of every view within 10 s, and the revoked fellow stops, saying why
        revoked = cli("revoke", "b", "--home", str(admin_home))
        assert revoked.returncode == 0, revoked.stderr
        took_s = wait("b out of every view", lambda: all(
            "b" not in alive_names(tmp_path / h) for h in ("admin", "a")), timeout_s=30)
        assert took_s <= 10.0
        assert "revoked" in refused_line(procs.pop("b"))
        # restarts: the admin keeps the revocation; b, back with its certificate, is told
        # and stops, out of every view
        stop(procs.pop("admin"))
        procs["admin"] = join(admin_home, ports["admin"], "--name", "admin")
        wait("the admin back with a", lambda: alive_names(admin_home) >= {"admin", "a"})
        procs["b"] = join(tmp_path / "b", ports["b"], seed, "--name", "b")
        assert "revoked" in refused_line(procs.pop("b"))
        assert all("b" not in alive_names(tmp_path / h) for h in ("admin", "a"))
    finally:
        stop(*procs.values())


def test_an_expired_invitation_or_a_plain_token_admits_nobody(tmp_path: Path) -> None:
    admin_home = tmp_path / "admin"
    assert cli("init", "--home", str(admin_home)).returncode == 0
    admin = AdmissionHome(admin_home).load_admin()
    secret = Home(admin_home).load_keyring().primary.secret
    expired = InvitationToken(secret, admin.invite(bytes(16), 5, int(time.time()) - 1)).text()
    late = cli("join", "--home", str(tmp_path / "late"), "127.0.0.1:9", "--token", expired)
    assert late.returncode == 2 and "the invitation has expired" in late.stderr
    assert not Home(tmp_path / "late").has_swarm()
    port, plain_port = free_port(), free_port()
    admin_proc = join(admin_home, port, "--name", "admin")
    try:
        wait("the admin's fellow", lambda: "admin" in alive_names(admin_home))
        plain = join(tmp_path / "plain", plain_port, f"127.0.0.1:{port}", "--name", "plain",
                     "--token", secret.token())
        line = refused_line(plain)
        assert "admits fellows by invitation only" in line and "p2pswarm invite" in line
        assert not Home(tmp_path / "plain").has_swarm()
        assert alive_names(admin_home) == {"admin"}
    finally:
        stop(admin_proc)
