"""The plan page in headless Chromium (Debian's `chromium`, driven by Playwright).

The page is served by a small stand-in of the HTTP API that answers the contract from the
real planner on a fake cluster (plan, load with its 409, job plan and submit), and records
what the page sent. Screenshots go to tests/artifacts/. Waiting is always on a condition
(Playwright's expect / wait_for_function), never a fixed sleep.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Page, expect

from p2pswarm.models.files import read_model_config
from p2pswarm.planner import (
    BUILTIN_MODELS,
    REFERENCE_CONFIGS,
    cluster_from_dict,
    diff_plans,
    plan_message,
    profile_from_config,
)
from tests.chromium import browser_fixture, open_page, shot  # noqa: F401 (a fixture)

STATIC = Path(__file__).resolve().parents[1] / "p2pswarm" / "http" / "static"
GB = 10**9
MODEL = "llama-3.1-8b"
TIMEOUT_MS = 15_000


def fellows(n: int) -> list[dict[str, Any]]:
    """deskpc, fxserver (Xorg holds some of its card), laptop, then more of the same."""
    out = [
        {"id": "3f9a1c0d", "name": "deskpc", "cards": [
            {"index": 0, "kind": "cuda", "name": "RTX 3060", "total_bytes": 12 * GB,
             "free_bytes": 11 * GB},
            {"index": 0, "kind": "cpu", "name": "Ryzen 5", "total_bytes": 32 * GB,
             "free_bytes": 9 * GB}]},
        {"id": "7b21e4aa", "name": "fxserver", "cards": [
            {"index": 0, "kind": "cuda", "name": "GTX 1050 Ti", "total_bytes": 4_294_967_296,
             "free_bytes": 3_500_000_000,
             "held_by_others": [{"pid": 1312, "name": "/usr/lib/xorg/Xorg", "bytes": 700_000_000}]},
            {"index": 1, "kind": "cuda", "name": "RTX 2060", "total_bytes": 6 * GB,
             "free_bytes": 6 * GB}]},
        {"id": "c40e99b2", "name": "laptop", "cards": [
            {"index": 0, "kind": "cuda", "name": "RTX 3050 Laptop", "total_bytes": 4 * GB,
             "free_bytes": 3 * GB},
            {"index": 0, "kind": "cpu", "name": "Core i7", "total_bytes": 16 * GB,
             "free_bytes": 6 * GB}]},
    ]
    for i in range(3, n):
        out.append({"id": f"{i:04x}beef", "name": f"pc-{i:02d}", "cards": [
            {"index": 0, "kind": "cuda", "name": "RTX 3060", "total_bytes": 12 * GB,
             "free_bytes": (6 + i % 5) * GB}]})
    return out[:n]


# --- the stand-in API ------------------------------------------------------------------------


def error(code: str, message: str, status: int, **extra: Any) -> tuple[int, dict[str, Any]]:
    return status, {"error": {"code": code, "message": message, **extra}}


@dataclass
class StandIn:
    cluster: list[dict[str, Any]]
    requests: list[tuple[str, str, Any]] = field(default_factory=list)
    shown: dict[str, dict[str, Any]] = field(default_factory=dict)

    def view(self) -> Any:
        return cluster_from_dict({"fellows": self.cluster})

    def serve_message(self, body: dict[str, Any]) -> dict[str, Any]:
        name, config = read_model_config(body["model"])
        return {"model": {"name": name, "config": config}, "kind": "serve",
                "context": body.get("context"), "stages": body.get("stages"),
                "kv_dtype": body.get("kv_dtype") or "f16", "maximize": body.get("maximize"),
                "weights_dtype": body.get("weights_dtype"),
                "exclude": body.get("exclude_cards") or [], "sequences": 1}

    def job_message(self, body: dict[str, Any]) -> dict[str, Any]:
        from p2pswarm.training.job import JobConfig

        job = JobConfig.from_dict(body["config"])
        name, config = read_model_config(str(job.model.name))
        return {"model": {"name": name, "config": config}, **job.plan_request(),
                "maximize": body.get("maximize"), "exclude": body.get("exclude_cards") or []}

    def plan(self, message: dict[str, Any]) -> dict[str, Any]:
        plan = plan_message(message, self.view())
        self.shown[plan["plan_id"]] = plan
        return plan

    def pinned(self, message: dict[str, Any], plan_id: str | None
               ) -> tuple[int, dict[str, Any]] | dict[str, Any]:
        plan = self.plan(message)
        if plan_id and plan_id != plan["plan_id"]:
            old = self.shown.get(plan_id)
            changed = list(diff_plans(old, plan)) if old else ["the plan is not one shown"]
            return error("plan-changed", f"plan {plan_id} no longer holds", 409,
                         expected_plan_id=plan_id, new_plan_id=plan["plan_id"],
                         changed=changed, plan=plan)
        return plan

    def answer(self, method: str, path: str, body: Any) -> tuple[int, Any]:
        self.requests.append((method, path, body))
        try:
            if (method, path) == ("GET", "/api/models"):
                models = [{"name": n, "weights": n in BUILTIN_MODELS,
                           "layers": profile_from_config(c, n).n_layers,
                           "params": profile_from_config(c, n).total_params(),
                           "max_context": profile_from_config(c, n).max_context}
                          for n, c in {**BUILTIN_MODELS, **REFERENCE_CONFIGS}.items()]
                return 200, {"models": models}
            if (method, path) == ("GET", "/api/status"):
                return 200, {"self": {"name": "deskpc"}, "members": self.cluster,
                             "leader": {"name": "deskpc"}}
            if (method, path) == ("GET", "/api/models/loads"):
                return 200, {"loads": []}
            if (method, path) == ("POST", "/api/models/plan"):
                return 200, self.plan(self.serve_message(body))
            if (method, path) == ("POST", "/api/jobs/plan"):
                return 200, self.plan(self.job_message(body))
            if (method, path) == ("POST", "/api/models/load"):
                out = self.pinned(self.serve_message(body), body.get("plan_id"))
                if isinstance(out, tuple):
                    return out
                if not out["fits"]:
                    return error("refused", out["layout"]["limit"]["sentence"], 422)
                return 200, {"plan_id": out["plan_id"], "model": out["model"],
                             "stages": out["stages"]}
            if (method, path) == ("POST", "/api/jobs"):
                out = self.pinned(self.job_message(body), body.get("plan_id"))
                if isinstance(out, tuple):
                    return out
                return 200, {"job_id": "job-1", "plan_id": out["plan_id"], "state": "starting"}
        except Exception as exc:  # the real API's 400: the planner's sentence
            return error("bad-request", str(exc), 400)
        return error("not-found", f"nothing at {path}", 404)


def serve(stand_in: StandIn) -> ThreadingHTTPServer:
    pages = {"/": "index.html", "/plan": "plan.html"}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def send(self, status: int, data: bytes, kind: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            path = self.path.split("?")[0]
            name = pages.get(path) or (path[len("/static/"):] if path.startswith("/static/")
                                       else None)
            if name is not None and (STATIC / name).is_file():
                kinds = {".html": "text/html", ".js": "application/javascript",
                         ".css": "text/css"}
                self.send(200, (STATIC / name).read_bytes(),
                          kinds[Path(name).suffix] + "; charset=utf-8")
                return
            self.reply("GET", path, None)

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            self.reply("POST", self.path, json.loads(self.rfile.read(length) or b"null"))

        def reply(self, method: str, path: str, body: Any) -> None:
            status, data = stand_in.answer(method, path, body)
            self.send(status, json.dumps(data).encode(), "application/json")

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


# --- fixtures ----------------------------------------------------------------------------------


@pytest.fixture
def site() -> Iterator[tuple[StandIn, str]]:
    stand_in = StandIn(fellows(3))
    server = serve(stand_in)
    yield stand_in, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture
def page(browser: Any) -> Iterator[Page]:
    yield from open_page(browser, 1280, 900, TIMEOUT_MS)


def expect_plan(page: Page, plan_id: str) -> None:
    expect(page.locator("#submit")).to_have_attribute("data-plan-id", plan_id)


def last_body(stand_in: StandIn, path: str) -> Any:
    return next(b for m, p, b in reversed(stand_in.requests) if p == path)


def check_bar_widths(page: Page, plan: dict[str, Any]) -> None:
    """Every segment is as wide as its bytes, on the scale of its own card's bar."""
    bars = page.evaluate("""() => [...document.querySelectorAll('#chart .card')].map(c => {
        const mem = c.querySelector('.mem').getBoundingClientRect();
        return {card: c.dataset.card, mem: mem.width,
                segs: [...c.querySelectorAll('.seg')].map(s => ({
                    name: s.dataset.segment, width: s.getBoundingClientRect().width,
                    left: s.getBoundingClientRect().left - mem.left}))};
    })""")
    cards = plan["cards"]
    assert [b["card"] for b in bars] == [
        f"{c['fellow_id']}:{'cpu' if c['kind'] == 'cpu' else c['index']}" for c in cards]
    for bar, card in zip(bars, cards):
        total = card["total_bytes"]
        want = {k: v for k, v in card["segments"].items() if v > 0}
        assert [s["name"] for s in bar["segs"]] == list(want), card
        at = 0.0
        for seg in bar["segs"]:
            assert abs(seg["width"] - want[seg["name"]] / total * bar["mem"]) < 1.0, (card, seg)
            if seg["name"] != "does_not_fit":
                assert abs(seg["left"] - at) < 1.0
                at += seg["width"]
            else:
                assert abs(seg["left"] - bar["mem"]) < 1.0  # past the card's end
        # the claims run past the card's end by exactly what does not fit
        over = card["segments"]["does_not_fit"]
        assert sum(v for k, v in want.items() if k != "does_not_fit") == total + over
        assert abs(at - bar["mem"] * (1 + over / total)) < 1.5


