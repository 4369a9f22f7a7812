"""A document read at the edge: each field checked against its type and bounds as it is
read, a bad one a ConfigError naming what was read."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from p2pswarm.agent.serving.doc_fields import DocFields
from p2pswarm.errors import ConfigError


def test_fields_are_read_checked() -> None:
    f = DocFields({"n": 3, "t": "x", "s": 0.5, "on": True, "m": {"k": 1}, "l": [1, 2]}, "a doc")
    assert (f.whole("n"), f.text("t"), f.number("s"), f.flag("on")) == (3, "x", 0.5, True)
    assert f.fields("m").whole("k") == 1 and f.pair("l") == (1, 2) and f.items("l", 2) == [1, 2]
    assert f.whole("missing", 7) == 7 and f.value("missing", None) is None
    assert not f.flag("missing") and not f.has("missing")


@pytest.mark.parametrize("read", [
    lambda f: f.whole("t"), lambda f: f.whole("on"), lambda f: f.whole("n", high=2),
    lambda f: f.text("n"), lambda f: f.text("t", max_chars=0), lambda f: f.number("t"),
    lambda f: f.fields("n"), lambda f: f.items("l", 1), lambda f: f.pair("t"),
    lambda f: f.value("missing"),
])
def test_a_bad_field_is_a_config_error(read: Callable[[DocFields], object]) -> None:
    f = DocFields({"n": 3, "t": "x", "on": True, "l": [1, 2]}, "a doc")
    with pytest.raises(ConfigError, match="a doc"):
        read(f)


def test_a_document_that_is_not_a_map_is_refused() -> None:
    with pytest.raises(ConfigError, match="a record is not a map"):
        DocFields([1], "a record")
