"""Admission on the command line: init (a new swarm, its admin key and a first invitation;
`--upgrade` of an older home, `--export-admin`), invite (an invitation token), delegate (an
issuer bundle: a fellow that admits without the admin key), revoke (a fellow, or a
delegated issuer, out)."""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Optional

import typer

from p2pswarm.cli.app import HomeOption, JsonOption, app, home_dir, print_json
from p2pswarm.cli.exits import EXIT_USAGE, exits_on, fail
from p2pswarm.config import DEFAULT_PORT

MAX_TTL_S = 10 * 365 * 86400
_TTL_RE = re.compile(r"^(\d+)([smhdw]?)$")
_TTL_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
DEFAULT_USES = 10  # the invitation `init` prints: enough for a room of machines
DEFAULT_TTL = "24h"


def ttl_seconds(text: str) -> int:
    """``90s``, ``30m``, ``24h``, ``7d``, ``2w`` or plain seconds; one line if not."""
    match = _TTL_RE.match(text.strip().lower())
    if match is None:
        fail(f"--ttl {text!r} is not a duration: give e.g. 30m, 24h or 7d")
    seconds = int(match.group(1)) * _TTL_UNITS[match.group(2)]
    if not 0 < seconds <= MAX_TTL_S:
        fail(f"--ttl {text!r} is out of range: from 1 s to 10 years")
    return seconds


def label_pairs(labels: list[str]) -> tuple[tuple[str, str], ...]:
    from p2pswarm.errors import ConfigError
    from p2pswarm.security.admission import labels_of

    pairs = []
    for label in labels:
        key, sep, value = label.partition("=")
        if not sep or not key:
            fail(f"--label {label!r} is not KEY=VALUE: give e.g. --label kind=rpi")
        pairs.append((key, value))
    try:
        return labels_of(pairs)
    except ConfigError as exc:
        fail(f"--label: {exc}")


def invitation_token(directory: Path, uses: int, ttl_s: int, max_priority: int,
                     labels: tuple[tuple[str, str], ...]) -> tuple[str, int]:
    """(a new invitation token of the swarm in ``directory``, when it expires)."""
    from p2pswarm.admission_home import AdmissionHome
    from p2pswarm.home import Home
    from p2pswarm.security.invitation_token import InvitationToken

    files = AdmissionHome(directory)
    if not files.has_admin():
        fail(f"{directory} does not hold the swarm's admin key: run `p2pswarm invite` on the "
             "machine that ran `p2pswarm init` (a swarm made before invitations: "
             "`p2pswarm init --upgrade` there first)")
    admin = files.load_admin()
    keyring = Home(directory).load_keyring()
    expires_s = int(time.time()) + ttl_s
    invitation = admin.invite(os.urandom(16), uses, expires_s, max_priority=max_priority,
                              labels=labels)
    return InvitationToken(keyring.primary.secret, invitation).text(), expires_s


def make_admin(directory: Path) -> bool:
    """The admin key and the admission file in ``directory`` (kept if there); whether
    anything was made."""
    from p2pswarm.admission_home import AdmissionHome, AdmissionState

    files = AdmissionHome(directory)
    state = files.load()
    if state is not None and files.has_admin():
        return False
    if state is not None:
        fail(f"{directory} belongs to a swarm whose admin key is elsewhere; `init --upgrade` "
             "runs on the machine that ran `p2pswarm init`")
    admin = files.make_admin()
    files.save(AdmissionState(admin.public_key))
    return True


def export_admin(directory: Path, target: Path) -> None:
    from p2pswarm.admission_home import AdmissionHome
    from p2pswarm.home import write_private

    files = AdmissionHome(directory)
    if not files.has_admin():
        fail(f"{directory} holds no admin key to export")
    if target.exists():
        fail(f"{target} already exists: give a new file name")
    admin = files.load_admin()
    write_private(target, {"format": "p2pswarm-admin", "version": 1,
                           "ed25519_private_key": admin.private_bytes().hex()})


