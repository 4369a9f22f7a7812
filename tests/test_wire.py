"""The codec: every message round-trips; anything else is a RemoteProtocolError."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p2pswarm.errors import LocalProtocolError, RemoteProtocolError, VersionMismatch
from p2pswarm.wire import (
    PROTOCOL_MAJOR,
    PROTOCOL_MINOR,
    codec,
    decode,
    encode,
    frame_limit,
    layout,
    message_types,
    pack_compound,
    tag_of,
)
from p2pswarm.wire.base import Hello, Refusal
from tests.wire_strategies import for_class

ALL_MESSAGES = st.sampled_from(sorted(message_types().items())).flatmap(
    lambda item: for_class(item[1]))

HELLO = Hello(seq=7, node_id=b"n" * 16, name="desk", addr="10.0.0.2:7946")


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(ALL_MESSAGES, min_size=1, max_size=4))
def test_every_message_round_trips(messages: list) -> None:
    assert decode(encode(*messages)) == messages


@settings(max_examples=2000)
@given(st.binary(max_size=300))
def test_random_bytes_only_raise_remote_protocol_error(data: bytes) -> None:
    try:
        decode(data)
    except RemoteProtocolError:
        pass


@settings(max_examples=1000)
@given(st.data())
def test_mutated_envelopes_only_raise_remote_protocol_error(data: st.DataObject) -> None:
    good = bytearray(encode(HELLO, HELLO))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(good) - 1))
        good[i] = data.draw(st.integers(0, 255))
    try:
        decode(bytes(good))
    except RemoteProtocolError:
        pass


def test_every_truncation_is_refused() -> None:
    data = encode(HELLO, HELLO)
    for end in range(len(data)):
        with pytest.raises(RemoteProtocolError):
            decode(data[:end])


def _raw(*body: list) -> bytes:
    return msgpack.packb([PROTOCOL_MAJOR, PROTOCOL_MINOR, list(body)], use_bin_type=True)


FIELDS = [7, b"n" * 16, "desk", "10.0.0.2:7946"]


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (_raw([1, [2**32, *FIELDS[1:]]]), "invalid-field"),  # out of range
        (_raw([1, [-1, *FIELDS[1:]]]), "invalid-field"),
        (_raw([1, [True, *FIELDS[1:]]]), "invalid-field"),  # bool is not an int here
        (_raw([1, [7.0, *FIELDS[1:]]]), "invalid-field"),  # wrong type
        (_raw([1, [7, b"n" * 15, *FIELDS[2:]]]), "invalid-field"),  # wrong length
        (_raw([1, [7, "n" * 16, *FIELDS[2:]]]), "invalid-field"),  # str for bytes
        (_raw([1, [*FIELDS[:2], "", FIELDS[3]]]), "invalid-field"),  # empty name
        (_raw([1, [*FIELDS[:2], "x" * 65, FIELDS[3]]]), "invalid-field"),  # name too long
        (_raw([1, FIELDS[:3]]), "invalid-field"),  # a field missing
        (_raw([1, [*FIELDS, 1]]), "invalid-field"),  # a field too many
        # no schema has a map: msgpack refuses one (max_map_len 0) before building it
        (_raw([1, {"seq": 7}]), "malformed"),
        (_raw([999, []]), "unknown-tag"),
        (_raw([1]), "invalid-field"),
        (msgpack.packb([PROTOCOL_MAJOR, PROTOCOL_MINOR, []]), "malformed"),  # no messages
        (msgpack.packb({"a": 1}), "malformed"),
        # trailing bytes
        (msgpack.packb([PROTOCOL_MAJOR, PROTOCOL_MINOR, [[1, FIELDS]]]) + b"\x00", "malformed"),
        (msgpack.packb(msgpack.ExtType(5, b"xx")), "malformed"),
    ],
)
def test_invalid_input_names_its_reason(data: bytes, reason: str) -> None:
    with pytest.raises(RemoteProtocolError) as info:
        decode(data)
    assert info.value.reason == reason


def test_oversize_is_refused_before_parsing() -> None:
    with pytest.raises(RemoteProtocolError) as info:
        decode(encode(HELLO), max_bytes=20)
    assert info.value.reason == "too-large"


def test_unknown_major_version_is_a_clear_refusal() -> None:
    data = msgpack.packb([PROTOCOL_MAJOR + 1, 3, [[1, FIELDS]]], use_bin_type=True)
    speaks = rf"peer speaks protocol {PROTOCOL_MAJOR + 1}\.3, this node speaks {PROTOCOL_MAJOR}\."
    with pytest.raises(VersionMismatch, match=speaks):
        decode(data)


def test_a_refusal_reads_across_major_versions() -> None:
    data = msgpack.packb([PROTOCOL_MAJOR + 1, 0, [[0, [2, 0, "upgrade to 2.x"]]]])
    assert decode(data) == [Refusal(2, 0, "upgrade to 2.x")]


def test_encoding_refuses_invalid_values() -> None:
    with pytest.raises(LocalProtocolError):
        encode(Hello(seq=-1, node_id=b"n" * 16, name="desk", addr="10.0.0.2:7946"))
    with pytest.raises(LocalProtocolError):
        encode(HELLO, max_bytes=10)


def test_compound_datagrams_stay_under_the_budget_and_keep_order() -> None:
    messages = [Hello(seq=i, node_id=b"n" * 16, name=f"fellow-{i}", addr="10.0.0.2:7946")
                for i in range(100)]
    packets, too_large = pack_compound(messages, max_bytes=1400)
    assert not too_large
    assert all(len(p) <= 1400 for p in packets)
    assert len(packets) < 10  # many messages share a packet
    assert [m for p in packets for m in decode(p)] == messages


def test_compound_reports_what_cannot_travel_in_a_datagram() -> None:
    big = Refusal(1, 0, "x" * 500)
    packets, too_large = pack_compound([HELLO, big], max_bytes=200)
    assert too_large == [big]
    assert [m for p in packets for m in decode(p)] == [HELLO]


# --- budgets: kinds and sizes before unpacking (wire/layout.py) -------------------------


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(ALL_MESSAGES)
def test_every_valid_encoding_passes_its_kinds_skim(msg: object) -> None:
    """The skim large frames take agrees with the codec: what encode makes, it passes."""
    data = encode(msg)
    head = layout.peek_envelope(data)
    assert (head.major, head.messages, head.first_tag) == (PROTOCOL_MAJOR, 1, tag_of(type(msg)))
    layout.skim(data, head.fields_at, codec.layout_of(type(msg)))
    assert len(data) <= frame_limit(type(msg))


def test_a_frame_above_its_kinds_limit_is_refused_before_unpacking() -> None:
    padded = _raw([1, FIELDS]) + b"\x00" * frame_limit(Hello)  # trailing junk, far past it
    with pytest.raises(RemoteProtocolError) as info:
        decode(padded)
    assert info.value.reason == "too-large" and "Hello" in str(info.value)


def test_kinds_refuses_other_messages_before_unpacking() -> None:
    assert decode(encode(HELLO), kinds={Hello}) == [HELLO]
    with pytest.raises(RemoteProtocolError) as info:
        decode(encode(HELLO), kinds={Refusal})
    assert info.value.reason == "unexpected-message"
    with pytest.raises(RemoteProtocolError):
        decode(encode(HELLO, Refusal(1, 0, "no")), kinds={Hello})


def test_several_messages_travel_in_at_most_64_kib() -> None:
    body = [[1, FIELDS]] * 2 + [[0, [1, 0, "x" * 512]]] * 200
    data = msgpack.packb([PROTOCOL_MAJOR, PROTOCOL_MINOR, body], use_bin_type=True)
    assert len(data) > codec.SMALL_FRAME_BYTES
    with pytest.raises(RemoteProtocolError) as info:
        decode(data)
    assert info.value.reason == "too-large"


def test_msgpack_limits_come_from_the_schemas() -> None:
    limits = codec.unpack_limits()
    assert limits["max_map_len"] == 0 and limits["max_ext_len"] == 0
    assert limits["max_bin_len"] == codec.DEFAULT_BYTES
    assert 4096 <= limits["max_array_len"] <= 1 << 20
    # an array announcing more items than any schema allows is refused before it is built
    data = _raw([1, FIELDS])[:-1] + b"\xdd" + (limits["max_array_len"] + 1).to_bytes(4, "big")
    with pytest.raises(RemoteProtocolError):
        decode(data)


def test_a_large_frame_off_its_layout_is_refused_at_the_first_byte() -> None:
    from p2pswarm.wire.serving import StepInput

    junk = b"\x90" * (4 << 20)
    data = bytes([0x93, PROTOCOL_MAJOR, PROTOCOL_MINOR, 0x91, 0x92, 105]) + b"\xdc\x00\x05" + junk
    assert tag_of(StepInput) == 105
    with pytest.raises(RemoteProtocolError) as info:
        decode(data)
    assert info.value.reason == "invalid-field"
