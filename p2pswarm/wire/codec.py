"""The msgpack codec: frozen message values <-> validated bytes.

An envelope is a msgpack array ``[major, minor, [[tag, [field, ...]], ...]]``: a protocol
version, then one or more messages (several make a compound datagram). Decoding validates
everything (types, arity, lengths, ranges, sizes) and raises ``RemoteProtocolError`` on
anything else, never another exception: whatever a peer sends, the worst it can do is be
dropped and counted.

Nothing is unpacked before its kind and size are known to fit: the first bytes of an
envelope name its first message's tag (``layout.peek_envelope``), each kind has a frame
limit (the largest envelope its schema allows), and msgpack runs with the limits of the
largest any kind allows (``unpack_limits``). A frame above ``SMALL_FRAME_BYTES`` is first
skimmed along its kind's layout, so what msgpack then builds is what the schema allows; a
small one can cost at most its size in objects (a few MiB, a few ms) whatever it holds.

The envelope's minor is the sender's release protocol (``versions``): a peer with another
major, or a protocol two or more away from ours, gets ``VersionMismatch`` (its detail the
one line naming both versions), except for ``Refusal`` (tag 0), whose layout is frozen
for every version so a refusal always reads. A single message of a kind this release does
not know raises ``UnknownKind`` before anything is unpacked (a stream answers it with
``Unsupported`` and stays open); in a compound datagram, messages of unknown kinds are
skipped and the others decode.

Compatibility rule: a field is only ever appended to a message, with a default, and
marked ``Elided`` so it stays off the wire while it holds that default: protocol 1's
decoder refuses a field list longer than its own (see docs/versions.md).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Callable, Container, Iterable, TypeVar

import msgpack

from p2pswarm.errors import LocalProtocolError, RemoteProtocolError, VersionMismatch
from p2pswarm.wire import layout as lay
from p2pswarm.wire import versions
from p2pswarm.wire.schema import Elided, Items, Range, Size

PROTOCOL_MAJOR = 2  # 2: every call, order and training message is its own type; frozen
# (protocol 1's decoder refuses any other major), so releases count in the minor:
PROTOCOL_MINOR = versions.PROTOCOL  # the release's protocol (1: commit 675ee12)

DEFAULT_STR_CHARS = 1024
DEFAULT_BYTES = 64 * 1024 * 1024
DEFAULT_ITEMS = 4096
MAX_DEPTH = 32
# Below this an envelope is unpacked without a skim: the worst it can hold (empty arrays,
# one byte each) is 64 Ki objects, about 4 MiB and 13 ms. Several messages in one
# envelope (compound datagrams) must fit in it too.
SMALL_FRAME_BYTES = 64 * 1024

Check = Callable[[Any], Any]  # validates a decoded value and returns the Python value
Dump = Callable[[Any], Any]  # turns a Python value into msgpack-ready primitives

M = TypeVar("M")


class UnknownKind(RemoteProtocolError):
    """A message of a kind (tag) this release does not know: a newer fellow's."""

    def __init__(self, tag: int) -> None:
        super().__init__("unknown-tag", f"tag {tag}")
        self.tag = tag


class _Invalid(Exception):
    """Internal: a field failed validation (turned into RemoteProtocolError at the edge)."""


@dataclasses.dataclass(frozen=True, slots=True)
class _Codec:
    cls: type
    tag: int | None
    names: tuple[str, ...]
    required: int  # fields without a default: a shorter array is invalid
    checks: tuple[Check, ...]
    dumps: tuple[Dump, ...]
    elided: tuple[Any, ...] = ()  # defaults of the trailing fields marked Elided, in order


_BY_TAG: dict[int, _Codec] = {}
_BY_CLASS: dict[type, _Codec] = {}
_LAYOUTS: dict[type, lay.Struct] = {}
_SKIMMERS: dict[int, lay.Skimmer] = {}  # tag -> its layout's skimmer
_FRAME_BYTES: dict[int, int] = {}  # tag -> the largest envelope holding one such message
# msgpack's own limits, the largest any registered kind allows (grown at registration)
_UNPACK_LIMITS: dict[str, int] = {"max_array_len": 3, "max_map_len": 0, "max_str_len": 0,
                                  "max_bin_len": 0, "max_ext_len": 0}