# --- tests -------------------------------------------------------------------------------------


def test_serving_plan_page(page: Page, site: tuple[StandIn, str]) -> None:
    stand_in, url = site
    page.goto(f"{url}/plan?model={MODEL}&context=8192")
    message = stand_in.serve_message({"model": MODEL, "context": 8192, "kv_dtype": "f16"})
    first = plan_message(message, stand_in.view())
    assert first["fits"] and len(first["stages"]) >= 2
    expect_plan(page, first["plan_id"])
    sentence = first["layout"]["limit"]["sentence"]
    expect(page.locator("#chart")).to_have_attribute("aria-label", sentence)
    expect(page.locator("#limit")).to_have_text(sentence)
    expect(page.locator("#strip .stage")).to_have_count(len(first["stages"]))
    # each stage names its weights dtype (auto, the default, keeps f16 where it fits)
    expect(page.locator("#strip .stage").first).to_contain_text(
        "· " + first["stages"][0]["weights_dtype"])
    expect(page.locator("#cards tbody tr").first).to_contain_text(
        first["stages"][0]["dtype_reason"])
    check_bar_widths(page, first)
    expect(page.locator("#cards tbody tr")).to_have_count(len(first["cards"]))
    shot(page, "plan-serving-1280.png")

    # untick a used card: the page asks again without it, and the table says why
    used = next(c for c in first["cards"] if c["used"])
    key = f"{used['fellow_id']}:{'cpu' if used['kind'] == 'cpu' else used['index']}"
    page.locator(f"#cards input[data-card='{key}']").uncheck()
    without = plan_message({**message, "exclude": [key]}, stand_in.view())
    expect_plan(page, without["plan_id"])
    assert last_body(stand_in, "/api/models/plan")["exclude_cards"] == [key]
    expect(page.locator(f"#cards tr[data-card='{key}'] td.reason")).to_have_text(
        "left out by you")
    check_bar_widths(page, without)
    page.locator(f"#cards input[data-card='{key}']").focus()
    page.keyboard.press("Space")  # tick it back, from the keyboard
    expect_plan(page, first["plan_id"])
    # the table was drawn anew and the box that was ticked still has the focus
    expect(page.locator(f"#cards input[data-card='{key}']")).to_be_focused()
    expect(page.locator(f"#cards input[data-card='{key}']")).to_be_checked()
    assert last_body(stand_in, "/api/models/plan")["exclude_cards"] == []

    # Maximize context: the field and the plan take the most the cards hold
    page.locator("#maximize-context").click()
    longest = plan_message({**message, "maximize": "context"}, stand_in.view())
    assert longest["request"]["context"] > 8192
    expect_plan(page, longest["plan_id"])
    expect(page.locator("#context")).to_have_value(str(longest["request"]["context"]))
    expect(page.locator("#chart")).to_have_attribute(
        "aria-label", longest["layout"]["limit"]["sentence"])

    # Load this plan sends the shown plan's id
    page.locator("#submit").click()
    expect(page.locator("#message")).to_contain_text(f"Loaded plan {longest['plan_id']}")
    body = last_body(stand_in, "/api/models/load")
    assert body["plan_id"] == longest["plan_id"] and body["maximize"] == "context"

    # a stale pin: the swarm changed under the shown plan -> the refusal and the new plan
    stand_in.cluster = [f for f in stand_in.cluster if f["name"] != used["fellow"]]
    page.locator("#submit").click()
    refusal = page.locator("#message.refused")
    expect(refusal).to_contain_text("Refused: the plan changed")
    expect(refusal).to_contain_text(longest["plan_id"])
    new = plan_message({**message, "maximize": "context"}, stand_in.view())
    assert new["plan_id"] != longest["plan_id"]
    expect_plan(page, new["plan_id"])
    for line in diff_plans(longest, new):
        expect(refusal).to_contain_text(line)
    shot(page, "plan-refused-1280.png")

    # a field changed after the plan was shown: the load goes without the pin
    page.locator("#context").fill("128")
    page.locator("#submit").click()
    expect(page.locator("#message")).to_contain_text("Loaded plan")
    body = last_body(stand_in, "/api/models/load")
    assert "plan_id" not in body and body["context"] == 128

    expect(page.locator("#context")).to_have_value("128")
    # auto (the default) would lower the weights to fit: f16 asked for does not
    page.locator("#weights_dtype").select_option("f16")
    expect_plan(page, plan_message({**message, "context": 128, "weights_dtype": "f16"},
                                   stand_in.view())["plan_id"])
    page.locator("#context").fill("4096")
    page.locator("#context").press("Enter")
    too_long = plan_message({**message, "context": 4096, "weights_dtype": "f16"},
                            stand_in.view())
    assert not too_long["fits"]
    expect_plan(page, too_long["plan_id"])
    expect(page.locator("#submit")).to_be_disabled()
    check_bar_widths(page, too_long)
    page.set_viewport_size({"width": 390, "height": 844})
    shot(page, "plan-serving-phone.png")
    width = page.evaluate("document.documentElement.scrollWidth")
    assert width <= 392, f"the page scrolls sideways on a phone ({width} px)"


