"""The OpenAI-compatible endpoint through the official ``openai`` client, against a
built-in model loaded across two real agents on loopback: the text it answers is the
``generate`` op's for the same prompt, streamed or not. The load has one session slot:
many clients at once wait in line and complete in order of arrival, a full line answers
429, a client that hangs up while in line leaves it."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from p2pswarm.control.server import current_emitter, emitting_to
from p2pswarm.http.openai_api import StopScanner
from p2pswarm.http.problems import from_swarm_error
from p2pswarm.models.chat_template import (
    ChatRefused,
    ChatTemplate,
    plain_prompt,
    read_chat_template,
    render_chat,
)
from tests.http_swarm import LoopbackSwarm, serve_message

PROMPT = "The swarm of fellows"
MESSAGES: Any = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Where do the layers run?"}]


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoopbackSwarm]:
    with LoopbackSwarm(tmp_path_factory.mktemp("openai")) as running:
        agent = running.agents[1]
        running.call(agent.control_ops["load"], {"op": "load", "request": serve_message()})
        yield running


@pytest.fixture
def client(swarm: LoopbackSwarm) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{swarm.url(1)}/v1", api_key="unused", max_retries=0,
                       timeout=60) as c:
        yield c


def generate(swarm: LoopbackSwarm, prompt: str, max_tokens: int,
             **sampling: Any) -> dict[str, Any]:
    """The generate op on the same fellow (greedy unless told): what the endpoint must
    answer."""
    agent = swarm.agents[1]
    return swarm.call(agent.control_ops["generate"], {  # type: ignore[no-any-return]
        "op": "generate", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
        **sampling})


def test_models_lists_the_load(swarm: LoopbackSwarm, client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny-llama"]
    plan_id = models[0].model_extra["plan_id"]  # type: ignore[index]
    assert client.models.retrieve("tiny-llama").id == "tiny-llama"
    assert client.models.retrieve(plan_id).id == "tiny-llama"


def test_completions_equal_the_generate_op(swarm: LoopbackSwarm, client: openai.OpenAI) -> None:
    expected = generate(swarm, PROMPT, 12)
    answer = client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=12,
                                       temperature=0)
    assert answer.choices[0].text == expected["text"]
    assert answer.choices[0].finish_reason == ("length" if expected["stop_reason"] ==
                                               "max_tokens" else "stop")
    assert answer.usage is not None
    assert answer.usage.prompt_tokens == expected["prompt_tokens"]
    assert answer.usage.completion_tokens == len(expected["token_ids"])

    chunks = list(client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=12,
                                            temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected["text"]
    assert len([c for c in chunks if c.choices[0].text]) > 1  # piece by piece, not at the end
    assert chunks[-1].choices[0].finish_reason == answer.choices[0].finish_reason


def test_chat_completions_equal_the_generate_op(swarm: LoopbackSwarm,
                                                client: openai.OpenAI) -> None:
    prompt = plain_prompt(MESSAGES)
    assert prompt == "System: You are terse.\nUser: Where do the layers run?\nAssistant:"
    expected = generate(swarm, prompt, 10)
    answer = client.chat.completions.create(model="tiny-llama", messages=MESSAGES,
                                            max_tokens=10, temperature=0)
    assert answer.choices[0].message.role == "assistant"
    assert answer.choices[0].message.content == expected["text"]

    stream = client.chat.completions.create(model="tiny-llama", messages=MESSAGES,
                                            max_tokens=10, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected["text"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(
        expected["token_ids"])


def test_seeded_sampling_and_a_stop_string(swarm: LoopbackSwarm,
                                           client: openai.OpenAI) -> None:
    full = generate(swarm, PROMPT, 24, temperature=1.0, seed=7)["text"]
    sampled = client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=24,
                                        temperature=1.0, seed=7)
    assert sampled.choices[0].text == full
    assert len(set(full)) > 3  # varied text, where a stop string can fall mid-answer
    cut = next(i for i, ch in enumerate(full)
               if i > 2 and ch.isascii() and ch.isprintable() and ch not in full[:i])
    stop = full[cut]
    want = full[:cut]
    answer = client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=24,
                                       temperature=1.0, seed=7, stop=[stop, "never there"])
    assert answer.choices[0].text == want and answer.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=24,
                                            temperature=1.0, seed=7, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_what_cannot_be_done_is_refused_clearly(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError, match="not loaded"):
        client.completions.create(model="llama-3-8b", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="n must be 1"):
        client.completions.create(model="tiny-llama", prompt="hi", max_tokens=2, n=2)
    with pytest.raises(openai.BadRequestError, match="exceed the load's context of 512"):
        client.completions.create(model="tiny-llama", prompt="hi", max_tokens=5000)
    with pytest.raises(openai.BadRequestError, match="role"):
        wizard: Any = [{"role": "wizard", "content": "hi"}]
        client.chat.completions.create(model="tiny-llama", max_tokens=2, messages=wizard)
    with pytest.raises(openai.BadRequestError, match="not valid JSON"):
        client.post("/completions", cast_to=object, content=b"{nope",
                    options={"headers": {"content-type": "application/json"}})


def test_stop_scanner_holds_back_what_may_begin_a_stop() -> None:
    scanner = StopScanner(("</s>", "\n\n"))
    assert scanner.push("Hello <") == "Hello "
    assert scanner.push("/") == ""
    assert scanner.push("b> and\n") == "</b> and"
    assert scanner.push("\nmore") == "" and scanner.stopped
    assert scanner.shown == "Hello </b> and"
    plain = StopScanner()
    assert plain.push("a") == "a" and plain.finish("ab\ufffd") == "b\ufffd"
    late = StopScanner(("END",))
    assert late.push("xE") == "x" and late.finish("xEND!") == "" and late.stopped


def test_chat_template_from_the_model_directory(tmp_path: Path) -> None:
    assert read_chat_template(tmp_path) is None
    source = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
              "{{ eos_token }}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    (tmp_path / "tokenizer_config.json").write_text(
        '{"chat_template": ' + __import__("json").dumps(source) +
        ', "bos_token": {"content": "<s>"}, "eos_token": "</s>"}')
    template = read_chat_template(tmp_path)
    assert template == ChatTemplate(source, "<s>", "</s>")
    # bos comes from the tokenizer when the prompt is encoded: not twice
    assert render_chat([{"role": "user", "content": "hi"}], template) == \
        "<|user|>hi</s><|assistant|>"
    refusing = ChatTemplate("{{ raise_exception('only user turns') }}")
    with pytest.raises(ChatRefused, match="only user turns") as refused:
        render_chat([{"role": "user", "content": "hi"}], refusing)
    assert from_swarm_error(refused.value).status == 400  # the asker's to fix


def test_a_client_that_goes_away_ends_the_generation(swarm: LoopbackSwarm) -> None:
    agent = swarm.agents[1]
    original = agent.control_ops["generate"]
    tokens: list[int] = []
    finished = []

    async def counted(request: dict[str, Any]) -> Any:
        outer = current_emitter()

        def tap(event: dict[str, Any]) -> None:
            tokens.append(event.get("token", -1))
            if outer is not None:
                outer(event)

        try:
            with emitting_to(tap):
                return await original(request)
        finally:
            finished.append(True)

    swarm.run_sync(agent.control_ops.__setitem__, "generate", counted)
    try:
        body = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 400, "temperature": 0,
                "stream": True}
        with httpx.Client(base_url=swarm.url(1), timeout=60) as c:
            with c.stream("POST", "/v1/completions", json=body) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        break  # and hang up
        swarm.call(swarm.wait_for, lambda: bool(finished) and not any(
            h.stage.sessions for a in swarm.agents for h in a.serving.hosted.values()))
        assert 0 < len(tokens) < 400
    finally:
        swarm.run_sync(agent.control_ops.__setitem__, "generate", original)


# --- many clients on the one-slot load: a line, in order of arrival; 429 when full ---


def _line(swarm: LoopbackSwarm) -> tuple[int, int]:
    """(running, waiting) on the driver's queue for the one load."""
    driver = swarm.agents[1].serving.driver
    plan_id = next(iter(swarm.agents[1].serving.loads_view())).plan_id
    return driver.admission.running(plan_id), driver.admission.waiting(plan_id)


