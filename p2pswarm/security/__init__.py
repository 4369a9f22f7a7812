"""Swarm secrets, keyrings, node identities, datagram sealing and the stream handshake.

Theory of operation
-------------------
A swarm is closed by one 32-byte secret, handed to new fellows as a join token
(``token``). From each secret the ``keyring`` derives separate keys for datagrams, streams
and the handshake MAC, and rotates secrets without downtime. Each fellow has a long-term
Ed25519 ``identity`` that fixes its node id. Datagrams are sealed and de-duplicated by
``datagrams``; streams are authenticated and sealed after the ``handshake``.

This package is pure: no clock, no sockets, no global random; key material comes from
``os.urandom`` through ``cryptography``.
"""

from p2pswarm.security.datagrams import DatagramSealer, OpenedDatagram
from p2pswarm.security.handshake import (
    SUITE_AES256GCM,
    SUITE_CHACHA20POLY1305,
    ClientHandshake,
    ServerHandshake,
    StreamCipher,
)
from p2pswarm.security.identity import (
    NODE_ID_BYTES,
    PUBLIC_KEY_BYTES,
    SIGNATURE_BYTES,
    Identity,
    node_id_of,
    verify,
)
from p2pswarm.security.keyring import KEY_ID_BYTES, Keyring, SwarmKey
from p2pswarm.security.token import SECRET_BYTES, SwarmSecret

__all__ = [
    "KEY_ID_BYTES",
    "NODE_ID_BYTES",
    "PUBLIC_KEY_BYTES",
    "SECRET_BYTES",
    "SIGNATURE_BYTES",
    "SUITE_AES256GCM",
    "SUITE_CHACHA20POLY1305",
    "ClientHandshake",
    "DatagramSealer",
    "OpenedDatagram",
    "Identity",
    "Keyring",
    "ServerHandshake",
    "StreamCipher",
    "SwarmKey",
    "SwarmSecret",
    "node_id_of",
    "verify",
]
