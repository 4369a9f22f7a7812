"""Serving's values on the wire: a stage order and a route keep every field, and the
codec bounds them."""

from __future__ import annotations

import dataclasses

import pytest

from p2pswarm import wire
from p2pswarm.agent.serving.records import (
    LoadRecord,
    StageOrder,
    WeightsOrigin,
    generation_tokens,
    route_dict,
    route_hop,
    runtime_block,
)
from p2pswarm.errors import ConfigError, LocalProtocolError
from p2pswarm.wire.loads import StagePrepare, StageStart

RUNTIME = {"dtype": "float16", "quant": "int4", "quant_group_size": 32,
           "prefill_chunk_tokens": 256, "kv_dtype": "float16", "max_context_tokens": 4096,
           "max_sessions": 2}
ORDER = StageOrder(
    plan_id="0123456789abcdef", stage=1, n_stages=3, fellow_id="ab" * 16, layers=(4, 9),
    card_kind="cuda", card_index=0, card_name="GTX 1050 Ti", claim_bytes=3 * 2**30,
    need_bytes=3 * 2**30 + 12345, runtime=runtime_block(RUNTIME),
    model={"kind": "files", "name": "m", "manifest": {"files": [], "tensors": []}},
    progress_addr="10.0.0.2:7000", ticket="00ff", adapter={"rank": 8, "alpha": 16})
HOP = {"stage": 0, "fellow_id": "cd" * 16, "fellow": "fxserver", "addr": "10.0.0.3:7000",
       "layers": [0, 4], "card": "CPU", "claim_bytes": 10, "allocated_bytes": 9,
       "fetched_bytes": 0, "fetch_s": 0.5}


def test_a_stage_order_crosses_the_wire_whole() -> None:
    (msg,) = wire.decode(wire.encode(StagePrepare(ORDER.to_wire(), 7)), max_bytes=1 << 20)
    assert msg.term == 7
    assert StageOrder.from_wire(msg.order) == ORDER


def test_a_route_crosses_the_wire_whole() -> None:
    (msg,) = wire.decode(wire.encode(StageStart("0123456789abcdef", (route_hop(HOP, 0),))),
                         max_bytes=1 << 20)
    assert [route_dict(h) for h in msg.route] == [HOP]


def test_out_of_bounds_fields_do_not_travel() -> None:
    with pytest.raises(LocalProtocolError):
        wire.encode(StagePrepare(dataclasses.replace(ORDER, stage=70000).to_wire()))
    with pytest.raises(LocalProtocolError):
        wire.encode(StagePrepare(dataclasses.replace(ORDER, plan_id="").to_wire()))


def test_a_model_that_is_not_a_document_is_a_malformed_order() -> None:
    bad = dataclasses.replace(ORDER.to_wire(), model=b"\xc1")
    with pytest.raises(ConfigError, match="malformed stage order"):
        StageOrder.from_wire(bad)


RECORD = {"plan_id": "0123456789abcdef", "model": {"kind": "builtin", "name": "tiny-llama"},
          "runtime": RUNTIME, "stages": [HOP, {**HOP, "stage": 1, "layers": [4, 9]}],
          "recut_from": ["fedcba9876543210"], "load_s": 1.0}


def test_a_load_record_reads_its_route_and_runtime() -> None:
    record = LoadRecord.from_doc(RECORD)
    assert record.plan_id == RECORD["plan_id"] and record.recut_from == ("fedcba9876543210",)
    assert [route_dict(h) for h in record.stages] == RECORD["stages"]
    assert (record.max_sessions, record.prefill_chunk_tokens, record.context_tokens) == \
        (2, 256, 4096)
    assert record.generation_tokens() == generation_tokens(RECORD)
    recurrent = {**RECORD, "model": {"recurrent": True}}
    assert LoadRecord.from_doc(recurrent).generation_tokens() == generation_tokens(recurrent)


@pytest.mark.parametrize("broken", [
    {"plan_id": 7}, {"stages": []}, {"stages": [{**HOP, "stage": 1}]},
    {"stages": [{**HOP, "fellow_id": "not hex"}]}, {"stages": [{**HOP, "addr": None}]},
    {"runtime": None}, {"runtime": {"max_sessions": "many"}}, {"model": []},
])
def test_a_malformed_load_record_is_refused(broken: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        LoadRecord.from_doc({**RECORD, **broken})


def test_a_weights_origin_reads_what_the_identity_says() -> None:
    origin = WeightsOrigin.of({"kind": "files", "name": "m", "source_id": "ab", "path": "/m"})
    assert (origin.kind, origin.name, origin.path) == ("files", "m", "/m")
    assert origin.offered_by("ab") and not origin.offered_by("cd")
    assert origin.source_name() == "the source" and origin.source is None
    named = WeightsOrigin.of({"kind": "builtin", "source": "x" * 80})
    assert named.source_name() == "x" * 64 and named.source_id == "" and named.path is None
