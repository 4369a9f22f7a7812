"""The join token: the swarm secret, written for people to copy and retype.

A swarm is closed by one 32-byte secret, handed to new fellows as a join token.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
from dataclasses import dataclass, field

from p2pswarm.errors import ConfigError, TokenError

__all__ = ["SECRET_BYTES", "SwarmSecret"]

SECRET_BYTES = 32

_TOKEN_VERSION = 1
_TOKEN_PREFIX = f"p2ps{_TOKEN_VERSION}-"
_CHECKSUM_BYTES = 4
_TOKEN_GROUP_CHARS = 5
# Crockford base32: no I, L, O, U, so the token survives being read aloud or retyped.
_CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
_CROCKFORD_DECODE = {c: i for i, c in enumerate(_CROCKFORD)}
_CROCKFORD_DECODE.update({"I": 1, "L": 1, "O": 0})  # the usual misreadings
_TOKEN_PAYLOAD_BITS = (SECRET_BYTES + _CHECKSUM_BYTES) * 8
_TOKEN_CHARS = -(-_TOKEN_PAYLOAD_BITS // 5)  # 58
_TOKEN_PAD_BITS = _TOKEN_CHARS * 5 - _TOKEN_PAYLOAD_BITS  # 2, must decode as zero
_TOKEN_VERSION_RE = re.compile(r"p2ps(\d+)-", re.IGNORECASE)
_RETYPE_HINT = "copy it again from the fellow that ran `p2pswarm init`"


def _token_checksum(raw: bytes) -> bytes:
    return hashlib.sha256(raw).digest()[:_CHECKSUM_BYTES]


@dataclass(frozen=True, slots=True)
class SwarmSecret:
    """The 32 random bytes that close a swarm. Never logged: repr shows nothing secret."""

    raw: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.raw, bytes) or len(self.raw) != SECRET_BYTES:
            raise ConfigError(f"a swarm secret is {SECRET_BYTES} bytes")

    @classmethod
    def generate(cls) -> SwarmSecret:
        return cls(os.urandom(SECRET_BYTES))

    def token(self) -> str:
        """``p2ps1-`` and Crockford base32 of secret || checksum, in dash-separated groups."""
        payload = self.raw + _token_checksum(self.raw)
        number = int.from_bytes(payload, "big") << _TOKEN_PAD_BITS
        chars = [
            _CROCKFORD[(number >> (5 * (_TOKEN_CHARS - 1 - i))) & 31] for i in range(_TOKEN_CHARS)
        ]
        body = "".join(chars)
        groups = [body[i : i + _TOKEN_GROUP_CHARS] for i in range(0, len(body), _TOKEN_GROUP_CHARS)]
        return _TOKEN_PREFIX + "-".join(groups)

    @classmethod
    def from_token(cls, text: str) -> SwarmSecret:
        """Parse a join token: case-insensitive, dashes and whitespace anywhere are ignored.

        Error messages never echo the token: it is the swarm's only secret.
        """
        compact = "".join(text.split())
        match = _TOKEN_VERSION_RE.match(compact)
        if match is None:
            raise TokenError(
                f"this is not a p2pswarm join token: a token starts with `{_TOKEN_PREFIX}`"
            )
        version = int(match.group(1))
        if version != _TOKEN_VERSION:
            raise TokenError(
                f"join token is version {version} (`p2ps{version}-`), this node reads "
                f"version {_TOKEN_VERSION} (`{_TOKEN_PREFIX}`); run the same p2pswarm "
                f"version on every fellow"
            )
        body = compact[match.end() :].replace("-", "").upper()
        bad = [(i, c) for i, c in enumerate(body) if c not in _CROCKFORD_DECODE]
        if bad:
            listed = ", ".join(f"{c!r} at position {i + 1}" for i, c in bad[:5])
            raise TokenError(
                f"join token has characters that cannot be in a token: {listed} "
                f"(counting after `{_TOKEN_PREFIX}`, without dashes; a token uses 0-9 and "
                f"A-Z except U); {_RETYPE_HINT}"
            )
        if len(body) != _TOKEN_CHARS:
            raise TokenError(
                f"join token is mistyped: it has {len(body)} characters after "
                f"`{_TOKEN_PREFIX}` (without dashes), a token has {_TOKEN_CHARS}; "
                f"{_RETYPE_HINT}"
            )
        number = 0
        for c in body:
            number = (number << 5) | _CROCKFORD_DECODE[c]
        pad_mask = (1 << _TOKEN_PAD_BITS) - 1
        payload = (number >> _TOKEN_PAD_BITS).to_bytes(SECRET_BYTES + _CHECKSUM_BYTES, "big")
        raw, checksum = payload[:SECRET_BYTES], payload[SECRET_BYTES:]
        # Non-zero pad bits mean the last character was mistyped in bits the checksum
        # cannot see; report it the same way.
        if number & pad_mask or not hmac.compare_digest(checksum, _token_checksum(raw)):
            raise TokenError(f"join token is mistyped: checksum does not match; {_RETYPE_HINT}")
        return cls(raw)

