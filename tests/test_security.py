"""Join tokens, keyrings and rotation, identities, datagram sealing, the stream handshake."""

from __future__ import annotations

import ast
import hashlib
import itertools
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pswarm import security
from p2pswarm.errors import AuthenticationError, ConfigError, LocalProtocolError, TokenError
from p2pswarm.security import (
    SUITE_AES256GCM,
    SUITE_CHACHA20POLY1305,
    ClientHandshake,
    DatagramSealer,
    Identity,
    Keyring,
    ServerHandshake,
    StreamCipher,
    SwarmSecret,
    node_id_of,
    verify,
)

SECRET = SwarmSecret(bytes(range(32)))
OTHER_SECRET = SwarmSecret(bytes(range(100, 132)))
ALPHABET = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
PREFIX = "p2ps1-"


def token_body(token: str) -> str:
    return token[len(PREFIX) :].replace("-", "")


# --------------------------------------------------------------------------- module rules


def test_security_module_is_pure() -> None:
    modules = sorted(Path(security.__file__).parent.glob("*.py"))
    imported: set[str] = set()
    for module in modules:
        for node in ast.walk(ast.parse(module.read_text())):
            if isinstance(node, ast.Import):
                imported.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                imported.add(node.module.split(".")[0])
    assert not imported & {"time", "random", "socket", "trio", "asyncio"}
    assert imported <= {
        "__future__",
        "hashlib",
        "hmac",
        "os",
        "re",
        "struct",
        "threading",
        "collections",
        "dataclasses",
        "typing",
        "cryptography",
        "p2pswarm",
    }


def test_reprs_do_not_show_secrets() -> None:
    identity = Identity.generate()
    keyring = Keyring([SECRET])
    for text in (repr(SECRET), repr(keyring), repr(keyring.primary), repr(identity)):
        assert SECRET.raw.hex() not in text
        assert identity.private_bytes().hex() not in text
        assert SECRET.token() not in text


# --------------------------------------------------------------------------- join tokens


@given(st.binary(min_size=32, max_size=32))
def test_token_round_trips(raw: bytes) -> None:
    secret = SwarmSecret(raw)
    token = secret.token()
    assert token.startswith(PREFIX)
    assert len(token_body(token)) == 58
    assert set(token_body(token)) <= set(ALPHABET)
    assert SwarmSecret.from_token(token) == secret
    # Case, missing dashes and surrounding or wrapped whitespace do not matter.
    assert SwarmSecret.from_token(f"  {token.lower()}\n") == secret
    assert SwarmSecret.from_token(PREFIX + token_body(token)) == secret
    body = token_body(token)
    assert SwarmSecret.from_token(f"{PREFIX}{body[:30]}\n  {body[30:]}") == secret


def test_generated_secrets_differ() -> None:
    assert SwarmSecret.generate() != SwarmSecret.generate()
    assert len(SwarmSecret.generate().raw) == 32


def test_every_one_character_typo_says_checksum_does_not_match() -> None:
    body = token_body(SECRET.token())
    for position, wrong in itertools.product(range(len(body)), ALPHABET):
        if wrong == body[position]:
            continue
        typo = PREFIX + body[:position] + wrong + body[position + 1 :]
        with pytest.raises(TokenError) as info:
            SwarmSecret.from_token(typo)
        assert str(info.value).startswith("join token is mistyped: checksum does not match")


def test_misread_letters_are_read_as_digits() -> None:
    body = token_body(SECRET.token())
    index = next(i for i, c in enumerate(body) if c in "01")
    alias = "O" if body[index] == "0" else "l"
    aliased = PREFIX + body[:index] + alias + body[index + 1 :]
    assert SwarmSecret.from_token(aliased) == SECRET


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("p2ps2-ABCDE-FGHJK", "join token is version 2 (`p2ps2-`), this node reads version 1"),
        ("P2PS0-ABCDE", "join token is version 0"),
        ("swarm-ABCDE-FGHJK", "this is not a p2pswarm join token: a token starts with `p2ps1-`"),
        ("", "this is not a p2pswarm join token"),
    ],
)
def test_wrong_prefix_or_version_is_named(text: str, expected: str) -> None:
    with pytest.raises(TokenError) as info:
        SwarmSecret.from_token(text)
    assert str(info.value).startswith(expected)


