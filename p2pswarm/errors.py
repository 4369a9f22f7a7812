"""One error tree for everything p2pswarm raises on purpose.

    SwarmError
    ├── ProtocolError
    │   ├── LocalProtocolError      we were about to send something invalid (a bug here)
    │   └── RemoteProtocolError     a peer sent something invalid; drop it and count it
    │       ├── VersionMismatch     the peer speaks a protocol major version we do not
    │       └── AuthenticationError the bytes are not sealed under a key we hold,
    │                               tampered with, replayed, or badly signed
    ├── TransportError              sockets and streams: refused, reset, closed, timed out
    │   ├── VersionRefused          the peer refused our protocol version (wire.versions)
    │   └── HandshakeRefused        the peer took the stream and closed it at our hello
    │       └── KeyRefused          ... answering, bound to our hello, that our key is not its
    ├── ConfigError                 bad settings, bad arguments, unusable state directory
    │   └── TokenError              a join token that is mistyped or malformed
    │       └── TokenRefused        the seeds refuse the token: it is another swarm's
    ├── FellowRevoked               the swarm's admin revoked this fellow (its home is kept)
    ├── ControlError                the local agent could not be reached or refused a request
    ├── PlacementError              the planner cannot place what was asked
    │   ├── PlanChanged             a pinned plan_id no longer matches the live view (409)
    │   ├── Busy                    every session slot taken and the queue full (429)
    │   ├── NotLeader               a call reached a fellow that does not lead (ask the next)
    │   └── ReplicaLost             a training replica lost a fellow (the job goes on or waits)
    └── HttpError                   an HTTP API answer that is an error (http.problems: code,
                                    sentence, status)

Only the CLI turns these into exit codes and text. OS and trio errors are translated at
the transport boundary with ``raise ... from exc``.
"""

from __future__ import annotations

from typing import Any


class SwarmError(Exception):
    """Root of every error p2pswarm raises on purpose."""


class ProtocolError(SwarmError):
    """Something on the wire does not follow the protocol."""

    def __init__(self, reason: str, detail: str = "") -> None:
        self.reason = reason  # short machine-readable reason, used as a counter key
        self.detail = detail
        super().__init__(f"{reason}: {detail}" if detail else reason)


class LocalProtocolError(ProtocolError):
    """We tried to encode or send something the protocol does not allow."""


class RemoteProtocolError(ProtocolError):
    """A peer sent bytes that do not decode to a valid message."""


class VersionMismatch(RemoteProtocolError):
    """The peer speaks a protocol major version this node does not."""


class AuthenticationError(RemoteProtocolError):
    """Wrong key, tampered bytes, a replay, or a bad signature."""


class TransportError(SwarmError):
    """A datagram or stream operation failed."""


class VersionRefused(TransportError):
    """The peer answered with a ``Refusal``: its protocol and ours are two or more apart."""


class HandshakeRefused(TransportError):
    """The peer answered the connection, then closed it at our hello instead of answering
    it: it does not hold our swarm's key (or is not a p2pswarm fellow at all). Silence (no
    connection, no answer in time) is a plain TransportError."""


class KeyRefused(HandshakeRefused):
    """The peer read our hello and answered, in a refusal bound to that hello, that it does
    not hold the key it is sealed under: our token is not its swarm's. Unlike a close or
    silence, which a busy or flooded listener also gives, this alone means a wrong token."""


class NobodyListens(TransportError):
    """The peer's machine answered that nothing listens at the address (TCP connection
    refused): the fellow's process is gone, not silent behind a fading link."""


class ConfigError(SwarmError):
    """Bad configuration, arguments or state directory; the message says how to fix it."""


class TokenError(ConfigError):
    """A join token that cannot be used."""


class TokenRefused(TokenError):
    """The seeds answered and refused every handshake: the join token is not their
    swarm's."""


class FellowRevoked(SwarmError):
    """The swarm's admin key revoked this fellow: it is no member any more."""


class ControlError(SwarmError):
    """The local control API could not be reached, or refused the request."""


class PlacementError(SwarmError):
    """The planner cannot place what was asked."""


class ReplicaLost(PlacementError):
    """A training replica lost a fellow or a stage failed: it is paused, the job goes on."""


class EveryReplicaLost(ReplicaLost):
    """A job of several replicas lost every one: it goes on from its checkpoint, placed
    again as fellows come back."""


class WeightsCacheFull(PlacementError):
    """This fellow's weights cache cannot take a tensor (``storage.weights_cache_bytes``):
    no other sender would change that."""


class NotLeader(PlacementError):
    """A call for the leader reached a fellow that does not lead (it lost the election, or
    never won one): the caller may ask the leader of the moment instead."""


class NotFollowingYet(PlacementError):
    """An order reached a fellow that has not heard of the ordering leader or its term
    yet (it has just started or rejoined, or news of the election is still on its way):
    the same order a moment later is obeyed, so the leader offers it again briefly."""


class Busy(PlacementError):
    """A load's session slots are all taken and its queue is full: come back later (429)."""

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class PlanChanged(PlacementError):
    """A pinned plan no longer matches the live view: HTTP-style code 409."""

    code = 409

    def __init__(self, expected_plan_id: str, new_plan_id: str, changes: list[str],
                 new_plan: Any = None) -> None:
        self.expected_plan_id = expected_plan_id
        self.new_plan_id = new_plan_id
        self.changes = list(changes)
        self.new_plan = new_plan
        what = "; ".join(self.changes) if self.changes else "the live view differs"
        super().__init__(
            f"plan-changed (409): plan {expected_plan_id} is now {new_plan_id}: {what}"
        )
