"""The JSON API under ``/api``: the CLI's commands as HTTP endpoints.

Each handler checks the body, builds the same request the CLI builds, and runs the
agent's own control op in-process; what the op raises becomes an error document
(``p2pswarm.http.problems``). A body with a field the endpoint does not take is refused
(400 ``bad-request``) rather than half understood, and nothing is changed by a request
that is refused.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from p2pswarm.http.app import Call, Route
from p2pswarm.http.guard import job_paths_allowed
from p2pswarm.http.problems import HttpError

if TYPE_CHECKING:
    from p2pswarm.agent.agent import Agent

SERVE_FIELDS = ("model", "context", "stages", "kv_dtype", "weights_dtype", "sequences",
                "maximize", "exclude_cards", "floors")
LOAD_FIELDS = (*SERVE_FIELDS, "plan_id")
UNLOAD_FIELDS = ("plan_id", "all")
JOB_PLAN_FIELDS = ("config", "exclude_cards", "maximize")
JOB_SUBMIT_FIELDS = ("config", "plan_id", "exclude_cards", "maximize")
PLAN_ID = re.compile(r"^[0-9a-f]{16}$")


def check_fields(body: Mapping[str, Any], allowed: tuple[str, ...]) -> None:
    unknown = sorted(set(body) - set(allowed))
    if unknown:
        raise HttpError("bad-request", f"unknown field{'s' if len(unknown) > 1 else ''} "
                                       f"{', '.join(unknown)}: this endpoint takes "
                                       f"{', '.join(allowed)}")


def plan_id_field(body: Mapping[str, Any]) -> str | None:
    value = body.get("plan_id")
    if value is None or value == "":
        return None
    if not isinstance(value, str) or not PLAN_ID.match(value):
        raise HttpError("bad-request", f"plan_id must be the 16 hex characters a plan "
                                       f"names, got {value!r}")
    return value


def exclude_field(body: Mapping[str, Any]) -> list[str]:
    value = body.get("exclude_cards") or []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise HttpError("bad-request", "exclude_cards must be a list of \"fellow_id:gpu_index\""
                                       " strings, e.g. [\"3fa2c1d0e9b8:0\", \"3fa2c1d0e9b8:cpu\"]")
    return value


def serve_message(body: Mapping[str, Any]) -> tuple[dict[str, Any], str | None]:
    """The plan request a serving plan or load sends (as ``p2pswarm plan`` builds it),
    and the model's directory on this fellow when the model is not a built-in."""
    from p2pswarm.models.files import model_directory, read_model_config
    from p2pswarm.planner import profile_from_config, request_from_dict

    model = body.get("model")
    if not isinstance(model, str) or not model.strip():
        raise HttpError("bad-request", "\"model\" must name a model: a built-in (GET "
                                       "/api/models lists them) or a model directory on "
                                       "this fellow")
    floors = body.get("floors") or {}
    if not isinstance(floors, dict):
        raise HttpError("bad-request", "floors must map a card kind to a size, e.g. "
                                       "{\"cuda\": \"2GB\"}")
    request: dict[str, Any] = {
        "kind": "serve", "stages": body.get("stages"), "kv_dtype": body.get("kv_dtype") or "f16",
        "weights_dtype": body.get("weights_dtype"), "maximize": body.get("maximize"),
        "exclude": exclude_field(body), "floors_bytes": floors,
        "context": body.get("context"), "sequences": body.get("sequences", 1),
    }
    name, config = read_model_config(model)  # ConfigError: 400 with the fix
    profile_from_config(config, name)
    request_from_dict(request)
    path = model_directory(model)
    return {"model": {"name": name, "config": config}, **request}, path


def model_summaries() -> list[dict[str, Any]]:
    """Every model the planner knows by name: the built-ins (weights drawn by
    p2pswarm), the models shipped in the package (``demo-llama``) and reference shapes
    (plan on paper; load needs the model's directory)."""
    from p2pswarm.models.files import SHIPPED_MODELS, read_model_config
    from p2pswarm.planner import BUILTIN_MODELS, profile_from_config
    from p2pswarm.planner.profile import REFERENCE_CONFIGS

    shipped = {name: read_model_config(name)[1] for name in SHIPPED_MODELS}
    out = []
    for source, configs in (("builtin", BUILTIN_MODELS), ("shipped", shipped),
                            ("reference", REFERENCE_CONFIGS)):
        for name in configs:
            profile = profile_from_config(configs[name], name)
            out.append({
                "name": name, "source": source, "weights": source != "reference",
                "model_type": profile.model_type, "layers": profile.n_layers,
                "hidden": profile.hidden, "heads": profile.n_heads,
                "kv_heads": profile.n_kv_heads, "vocab": profile.vocab,
                "max_context": profile.max_context, "params": profile.total_params(),
                "profile": profile.to_dict()})
    return out