def message(tag: int, *, needs: str | None = None) -> Callable[[type[M]], type[M]]:
    """Register a frozen dataclass as a top-level message with an append-only tag.
    ``needs``: the capability (``versions.CAPABILITIES``) a fellow must have announced to
    be sent one; every kind added after protocol 1 names one (``sendable``)."""
    if needs is not None and needs not in versions.CAPABILITIES:
        raise TypeError(f"{needs!r} is not a capability listed in wire.versions")

    def register(cls: type[M]) -> type[M]:
        if tag in _BY_TAG:
            raise TypeError(f"wire tag {tag} is already {_BY_TAG[tag].cls.__name__}")
        if needs is not None:
            _NEEDS[cls] = needs
        codec = _build(cls, tag)
        _BY_TAG[tag] = codec
        _FRAME_BYTES[tag] = lay.ENVELOPE_HEAD_BYTES + lay.largest_bytes(_LAYOUTS[cls])
        _SKIMMERS[tag] = lay.skimmer(_LAYOUTS[cls])
        return cls

    return register


_NEEDS: dict[type, str] = {}  # message kind -> the capability a receiver must speak


def needs(cls: type) -> str | None:
    """The capability a fellow must speak to be sent a ``cls`` (None: protocol 1's)."""
    return _NEEDS.get(cls)


def sendable(release: versions.Release, msg: Any) -> bool:
    """Whether ``msg`` may go to a fellow that announced ``release``: the check every
    sender of a kind added after protocol 1 makes (docs/versions.md)."""
    capability = _NEEDS.get(type(msg))
    return capability is None or capability in release.speaks


def struct(cls: type[M]) -> type[M]:
    """Register a frozen dataclass that travels only inside messages (no tag)."""
    _build(cls, None)
    return cls


def tag_of(cls: type) -> int:
    codec = _BY_CLASS.get(cls)
    if codec is None or codec.tag is None:
        raise LocalProtocolError("not-a-message", f"{cls.__name__} has no wire tag")
    return codec.tag


def message_types() -> dict[int, type]:
    """Every registered message class by tag (for tests and docs)."""
    return {tag: codec.cls for tag, codec in sorted(_BY_TAG.items())}


def frame_limit(cls: type) -> int:
    """The most bytes an envelope holding one ``cls`` message can take: larger is refused
    before anything is unpacked."""
    return _FRAME_BYTES[tag_of(cls)]


def layout_of(cls: type) -> lay.Struct:
    """The byte layout of a registered message or struct (for tests and docs)."""
    return _LAYOUTS[cls]


def unpack_limits() -> dict[str, int]:
    """msgpack's ``max_*_len`` limits: the largest any registered kind allows."""
    return dict(_UNPACK_LIMITS)


# --- building validators from annotations ---------------------------------------------
#
# Each registered class gets one generated checker function with the primitive checks
# inlined (a few tens of nanoseconds a field), so decoding a full gossip datagram costs a
# few microseconds. Nested structs, tuples and optionals call their own checkers.


def _build(cls: type, tag: int | None) -> _Codec:
    params = getattr(cls, "__dataclass_params__", None)
    if params is None or not params.frozen:
        raise TypeError(f"{cls.__name__} must be a frozen dataclass")
    hints = typing.get_type_hints(cls, include_extras=True)
    fields = dataclasses.fields(cls)
    required = sum(
        1 for f in fields
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    )
    names = tuple(f.name for f in fields)
    specs = [_field(hints[f.name]) for f in fields]
    layout = lay.Struct(required, tuple(_layout(hints[f.name]) for f in fields))
    _LAYOUTS[cls] = layout
    _grow_limits(layout)
    dumps = tuple(dump for _, dump in specs)
    checks = tuple(check for check, _ in specs)
    elided: list[Any] = []
    for f in reversed(fields):
        extras = typing.get_args(hints[f.name])[1:] \
            if typing.get_origin(hints[f.name]) is typing.Annotated else ()
        if not any(isinstance(m, Elided) for m in extras):
            break
        elided.insert(0, f.default)
    codec = _Codec(cls, tag, names, required, checks, dumps, tuple(elided))
    _BY_CLASS[cls] = codec
    _CHECKERS[cls] = _compile_checker(cls, names, required, [inline for inline, _ in
                                                              (_inline(hints[n]) for n in names)],
                                      checks)
    return codec


_CHECKERS: dict[type, Callable[[Any], Any]] = {}