def _hang_up_later(swarm: LoopbackSwarm, body: dict[str, Any]) -> socket.socket:
    """A completion asked over a raw socket, so the test decides when the client goes."""
    host, port = swarm.http[1].rsplit(":", 1)
    data = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)))
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {swarm.http[1]}\r\n"
                 f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
                 .encode() + data)
    return sock


def test_eight_clients_on_one_slot_complete_in_order_of_arrival(swarm: LoopbackSwarm) -> None:
    finished: list[int] = []
    answers: dict[int, str] = {}
    failures: list[BaseException] = []

    def client(i: int) -> None:
        try:
            with openai.OpenAI(base_url=f"{swarm.url(1)}/v1", api_key="unused",
                               max_retries=0, timeout=120) as c:
                answer = c.chat.completions.create(
                    model="tiny-llama", messages=[{"role": "user", "content": f"question {i}"}],
                    max_tokens=12 if i == 0 else 6, temperature=0)
            answers[i] = answer.choices[0].message.content or ""
            finished.append(i)
        except BaseException as exc:  # reported below
            failures.append(exc)

    threads = []
    for i in range(8):
        thread = threading.Thread(target=client, args=(i,), daemon=True)
        thread.start()
        threads.append(thread)
        # the next client arrives once this one is in: running, in line, or done
        swarm.call(swarm.wait_for, lambda: failures or sum(_line(swarm)) + len(finished) > i)
    for thread in threads:
        thread.join(120)
    assert not failures, failures
    assert finished == list(range(8))
    # each answer is the one the load gives the same conversation alone
    for i in (0, 7):
        prompt = plain_prompt([{"role": "user", "content": f"question {i}"}])
        alone = swarm.call(swarm.agents[1].control_ops["generate"], {
            "op": "generate", "prompt": prompt, "max_tokens": 12 if i == 0 else 6,
            "temperature": 0.0})
        assert answers[i] == alone["text"]


