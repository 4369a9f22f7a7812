"""What a home keeps of admission: the admin key (one machine only) and the admission file.

Layout (beside ``home.py``'s files; mode 0600, written atomically)::

    HOME/admin.json      {"format": "p2pswarm-admin", "version": 1,
                          "ed25519_private_key": "<hex>"}          the swarm's admin key
    HOME/issuer.json     {"format": "p2pswarm-issuer", "version": 1,
                          "ed25519_private_key": "<hex>", "delegation": "<hex>"}
                                                    a delegated issuer (``p2pswarm delegate``)
    HOME/admission.json  {"format": "p2pswarm-admission", "version": 1,
                          "admin_public_key": "<hex>", "certificate": "<hex>" | "",
                          "invitation": "<hex>" | "", "revocations": ["<hex>", ...],
                          "issued": [{"certificate": "<hex>"}, ...]}

A home without ``admission.json`` is a swarm made before invitations: its agent runs as
before (no certificates asked or checked) until ``p2pswarm init --upgrade`` (on the
machine that ran ``init``) or a join with an invitation writes one.
"""

from __future__ import annotations

import json
import stat
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from p2pswarm.errors import AuthenticationError, ConfigError
from p2pswarm.home import write_private
from p2pswarm.security.admission import AdminKey, Certificate, Delegation, _Reader
from p2pswarm.security.identity import Identity

__all__ = ["AdmissionHome", "AdmissionState", "IssuerBundle"]

_ADMIN_FORMAT = "p2pswarm-admin"
_STATE_FORMAT = "p2pswarm-admission"
_ISSUER_FORMAT = "p2pswarm-issuer"
_VERSION = 1
MAX_KEPT = 4096  # revocations or certificates issued: bounded like the gate's


@dataclass(frozen=True, slots=True)
class AdmissionState:
    admin_key: bytes
    certificate: bytes = b""  # ours (b"": still to ask for, with ``invitation``)
    invitation: bytes = b""  # the invitation we joined with, until we hold a certificate
    revocations: tuple[bytes, ...] = ()
    issued: tuple[bytes, ...] = field(default=(), repr=False)  # certificates we gave

    def with_revocation(self, data: bytes) -> AdmissionState:
        if data in self.revocations or len(self.revocations) >= MAX_KEPT:
            return self
        return replace(self, revocations=(*self.revocations, data))

    def issued_certificates(self) -> list[Certificate]:
        out = []
        for data in self.issued:
            try:
                out.append(Certificate.decode(data))
            except AuthenticationError:
                continue
        return out


def _hex(document: dict[str, Any], key: str) -> bytes:
    value = document.get(key, "")
    if not isinstance(value, str):
        raise ValueError(f"{key} is not a hex string")
    return bytes.fromhex(value)


@dataclass(frozen=True, slots=True, eq=False)
class IssuerBundle:
    """A delegated issuer: its own key and the admin-signed delegation naming that key."""

    identity: Identity
    delegation: Delegation

    def document(self) -> dict[str, Any]:
        return {"format": _ISSUER_FORMAT, "version": _VERSION,
                "ed25519_private_key": self.identity.private_bytes().hex(),
                "delegation": self.delegation.encode().hex()}

    @classmethod
    def read(cls, path: Path, *, private: bool = True) -> IssuerBundle:
        """The bundle in ``path``; ConfigError (one line) if it is not one. ``private``:
        refuse a file other users may read (a Docker secret is given as read-only by all
        of its container, so a bundle handed in is copied into the home instead)."""
        document = _read_private(path, _ISSUER_FORMAT, private=private)
        try:
            identity = Identity.from_private_bytes(_hex(document, "ed25519_private_key"))
            raw = _hex(document, "delegation")
            if len(raw) > 1024:
                raise ValueError("the delegation is too long")
            r = _Reader(raw)
            delegation = Delegation.read(r)
            r.end()
        except (ValueError, ConfigError, AuthenticationError) as exc:
            raise ConfigError(f"{path} is not a usable issuer bundle: {exc}") from None
        if delegation.delegate_key != identity.public_key:
            raise ConfigError(f"{path} is not a usable issuer bundle: its delegation names "
                              "another key")
        return cls(identity, delegation)