class Api:
    def __init__(self, agent: Agent, allow_dirs: tuple[Path, ...] = ()) -> None:
        self.agent = agent
        self.allow_dirs = allow_dirs  # where a job sent here may name files

    async def op(self, name: str, request: dict[str, Any]) -> Any:
        """Run control op ``name`` in-process, as the CLI's request would."""
        handler = self.agent.control_ops.get(name)
        if handler is None:
            raise HttpError("not-available", f"this agent has no {name} op yet")
        return await handler({"op": name, **request})

    async def status(self, call: Call) -> None:
        await call.respond_json(await self.op("status", {}))

    async def models(self, call: Call) -> None:
        await call.respond_json({"models": model_summaries()})

    async def plan(self, call: Call) -> None:
        body = await call.json()
        check_fields(body, SERVE_FIELDS)
        message, _ = serve_message(body)
        await call.respond_json(await self.op("plan", {"request": message}))

    async def load(self, call: Call) -> None:
        from p2pswarm.models.files import weights_directory

        body = await call.json()
        check_fields(body, LOAD_FIELDS)
        plan_id = plan_id_field(body)
        message, path = serve_message(body)
        weights_directory(str(body["model"]))  # a shape-only name: 400, saying what to give
        await call.respond_json(await self.op("load", {"request": message, "plan_id": plan_id,
                                                       "path": path}))

    async def unload(self, call: Call) -> None:
        body = await call.json()
        check_fields(body, UNLOAD_FIELDS)
        plan_id = plan_id_field(body)
        everything = body.get("all", False)
        if not isinstance(everything, bool):
            raise HttpError("bad-request", "\"all\" must be true or false")
        if plan_id and everything:
            raise HttpError("bad-request", "give plan_id or all: true, not both")
        await call.respond_json(await self.op("unload", {"plan_id": plan_id,
                                                         "all": everything}))

    async def loads(self, call: Call) -> None:
        await call.respond_json(await self.op("loads", {}))

    async def job_plan(self, call: Call) -> None:
        body = await call.json()
        check_fields(body, JOB_PLAN_FIELDS)
        config = _job_config(body)
        job_paths_allowed(config, self.allow_dirs)
        maximize = body.get("maximize")
        if maximize not in (None, "seq_len"):
            raise HttpError("bad-request", f"maximize {maximize!r}: a training plan "
                                           "maximizes \"seq_len\" or nothing")
        await call.respond_json(await self.op("job_plan", {
            "config": config, "exclude_cards": exclude_field(body), "maximize": maximize}))

    async def job_submit(self, call: Call) -> None:
        body = await call.json()
        check_fields(body, JOB_SUBMIT_FIELDS)
        config = _job_config(body)
        job_paths_allowed(config, self.allow_dirs)
        maximize = body.get("maximize")
        if maximize not in (None, "seq_len"):
            raise HttpError("bad-request", f"maximize {maximize!r}: a training job "
                                           "maximizes \"seq_len\" or nothing")
        await call.respond_json(await self.op("job_submit", {
            "config": config, "plan_id": plan_id_field(body),
            "exclude_cards": exclude_field(body), "maximize": maximize}))

    async def jobs(self, call: Call) -> None:
        await call.respond_json(await self.op("jobs", {}))

    async def job_cancel(self, call: Call, job_id: str) -> None:
        await call.respond_json(await self.op("job_cancel", {"job_id": job_id}))


def _job_config(body: Mapping[str, Any]) -> dict[str, Any]:
    config = body.get("config")
    if not isinstance(config, dict):
        raise HttpError("bad-request", "\"config\" must be the job's settings, a JSON object "
                                       "as in job.json")
    return config


def api_routes(agent: Agent, allow_dirs: tuple[Path, ...] = ()) -> list[Route]:
    api = Api(agent, allow_dirs)
    return [
        Route("GET", "/api/status", api.status),
        Route("GET", "/api/models", api.models),
        Route("POST", "/api/models/plan", api.plan),
        Route("POST", "/api/models/load", api.load),
        Route("POST", "/api/models/unload", api.unload),
        Route("GET", "/api/models/loads", api.loads),
        Route("POST", "/api/jobs/plan", api.job_plan),
        Route("POST", "/api/jobs", api.job_submit),
        Route("GET", "/api/jobs", api.jobs),
        Route("POST", "/api/jobs/{job_id}/cancel", api.job_cancel),
    ]


__all__ = ["Api", "api_routes", "model_summaries", "serve_message"]
