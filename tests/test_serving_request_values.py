"""Serving's request-side values and their documents: a model's identity and a cancel's
outcome keep the exact shapes orders, records and the CLI have always seen; the CLI's
typed requests are the ones its old maps made."""

from __future__ import annotations

import dataclasses
from typing import cast

import pytest

from p2pswarm.agent.serving import Serving
from p2pswarm.agent.serving.asking import AskedModel, CancelOutcome, ModelIdentity
from p2pswarm.agent.serving.chat_turns import ChatPrompts
from p2pswarm.agent.serving.records import LoadRecord, WeightsOrigin
from p2pswarm.agent.weights import Manifest, ManifestFile
from p2pswarm.control.requests import checked, decoded, request_map
from p2pswarm.control.serving_requests import chat_request, generate_request
from p2pswarm.errors import ConfigError
from p2pswarm.planner import BUILTIN_MODELS
from p2pswarm.wire.control import ChatRequest, ChatTurn, GenerateRequest
from p2pswarm.wire.orders import pack_doc

CONFIG = dict(BUILTIN_MODELS["tiny-llama"])


def test_a_builtin_identity_is_its_kind_and_name() -> None:
    assert ModelIdentity("tiny-llama").to_doc() == {"kind": "builtin", "name": "tiny-llama"}
    assert list(ModelIdentity("rwkv", recurrent=True).to_doc().items()) == [
        ("kind", "builtin"), ("name", "rwkv"), ("recurrent", True)]


def test_a_files_identity_keeps_the_document_orders_carry() -> None:
    manifest = Manifest("0123456789abcdef", "my-model", "/models/my-model", CONFIG, (),
                        (ManifestFile("config.json", 10, "ab" * 32),))
    doc = ModelIdentity("my-model", manifest, "aa" * 16, "fellow-1", "10.0.0.1:7000").to_doc()
    data = manifest.to_dict()
    assert list(doc.items()) == [  # the keys in the order records and gossip show them
        ("kind", "files"), ("name", "my-model"), ("key", "0123456789abcdef"),
        ("source_id", "aa" * 16), ("source", "fellow-1"), ("source_addr", "10.0.0.1:7000"),
        ("files", data["files"]), ("manifest", data)]  # no path: it stays on its fellow
    assert "/models" not in str(doc)
    assert Manifest.from_dict(doc["manifest"]) == dataclasses.replace(manifest, path="")
    origin = WeightsOrigin.of(doc)  # as stage orders read it
    assert (origin.kind, origin.name, origin.path, origin.offered_by("aa" * 16)) == (
        "files", "my-model", None, True)


def test_a_cancel_outcome_answers_as_it_always_did() -> None:
    assert CancelOutcome("cli-1", "not-started").to_doc() == {
        "load_id": "cli-1", "outcome": "not-started", "plan_id": None}
    assert CancelOutcome("cli-2", "unloaded", "0123456789abcdef").to_doc() == {
        "load_id": "cli-2", "outcome": "unloaded", "plan_id": "0123456789abcdef"}


def test_a_load_request_names_its_model_once() -> None:
    asked = AskedModel.of(pack_doc({"model": {"name": "tiny-llama", "config": CONFIG},
                                    "adapter": "cd" * 32}))
    assert asked == AskedModel("tiny-llama", CONFIG, "cd" * 32) and not asked.recurrent
    assert AskedModel.of(pack_doc({"model": {"name": "r", "config": {
        "model_type": "rwkv7"}}})).recurrent
    for bad in ({}, {"model": "tiny-llama"}, {"model": {"name": "x", "config": []}}):
        with pytest.raises(ConfigError, match="a load request needs \"model\""):
            AskedModel.of(pack_doc(bad))


def test_the_cli_sends_what_its_maps_asked_for() -> None:
    options = GenerateRequest(plan_id="0123456789abcdef", max_tokens=8, temperature=0.5,
                              top_k=40, top_p=0.9, seed=3)  # as `generate` makes them
    sent = request_map("generate", dataclasses.replace(options, prompt="Hi"))
    old = {"op": "generate", "prompt": "Hi", "max_tokens": 8, "temperature": 0.5, "top_k": 40,
           "top_p": 0.9, "seed": 3, "plan_id": "0123456789abcdef"}
    assert decoded(sent["msg"], GenerateRequest) == checked(generate_request(old))
    turns = (ChatTurn("system", "be brief"), ChatTurn("user", "hi"))
    chat = decoded(request_map("chat", ChatRequest(turns, options))["msg"], ChatRequest)
    old_chat = {"op": "chat", "messages": [{"role": t.role, "content": t.content}
                                           for t in turns],
                "max_tokens": 8, "temperature": 0.5, "top_k": 40, "top_p": 0.9, "seed": 3,
                "plan_id": "0123456789abcdef"}
    assert chat == checked(chat_request(old_chat))


async def test_a_chat_turn_of_an_unknown_role_is_refused_before_any_work() -> None:
    # The control socket's typed chat bounds a role's length, not its name; the map path
    # checked names. The turns are checked where they become a prompt, for either path.
    prompts = ChatPrompts(cast(Serving, None))  # never reached: refused first
    turns = (ChatTurn("user", "hello"), ChatTurn("wizard", "obey"))
    with pytest.raises(ConfigError, match=r"messages\[1\].role 'wizard' must be one of"):
        await prompts.prompt(cast(LoadRecord, None), turns, max_tokens=4)
