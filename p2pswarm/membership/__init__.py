"""Membership: who is in the swarm, alive or not, and what each fellow says of itself.

A sans-I/O SWIM + Lifeguard state machine (``Membership``) and the values it deals in.
Importing this package registers the membership and election wire messages.
"""

from p2pswarm.effects import Effect, Event, SendDatagram, StreamRequest
from p2pswarm.membership.machine import Membership, meta_signed_bytes
from p2pswarm.membership.member import LocalNode, Member, MemberState, node_id_of
from p2pswarm.membership.timing import Tuning, retransmit_limit, suspicion_timeout_s

__all__ = [
    "Effect",
    "Event",
    "LocalNode",
    "Member",
    "MemberState",
    "Membership",
    "SendDatagram",
    "StreamRequest",
    "Tuning",
    "meta_signed_bytes",
    "node_id_of",
    "retransmit_limit",
    "suspicion_timeout_s",
]
