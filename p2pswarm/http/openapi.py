"""The OpenAPI 3.1 document of the agent's HTTP API (served at ``/openapi.json``)."""

from __future__ import annotations

from typing import Any

from p2pswarm import __version__
from p2pswarm.http.problems import STATUS_CODES

_OBJECT = {"type": "object", "additionalProperties": True}


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _errors(*codes: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for code in ("bad-json", "unauthorized", "foreign-host", *codes):
        status = str(STATUS_CODES[code])
        schema = _ref("PlanChanged") if code == "plan-changed" else _ref("Error")
        if status in out:
            out[status]["description"] += f", {code}"
        else:
            out[status] = _json(schema, code)
    return out


def _op(summary: str, result: dict[str, Any], *errors: str, body: dict[str, Any] | None = None,
        op_id: str = "", tag: str = "api", stream: bool = False) -> dict[str, Any]:
    ok = _json(result, "the result")
    if stream:
        ok["content"]["text/event-stream"] = {"schema": {
            "type": "string", "description": "with \"stream\": true: `data: {chunk}` events, "
                                             "then `data: [DONE]`"}}
    if body is not None:  # a state change: the web rules of http/guard.py
        errors = (*errors, "foreign-origin", "unsupported-media-type", "too-large")
    operation: dict[str, Any] = {"summary": summary, "operationId": op_id, "tags": [tag],
                                 "responses": {"200": ok, **_errors(*errors)}}
    if body is not None:
        operation["requestBody"] = {"required": True,
                                    "content": {"application/json": {"schema": body}}}
    return operation


SERVE_REQUEST: dict[str, Any] = {
    "type": "object", "additionalProperties": False, "required": ["model"],
    "properties": {
        "model": {"type": "string", "description": "a built-in or reference model name (GET "
                  "/api/models), or a model directory on this fellow"},
        "context": {"type": ["integer", "null"], "minimum": 1,
                    "description": "context tokens per sequence"},
        "stages": {"type": ["integer", "null"], "minimum": 1},
        "kv_dtype": {"type": "string", "enum": ["f32", "f16", "bf16", "int8"]},
        "weights_dtype": {"type": ["string", "null"],
                          "enum": ["auto", "f32", "f16", "bf16", "int8", "int4", None],
                          "description": "default auto: each stage keeps f16 where its "
                                         "card holds it, else int8, then int4"},
        "sequences": {"type": "integer", "minimum": 1},
        "maximize": {"type": ["string", "null"], "enum": ["context", "speed", None]},
        "exclude_cards": {"type": "array", "items": {"type": "string"},
                          "description": "cards to leave out, \"fellow_id:gpu_index\" or "
                                         "\"fellow_id:cpu\" (a fellow's name works too)"},
        "floors": {"type": "object", "additionalProperties": {"type": "string"},
                   "description": "least free memory per card kind, e.g. {\"cuda\": \"2GB\"}"},
    },
}

LOAD_REQUEST: dict[str, Any] = {
    **SERVE_REQUEST,
    "properties": {**SERVE_REQUEST["properties"], "plan_id": {
        "type": ["string", "null"], "pattern": "^[0-9a-f]{16}$",
        "description": "load exactly this plan, or be refused with 409 plan-changed"}},
}

COMPLETION_OPTIONS: dict[str, Any] = {
    "model": {"type": "string", "description": "an id from GET /v1/models, or a plan_id"},
    "max_tokens": {"type": "integer", "minimum": 1},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2, "default": 1},
    "top_p": {"type": "number", "minimum": 0, "maximum": 1, "default": 1},
    "top_k": {"type": "integer", "minimum": 0, "default": 0},
    "seed": {"type": "integer"},
    "stop": {"oneOf": [{"type": "string"},
                       {"type": "array", "items": {"type": "string"}, "maxItems": 4}]},
    "n": {"type": "integer", "enum": [1]},
    "stream": {"type": "boolean", "default": False},
    "stream_options": {"type": "object",
                       "properties": {"include_usage": {"type": "boolean"}}},
}


