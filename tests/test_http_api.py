"""The HTTP API end to end: two real agents on loopback sockets, each with its HTTP
server, driven with a plain HTTP client as a page or a script would."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from p2pswarm.cli import app
from p2pswarm.errors import ConfigError, TransportError
from p2pswarm.home import Home
from p2pswarm.http.app import HttpSettings, http_settings
from p2pswarm.security import SwarmSecret
from tests.http_swarm import LoopbackSwarm, cpu_card, serve_body, serve_message

CONTRACT_PATHS = ("/api/status", "/api/models", "/api/models/plan", "/api/models/load",
                  "/api/models/unload", "/api/models/loads", "/api/jobs/plan", "/api/jobs",
                  "/api/jobs/{job_id}/cancel", "/v1/models", "/v1/completions",
                  "/v1/chat/completions", "/", "/plan", "/openapi.json")


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoopbackSwarm]:
    with LoopbackSwarm(tmp_path_factory.mktemp("http-api")) as running:
        yield running


@pytest.fixture
def client(swarm: LoopbackSwarm) -> Iterator[httpx.Client]:
    # fellow-2 need not be the leader: what it cannot decide it forwards, as for the CLI
    with httpx.Client(base_url=swarm.url(1), timeout=60) as c:
        yield c


def error_of(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert error["code"] == code, error
    assert error["message"] and "\n" not in error["message"]
    return error  # type: ignore[no-any-return]


def nothing_loaded(swarm: LoopbackSwarm) -> bool:
    return swarm.run_sync(lambda: all(not a.serving.hosted and not a.serving.loads
                                      for a in swarm.agents))


def test_status_models_and_the_openapi_document(swarm: LoopbackSwarm,
                                                client: httpx.Client) -> None:
    status = client.get("/api/status").json()
    assert status["self"]["name"] == "fellow-2"
    assert {m["name"] for m in status["members"]} == {"fellow-1", "fellow-2"}
    assert status["leader"]["name"] in ("fellow-1", "fellow-2")

    models = {m["name"]: m for m in client.get("/api/models").json()["models"]}
    assert models["tiny-llama"]["weights"] and models["tiny-llama"]["layers"] == 8
    assert models["llama-3-8b"]["source"] == "reference" and not models["llama-3-8b"]["weights"]

    document = client.get("/openapi.json").json()
    assert document["openapi"].startswith("3.1")
    assert set(CONTRACT_PATHS) <= set(document["paths"])
    load = document["paths"]["/api/models/load"]["post"]
    assert "409" in load["responses"]
    assert "plan_id" in load["requestBody"]["content"]["application/json"]["schema"]["properties"]


def test_plan_a_stale_pin_load_loads_and_unload(swarm: LoopbackSwarm,
                                                client: httpx.Client) -> None:
    # a floor low enough that a card filled past its stage's claim can still take a
    # smaller stage: the refused pin then has a new plan to offer
    def body(**extra: Any) -> dict[str, Any]:
        return serve_body(floors={"cpu": "1MB"}, **extra)

    shown = client.post("/api/models/plan", json=body())
    assert shown.status_code == 200, shown.text
    plan = shown.json()
    assert plan["fits"] and len(plan["stages"]) == 2 and len(plan["plan_id"]) == 16
    # the same plan as the control op gives the CLI: one implementation
    agent = swarm.agents[1]
    same = swarm.call(agent.control_ops["plan"], {
        "op": "plan", "request": serve_message(floors_bytes={"cpu": "1MB"})})
    assert same["plan_id"] == plan["plan_id"]

    # fellow-1's memory fills past what its stage claims: once the leader sees it, the
    # pin no longer holds (memory that moves within the plan's headroom would not do)
    mine = next(c for c in plan["cards"] if c["fellow"] == "fellow-1")
    claims = sum(v for k, v in mine["segments"].items()
                 if k not in ("other_programs", "free", "does_not_fit"))
    full = claims - 10**6
    swarm.run_sync(setattr, swarm.cards[0], "cards", (cpu_card(free_gb=full / 10**9),))
    leader = swarm.leader()

    def leader_sees_it() -> bool:
        return any(c.free_bytes == full for f in leader.planning.view().fellows
                   for c in f.cards)

    swarm.call(swarm.wait_for, leader_sees_it)
    refused = client.post("/api/models/load", json=body(plan_id=plan["plan_id"]))
    error = error_of(refused, 409, "plan-changed")
    assert error["changed"] and all(isinstance(line, str) for line in error["changed"])
    new_plan = error["plan"]
    assert new_plan["plan_id"] == error["new_plan_id"] != plan["plan_id"]
    assert error["expected_plan_id"] == plan["plan_id"]
    assert client.get("/api/models/loads").json() == {"loads": []}
    assert nothing_loaded(swarm)

    loaded = client.post("/api/models/load", json=body(plan_id=new_plan["plan_id"]))
    assert loaded.status_code == 200, loaded.text
    record = loaded.json()
    assert record["plan_id"] == new_plan["plan_id"]
    assert [s["stage"] for s in record["stages"]] == [0, 1]
    loads = client.get("/api/models/loads").json()["loads"]
    assert [r["plan_id"] for r in loads] == [new_plan["plan_id"]]

    again = client.post("/api/models/load", json=body(plan_id=new_plan["plan_id"]))
    assert "already loaded" in error_of(again, 409, "refused")["message"]

    gone = client.post("/api/models/unload", json={"plan_id": new_plan["plan_id"]})
    assert gone.status_code == 200 and gone.json() == {"unloaded": [new_plan["plan_id"]]}
    assert client.get("/api/models/loads").json() == {"loads": []}
    error_of(client.post("/api/models/unload", json={"plan_id": new_plan["plan_id"]}), 404,
             "not-found")
    assert nothing_loaded(swarm)
    swarm.run_sync(setattr, swarm.cards[0], "cards", (cpu_card(),))


@pytest.mark.parametrize(("path", "body", "status", "code", "words"), [
    ("/api/models/load", b"{\"model\": \"tiny-llama\",", 400, "bad-json", "not valid JSON"),
    ("/api/models/plan", b"\xff\xfe", 400, "bad-json", "not valid JSON"),
    ("/api/models/load", b"[1, 2]", 400, "bad-json", "must be a JSON object"),
    ("/api/models/unload", b"{'all': true}", 400, "bad-json", "not valid JSON"),
    ("/api/models/load", json.dumps(serve_body(contxt=4096)).encode(), 400, "bad-request",
     "unknown field contxt"),
    ("/api/models/load", json.dumps(serve_body(plan_id="12345")).encode(), 400, "bad-request",
     "plan_id must be the 16 hex"),
    ("/api/models/load", json.dumps(serve_body(stages=0)).encode(), 400, "bad-request",
     "--stages must be a whole number"),
    ("/api/models/plan", json.dumps({"stages": 2}).encode(), 400, "bad-request",
     "\"model\" must name a model"),
    ("/api/models/plan", json.dumps(serve_body(model="no-such-model")).encode(), 400,
     "bad-request", "unknown model"),
    ("/api/models/plan", json.dumps(serve_body(exclude_cards="f:0")).encode(), 400,
     "bad-request", "exclude_cards must be a list"),
    ("/api/models/unload", json.dumps({"all": "yes"}).encode(), 400, "bad-request",
     "\"all\" must be true or false"),
    ("/api/jobs", b"{\"config\": 3}", 400, "bad-request", "\"config\" must be"),
])
def test_malformed_requests_are_a_clear_400_and_change_nothing(
        swarm: LoopbackSwarm, client: httpx.Client, path: str, body: bytes, status: int,
        code: str, words: str) -> None:
    shown_before = swarm.run_sync(lambda: swarm.leader().planning.shown.plan_ids())
    response = client.post(path, content=body, headers={"content-type": "application/json"})
    assert words in error_of(response, status, code)["message"]
    assert client.get("/api/models/loads").json() == {"loads": []}
    assert nothing_loaded(swarm)
    assert swarm.run_sync(lambda: swarm.leader().planning.shown.plan_ids()) == shown_before


def test_routes_methods_and_ops_the_agent_lacks(swarm: LoopbackSwarm,
                                                client: httpx.Client) -> None:
    assert "/openapi.json" in error_of(client.get("/api/nothing"), 404, "not-found")["message"]
    assert "answers POST" in error_of(client.get("/api/models/plan"), 405,
                                      "method-not-allowed")["message"]
    agent = swarm.agents[1]
    taken = swarm.run_sync(lambda: {op: agent.control_ops.pop(op, None)
                                    for op in ("job_plan", "jobs", "job_cancel")})
    try:
        error_of(client.post("/api/jobs/plan", json={"config": {"model": "tiny-llama"}}), 501,
                 "not-available")
        error_of(client.get("/api/jobs"), 501, "not-available")
        error_of(client.post("/api/jobs/abc/cancel"), 501, "not-available")
    finally:
        swarm.run_sync(lambda: agent.control_ops.update(
            {op: h for op, h in taken.items() if h is not None}))


def test_a_token_is_required_on_every_data_request_beyond_loopback(
        swarm: LoopbackSwarm) -> None:
    bound = swarm.serve_http(0, HttpSettings("0.0.0.0", 0, "s3cret-token"))
    assert bound is not None and bound.startswith("0.0.0.0:")
    url = f"http://127.0.0.1:{bound.rpartition(':')[2]}"
    with httpx.Client(base_url=url, timeout=30) as c:
        for path in ("/api/status", "/v1/models", "/openapi.json"):
            error_of(c.get(path), 401, "unauthorized")
            wrong = c.get(path, headers={"authorization": "Bearer s3cret-tokeN"})
            assert "not this agent's" in error_of(wrong, 401, "unauthorized")["message"]
        error_of(c.post("/api/models/unload", json={"all": True},
                        headers={"authorization": "Basic s3cret-token"}), 401, "unauthorized")
        ok = c.get("/api/status", headers={"authorization": "Bearer s3cret-token"})
        assert ok.status_code == 200 and ok.json()["self"]["name"] == "fellow-1"
        # the pages hold no data: a browser opens /plan?token=T and the page sends it
        page = c.get("/plan", params={"token": "s3cret-token"})
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        assert c.get("/static/common.js").status_code == 200
        error_of(c.get("/static/../api/status"), 401, "unauthorized")


def test_binding_beyond_loopback_needs_a_token(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="add --http-token"):
        http_settings("0.0.0.0:7780")
    with pytest.raises(ConfigError, match="add --http-token"):
        http_settings("my-laptop.lan:7780")
    assert http_settings("0.0.0.0:7780", "t0ken") == HttpSettings("0.0.0.0", 7780, "t0ken")
    assert http_settings("[::1]:8080") == HttpSettings("::1", 8080)
    assert http_settings(None) == HttpSettings("127.0.0.1", 7780, explicit=False)
    assert http_settings("off") is None
    with pytest.raises(ConfigError, match="bad port"):
        http_settings("127.0.0.1:http")

    home = tmp_path / "h"
    result = CliRunner().invoke(app, ["join", "--home", str(home), "--http", "0.0.0.0:7780"],
                                env={"P2PSWARM_TOKEN": "", "P2PSWARM_HOME": ""})
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: --http 0.0.0.0:7780 is reachable")
    assert not home.exists()  # refused before anything was written


def test_a_busy_port_is_an_error_when_chosen_and_a_note_by_default(
        swarm: LoopbackSwarm) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        with pytest.raises(TransportError, match=f"cannot serve HTTP on 127.0.0.1:{port}"):
            swarm.serve_http(0, HttpSettings("127.0.0.1", port))
        assert swarm.serve_http(0, HttpSettings("127.0.0.1", port, explicit=False)) is None


def test_the_server_stops_with_its_agent(tmp_path: Path) -> None:
    with LoopbackSwarm(tmp_path, n=1) as one:
        url = one.url(0)
        assert httpx.get(f"{url}/api/status", timeout=10).status_code == 200
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{url}/api/status", timeout=2)


def test_join_serves_the_api_on_the_chosen_address(tmp_path: Path) -> None:
    """... with the HTTP token from the environment, never in the process list."""
    home = tmp_path / "h"
    Home(home).join_swarm(SwarmSecret(bytes(range(32))))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    token = "env-token-" + os.urandom(8).hex()
    process = subprocess.Popen(
        [sys.executable, "-m", "p2pswarm.cli", "join", "--home", str(home), "--listen",
         "127.0.0.1:0", "--name", "solo", "--preset", "local", "--no-cpu",
         "--http", f"127.0.0.1:{port}"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        env={**os.environ, "P2PSWARM_HTTP_TOKEN": token, "P2PSWARM_TOKEN": ""})
    try:
        deadline = time.monotonic() + 60
        while True:  # until the agent answers (polled: start-up takes what it takes)
            assert process.poll() is None, process.stderr.read() if process.stderr else ""
            try:
                bare = httpx.get(f"http://127.0.0.1:{port}/api/status", timeout=5)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "the agent's HTTP API never answered"
                time.sleep(0.1)
        error_of(bare, 401, "unauthorized")
        status = httpx.get(f"http://127.0.0.1:{port}/api/status", timeout=5,
                           headers={"authorization": f"Bearer {token}"})
        assert status.status_code == 200 and status.json()["self"]["name"] == "solo"
        assert token.encode() not in Path(f"/proc/{process.pid}/cmdline").read_bytes()
    finally:
        process.send_signal(signal.SIGINT)
        assert process.wait(30) == 0


def test_pages_come_from_the_static_folder_and_nothing_outside_it(
        swarm: LoopbackSwarm, client: httpx.Client, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    static = tmp_path / "static"
    static.mkdir()
    (static / "index.html").write_text("<!doctype html><title>models</title>")
    (static / "plan.html").write_text("<!doctype html><title>plan</title>")
    (static / "plan.js").write_text("export const x = 1;")
    (tmp_path / "secret.txt").write_text("not for the web")
    monkeypatch.setattr("p2pswarm.http.app.STATIC_DIR", static)
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "<title>models</title>" in page.text
    assert "<title>plan</title>" in client.get("/plan").text
    script = client.get("/static/plan.js")
    assert script.status_code == 200 and "javascript" in script.headers["content-type"]
    error_of(client.get("/static/..%2Fsecret.txt"), 404, "not-found")
    error_of(client.get("/static/missing.css"), 404, "not-found")
