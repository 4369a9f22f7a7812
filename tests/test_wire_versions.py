"""Versions on the wire: protocol 1 (commit 675ee12) and this release share a swarm.

Golden bytes: ``tests/data/wire_v1/samples.json`` holds one message of every kind as
protocol 1's own code encoded it (``tests/data/wire_v1/make_samples.py`` says how it was
made); today's codec must decode each one and, encoding it for protocol 1, give the same
bytes back. The reverse runs protocol 1's code itself, from a ``git archive`` of 675ee12
in a subprocess, on what this release sends. Fields are only appended, with defaults,
elided while at them, so a protocol-1 decoder (which refuses a longer field list) never
sees them.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import typing
from pathlib import Path
from typing import Any

import msgpack
import pytest

from p2pswarm import errors as wire_errors
from p2pswarm import wire
from p2pswarm.errors import VersionMismatch
from p2pswarm.wire import codec, decode, encode, message_types
from p2pswarm.wire.base import Hello, Refusal, Unsupported
from p2pswarm.wire.schema import Elided
from p2pswarm.wire.versions import (
    CAPABILITIES,
    PROTOCOL,
    THIS_RELEASE,
    UNSUPPORTED_REPLY,
    Release,
    compatible,
    refusal_line,
    runs,
    speaks,
)

DATA = Path(__file__).parent / "data" / "wire_v1"
V1 = json.loads((DATA / "samples.json").read_text())
V1_COMMIT = "675ee12"
REPO = Path(__file__).resolve().parent.parent
HELLO = Hello(7, b"n" * 16, "desk", "10.0.0.2:7946")


def _maker() -> Any:
    spec = importlib.util.spec_from_file_location("make_samples", DATA / "make_samples.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- golden bytes: what protocol 1 sends decodes here ------------------------------------


def test_the_samples_are_protocol_1s() -> None:
    assert V1["envelope"] == [2, 1]
    assert len(V1["messages"]) >= 140


@pytest.mark.parametrize("tag", sorted(V1["messages"], key=int))
def test_every_protocol_1_message_decodes_and_encodes_back_byte_for_byte(tag: str) -> None:
    sample = V1["messages"][tag]
    data = bytes.fromhex(sample["hex"])
    (msg,) = decode(data)
    assert type(msg).__name__ == sample["name"]
    # what this release sends a protocol-1 fellow is what that fellow itself would send
    assert encode(msg, protocol=1) == data


def test_every_protocol_1_kind_keeps_its_tag() -> None:
    kinds = message_types()
    for tag, sample in V1["messages"].items():
        assert kinds[int(tag)].__name__ == sample["name"]


def test_fields_are_only_appended_with_defaults_that_stay_off_the_wire() -> None:
    """The rule for every message and struct of protocol 1: its fields come first, in
    their order; any field added since has a default and is Elided, so a protocol-1
    decoder (which refuses more fields than it knows) never sees it unless it was set."""
    classes = {cls.__name__: cls for cls in codec._BY_CLASS}
    for name, old in V1["fields"].items():
        cls = classes[name]
        fields = dataclasses.fields(cls)
        assert [f.name for f in fields[:len(old)]] == old, name
        hints = typing.get_type_hints(cls, include_extras=True)
        for f in fields[len(old):]:
            assert f.default is not dataclasses.MISSING \
                or f.default_factory is not dataclasses.MISSING, f"{name}.{f.name}"
            assert any(isinstance(m, Elided) for m in typing.get_args(hints[f.name])[1:]), \
                f"{name}.{f.name} is new since protocol 1: mark it Elided"


def test_new_kinds_take_tags_protocol_1_never_used() -> None:
    new = set(message_types()) - {int(t) for t in V1["messages"]}
    assert Unsupported in {message_types()[t] for t in new}


# --- versions: who shares a swarm ---------------------------------------------------------


@pytest.mark.parametrize(("theirs", "ok"), [(0, False), (1, True), (2, True), (3, True),
                                            (4, False)])
def test_a_release_and_the_one_before_it_share_a_swarm(theirs: int, ok: bool) -> None:
    data = encode(HELLO, protocol=theirs)
    assert compatible(PROTOCOL, theirs) is ok
    if ok:
        assert decode(data) == [HELLO]
        return
    with pytest.raises(VersionMismatch) as info:
        decode(data)
    line = info.value.detail
    assert line == refusal_line(PROTOCOL, theirs)
    assert f"protocol {theirs}" in line and f"protocol {PROTOCOL}" in line and "\n" not in line


def test_a_refusal_reads_whatever_the_protocol() -> None:
    refusal = Refusal(2, 9, refusal_line(9, PROTOCOL))
    assert decode(encode(refusal, protocol=9)) == [refusal]


def test_an_unknown_kind_alone_is_named_and_among_others_skipped() -> None:
    alone = msgpack.packb([2, PROTOCOL + 1, [[9999, [1, 2]]]])
    with pytest.raises(codec.UnknownKind) as info:
        decode(alone)
    assert info.value.tag == 9999 and info.value.reason == "unknown-tag"
    fields = msgpack.unpackb(encode(HELLO))[2][0]
    mixed = msgpack.packb([2, PROTOCOL + 1, [[9999, [1, 2]], fields]], use_bin_type=True)
    assert decode(mixed) == [HELLO]


# --- what a fellow announces ----------------------------------------------------------------


def test_a_release_reads_from_metadata_and_hostile_values_make_it_older() -> None:
    assert Release.from_doc({}) == Release(1, frozenset())
    assert Release.from_doc(THIS_RELEASE.to_doc()) == THIS_RELEASE
    assert Release.from_doc({"protocol": "2"}) == Release()
    assert Release.from_doc({"protocol": True}) == Release()
    assert Release.from_doc({"protocol": 2, "speaks": "x"}) == Release(2)
    assert Release.from_doc({"protocol": 2, "speaks": ["a"] * 65}) == Release(2)
    assert Release.from_doc({"protocol": 2, "speaks": [1, "y" * 49, "ok"]}) \
        == Release(2, frozenset({"ok"}))


def test_speaks_only_what_was_announced() -> None:
    assert speaks(THIS_RELEASE, UNSUPPORTED_REPLY)
    assert not speaks(Release(), UNSUPPORTED_REPLY)  # protocol 1 announced nothing
    assert set(THIS_RELEASE.speaks) == set(CAPABILITIES)
    with pytest.raises(ValueError):
        speaks(THIS_RELEASE, "no-such-capability")


def test_a_stage_runs_only_where_its_needs_are_spoken() -> None:
    needs = {"int2": "int2-kernels"}
    fake = Release(2, frozenset({"int2-kernels"}))
    assert runs(fake, ("int2", "bf16"), needs) is None
    assert runs(THIS_RELEASE, ("int2",), needs) == "int2-kernels"
    assert runs(Release(), ("bf16", "int8", "int4")) is None  # protocol 1 runs these


# --- protocol 1's own code on what this release sends -----------------------------------------


@pytest.fixture(scope="module")
def v1_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    have = subprocess.run(["git", "-C", str(REPO), "cat-file", "-e", V1_COMMIT + "^{commit}"],
                          capture_output=True)
    if have.returncode != 0:
        pytest.skip(f"commit {V1_COMMIT} is not in this clone's history")
    root = tmp_path_factory.mktemp("p2pswarm-v1")
    archive = subprocess.run(["git", "-C", str(REPO), "archive", V1_COMMIT, "p2pswarm"],
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(root)], input=archive, check=True)
    return root


_V1_DECODER = """
import json, sys
import msgpack
from p2pswarm import wire
from p2pswarm.agent.fellow_meta import FellowSays
assert wire.PROTOCOL_MINOR == 1, wire.__file__
out = {}
for tag, data in json.load(sys.stdin).items():
    try:
        (msg,) = wire.decode(bytes.fromhex(data))
        out[tag] = type(msg).__name__
        if tag == "alive-with-metadata":
            says = FellowSays.from_doc(msgpack.unpackb(msg.metadata, raw=False))
            out["metadata"] = [says.dropped, sorted(says.others), len(says.cards)]
    except Exception as exc:
        out[tag] = "failed: " + repr(exc)