def test_bad_characters_are_named() -> None:
    body = token_body(SECRET.token())
    bad = PREFIX + body[:6] + "U" + body[7:40] + "*" + body[41:]
    with pytest.raises(TokenError) as info:
        SwarmSecret.from_token(bad)
    message = str(info.value)
    assert "'U' at position 7" in message
    assert "'*' at position 41" in message
    assert SECRET.token() not in message  # never echo the secret


@pytest.mark.parametrize("cut", [1, 5])
def test_missing_characters_say_how_many(cut: int) -> None:
    body = token_body(SECRET.token())
    with pytest.raises(TokenError) as info:
        SwarmSecret.from_token(PREFIX + body[:-cut])
    assert str(info.value).startswith(
        f"join token is mistyped: it has {58 - cut} characters after `p2ps1-`"
    )


def test_secret_must_be_32_bytes() -> None:
    with pytest.raises(ConfigError):
        SwarmSecret(b"short")


# --------------------------------------------------------------------------- keyring


def test_keyring_keys_are_derived_and_separate() -> None:
    key = Keyring([SECRET]).primary
    assert len(key.key_id) == 4
    derived = {key.datagram_key, key.stream_key, key.handshake_key, SECRET.raw}
    assert len(derived) == 4
    assert Keyring([OTHER_SECRET]).primary.key_id != key.key_id
    assert Keyring([SECRET]).primary == key  # deterministic


def test_keyring_install_use_remove() -> None:
    keyring = Keyring([SECRET])
    old_id = keyring.primary_key_id
    new_id = keyring.install(OTHER_SECRET)
    assert keyring.install(OTHER_SECRET) == new_id  # idempotent
    assert keyring.key_ids == (old_id, new_id)
    assert keyring.primary_key_id == old_id  # installing does not switch sealing
    keyring.use(new_id)
    assert keyring.primary_key_id == new_id
    with pytest.raises(ConfigError, match="primary"):
        keyring.remove(new_id)
    keyring.remove(old_id)
    assert keyring.key_ids == (new_id,)
    assert keyring.secrets == (OTHER_SECRET,)
    with pytest.raises(ConfigError, match="primary"):
        keyring.remove(new_id)  # the last key is always the primary
    with pytest.raises(ConfigError, match="no key"):
        keyring.use(old_id)
    with pytest.raises(ConfigError, match="no key"):
        keyring.remove(b"\0\0\0\0")


def test_keyring_needs_a_key() -> None:
    with pytest.raises(ConfigError):
        Keyring([])
    with pytest.raises(ConfigError):
        Keyring([SECRET], primary_key_id=b"\0\0\0\0")
    assert Keyring([SECRET, OTHER_SECRET]).primary.secret == SECRET
    other_id = Keyring([OTHER_SECRET]).primary_key_id
    assert Keyring([SECRET, OTHER_SECRET], primary_key_id=other_id).primary.secret == OTHER_SECRET


class Fellow:
    def __init__(self, index: int, secret: SwarmSecret) -> None:
        self.keyring = Keyring([secret])
        self.identity = Identity.generate()
        self.sealer = DatagramSealer(self.keyring, self.identity.node_id, epoch=index)


def assert_every_pair_talks(fellows: list[Fellow], step: str) -> None:
    for a, b in itertools.permutations(fellows, 2):
        payload = f"{step} {a.identity.node_id.hex()}".encode()
        assert b.sealer.open(a.sealer.seal(payload)) == (a.identity.node_id, payload), step
        client = ClientHandshake(a.keyring, a.identity)
        server = ServerHandshake(b.keyring, b.identity)
        finish, client_cipher = client.finish(server.respond(client.hello()))
        server_cipher = server.finish(finish)
        assert server_cipher.open_frame(client_cipher.seal_frame(payload)) == payload, step


