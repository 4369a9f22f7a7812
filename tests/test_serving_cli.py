"""The serving commands and streamed control answers, against a stand-in agent.

The CLI side (load/loads/unload/generate/chat) runs through typer's CliRunner with the
control client replaced; the agent side of streaming runs the real control server.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import trio
from typer.testing import CliRunner

import p2pswarm.control.client as control_client
from p2pswarm.cli import app
from p2pswarm.control.server import emit, serve_control
from p2pswarm.errors import Busy, PlanChanged
from p2pswarm.planner import BUILTIN_MODELS, cluster_from_dict, plan_message
from p2pswarm.wire.control import ChatRequest, ChatTurn, GenerateRequest, LoadRequest, UnloadRequest
from tests.fakes import RECORD, FakeAgent

runner = CliRunner()


def a_plan(free: str = "16GB") -> dict[str, Any]:
    view = cluster_from_dict({"fellows": [
        {"id": f"{i:02x}", "name": f"fellow-{i + 1}",
         "cards": [{"index": 0, "kind": "cpu", "name": "CPU", "total_bytes": "16GB",
                    "free_bytes": free if i == 1 else "16GB"}]} for i in range(3)]})
    return plan_message({"model": {"name": "small-llama", "config": BUILTIN_MODELS[
        "small-llama"]}, "stages": 3, "weights_dtype": "f32"}, view)


def test_load_with_plan_prints_the_plan_and_loads_nothing(agent: FakeAgent) -> None:
    plan = a_plan()
    agent.answers["plan"] = plan
    result = runner.invoke(app, ["load", "small-llama", "--plan", "--stages", "3",
                                 "--weights-dtype", "f32"])
    assert result.exit_code == 0, result.output
    assert f"plan_id {plan['plan_id']}" in result.stdout and "▕" in result.stdout
    assert [r["op"] for r in agent.requests] == ["plan"]
    sent = agent.requests[0]["request"]
    assert sent["model"]["name"] == "small-llama" and sent["stages"] == 3


def test_load_shows_progress_per_fellow_then_where_it_runs(agent: FakeAgent) -> None:
    agent.answers["load"] = RECORD
    agent.events["load"] = [
        {"progress": {"stage": 1, "fellow": "fellow-2", "phase": "checked", "done_bytes": 0,
                      "total_bytes": 59_000_000}},
        {"progress": {"stage": 1, "fellow": "fellow-2", "phase": "fetching",
                      "done_bytes": 30_000_000, "total_bytes": 60_000_000}},
        {"progress": {"stage": 1, "fellow": "fellow-2", "phase": "ready",
                      "done_bytes": 59_000_000, "total_bytes": 59_000_000}}]
    result = runner.invoke(app, ["load", "small-llama", "--plan-id", "0123456789abcdef"])
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "stage 1 on fellow-2: fetching weights 30.0 / 60.0 MB" in out
    assert "stage 1 on fellow-2: ready, 59.0 MB allocated (plan claimed 59.0 MB)" in out
    assert "loaded plan 0123456789abcdef (small-llama): 3 stages in 1.5 s" in out
    (sent,) = agent.sent(LoadRequest)
    assert len(agent.requests) == 1 and sent.plan_id == "0123456789abcdef"
    assert sent.path == ""  # a built-in: no directory to offer


def test_plan_changed_says_what_changed_and_the_new_id(agent: FakeAgent) -> None:
    new = a_plan(free="1.2GB")
    agent.answers["load"] = PlanChanged("0123456789abcdef", new["plan_id"],
                                        ["fellow-2's CPU now has 1.2 GB free, was 16.0 GB"], new)
    result = runner.invoke(app, ["load", "small-llama", "--plan-id", "0123456789abcdef",
                                 "--stages", "3", "--weights-dtype", "f32"])
    assert result.exit_code == 1
    assert "plan-changed (409): plan 0123456789abcdef no longer holds" in result.stderr
    assert "  - fellow-2's CPU now has 1.2 GB free, was 16.0 GB" in result.stderr
    assert f"p2pswarm load small-llama --plan-id {new['plan_id']}" in result.stderr
    assert f"plan_id {new['plan_id']}" in result.stdout  # the new plan, shown
    as_json = runner.invoke(app, ["load", "small-llama", "--plan-id", "0123456789abcdef",
                                  "--json"])
    assert as_json.exit_code == 1
    data = json.loads(as_json.stdout)
    assert data["code"] == 409 and data["new_plan_id"] == new["plan_id"]


def test_generate_streams_sanitised_text_then_the_timings(agent: FakeAgent) -> None:
    agent.events["generate"] = [{"token": 72, "text": "Hel"}, {"token": 108, "text": "lo"},
                                {"token": 27, "text": "\x1b[2J!"}]
    agent.answers["generate"] = {
        "token_ids": [72, 108, 27], "text": "Hello\x1b[2J!", "stop_reason": "max_tokens",
        "prompt_tokens": 4, "time_to_first_token_s": 0.05, "decode_tokens_per_s": 31.0,
        "network_ms_per_token": 1.2, "hops": 4,
        "stages": [{"stage": i, "fellow": f"fellow-{i + 1}", "layers": [4 * i, 4 * i + 4],
                    "ms_per_token": 8.0} for i in range(3)]}
    result = runner.invoke(app, ["generate", "Hi", "--max-tokens", "3", "--seed", "5"])
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("Hello\ufffd[2J!")  # no escape reaches the terminal
    assert "3 tokens (max_tokens)" in result.stderr and "31.0 tokens/s" in result.stderr
    assert "stage 1 fellow-2 (layers 4-7) 8.0 ms" in result.stderr
    assert "network 1.2 ms over 4 hops" in result.stderr
    (sent,) = agent.sent(GenerateRequest)
    assert sent.prompt == "Hi" and sent.max_tokens == 3 and sent.seed == 5
    bad = runner.invoke(app, ["generate", "Hi", "--max-tokens", "0"])
    assert bad.exit_code == 2 and bad.stderr.startswith("error: --max-tokens 0")


def test_chat_takes_turns_until_end_of_input(agent: FakeAgent) -> None:
    replies = iter([" hello", " again"])
    agent.answers["chat"] = lambda req: {"text": next(replies), "token_ids": []}
    result = runner.invoke(app, ["chat", "--max-tokens", "8"], input="hi\n\nand you?\n")
    assert result.exit_code == 0, result.output
    turns = agent.sent(ChatRequest)
    sent = [list(r.messages) for r in turns]  # the whole conversation, every turn
    assert sent == [[ChatTurn("user", "hi")],
                    [ChatTurn("user", "hi"), ChatTurn("assistant", " hello"),
                     ChatTurn("user", "and you?")]]
    assert len(turns) == len(agent.requests) and all(r.generate.max_tokens == 8 for r in turns)


def test_a_full_queue_is_one_line(agent: FakeAgent) -> None:
    agent.answers["generate"] = Busy("plan 0123456789abcdef is busy: 1 generation running "
                                     "and 32 waiting, the queue is full; try again in 9 s", 9)
    result = runner.invoke(app, ["generate", "Hi"])
    assert result.exit_code == 1
    assert result.stderr == ("error: plan 0123456789abcdef is busy: 1 generation running and "
                             "32 waiting, the queue is full; try again in 9 s\n")


def test_loads_and_unload(agent: FakeAgent) -> None:
    agent.answers["loads"] = {"loads": [RECORD]}
    agent.answers["unload"] = {"unloaded": ["0123456789abcdef"]}
    shown = runner.invoke(app, ["loads", "--json"])
    assert shown.exit_code == 0 and json.loads(shown.stdout)[0]["plan_id"] == RECORD["plan_id"]
    table = runner.invoke(app, ["loads"])
    assert "loaded plan 0123456789abcdef" in table.stdout and "fellow-3" in table.stdout
    gone = runner.invoke(app, ["unload", "0123456789abcdef"])
    assert gone.exit_code == 0 and gone.stdout.strip() == "unloaded 0123456789abcdef"
    assert agent.sent(UnloadRequest)[-1] == UnloadRequest("0123456789abcdef", False)


def test_loads_says_where_each_stage_is_copied_ahead(agent: FakeAgent) -> None:
    copies = [{"stage": 0, "fellow": "fellow-4", "fellow_id": "04", "state": "held"},
              {"stage": 1, "fellow": "fellow-[b]5", "fellow_id": "05", "state": "copying"}]
    agent.answers["loads"] = {"loads": [{**RECORD, "copies": copies}]}
    table = runner.invoke(app, ["loads"])
    assert table.exit_code == 0, table.output
    assert "copies: stage 0 on fellow-4, stage 1 on fellow-[b]5 (copying)" in table.stdout


# --- the agent's side: events before the result ------------------------------------------


async def test_streamed_answers_carry_events_and_one_shot_ones_do_not(tmp_path: Path) -> None:
    home = tmp_path / "h"
    home.mkdir()

    async def handle(request: dict[str, Any]) -> Any:
        for i in range(3):
            emit({"token": i})
        return {"done": request["op"]}

    async with trio.open_nursery() as nursery:
        await nursery.start(serve_control, home, handle)
        seen: list[Any] = []
        result = await trio.to_thread.run_sync(
            lambda: control_client.stream(home, {"op": "go"}, seen.append, 5.0))
        assert result == {"done": "go"} and seen == [{"token": 0}, {"token": 1}, {"token": 2}]
        one_shot = await trio.to_thread.run_sync(
            lambda: control_client.request(home, {"op": "once"}, 5.0))
        assert one_shot == {"done": "once"}
        nursery.cancel_scope.cancel()
