"""`p2pswarm mcp`: the swarm's tools for agents, over MCP on stdio.

The server is a thin face on the local agent's control API, like the CLI: every tool is
one control request (the blocking client, run in a worker thread so the event loop keeps
answering), and every refusal becomes a tool error whose text says what to do, never a
crash. Plans come back as the planner writes them (``p2pswarm plan --json``): ``cards``
(every card, used or left out with its reason), ``layout.limit`` (the sentence naming what
limits the plan), ``summary`` (a paragraph to show a person) and ``plan_id``, which
``models_load`` / ``jobs_submit`` take to start exactly what was shown.

Runs on trio through anyio: ``anyio.run(server.run_stdio_async, backend="trio")``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

import anyio
import anyio.from_thread
import anyio.to_thread
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from pydantic import Field, ValidationError

from p2pswarm import __version__
from p2pswarm.control import client as control
from p2pswarm.errors import ConfigError, ControlError, PlanChanged, SwarmError

SERVER_NAME = "p2pswarm"
PLAN_TIMEOUT_S = 60.0  # a plan on a large swarm is quick; this bounds a stuck leader
LOAD_TIMEOUT_S = 600.0  # the most a load may stay silent between two progress words
STATUS_TIMEOUT_S = 15.0

INSTRUCTIONS = (
    "Tools for a p2pswarm swarm: machines pooled to serve and train models none of them "
    "holds alone. Call models_plan first and show the person its `summary` and "
    "`layout.limit.sentence`; models_load with that plan's `plan_id` then starts exactly "
    "that plan or refuses with what changed. Cards are named \"fellow_id:gpu_index\" "
    "(or \"fellow_id:cpu\") in exclude_cards."
)

Model = Annotated[str, Field(description="A built-in model name (tiny-llama, small-llama) or "
                                         "a model directory on this machine.")]
Context_ = Annotated[int | None, Field(ge=1, description="Context tokens per sequence "
                                       "(default: 4096 or the model's maximum).")]
Stages = Annotated[int | None, Field(ge=1, description="Fix the number of pipeline stages "
                                     "(default: as the fastest plan that fits needs).")]
KvDtype = Annotated[Literal["f32", "f16", "bf16", "int8"],
                    Field(description="How the KV cache is stored.")]
Sequences = Annotated[int, Field(ge=1, description="Sequences decoded together.")]
WeightsDtype = Annotated[Literal["auto", "f32", "f16", "bf16", "int8", "int4"] | None,
                         Field(description="Weights precision. Default auto: each stage "
                                           "keeps f16 where its card holds it, else int8, "
                                           "then int4; each stage's weights_dtype and "
                                           "dtype_reason say what was chosen and why.")]
Maximize = Annotated[Literal["context", "speed"] | None,
                     Field(description="context: the longest context the cards hold; "
                                       "speed: the fastest placement that fits, even for a "
                                       "model trained on a cut (the default keeps the cut, "
                                       "else is the fastest too).")]
ExcludeCards = Annotated[list[str] | None,
                         Field(description="Cards to leave out, each \"fellow_id:gpu_index\" "
                                           "or \"fellow_id:cpu\" (a fellow's name works too).")]
PlanId = Annotated[str | None, Field(description="The plan_id of a plan shown before: start "
                                     "exactly that plan, or refuse with what changed.")]
JobConfig = Annotated[dict[str, Any], Field(description="The training job, as job.json: "
                                            "{\"model\": \"tiny-llama\", \"seq_len\": 128, ...}.")]


def _explain_plan_changed(exc: PlanChanged) -> str:
    changes = "; ".join(exc.changes) if exc.changes else "the live view differs"
    text = (f"plan-changed (409): plan {exc.expected_plan_id} no longer holds; the swarm now "
            f"gives {exc.new_plan_id}. What changed: {changes}.")
    plan = exc.new_plan if isinstance(exc.new_plan, dict) else None
    if plan is not None:
        text += f" The new plan: {plan.get('summary', '')}".rstrip()
        if plan.get("fits"):
            text += (f" To start it, call again with plan_id {exc.new_plan_id} after showing "
                     f"it to the person.")
    return text


def _not_available(op: str, exc: ControlError) -> str | None:
    if str(exc).startswith(f"unknown control op {op!r}"):
        return (f"training jobs are not available from this agent: it has no {op} operation "
                f"(update p2pswarm on this fellow and restart `p2pswarm join`)")
    return None


class SwarmTools:
    """The tools, bound to the agent in ``home``."""

    def __init__(self, home: Path) -> None:
        self.home = home

    async def ask(self, request: dict[str, Any], timeout_s: float,
                  on_event: Callable[[dict[str, Any]], None] | None = None) -> Any:
        """One control request, its refusal turned into a ToolError with the fix."""
        def exchange() -> Any:
            if on_event is None:
                return control.request(self.home, request, timeout_s)
            return control.stream(self.home, request, on_event, timeout_s)

        op = str(request.get("op"))
        try:
            return await anyio.to_thread.run_sync(exchange)
        except PlanChanged as exc:
            raise ToolError(_explain_plan_changed(exc)) from None
        except ControlError as exc:
            raise ToolError(_not_available(op, exc) or str(exc)) from None
        except SwarmError as exc:
            raise ToolError(str(exc)) from None

    # --- serving ---------------------------------------------------------------------

    @staticmethod
    def serve_request(model: str, context: int | None, stages: int | None, kv_dtype: str,
                      maximize: str | None, exclude_cards: list[str] | None, sequences: int,
                      weights_dtype: str | None) -> tuple[dict[str, Any], str | None]:
        """The planner request for a model (checked here, so a typo answers at once), and
        the model's directory when it is not a built-in one."""
        from p2pswarm.models.files import model_directory, read_model_config
        from p2pswarm.planner import profile_from_config, request_from_dict

        request: dict[str, Any] = {
            "kind": "serve", "context": context, "sequences": sequences, "stages": stages,
            "kv_dtype": kv_dtype, "weights_dtype": weights_dtype, "maximize": maximize,
            "exclude": list(exclude_cards or []), "floors_bytes": {},
        }
        try:
            name, config = read_model_config(model)
            profile_from_config(config, name)
            request_from_dict(request)
        except ConfigError as exc:
            raise ToolError(str(exc)) from None
        try:
            path = model_directory(model)
        except ConfigError as exc:
            raise ToolError(str(exc)) from None
        return {"model": {"name": name, "config": config}, **request}, path

    async def models_plan(self, model: Model, context: Context_ = None, stages: Stages = None,
                          kv_dtype: KvDtype = "f16", maximize: Maximize = None,
                          exclude_cards: ExcludeCards = None, sequences: Sequences = 1,
                          weights_dtype: WeightsDtype = None) -> dict[str, Any]:
        """Plan serving MODEL on the swarm, load nothing. Answers the plan: `cards` (every
        card in pipeline order, used or left out with its reason, and its memory segments),
        `layout.limit.sentence` (what limits the plan), `summary` (show it to the person),
        `fits`, and `plan_id` to pass to models_load."""
        message, _ = self.serve_request(model, context, stages, kv_dtype, maximize,
                                        exclude_cards, sequences, weights_dtype)
        plan: dict[str, Any] = await self.ask({"op": "plan", "request": message},
                                              PLAN_TIMEOUT_S)
        return plan

    async def models_load(self, model: Model, ctx: Context, plan_id: PlanId = None,
                          context: Context_ = None, stages: Stages = None,
                          kv_dtype: KvDtype = "f16", maximize: Maximize = None,
                          exclude_cards: ExcludeCards = None, sequences: Sequences = 1,
                          weights_dtype: WeightsDtype = None) -> dict[str, Any]:
        """Load MODEL across the swarm, all or nothing. Give the same fields as the
        models_plan call and its plan_id: the load starts exactly that plan, or is refused
        (plan-changed) with what changed and the new plan. Answers the load record: its
        plan_id and where each stage runs."""
        message, path = self.serve_request(model, context, stages, kv_dtype, maximize,
                                           exclude_cards, sequences, weights_dtype)
        done: dict[tuple[int, str], tuple[int, int]] = {}

        def on_event(event: dict[str, Any]) -> None:
            p = event.get("progress")
            if not isinstance(p, dict):
                return
            done[(int(p.get("stage", 0)), str(p.get("fellow", "?")))] = (
                int(p.get("done_bytes", 0)), int(p.get("total_bytes", 0)))
            have = sum(d for d, _ in done.values())
            total = sum(t for _, t in done.values())
            words = f"stage {p.get('stage', 0)} on {p.get('fellow', '?')}: {p.get('phase')}"
            try:
                anyio.from_thread.run(ctx.report_progress, float(have), float(total or 0) or None,
                                      words)
            except Exception:  # a client gone mid-load must not abort the load
                pass

        record: dict[str, Any] = await self.ask(
            {"op": "load", "request": message, "plan_id": plan_id or None, "path": path},
            LOAD_TIMEOUT_S, on_event)
        return record

    async def models_loads(self) -> dict[str, Any]:
        """What is loaded in the swarm: each load's plan_id, model and stages."""
        result: dict[str, Any] = await self.ask({"op": "loads"}, STATUS_TIMEOUT_S)
        return result

    async def models_unload(self, plan_id: Annotated[str | None, Field(
            description="The load to drop (default: the only one).")] = None,
            all: Annotated[bool, Field(description="Unload everything.")] = False
            ) -> dict[str, Any]:
        """Free the stages of a load on every fellow."""
        result: dict[str, Any] = await self.ask(
            {"op": "unload", "plan_id": plan_id or None, "all": bool(all)}, PLAN_TIMEOUT_S)
        return result

    # --- training --------------------------------------------------------------------

    @staticmethod
    def check_job(config: dict[str, Any]) -> None:
        from p2pswarm.training.job import JobConfig as Job

        try:
            Job.from_dict(config)
        except ConfigError as exc:
            raise ToolError(f"job config: {exc}") from None

    async def jobs_plan(self, config: JobConfig, exclude_cards: ExcludeCards = None,
                        maximize: Annotated[Literal["seq_len"] | None, Field(
                            description="seq_len: the longest sequence the cards train.")
                        ] = None) -> dict[str, Any]:
        """Plan a training job (job.json as an object) on the swarm, start nothing. Answers
        the plan like models_plan; with maximize "seq_len" the plan's
        `layout.limit.holds` is the longest sequence length that fits."""
        self.check_job(config)
        result: dict[str, Any] = await self.ask(
            {"op": "job_plan", "config": config, "exclude_cards": list(exclude_cards or []),
             "maximize": maximize}, PLAN_TIMEOUT_S)
        return result

    async def jobs_submit(self, config: JobConfig, plan_id: PlanId = None,
                          exclude_cards: ExcludeCards = None,
                          maximize: Annotated[Literal["seq_len"] | None, Field(
                              description="\"seq_len\": train at the longest sequence "
                                          "length that fits now.")] = None) -> dict[str, Any]:
        """Start a training job; with the plan_id of a jobs_plan answer it starts exactly
        there or is refused (plan-changed) with what changed and the new plan. The job may
        carry exclude_cards, maximize and plan_id itself; those given here win."""
        self.check_job(config)
        result: dict[str, Any] = await self.ask(
            {"op": "job_submit", "config": config, "plan_id": plan_id or None,
             "exclude_cards": list(exclude_cards or []), "maximize": maximize},
            LOAD_TIMEOUT_S)
        return result

    async def jobs_list(self) -> dict[str, Any]:
        """The swarm's training jobs and how far each has come."""
        result = await self.ask({"op": "jobs"}, STATUS_TIMEOUT_S)
        return result if isinstance(result, dict) else {"jobs": result}

    async def jobs_cancel(self, job_id: Annotated[str, Field(
            description="The job to stop, as jobs_list names it.")]) -> dict[str, Any]:
        """Stop a training job on every fellow (its last checkpoint stays)."""
        result: dict[str, Any] = await self.ask({"op": "job_cancel", "job_id": job_id},
                                                PLAN_TIMEOUT_S)
        return result

    # --- the swarm -------------------------------------------------------------------

    async def swarm_status(self) -> dict[str, Any]:
        """This fellow, the fellows it knows with their cards, the leader and counters."""
        result: dict[str, Any] = await self.ask({"op": "status"}, STATUS_TIMEOUT_S)
        return result