def test_a_full_line_answers_429_and_a_client_that_hangs_up_leaves_it(
        swarm: LoopbackSwarm) -> None:
    driver = swarm.agents[1].serving.driver
    swarm.run_sync(setattr, driver.admission, "limit", 1)
    body = {"model": "tiny-llama", "prompt": "a long one", "max_tokens": 400,
            "temperature": 0}
    running = waiting = None
    try:
        running = _hang_up_later(swarm, body)
        swarm.call(swarm.wait_for, lambda: _line(swarm) == (1, 0))
        waiting = _hang_up_later(swarm, {**body, "max_tokens": 4})
        swarm.call(swarm.wait_for, lambda: _line(swarm) == (1, 1))
        with httpx.Client(base_url=swarm.url(1), timeout=30) as c:
            refused = c.post("/v1/completions", json={**body, "max_tokens": 4})
        assert refused.status_code == 429
        assert int(refused.headers["retry-after"]) >= 1
        error = refused.json()["error"]
        assert error["code"] == "busy" and "the queue is full" in error["message"]
        waiting.close()  # hangs up while in line: it leaves the line
        swarm.call(swarm.wait_for, lambda: _line(swarm) == (1, 0))
        running.close()  # and the one running ends its generation
        swarm.call(swarm.wait_for, lambda: _line(swarm) == (0, 0))
    finally:
        for sock in (running, waiting):
            if sock is not None:
                sock.close()
        swarm.run_sync(setattr, driver.admission, "limit", 32)
