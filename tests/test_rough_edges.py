"""Rough edges a newcomer meets, each through the real command line: a second `join` on a
busy home, a busy HTTP port, shape-only and shipped model names, the demo started from
the folder holding the clone, a seed that never answers, and narrow terminals."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from p2pswarm.cli import app
from p2pswarm.sim.commands import CLI, cli
from p2pswarm.sim.processes import LocalSwarm, local_swarm

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

runner = CliRunner()


def invoke(*args: str, columns: int = 80):
    return runner.invoke(app, list(args), env={"P2PSWARM_TOKEN": "", "P2PSWARM_HOME": "",
                                               "COLUMNS": str(columns)})


def error_lines(stderr: str) -> list[str]:
    """The lines of a failed command's stderr that are not its log."""
    return [line for line in stderr.splitlines() if line.strip()
            and " INFO " not in line and " WARNING " not in line]


@pytest.fixture(scope="module")
def one_fellow() -> Iterator[LocalSwarm]:
    """One fellow for the module: its tests ask it, and any load they make they unload."""
    with local_swarm(lambda text: None) as swarm:
        swarm.start("only", extra=("--http", "off", "--cpu-memory", "300MB"))
        swarm.wait_formed(["only"])
        yield swarm


@pytest.mark.slow
def test_a_second_join_on_a_busy_home_is_one_line_and_prompt(one_fellow: LocalSwarm) -> None:
    home = one_fellow.homes["only"]
    began = time.monotonic()
    done = cli("join", "--home", str(home), "--listen", "127.0.0.1:0", "--http", "off",
               "--cpu-memory", "300MB")
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
        done = cli("join", "--home", str(tmp_path), "--listen", "127.0.0.1:0", "--http",
                   f"127.0.0.1:{port}")
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
    assert "asked https://download.pytorch.org/whl/cpu (and the places pip is configured " \
        "with) for the CPU build" in out
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


# --- model names: shape-only built-ins, the shipped demo-llama, the models page -----------


def test_load_of_a_shape_only_name_says_what_it_is_and_what_to_give(tmp_path: Path) -> None:
    result = invoke("load", "llama-3-8b", "--home", str(tmp_path))
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: llama-3-8b is a shape-only built-in")
    assert "no weights" in lines[0] and "model's directory" in lines[0]
    assert "config.json not found" not in lines[0]


@pytest.mark.slow
def test_demo_llama_is_a_name_for_plan_and_load(one_fellow: LocalSwarm) -> None:
    home = str(one_fellow.homes["only"])
    plan = invoke("plan", "demo-llama", "--floor", "cpu=200MB", "--home", home)
    assert plan.exit_code == 0, plan.output
    assert "demo-llama" in plan.output and "plan_id" in plan.output
    shape = invoke("load", "llama-3-8b", "--plan", "--home", home, columns=120)
    assert "shape-only" not in shape.output  # plan on paper stays allowed
    loaded = invoke("load", "demo-llama", "--floor", "cpu=200MB", "--weights-dtype", "f32",
                    "--home", home, columns=120)
    assert loaded.exit_code == 0, loaded.output
    assert "loaded plan" in loaded.output and "(demo-llama)" in loaded.output
    assert invoke("unload", "--all", "--home", home).exit_code == 0


def test_the_models_listing_holds_demo_llama_with_its_weights() -> None:
    from p2pswarm.http.api import model_summaries

    models = {m["name"]: m for m in model_summaries()}
    assert models["demo-llama"]["weights"] and models["demo-llama"]["source"] == "shipped"
    assert models["demo-llama"]["layers"] == 6
    assert not models["llama-3-8b"]["weights"]