@dataclasses.dataclass(frozen=True, slots=True)
class _Earlier:
    """A field order a message had in an earlier release: where each of today's fields
    sat in it (None: not there yet, its default applies)."""

    fields: int  # how many fields the earlier order has
    at: tuple[int | None, ...]  # per field of today's order
    defaults: tuple[Any, ...]  # per field of today's order, as dumped (when at is None)
    skimmer: lay.Skimmer


_EARLIER: dict[type, tuple[_Earlier, ...]] = {}


def earlier_order(cls: type, names: tuple[str, ...]) -> None:
    """Decode ``cls`` also in the field order ``names`` an earlier release sent, where a
    field was added in the middle: a field list of that length that fails today's checks
    is read in that order, the missing fields at their defaults. Tried only on a failure,
    so today's messages cost nothing more."""
    codec = _BY_CLASS[cls]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if not set(names) <= set(codec.names):
        raise TypeError(f"{cls.__name__} has no field {set(names) - set(codec.names)}")
    at: list[int | None] = []
    defaults: list[Any] = []
    for i, name in enumerate(codec.names):
        if name in names:
            at.append(names.index(name))
            defaults.append(None)
            continue
        if fields[name].default is dataclasses.MISSING:
            raise TypeError(f"{cls.__name__}.{name} was added without a default")
        at.append(None)
        defaults.append(codec.dumps[i](fields[name].default))
    layout = _LAYOUTS[cls]
    old = lay.Struct(len(names), tuple(layout.fields[codec.names.index(n)] for n in names))
    _EARLIER[cls] = (*_EARLIER.get(cls, ()),
                     _Earlier(len(names), tuple(at), tuple(defaults), lay.skimmer(old)))


def _check_earlier(cls: type, raw: Any) -> Any:
    """``raw`` read in an earlier release's field order, if one fits; else _Invalid."""
    for earlier in _EARLIER.get(cls, ()):
        if type(raw) is list and len(raw) == earlier.fields:
            try:
                return _CHECKERS[cls]([raw[i] if i is not None else d
                                       for i, d in zip(earlier.at, earlier.defaults)])
            except _Invalid:
                continue
    raise _Invalid(f"{cls.__name__}: fields in no order this release reads")


def _inline(tp: Any) -> tuple[str | None, None]:
    """Source for an inline check of a primitive field (``{v}`` is the value), or None."""
    meta: tuple[Any, ...] = ()
    if typing.get_origin(tp) is typing.Annotated:
        tp, *extra = typing.get_args(tp)
        meta = tuple(extra)
    if tp is bool:
        return "type({v}) is bool", None
    if tp is int:
        rng = next((m for m in meta if isinstance(m, Range)), Range(-(2**63), 2**64 - 1))
        return f"type({{v}}) is int and {int(rng.low)} <= {{v}} <= {int(rng.high)}", None
    if tp is str or tp is bytes:
        size = next((m for m in meta if isinstance(m, Size)),
                    Size(0, DEFAULT_STR_CHARS if tp is str else DEFAULT_BYTES))
        return f"type({{v}}) is {tp.__name__} and {size.low} <= len({{v}}) <= {size.high}", None
    return None, None


def _compile_checker(cls: type, names: tuple[str, ...], required: int,
                     inlines: list[str | None], checks: tuple[Check, ...]) -> Callable[[Any], Any]:
    n_all = len(names)
    lines = [
        "def check(raw):",
        "    if type(raw) is not list:",
        f"        raise _Invalid('{cls.__name__}: expected a field list')",
        "    n = len(raw)",
        f"    if n != {n_all}:",
        f"        if n < {required} or n > {n_all}:",
        f"            raise _Invalid(f'{cls.__name__}: expected {required}..{n_all} fields,"
        " got {n}')",
        "        return _slow(raw)",
    ]
    if n_all:
        lines.append(f"    {', '.join(f'v{i}' for i in range(n_all))}, = raw")
    for i, (name, inline) in enumerate(zip(names, inlines)):
        if inline is not None:
            cond = inline.replace("{v}", f"v{i}")
            lines += [f"    if not ({cond}):",
                      f"        raise _Invalid('{cls.__name__}.{name}: ' + _doc[{i}])"]
        else:
            lines.append(f"    v{i} = _checks[{i}](v{i})")
    # Build the frozen value without its __init__ (the checks above are the validation);
    # this halves the cost of decoding a datagram of small messages.
    lines.append("    o = _new(_cls)")
    lines += [f"    _set(o, {name!r}, v{i})" for i, name in enumerate(names)]
    lines.append("    return o")

    def slow(raw: list[Any]) -> Any:  # fewer fields than declared: trailing defaults apply
        return cls(*[check(v) for check, v in zip(checks, raw)])

    doc = [_describe(inline) for inline in inlines]
    namespace: dict[str, Any] = {"_Invalid": _Invalid, "_cls": cls, "_checks": checks,
                                 "_new": object.__new__, "_set": object.__setattr__,
                                 "_slow": slow, "_doc": doc}
    exec("\n".join(lines), namespace)  # noqa: S102 - source built from our own annotations
    return namespace["check"]  # type: ignore[no-any-return]


