"""Admission on the agent: a certificate asked for at join, issued by the admin's fellow,
and revocations kept.

Theory of operation. A home that holds an admission file (``admission_home``) runs with
admission on; one made before invitations runs as it always did.

- Joining: a fellow holding an invitation and no certificate asks its seeds for one
  (``AdmitAsk`` over a sealed stream) before it joins; the first certificate that admits
  its own key is kept in the home and presented from then on in its signed ``Alive`` (a
  restart uses it again, never another slot). A refusal is the issuer's authenticated
  answer (``AdmitRefused``): the join stops with its one line.
- Issuing: the fellow that holds the admin key, or a delegated issuer (an issuer bundle
  from ``p2pswarm delegate`` in its home: its own key and the admin-signed delegation, which
  rides in every certificate it signs), answers ``AdmitAsk``: the invitation must verify
  and be live, the key asked for must be the one the stream's handshake proved (or, for an
  ask a seed relayed, the one whose fresh signature the ask carries), and not revoked;
  the asker gets the lowest free slot (``security.admission.issue_under``), or its own
  again. What it gave is kept in its home, so a restart gives no slot twice.
- Relaying: any admitted fellow that cannot issue relays a joiner's ask (the joiner's own
  stream only, never a relayed one: no loops) to the fellows that say in their signed
  metadata that they issue, and answers with the issuer's answer. One relay at a time per
  joiner address, a few at a time in all, each within ``RELAY_TIMEOUT_S``.
- Revoking: a revocation from the CLI (control op ``revoke``) or from gossip is kept in the
  home and handed to the membership, which drops the fellow from its view; the fellow's
  open streams are closed and new ones refused.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import msgpack
import trio

from p2pswarm.admission_home import MAX_KEPT, AdmissionHome, AdmissionState, IssuerBundle
from p2pswarm.agent.status_doc import AdmissionStateDoc, CertificateDoc
from p2pswarm.errors import AuthenticationError, ConfigError, SwarmError, TokenRefused
from p2pswarm.membership.gate import AdmissionGate
from p2pswarm.membership.member import Member
from p2pswarm.security import Identity, node_id_of
from p2pswarm.security.admission import (
    CERTIFICATE_TTL_S,
    AdminKey,
    Certificate,
    Delegation,
    Invitation,
    Revocation,
    ask_problem,
    ask_signed_bytes,
    certificate_problem,
    issue_under,
)
from p2pswarm.transport.secure import SecureStream
from p2pswarm.wire.gossip import AdmitAsk, AdmitRefused, Admitted

log = logging.getLogger("p2pswarm.agent")

ASK_TIMEOUT_S = 10.0  # one ask of one seed
ASK_FOR_S = 120.0  # how long a joiner keeps asking seeds that do not answer at all
RELAY_TIMEOUT_S = 8.0  # one relayed ask, below the joiner's own ASK_TIMEOUT_S
MAX_RELAYS = 8  # relays under way at once on one seed
MAX_RELAY_ISSUERS = 3  # issuers one relay tries
ISSUER_METADATA_KEY = "issuer"  # in a fellow's signed metadata: it issues certificates


@dataclass(frozen=True, slots=True)
class AdmissionSetup:
    """What an agent is given of admission (in its world): None there means admission off."""

    admin_key: bytes
    certificate: bytes = b""  # ours; b"": ask for one with ``invitation``
    invitation: bytes = b""
    revocations: tuple[bytes, ...] = ()
    issued: tuple[bytes, ...] = ()  # certificates this fellow gave (if it holds the admin key)
    issuer: AdminKey | None = None  # the admin key, on the fellow that holds it
    delegate: IssuerBundle | None = None  # a delegated issuer's key and delegation

    @classmethod
    def of_home(cls, home: Path) -> AdmissionSetup | None:
        files = AdmissionHome(home)
        state = files.load()
        if state is None:
            return None
        issuer = files.load_admin() if files.has_admin() else None
        if issuer is not None and issuer.public_key != state.admin_key:
            raise ConfigError(f"{files.admin_path} is not the admin key {files.state_path} "
                              "names; restore the right one from its backup")
        delegate = files.load_issuer()
        if delegate is not None and delegate.delegation.admin_key != state.admin_key:
            raise ConfigError(f"{files.issuer_path} was delegated by another swarm's admin "
                              "key: remove it, or ask this swarm's admin for a bundle "
                              "(`p2pswarm delegate`)")
        return cls(state.admin_key, state.certificate, state.invitation, state.revocations,
                   state.issued, issuer, delegate)


MAX_LEADER_PRIORITY = 255  # what `join --leader-priority` takes


def founder_invitation_id(admin_key: bytes) -> bytes:
    """The invitation the admin's own fellow is admitted under (one use)."""
    return hashlib.sha256(b"p2pswarm-founder\x00" + admin_key).digest()[:16]


