"""The planner refuses requests beyond sane bounds, from a local `plan DIR` and from a
fellow's plan message alike, in one line naming the bound and why it is enough; every
published shape the planner knows stays inside them."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from p2pswarm.errors import ConfigError
from p2pswarm.planner import REFERENCE_CONFIGS, profile_from_config, read_plan_message
from p2pswarm.planner.request import MAX_STAGES, request_from_dict
from p2pswarm.shapes.model_config import SIZE_BOUNDS
from tests.planner_cases import MID_CONFIG
from tests.test_bad_local_input import cluster, one_line_error

# Llama 3.1 405B, the largest published dense decoder of this family
LLAMA_405B: dict[str, Any] = {
    "model_type": "llama", "vocab_size": 128_256, "hidden_size": 16_384,
    "intermediate_size": 53_248, "num_hidden_layers": 126, "num_attention_heads": 128,
    "num_key_value_heads": 8, "max_position_embeddings": 131_072}


@pytest.mark.parametrize("config", [LLAMA_405B, *REFERENCE_CONFIGS.values()])
def test_published_shapes_are_inside_the_bounds(config: dict[str, Any]) -> None:
    profile_from_config(config, "published")


@pytest.mark.parametrize(("key", "value", "bound"), [
    ("num_hidden_layers", 2**24, "num_layers"),
    ("num_hidden_layers", 2**31 - 1, "num_layers"),
    ("hidden_size", 2**20, "hidden_size"),
    ("intermediate_size", 2**24, "intermediate_size"),
    ("vocab_size", 2**30, "vocab_size"),
    ("num_attention_heads", 4096, "num_heads"),
    ("max_position_embeddings", 2**31 - 1, "max_context_tokens"),
])
def test_a_config_past_a_bound_is_refused_at_once_naming_it(key: str, value: int,
                                                           bound: str) -> None:
    config = dict(MID_CONFIG, **{key: value})
    if key == "num_attention_heads":
        config.update(num_key_value_heads=value, hidden_size=value * 2)
    started = time.perf_counter()
    with pytest.raises(ConfigError) as caught:
        profile_from_config(config, "huge")
    assert time.perf_counter() - started < 0.5
    text = str(caught.value)
    assert bound in text and f"{SIZE_BOUNDS[bound].most:,}" in text
    assert SIZE_BOUNDS[bound].why in text


def test_a_long_list_of_stop_tokens_is_refused_before_it_is_read() -> None:
    with pytest.raises(ConfigError, match="eos_token_ids"):
        profile_from_config(dict(MID_CONFIG, eos_token_id=list(range(10_000))), "stops")


def test_a_plan_message_with_a_huge_model_is_refused_as_a_fellow_sends_it() -> None:
    message = {"model": {"name": "deep", "config": dict(MID_CONFIG, num_hidden_layers=2**24)}}
    with pytest.raises(ConfigError, match="num_layers 16,777,216 is over the 512"):
        read_plan_message(message)


@pytest.mark.parametrize(("field", "value"), [
    ("stages", MAX_STAGES + 1), ("context", 2**31), ("sequences", 2**21),
    ("lora_rank", 2**20)])
def test_request_fields_the_planner_works_on_are_bounded(field: str, value: int) -> None:
    with pytest.raises(ConfigError, match=f"--{field.replace('_', '-')} must be a whole"):
        request_from_dict({field: value})


def test_exclude_lists_are_bounded() -> None:
    with pytest.raises(ConfigError, match="at most 1,024"):
        request_from_dict({"exclude": [f"f:{i}" for i in range(2000)]})


@pytest.mark.parametrize("layers", [2**24, 2**31 - 1])
def test_plan_dir_with_huge_layers_is_one_line(tmp_path: Path, layers: int) -> None:
    model = tmp_path / "deep"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(dict(MID_CONFIG, num_hidden_layers=layers)))
    started = time.perf_counter()
    one_line_error(tmp_path, ["plan", str(model), "--cluster", str(cluster(tmp_path))],
                   f"num_layers {layers:,} is over the 512", "Llama 3.1 405B")
    assert time.perf_counter() - started < 5


def test_more_usable_cards_than_the_planner_searches_are_refused() -> None:
    from p2pswarm.planner.plan import MAX_PLAN_CARDS
    from tests.planner_cases import MID, card, cluster, fellow, make

    fellows = [fellow(f"f{i:03d}", card(0, free=2.0)) for i in range(MAX_PLAN_CARDS + 1)]
    with pytest.raises(ConfigError, match="257 cards are usable; the planner searches at "
                                          "most 256"):
        make(MID, cluster(*fellows))
    assert make(MID, cluster(*fellows[:8])).fits
