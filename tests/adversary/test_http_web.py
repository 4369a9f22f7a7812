"""A web page against the HTTP API: DNS rebinding, cross-site requests, simple-request
CSRF, request smuggling, and a job that names files outside what the user allowed. Each
is refused, counted in ``status``, and changes nothing (docs/security.md)."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from p2pswarm.cli.http_options import HTTP_TOKEN_ENV, read_http_token
from p2pswarm.errors import ConfigError
from p2pswarm.http.app import HttpSettings, http_settings
from p2pswarm.http.guard import WebGuard, split_host
from p2pswarm.http.problems import HttpError
from tests.http_swarm import LoopbackSwarm

JOB = {"model": "tiny-llama", "steps": 2, "seq_len": 16, "micro_batch": 1}


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoopbackSwarm]:
    with LoopbackSwarm(tmp_path_factory.mktemp("http-web"), n=1) as running:
        yield running


@pytest.fixture
def client(swarm: LoopbackSwarm) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=swarm.url(0), timeout=30) as c:
        yield c


def refused(response: httpx.Response, status: int, code: str) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code, error
    return str(error["message"])


def drops(swarm: LoopbackSwarm) -> dict[str, int]:
    return swarm.run_sync(lambda: dict(swarm.agents[0].counters.drops))


def nothing_loaded(swarm: LoopbackSwarm) -> bool:
    return swarm.run_sync(lambda: not swarm.agents[0].serving.loads)


# --- the rules, one request at a time ------------------------------------------------------


@pytest.mark.parametrize(("host", "allowed"), [
    ("127.0.0.1:7780", True), ("localhost:7780", True), ("[::1]:7780", True),
    ("LOCALHOST.", True), ("192.168.1.20:7780", True), ("mybox.lan:7780", True),
    ("attacker.example:7780", False), ("localhost.attacker.example", False),
    ("127.0.0.1.nip.io:7780", False), ("[::1", False), ("x:port", False),
])
def test_host_names_other_than_loopback_and_the_allowed_are_refused(host: str,
                                                                     allowed: bool) -> None:
    guard = WebGuard.for_names(["mybox.lan"])
    try:
        guard.check("GET", [(b"host", host.encode())])
    except HttpError as exc:
        assert not allowed and exc.code == "foreign-host" and exc.status == 403
    else:
        assert allowed


@pytest.mark.parametrize(("origin", "allowed"), [
    ("http://127.0.0.1:7780", True), ("http://127.0.0.1:7781", False),
    ("http://localhost:7780", False), ("https://evil.example", False), ("null", False),
    ("http://127.0.0.1:7780/path", False), ("http://user@127.0.0.1:7780", False),
])
def test_a_state_change_must_come_from_the_agents_own_origin(origin: str,
                                                             allowed: bool) -> None:
    headers = [(b"host", b"127.0.0.1:7780"), (b"origin", origin.encode())]
    try:
        WebGuard().check("POST", headers)
    except HttpError as exc:
        assert not allowed and exc.code == "foreign-origin"
    else:
        assert allowed
    WebGuard().check("GET", headers)  # reading: the browser keeps the answer from the page


def test_split_host_reads_names_ports_and_v6() -> None:
    assert split_host("LocalHost:80") == ("localhost", 80)
    assert split_host("[::1]:7780") == ("::1", 7780)
    assert split_host("example.org") == ("example.org", None)
    for bad in ("", ":80", "[::1]x", "a:123456", "a:-1"):
        with pytest.raises(ValueError):
            split_host(bad)


# --- against a live agent ------------------------------------------------------------------


def test_dns_rebinding_and_cross_site_requests_are_refused_and_counted(
        swarm: LoopbackSwarm, client: httpx.Client) -> None:
    before = drops(swarm)
    # a rebinding page: its own name, resolved to 127.0.0.1
    message = refused(client.get("/api/status", headers={"host": "attacker.example:7780"}),
                      403, "foreign-host")
    assert "--http-allow-host attacker.example" in message
    refused(client.post("/api/models/load", json={"model": "tiny-llama"},
                        headers={"host": "attacker.example"}), 403, "foreign-host")
    # a page of another site, posting JSON (a preflight would fail too; the agent refuses
    # even a browser that skipped it)
    refused(client.post("/api/models/load", json={"model": "tiny-llama"},
                        headers={"origin": "https://evil.example"}), 403, "foreign-origin")
    refused(client.post("/api/models/unload", json={"all": True},
                        headers={"sec-fetch-site": "cross-site"}), 403, "foreign-origin")
    refused(client.post("/api/jobs/x/cancel", headers={"origin": "null"}), 403,
            "foreign-origin")
    # the simple requests a form or a text/plain fetch sends without asking first
    for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data"):
        refused(client.post("/api/models/load", content=b'{"model": "tiny-llama"}',
                            headers={"content-type": kind}), 415, "unsupported-media-type")
    refused(client.post("/v1/completions", content=b'{"model": "x", "prompt": "hi"}'), 415,
            "unsupported-media-type")
    assert nothing_loaded(swarm)
    after = drops(swarm)
    for reason, n in (("http-foreign-host", 2), ("http-foreign-origin", 3),
                      ("http-unsupported-media-type", 4)):
        assert after.get(reason, 0) - before.get(reason, 0) == n, (reason, after)


def test_the_agents_own_pages_and_programs_still_work(swarm: LoopbackSwarm,
                                                      client: httpx.Client) -> None:
    here = swarm.http[0]
    page = client.get("/plan")
    assert page.status_code == 200
    assert page.headers["x-frame-options"] == "DENY"
    assert page.headers["x-content-type-options"] == "nosniff"
    assert "frame-ancestors 'none'" in page.headers["content-security-policy"]
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert client.get("/api/status").headers["x-content-type-options"] == "nosniff"
    # the page itself: same origin, JSON with its content type
    same = client.post("/api/models/plan", json={"model": "nope/none"},
                       headers={"origin": f"http://{here}", "sec-fetch-site": "same-origin"})
    refused(same, 400, "bad-request")  # past the guard: the model is what is wrong
    # curl and the openai client send no Origin
    assert client.post("/api/jobs/x/cancel").status_code != 403
    charset = client.post("/api/models/plan", content=b'{"model": "nope/none"}',
                          headers={"content-type": "Application/JSON; charset=utf-8"})
    refused(charset, 400, "bad-request")


def test_a_body_nested_thousands_deep_is_bad_json(client: httpx.Client) -> None:
    deep = b"[" * 100_000 + b"]" * 100_000
    refused(client.post("/api/models/plan", content=deep,
                        headers={"content-type": "application/json"}), 400, "bad-json")
    assert client.get("/api/status").status_code == 200


def test_sampling_numbers_beyond_what_the_wire_carries_are_a_clear_400(
        client: httpx.Client) -> None:
    for key, value in (("top_k", 10**30), ("max_tokens", 2**40), ("seed", 2**70)):
        message = refused(client.post("/v1/completions", json={
            "model": "tiny-llama", "prompt": "hi", key: value}), 400, "bad-request")
        assert f"{key} must be a whole number" in message and len(message) < 120


def test_plan_fields_beyond_any_request_are_a_clear_400(client: httpx.Client) -> None:
    for extra in ('"sequences": 1000000000000000000000000000000', '"floors": {"cuda": 1e400}',
                  '"floors": {"cpu": "abc"}', '"floors": {"cpu": Infinity}'):
        body = ('{"model": "tiny-llama", ' + extra + "}").encode()
        refused(client.post("/api/models/plan", content=body,
                            headers={"content-type": "application/json"}), 400, "bad-request")


def raw_request(addr: str, head: bytes, body: bytes = b"") -> bytes:
    """Send bytes as they are (no client would send these) and read the answer."""
    host, _, port = addr.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(head + body)
        answer = b""
        while b"\r\n\r\n" not in answer and (chunk := sock.recv(65536)):
            answer += chunk
    return answer


def status_of(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1])


@pytest.mark.parametrize(("head", "status"), [
    # both lengths: a proxy reading one and the agent the other would split requests
    (b"POST /api/models/unload HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
     b"\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400),
    (b"POST /api/models/unload HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 2\r\n"
     b"Content-Length: 3\r\n\r\n{}", 400),
    (b"POST /api/models/unload HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: gzip\r\n"
     b"\r\n", 501),
    (b"POST /api/models/unload HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
     b"\r\nContent-Length: 99999999999\r\n\r\n{}", 413),
    (b"GET /api/status HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: " + b"a" * 20000 + b"\r\n\r\n",
     431),
    (b"GET /api/status HTTP/1.1\r\nHost: 127.0.0.1\r\nHost: attacker.example\r\n\r\n", 400),
])
def test_framing_a_proxy_could_read_differently_is_refused(
        swarm: LoopbackSwarm, head: bytes, status: int) -> None:
    answer = raw_request(swarm.http[0], head)
    assert status_of(answer) == status, answer[:300]
    assert nothing_loaded(swarm)
    assert httpx.get(f"{swarm.url(0)}/api/status", timeout=10).status_code == 200


def job_body(**fields: Any) -> dict[str, Any]:
    return {"config": {**JOB, **fields}}


def test_a_job_over_http_names_files_only_in_allowed_directories(
        swarm: LoopbackSwarm, client: httpx.Client, tmp_path: Path) -> None:
    allowed, elsewhere = tmp_path / "allowed", tmp_path / "elsewhere"
    allowed.mkdir()
    elsewhere.mkdir()
    (allowed / "notes.txt").write_text("hello " * 50)
    (elsewhere / "secret.txt").write_text("not for the web")
    (allowed / "escape").symlink_to(elsewhere)
    before = drops(swarm).get("http-dir-not-allowed", 0)
    # the default server allows no directory: the answer says how to allow one
    for body in (job_body(checkpoint={"dir": str(allowed / "ckpt")}),
                 job_body(data={"files": [str(allowed / "notes.txt")]})):
        message = refused(client.post("/api/jobs", json=body), 403, "dir-not-allowed")
        assert "--http-allow-dir" in message and "none is allowed" in message
    refused(client.post("/api/jobs/plan", json=job_body(data={"token_files": ["/etc/passwd"]})),
            403, "dir-not-allowed")
    # a server that allows one directory
    port = swarm.serve_http(0, HttpSettings("127.0.0.1", 0, allow_dirs=(str(allowed),)))
    assert port is not None
    with httpx.Client(base_url=f"http://{port}", timeout=60) as c:
        for body in (job_body(data={"files": [str(elsewhere / "secret.txt")]}),
                     job_body(data={"files": [str(allowed / "escape" / "secret.txt")]}),
                     job_body(checkpoint={"dir": str(allowed / ".." / "elsewhere")})):
            assert str(allowed) in refused(c.post("/api/jobs/plan", json=body), 403,
                                           "dir-not-allowed")
        refused(c.post("/api/jobs/plan", json=job_body(checkpoint={"dir": "ckpt"})), 400,
                "bad-request")
        inside = c.post("/api/jobs/plan", json=job_body(
            data={"files": [str(allowed / "notes.txt")]},
            checkpoint={"dir": str(allowed / "ckpt")}))
        assert inside.status_code == 200, inside.text  # planned: the guard let it through
    assert drops(swarm)["http-dir-not-allowed"] - before == 6
    assert not (allowed / "ckpt").exists()
    assert swarm.run_sync(lambda: not swarm.agents[0].training.jobs)


def test_allowed_hosts_and_dirs_are_checked_when_join_starts(tmp_path: Path) -> None:
    settings = http_settings(None, allow_hosts=("MyBox.lan",), allow_dirs=(str(tmp_path),))
    assert settings is not None and settings.allow_hosts == ("mybox.lan",)
    settings.guard.check("GET", [(b"host", b"mybox.lan:7780")])
    for bad in ("http://x/", "a b/c", ""):
        with pytest.raises(ConfigError, match="--http-allow-host"):
            http_settings(None, allow_hosts=(bad,))
    with pytest.raises(ConfigError, match="--http-allow-dir"):
        http_settings(None, allow_dirs=(str(tmp_path / "missing"),))


# --- the token stays out of the process list ---------------------------------------------


def test_the_http_token_comes_from_a_file_or_the_environment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    file = tmp_path / "http-token"
    file.write_text("from-the-file\n")
    file.chmod(0o600)
    monkeypatch.setenv(HTTP_TOKEN_ENV, "from-the-env")
    assert read_http_token(None, file) == "from-the-file"
    assert read_http_token(None, None) == "from-the-env"
    assert capsys.readouterr().err == ""
    assert read_http_token("on-the-line", None) == "on-the-line"
    assert "visible to every user" in capsys.readouterr().err
    file.chmod(0o644)
    read_http_token(None, file)
    assert "chmod 600" in capsys.readouterr().err


def test_join_refuses_bad_http_options_in_one_line_before_it_starts(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from p2pswarm.cli import app

    token_file = tmp_path / "token"
    token_file.write_text("t0ken")
    for args, says in (
            (["--http-allow-dir", str(tmp_path / "missing")], "not a directory"),
            (["--http-allow-host", "http://evil/"], "--http-allow-host"),
            (["--http-token", "x", "--http-token-file", str(token_file)], "not both"),
            (["--http-token-file", str(tmp_path / "nope")], "cannot read --http-token-file")):
        result = CliRunner().invoke(app, ["join", "--home", str(tmp_path / "h"), *args],
                                    env={"P2PSWARM_TOKEN": "", HTTP_TOKEN_ENV: ""})
        lines = [line for line in result.output.splitlines() if line.startswith("error:")]
        assert result.exit_code == 2 and len(lines) == 1 and says in lines[0], result.output
        assert not (tmp_path / "h").exists()
