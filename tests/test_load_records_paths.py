"""What travels of a load (orders, records, gossip) names no path on any fellow: the
source finds its own directory by the key it offered it under."""

from __future__ import annotations

import json
from pathlib import Path

from p2pswarm.agent.serving.asking import ModelIdentity
from p2pswarm.agent.serving.records import public_model
from p2pswarm.agent.weights import Manifest, ManifestFile, WeightsServer
from p2pswarm.planner import BUILTIN_MODELS


def test_a_model_identity_and_its_manifest_carry_no_path(tmp_path: Path) -> None:
    config = dict(BUILTIN_MODELS["tiny-llama"])
    files = (ManifestFile("config.json", 10, "ab" * 32),)
    manifest = Manifest("0123456789abcdef", "model", str(tmp_path / "models" / "model"),
                        config, (), files)
    doc = ModelIdentity("model", manifest, source_id="ab", source="a").to_doc()
    travelling = json.dumps([doc, public_model(dict(doc))])
    assert str(tmp_path) not in travelling and "path" not in public_model(dict(doc))
    read = Manifest.from_dict(dict(doc["manifest"]))  # type: ignore[arg-type]
    assert read.path == "" and read.key == manifest.key
    # the source reads its files from the directory it offered, by key
    server = WeightsServer()
    server.offer(manifest)
    assert server.offers[read.key].path == manifest.path