def test_rolling_rotation_keeps_every_pair_talking() -> None:
    fellows = [Fellow(i, SECRET) for i in range(4)]
    old_id = fellows[0].keyring.primary_key_id
    new_id = Keyring([OTHER_SECRET]).primary_key_id
    assert_every_pair_talks(fellows, "before")
    steps = [
        ("install", lambda f: f.keyring.install(OTHER_SECRET)),
        ("use", lambda f: f.keyring.use(new_id)),
        ("remove", lambda f: f.keyring.remove(old_id)),
    ]
    for name, apply in steps:
        # One fellow at a time: between two of them some have done the step, some not.
        for index, fellow in enumerate(fellows):
            apply(fellow)
            assert_every_pair_talks(fellows, f"{name} on {index + 1} of {len(fellows)}")
    assert all(f.keyring.key_ids == (new_id,) for f in fellows)
    # The old key is gone everywhere: a datagram sealed under it is refused.
    straggler = DatagramSealer(Keyring([SECRET]), b"s" * 16, epoch=1)
    with pytest.raises(AuthenticationError) as info:
        fellows[0].sealer.open(straggler.seal(b"late"))
    assert info.value.reason == "unknown-key"


# --------------------------------------------------------------------------- identity


def test_identity_round_trip_and_node_id() -> None:
    identity = Identity.generate()
    assert len(identity.public_key) == 32
    assert identity.node_id == hashlib.sha256(identity.public_key).digest()[:16]
    assert node_id_of(identity.public_key) == identity.node_id
    again = Identity.from_private_bytes(identity.private_bytes())
    assert again == identity and again.node_id == identity.node_id
    assert Identity.generate() != identity
    with pytest.raises(ConfigError):
        Identity.from_private_bytes(b"short")


def test_signature_verifies_and_rejects() -> None:
    identity = Identity.generate()
    signature = identity.sign(b"inventory v7")
    assert len(signature) == 64
    verify(identity.public_key, signature, b"inventory v7")
    bad_cases = [
        (identity.public_key, signature, b"inventory v8"),
        (Identity.generate().public_key, signature, b"inventory v7"),
        (identity.public_key, bytes([signature[0] ^ 1]) + signature[1:], b"inventory v7"),
        (identity.public_key[:31], signature, b"inventory v7"),
        (identity.public_key, signature[:63], b"inventory v7"),
    ]
    for public_key, sig, data in bad_cases:
        with pytest.raises(AuthenticationError) as info:
            verify(public_key, sig, data)
        assert info.value.reason == "bad-signature"


# --------------------------------------------------------------------------- datagrams

A_ID = b"A" * 16
B_ID = b"B" * 16


def pair(window: int = 1024) -> tuple[DatagramSealer, DatagramSealer]:
    return (
        DatagramSealer(Keyring([SECRET]), A_ID, epoch=10, replay_window=window),
        DatagramSealer(Keyring([SECRET]), B_ID, epoch=20, replay_window=window),
    )


def reason(sealer: DatagramSealer, packet: bytes) -> str:
    with pytest.raises(AuthenticationError) as info:
        sealer.open(packet)
    return info.value.reason


def test_datagram_round_trip_and_overhead() -> None:
    a, b = pair()
    packet = a.seal(b"ping")
    assert b.open(packet) == (A_ID, b"ping")
    assert a.overhead_bytes == 37 + 16
    assert len(a.seal(b"")) == a.overhead_bytes
    assert len(a.seal(b"x" * 1000)) == 1000 + a.overhead_bytes
    assert b.open(bytearray(a.seal(b"as bytearray"))) == (A_ID, b"as bytearray")


def test_datagrams_under_another_swarm_are_refused() -> None:
    a, _ = pair()
    stranger = DatagramSealer(Keyring([OTHER_SECRET]), B_ID, epoch=1)
    assert reason(stranger, a.seal(b"hello")) == "unknown-key"
    # The same key id but another key: the seal does not open.
    forged = bytearray(stranger.seal(b"hello"))
    forged[1:5] = a.seal(b"")[1:5]
    assert reason(a, bytes(forged)) == "bad-seal"