def test_training_run_from_the_dialog(page: Page, site: tuple[StandIn, str]) -> None:
    stand_in, url = site
    page.goto(f"{url}/")
    expect(page.locator("#models tr[data-model='tiny-llama']")).to_be_visible()
    page.locator("#new-run").click()
    dialog = page.locator("#run-dialog")
    expect(dialog).to_be_visible()
    dialog.locator("select[name=model]").select_option("tiny-llama")
    dialog.locator("input[name=seq_len]").fill("256")
    dialog.locator("input[name=micro_batch]").fill("2")
    shot(page, "run-dialog-1280.png")
    dialog.locator("#run-plan").click()

    page.wait_for_url("**/plan?kind=train*")
    expect(page.locator("#submit")).to_have_text("Start training")
    expect(page.locator("#seq_len")).to_have_value("256")
    config = {"model": "tiny-llama", "seq_len": 256, "micro_batch": 2, "micro_batches": 1,
              "steps": 1000, "mode": "full", "optimizer": {"name": "adamw"}, "replicas": "auto"}
    planned = stand_in.plan(stand_in.job_message({"config": config}))
    expect_plan(page, planned["plan_id"])
    check_bar_widths(page, planned)

    page.locator("#maximize-seq-len").click()
    longest = stand_in.plan(stand_in.job_message({"config": config, "maximize": "seq_len"}))
    holds = longest["layout"]["limit"]["holds"]
    assert holds > 256
    expect(page.locator("#seq_len")).to_have_value(str(holds))
    final = stand_in.plan(stand_in.job_message({"config": {**config, "seq_len": holds}}))
    expect_plan(page, final["plan_id"])
    shot(page, "plan-training-1280.png")

    page.locator("#submit").click()
    expect(page.locator("#message")).to_contain_text("Training run job-1 started")
    body = last_body(stand_in, "/api/jobs")
    assert body["plan_id"] == final["plan_id"] and body["config"]["seq_len"] == holds


def test_round_trip_on_64_fellows(page: Page) -> None:
    stand_in = StandIn(fellows(64))
    server = serve(stand_in)
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        page.goto(f"{url}/plan?model=llama-3.1-70b&weights_dtype=int4&context=4096")
        expect(page.locator("#chart .card")).to_have_count(sum(len(f["cards"])
                                                               for f in stand_in.cluster))
        times = []
        for _ in range(3):
            used = page.locator("#cards tr:not(.unused) input").first
            before = page.locator("#submit").get_attribute("data-plan-id")
            t0 = time.perf_counter()
            used.click()
            page.wait_for_function(
                "id => document.querySelector('#submit').dataset.planId !== id", arg=before)
            times.append(time.perf_counter() - t0)
        shot(page, "plan-64-fellows-1280.png")
    finally:
        server.shutdown()
        server.server_close()
    best = min(times) * 1000
    print(f"plan round trip on 64 fellows: best {best:.0f} ms of "
          f"{', '.join(f'{t * 1000:.0f}' for t in times)} ms")
    assert best <= 600, f"click to redrawn bars took {best:.0f} ms (goal 300 ms)"
