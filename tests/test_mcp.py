"""`p2pswarm mcp` through the MCP SDK's own client, against a running agent.

The agent runs in this process on real loopback sockets (as `p2pswarm join` runs it,
with fake cards); the MCP server is the real command in a subprocess, spoken to over
stdio by ``ClientSession``. Waiting for the agent to lead polls that condition under a
deadline, never a fixed sleep.
"""

from __future__ import annotations

import json
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

pytest.importorskip("mcp", reason="the MCP server needs the `mcp` package (test extra)")

from mcp import ClientSession, StdioServerParameters, stdio_client  # noqa: E402

from p2pswarm.agent.node import NodeSettings, run_node  # noqa: E402
from p2pswarm.cards import Card  # noqa: E402
from p2pswarm.config import preset  # noqa: E402
from p2pswarm.home import Home  # noqa: E402
from p2pswarm.inventory import FakeCardSource  # noqa: E402
from p2pswarm.mcp_server import TOOL_NAMES  # noqa: E402

GB = 10**9
DEADLINE_S = 60
CARDS = (
    Card(index=0, kind="cuda", name="RTX 3060", uuid="GPU-test-0", total_bytes=12 * GB,
         free_bytes=11 * GB),
    Card(index=0, kind="cpu", name="Test CPU", uuid="cpu-test", total_bytes=16 * GB,
         free_bytes=12 * GB),
)


@asynccontextmanager
async def running_agent(home: Path) -> AsyncIterator[Any]:
    Home(home).init()
    settings = NodeSettings(home=home, listen="127.0.0.1:0", seeds=(), name="deskpc",
                            config=preset("local"), card_source=FakeCardSource(CARDS))
    async with trio.open_nursery() as nursery:
        agent = await nursery.start(run_node, settings)
        with trio.fail_after(DEADLINE_S):
            while agent.leader() is None or agent.leader()["id"] != agent.node_id.hex():
                await trio.sleep(0.05)  # polls a condition; the deadline bounds it
        yield agent
        await agent.leave()
        nursery.cancel_scope.cancel()


@asynccontextmanager
async def mcp_session(home: Path) -> AsyncIterator[ClientSession]:
    params = StdioServerParameters(command=sys.executable,
                                   args=["-m", "p2pswarm.cli", "mcp", "--home", str(home)])
    async with stdio_client(params) as (read, write):
        async with ClientSession(read, write) as session:
            with trio.fail_after(DEADLINE_S):
                await session.initialize()
            yield session


def answer(result: Any) -> dict[str, Any]:
    """A successful tool call's JSON answer."""
    assert not result.is_error, result.content[0].text
    if result.structured_content is not None:
        return dict(result.structured_content)
    return dict(json.loads(result.content[0].text))


def error_text(result: Any) -> str:
    assert result.is_error, f"expected a tool error, got {result.content}"
    text = "\n".join(c.text for c in result.content)
    assert "Traceback" not in text
    return text


async def test_mcp_tools_against_a_running_agent(tmp_path: Path) -> None:
    home = tmp_path / "home"
    async with running_agent(home) as agent, mcp_session(home) as session:
        with trio.fail_after(DEADLINE_S):
            tools = {t.name: t for t in (await session.list_tools()).tools}
            assert set(TOOL_NAMES) <= set(tools)
            plan_schema = tools["models_plan"].input_schema
            assert {"model", "context", "stages", "kv_dtype", "maximize",
                    "exclude_cards"} <= set(plan_schema["properties"])

            status = answer(await session.call_tool("swarm_status", {}))
            assert status["self"] == {"id": agent.node_id.hex(), "name": "deskpc",
                                      "addr": agent.addr,
                                      "listen": agent.transport.local_addr}
            assert status["leader"]["name"] == "deskpc" and status["role"] == "leader"

            plan = answer(await session.call_tool("models_plan", {"model": "tiny-llama"}))
            assert plan["fits"] is True
            assert len(plan["plan_id"]) == 16
            assert plan["layout"]["limit"]["sentence"]
            assert "tiny-llama" in plan["summary"]
            # weights dtype auto by default: each stage says its dtype and why
            assert plan["request"]["weights_dtype"] == "auto"
            assert "auto" in plan_schema["properties"]["weights_dtype"]["anyOf"][0]["enum"]
            assert all(s["weights_dtype"] == "f16" and s["dtype_reason"].startswith("f16: ")
                       for s in plan["stages"])
            me = agent.node_id.hex()
            assert sorted((c["fellow_id"], c["kind"]) for c in plan["cards"]) == [
                (me, "cpu"), (me, "cuda")]
            for card in plan["cards"]:
                assert card["used"] or card["reason"]
                assert sum(v for k, v in card["segments"].items() if k != "does_not_fit") \
                    == card["total_bytes"]

            # the same fields plan the same: the plan_id is stable
            again = answer(await session.call_tool("models_plan", {"model": "tiny-llama"}))
            assert again["plan_id"] == plan["plan_id"]

            # leaving the GPU out: the plan says so in the card's reason, and runs elsewhere
            used = next(c for c in plan["cards"] if c["used"])
            card = f"{me}:{used['index'] if used['kind'] == 'cuda' else 'cpu'}"
            without = answer(await session.call_tool(
                "models_plan", {"model": "tiny-llama", "exclude_cards": [card]}))
            left = next(c for c in without["cards"] if c["kind"] == used["kind"])
            assert not left["used"] and left["reason"] == "left out by you"
            assert without["plan_id"] != plan["plan_id"]

            longest = answer(await session.call_tool(
                "models_plan", {"model": "tiny-llama", "maximize": "context"}))
            assert longest["request"]["context"] >= plan["request"]["context"]

            # bad arguments: a clear tool error, and the server keeps answering
            text = error_text(await session.call_tool(
                "models_plan", {"model": "tiny-llama", "maximize": "fastest"}))
            assert "maximize: input should be 'context' or 'speed' (got 'fastest')" in text
            text = error_text(await session.call_tool(
                "models_plan", {"model": "tiny-llama", "exclude_cards": ["nobody:0"]}))
            assert "no fellow 'nobody'" in text
            text = error_text(await session.call_tool("models_plan", {"model": "no-such"}))
            assert "unknown model 'no-such'" in text
            text = error_text(await session.call_tool(
                "models_plan", {"model": "tiny-llama", "context": 10**9}))
            assert "maximum" in text
            text = error_text(await session.call_tool(
                "models_load", {"model": "tiny-llama", "plan_id": "0123456789abcdef"}))
            assert "plan-changed (409)" in text and plan["plan_id"] in text

            # jobs: a bad config is refused here; a good one reaches the agent's job ops
            text = error_text(await session.call_tool("jobs_plan", {"config": {"seq_len": 8}}))
            assert "job config" in text and "model" in text
            jobs = await session.call_tool("jobs_list", {})
            if jobs.is_error:
                assert "not available from this agent" in error_text(jobs)
            else:
                assert "jobs" in answer(jobs)

            loads = answer(await session.call_tool("models_loads", {}))
            assert loads["loads"] == []