CHROMIUM = next((p for p in ("/usr/bin/chromium", shutil.which("chromium") or "") if p
                 and Path(p).exists()), None)


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed")
def test_the_models_page_reads_sensibly() -> None:
    """The real listing on the page: an RWKV's unbounded context, 999.9 M parameters as
    1.0B, the shipped demo-llama with a Load button."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from playwright.sync_api import expect, sync_playwright

    from p2pswarm.http.api import model_summaries

    static = REPO / "p2pswarm" / "http" / "static"
    answers = {"/api/models": {"models": model_summaries()}, "/api/models/loads": {"loads": []},
               "/api/status": {"self": {"name": "deskpc"}, "members": [], "leader": None}}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            path = self.path.split("?")[0]
            name = "index.html" if path == "/" else path.removeprefix("/static/")
            if (static / name).is_file():
                kind = {".html": "text/html", ".js": "application/javascript",
                        ".css": "text/css"}[Path(name).suffix]
                data = (static / name).read_bytes()
            else:
                kind, data = "application/json", json.dumps(answers[path]).encode()
            self.send_response(200)
            self.send_header("Content-Type", kind + "; charset=utf-8")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM)
            page = browser.new_page()
            page.goto(f"http://127.0.0.1:{server.server_address[1]}/")
            rwkv = page.locator('tr[data-model="tiny-rwkv7"] td')
            expect(rwkv.nth(2)).to_have_text("unbounded", timeout=15_000)
            expect(page.locator('tr[data-model="gemma-3-1b"] td').first).to_have_text("1.0B")
            expect(page.locator('tr[data-model="demo-llama"] td').first).to_have_text("1.2M")
            expect(page.locator('tr[data-model="demo-llama"] td').nth(3)).to_have_text("shipped")
            expect(page.get_by_role("button", name="Load demo-llama")).to_be_enabled()
            browser.close()
    finally:
        server.shutdown()


# the demo started in the folder that holds a clone: tests/test_demo.py (one demo run)


# --- status explains a leaderless side; a waiting stage says the true reason ------------


def status_through_cli(monkeypatch: pytest.MonkeyPatch, doc: dict, columns: int = 80) -> str:
    """`p2pswarm status` as a terminal ``columns`` wide shows ``doc`` (an agent's)."""
    from p2pswarm.control import client

    monkeypatch.setattr(client, "request", lambda home, request, timeout_s=30.0: doc)
    result = invoke("status", columns=columns)
    assert result.exit_code == 0, result.output
    return result.output


async def test_status_says_why_a_side_has_no_leader_and_what_ends_it(
        autojump_clock, monkeypatch: pytest.MonkeyPatch) -> None:
    import trio

    from p2pswarm.sim.virtual import VirtualSwarm, wait_until
    from tests.swarm_start import formed

    swarm = VirtualSwarm(4, seed=11)
    async with trio.open_nursery() as nursery:
        await formed(nursery, swarm, timeout_s=30)
        await wait_until(lambda: len(swarm.leaders()) == 1
                         and next(iter(swarm.leaders()))[0] is not None, timeout_s=30)
        swarm.crash(2)
        await trio.sleep(60.0)  # two crashes within four minutes
        swarm.crash(3)
        crashed_s = trio.current_time()
        await wait_until(lambda: all(lead is None for lead, _ in swarm.leaders()),
                         timeout_s=60)
        waited_s = trio.current_time() - crashed_s
        doc = swarm.live()[0].status()
        nursery.cancel_scope.cancel()
    electorate = doc["electorate"]
    assert (electorate["voters"], electorate["needs"], electorate["sees"]) == (4, 3, 2)
    # the first to die leaves the electorate 240 s after it was last seen alive
    assert 240.0 - 60.0 - waited_s - 15.0 <= electorate["shrinks_in_s"] <= 240.0 - 60.0
    out = status_through_cli(monkeypatch, doc)
    assert "no leader: this side sees 2 of 4 fellows" in out
    assert "a leader needs the votes of a majority of the electorate: 3 of its 4" in out
    assert "the electorate shrinks to 3" in out and "then 2 votes elect" in out
    assert "restart a fellow that died" in out
    assert "last heard" in out and all(len(line) <= 80 for line in out.splitlines())


def test_a_waiting_stage_says_which_fellows_were_ruled_out_and_why() -> None:
    from p2pswarm.agent.serving.moves import no_spare_reason
    from p2pswarm.planner.cluster import CardView, ClusterView, Fellow

    def fellow(name: str, connected: bool = True, training: bool = False,
               free_gb: float = 20.0) -> Fellow:
        card = CardView(0, "cpu", "CPU", 32 * 10**9, int(free_gb * 1e9), (), 1e11, 2e10, False)
        return Fellow(name, name, connected, training, (card,))

    view = ClusterView((fellow("a"), fellow("b"), fellow("c", connected=False),
                        fellow("d", connected=False)))
    why = no_spare_reason(view, 300_000_000, {"a", "b"})
    assert "a, b already run a stage of this load" in why
    assert "2 fellows are not connected" in why and "restart a lost one" in why
    why = no_spare_reason(ClusterView((fellow("a"), fellow("e", training=True),
                                       fellow("f", free_gb=0.1))), 300_000_000, {"a"})
    assert "e trains" in why and "too little free on f (0.1 GB at most)" in why


# --- narrow terminals: status keeps "last heard"; a small model's plan in MB ------------


def test_status_keeps_every_important_column_at_80_columns(
        monkeypatch: pytest.MonkeyPatch) -> None:
    card = {"kind": "cpu", "index": 0, "name": "CPU", "free_bytes": 1_600_000_000,
            "total_bytes": 2_000_000_000, "memory_source": "cgroup memory.max"}
    members = [{"id": f"{i:02x}" * 16, "name": f"workstation-{i}", "self": i == 0,
                "addr": f"192.168.100.{100 + i}:7782", "state": "alive", "incarnation": i,
                "cards": [card, {**card, "kind": "cuda", "name": "RTX 3060"}],
                "last_heard_s": 12.5 * i} for i in range(3)]
    doc = {"self": {"id": "00" * 16, "name": "workstation-0", "addr": members[0]["addr"]},
           "preset": "lan", "health": 0, "members": members, "counters": {},
           "leader": {"id": "00" * 16, "name": "workstation-0", "term": 2}}
    out = status_through_cli(monkeypatch, doc, columns=80)
    assert all(len(line) <= 80 for line in out.splitlines()), out
    for words in ("last heard", "25.0 s ago", "192.168.100.102:7782", "alive", "(cgroup"):
        assert words in out, words
    assert "…" not in out  # folded, never cut short
    wide = status_through_cli(monkeypatch, doc, columns=140)
    assert "inc" in wide and "0101010" in wide


@pytest.mark.slow
def test_a_small_models_plan_reads_megabytes(one_fellow: LocalSwarm) -> None:
    result = invoke("plan", "demo-llama", "--floor", "cpu=200MB", "--home",
                    str(one_fellow.homes["only"]))
    assert result.exit_code == 0, result.output
    assert "segments in MB" in result.output
    assert " 0.0 " not in result.output and "0.0 GB" not in result.output


# --- a seed that never answers ------------------------------------------------------------


def test_an_unreachable_seed_gets_a_hint_while_joining_goes_on(tmp_path: Path) -> None:
    import queue
    import threading

    invoke("init", "--home", str(tmp_path))
    with socket.socket() as closed:  # a port nothing listens on: a mistyped one
        closed.bind(("127.0.0.1", 0))
        seed = f"127.0.0.1:{closed.getsockname()[1]}"
    process = subprocess.Popen(
        [*CLI, "join", seed, "--home", str(tmp_path), "--listen", "127.0.0.1:0", "--http",
         "off", "--preset", "local", "--cpu-memory", "300MB", "--log-level", "warning"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in process.stderr or []],
                     daemon=True).start()
    hint = None
    deadline = time.monotonic() + 60
    try:
        while hint is None and time.monotonic() < deadline:
            try:
                line = lines.get(timeout=1)
            except queue.Empty:
                continue
            if "did not answer" in line:
                hint = line
        assert hint is not None, "no hint within 60 s"
        assert f"the seed {seed} did not answer 3 tries" in hint
        assert "connection refused" in hint and "is the address right?" in hint
        assert "still trying" in hint
        assert process.poll() is None  # it goes on trying
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_loads_keeps_its_columns_at_80_columns(agent) -> None:
    from tests.fakes import RECORD

    stages = [dict(s, card="NVIDIA GeForce RTX 3060 #0", fellow=f"workstation-{i}",
                   allocated_bytes=5_900_000_000, claim_bytes=5_900_000_000,
                   fetched_bytes=0) for i, s in enumerate(RECORD["stages"])]
    agent.answers["loads"] = {"loads": [dict(RECORD, stages=stages)]}
    result = invoke("loads", columns=80)
    assert result.exit_code == 0, result.output
    assert all(len(line) <= 80 for line in result.output.splitlines())
    for header in ("stage", "fellow", "layers", "allocated", "claimed", "fetched", "state"):
        assert header in result.output
    assert "5.9 GB" in result.output and "0 MB" in result.output and "…" not in result.output


def test_a_service_that_fails_to_start_is_its_own_error_not_a_group() -> None:
    from p2pswarm.cli.swarm import first_swarm_error
    from p2pswarm.errors import TransportError

    busy = TransportError("cannot serve HTTP on 127.0.0.1:7780: Address already in use")
    nested = BaseExceptionGroup("nursery", [BaseExceptionGroup("inner", [busy])])
    assert first_swarm_error(nested) is busy
    other = BaseExceptionGroup("nursery", [ValueError("a bug")])
    assert first_swarm_error(other) is other  # a bug keeps its traceback


@pytest.mark.usefixtures("one_torch_thread")
async def test_loads_says_why_a_lost_stage_waits_when_the_others_have_room(
        autojump_clock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three fellows, a stage on each, 16 GB free on every card: the leader that hosts a
    stage crashes, and its stage waits. Not for a card with room (every fellow has one)
    but because each one left already runs a stage of the load."""
    import trio

    from p2pswarm.errors import TransportError
    from tests.serving_swarm import PROMPT, crashing_after, request, short_grace, start_swarm

    async with trio.open_nursery() as nursery:
        swarm = await start_swarm(nursery, tmp_path, seed=52, n=3)
        ((leader_id, _),) = swarm.leaders()
        leader_at = next(i for i, f in enumerate(swarm.fellows)
                         if f.identity.node_id == leader_id)
        leader = swarm.fellows[leader_at].agent
        assert leader is not None
        message = request()
        plan = await leader.planning.ask_plan(message)
        await leader.serving.load(message, plan_id=plan["plan_id"])
        driver = next(a for a in swarm.live() if a is not leader)
        short_grace(swarm)
        with pytest.raises(TransportError):
            await driver.serving.generate(prompt_ids=PROMPT[:30], max_tokens=200,
                                          stop_token_ids=(),
                                          on_token=crashing_after(swarm, leader_at, 3, []))
        (record,) = await driver.serving.list_loads()
        nursery.cancel_scope.cancel()
    from p2pswarm.control import client

    monkeypatch.setattr(client, "request", lambda home, req, timeout_s=30.0: {
        "loads": [record]})
    out = " ".join(invoke("loads", columns=200).output.split())
    assert "no connected fellow has one" not in out
    assert "already run a stage of this load" in out and "1 fellow is not connected" in out


def test_join_on_a_home_too_deep_for_its_socket_is_one_line(tmp_path: Path) -> None:
    # a Unix socket's path holds 107 bytes: a deep --home failed as an ExceptionGroup
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    invoke("init", "--home", str(deep))
    done = cli("join", "--home", str(deep), "--listen", "127.0.0.1:0", "--http", "off")
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr and "ExceptionGroup" not in done.stderr
    lines = error_lines(done.stderr)
    assert len(lines) == 1, done.stderr
    assert "too deep for its control socket" in lines[0] and "shorter --home" in lines[0]
