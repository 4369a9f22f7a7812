"""Rough edges a newcomer meets, each through the real command line: a second `join` on a
busy home, a busy HTTP port, shape-only and shipped model names, the demo started from
the folder holding the clone, a seed that never answers, and narrow terminals."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from p2pswarm.cli import app
from p2pswarm.sim.processes import LocalSwarm, local_swarm

runner = CliRunner()
CLI = [sys.executable, "-m", "p2pswarm.cli"]


def invoke(*args: str, columns: int = 80):
    return runner.invoke(app, list(args), env={"P2PSWARM_TOKEN": "", "P2PSWARM_HOME": "",
                                               "COLUMNS": str(columns)})


def error_lines(stderr: str) -> list[str]:
    """The lines of a failed command's stderr that are not its log."""
    return [line for line in stderr.splitlines() if line.strip()
            and " INFO " not in line and " WARNING " not in line]


@pytest.fixture
def one_fellow() -> Iterator[LocalSwarm]:
    with local_swarm(lambda text: None) as swarm:
        swarm.start("only", extra=("--http", "off", "--cpu-memory", "300MB"))
        yield swarm


@pytest.mark.slow
def test_a_second_join_on_a_busy_home_is_one_line_and_prompt(one_fellow: LocalSwarm) -> None:
    home = one_fellow.homes["only"]
    began = time.monotonic()
    done = subprocess.run([*CLI, "join", "--home", str(home), "--listen", "127.0.0.1:0",
                           "--http", "off", "--cpu-memory", "300MB"],
                          capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    took_s = time.monotonic() - began
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr and "ExceptionGroup" not in done.stderr
    lines = error_lines(done.stderr)
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"error: an agent is already running in {home}")
    assert "--home" in lines[0]
    assert took_s < 8.0, took_s  # before the transport, the benchmark or anything slow
    assert one_fellow.status("only")["self"]["name"] == "only"  # the first one runs on


def test_join_on_a_busy_http_port_names_the_port_and_the_fix(tmp_path: Path) -> None:
    invoke("init", "--home", str(tmp_path))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = subprocess.run([*CLI, "join", "--home", str(tmp_path), "--listen",
                               "127.0.0.1:0", "--http", f"127.0.0.1:{port}"],
                              capture_output=True, text=True, timeout=60,
                              stdin=subprocess.DEVNULL)
    assert done.returncode != 0
    assert "Traceback" not in done.stderr and "ExceptionGroup" not in done.stderr
    lines = error_lines(done.stderr)
    assert len(lines) == 1, done.stderr
    assert f"127.0.0.1:{port}" in lines[0]
    assert "another --http" in lines[0] and "stop the other program" in lines[0]
