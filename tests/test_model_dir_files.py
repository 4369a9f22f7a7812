"""Every file a model directory contributes resolves inside it: a link to the fellow's
identity (or anywhere else outside) is never hashed, served, read as a tokenizer or a
config; it is refused in one line naming the file. Hub snapshots, whose files link into
their repository's blobs, keep working."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from p2pswarm.errors import ConfigError
from p2pswarm.models.model_dir import OutsideModelDir, model_file, model_file_if_any
from tests.test_models import SMALL, random_checkpoint


def secret(tmp_path: Path) -> Path:
    home = tmp_path / "home" / ".p2pswarm"
    home.mkdir(parents=True)
    path = home / "identity.json"
    path.write_text(json.dumps({"private_key": "00" * 32}))
    return path


def test_a_plain_file_inside_is_its_path(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert model_file(tmp_path, "config.json") == (tmp_path / "config.json").resolve()
    assert model_file_if_any(tmp_path, "tokenizer.json") is None


@pytest.mark.parametrize("name", ["../identity.json", "sub/config.json", ".hidden", ""])
def test_a_name_that_is_not_one_plain_file_name_is_refused(tmp_path: Path, name: str) -> None:
    with pytest.raises(OutsideModelDir):
        model_file(tmp_path, name)


def test_a_link_out_of_the_directory_is_refused_naming_the_file(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "generation_config.json").symlink_to(secret(tmp_path))
    with pytest.raises(OutsideModelDir) as caught:
        model_file_if_any(model, "generation_config.json")
    text = str(caught.value)
    assert "generation_config.json" in text and "outside its model directory" in text
    assert "\n" not in text


def test_a_link_inside_the_directory_is_fine(tmp_path: Path) -> None:
    (tmp_path / "real.json").write_text("{}")
    (tmp_path / "generation_config.json").symlink_to(tmp_path / "real.json")
    assert model_file(tmp_path, "generation_config.json") == (tmp_path / "real.json").resolve()


def test_a_hub_snapshot_links_into_its_blobs(tmp_path: Path) -> None:
    repo = tmp_path / "hub" / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (repo / "blobs" / "abc").write_text("{}")
    (snapshot / "config.json").symlink_to(Path("../../blobs/abc"))
    assert model_file(snapshot, "config.json") == (repo / "blobs" / "abc").resolve()
    (snapshot / "tokenizer.json").symlink_to(secret(tmp_path))
    with pytest.raises(OutsideModelDir):
        model_file(snapshot, "tokenizer.json")


@pytest.mark.parametrize("name", ["generation_config.json", "tokenizer.json",
                                  "tokenizer_config.json", "special_tokens_map.json"])
def test_the_manifest_refuses_a_linked_out_file_and_hashes_nothing(tmp_path: Path,
                                                                   name: str) -> None:
    from p2pswarm.agent.weights import build_manifest

    checkpoint = random_checkpoint(tmp_path, SMALL)
    assert "generation_config.json" not in [f.name for f in build_manifest(
        checkpoint.model_dir).files]
    (checkpoint.model_dir / name).symlink_to(secret(tmp_path))
    with pytest.raises(ConfigError, match=f"{name} leads outside its model directory"):
        build_manifest(checkpoint.model_dir)


def test_a_linked_out_config_or_weights_file_is_refused(tmp_path: Path) -> None:
    from p2pswarm.models.checkpoint import Checkpoint
    from p2pswarm.models.files import read_model_config

    model = random_checkpoint(tmp_path, SMALL).model_dir
    outside = tmp_path / "elsewhere.json"
    (model / "config.json").rename(outside)
    (model / "config.json").symlink_to(outside)
    with pytest.raises(OutsideModelDir, match="config.json"):
        Checkpoint(model)
    with pytest.raises(OutsideModelDir, match="config.json"):
        read_model_config(str(model))


def test_tokenizer_and_chat_template_readers_refuse_links_out(tmp_path: Path) -> None:
    from p2pswarm.models.chat_template import read_chat_template
    from p2pswarm.models.tokenizer import _special_ids, load_tokenizer

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    (model / "generation_config.json").symlink_to(secret(tmp_path))
    with pytest.raises(OutsideModelDir):
        _special_ids(model)
    (model / "tokenizer.json").symlink_to(tmp_path / "home" / ".p2pswarm" / "identity.json")
    with pytest.raises(OutsideModelDir):
        load_tokenizer(model)
    (model / "tokenizer_config.json").symlink_to(tmp_path / "home" / ".p2pswarm"
                                                 / "identity.json")
    with pytest.raises(OutsideModelDir):
        read_chat_template(model)