@app.command()
@exits_on()
def init(
    home: Optional[Path] = HomeOption,
    force: bool = typer.Option(False, "--force", help="Replace a swarm already in --home."),
    upgrade: bool = typer.Option(False, "--upgrade", help="Give a swarm made before "
                                 "invitations its admin key (on the machine that ran init)."),
    export_admin: Optional[Path] = typer.Option(
        None, "--export-admin", help="Write a backup of the admin key to this file (0600)."),
    uses: int = typer.Option(DEFAULT_USES, "--uses", min=1, max=4096,
                             help="How many fellows the printed invitation admits."),
    ttl: str = typer.Option(DEFAULT_TTL, "--ttl",
                            help="How long the printed invitation admits: 30m, 24h, 7d."),
    as_json: bool = JsonOption,
) -> None:
    """Make a new swarm: a secret and the admin key in the state directory, and an
    invitation (a join token) to share."""
    from p2pswarm.home import Home

    directory = home_dir(home)
    with exits_on(EXIT_USAGE):
        if export_admin is not None:
            export_admin(directory, export_admin)
            typer.echo(f"admin key written to {export_admin} (mode 0600): keep it offline; "
                       "anyone holding it can admit and revoke fellows")
            return
        if upgrade:
            if not Home(directory).has_swarm():
                fail(f"no swarm in {directory} to upgrade: `p2pswarm init` makes a new one")
            made = make_admin(directory)
            typer.echo(f"upgraded {directory}: made the swarm's admin key (admin.json; back it "
                       "up with `p2pswarm init --export-admin FILE`); fellows now need an "
                       "invitation (`p2pswarm invite --uses N`) to rejoin" if made else
                       f"{directory} already holds the swarm's admin key: nothing to upgrade")
            return
        ttl_s = ttl_seconds(ttl)
        Home(directory).init(force=force)
        if force:
            for stale in ("admin.json", "json"):
                (directory / stale).unlink(missing_ok=True)
        make_admin(directory)
        token, expires_s = invitation_token(directory, uses, ttl_s, 255, ())
    if as_json:
        print_json({"home": str(directory), "token": token, "uses": uses,
                    "expires_at_s": expires_s})
        return
    typer.echo(f"New swarm in {directory}, with its admin key (admin.json: back it up with "
               f"`p2pswarm init --export-admin FILE`).\nInvitation for {uses} fellows, for "
               f"{ttl} (keep it secret; `p2pswarm invite` makes more):\n\n  {token}\n\n"
               f"Here:               p2pswarm join\n"
               f"On every machine:  P2PSWARM_TOKEN=<token> p2pswarm join THIS-MACHINE:"
               f"{DEFAULT_PORT}\n(or --token-file FILE; --token works too, but `ps` shows "
               "it to every user of the machine)")


@app.command()
@exits_on()
def invite(
    uses: int = typer.Option(1, "--uses", min=1, max=4096,
                             help="How many fellows the invitation admits (each its own key)."),
    ttl: str = typer.Option(DEFAULT_TTL, "--ttl", help="How long it admits: 30m, 24h, 7d."),
    max_priority: int = typer.Option(255, "--max-priority", min=0, max=255,
                                     help="The highest leader priority its fellows may claim."),
    label: Optional[list[str]] = typer.Option(None, "--label",
                                              help="KEY=VALUE its fellows carry (repeatable)."),
    home: Optional[Path] = HomeOption,
    as_json: bool = JsonOption,
) -> None:
    """Make an invitation: a join token that admits up to --uses fellows until --ttl ends."""
    directory = home_dir(home)
    with exits_on(EXIT_USAGE):
        ttl_s = ttl_seconds(ttl)
        labels = label_pairs(label or [])
        token, expires_s = invitation_token(directory, uses, ttl_s, max_priority, labels)
    if as_json:
        print_json({"token": token, "uses": uses, "expires_at_s": expires_s,
                    "max_priority": max_priority, "labels": dict(labels)})
        return
    typer.echo(f"Invitation for {uses} fellow{'' if uses == 1 else 's'}, until "
               f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(expires_s))} (keep it "
               f"secret; each fellow that joins with it takes one use):\n\n  {token}\n\n"
               "On each new machine:  P2PSWARM_TOKEN=<token> p2pswarm join THIS-MACHINE:PORT")


@app.command()
@exits_on()
def revoke(
    fellow: str = typer.Argument(..., help="The fellow's name, or its node id (32 hex digits)."),
    home: Optional[Path] = HomeOption,
    as_json: bool = JsonOption,
) -> None:
    """Take a fellow out of the swarm for good (admin-signed, gossiped, kept)."""
    from p2pswarm.admission_home import AdmissionHome
    from p2pswarm.cli.local_agent import ask_agent
    from p2pswarm.control.requests import request_map
    from p2pswarm.errors import ControlError
    from p2pswarm.wire.control import RevokeRequest

    directory = home_dir(home)
    with exits_on(EXIT_USAGE):
        files = AdmissionHome(directory)
        if not files.has_admin():
            fail(f"{directory} does not hold the swarm's admin key: revoke on the machine "
                 "that ran `p2pswarm init`")
        admin = files.load_admin()
        target = fellow.strip()
        by_id = re.fullmatch(r"[0-9a-fA-F]{32}", target) is not None
        if not target or len(target) > 64:
            fail("give the fellow's name (1 to 64 characters) or its 32-hex-digit node id")
        rev = admin.revoke(int(time.time()), node_id=bytes.fromhex(target) if by_id else b"",
                           name="" if by_id else target)
        state = files.load()
        if state is not None:
            files.save(state.with_revocation(rev.encode()))
    told = True
    try:
        ask_agent(home, request_map("revoke", RevokeRequest(rev.encode())))
    except ControlError:
        told = False
    if as_json:
        print_json({"revoked": target, "by": "node id" if by_id else "name",
                    "agent_told": told})
        return
    typer.echo(f"revoked {target}: " + ("the agent gossips it now; fellows drop it within "
                                        "seconds" if told else
                                        f"kept in {directory}; the agent gossips it when it "
                                        "starts"))


