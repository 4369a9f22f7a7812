"""Control requests are typed messages: one sent encoded and one sent as a plain map reach
the handler as the same value, the codec bounding both; the map's own checks keep their
words."""

from __future__ import annotations

from typing import Any

import pytest

from p2pswarm.control import serving_requests as requests
from p2pswarm.control.requests import checked, decoded, request_map, typed_op
from p2pswarm.errors import ConfigError
from p2pswarm.wire.control import (
    ChatRequest,
    GenerateRequest,
    LoadRequest,
    StatusRequest,
    UnloadRequest,
)
from p2pswarm.wire.orders import unpack_doc


async def test_an_encoded_request_and_a_plain_map_reach_the_handler_alike() -> None:
    seen: list[GenerateRequest] = []

    async def handler(call: GenerateRequest) -> str:
        seen.append(call)
        return "done"

    op = typed_op(GenerateRequest, requests.generate_request, handler)
    want = GenerateRequest("hello", None, "", 7, 0.5, 40, 0.9, 3, (2,), True)
    assert await op(request_map("generate", want)) == "done"
    assert await op({"op": "generate", "prompt": "hello", "max_tokens": "7",
                     "temperature": 0.5, "top_k": 40, "top_p": 0.9, "seed": 3,
                     "stop_token_ids": [2], "remember": True}) == "done"
    assert seen == [want, want]


@pytest.mark.parametrize(("request_", "words"), [
    ({}, "generate needs a non-empty \"prompt\" or \"prompt_ids\""),
    ({"prompt": "x", "stop_token_ids": "2"}, "\"stop_token_ids\" must be a list"),
    ({"prompt": "x", "top_k": "many"}, "generate: a bad number"),
    ({"prompt_ids": [-1]}, "\"prompt_ids\" must be a non-empty list"),
    ({"prompt": "x", "plan_id": 5}, "'plan_id' must be a string"),
])
def test_a_plain_generate_map_is_checked_in_its_own_words(request_: dict[str, Any],
                                                          words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        requests.generate_request(request_)


def test_the_codec_bounds_a_request_made_from_a_map() -> None:
    with pytest.raises(ConfigError, match="GenerateRequest"):
        checked(requests.generate_request({"prompt": "x", "max_tokens": 2**70}))
    with pytest.raises(ConfigError, match="GenerateRequest"):
        checked(requests.generate_request({"prompt": "x", "temperature": float("nan")}))
    with pytest.raises(ConfigError, match="UnloadRequest"):
        checked(requests.unload_request({"plan_id": "p" * 65}))


def test_an_encoded_request_of_another_op_is_refused() -> None:
    raw = request_map("status", StatusRequest())["msg"]
    assert decoded(raw, StatusRequest) == StatusRequest()
    with pytest.raises(ConfigError, match="expected one UnloadRequest"):
        decoded(raw, UnloadRequest)
    with pytest.raises(ConfigError, match="malformed"):
        decoded(b"\x00junk", StatusRequest)


def test_load_and_chat_requests_from_maps() -> None:
    load = requests.load_request({"request": {"model": {"name": "m"}}, "plan_id": "ab",
                                  "load_id": "0f"})
    assert isinstance(load, LoadRequest) and unpack_doc(load.request) == {"model": {"name": "m"}}
    assert (load.plan_id, load.path, load.load_id) == ("ab", "", "0f")
    with pytest.raises(ConfigError, match="a load op needs a \"request\" map"):
        requests.load_request({})
    chat = requests.chat_request({"messages": [{"role": "user", "content": "hi"}],
                                  "max_tokens": 5, "temperature": 0.7})
    assert isinstance(chat, ChatRequest) and checked(chat) == chat
    assert [(t.role, t.content) for t in chat.messages] == [("user", "hi")]
    assert (chat.generate.max_tokens, chat.generate.temperature) == (5, 0.7)
    with pytest.raises(ConfigError, match="chat: max_tokens must be a whole number"):
        requests.chat_request({"messages": [{"role": "user", "content": "hi"}],
                               "max_tokens": "x"})