def test_every_flipped_bit_is_refused_with_its_reason() -> None:
    a, b = pair()
    packet = a.seal(b"a sample datagram carrying gossip")
    for bit in range(len(packet) * 8):
        tampered = bytearray(packet)
        tampered[bit // 8] ^= 1 << (bit % 8)
        byte = bit // 8
        expected = "malformed" if byte == 0 else "unknown-key" if byte < 5 else "bad-seal"
        assert reason(b, bytes(tampered)) == expected, f"bit {bit}"
    assert b.open(packet) == (A_ID, b"a sample datagram carrying gossip")  # still fresh


def test_short_packets_are_malformed() -> None:
    a, b = pair()
    packet = a.seal(b"")
    for size in (0, 1, 36, len(packet) - 1):
        assert reason(b, packet[:size]) == "malformed"


def test_replay_is_refused() -> None:
    a, b = pair()
    packet = a.seal(b"suspect C")
    b.open(packet)
    assert reason(b, packet) == "replay"


def test_out_of_order_within_the_window_is_accepted_once() -> None:
    a, b = pair(window=64)
    packets = [a.seal(f"n{i}".encode()) for i in range(100)]
    b.open(packets[99])
    for i in range(36, 99):  # 63 back from the newest: still inside the window
        assert b.open(packets[i]) == (A_ID, f"n{i}".encode())
        assert reason(b, packets[i]) == "replay"
    assert reason(b, packets[35]) == "replay"  # 64 back: outside the window
    assert reason(b, packets[0]) == "replay"


def test_window_is_updated_only_after_authentication() -> None:
    a, b = pair()
    packet = a.seal(b"real")
    tampered = bytearray(packet)
    tampered[-1] ^= 1
    assert reason(b, bytes(tampered)) == "bad-seal"
    assert b.open(packet) == (A_ID, b"real")


def test_a_proven_epoch_makes_older_ones_stale() -> None:
    keyring = Keyring([SECRET])
    receiver = DatagramSealer(keyring, B_ID, epoch=1)
    before = DatagramSealer(keyring, A_ID, epoch=100)
    early = before.seal(b"before restart")
    late = before.seal(b"late, before restart")
    receiver.open(early)
    after = DatagramSealer(keyring, A_ID, epoch=101)  # the same fellow, restarted
    first = after.seal(b"after restart")  # sequence numbers start again at 0
    assert receiver.open(first) == (A_ID, b"after restart")
    # a newer epoch alone proves nothing (anyone with the key can seal one)...
    assert receiver.open(late) == (A_ID, b"late, before restart")
    # ...until the fellow proves it with something it signed in that epoch
    assert receiver.confirm(A_ID, 101, incarnation=3)
    assert reason(receiver, early) == "stale-epoch"
    assert reason(receiver, first) == "replay"


def test_a_forged_far_future_epoch_does_not_lock_a_fellow_out() -> None:
    keyring = Keyring([SECRET])
    receiver = DatagramSealer(keyring, B_ID, epoch=1)
    honest = DatagramSealer(keyring, A_ID, epoch=100)
    receiver.open(honest.seal(b"hello"))
    assert receiver.confirm(A_ID, 100, incarnation=1)
    for k in range(10):  # an insider with the key, naming A, epochs far ahead
        forged = DatagramSealer(keyring, A_ID, epoch=2**64 - 1 - k)
        receiver.open(forged.seal(b"forged"))
        assert not receiver.confirm(A_ID, 2**64 - 1 - k, incarnation=1)  # replayed proof
    assert receiver.open(honest.seal(b"still heard")) == (A_ID, b"still heard")
    assert receiver.proven_epoch(A_ID) == 100


def test_a_fellow_whose_clock_went_back_is_heard_once_it_proves_its_epoch() -> None:
    keyring = Keyring([SECRET])
    receiver = DatagramSealer(keyring, B_ID, epoch=1)
    receiver.open(DatagramSealer(keyring, A_ID, epoch=500).seal(b"old life"))
    assert receiver.confirm(A_ID, 500, incarnation=4)
    restarted = DatagramSealer(keyring, A_ID, epoch=20)  # no clock battery
    packet = restarted.seal(b"refutation at incarnation 5")
    opened = receiver.open_datagram(packet)
    assert opened.stale and reason(receiver, packet) == "stale-epoch"
    assert receiver.confirm(A_ID, 20, incarnation=5, seq=opened.seq)
    assert reason(receiver, packet) == "replay"
    assert receiver.open(restarted.seal(b"next")) == (A_ID, b"next")


def test_tracked_senders_are_bounded() -> None:
    keyring = Keyring([SECRET])
    receiver = DatagramSealer(keyring, B_ID, epoch=1, max_senders=8, max_subkeys=8)
    senders = [DatagramSealer(keyring, bytes([i]) * 16, epoch=1) for i in range(20)]
    for sender in senders:
        receiver.open(sender.seal(b"hi"))
    assert len(receiver._windows) == 8  # senders tracked
    assert len(receiver._subkeys) == 8
    assert receiver.open(senders[0].seal(b"again")) == (bytes([0]) * 16, b"again")


def test_sealing_follows_the_primary_key() -> None:
    keyring = Keyring([SECRET])
    a = DatagramSealer(keyring, A_ID, epoch=1)
    b = DatagramSealer(Keyring([SECRET, OTHER_SECRET]), B_ID, epoch=1)
    new_id = keyring.install(OTHER_SECRET)
    keyring.use(new_id)
    packet = a.seal(b"under the new key")
    assert packet[1:5] == new_id
    assert b.open(packet) == (A_ID, b"under the new key")


def test_sealer_rejects_bad_arguments() -> None:
    keyring = Keyring([SECRET])
    with pytest.raises(ConfigError):
        DatagramSealer(keyring, b"short", epoch=1)
    with pytest.raises(ConfigError):
        DatagramSealer(keyring, A_ID, epoch=-1)
    with pytest.raises(ConfigError):
        DatagramSealer(keyring, A_ID, epoch=1, replay_window=0)


@settings(max_examples=200, deadline=None)
@given(
    window=st.integers(1, 70),
    order=st.lists(st.integers(0, 150), max_size=120),
)
def test_replay_window_matches_a_model(window: int, order: list[int]) -> None:
    sender = DatagramSealer(Keyring([SECRET]), A_ID, epoch=1)
    packets = [sender.seal(b"%d" % i) for i in range(151)]
    receiver = DatagramSealer(Keyring([SECRET]), B_ID, epoch=1, replay_window=window)
    seen: set[int] = set()
    newest = -1
    for seq in order:
        fresh = seq not in seen and seq > newest - window
        if fresh:
            assert receiver.open(packets[seq]) == (A_ID, b"%d" % seq)
            seen.add(seq)
            newest = max(newest, seq)
        else:
            assert reason(receiver, packets[seq]) == "replay"


# --------------------------------------------------------------------------- handshake


def handshake(
    client_keyring: Keyring,
    server_keyring: Keyring,
    suite: int = SUITE_AES256GCM,
) -> tuple[StreamCipher, StreamCipher, ClientHandshake, ServerHandshake]:
    client = ClientHandshake(client_keyring, Identity.generate(), suite=suite)
    server = ServerHandshake(server_keyring, Identity.generate())
    finish, client_cipher = client.finish(server.respond(client.hello()))
    return client_cipher, server.finish(finish), client, server


@pytest.mark.parametrize("suite", [SUITE_AES256GCM, SUITE_CHACHA20POLY1305])
def test_handshake_authenticates_both_ends_and_frames_round_trip(suite: int) -> None:
    client_id, server_id = Identity.generate(), Identity.generate()
    client = ClientHandshake(Keyring([SECRET]), client_id, suite=suite)
    server = ServerHandshake(Keyring([SECRET]), server_id)
    assert server.peer_node_id is None
    server_hello = server.respond(client.hello())
    assert server.peer_node_id is None  # not before the client has signed
    finish, client_cipher = client.finish(server_hello)
    server_cipher = server.finish(finish)
    assert (client.peer_public_key, client.peer_node_id) == (
        server_id.public_key,
        server_id.node_id,
    )
    assert (server.peer_public_key, server.peer_node_id) == (
        client_id.public_key,
        client_id.node_id,
    )
    for i in range(3):
        assert server_cipher.open_frame(client_cipher.seal_frame(b"up %d" % i)) == b"up %d" % i
        assert client_cipher.open_frame(server_cipher.seal_frame(b"down %d" % i)) == b"down %d" % i
    assert client_cipher.open_frame(server_cipher.seal_frame(b"")) == b""


def test_every_handshake_has_fresh_keys() -> None:
    c1, _, _, _ = handshake(Keyring([SECRET]), Keyring([SECRET]))
    _, s2, _, _ = handshake(Keyring([SECRET]), Keyring([SECRET]))
    with pytest.raises(AuthenticationError):
        s2.open_frame(c1.seal_frame(b"from another session"))


def test_ephemeral_keys_are_dropped_after_finish() -> None:
    client = ClientHandshake(Keyring([SECRET]), Identity.generate())
    server = ServerHandshake(Keyring([SECRET]), Identity.generate())
    finish, _ = client.finish(server.respond(client.hello()))
    server.finish(finish)
    assert client._ephemeral is None
    assert not any(isinstance(v, security.handshake.X25519PrivateKey)
                   for v in vars(server).values())
    with pytest.raises(LocalProtocolError):
        client.finish(b"")
    with pytest.raises(LocalProtocolError):
        server.finish(finish)


def test_handshake_fails_with_another_swarm_secret() -> None:
    client = ClientHandshake(Keyring([OTHER_SECRET]), Identity.generate())
    server = ServerHandshake(Keyring([SECRET]), Identity.generate())
    with pytest.raises(AuthenticationError) as info:
        server.respond(client.hello())
    assert info.value.reason == "unknown-key"


def test_handshake_across_a_rotation_uses_the_clients_key() -> None:
    client_cipher, server_cipher, _, _ = handshake(
        Keyring([OTHER_SECRET]), Keyring([SECRET, OTHER_SECRET])
    )
    assert server_cipher.open_frame(client_cipher.seal_frame(b"ok")) == b"ok"


def flip(data: bytes, byte: int) -> bytes:
    changed = bytearray(data)
    changed[byte] ^= 0x01
    return bytes(changed)


def test_tampered_client_hello_is_refused() -> None:
    client = ClientHandshake(Keyring([SECRET]), Identity.generate())
    hello = client.hello()
    for byte in range(len(hello)):
        server = ServerHandshake(Keyring([SECRET]), Identity.generate())
        with pytest.raises(AuthenticationError):
            server.respond(flip(hello, byte))
    with pytest.raises(AuthenticationError):
        ServerHandshake(Keyring([SECRET]), Identity.generate()).respond(hello[:-1])


def test_tampered_server_hello_is_refused() -> None:
    server_hello = b""
    for byte in itertools.count():
        client = ClientHandshake(Keyring([SECRET]), Identity.generate())
        server = ServerHandshake(Keyring([SECRET]), Identity.generate())
        server_hello = server.respond(client.hello())
        if byte == len(server_hello):
            break
        with pytest.raises(AuthenticationError):
            client.finish(flip(server_hello, byte))


def test_tampered_client_finish_is_refused() -> None:
    client = ClientHandshake(Keyring([SECRET]), Identity.generate())
    server = ServerHandshake(Keyring([SECRET]), Identity.generate())
    finish, _ = client.finish(server.respond(client.hello()))
    with pytest.raises(AuthenticationError) as info:
        server.finish(flip(finish, 10))
    assert info.value.reason == "bad-signature"


def test_a_server_hello_for_another_client_is_refused() -> None:
    # A swarm member answering with a hello made for someone else's handshake.
    victim = ClientHandshake(Keyring([SECRET]), Identity.generate())
    other = ClientHandshake(Keyring([SECRET]), Identity.generate())
    relayed = ServerHandshake(Keyring([SECRET]), Identity.generate()).respond(other.hello())
    with pytest.raises(AuthenticationError):
        victim.finish(relayed)


def test_a_client_finish_from_another_session_is_refused() -> None:
    client_a = ClientHandshake(Keyring([SECRET]), Identity.generate())
    server_a = ServerHandshake(Keyring([SECRET]), Identity.generate())
    finish_a, _ = client_a.finish(server_a.respond(client_a.hello()))
    # Replaying the recorded hello and finish to a fresh server does not get in.
    server_b = ServerHandshake(Keyring([SECRET]), Identity.generate())
    server_b.respond(client_a.hello())
    with pytest.raises(AuthenticationError) as info:
        server_b.finish(finish_a)
    assert info.value.reason == "bad-signature"


def test_tampered_replayed_reordered_and_dropped_frames_are_refused() -> None:
    client_cipher, server_cipher, _, _ = handshake(Keyring([SECRET]), Keyring([SECRET]))
    frames = [client_cipher.seal_frame(b"frame %d" % i) for i in range(4)]
    assert server_cipher.open_frame(frames[0]) == b"frame 0"
    for bad in (flip(frames[1], 3), flip(frames[1], len(frames[1]) - 1), frames[0], frames[2]):
        with pytest.raises(AuthenticationError) as info:
            server_cipher.open_frame(bad)
        assert info.value.reason == "bad-seal"
    assert server_cipher.open_frame(frames[1]) == b"frame 1"
    # A frame from one direction cannot be reflected back to its sender.
    with pytest.raises(AuthenticationError):
        client_cipher.open_frame(frames[2])
