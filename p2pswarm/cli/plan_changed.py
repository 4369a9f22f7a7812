"""A load or job pinned to a plan that no longer holds (plan-changed, 409): what changed,
the new plan, and how to start it; exit 1."""

from __future__ import annotations

from typing import NoReturn

import typer

from p2pswarm.cli.app import print_json
from p2pswarm.cli.exits import EXIT_FAILURE
from p2pswarm.errors import PlanChanged


def explain_plan_changed(exc: PlanChanged, model: str, as_json: bool) -> NoReturn:
    if as_json:
        print_json({"error": "plan-changed", "code": 409, "expected_plan_id":
                    exc.expected_plan_id, "new_plan_id": exc.new_plan_id,
                    "changes": exc.changes, "new_plan": exc.new_plan})
        raise typer.Exit(EXIT_FAILURE)
    from rich.console import Console

    from p2pswarm.cli.render import print_plan

    typer.echo(f"plan-changed (409): plan {exc.expected_plan_id} no longer holds; the "
               f"swarm now gives {exc.new_plan_id}. What changed:", err=True)
    for line in exc.changes or ["the live view differs"]:
        typer.echo(f"  - {line}", err=True)
    if isinstance(exc.new_plan, dict):
        print_plan(exc.new_plan, Console())
        if exc.new_plan.get("fits"):
            typer.echo(f"To load the new plan: p2pswarm load {model} --plan-id "
                       f"{exc.new_plan_id} (with the same options)", err=True)
    raise typer.Exit(EXIT_FAILURE)


__all__ = ["explain_plan_changed"]