def _describe(inline: str | None) -> str:
    return "" if inline is None else "expected " + inline.replace("{v}", "value")


def _identity(value: Any) -> Any:
    return value


def _field(tp: Any, meta: tuple[Any, ...] = ()) -> tuple[Check, Dump]:
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        base, *extra = typing.get_args(tp)
        return _field(base, meta + tuple(extra))
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(options) != len(typing.get_args(tp)) - 1 or len(options) != 1:
            raise TypeError(f"only `X | None` unions are supported, not {tp}")
        inner_check, inner_dump = _field(options[0], meta)

        def check_optional(v: Any) -> Any:
            return None if v is None else inner_check(v)

        def dump_optional(v: Any) -> Any:
            return None if v is None else inner_dump(v)

        return check_optional, dump_optional
    if origin is tuple:
        args = typing.get_args(tp)
        if len(args) != 2 or args[1] is not Ellipsis:
            raise TypeError(f"tuple fields must be tuple[X, ...], not {tp}")
        most = next((m.high for m in meta if isinstance(m, Items)), DEFAULT_ITEMS)
        item_check, item_dump = _field(args[0])

        def check_tuple(v: Any) -> Any:
            if type(v) is not list or len(v) > most:
                raise _Invalid(f"expected a list of at most {most} items")
            return tuple([item_check(x) for x in v])

        def dump_tuple(v: Any) -> Any:
            return [item_dump(x) for x in v]

        return check_tuple, dump_tuple
    if tp is bool:
        def check_bool(v: Any) -> Any:
            if type(v) is not bool:
                raise _Invalid("expected a bool")
            return v

        return check_bool, _identity
    if tp is int:
        rng = next((m for m in meta if isinstance(m, Range)), Range(-(2**63), 2**64 - 1))
        low, high = int(rng.low), int(rng.high)

        def check_int(v: Any) -> Any:
            if type(v) is not int or not low <= v <= high:
                raise _Invalid(f"expected an int in [{low}, {high}]")
            return v

        return check_int, _identity
    if tp is float:
        rng = next((m for m in meta if isinstance(m, Range)), Range(-1e300, 1e300))
        flow, fhigh = float(rng.low), float(rng.high)

        def check_float(v: Any) -> Any:
            if type(v) is int:
                v = float(v)
            if type(v) is not float or not flow <= v <= fhigh:  # NaN fails both comparisons
                raise _Invalid(f"expected a number in [{flow}, {fhigh}]")
            return v

        return check_float, float
    if tp is str or tp is bytes:
        size = next((m for m in meta if isinstance(m, Size)),
                    Size(0, DEFAULT_STR_CHARS if tp is str else DEFAULT_BYTES))
        slow, shigh, kind = size.low, size.high, tp

        def check_sized(v: Any) -> Any:
            if type(v) is not kind or not slow <= len(v) <= shigh:
                raise _Invalid(f"expected {kind.__name__} of length {slow}..{shigh}")
            return v

        return check_sized, _identity
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if tp not in _BY_CLASS:
            raise TypeError(f"{tp.__name__} must be registered with @struct before use")
        codec = _BY_CLASS[tp]
        checker = _CHECKERS[tp]

        def dump_struct(v: Any) -> Any:
            return _dump_fields(codec, v)

        return checker, dump_struct
    raise TypeError(f"unsupported wire field type {tp!r}")


