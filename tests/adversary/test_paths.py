"""Names from the network never become paths (issue 19, part 5).

A fellow holding the token sends hashes, model keys, file names and checkpoint names of
its choosing. Each attack here hands the receiving side's code a hostile value as it
would arrive (a stage order's manifest, a gossiped load record, a shard push) and checks
that it is refused and that nothing outside the state directory was written, changed or
deleted (a snapshot of the whole temporary tree before and after).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pswarm.agent.weights import Manifest, WeightsCache
from p2pswarm.agent.world import Services
from p2pswarm.errors import ConfigError, SwarmError
from p2pswarm.names import UnsafeName, contained, safe_name, sha256_hex
from tests.adversary.snapshot import tree

PAYLOAD = b"import os; os.system('touch /tmp/owned')\n"  # what a planted .pth would run


def _layout(tmp_path: Path) -> tuple[Path, Path]:
    """A state directory and, beside it, a stand-in for site-packages."""
    state = tmp_path / "state"
    site = tmp_path / "lib" / "site-packages"
    (state / "weights").mkdir(parents=True)
    site.mkdir(parents=True)
    (site / "keep.py").write_text("x = 1\n")
    return state, site


def _cached(cache: WeightsCache, data: bytes) -> str:
    """Store ``data`` in the cache as a verified tensor would be; its hash."""
    sha = hashlib.sha256(data).hexdigest()
    writer = cache.writer(sha, len(data))
    writer.write(data)
    assert writer.commit()
    return sha


def _manifest(key: str, files: list[list[Any]], tensors: list[list[Any]] | None = None
              ) -> dict[str, Any]:
    return {"key": key, "name": "m", "path": "/nowhere", "config": {},
            "tensors": tensors or [], "files": files}


def test_a_crafted_model_key_cannot_plant_a_pth_in_site_packages(tmp_path: Path) -> None:
    state, site = _layout(tmp_path)
    cache = WeightsCache(state / "weights")
    sha = _cached(cache, PAYLOAD)  # bytes a rogue source got cached as a "tensor"
    before = tree(tmp_path, skip=state)
    hostile = _manifest("../../../lib/site-packages", [["evil.pth", len(PAYLOAD), sha]])
    with pytest.raises(ConfigError):
        cache.model_dir(Manifest.from_dict(hostile))
    assert not (site / "evil.pth").exists()
    assert tree(tmp_path, skip=state) == before


@pytest.mark.parametrize("name", ["../../../lib/site-packages/evil.pth", "/tmp/evil.pth",
                                  ".tokenizer.json", "tokenizer.json/../../x",
                                  "weights.pth"])
def test_a_crafted_file_name_is_refused(tmp_path: Path, name: str) -> None:
    state, _ = _layout(tmp_path)
    cache = WeightsCache(state / "weights")
    sha = _cached(cache, PAYLOAD)
    before = tree(tmp_path, skip=state)
    with pytest.raises(ConfigError):
        cache.model_dir(Manifest.from_dict(_manifest("0123456789abcdef",
                                                     [[name, len(PAYLOAD), sha]])))
    assert tree(tmp_path, skip=state) == before


@pytest.mark.parametrize("sha", ["../../../lib/site-packages/x", "/etc/hostname",
                                 "A" * 64, "0" * 63, "0" * 65, "../" * 21 + "a"])
def test_a_crafted_hash_never_becomes_a_path(tmp_path: Path, sha: str) -> None:
    state, _ = _layout(tmp_path)
    cache = WeightsCache(state / "weights")
    before = tree(tmp_path, skip=state)
    with pytest.raises(ConfigError):
        cache.writer(sha, 10)
    with pytest.raises(ConfigError):
        cache.has(sha, 10)
    tensor = ["t", "model.safetensors", "F32", [1], 0, 4, sha]
    with pytest.raises(ConfigError):
        Manifest.from_dict(_manifest("0123456789abcdef", [], [tensor]))
    with pytest.raises(ConfigError):
        Manifest.from_dict(_manifest("0123456789abcdef", [["tokenizer.json", 4, sha]]))
    assert tree(tmp_path, skip=state) == before


def test_a_cached_file_outside_the_cache_is_not_taken_for_a_tensor(tmp_path: Path) -> None:
    # today an absolute "hash" made has() look at any file of that size
    outside = tmp_path / "secret"
    outside.write_bytes(b"12345")
    cache = WeightsCache(tmp_path / "weights")
    with pytest.raises(ConfigError):
        cache.has(str(outside), 5)


def test_the_tokenizer_directory_is_named_by_its_content(tmp_path: Path) -> None:
    # a rogue announcing a known model's key with other files gets its own directory
    cache = WeightsCache(tmp_path / "weights")
    good = _cached(cache, b'{"good": 1}')
    bad = _cached(cache, b'{"bad": 1}')
    honest = Manifest.from_dict(_manifest("0123456789abcdef",
                                          [["tokenizer.json", 11, good]]))
    poisoned = Manifest.from_dict(_manifest("0123456789abcdef",
                                            [["tokenizer.json", 10, bad]]))
    first = cache.model_dir(poisoned)
    second = cache.model_dir(honest)
    assert first != second
    assert (second / "tokenizer.json").read_bytes() == b'{"good": 1}'


def test_names_module() -> None:
    assert sha256_hex("ab" * 32) == "ab" * 32
    for bad in ("AB" * 32, "ab" * 31, 5, None, "g" * 64):
        with pytest.raises(UnsafeName):
            sha256_hex(bad)
    assert safe_name("model-00001-of-00002.safetensors")
    for bad in ("", ".", "..", ".hidden", "a/b", "a\\b", "a\x00b", "x" * 129, "ü", 3):
        with pytest.raises(UnsafeName):
            safe_name(bad)
    assert issubclass(UnsafeName, SwarmError)


def test_contained_follows_symlinks(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    (root / "a.safetensors").write_bytes(b"x")
    (root / "link").symlink_to(tmp_path)
    assert contained(root, "a.safetensors") == (root / "a.safetensors").resolve()
    for escape in ("../x", "/etc/passwd", "link/x", "sub/../../x"):
        with pytest.raises(UnsafeName):
            contained(root, escape)


# --- a model directory's index cannot point outside it -------------------------------------


@pytest.fixture(scope="module")
def built_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from p2pswarm.models import write_builtin_checkpoint

    return write_builtin_checkpoint("tiny-llama", tmp_path_factory.mktemp("built") / "m")


def _model_copy(built: Path, where: Path) -> Path:
    """A model directory like ``built`` (weights hard-linked: written once per module)."""
    where.mkdir(parents=True)
    (where / "config.json").write_bytes((built / "config.json").read_bytes())
    os.link(built / "model.safetensors", where / "model.safetensors")
    return where


@pytest.mark.parametrize("where", ["../outside.safetensors", "/etc/passwd",
                                   "sub/../../outside.safetensors", "link.safetensors"])
def test_an_index_naming_a_file_outside_the_model_is_refused(tmp_path: Path, built_model: Path,
                                                               where: str) -> None:
    from p2pswarm.models.checkpoint import Checkpoint

    (tmp_path / "outside.safetensors").write_bytes(b"\0" * 16)
    model = _model_copy(built_model, tmp_path / "model")
    (model / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {"model.embed_tokens.weight": where}}))
    (model / "link.safetensors").symlink_to(tmp_path / "outside.safetensors")
    with pytest.raises(ConfigError, match="outside|bad weights file name"):
        Checkpoint(model)


def test_a_symlink_out_of_an_unindexed_model_is_refused(tmp_path: Path,
                                                        built_model: Path) -> None:
    from p2pswarm.models.checkpoint import Checkpoint

    model = _model_copy(built_model, tmp_path / "model")
    (model / "model.safetensors").rename(tmp_path / "elsewhere.safetensors")
    (model / "model.safetensors").symlink_to(tmp_path / "elsewhere.safetensors")
    with pytest.raises(ConfigError, match="outside"):
        Checkpoint(model)


def test_a_hub_snapshot_may_link_into_its_own_blobs(tmp_path: Path, built_model: Path) -> None:
    from p2pswarm.models.checkpoint import Checkpoint

    repo = tmp_path / "models--org--tiny"
    snapshot = _model_copy(built_model, repo / "snapshots" / "abc123")
    (repo / "blobs").mkdir()
    (snapshot / "model.safetensors").rename(repo / "blobs" / "f00d")
    (snapshot / "model.safetensors").symlink_to(Path("../../blobs/f00d"))
    assert Checkpoint(snapshot).tensor_names()


# --- against live agents: a rogue leader's orders and a rogue's shard pushes ---------------


async def test_a_rogue_leaders_crafted_names_are_refused_and_counted(
        autojump_clock: Any, tmp_path: Path) -> None:
    """The rogue is elected leader (it may well be: it holds the token and the votes), then
    orders a stage whose manifest's hashes and key are paths, and pushes checkpoint
    shards and job data under names that are paths. Every one is refused and counted;
    every fellow stays up; nothing outside the fellows' state directories changes."""
    from p2pswarm.agent.serving.records import StageOrder, runtime_block
    from p2pswarm.agent.streams import receive_message, send_message
    from p2pswarm.planner import BUILTIN_MODELS
    from p2pswarm.sim.virtual import VirtualSwarm, wait_until
    from p2pswarm.wire.loads import StagePrepare, StagePrepared
    from p2pswarm.wire.training import DataPut, TrainError, TrainFetch, TrainShard

    (tmp_path / "lib" / "site-packages").mkdir(parents=True)
    (tmp_path / "lib" / "site-packages" / "keep.py").write_text("x = 1\n")
    services = Services(weights_dir=tmp_path / "state" / "weights")
    async with trio.open_nursery() as nursery:
        swarm = VirtualSwarm(3, seed=8, services=services)
        swarm.fellows[0].leader_priority = 10
        await nursery.start(swarm.run)
        for i in range(3):
            await swarm.start(i)
        await wait_until(lambda: swarm.converged() and len(swarm.leaders()) == 1
                         and None not in {lid for lid, _ in swarm.leaders()}, timeout_s=30)
        rogue, victim = swarm.live()[0], swarm.live()[1]
        assert rogue.election is not None and rogue.election.status().role == "leader"
        before = tree(tmp_path, skip=tmp_path / "state")

        hf = dict(BUILTIN_MODELS["tiny-llama"])
        for key, sha in (("../../../lib/site-packages", "ab" * 32),
                         ("0123456789abcdef", "/etc/hostname"),
                         ("0123456789abcdef", "../../../lib/site-packages/evil.pth")):
            manifest = {"key": key, "name": "m", "path": "/", "config": hf,
                        "tensors": [["model.embed_tokens.weight", "model.safetensors", "F32",
                                     [4], 0, 16, sha]], "files": []}
            order = StageOrder("00000000000000aa", 0, 1, victim.node_id.hex(), (0, 1), "cpu",
                               0, "CPU", 1000, 1000, runtime_block({}), {
                                   "kind": "files", "source_id": rogue.node_id.hex(),
                                   "source": rogue.name, "manifest": manifest})
            with pytest.raises(SwarmError, match="bad|SHA-256|model key"):
                await rogue.leadership.order(victim.addr, StagePrepare(order.to_wire()),
                                             StagePrepared)
        assert victim.counters.drops["unsafe-name"] == 3

        hostile = [TrainShard("../../../lib", 1, "x", "ab" * 32, 0, 4, b"abcd"),
                   TrainShard("job-00000001", 1, "../../../lib/site-packages/evil",
                              "ab" * 32, 0, 4, b"abcd"),
                   TrainShard("job-00000001", 1, ".hidden", "ab" * 32, 0, 4, b"abcd"),
                   TrainFetch("../../..", 0, "manifest.json"),
                   DataPut("../../../lib/site-packages/evil.pth" + "x" * 29, 4)]
        for msg in hostile:
            async with await rogue.open_secure(victim.addr) as stream:
                await send_message(stream, msg)
                answer = await receive_message(stream, TrainError, "the victim")
                assert "bad" in answer.reason or "SHA-256" in answer.reason
        assert victim.counters.drops["unsafe-name"] == 3 + 4
        assert victim.counters.drops["bad-hash"] == 1
        assert all(not a.stopped.is_set() for a in swarm.live())
        assert victim.status()["counters"]["drops"]["unsafe-name"] == 7
        nursery.cancel_scope.cancel()
    assert tree(tmp_path, skip=tmp_path / "state") == before


@given(st.text(max_size=140))
@settings(max_examples=300, deadline=None)
def test_whatever_passes_safe_name_stays_one_component(name: str) -> None:
    try:
        safe_name(name)
    except UnsafeName:
        return
    root = Path("/nonexistent-p2pswarm-root")
    assert (root / name).parent == root and not name.startswith(".")
    assert contained(root, name) == root / name