def openapi_document() -> dict[str, Any]:
    api = {
        "/api/status": {"get": _op("The agent's status: this fellow, the fellows it knows, "
                                   "the leader, counters", _OBJECT, "agent-error",
                                   op_id="status")},
        "/api/models": {"get": _op("Models the planner knows by name", {
            "type": "object", "properties": {"models": {"type": "array",
                                                        "items": _ref("Model")}}},
            op_id="models")},
        "/api/models/plan": {"post": _op(
            "Plan serving a model on the swarm as it is now (the leader plans)",
            _ref("Plan"), "bad-request", "no-leader", "agent-error", body=SERVE_REQUEST,
            op_id="models_plan")},
        "/api/models/load": {"post": _op(
            "Load a model as planned, all or nothing; with plan_id exactly that plan",
            _ref("Load"), "bad-request", "plan-changed", "refused", "no-leader", "unreachable",
            "agent-error", body=LOAD_REQUEST, op_id="models_load")},
        "/api/models/unload": {"post": _op(
            "Free a load's stages on every fellow", {
                "type": "object", "properties": {"unloaded": {
                    "type": "array", "items": {"type": "string"}}}},
            "bad-request", "not-found", "no-leader", "agent-error", op_id="models_unload",
            body={"type": "object", "additionalProperties": False, "properties": {
                "plan_id": {"type": ["string", "null"]}, "all": {"type": "boolean"}}})},
        "/api/models/loads": {"get": _op("What the swarm has loaded", {
            "type": "object", "properties": {"loads": {"type": "array",
                                                       "items": _ref("Load")}}},
            "agent-error", op_id="models_loads")},
        "/api/jobs/plan": {"post": _op(
            "Plan a training job", _ref("Plan"), "bad-request", "no-leader", "not-available",
            "dir-not-allowed", op_id="jobs_plan", body={
                "type": "object", "additionalProperties": False, "required": ["config"],
                "properties": {"config": {**_OBJECT, "description": "the job's job.json"},
                               "exclude_cards": {"type": "array", "items": {"type": "string"}},
                               "maximize": {"type": ["string", "null"],
                                            "enum": ["seq_len", None]}}})},
        "/api/jobs": {
            "post": _op("Start a training job (with plan_id: exactly that plan)", _OBJECT,
                        "bad-request", "plan-changed", "refused", "no-leader", "not-available",
                        "dir-not-allowed", op_id="jobs_submit", body={
                            "type": "object", "additionalProperties": False,
                            "required": ["config"], "properties": {
                                "config": _OBJECT, "plan_id": {"type": ["string", "null"]},
                                "exclude_cards": {"type": "array",
                                                  "items": {"type": "string"}},
                                "maximize": {"type": ["string", "null"],
                                             "enum": ["seq_len", None]}}}),
            "get": _op("Training jobs", _OBJECT, "not-available", op_id="jobs_list")},
        "/api/jobs/{job_id}/cancel": {"post": {
            **_op("Stop a training job", _OBJECT, "not-found", "not-available",
                  op_id="jobs_cancel"),
            "parameters": [{"name": "job_id", "in": "path", "required": True,
                            "schema": {"type": "string"}}]}},
    }
    v1 = {
        "/v1/models": {"get": _op("Loaded models, OpenAI style", {
            "type": "object", "properties": {
                "object": {"const": "list"},
                "data": {"type": "array", "items": _ref("OpenAIModel")}}},
            op_id="v1_models", tag="openai")},
        "/v1/models/{model}": {"get": {
            **_op("One loaded model", _ref("OpenAIModel"), "not-found", op_id="v1_model",
                  tag="openai"),
            "parameters": [{"name": "model", "in": "path", "required": True,
                            "schema": {"type": "string"}}]}},
        "/v1/completions": {"post": _op(
            "Complete a prompt", _OBJECT, "bad-request", "context-length-exceeded",
            "not-found", "unreachable", op_id="v1_completions", tag="openai", stream=True,
            body={"type": "object", "required": ["model", "prompt"], "properties": {
                **COMPLETION_OPTIONS, "prompt": {"oneOf": [
                    {"type": "string"},
                    {"type": "array", "items": {"type": "integer", "minimum": 0}}]},
                "echo": {"type": "boolean"}}})},
        "/v1/chat/completions": {"post": _op(
            "Answer a conversation (the model's chat template, or \"Role: content\" lines)",
            _OBJECT, "bad-request", "context-length-exceeded", "not-found", "unreachable",
            op_id="v1_chat_completions", tag="openai", stream=True, body={
                "type": "object", "required": ["model", "messages"], "properties": {
                    **COMPLETION_OPTIONS, "max_completion_tokens": {"type": "integer"},
                    "messages": {"type": "array", "items": {
                        "type": "object", "required": ["role", "content"], "properties": {
                            "role": {"enum": ["system", "developer", "user", "assistant",
                                              "tool"]},
                            "content": {"type": ["string", "array", "null"]}}}}}})},
    }
    pages = {
        "/": {"get": {"summary": "The model list page", "operationId": "page_models",
                      "tags": ["pages"], "responses": {"200": {
                          "description": "HTML", "content": {"text/html": {}}}}}},
        "/plan": {"get": {"summary": "The plan page", "operationId": "page_plan",
                          "tags": ["pages"], "responses": {"200": {
                              "description": "HTML", "content": {"text/html": {}}}}}},
        "/swarm": {"get": {"summary": "The swarm dashboard page", "operationId": "page_swarm",
                           "tags": ["pages"], "responses": {"200": {
                               "description": "HTML", "content": {"text/html": {}}}}}},
        "/api/swarm": {"get": {"summary": "The swarm as this fellow sees it: fellows, leader, "
                                          "loads, jobs, last events (the dashboard's data)",
                               "operationId": "swarm", "tags": ["pages"],
                               "responses": {"200": _json(_OBJECT, "The swarm")}}},
        "/metrics": {"get": {"summary": "Prometheus metrics of this agent", "operationId":
                             "metrics", "tags": ["pages"], "responses": {"200": {
                                 "description": "Prometheus text format",
                                 "content": {"text/plain": {}}}}}},
        "/openapi.json": {"get": {"summary": "This document", "operationId": "openapi",
                                  "tags": ["pages"], "responses": {"200": _json(
                                      _OBJECT, "OpenAPI 3.1")}}},
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": "p2pswarm agent", "version": __version__, "description": (
            "The HTTP API of one p2pswarm agent. Every endpoint runs the agent's own control "
            "ops, as the CLI does. Errors are {\"error\": {\"code\", \"message\", ...}} with "
            "a stable code. Bound to 127.0.0.1 by default; an agent bound beyond loopback "
            "requires `Authorization: Bearer TOKEN` on every request.")},
        "servers": [{"url": "/"}],
        "paths": {**api, **v1, **pages},
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": {
                "Error": {"type": "object", "required": ["error"], "properties": {"error": {
                    "type": "object", "required": ["code", "message"], "properties": {
                        "code": {"type": "string", "enum": sorted(STATUS_CODES)},
                        "message": {"type": "string"}, "type": {"type": "string"}}}}},
                "PlanChanged": {"type": "object", "properties": {"error": {
                    "type": "object", "properties": {
                        "code": {"const": "plan-changed"}, "message": {"type": "string"},
                        "expected_plan_id": {"type": "string"},
                        "new_plan_id": {"type": "string"},
                        "changed": {"type": "array", "items": {"type": "string"}},
                        "plan": _ref("Plan")}}}},
                "Plan": {**_OBJECT, "description": "what `p2pswarm plan --json` prints: "
                         "cards with segments, stages, layout.limit, summary, plan_id",
                         "properties": {"plan_id": {"type": "string"},
                                        "fits": {"type": "boolean"},
                                        "cards": {"type": "array", "items": _OBJECT},
                                        "stages": {"type": "array", "items": _OBJECT},
                                        "layout": _OBJECT, "summary": {"type": "string"}}},
                "Load": {**_OBJECT, "properties": {
                    "plan_id": {"type": "string"}, "model": _OBJECT, "runtime": _OBJECT,
                    "stages": {"type": "array", "items": _OBJECT}}},
                "Model": {**_OBJECT, "properties": {
                    "name": {"type": "string"}, "source": {"enum": ["builtin", "reference"]},
                    "weights": {"type": "boolean"}, "layers": {"type": "integer"},
                    "max_context": {"type": "integer"}, "params": {"type": "integer"}}},
                "OpenAIModel": {"type": "object", "properties": {
                    "id": {"type": "string"}, "object": {"const": "model"},
                    "owned_by": {"type": "string"}, "plan_id": {"type": "string"},
                    "context": {"type": "integer"}, "stages": {"type": "integer"}}},
            },
        },
        "security": [{}, {"bearer": []}],
    }


__all__ = ["openapi_document"]