def wall_s() -> int:
    return int(time.time())


class Admission:
    """One agent's admission: its certificate, what it issues, the revocations it keeps."""

    def __init__(self, name: str, identity: Identity, home: Path | None,
                 setup: AdmissionSetup) -> None:
        self._name = name
        self._identity = identity
        self._home = home
        self.setup = setup
        self.certificate = setup.certificate
        self._issued: list[Certificate] = []
        for data in setup.issued:
            try:
                self._issued.append(Certificate.decode(data))
            except AuthenticationError:
                continue
        self.gate = AdmissionGate(setup.admin_key)  # its wall clock is set when the agent runs
        self.refused_asks = 0
        self.relayed_asks = 0
        self.barred: set[bytes] = set()  # node ids revoked: their streams are closed
        self._relaying: set[str] = set()  # joiner addresses with a relay under way
        # set by the agent: one stream request, and the addresses of fellows that issue
        self.call: Any = None
        self.issuer_addrs: Any = None

    def issues(self, now_s: int) -> bool:
        """Whether this fellow signs certificates now (admin key, or a live delegation)."""
        if self.setup.issuer is not None:
            return True
        d = self.setup.delegate
        return d is not None and d.delegation.valid(self.setup.admin_key, now_s) \
            and not self.gate.revoked(node_id_of(d.identity.public_key), "")

    def status(self) -> AdmissionStateDoc:
        """What ``status --json`` shows of admission."""
        out: AdmissionStateDoc = {"admin_key": self.setup.admin_key.hex()[:16],
                                  "issues": self.issues(wall_s()),
                                  "delegated": self.setup.delegate is not None,
                                  "revocations": self.gate.revocation_count,
                                  "refused_asks": self.refused_asks,
                                  "relayed_asks": self.relayed_asks,
                                  "issued": len(self._issued),
                                  "certificate": None}
        try:
            cert = Certificate.decode(self.certificate)
        except AuthenticationError:
            return out
        out["certificate"] = CertificateDoc(
            invitation=cert.invitation_id.hex()[:8], slot=cert.slot, uses=cert.uses,
            expires_at_s=cert.expires_at_s, max_priority=cert.max_priority,
            issuer="admin" if cert.delegation is None else
            node_id_of(cert.issuer_key).hex())
        if self.setup.delegate is not None:
            out["delegation_expires_at_s"] = self.setup.delegate.delegation.expires_at_s
        return out

    # --- our own certificate ------------------------------------------------------------

    def capped_priority(self, priority: int) -> int:
        """Our leader priority as our certificate allows it (announcing more would only get
        our Alive refused)."""
        try:
            cap = Certificate.decode(self.certificate).max_priority
        except AuthenticationError:
            return priority
        if priority > cap:
            log.warning("%s: leader priority %d is above the %d our certificate allows; "
                        "announcing %d", self._name, priority, cap, cap)
        return min(priority, cap)

    async def obtain(self, call: Any, seeds: tuple[str, ...]) -> bytes:
        """Our certificate: the one we hold, else one asked of the seeds with our
        invitation (``call(addr, request, timeout_s=...)`` sends one stream request)."""
        self.gate.wall_offset_s = time.time() - trio.current_time()
        issuer = self.setup.issuer
        if issuer is not None and not self._own_certificate_fits():
            # the admin's own fellow admits itself, under an invitation of its own
            founder = issuer.invite(founder_invitation_id(issuer.public_key), 1,
                                    wall_s() + 86400, max_priority=MAX_LEADER_PRIORITY)
            cert = Certificate.issue(issuer.identity, founder, self._identity.public_key,
                                     self._name[:64], 0, wall_s(), wall_s() + CERTIFICATE_TTL_S)
            self.certificate = cert.encode()
            self._save(lambda s: replace(s, certificate=cert.encode(), invitation=b""))
        if not self.certificate and self.setup.delegate is not None and self.setup.invitation:
            # a delegated issuer admits itself under the invitation it joins with (one use)
            own = AdmitAsk(self.setup.invitation, self._identity.public_key, self._name[:64],
                           2**31 - 1)
            reply = self._answer(own, node_id_of(self._identity.public_key))
            if isinstance(reply, Admitted):
                self.certificate = reply.certificate
                self._save(lambda s: replace(s, certificate=reply.certificate, invitation=b""))
                log.info("%s: admitted itself as a delegated issuer", self._name)
            else:
                log.warning("%s: cannot admit itself as a delegated issuer (%s); asking the "
                            "seeds", self._name, reply.reason)
        if self.certificate:
            return self.certificate
        if not self.setup.invitation:
            raise TokenRefused("this fellow holds no certificate and no invitation: ask the "
                               "swarm's admin for one (`p2pswarm invite`) and join with it")
        if not seeds:
            raise TokenRefused("an invitation is taken to a fellow already in the swarm: "
                               "give the address of the fellow that ran `p2pswarm init`")
        deadline = trio.current_time() + ASK_FOR_S
        delay_s = 0.5
        last = "no answer"
        while True:
            for addr in seeds:
                ask = self._signed_ask()  # fresh each time: an issuer takes recent asks only
                try:
                    reply = await call(addr, ask, timeout_s=ASK_TIMEOUT_S)
                except (SwarmError, OSError, trio.TooSlowError) as exc:
                    last = f"{addr}: {exc}"
                    continue
                if isinstance(reply, AdmitRefused):
                    raise TokenRefused(f"the swarm refused this fellow's invitation: "
                                       f"{reply.reason}")
                if isinstance(reply, Admitted):
                    got, problem = certificate_problem(
                        reply.certificate, self.setup.admin_key, self._identity.public_key,
                        wall_s())
                    if got is None or problem is not None:
                        last = f"{addr} gave a certificate that does not admit us: {problem}"
                        continue
                    self.certificate = reply.certificate
                    self._save(lambda s: replace(s, certificate=reply.certificate,
                                                 invitation=b""))
                    log.info("%s: admitted by %s (slot %d of invitation %s)", self._name, addr,
                             got.slot, got.invitation_id.hex()[:8])
                    return self.certificate
            if trio.current_time() >= deadline:
                raise TokenRefused(f"no fellow answered this fellow's invitation in "
                                   f"{ASK_FOR_S:.0f} s (last: {last}); is the address the "
                                   "one of a fellow in the swarm?")
            await trio.sleep(delay_s)
            delay_s = min(delay_s * 2, 8.0)

    def _signed_ask(self) -> AdmitAsk:
        name, priority, at_s = self._name[:64], 2**31 - 1, wall_s()
        signature = self._identity.sign(ask_signed_bytes(
            self.setup.invitation, self._identity.public_key, name, priority, at_s))
        return AdmitAsk(self.setup.invitation, self._identity.public_key, name, priority,
                        at_s, signature)

    def _own_certificate_fits(self) -> bool:
        try:
            cert = Certificate.decode(self.certificate)
        except AuthenticationError:
            return False
        return cert.public_key == self._identity.public_key and cert.name == self._name[:64]

    # --- issuing ------------------------------------------------------------------------

    async def on_ask(self, msg: AdmitAsk, stream: SecureStream) -> Any:
        """A joiner asks for its certificate (or a seed relays a joiner's ask)."""
        direct = node_id_of(msg.public_key) == stream.peer_node_id
        if not self.issues(wall_s()) and msg.invitation != b"\x00":
            if not direct:
                return None  # relayed asks are never relayed again: nothing to say
            return await self._relay(msg, stream.peer_addr.rpartition(":")[0]
                                     or stream.peer_addr)
        reply = self._answer(msg, stream.peer_node_id)
        if isinstance(reply, AdmitRefused):
            self.refused_asks += 1
            log.info("%s: refused an invitation from %s: %s", self._name, stream.peer_addr,
                     reply.reason)
        return reply

    async def _relay(self, msg: AdmitAsk, joiner_addr: str) -> Any:
        """Ask an issuer for the joiner, and answer with the issuer's answer. None (the
        joiner asks again) while a relay for its address is under way or too many are."""
        if joiner_addr in self._relaying or len(self._relaying) >= MAX_RELAYS \
                or self.call is None or self.issuer_addrs is None:
            return None
        addrs = list(self.issuer_addrs())[:MAX_RELAY_ISSUERS]
        if not addrs:
            return None  # none known yet (metadata still on its way): the joiner asks again
        self._relaying.add(joiner_addr)
        self.relayed_asks += 1
        try:
            # the whole relay within one budget, below the joiner's own wait for its answer
            with trio.move_on_after(RELAY_TIMEOUT_S):
                for addr in addrs:
                    try:
                        reply = await self.call(addr, msg, timeout_s=RELAY_TIMEOUT_S)
                    except (SwarmError, OSError, trio.TooSlowError) as exc:
                        log.info("%s: relaying an ask to %s failed: %s", self._name, addr, exc)
                        continue
                    if isinstance(reply, (Admitted, AdmitRefused)):
                        log.info("%s: relayed %s's ask to %s", self._name, joiner_addr, addr)
                        return reply
            return None
        finally:
            self._relaying.discard(joiner_addr)

    def _signer(self) -> tuple[Identity, Delegation | None] | None:
        if self.setup.issuer is not None:
            return self.setup.issuer.identity, None
        d = self.setup.delegate
        if d is not None and self.issues(wall_s()):
            return d.identity, d.delegation
        return None

    def _answer(self, msg: AdmitAsk, peer: bytes) -> Admitted | AdmitRefused:
        signer = self._signer()
        if signer is None:
            return AdmitRefused("this fellow does not issue certificates (no admin key, no "
                                "live delegation)")
        if node_id_of(msg.public_key) != peer:  # relayed: the joiner's signature proves it
            problem = ask_problem(msg.invitation, msg.public_key, msg.name, msg.priority,
                                  msg.asked_at_s, msg.signature, wall_s())
            if problem is not None:
                return AdmitRefused(f"the key asked for is not the one this stream's "
                                    f"handshake proved, and {problem}")
            peer = node_id_of(msg.public_key)
        if self.gate.revoked(peer, msg.name):
            return AdmitRefused("this fellow was revoked by the admin")
        try:
            invitation = Invitation.decode(msg.invitation)
        except AuthenticationError:
            return AdmitRefused("the invitation is not readable")
        if len(self._issued) >= MAX_KEPT:
            return AdmitRefused("this issuer keeps no more certificates")
        identity, delegation = signer
        got = issue_under(identity, self.setup.admin_key, invitation, msg.public_key,
                          msg.name, msg.priority, wall_s(),
                          # slots other issuers gave, as this view holds them, are taken too
                          [*self._issued, *self.gate.slots.holders()], delegation=delegation)
        if isinstance(got, str):
            return AdmitRefused(got)
        if got not in self._issued and got.issuer_key == identity.public_key:
            self._issued.append(got)
            data = got.encode()
            self._save(lambda s: replace(s, issued=(*s.issued, data)))
        return Admitted(got.encode())

    # --- revocations --------------------------------------------------------------------

    def revocations_changed(self) -> bool:
        return self.gate.revocation_count != len(self.setup.revocations)

    def keep_revocations(self, revocations: tuple[bytes, ...]) -> None:
        """Keep in the home the revocations the membership took in (new ones only)."""
        known = set(self.setup.revocations)
        new = [r for r in revocations if r not in known]
        if not new:
            return
        self.setup = replace(self.setup, revocations=(*self.setup.revocations, *new))
        for data in new:
            try:
                rev = Revocation.decode(data)
            except AuthenticationError:
                continue
            if rev.node_id:
                self.barred.add(rev.node_id)

            def add(s: AdmissionState, data: bytes = data) -> AdmissionState:
                return s.with_revocation(data)

            self._save(add)

    def _save(self, change: Any) -> None:
        if self._home is None:
            return
        files = AdmissionHome(self._home)
        try:
            state = files.load() or AdmissionState(self.setup.admin_key)
            files.save(change(state))
        except ConfigError as exc:
            log.warning("%s: cannot keep admission state: %s", self._name, exc)





