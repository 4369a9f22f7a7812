"""The command line: clear one-line errors with exit code 2, JSON where data is printed."""

from __future__ import annotations

import json
import os
import socket

from typer.testing import CliRunner

from p2pswarm import __version__
from p2pswarm.cli import app
from p2pswarm.sim import commands

runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, list(args), env={"P2PSWARM_TOKEN": "", "P2PSWARM_HOME": ""})


def one_line_error(result) -> str:
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1, result.output
    assert lines[0].startswith("error: ")
    assert "Traceback" not in result.output
    return lines[0]


def test_version() -> None:
    result = invoke("--version")
    assert result.exit_code == 0 and __version__ in result.output
    assert "protocol 2 (shares a swarm with protocols 1 to 3)" in result.output


def test_init_prints_a_token_and_keeps_keys_private(tmp_path) -> None:
    result = invoke("init", "--home", str(tmp_path / "h"), "--json")
    assert result.exit_code == 0, result.output
    token = json.loads(result.output)["token"]
    assert token.startswith("p2pi1-")  # an invitation: secret and admin-signed invitation
    for path in (tmp_path / "h").iterdir():
        assert path.stat().st_mode & 0o077 == 0, path
    again = invoke("init", "--home", str(tmp_path / "h"))
    assert again.exit_code == 2
    assert "already holds a swarm; use --force" in one_line_error(again)


def test_status_without_an_agent_says_how_to_start_one(tmp_path) -> None:
    invoke("init", "--home", str(tmp_path))
    result = invoke("status", "--home", str(tmp_path), "--json")
    assert result.exit_code == 1
    assert "no agent running" in one_line_error(result)


def test_mistyped_token_is_caught_before_any_traffic(tmp_path) -> None:
    token = json.loads(invoke("init", "--home", str(tmp_path / "a"), "--json").output)["token"]
    typo = token[:-3] + ("X" if token[-3] != "X" else "Y") + token[-2:]
    result = invoke("join", "--home", str(tmp_path / "b"), "--token", typo)
    assert result.exit_code == 2
    assert "join token is mistyped: checksum does not match" in one_line_error(result)
    assert not (tmp_path / "b" / "keyring.json").exists()


def test_missing_state_directory(tmp_path) -> None:
    result = invoke("join", "--home", str(tmp_path / "nowhere"))
    assert result.exit_code == 2
    assert "no swarm in" in one_line_error(result) and "p2pswarm init" in result.output


def test_world_readable_key_file_refuses_to_start(tmp_path) -> None:
    invoke("init", "--home", str(tmp_path))
    os.chmod(tmp_path / "keyring.json", 0o644)
    result = invoke("join", "--home", str(tmp_path), "--listen", "127.0.0.1:0")
    assert result.exit_code == 2
    assert "chmod 600" in one_line_error(result)


def test_bad_arguments_say_how_to_fix_them(tmp_path) -> None:
    invoke("init", "--home", str(tmp_path))
    for args, words in [
        (("--listen", "127.0.0.1:99999"), "bad port"),
        (("--listen", ":7946"), "has no host"),
        (("--preset", "moon"), "unknown preset"),
        (("nohost:", "--listen", "127.0.0.1:0"), "bad port"),
    ]:
        result = invoke("join", "--home", str(tmp_path), *args)
        assert result.exit_code == 2, result.output
        assert words in one_line_error(result)


def test_port_in_use_is_a_clear_error(tmp_path) -> None:
    invoke("init", "--home", str(tmp_path))
    with socket.socket() as tcp, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        tcp.bind(("127.0.0.1", 0))
        tcp.listen()
        port = tcp.getsockname()[1]
        udp.bind(("127.0.0.1", port))
        result = commands.cli("join", "--home", str(tmp_path), "--listen", f"127.0.0.1:{port}")
    assert result.returncode != 0
    assert "address already in use" in result.stderr
    assert "Traceback" not in result.stderr


def test_demo_out_goes_with_train_and_never_overwrites(tmp_path) -> None:
    result = invoke("demo", "--out", str(tmp_path / "model"))
    assert result.exit_code != 0 and "--out goes with --train" in result.output
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "config.json").write_text("{}")
    result = invoke("demo", "--train", "--out", str(tmp_path / "full"))
    assert result.exit_code != 0 and "is not empty" in result.output
    assert "Traceback" not in result.output
