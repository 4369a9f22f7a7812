"""Training: `train` (a job across the swarm, with live progress) and `jobs` (list,
cancel, export)."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Any, NoReturn, Optional

import typer

from p2pswarm.cli.app import HomeOption, JsonOption, app, print_json
from p2pswarm.cli.exits import EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_USAGE, exits_on, fail
from p2pswarm.cli.local_agent import agent_answer, stream_agent
from p2pswarm.cli.plan_changed import explain_plan_changed
from p2pswarm.cli.plan_request import ExcludeOption
from p2pswarm.errors import ConfigError, SwarmError

_TRAIN_TIMEOUT_S = 900.0  # the most `train` waits between two words from its agent
_EXPORT_TIMEOUT_S = 1800.0  # fetching a checkpoint's shards and writing the export


def _read_job(path: Path) -> dict[str, Any]:
    """job.json, checked and made canonical (paths absolute, defaults filled in)."""
    from p2pswarm.training.job import JobConfig

    with exits_on(prefix=f"{path}: ", errors=(ConfigError,)):
        return JobConfig.from_json(path).to_dict()


def _resume_config(resume: str) -> Optional[dict[str, Any]]:
    """The job a checkpoint directory was written by (None: RESUME is a job id)."""
    where = Path(resume).expanduser()
    if not where.is_dir():
        return None
    from p2pswarm.training.checkpoint import CheckpointStore

    with exits_on(EXIT_USAGE, prefix=f"cannot read the checkpoint in {where}: ",
                  errors=(ConfigError, KeyError, OSError)):
        store = CheckpointStore(where)
        step = store.latest()
        if step is None:
            fail(f"no complete checkpoint in {where}")
        job = dict(store.manifest(step)["meta"]["job"])
    job["checkpoint"] = {**job.get("checkpoint", {}), "dir": str(where.resolve())}
    return job


def _offline_plan(job: dict[str, Any], cluster: Path, stages: Optional[int],
                  exclude: list[str], maximize: Optional[str]) -> dict[str, Any]:
    """The job's fleet training plan on a cluster file, without an agent."""
    from p2pswarm.cli.plans import _read_cluster_file
    from p2pswarm.models.files import read_model_config
    from p2pswarm.planner import fleet_plan_message
    from p2pswarm.training.job import JobConfig

    view = _read_cluster_file(cluster)
    with exits_on(errors=(ConfigError,)):
        cfg = JobConfig.from_dict(job)
        if cfg.model.init_config is not None:
            model = {"name": "scratch", "config": dict(cfg.model.init_config)}
        else:
            name, config = read_model_config(str(cfg.model.name))
            model = {"name": name, "config": config}
        # a flag given wins over job.json's launch field, as the agent does it
        message = {"model": model, **cfg.fleet_request(), "stages": stages,
                   "maximize": maximize or cfg.launch.maximize,
                   "exclude": sorted(exclude or cfg.launch.exclude_cards)}
        return fleet_plan_message(message, view)


def _job_line(job: dict[str, Any]) -> str:
    loss = job.get("loss")
    text = (f"{job['job_id']} {job['state']}: step {job.get('step', 0)}/{job.get('steps', 0)}"
            + (f", loss {loss:.4f}" if isinstance(loss, (int, float)) else "")
            + f", {job.get('tokens_per_s', 0.0):,.0f} tokens/s, "
            f"{job.get('replicas', 0)} replica(s), {job.get('bytes_sent', 0) / 1e6:,.2f} MB "
            "exchanged")
    return text + (f" ({job['reason']})" if job.get("reason") else "")


def kept_elsewhere_note(job: Optional[dict[str, Any]], record: dict[str, Any]) -> str:
    """A line saying where the leader keeps the checkpoints when that is not the job's
    ``checkpoint.dir`` (the job came from a fellow that does not lead); else ""."""
    kept = record.get("checkpoint_dir")
    asked = ((job or {}).get("checkpoint") or {}).get("dir")
    if not kept or not asked or kept == asked:
        return ""
    return (f"checkpoints are kept on the leader in {kept} (a job from a fellow that does "
            f"not lead never writes to the leader's disk elsewhere); `p2pswarm jobs export "
            f"{record.get('job_id')} --out DIR` brings the latest here")


def _moved_line(job: dict[str, Any]) -> str:
    """How the job came to its leader, when a new leader took it over; else ""."""
    return f"  {job['moved']}" if job.get("moved") else ""


