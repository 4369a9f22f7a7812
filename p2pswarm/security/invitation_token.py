"""The invitation token: the swarm secret and an admin-signed invitation, to copy and paste.

``p2pi1-`` then Crockford base32 of secret || invitation || checksum (4 bytes of SHA-256),
no dashes needed (dashes and whitespace anywhere are ignored). The secret lets the holder
complete a handshake; the invitation, not the secret, gets it a certificate. A plain
``p2ps1-`` token (the secret alone) still parses as ``SwarmSecret``; see ``docs/security.md``
for what it can still do.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass, field

from p2pswarm.errors import AuthenticationError, TokenError
from p2pswarm.security.admission import Invitation
from p2pswarm.security.token import SECRET_BYTES, SwarmSecret

__all__ = ["INVITATION_PREFIX", "InvitationToken", "is_invitation_token"]

INVITATION_PREFIX = "p2pi1-"
_CHECKSUM_BYTES = 4
_MAX_CHARS = 2048
_CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
_DECODE = {c: i for i, c in enumerate(_CROCKFORD)}
_DECODE.update({"I": 1, "L": 1, "O": 0})
_HINT = "copy it again from the output of `p2pswarm invite`"


def is_invitation_token(text: str) -> bool:
    return "".join(text.split()).lower().startswith(INVITATION_PREFIX)


def _checksum(raw: bytes) -> bytes:
    return hashlib.sha256(b"p2pswarm-invitation-token\x00" + raw).digest()[:_CHECKSUM_BYTES]


@dataclass(frozen=True, slots=True)
class InvitationToken:
    secret: SwarmSecret = field(repr=False)
    invitation: Invitation

    def text(self) -> str:
        raw = self.secret.raw + self.invitation.encode()
        payload = raw + _checksum(raw)
        bits = len(payload) * 8
        chars = -(-bits // 5)
        number = int.from_bytes(payload, "big") << (chars * 5 - bits)
        body = "".join(_CROCKFORD[(number >> (5 * (chars - 1 - i))) & 31] for i in range(chars))
        return INVITATION_PREFIX + body

    @classmethod
    def parse(cls, text: str) -> InvitationToken:
        """Parse an invitation token; errors never echo it (it holds the swarm secret)."""
        compact = "".join(text.split()).replace("-", "")
        prefix = INVITATION_PREFIX.replace("-", "")
        if not compact.lower().startswith(prefix) or len(compact) > _MAX_CHARS:
            raise TokenError(f"this is not a p2pswarm invitation: one starts with "
                             f"`{INVITATION_PREFIX}`; {_HINT}")
        body = compact[len(prefix):].upper()
        if any(c not in _DECODE for c in body):
            raise TokenError(f"the invitation has characters that cannot be in one; {_HINT}")
        bits = len(body) * 5
        whole = bits // 8
        if whole <= SECRET_BYTES + _CHECKSUM_BYTES:
            raise TokenError(f"the invitation is cut short; {_HINT}")
        number = 0
        for c in body:
            number = (number << 5) | _DECODE[c]
        pad = bits - whole * 8
        if pad >= 5 or number & ((1 << pad) - 1):
            raise TokenError(f"join token is mistyped: checksum does not match; {_HINT}")
        payload = (number >> pad).to_bytes(whole, "big")
        raw, checksum = payload[:-_CHECKSUM_BYTES], payload[-_CHECKSUM_BYTES:]
        if not hmac.compare_digest(checksum, _checksum(raw)):
            raise TokenError(f"join token is mistyped: checksum does not match; {_HINT}")
        try:
            invitation = Invitation.decode(raw[SECRET_BYTES:])
        except AuthenticationError:
            raise TokenError(f"the invitation does not hold a readable invitation; {_HINT}"
                             ) from None
        return cls(SwarmSecret(raw[:SECRET_BYTES]), invitation)
