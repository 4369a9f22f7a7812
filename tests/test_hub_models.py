"""Models by hub id, from a Hugging Face cache laid out as ``huggingface-cli`` lays it out.

The cache is built here (refs/main, a snapshot whose files link to blobs), so everything
runs offline: ``plan`` through the CLI in a real process, ``load`` and a completion over
the HTTP API of a two-fellow loopback swarm, a job's model, and the one line a model
that is not cached gets.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from p2pswarm.errors import ConfigError
from p2pswarm.models import BuiltinModel, write_builtin_checkpoint
from p2pswarm.models.files import model_directory, read_model_config
from p2pswarm.models.hub import cached_snapshot, hub_cache_dir, is_hub_id
from p2pswarm.models.loader import open_model
from p2pswarm.models.tokenizer import load_tokenizer
from p2pswarm.sim.commands import cli
from tests.http_swarm import LoopbackSwarm, serve_body

HUB_ID = "acme/tiny-llama-chat"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
REFERENCE = Path(__file__).resolve().parent.parent / "simulations" / "clusters" / "reference.json"


def build_cache(root: Path) -> Path:
    """A hub cache holding HUB_ID: tiny-llama's weights and a word-level tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    made = write_builtin_checkpoint("tiny-llama", root / "made")
    vocab = {"<unk>": 0, "hello": 104, "swarm": 115, "<s>": 256, "</s>": 257}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(made / "tokenizer.json"))
    repo = root / "hub" / "models--acme--tiny-llama-chat"
    snapshot = repo / "snapshots" / COMMIT
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for file in made.iterdir():  # as the hub does: the snapshot links to content blobs
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / file.name).symlink_to(Path("..", "..", "blobs", blob.name))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return root / "hub"


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_cache(tmp_path_factory.mktemp("hf"))


@pytest.fixture
def env_cache(cache: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return cache


def test_the_cache_is_found_where_the_hub_tools_put_it() -> None:
    assert hub_cache_dir({"HF_HUB_CACHE": "/a", "HF_HOME": "/b"}) == Path("/a")
    assert hub_cache_dir({"HF_HOME": "/b", "XDG_CACHE_HOME": "/c"}) == Path("/b/hub")
    assert hub_cache_dir({"XDG_CACHE_HOME": "/c"}) == Path("/c/huggingface/hub")
    assert hub_cache_dir({}) == Path("~/.cache/huggingface/hub").expanduser()
    assert is_hub_id("Qwen/Qwen2.5-0.5B-Instruct")
    for bad in ("tiny-llama", "../etc/x", "a/b/c", "org/.hidden", "/abs", "a/", "a b/c"):
        assert not is_hub_id(bad), bad


def test_a_cached_model_opens_by_its_id(env_cache: Path) -> None:
    name, config = read_model_config(HUB_ID)
    assert name == "tiny-llama-chat" and config["num_hidden_layers"] == 8
    assert model_directory(HUB_ID) == str(env_cache / "models--acme--tiny-llama-chat" /
                                          "snapshots" / COMMIT)
    model = open_model(HUB_ID)
    assert model.name == "tiny-llama-chat"  # the repository's name, not the commit
    builtin = BuiltinModel("tiny-llama")
    [(_, tensor)] = list(model.read(["model.layers.3.mlp.up_proj.weight"], "cpu"))
    assert tensor.equal(builtin.tensor("model.layers.3.mlp.up_proj.weight"))
    assert load_tokenizer(HUB_ID).encode("hello swarm", add_bos=False) == [104, 115]


def test_mcp_and_job_json_take_a_hub_id(env_cache: Path, tmp_path: Path) -> None:
    from p2pswarm.agent.training.jobs import model_message
    from p2pswarm.mcp_server import SwarmTools
    from p2pswarm.training.job import JobConfig
    from p2pswarm.training.source import open_job_model

    message, path = SwarmTools.serve_request(HUB_ID, 256, None, "f32", None, None, 1, "f32")
    assert message["model"]["name"] == "tiny-llama-chat" and path == model_directory(HUB_ID)
    (tmp_path / "acme").mkdir()  # job.json's directory: the id is not taken as a path in it
    job = JobConfig.from_dict({"model": HUB_ID, "steps": 1}, base_dir=tmp_path)
    assert job.model.name == HUB_ID
    assert model_message(job)["name"] == "tiny-llama-chat"
    assert open_job_model(job.model, 0).config.num_layers == 8


def test_a_model_not_cached_gets_one_line(env_cache: Path) -> None:
    with pytest.raises(ConfigError, match="huggingface-cli download acme/other") as caught:
        read_model_config("acme/other")
    assert "\n" not in str(caught.value) and str(env_cache) in str(caught.value)
    with pytest.raises(ConfigError, match="huggingface-cli download acme/other"):
        open_model("acme/other")


def test_a_bad_ref_is_refused(tmp_path: Path) -> None:
    repo = tmp_path / "models--acme--x"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("../../../../etc")
    with pytest.raises(ConfigError, match="commit hash"):
        cached_snapshot("acme/x", tmp_path)


def test_plan_by_hub_id_in_a_real_process_offline(cache: Path) -> None:
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    run = cli("plan", HUB_ID, "--cluster", str(REFERENCE), "--json", env=env, timeout_s=120)
    assert run.returncode == 0, run.stderr
    plan = json.loads(run.stdout)
    assert plan["model"]["name"] == "tiny-llama-chat" and plan["fits"]
    missing = cli("plan", "acme/other", "--cluster", str(REFERENCE), env=env, timeout_s=120)
    assert missing.returncode != 0 and "Traceback" not in missing.stderr
    lines = missing.stderr.strip().splitlines()
    assert len(lines) == 1 and "huggingface-cli download acme/other" in lines[0]


@pytest.fixture
def swarm(tmp_path: Path, env_cache: Path) -> Iterator[LoopbackSwarm]:
    with LoopbackSwarm(tmp_path) as running:
        yield running


def test_load_and_complete_by_hub_id_over_http(swarm: LoopbackSwarm) -> None:
    with httpx.Client(base_url=swarm.url(1), timeout=60) as client:
        loaded = client.post("/api/models/load", json=serve_body(HUB_ID))
        assert loaded.status_code == 200, loaded.text
        answer = client.post("/v1/completions", json={
            "model": "tiny-llama-chat", "prompt": "hello swarm", "max_tokens": 3,
            "temperature": 0})
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == 3