@dataclass(frozen=True, slots=True)
class AdmissionHome:
    path: Path

    @property
    def admin_path(self) -> Path:
        return self.path / "admin.json"

    @property
    def state_path(self) -> Path:
        return self.path / "admission.json"

    # --- the admin key ------------------------------------------------------------------

    def has_admin(self) -> bool:
        return self.admin_path.exists()

    def make_admin(self) -> AdminKey:
        if self.has_admin():
            return self.load_admin()
        admin = AdminKey.generate()
        self.save_admin(admin)
        return admin

    def save_admin(self, admin: AdminKey) -> None:
        write_private(self.admin_path, {"format": _ADMIN_FORMAT, "version": _VERSION,
                                        "ed25519_private_key": admin.private_bytes().hex()})

    def load_admin(self) -> AdminKey:
        document = self._read(self.admin_path, _ADMIN_FORMAT)
        try:
            return AdminKey.from_private_bytes(_hex(document, "ed25519_private_key"))
        except (ValueError, ConfigError) as exc:
            raise ConfigError(f"{self.admin_path} is not a usable admin key: {exc}") from None

    # --- a delegated issuer ---------------------------------------------------------------

    @property
    def issuer_path(self) -> Path:
        return self.path / "issuer.json"

    def load_issuer(self) -> IssuerBundle | None:
        return IssuerBundle.read(self.issuer_path) if self.issuer_path.exists() else None

    def save_issuer(self, bundle: IssuerBundle) -> None:
        write_private(self.issuer_path, bundle.document())

    # --- the admission file -------------------------------------------------------------

    def load(self) -> AdmissionState | None:
        """What this home keeps of admission; None: a home made before invitations."""
        if not self.state_path.exists():
            return None
        document = self._read(self.state_path, _STATE_FORMAT)
        try:
            revocations = document.get("revocations", [])
            issued = document.get("issued", [])
            if not isinstance(revocations, list) or not isinstance(issued, list):
                raise ValueError("revocations and issued are lists")
            return AdmissionState(
                _hex(document, "admin_public_key"), _hex(document, "certificate"),
                _hex(document, "invitation"),
                tuple(bytes.fromhex(str(r)) for r in revocations[:MAX_KEPT]),
                tuple(bytes.fromhex(str(i.get("certificate", ""))) for i in issued[:MAX_KEPT]
                      if isinstance(i, dict)))
        except (ValueError, AttributeError) as exc:
            raise ConfigError(f"{self.state_path} is not a usable admission file: {exc}"
                              ) from None

    def save(self, state: AdmissionState) -> None:
        write_private(self.state_path, {
            "format": _STATE_FORMAT, "version": _VERSION,
            "admin_public_key": state.admin_key.hex(),
            "certificate": state.certificate.hex(),
            "invitation": state.invitation.hex(),
            "revocations": [r.hex() for r in state.revocations],
            "issued": [{"certificate": c.hex()} for c in state.issued],
        })

    def _read(self, path: Path, expected: str) -> dict[str, Any]:
        return _read_private(path, expected)


def _read_private(path: Path, expected: str, *, private: bool = True) -> dict[str, Any]:
    """A JSON document of ``expected`` format (that only its owner may read: ``private``)."""
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
        if path.stat().st_size > 65536:
            raise ConfigError(f"{path} is too large for a {expected} file")
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path} is not a {expected} file (not text)") from None
    if private and mode & 0o077:
        raise ConfigError(f"{path} is readable by other users (mode {mode:04o}); run: "
                          f"chmod 600 {path}")
    try:
        document = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(document, dict) or document.get("format") != expected \
            or document.get("version") != _VERSION:
        raise ConfigError(f"{path} is not a {expected} file of version {_VERSION}")
    return document