DEFAULT_DELEGATION_TTL = "30d"


@app.command()
@exits_on()
def delegate(
    out: Path = typer.Option(..., "--out", help="Write the issuer bundle to this new file "
                             "(mode 0600), or - for stdout (a pipe into `docker secret "
                             "create`); give it to one fellow: `join --issuer-file FILE`."),
    ttl: str = typer.Option(DEFAULT_DELEGATION_TTL, "--ttl",
                            help="How long the bundle may issue certificates: 7d, 30d."),
    home: Optional[Path] = HomeOption,
    as_json: bool = JsonOption,
) -> None:
    """Make an issuer bundle: a fresh key the admin key lets issue certificates until --ttl
    ends, so a fellow admits joiners without the admin key ever leaving this machine."""
    from p2pswarm.admission_home import AdmissionHome, IssuerBundle
    from p2pswarm.home import write_private
    from p2pswarm.security import Identity, node_id_of

    directory = home_dir(home)
    with exits_on(EXIT_USAGE):
        ttl_s = ttl_seconds(ttl)
        files = AdmissionHome(directory)
        if not files.has_admin():
            fail(f"{directory} does not hold the swarm's admin key: run `p2pswarm delegate` "
                 "on the machine that ran `p2pswarm init`")
        to_stdout = str(out) == "-"
        if not to_stdout and out.exists():
            fail(f"--out {out} already exists: give a new file name")
        if not to_stdout and not out.parent.is_dir():
            fail(f"--out {out}: the directory {out.parent} does not exist")
        admin = files.load_admin()
        key = Identity.generate()
        expires_s = int(time.time()) + ttl_s
        bundle = IssuerBundle(key, admin.delegate(key.public_key, expires_s))
        if to_stdout:
            sys.stdout.write(json.dumps(bundle.document()) + "\n")
        else:
            write_private(out, bundle.document())
    issuer_id = node_id_of(key.public_key).hex()
    if to_stdout:  # the bundle went to stdout: what to do with it goes to stderr
        typer.echo(f"issuer bundle written to stdout, issuing until "
                   f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(expires_s))}; if it is "
                   f"lost or stolen: p2pswarm revoke {issuer_id}", err=True)
        return
    if as_json:
        print_json({"out": str(out), "issuer_id": issuer_id, "expires_at_s": expires_s})
        return
    typer.echo(f"issuer bundle written to {out} (mode 0600), issuing until "
               f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(expires_s))}.\n"
               f"On the fellow that admits:  p2pswarm join --issuer-file {out} ...\n"
               f"Keep it as secret as a token: its holder admits fellows under any live "
               f"invitation's free uses.\nIf it is lost or stolen:  p2pswarm revoke {issuer_id}")


def take_issuer_file(directory: Path, source: Path) -> None:
    """Copy an issuer bundle into the home (0600); one line if it is not one of this
    swarm's, or its delegation has ended."""
    from p2pswarm.admission_home import AdmissionHome, IssuerBundle
    from p2pswarm.errors import ConfigError

    try:
        bundle = IssuerBundle.read(source, private=False)
    except ConfigError as exc:
        fail(f"--issuer-file: {exc}")
    files = AdmissionHome(directory)
    state = files.load()
    if state is not None and state.admin_key != bundle.delegation.admin_key:
        fail(f"--issuer-file {source} was delegated by another swarm's admin key: ask this "
             "swarm's admin for one (`p2pswarm delegate --out FILE`)")
    if int(time.time()) >= bundle.delegation.expires_at_s:
        fail(f"--issuer-file {source} has expired: ask the swarm's admin for a new one "
             "(`p2pswarm delegate --out FILE`)")
    files.save_issuer(bundle)


def take_invitation(directory: Path, text: str, *, force: bool) -> None:
    """Write the invitation's secret and invitation into the home; one line if it cannot
    admit anyone now (expired), before any traffic."""
    from p2pswarm.admission_home import AdmissionHome, AdmissionState
    from p2pswarm.home import Home
    from p2pswarm.security.invitation_token import InvitationToken

    token = InvitationToken.parse(text)
    invitation = token.invitation
    if int(time.time()) >= invitation.expires_at_s:
        fail("the invitation has expired: ask the swarm's admin for a new one "
             "(`p2pswarm invite`)")
    files = AdmissionHome(directory)
    state = files.load() if Home(directory).has_swarm() else None
    Home(directory).join_swarm(token.secret, force=force)
    if state is not None and state.admin_key == invitation.admin_key and state.certificate:
        return  # admitted already: the certificate we hold is used again, no slot taken
    files.save(AdmissionState(invitation.admin_key, b"", invitation.encode(),
                              state.revocations if state is not None else ()))