print(json.dumps(out))
"""


def _alive_with_this_releases_metadata() -> Any:
    from p2pswarm.wire.gossip import Alive

    meta = msgpack.packb({"cards": [], **THIS_RELEASE.to_doc()}, use_bin_type=True)
    return Alive(b"n" * 16, 3, "desk", "10.0.0.2:7946", b"k" * 32, 2, 0, meta, b"s" * 64,
                 5, b"t" * 64)


def test_protocol_1_decodes_every_kind_this_release_sends_it(v1_tree: Path) -> None:
    """Every kind protocol 1 knows, as this release encodes it (its envelope says
    protocol 2), decodes in 675ee12's own code; and this release's metadata (protocol and
    capabilities) passes its metadata check untouched."""
    samples = _maker().samples()
    old = {int(t) for t in V1["messages"]}
    frames = {str(tag): encode(msg).hex() for tag, msg in samples.items() if tag in old}
    frames["alive-with-metadata"] = encode(_alive_with_this_releases_metadata()).hex()
    # why nothing new rides as a field: protocol 1 refuses a field list longer than its own
    hello = msgpack.unpackb(encode(HELLO))[2][0]
    frames["hello-with-a-field-more"] = msgpack.packb(
        [2, PROTOCOL, [[hello[0], [*hello[1], 0]]]], use_bin_type=True).hex()
    env = {**os.environ, "PYTHONPATH": str(v1_tree)}
    done = subprocess.run([sys.executable, "-c", _V1_DECODER], input=json.dumps(frames),
                          capture_output=True, text=True, env=env, cwd=v1_tree, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout)
    assert "invalid-field" in got.pop("hello-with-a-field-more")
    failed = {t: v for t, v in got.items() if t != "metadata" and v.startswith("failed")}
    assert not failed
    assert all(got[str(t)] == V1["messages"][str(t)]["name"] for t in old)
    assert got["metadata"] == [0, ["protocol", "speaks"], 0]


def test_this_releases_samples_equal_protocol_1s_for_the_kinds_it_knows() -> None:
    """The same values, encoded by today's codec for protocol 1, are protocol 1's bytes:
    no field moved, none was added in the middle."""
    samples = _maker().samples()
    for tag, sample in V1["messages"].items():
        assert encode(samples[int(tag)], protocol=1).hex() == sample["hex"], sample["name"]


def test_the_envelope_names_this_release() -> None:
    assert msgpack.unpackb(encode(HELLO))[:2] == [wire.PROTOCOL_MAJOR, PROTOCOL]


# --- a field added in the middle (StageStart, LoadKeep: ``asked``, commit ffe6bf5) ----------


@pytest.mark.parametrize("kind", ["StageStart", "LoadKeep"])
@pytest.mark.parametrize("large", [False, True])
def test_the_order_before_asked_was_inserted_still_decodes(kind: str, large: bool) -> None:
    from p2pswarm.wire import loads

    cls = getattr(loads, kind)
    msg = _maker()._instance(cls)
    if large:  # above 64 KiB a frame is skimmed along its layout before it is unpacked
        order = dataclasses.replace(msg.orders[0], card_name="c" * 256)
        msg = dataclasses.replace(msg, orders=(order,) * 256, plan_id="p" * 64)
    major, _, [[tag, fields]] = msgpack.unpackb(encode(msg))
    names = [f.name for f in dataclasses.fields(cls)]
    assert names == ["plan_id", "route", "orders", "asked", "term"]
    before = [fields[0], fields[1], fields[2], fields[4]]  # no asked, term in its place
    data = msgpack.packb([major, 1, [[tag, before]]], use_bin_type=True)
    assert (len(data) > codec.SMALL_FRAME_BYTES) is large
    assert decode(data) == [dataclasses.replace(msg, asked=b"")]
    # a list of that length in no order this release reads is still refused
    wrong = msgpack.packb([major, 1, [[tag, [fields[0], fields[1], fields[2], "x"]]]],
                          use_bin_type=True)
    with pytest.raises(wire_errors.RemoteProtocolError):
        decode(wrong)


def test_every_kind_added_after_protocol_1_names_the_capability_it_needs() -> None:
    """A kind protocol 1 lacks goes only to fellows that announced it: the rule a new
    kind must follow (``@message(tag, needs=...)``), so ``sendable`` can check it."""
    old = {int(t) for t in V1["messages"]}
    for tag, cls in message_types().items():
        if tag in old:
            assert wire.needs(cls) is None, cls.__name__
        else:
            assert wire.needs(cls) in CAPABILITIES, f"{cls.__name__} (tag {tag}) names no " \
                "capability: @message(tag, needs=...) with one from wire.versions"


def test_sendable_checks_the_receivers_capabilities() -> None:
    assert wire.sendable(Release(), HELLO)
    assert not wire.sendable(Release(), Unsupported(5))
    assert wire.sendable(THIS_RELEASE, Unsupported(5))
    with pytest.raises(TypeError):
        wire.message(9998, needs="no-such-capability")
