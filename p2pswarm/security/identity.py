"""Node identities: a fellow's long-term Ed25519 key pair, its node id, signatures."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from p2pswarm.errors import AuthenticationError, ConfigError
from p2pswarm.security.verified import VerifiedSignatures

__all__ = [
    "NODE_ID_BYTES",
    "PUBLIC_KEY_BYTES",
    "SIGNATURE_BYTES",
    "Identity",
    "VERIFIED",
    "node_id_of",
    "verify",
    "verify_fresh",
]

NODE_ID_BYTES = 16
PUBLIC_KEY_BYTES = 32
SIGNATURE_BYTES = 64


def node_id_of(public_key: bytes) -> bytes:
    """A fellow's node id: the first 16 bytes of SHA-256 of its Ed25519 public key."""
    return hashlib.sha256(public_key).digest()[:NODE_ID_BYTES]


# Checks of signed records that passed, shared by every agent of the process (a simulation
# runs many): a record relayed again is not checked again (``verified``).
VERIFIED = VerifiedSignatures()


def verify(public_key: bytes, signature: bytes, data: bytes) -> None:
    """Raise AuthenticationError("bad-signature") unless ``signature`` is valid. For signed
    records, which arrive again and again: a check that passed is remembered by exactly
    (key, signature, bytes)."""
    if VERIFIED.known(public_key, signature, data):
        return
    verify_fresh(public_key, signature, data)
    VERIFIED.remember(public_key, signature, data)


def verify_fresh(public_key: bytes, signature: bytes, data: bytes) -> None:
    """``verify`` without the memory: for signatures made once, over a handshake's
    transcript, which would only push records out of it."""
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, data)
    except InvalidSignature:
        raise AuthenticationError("bad-signature", "signature does not verify") from None
    except ValueError as exc:
        raise AuthenticationError("bad-signature", f"unusable public key: {exc}") from None


@dataclass(frozen=True, slots=True, eq=False)
class Identity:
    """A fellow's long-term Ed25519 key pair; the public key fixes the node id."""

    _private: Ed25519PrivateKey = field(repr=False)
    public_key: bytes = field(repr=False)
    node_id: bytes

    @classmethod
    def _of(cls, private: Ed25519PrivateKey) -> Identity:
        public = private.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        return cls(private, public, node_id_of(public))

    @classmethod
    def generate(cls) -> Identity:
        return cls._of(Ed25519PrivateKey.generate())

    @classmethod
    def from_private_bytes(cls, raw: bytes) -> Identity:
        try:
            return cls._of(Ed25519PrivateKey.from_private_bytes(raw))
        except ValueError as exc:
            raise ConfigError(f"not an Ed25519 private key: {exc}") from None

    def private_bytes(self) -> bytes:
        return self._private.private_bytes(
            serialization.Encoding.Raw,
            serialization.PrivateFormat.Raw,
            serialization.NoEncryption(),
        )

    def sign(self, data: bytes) -> bytes:
        return self._private.sign(data)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Identity) and other.public_key == self.public_key

    def __hash__(self) -> int:
        return hash(self.public_key)

    def __repr__(self) -> str:
        return f"Identity(node_id={self.node_id.hex()})"

