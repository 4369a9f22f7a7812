"""The one place errors become text and exit codes: ``p2pswarm.cli.exits.exits_on``."""

from __future__ import annotations

import subprocess
import sys

import pytest
import typer

from p2pswarm.cli.exits import EXIT_FAILURE, EXIT_USAGE, exits_on
from p2pswarm.errors import (
    ConfigError,
    ControlError,
    PlacementError,
    PlanChanged,
    SwarmError,
    TokenError,
)


@pytest.mark.parametrize("error, code", [
    (ConfigError("bad --x"), EXIT_USAGE),
    (TokenError("not a token"), EXIT_USAGE),
    (ControlError("no agent running"), EXIT_FAILURE),
    (PlacementError("does not fit"), EXIT_FAILURE),
    (PlanChanged("a" * 16, "b" * 16, ["fellow x left"]), EXIT_FAILURE),
    (SwarmError("something"), EXIT_FAILURE),
])
def test_a_swarm_error_is_one_line_and_its_exit_code(
        error: SwarmError, code: int, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(typer.Exit) as raised, exits_on():
        raise error
    assert raised.value.exit_code == code
    out, err = capsys.readouterr()
    assert out == "" and err == f"error: {error}\n"


def test_plan_changed_keeps_its_409_words(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(typer.Exit), exits_on():
        raise PlanChanged("a" * 16, "b" * 16, [])
    assert capsys.readouterr().err.startswith("error: plan-changed (409): plan aaaa")


def test_a_fixed_code_a_prefix_and_narrowed_errors(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(typer.Exit) as raised, exits_on(EXIT_FAILURE, prefix="cannot: "):
        raise ConfigError("why")
    assert raised.value.exit_code == EXIT_FAILURE
    assert capsys.readouterr().err == "error: cannot: why\n"
    with pytest.raises(typer.Exit) as raised, exits_on(EXIT_USAGE, errors=(OSError,)):
        raise FileNotFoundError("gone")
    assert raised.value.exit_code == EXIT_USAGE
    with pytest.raises(ControlError), exits_on(errors=(ConfigError,)):
        raise ControlError("not mine to translate")
    with pytest.raises(typer.Exit) as raised, exits_on():
        raise typer.Exit(130)  # an exit a command chose passes through
    assert raised.value.exit_code == 130


def test_as_a_decorator() -> None:
    @exits_on()
    def command(n: int) -> int:
        if n < 0:
            raise ConfigError("n must be >= 0")
        return n

    assert command(3) == 3
    with pytest.raises(typer.Exit):
        command(-1)


def test_help_is_fast_it_imports_no_torch_and_no_agent() -> None:
    probe = ("import sys; sys.argv = ['p2pswarm', '--help']\n"
             "from p2pswarm.cli import main\n"
             "try:\n    main()\nexcept SystemExit:\n    pass\n"
             "sys.stderr.write(repr(sorted(m for m in ('torch', 'trio', 'p2pswarm.agent', "
             "'p2pswarm.runtime', 'p2pswarm.training') if m in sys.modules)))")
    done = subprocess.run([sys.executable, "-c", probe], check=False, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "Usage:" in done.stdout
    assert done.stderr == "[]"
