"""Rough edges a newcomer meets, each through the real command line: a second `join` on a
busy home, a busy HTTP port, shape-only and shipped model names, the demo started from
the folder holding the clone, a seed that never answers, and narrow terminals."""

from __future__ import annotations

import os
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


# --- scripts/install and scripts/demo, with a fake venv python and a fake nvidia-smi ----

REPO = Path(__file__).resolve().parent.parent
FAKE_PYTHON = """#!/usr/bin/env bash
# stands in for the venv's python: pip logs what it was asked; the CPU index may be down
if [ "$1" = -c ]; then exit 1; fi  # `import torch`: not installed
echo "$*" >> "$FAKE_LOG"
case "$*" in
  *--index-url*) if [ "$FAKE_CPU_INDEX" = down ]; then
      echo "ERROR: Could not find a version (read timed out)" >&2; exit 1; fi ;;
esac
exit 0
"""


def fake_checkout(tmp_path: Path, gpu: bool) -> tuple[Path, dict[str, str]]:
    """A copy of scripts/ beside a .venv whose python is FAKE_PYTHON, and a PATH whose
    nvidia-smi lists a GPU or none (so the machine's own never decides)."""
    root = tmp_path / "clone"
    (root / "scripts").mkdir(parents=True)
    for name in ("install", "demo"):
        (root / "scripts" / name).write_text((REPO / "scripts" / name).read_text())
    venv_bin = root / ".venv" / "bin"
    venv_bin.mkdir(parents=True)
    (venv_bin / "activate").write_text(f'PATH="{venv_bin}:$PATH"\n')
    (venv_bin / "python").write_text(FAKE_PYTHON)
    (venv_bin / "p2pswarm").write_text('#!/usr/bin/env bash\necho "p2pswarm $*" >> "$FAKE_LOG"\n')
    tools = tmp_path / "bin"
    tools.mkdir()
    (tools / "nvidia-smi").write_text(
        "#!/usr/bin/env bash\n" + ('echo "GPU 0: NVIDIA GeForce RTX 3060 (UUID: GPU-1)"\n'
                                   if gpu else 'echo "No devices were found"; exit 6\n'))
    for f in [*venv_bin.iterdir(), *tools.iterdir()]:
        f.chmod(0o755)
    env = {"PATH": f"{tools}:{os.environ['PATH']}", "FAKE_LOG": str(tmp_path / "pip.log"),
           "HOME": str(tmp_path)}
    return root, env


def run_script(root: Path, env: dict[str, str], *args: str) -> tuple[str, list[str]]:
    done = subprocess.run(["bash", *args], cwd=root, env=env, capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout, Path(env["FAKE_LOG"]).read_text().splitlines()


def test_install_without_a_gpu_takes_torch_from_the_cpu_index(tmp_path: Path) -> None:
    root, env = fake_checkout(tmp_path, gpu=False)
    out, pip = run_script(root, env, "scripts/install")
    torch = [line for line in pip if "torch" in line]
    assert len(torch) == 1 and "torch==2.13.0" in torch[0]
    assert "--index-url https://download.pytorch.org/whl/cpu" in torch[0]
    assert "took the CPU build from https://download.pytorch.org/whl/cpu" in out
    assert pip[-1] == "-m pip install --quiet -e .[test]"


def test_install_falls_back_to_the_package_index_when_the_cpu_index_is_down(
        tmp_path: Path) -> None:
    root, env = fake_checkout(tmp_path, gpu=False)
    out, pip = run_script(root, env | {"FAKE_CPU_INDEX": "down"}, "scripts/install")
    torch = [line for line in pip if "torch" in line]
    assert len(torch) == 2 and "--index-url" in torch[0]
    assert torch[1] == "-m pip install --quiet torch==2.13.0"  # the package index, pinned
    assert "cannot be reached; took torch==2.13.0 from the package index" in out
    assert pip[-1] == "-m pip install --quiet -e .[test]"


def test_install_with_a_gpu_takes_the_pinned_torch_from_the_package_index(
        tmp_path: Path) -> None:
    root, env = fake_checkout(tmp_path, gpu=True)
    out, pip = run_script(root, env, "scripts/install")
    assert [line for line in pip if "torch" in line] == ["-m pip install --quiet torch==2.13.0"]
    assert "an NVIDIA GPU is present" in out


def test_the_demo_script_installs_no_test_extra(tmp_path: Path) -> None:
    root, env = fake_checkout(tmp_path, gpu=False)
    _, pip = run_script(root, env, "scripts/demo", "--fellows", "2")
    assert "-m pip install --quiet -e ." in pip
    assert not any("[test]" in line for line in pip)
    assert pip[-1] == "p2pswarm demo --fellows 2"


def test_the_package_asks_for_a_torch_range_not_the_pin() -> None:
    tomllib = pytest.importorskip("tomllib")

    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert [d for d in deps if d.startswith("torch")] == ["torch>=2.5"]
