"""Swarm keys derived from the secrets, and the keyring that rotates them.

From each secret HKDF derives separate keys (datagrams, streams, handshake MAC) and a 4-byte
key id that travels in every sealed datagram and hello so the receiver knows which key to
try. A ``Keyring`` holds several secrets: one primary seals, all open, which gives
memberlist's rolling rotation (install new everywhere, use new everywhere, remove old
everywhere).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from p2pswarm.errors import ConfigError
from p2pswarm.security.token import SwarmSecret

__all__ = ["KEY_ID_BYTES", "Keyring", "SwarmKey"]

KEY_ID_BYTES = 4

_KDF_SALT = b"p2pswarm swarm key v1"


def _derive(secret: bytes, label: bytes, length: int) -> bytes:
    return HKDF(hashes.SHA256(), length, _KDF_SALT, label).derive(secret)


@dataclass(frozen=True, slots=True)
class SwarmKey:
    """The keys derived from one swarm secret; ``key_id`` names it on the wire."""

    secret: SwarmSecret = field(repr=False)
    key_id: bytes
    datagram_key: bytes = field(repr=False)
    stream_key: bytes = field(repr=False)  # salt of the session key derivation
    handshake_key: bytes = field(repr=False)  # HMAC key of the hellos

    @classmethod
    def derive(cls, secret: SwarmSecret) -> SwarmKey:
        raw = secret.raw
        return cls(
            secret=secret,
            key_id=_derive(raw, b"key id", KEY_ID_BYTES),
            datagram_key=_derive(raw, b"datagram key", 32),
            stream_key=_derive(raw, b"stream key", 32),
            handshake_key=_derive(raw, b"handshake key", 32),
        )


class Keyring:
    """Swarm keys in order; the primary seals, every key opens.

    Rotation without downtime: ``install`` the new secret on every fellow, then ``use``
    it on every fellow, then ``remove`` the old one everywhere. At every point of that
    rolling change any two fellows hold the key the other seals with.
    """

    def __init__(self, secrets: Iterable[SwarmSecret], primary_key_id: bytes | None = None):
        self._keys: dict[bytes, SwarmKey] = {}
        for secret in secrets:
            self._add(secret)
        if not self._keys:
            raise ConfigError("a keyring needs at least one swarm secret")
        if primary_key_id is None:
            primary_key_id = next(iter(self._keys))
        self._primary = self._lookup(primary_key_id)

    def _add(self, secret: SwarmSecret) -> SwarmKey:
        key = SwarmKey.derive(secret)
        existing = self._keys.get(key.key_id)
        if existing is not None:
            if existing.secret != secret:
                # 1 in 2**32 per pair of secrets; refuse rather than guess.
                raise ConfigError(
                    f"two swarm secrets share key id {key.key_id.hex()}; generate another"
                )
            return existing
        self._keys[key.key_id] = key
        return key

    def _lookup(self, key_id: bytes) -> SwarmKey:
        key = self._keys.get(key_id)
        if key is None:
            held = ", ".join(k.hex() for k in self._keys)
            raise ConfigError(f"no key {key_id.hex()} in the keyring (it holds {held})")
        return key

    @property
    def primary(self) -> SwarmKey:
        return self._primary

    @property
    def primary_key_id(self) -> bytes:
        return self._primary.key_id

    @property
    def keys(self) -> tuple[SwarmKey, ...]:
        return tuple(self._keys.values())

    @property
    def key_ids(self) -> tuple[bytes, ...]:
        return tuple(self._keys)

    @property
    def secrets(self) -> tuple[SwarmSecret, ...]:
        return tuple(k.secret for k in self._keys.values())

    def get(self, key_id: bytes) -> SwarmKey | None:
        """The key with this id, or None; used on every received packet, so cheap."""
        return self._keys.get(key_id)

    def __contains__(self, key_id: object) -> bool:
        return key_id in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def __repr__(self) -> str:
        ids = ", ".join(k.hex() for k in self._keys)
        return f"Keyring(key_ids=[{ids}], primary={self._primary.key_id.hex()})"

    def install(self, secret: SwarmSecret) -> bytes:
        """Add a key that opens but does not seal yet; returns its key id. Idempotent."""
        return self._add(secret).key_id

    def use(self, key_id: bytes) -> None:
        """Seal with this (installed) key from now on."""
        self._primary = self._lookup(key_id)

    def remove(self, key_id: bytes) -> None:
        key = self._lookup(key_id)
        if key is self._primary:
            raise ConfigError(
                f"key {key_id.hex()} is the primary key; `use` another key before removing it"
            )
        del self._keys[key_id]

