"""`p2pswarm demo`: a temporary swarm of fellows on loopback serves (and with --train first
trains) a model none of them could hold alone, then cleans up."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

import typer

from p2pswarm.cli.app import JsonOption, app, print_json, printable
from p2pswarm.cli.exits import EXIT_FAILURE, exits_on, fail
from p2pswarm.cli.swarm import render_status


@app.command()
@exits_on()
def demo(
    fellows: int = typer.Option(3, "--fellows", min=2, max=16, help="How many fellows to start."),
    keep: bool = typer.Option(False, "--keep", help="Keep the temporary state and logs."),
    train: bool = typer.Option(False, "--train", help="Train a small model across the "
                               "fellows on the shipped corpus, then serve it."),
    steps: Optional[int] = typer.Option(None, "--steps", min=1, help="With --train: "
                                        "optimizer steps (default 300, about a minute)."),
    out: Optional[Path] = typer.Option(None, "--out", help="With --train: also keep the "
                                       "trained model in this new directory."),
    as_json: bool = JsonOption,
) -> None:
    """Serve a model no fellow could hold alone: a temporary swarm of fellows as separate
    processes on loopback loads it across all of them and generates; then it cleans up.
    With --train the swarm first trains the model it then serves."""
    from p2pswarm.demo import DEMO_TRAIN_STEPS, run_demo, run_train_demo

    say = (lambda text: typer.echo(text, err=True)) if as_json else typer.echo

    def render_plan(plan: dict[str, Any]) -> None:
        from rich.console import Console

        from p2pswarm.cli.render import print_plan
        print_plan(plan, Console())

    def write(text: str) -> None:
        sys.stdout.write(printable(text))
        sys.stdout.flush()

    if steps is not None and not train:
        fail("--steps goes with --train")
    if out is not None and not train:
        fail("--out goes with --train")
    terminal = not as_json and sys.stdout.isatty()

    def live(line: str) -> None:  # rewrite the progress line in place; "" ends it
        sys.stdout.write("\r\033[K" + line if line else "\n")
        sys.stdout.flush()

    with exits_on(EXIT_FAILURE):
        if train:
            result = run_train_demo(say, (lambda data: None) if as_json else render_status,
                                    None if as_json else render_plan,
                                    None if as_json else write, live if terminal else None,
                                    fellows=fellows, keep=keep,
                                    steps=steps or DEMO_TRAIN_STEPS, out=out)
        else:
            result = run_demo(say, (lambda data: None) if as_json else render_status,
                              None if as_json else render_plan, None if as_json else write,
                              fellows=fellows, keep=keep)
    if as_json:
        print_json(result)