def _layout(tp: Any, meta: tuple[Any, ...] = ()) -> lay.Layout:
    """The msgpack layout of a field annotation (mirrors ``_field``)."""
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        base, *extra = typing.get_args(tp)
        return _layout(base, meta + tuple(extra))
    if origin in (typing.Union, types.UnionType):
        (inner,) = [a for a in typing.get_args(tp) if a is not type(None)]
        return lay.Optional(_layout(inner, meta))
    if origin is tuple:
        most = next((m.high for m in meta if isinstance(m, Items)), DEFAULT_ITEMS)
        return lay.Tuple(most, _layout(typing.get_args(tp)[0]))
    if tp is bool:
        return lay.Bool()
    if tp is int:
        return lay.Int()
    if tp is float:
        return lay.Float()
    if tp is str:
        return lay.Str(next((m.high for m in meta if isinstance(m, Size)), DEFAULT_STR_CHARS))
    if tp is bytes:
        return lay.Bin(next((m.high for m in meta if isinstance(m, Size)), DEFAULT_BYTES))
    return _LAYOUTS[tp]  # a registered struct (``_field`` has checked)


def _grow_limits(layout: lay.Layout) -> None:
    limits = _UNPACK_LIMITS
    if isinstance(layout, lay.Struct):
        limits["max_array_len"] = max(limits["max_array_len"], len(layout.fields))
        for f in layout.fields:
            _grow_limits(f)
    elif isinstance(layout, lay.Tuple):
        limits["max_array_len"] = max(limits["max_array_len"], layout.most_items)
        _grow_limits(layout.item)
    elif isinstance(layout, lay.Optional):
        _grow_limits(layout.inner)
    elif isinstance(layout, lay.Str):
        limits["max_str_len"] = max(limits["max_str_len"], layout.most_bytes)
    elif isinstance(layout, lay.Bin):
        limits["max_bin_len"] = max(limits["max_bin_len"], layout.most_bytes)


def _check_fields(codec: _Codec, raw: Any) -> Any:
    return _CHECKERS[codec.cls](raw)


def _dump_fields(codec: _Codec, obj: Any) -> list[Any]:
    if type(obj) is not codec.cls:
        raise _Invalid(f"expected {codec.cls.__name__}, got {type(obj).__name__}")
    out = [dump(getattr(obj, name)) for dump, name in zip(codec.dumps, codec.names)]
    for default in reversed(codec.elided):  # trailing fields at their defaults stay off
        if out[-1] != default:
            break
        out.pop()
    return out


# --- envelopes ---------------------------------------------------------------------------


def encode(*messages: Any, max_bytes: int | None = None, protocol: int = PROTOCOL_MINOR) -> bytes:
    """Encode one or more messages as one envelope; LocalProtocolError if invalid.
    ``protocol``: the release protocol the envelope names (tests play other releases)."""
    if not messages:
        raise LocalProtocolError("empty", "an envelope needs at least one message")
    body = []
    for msg in messages:
        codec = _BY_CLASS.get(type(msg))
        if codec is None or codec.tag is None:
            raise LocalProtocolError("not-a-message", f"{type(msg).__name__} has no wire tag")
        try:
            fields = _dump_fields(codec, msg)
            _check_fields(codec, fields)  # refuse to send what a peer would refuse
        except _Invalid as exc:
            raise LocalProtocolError("invalid-field", str(exc)) from None
        body.append([codec.tag, fields])
    data: bytes = msgpack.packb([PROTOCOL_MAJOR, protocol, body], use_bin_type=True)
    if max_bytes is not None and len(data) > max_bytes:
        raise LocalProtocolError("too-large", f"{len(data)} bytes, limit {max_bytes}")
    return data