async def legacy_join_refused(call: Any, seeds: tuple[str, ...], public_key: bytes,
                              name: str) -> TokenRefused | None:
    """Whether a seed runs admission (it answers an ask without an invitation with a
    refusal): then a plain token admits nothing, and the joiner is told so. A seed made
    before invitations closes the stream at the unknown ask: nothing to say."""
    ask = AdmitAsk(b"\x00", public_key, name[:64] or "?", 0)
    for addr in seeds:
        try:
            reply = await call(addr, ask, timeout_s=ASK_TIMEOUT_S)
        except (SwarmError, OSError, trio.TooSlowError):
            continue
        if isinstance(reply, AdmitRefused):
            return TokenRefused(
                "this swarm admits fellows by invitation only, and a plain join token is "
                "no invitation: ask the swarm's admin for one (`p2pswarm invite` on the "
                "fellow that ran `p2pswarm init`) and join with it")
        return None
    return None


def issuer_addrs(fellows: Iterable[Member]) -> list[str]:
    """Fellows present that say (in their signed metadata) they issue certificates."""
    out = []
    for m in fellows:
        if not m.present or not m.metadata:
            continue
        try:
            doc = msgpack.unpackb(m.metadata, raw=False, strict_map_key=False)
        except (ValueError, msgpack.UnpackException):
            continue
        if isinstance(doc, dict) and doc.get(ISSUER_METADATA_KEY) is True:
            out.append(m.addr)
    return out


async def no_admission(message: Any, stream: SecureStream) -> None:
    """A swarm made before invitations: nothing to say to an ask (not a drop)."""
    return None


__all__ = ["Admission", "AdmissionSetup", "issuer_addrs", "legacy_join_refused", "no_admission"]
