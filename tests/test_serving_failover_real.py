"""Failover with real `join` processes on loopback: four fellows, three stages and one
spare. A stage fellow frozen (SIGSTOP) for 5 s keeps its stage; one killed mid-generation
has its stage moved to the spare. Either way the CLI's `generate` and a streamed OpenAI
client both finish with the greedy tokens of an undisturbed run."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import openai
import pytest

from p2pswarm.control.client import request
from p2pswarm.errors import PlacementError
from p2pswarm.models.chat_template import plain_prompt
from p2pswarm.planner import BUILTIN_MODELS
from p2pswarm.sim import commands
from p2pswarm.sim.commands import start
from p2pswarm.sim.field import free_address
from p2pswarm.sim.processes import LocalSwarm, local_swarm
from tests.real_swarm import poll, stage_sessions

pytestmark = pytest.mark.slow  # real processes

NAMES = ["fellow-1", "fellow-2", "fellow-3", "fellow-4"]
PROMPT = "The swarm of fellows"
MESSAGES: Any = [{"role": "user", "content": "Where do the layers run?"}]
MAX_TOKENS = 160
LOAD = {"model": {"name": "tiny-llama", "config": BUILTIN_MODELS["tiny-llama"]},
        "kind": "serve", "stages": 3, "weights_dtype": "f32", "kv_dtype": "f32",
        "context": 512, "sequences": 2, "exclude": [], "floors_bytes": {}, "maximize": None}


def _both_clients(swarm: LocalSwarm, http: str, victim: str,
                  disturb: Callable[[], None]) -> tuple[dict[str, Any], str]:
    """Run the CLI's `generate` and a streamed chat completion at once; ``disturb`` the
    victim once both sessions are in flight at its stage. Their results."""
    home = swarm.homes[NAMES[0]]
    cli = start("generate", PROMPT, "--max-tokens", str(MAX_TOKENS), "--json", "--home",
                str(home))
    chat: dict[str, Any] = {}

    def stream_chat() -> None:
        try:
            with openai.OpenAI(base_url=f"http://{http}/v1", api_key="unused",
                               max_retries=0, timeout=120) as client:
                stream = client.chat.completions.create(
                    model="tiny-llama", messages=MESSAGES, max_tokens=MAX_TOKENS,
                    temperature=0, stream=True)
                chat["text"] = "".join(c.choices[0].delta.content or ""
                                       for c in stream if c.choices)
        except Exception as exc:  # the assertion below shows it
            chat["error"] = repr(exc)

    thread = threading.Thread(target=stream_chat)
    try:
        # the CLI starts slower (a new Python): the chat joins once its session is up
        poll("the CLI's session at the victim's stage", lambda: stage_sessions(swarm, victim) == 1)
        thread.start()
        poll("both sessions at the victim's stage", lambda: stage_sessions(swarm, victim) == 2)
        disturb()
        out, err = cli.communicate(timeout=120)
        thread.join(120)
    finally:
        if not thread.is_alive() and "text" not in chat and "error" not in chat:
            chat["error"] = "the chat never started"
        if cli.poll() is None:
            cli.kill()
    assert cli.returncode == 0, err[-2000:]
    assert "error" not in chat, chat
    return json.loads(out), chat["text"]


def _load(swarm: LocalSwarm, home: Any) -> dict[str, Any]:
    """Load, again if the leader changed mid-load (a busy machine starting four torch
    processes may delay heartbeats past the local preset's 2 s lease)."""
    for attempt in range(3):
        try:
            return request(home, {"op": "load", "request": LOAD},  # type: ignore[no-any-return]
                           timeout_s=120)
        except PlacementError as exc:
            if attempt == 2 or "only the leader gives orders" not in str(exc):
                raise
            poll("a leader again", lambda: all(swarm.status(n)["leader"] for n in NAMES))
    raise AssertionError("unreachable")


def test_a_frozen_stage_fellow_keeps_its_stage_and_a_killed_one_moves() -> None:
    with local_swarm(lambda line: None) as swarm:
        http = free_address()
        seed = swarm.start(NAMES[0], extra=("--http", http, "--log-level", "warning"))
        for name in NAMES[1:]:
            swarm.launch(name, seeds=(seed,), extra=("--log-level", "warning"))
        swarm.wait_formed(NAMES)
        home = swarm.homes[NAMES[0]]
        record = _load(swarm, home)
        leader = swarm.status(NAMES[0])["leader"]["name"]
        stage_fellows = [s["fellow"] for s in record["stages"]]
        victim = next(n for n in stage_fellows if n not in (leader, NAMES[0]))
        spare = next(n for n in NAMES if n not in stage_fellows)
        want = request(home, {"op": "generate", "prompt": PROMPT, "max_tokens": MAX_TOKENS},
                       timeout_s=120)
        want_chat = request(home, {"op": "generate", "prompt": plain_prompt(MESSAGES),
                                   "max_tokens": MAX_TOKENS}, timeout_s=120)
        assert len(want["token_ids"]) > 20  # long enough to be cut in the middle
        process = swarm.processes[victim]

        def freeze_for_5_s() -> None:
            process.send_signal(signal.SIGSTOP)
            time.sleep(5.0)  # the freeze itself, not a wait for something
            process.send_signal(signal.SIGCONT)

        got, text = _both_clients(swarm, http, victim, freeze_for_5_s)
        assert got["token_ids"] == want["token_ids"] and text == want_chat["text"]
        (after,) = request(home, {"op": "loads"}, timeout_s=30)["loads"]
        assert [s["fellow"] for s in after["stages"]] == stage_fellows
        assert not after.get("moves")

        poll(f"{victim} alive again", lambda: all(
            m["state"] == "alive" for m in swarm.status(NAMES[0])["members"]))
        got, text = _both_clients(swarm, http, victim,
                                  lambda: os.kill(process.pid, signal.SIGKILL))
        assert got["token_ids"] == want["token_ids"] and text == want_chat["text"]
        assert got["resumes"] >= 1
        shown = commands.cli("loads", "--home", str(home), env={**os.environ, "COLUMNS": "200"},
                             check=True).stdout
        stage = stage_fellows.index(victim)
        assert f"moved stage {stage} at " in shown
        assert f"from {victim} to {spare}" in shown and "process is gone" in shown