@app.command()
@exits_on()
def train(
    config: Optional[Path] = typer.Option(None, "--config", help="The job: job.json."),
    show_plan: bool = typer.Option(False, "--plan", help="Print the training plan and its "
                                   "plan_id; start nothing."),
    plan_id: Optional[str] = typer.Option(None, "--plan-id", help="Start exactly this plan, "
                                          "or refuse with what changed (plan-changed, 409)."),
    maximize_seq_len: bool = typer.Option(False, "--maximize-seq-len", help="Plan and train "
                                          "at the longest sequence length that fits now."),
    stages: Optional[int] = typer.Option(None, "--stages", help="Fix the stages per replica."),
    exclude: list[str] = ExcludeOption,
    resume: Optional[str] = typer.Option(None, "--resume", help="Continue job JOB (its id, "
                                         "or its checkpoint directory) from its latest "
                                         "checkpoint."),
    detach: bool = typer.Option(False, "--detach", help="Submit and return; follow with "
                                "`p2pswarm jobs`."),
    cluster: Optional[Path] = typer.Option(None, "--cluster", help="With --plan: plan "
                                           "offline against a cluster file instead of "
                                           "asking the agent."),
    home: Optional[Path] = HomeOption,
    as_json: bool = JsonOption,
) -> None:
    """Train a model across the swarm as job.json says, with live progress."""
    from rich.console import Console

    from p2pswarm.errors import PlanChanged

    if config is None and resume is None:
        fail("give the job with --config job.json (or --resume JOB)")
    job = _read_job(config) if config is not None else _resume_config(str(resume))
    if show_plan:
        if job is None:
            fail("--plan needs --config job.json")
        maximize = "seq_len" if maximize_seq_len else None
        if cluster is not None:
            result = _offline_plan(job, cluster, stages, list(exclude), maximize)
        else:
            result = agent_answer(home, {"op": "job_plan", "config": job, "stages": stages,
                                         "exclude_cards": list(exclude),
                                         "maximize": maximize},
                                  ", or plan offline with --cluster FILE")
        if as_json:
            print_json(result)
        else:
            from p2pswarm.cli.fleet_render import print_job_plan
            print_job_plan(result, Console())
            if "fleet" not in result:
                typer.echo(f"plan_id {result['plan_id']}: start it with p2pswarm train "
                           f"--config {config} --plan-id {result['plan_id']}")
        if not result.get("fits", False):
            raise typer.Exit(EXIT_FAILURE)
        return
    console = Console(stderr=as_json)
    said: dict[str, Any] = {}

    def on_event(event: dict[str, Any]) -> None:
        record = event.get("job")
        if not isinstance(record, dict):
            return
        moved = _moved_line(record)
        if moved and said.get("moved") != moved:  # the job moved to a new leader
            said["moved"] = moved
            console.print(moved, markup=False)
        if isinstance(record.get("job_id"), str):
            said["job_id"] = record["job_id"]
        kept = kept_elsewhere_note(job, record)
        if kept and said.get("kept") != kept:
            said["kept"] = kept
            console.print(kept, markup=False, soft_wrap=True)
        line = _job_line(record)
        if said.get("line") == line:
            return
        said["line"] = line
        if console.is_terminal and not as_json:
            console.print(line, end="\r", overflow="ellipsis", soft_wrap=True, markup=False)
        else:
            console.print(line, markup=False)

    message: dict[str, Any] = {"op": "job_submit", "config": job, "plan_id": plan_id,
                               "stages": stages, "resume": resume or None,
                               "maximize": "seq_len" if maximize_seq_len else None,
                               "exclude_cards": list(exclude)}
    try:
        if detach:
            record = agent_answer(home, message, "")
        else:
            record = stream_agent(home, message, on_event, _TRAIN_TIMEOUT_S)
    except PlanChanged as exc:
        explain_plan_changed(exc, f"--config {config}", as_json)
    except KeyboardInterrupt:
        _interrupted(home, said.get("job_id"), console)
    if as_json:
        print_json(record)
    else:
        console.print(_job_line(record), markup=False)
    if record.get("state") in ("failed", "cancelled"):
        raise typer.Exit(EXIT_FAILURE)


def interactive() -> bool:
    """Whether a person can answer a question here (stdin is a terminal)."""
    return sys.stdin.isatty()