class SwarmServer(MCPServer[Any]):
    """MCPServer whose argument errors read as one line: which argument, what it takes."""

    async def call_tool(self, name: str, arguments: dict[str, Any],
                        context: Any = None) -> Any:
        try:
            return await super().call_tool(name, arguments, context)
        except ToolError as exc:
            cause = exc.__cause__
            if not isinstance(cause, ValidationError):
                raise
            raise ToolError(f"{name}: {_argument_errors(cause)}") from None


def _argument_errors(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "arguments"
        if err["type"] == "missing":
            parts.append(f"{where} is required")
        else:
            parts.append(f"{where}: {err['msg'][0].lower()}{err['msg'][1:]} "
                         f"(got {err.get('input')!r})")
    return "; ".join(parts)


TOOL_NAMES = ("models_plan", "models_load", "models_loads", "models_unload", "jobs_plan",
              "jobs_submit", "jobs_list", "jobs_cancel", "swarm_status")


def build_server(home: Path) -> MCPServer[Any]:
    """An MCP server whose tools talk to the agent in ``home``."""
    server = SwarmServer(SERVER_NAME, instructions=INSTRUCTIONS, version=__version__,
                         log_level="WARNING")
    tools = SwarmTools(home)
    for name in TOOL_NAMES:
        fn = getattr(tools, name)
        server.add_tool(fn, name=name, description=inspect.getdoc(fn))
    return server


def serve_stdio(home: Path) -> None:
    """Answer MCP on stdin/stdout until the client closes them."""
    server = build_server(home)
    anyio.run(server.run_stdio_async, backend="trio")
