"""The memory of signature checks that passed: exact bytes only, bounded, never a yes
for what was not verified."""

from __future__ import annotations

import pytest

from p2pswarm.errors import AuthenticationError
from p2pswarm.security.identity import VERIFIED, Identity, verify
from p2pswarm.security.verified import ENTRY_OVERHEAD_BYTES, VerifiedSignatures


@pytest.fixture(autouse=True)
def fresh_memory():
    VERIFIED.clear()
    yield
    VERIFIED.clear()


def test_a_check_that_passed_is_remembered_and_any_changed_byte_is_checked_again() -> None:
    me, other = Identity.generate(), Identity.generate()
    record = b"alive node=7 incarnation=3 addr=10.0.0.7:7946"
    signature = me.sign(record)
    verify(me.public_key, signature, record)
    assert VERIFIED.known(me.public_key, signature, record)
    verify(me.public_key, signature, record)  # from memory
    changed = [
        (me.public_key, signature, record[:-1] + b"8"),  # the record moved
        (other.public_key, signature, record),  # another signer claims it
        (me.public_key, bytes([signature[0] ^ 1]) + signature[1:], record),
    ]
    for key, sig, data in changed:
        with pytest.raises(AuthenticationError):
            verify(key, sig, data)
        assert not VERIFIED.known(key, sig, data)  # a failure is never remembered
    assert len(VERIFIED) == 1


def test_the_memory_is_bounded_by_bytes_oldest_out_first() -> None:
    entry = 32 + 64 + 10 + ENTRY_OVERHEAD_BYTES
    memory = VerifiedSignatures(capacity_bytes=3 * entry)
    keys = [(bytes([i]) * 32, bytes([i]) * 64, b"%010d" % i) for i in range(5)]
    for k in keys:
        memory.remember(*k)
    assert len(memory) == 3
    assert not memory.known(*keys[0]) and not memory.known(*keys[1])
    assert all(memory.known(*k) for k in keys[2:])
    memory.remember(b"k" * 32, b"s" * 64, b"x" * (4 * entry))  # larger than it all: not kept
    assert len(memory) == 3
    memory.resize(0)
    assert len(memory) == 0
    memory.remember(*keys[0])
    assert not memory.known(*keys[0])


def test_a_recently_used_entry_stays() -> None:
    entry = 32 + 64 + 10 + ENTRY_OVERHEAD_BYTES
    memory = VerifiedSignatures(capacity_bytes=2 * entry)
    a, b, c = ((bytes([i]) * 32, bytes([i]) * 64, b"%010d" % i) for i in range(3))
    memory.remember(*a)
    memory.remember(*b)
    assert memory.known(*a)  # a is now the most recent
    memory.remember(*c)
    assert memory.known(*a) and not memory.known(*b)
