"""The layer contracts (``[tool.importlinter]`` in pyproject.toml) hold on this tree, and
they can fail: a copy of the package with a planted import breaks them.

Each case runs ``lint-imports`` on a copy of ``p2pswarm/`` and ``pyproject.toml`` in a
temporary directory, with that copy first on ``PYTHONPATH``, so the very same contracts
judge the planted import.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` on the package under ``root``, with the contracts in its
    pyproject.toml."""
    script = Path(sys.executable).with_name("lint-imports")  # the one beside this python
    command = str(script) if script.exists() else "lint-imports"
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(
        [command, "--config", str(root / "pyproject.toml"), "--no-cache"],
        cwd=root, env=env, capture_output=True, text=True, timeout=300,
    )


def copy_of_the_package(tmp_path: Path) -> Path:
    shutil.copytree(ROOT / "p2pswarm", tmp_path / "p2pswarm",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def plant(root: Path, module: str, line: str) -> None:
    with open(root / module, "a", encoding="utf-8") as f:
        f.write(f"\n{line}\n")


def lint_planted(tmp_path: Path, module: str, line: str) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` on a copy of the package with ``line`` planted at the end of
    ``module``."""
    root = copy_of_the_package(tmp_path)
    plant(root, module, line)
    return lint_imports(root)


def test_the_tree_keeps_every_contract() -> None:
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "BROKEN" not in result.stdout
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(("module", "line", "says"), [
    ("p2pswarm/membership/timing.py", "import trio",
     "p2pswarm.membership is not allowed to import trio"),
    ("p2pswarm/planner/costs.py", "import time",
     "p2pswarm.planner is not allowed to import time"),
    ("p2pswarm/wire/base.py", "import random",
     "p2pswarm.wire is not allowed to import random"),
    # the planner's byte accounting, shared with the torch runtime, stays torch-free
    ("p2pswarm/shapes/footprint.py", "import torch",
     "p2pswarm.shapes is not allowed to import torch"),
])
def test_a_pure_core_that_imports_an_effect_breaks_a_contract(
        tmp_path: Path, module: str, line: str, says: str) -> None:
    result = lint_planted(tmp_path, module, line)
    assert result.returncode != 0
    assert "Pure cores: no trio, torch, sockets, clock or global random BROKEN" in result.stdout
    assert says in result.stdout


def test_an_upward_import_breaks_the_layers(tmp_path: Path) -> None:
    result = lint_planted(tmp_path, "p2pswarm/inventory.py", "import p2pswarm.planner")
    assert result.returncode != 0
    assert "Layers: imports point downward only (docs/architecture.md) BROKEN" in result.stdout
    assert "p2pswarm.inventory is not allowed to import p2pswarm.planner" in result.stdout
    assert "Pure cores: no trio, torch, sockets, clock or global random KEPT" in result.stdout


@pytest.mark.parametrize(("module", "line", "says"), [
    # http is the edge above the agent: the agent never imports it
    ("p2pswarm/agent/address.py", "import p2pswarm.http",
     "p2pswarm.agent is not allowed to import p2pswarm.http"),
    # the planner's shapes sit below the models they describe
    ("p2pswarm/shapes/footprint.py", "import p2pswarm.models.llama",
     "p2pswarm.shapes is not allowed to import p2pswarm.models"),
])
def test_the_agent_under_http_and_shapes_under_the_models(
        tmp_path: Path, module: str, line: str, says: str) -> None:
    result = lint_planted(tmp_path, module, line)
    assert result.returncode != 0
    assert "Layers: imports point downward only (docs/architecture.md) BROKEN" in result.stdout
    assert says in result.stdout


def test_a_random_generator_is_typed_by_the_protocol_not_the_module(tmp_path: Path) -> None:
    # TYPE_CHECKING imports count: a pure core names p2pswarm.randomness.Rng, not random
    typed = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    "
    result = lint_planted(tmp_path / "rng", "p2pswarm/planner/costs.py",
                          typed + "from p2pswarm.randomness import Rng")
    assert result.returncode == 0, result.stdout + result.stderr
    result = lint_planted(tmp_path / "random", "p2pswarm/planner/costs.py",
                          typed + "from random import Random")
    assert "p2pswarm.planner is not allowed to import random" in result.stdout


def test_a_type_only_upward_import_in_the_agent_breaks_the_layers(tmp_path: Path) -> None:
    result = lint_planted(tmp_path, "p2pswarm/agent/address.py",
                          "from typing import TYPE_CHECKING\n"
                          "if TYPE_CHECKING:\n    import p2pswarm.http")
    assert result.returncode != 0
    assert "p2pswarm.agent is not allowed to import p2pswarm.http" in result.stdout
