"""Gemma 2 across its sliding window on real `join` processes: a tiny random model saved by
transformers, loaded over two fellows from its directory with the CLI as a user types it,
and 24 greedy tokens after an 8-token prompt (past the window of 16 at the 9th) equal to
transformers' own ``generate`` (float32 weights and cache: exact, so equal token for token)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from p2pswarm.sim.commands import cli
from p2pswarm.sim.processes import local_swarm
from tests.test_sliding_window import reference_model, sequence

pytest.importorskip("transformers", reason="transformers is a test extra")
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]  # real processes

NAMES = ["fellow-1", "fellow-2"]


def _cli(home: Path, *args: str) -> str:
    run = cli(*args, "--home", str(home), timeout_s=180)
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout


def test_two_fellows_generate_what_transformers_generates_past_the_window(
        tmp_path: Path) -> None:
    model = reference_model("gemma2")
    model_dir = tmp_path / "tiny-gemma2"
    model.save_pretrained(model_dir)
    prompt = sequence(8, 7)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)
    want = out[0, len(prompt):].tolist()
    assert len(set(want)) > 5  # a walk through the vocabulary, not one token repeated
    with local_swarm(lambda line: None) as swarm:
        quiet = ("--log-level", "warning")
        seed = swarm.start(NAMES[0], extra=quiet)
        swarm.launch(NAMES[1], seeds=(seed,), extra=quiet)
        swarm.wait_formed(NAMES)
        home = swarm.homes[NAMES[0]]
        loaded = json.loads(_cli(home, "load", str(model_dir), "--stages", "2",
                                 "--weights-dtype", "f32", "--kv-dtype", "f32",
                                 "--context", "64", "--json"))
        assert {s["fellow"] for s in loaded["stages"]} == set(NAMES)
        got = json.loads(_cli(home, "generate", "--prompt-ids", ",".join(map(str, prompt)),
                              "--max-tokens", "24", "--json"))
        assert got["token_ids"] == want
