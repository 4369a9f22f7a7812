"""Write one encoded sample of every wire message kind, and every kind's field names.

Run against a release's own code to freeze what it sends (the test decodes the samples
with today's codec, and today's samples with that release's). For protocol 1 (commit
675ee12), from the repository root:

    rm -rf /tmp/p2pswarm-v1 && mkdir /tmp/p2pswarm-v1
    git archive 675ee12 p2pswarm | tar -x -C /tmp/p2pswarm-v1
    PYTHONPATH=/tmp/p2pswarm-v1 python tests/data/wire_v1/make_samples.py \\
        tests/data/wire_v1/samples.json

The values come from each field's annotation (the least its bounds allow, and one item
in every tuple), so they depend only on the schema. With no output path it prints the
JSON. The module also serves the test: ``samples()`` builds the same values with
whatever ``p2pswarm.wire`` is importable.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import types
import typing
from typing import Any


def _value(tp: Any, meta: tuple[Any, ...] = ()) -> Any:
    from p2pswarm.wire.schema import Items, Range, Size

    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        base, *extra = typing.get_args(tp)
        return _value(base, meta + tuple(extra))
    if origin in (typing.Union, types.UnionType):
        (inner,) = [a for a in typing.get_args(tp) if a is not type(None)]
        return _value(inner, meta)
    if origin is tuple:
        most = next((m.high for m in meta if isinstance(m, Items)), 1)
        return (_value(typing.get_args(tp)[0]),) if most >= 1 else ()
    if tp is bool:
        return True
    if tp is int:
        rng = next((m for m in meta if isinstance(m, Range)), Range(0, 2**32))
        return int(max(rng.low, min(1, rng.high)))
    if tp is float:
        rng = next((m for m in meta if isinstance(m, Range)), Range(0.0, 1e9))
        return float(max(rng.low, min(1.0, rng.high)))
    if tp is str:
        size = next((m for m in meta if isinstance(m, Size)), Size(0, 64))
        return "x" * max(size.low, min(1, size.high))
    if tp is bytes:
        size = next((m for m in meta if isinstance(m, Size)), Size(0, 64))
        return b"\x01" * max(size.low, min(1, size.high))
    if dataclasses.is_dataclass(tp):
        return _instance(tp)
    raise TypeError(f"no sample for {tp!r}")


def _instance(cls: Any) -> Any:
    """Every field filled (so every field travels); where the class's own checks refuse
    that, the fields with defaults are left at them."""
    hints = typing.get_type_hints(cls, include_extras=True)
    fields = dataclasses.fields(cls)
    try:
        return cls(**{f.name: _value(hints[f.name]) for f in fields})
    except (TypeError, ValueError):
        required = [f for f in fields if f.default is dataclasses.MISSING
                    and f.default_factory is dataclasses.MISSING]
        return cls(**{f.name: _value(hints[f.name]) for f in required})


def samples() -> dict[int, Any]:
    """One value of every registered message kind, by tag."""
    from p2pswarm import wire

    return {tag: _instance(cls) for tag, cls in wire.message_types().items()}


def field_names() -> dict[str, list[str]]:
    """Every registered message and struct: its field names, in wire order."""
    from p2pswarm.wire import codec

    return {cls.__name__: list(c.names)
            for cls, c in sorted(codec._BY_CLASS.items(), key=lambda kv: kv[0].__name__)}


def main(argv: list[str]) -> None:
    from p2pswarm import wire

    doc = {
        "envelope": [wire.PROTOCOL_MAJOR, wire.PROTOCOL_MINOR],
        "messages": {str(tag): {"name": type(msg).__name__, "hex": wire.encode(msg).hex()}
                     for tag, msg in samples().items()},
        "fields": field_names(),
    }
    text = json.dumps(doc, indent=1, sort_keys=True) + "\n"
    if len(argv) > 1:
        with open(argv[1], "w", encoding="utf-8") as out:
            out.write(text)
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main(sys.argv)