def _interrupted(home: Optional[Path], job_id: Optional[str], console: Any) -> NoReturn:
    """Ctrl-C during `train`: on a terminal, ask whether to cancel the job or leave it
    running; elsewhere leave it running and say how to stop it. Exit 130 either way."""
    stop = "p2pswarm jobs cancel " + (job_id or "JOB_ID") + (
        f" --home {shlex.quote(str(home))}" if home is not None else "")
    console.print()  # past a progress line that ended in a carriage return
    if job_id is None:
        console.print("interrupted before the leader answered: the job may still start; "
                      f"`p2pswarm jobs` lists it, `{stop}` stops it", soft_wrap=True,
                      markup=False, highlight=False)
        raise typer.Exit(EXIT_INTERRUPTED)
    if interactive():
        try:
            cancel = typer.confirm(f"cancel job {job_id}? (no: it keeps running)",
                                   default=False, err=console.stderr)
        except (KeyboardInterrupt, EOFError, typer.Abort):
            cancel = False
        if cancel:
            record = agent_answer(home, {"op": "job_cancel", "job_id": job_id}, "")
            console.print(f"cancelling {record['job_id']} (was {record['state']}); its "
                          "checkpoints stay")
            raise typer.Exit(EXIT_INTERRUPTED)
    console.print(f"job {job_id} keeps running; stop it with: {stop}", soft_wrap=True,
                  markup=False, highlight=False)  # one line, as it is to be copied
    raise typer.Exit(EXIT_INTERRUPTED)


jobs_app = typer.Typer(help="Training jobs: list them, cancel one.")
app.add_typer(jobs_app, name="jobs")


@jobs_app.callback(invoke_without_command=True)
@exits_on()
def jobs(ctx: typer.Context, home: Optional[Path] = HomeOption,
         as_json: bool = JsonOption) -> None:
    """List the swarm's training jobs with their state."""
    if ctx.invoked_subcommand is not None:
        return
    records = agent_answer(home, {"op": "jobs"}, "")
    if as_json:
        print_json(records)
        return
    if not records:
        typer.echo("no jobs; start one with p2pswarm train --config job.json")
        return
    for record in records:
        typer.echo(_job_line(record))
        if _moved_line(record):
            typer.echo(_moved_line(record))


@jobs_app.command("cancel")
@exits_on()
def jobs_cancel(job_id: str = typer.Argument(..., help="The job's id (see p2pswarm jobs)."),
                home: Optional[Path] = HomeOption, as_json: bool = JsonOption) -> None:
    """Cancel a job: its stages are released; its checkpoints stay."""
    record = agent_answer(home, {"op": "job_cancel", "job_id": job_id}, "")
    if as_json:
        print_json(record)
    else:
        typer.echo(f"cancelling {record['job_id']} (was {record['state']})")


def _print_export(result: dict[str, Any]) -> None:
    where = result["path"]
    cut = result.get("cut") or []
    cut_text = f"cut at layers {cut}" if cut else "one stage, no cut"
    if result["kind"] == "adapter":
        typer.echo(f"exported the LoRA adapters of {result['job_id'] or 'the job'} (step "
                   f"{result['step']}, {cut_text}) to {where}; base: {result['base']}")
        typer.echo(f"serve them with: p2pswarm load {result['base']} --adapter {where}")
    else:
        typer.echo(f"exported {result['job_id'] or 'the job'} (step {result['step']}, "
                   f"{cut_text}) to {where}")
        typer.echo(f"serve it on the cut it trained with: p2pswarm load {where}")


@jobs_app.command("export")
@exits_on()
def jobs_export(job: str = typer.Argument(..., help="The job's id (see p2pswarm jobs), or "
                                          "its checkpoint directory."),
                out: Path = typer.Option(..., "--out", help="A new (or empty) directory to "
                                         "write into."),
                home: Optional[Path] = HomeOption, as_json: bool = JsonOption) -> None:
    """Export a job's latest checkpoint: a Hugging Face model directory recording the cut
    it trained with, or, for a LoRA job, its adapters on their own."""
    from p2pswarm.training.job_export import check_out_dir

    out_dir = check_out_dir(out)
    where = Path(job).expanduser()
    if where.is_dir():  # a checkpoint directory: exported here, no agent needed
        from p2pswarm.training.checkpoint import CheckpointStore
        from p2pswarm.training.job_export import export_checkpoint

        with exits_on(EXIT_FAILURE, prefix=f"cannot export {where}: ",
                      errors=(SwarmError, OSError)):
            result = export_checkpoint(CheckpointStore(where), out_dir).to_dict()
    else:
        result = agent_answer(home, {"op": "job_export", "job_id": job, "out": str(out_dir)},
                              ", or give the job's checkpoint directory instead of its id",
                              _EXPORT_TIMEOUT_S)
    if as_json:
        print_json(result)
    else:
        _print_export(result)
