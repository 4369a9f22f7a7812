"""`p2pswarm demo` end to end: real processes on loopback, then nothing left behind."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import pytest

from p2pswarm.sim.commands import CLI, cli

pytestmark = pytest.mark.slow  # real processes: minutes, not seconds


def assert_nothing_left(tmp: Path, root: str) -> None:
    """No fellow process, no state: the demo's directory and TMPDIR are empty again
    (torch keeps a compile cache of its own in TMPDIR; it is not the demo's state)."""
    assert not Path(root).exists()
    assert [p for p in tmp.iterdir() if not p.name.startswith("torchinductor")] == []
    strays = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if root in " ".join(p.info["cmdline"] or []):
                strays.append(p.pid)
        except psutil.Error:
            continue
    assert strays == []


def corpus_words() -> set[str]:
    from p2pswarm.training.data import corpus_text

    return {w.lower() for w in re.findall(r"[A-Za-z]+", corpus_text())}


def test_demo_serves_across_three_fellows_and_leaves_cleanly(tmp_path: Path) -> None:
    """... and, started in the folder that holds a clone, runs the installed package: there
    a `p2pswarm` folder shadows it for anything that imports from the current directory
    (`python -m`), and the fellows must not."""
    # a short private TMPDIR: the demo's state goes there (Unix socket paths are short)
    tmp = Path(tempfile.mkdtemp(prefix="p2ps-"))
    try:
        env = {**os.environ, "TMPDIR": str(tmp), "COLUMNS": "120"}
        if sys.version_info >= (3, 11):
            shadow = tmp_path / "p2pswarm"
            shadow.mkdir()
            (shadow / "__init__.py").write_text(
                "raise ImportError('the clone shadows the package')\n")
            # -P: this process, like the `p2pswarm` console script, does not import from
            # the cwd (Python 3.11's safe path)
            done = subprocess.run([sys.executable, "-P", *CLI[1:], "demo"], cwd=tmp_path,
                                  capture_output=True, text=True, timeout=300, env=env,
                                  stdin=subprocess.DEVNULL, check=False)
        else:
            done = cli("demo", timeout_s=300, env=env)
        out = done.stdout
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        root = re.search(r"on loopback in (\S+), each offering 360MB", out)
        assert root is not None, out
        assert "3 fellows" in out and "leader:" in out  # the status
        assert "▕" in out and "plan_id" in out  # the plan's bars
        plan_id = re.search(r"plan_id ([0-9a-f]{16})", out)
        assert plan_id is not None
        assert f"demo-llama needs 3 of the 3 fellows; loading plan {plan_id[1]}" in out
        ready = re.findall(r"stage (\d) on (fellow-\d): ready, ([\d.]+) MB allocated "
                           r"\(plan claimed ([\d.]+) MB\)", out)
        assert sorted(r[0] for r in ready) == ["0", "1", "2"]
        assert len({r[1] for r in ready}) == 3 and all(r[2] == r[3] for r in ready)
        assert re.search(r"64 tokens: first after [\d.]+ s, then [\d.]+ tokens/s", out)
        # the shipped model learnt the corpus: its text is words, most of them the corpus's
        text = out.split("trains one like it):\n", 1)[1].split("\n", 1)[0]
        assert text.startswith("We the People")
        words = re.findall(r"[A-Za-z]+", text)
        corpus = corpus_words()
        assert len(words) >= 8 and sum(w.lower() in corpus for w in words) >= 0.7 * len(words)
        assert re.search(r"per token: stage 0 on fellow-\d \(layers 0-\d+\) [\d.]+ ms, "
                         r"stage 1 .* network [\d.]+ ms over 4 hops", out)
        assert "checked against the same model in one process: the same tokens" in out
        assert "unloaded; leaving" in out
        assert_nothing_left(tmp, root[1])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_demo_train_learns_serves_the_result_and_leaves_cleanly() -> None:
    """A shortened `demo --train`: three fellows train one pipeline, the exported model
    is served on the cut it trained with, and nothing is left behind."""
    import json

    tmp = Path(tempfile.mkdtemp(prefix="p2ps-"))
    try:
        env = {**os.environ, "TMPDIR": str(tmp), "COLUMNS": "120"}
        done = cli("demo", "--train", "--steps", "20", "--json", timeout_s=300, env=env)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        result = json.loads(done.stdout)
        root = re.search(r"on loopback in (\S+), each offering", done.stderr)
        assert root is not None, done.stderr
        assert result["job"]["state"] == "finished" and result["job"]["step"] == 20
        curve = result["loss_curve"]
        assert len(curve) == 20 and result["final_loss"] < result["first_loss"] - 1.0
        assert len(set(s["fellow"] for s in result["job"]["stages"][0])) == 3
        assert result["cut"] == result["served_cut"] and len(result["cut"]) == 2
        assert set(result["samples"]) == {"We the People", "Congress shall"}
        assert all(len(text) > len(prompt) for prompt, text in result["samples"].items())
        assert "step 20/20" not in done.stdout  # progress goes to stderr under --json
        assert_nothing_left(tmp, root[1])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
