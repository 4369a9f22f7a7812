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
from pathlib import Path
from typing import Any

import pytest

from p2pswarm.agent.weights import Manifest, WeightsCache
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


def _model_with_index(tmp_path: Path, weight_map: dict[str, str]) -> Path:
    from p2pswarm.models import write_builtin_checkpoint

    model = write_builtin_checkpoint("tiny-llama", tmp_path / "model")
    (model / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))
    return model


@pytest.mark.parametrize("where", ["../outside.safetensors", "/etc/passwd",
                                   "sub/../../outside.safetensors", "link.safetensors"])
def test_an_index_naming_a_file_outside_the_model_is_refused(tmp_path: Path,
                                                               where: str) -> None:
    from p2pswarm.models.checkpoint import Checkpoint

    (tmp_path / "outside.safetensors").write_bytes(b"\0" * 16)
    model = _model_with_index(tmp_path, {"model.embed_tokens.weight": where})
    (model / "link.safetensors").symlink_to(tmp_path / "outside.safetensors")
    with pytest.raises(ConfigError, match="outside|bad weights file name"):
        Checkpoint(model)


def test_a_symlink_out_of_an_unindexed_model_is_refused(tmp_path: Path) -> None:
    from p2pswarm.models import write_builtin_checkpoint
    from p2pswarm.models.checkpoint import Checkpoint

    model = write_builtin_checkpoint("tiny-llama", tmp_path / "model")
    (model / "model.safetensors").rename(tmp_path / "elsewhere.safetensors")
    (model / "model.safetensors").symlink_to(tmp_path / "elsewhere.safetensors")
    with pytest.raises(ConfigError, match="outside"):
        Checkpoint(model)


def test_a_hub_snapshot_may_link_into_its_own_blobs(tmp_path: Path) -> None:
    from p2pswarm.models import write_builtin_checkpoint
    from p2pswarm.models.checkpoint import Checkpoint

    repo = tmp_path / "models--org--tiny"
    snapshot = write_builtin_checkpoint("tiny-llama", repo / "snapshots" / "abc123")
    (repo / "blobs").mkdir()
    (snapshot / "model.safetensors").rename(repo / "blobs" / "f00d")
    (snapshot / "model.safetensors").symlink_to(Path("../../blobs/f00d"))
    assert Checkpoint(snapshot).tensor_names()
