"""`plan`/`load PATH.pth`: the RWKV authors' file, converted once under the state dir.

A small random RWKV-7 written as an authors' ``.pth`` is planned straight from its path
(the real CLI, offline on a cluster file); the conversion lands in a directory named by
the file's SHA-256, is reused on the next call, and gives the same logits as the ``.pth``
read directly. Where no state dir converts it, one line gives the conversion command; a
``.pth`` that holds pickled code is refused in one line.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from p2pswarm.cli import app
from p2pswarm.errors import ConfigError
from p2pswarm.models.files import read_model_config
from p2pswarm.models.loader import load_stage_model, open_model
from p2pswarm.models.pth_cache import PTH_DIR, file_sha256, offered_model
from p2pswarm.models.rwkv7_pth import save_pth
from tests.test_rwkv7 import CONFIG, random_tensors

runner = CliRunner()


def write_pth(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    return save_pth(random_tensors(CONFIG, seed=7), True, path)


def test_plan_takes_a_pth_and_converts_it_once(tmp_path: Path) -> None:
    pth = write_pth(tmp_path / "downloads" / "rwkv7-tiny.pth")
    home = tmp_path / "home"
    cluster = tmp_path / "cluster.json"
    cluster.write_text(json.dumps({"fellows": [{"id": "a", "cards": [
        {"kind": "cpu", "total_bytes": "16GB"}]}]}))
    result = runner.invoke(app, ["plan", str(pth), "--cluster", str(cluster), "--json"],
                           env={"P2PSWARM_HOME": str(home), "P2PSWARM_TOKEN": ""})
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    assert plan["model"]["name"] == "rwkv7-tiny" and plan["model"]["recurrent"] is True
    converted = home / PTH_DIR / file_sha256(pth)[:16] / "rwkv7-tiny"
    assert (converted / "config.json").is_file()
    stamp = (converted / "config.json").stat().st_mtime_ns
    assert offered_model(str(pth), home / PTH_DIR) == str(converted)  # reused, not redone
    assert (converted / "config.json").stat().st_mtime_ns == stamp
    assert not [p for p in (home / PTH_DIR).rglob(".converting-*")]
    ids = torch.tensor([[3, 5, 7, 11, 13]])
    direct = load_stage_model(open_model(pth), 0, CONFIG.num_layers, dtype="float32")
    offered = load_stage_model(open_model(converted), 0, CONFIG.num_layers, dtype="float32")
    with torch.no_grad():
        assert torch.equal(direct(ids), offered(ids))
    # another file: another directory
    other = write_pth(tmp_path / "other" / "rwkv7-tiny.pth")
    with other.open("ab") as f:
        f.write(b"\0")  # the same tensors, other bytes: torch.load ignores the tail
    assert offered_model(str(other), home / PTH_DIR) != str(converted)


def test_a_pth_without_a_state_dir_or_with_code_gets_one_line(tmp_path: Path) -> None:
    pth = write_pth(tmp_path / "m" / "rwkv7.pth")
    with pytest.raises(ConfigError, match=r"python -m p2pswarm.models.rwkv7_pth IN.pth "
                                          r"OUT_DIR") as refused:
        read_model_config(str(pth))
    assert "\n" not in str(refused.value)

    class Code:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (os.system, ("true",))

    hostile = tmp_path / "bad" / "rwkv7.pth"
    hostile.parent.mkdir()
    torch.save({"emb.weight": torch.zeros(2, 2), "x": Code()}, hostile, pickle_module=pickle)
    result = runner.invoke(app, ["plan", str(hostile), "--cluster", str(tmp_path / "none")],
                           env={"P2PSWARM_HOME": str(tmp_path / "home"), "P2PSWARM_TOKEN": ""})
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert lines[0].startswith("error: cannot read") and "Traceback" not in result.output
    assert not list((tmp_path / "home" / PTH_DIR).rglob("config.json"))