def decode(data: bytes, *, max_bytes: int = DEFAULT_BYTES,
           kinds: Container[type] | None = None) -> list[Any]:
    """Decode and validate an envelope; RemoteProtocolError on anything invalid.

    The kind and the size are checked first, from the envelope's first bytes; only an
    envelope that may hold what it says is unpacked (see the module's docstring). With
    ``kinds``, a message of another type is refused as "unexpected-message", the first
    one before anything is unpacked (a stream server passes the types it answers)."""
    if len(data) > max_bytes:
        raise RemoteProtocolError("too-large", f"{len(data)} bytes, limit {max_bytes}")
    head = lay.peek_envelope(data)
    if not (head.messages == 1 and head.first_tag == 0):  # a Refusal reads across versions
        if head.major != PROTOCOL_MAJOR:
            raise VersionMismatch(
                "version", f"peer speaks protocol {head.major}.{head.minor}, this node "
                f"speaks {PROTOCOL_MAJOR}.{PROTOCOL_MINOR}")
        if not versions.compatible(PROTOCOL_MINOR, head.minor):
            raise VersionMismatch("version", versions.refusal_line(PROTOCOL_MINOR, head.minor))
    if head.messages > 1:
        if len(data) > SMALL_FRAME_BYTES:
            raise RemoteProtocolError(
                "too-large", f"{head.messages} messages in {len(data)} bytes; several "
                f"messages travel in at most {SMALL_FRAME_BYTES}")
    else:
        codec = _BY_TAG.get(head.first_tag)
        if codec is None:
            raise UnknownKind(head.first_tag)
        if kinds is not None and codec.cls not in kinds:
            raise RemoteProtocolError("unexpected-message", codec.cls.__name__)
        limit = _FRAME_BYTES[head.first_tag]
        if len(data) > limit:
            raise RemoteProtocolError(
                "too-large", f"a {codec.cls.__name__} of {len(data)} bytes; its schema "
                f"allows at most {limit}")
        if len(data) > SMALL_FRAME_BYTES:
            _skim(data, head.fields_at, codec)
    try:
        top = msgpack.unpackb(data, raw=False, use_list=True, strict_map_key=True,
                              **_UNPACK_LIMITS)
    except Exception as exc:  # msgpack raises many kinds; all mean "not our protocol"
        raise RemoteProtocolError("malformed", type(exc).__name__) from None
    if type(top) is not list or len(top) != 3 or type(top[0]) is not int \
            or type(top[1]) is not int or type(top[2]) is not list or not top[2]:
        raise RemoteProtocolError("malformed", "not an envelope")
    messages = _decode_body(top[2])
    if kinds is not None and any(type(m) not in kinds for m in messages):
        raise RemoteProtocolError("unexpected-message", "in a compound envelope")
    return messages


def _skim(data: bytes, at: int, codec: _Codec) -> None:
    """Skim a large frame along its kind's layout, or an earlier order of it."""
    try:
        lay.skim(data, at, _SKIMMERS[codec.tag])  # type: ignore[index]
    except RemoteProtocolError:
        for earlier in _EARLIER.get(codec.cls, ()):
            try:
                lay.skim(data, at, earlier.skimmer)
                return
            except RemoteProtocolError:
                continue
        raise


def _decode_body(body: list[Any]) -> list[Any]:
    out = []
    unknown: int | None = None
    try:
        for item in body:
            if type(item) is not list or len(item) != 2 or type(item[0]) is not int:
                raise _Invalid("expected [tag, fields]")
            codec = _BY_TAG.get(item[0])
            if codec is None:  # a newer fellow's kind, riding with others: skip it
                unknown = item[0]
                continue
            try:
                out.append(_CHECKERS[codec.cls](item[1]))
            except _Invalid:
                if codec.cls not in _EARLIER:
                    raise
                out.append(_check_earlier(codec.cls, item[1]))
    except _Invalid as exc:
        raise RemoteProtocolError("invalid-field", str(exc)) from None
    except RecursionError:
        raise RemoteProtocolError("malformed", "nested too deeply") from None
    except (TypeError, ValueError) as exc:  # a constructor's own __post_init__ checks
        raise RemoteProtocolError("invalid-field", str(exc)) from None
    if not out and unknown is not None:
        raise UnknownKind(unknown)
    return out


def pack_compound(messages: Iterable[Any], max_bytes: int) -> tuple[list[bytes], list[Any]]:
    """Pack messages into as few envelopes of at most ``max_bytes`` as fit, in order.

    Returns the envelopes and the messages too large to travel alone in a datagram.
    """
    packets: list[bytes] = []
    too_large: list[Any] = []
    batch: list[Any] = []
    for msg in messages:
        try:
            encode(*batch, msg, max_bytes=max_bytes)
            batch.append(msg)
            continue
        except LocalProtocolError as exc:
            if exc.reason != "too-large":
                raise
        if batch:
            packets.append(encode(*batch))
            batch = []
        try:
            encode(msg, max_bytes=max_bytes)
            batch = [msg]
        except LocalProtocolError:
            too_large.append(msg)
    if batch:
        packets.append(encode(*batch))
    return packets, too_large
