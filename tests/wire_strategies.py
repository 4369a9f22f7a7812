"""Hypothesis strategies built from the wire schema: one for every registered message."""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

from hypothesis import strategies as st

from p2pswarm.wire.schema import Items, Range, Size


def for_type(tp: Any, meta: tuple[Any, ...] = ()) -> st.SearchStrategy[Any]:
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        base, *extra = typing.get_args(tp)
        return for_type(base, meta + tuple(extra))
    if origin in (typing.Union, types.UnionType):
        (inner,) = [a for a in typing.get_args(tp) if a is not type(None)]
        return st.none() | for_type(inner, meta)
    if origin is tuple:
        most = next((m.high for m in meta if isinstance(m, Items)), 8)
        return st.lists(for_type(typing.get_args(tp)[0]), max_size=min(most, 4)).map(tuple)
    if tp is bool:
        return st.booleans()
    if tp is int:
        rng = next((m for m in meta if isinstance(m, Range)), Range(-(2**63), 2**64 - 1))
        return st.integers(int(rng.low), int(rng.high))
    if tp is float:
        rng = next((m for m in meta if isinstance(m, Range)), Range(-1e300, 1e300))
        return st.floats(rng.low, rng.high, allow_nan=False, allow_infinity=False)
    if tp is str:
        size = next((m for m in meta if isinstance(m, Size)), Size(0, 64))
        return st.text(min_size=size.low, max_size=min(size.high, 64))
    if tp is bytes:
        size = next((m for m in meta if isinstance(m, Size)), Size(0, 64))
        return st.binary(min_size=size.low, max_size=min(size.high, 64))
    if dataclasses.is_dataclass(tp):
        return for_class(tp)
    raise TypeError(f"no strategy for {tp!r}")


def for_class(cls: type) -> st.SearchStrategy[Any]:
    hints = typing.get_type_hints(cls, include_extras=True)
    return st.builds(cls, **{f.name: for_type(hints[f.name]) for f in dataclasses.fields(cls)})
