"""The swarm dashboard in headless Chromium (Debian's `chromium`, driven by Playwright),
served by a real swarm on loopback (three agents with their HTTP servers).

The page shows the fellows and the leader; a load and a training job appear as they start
and the job's loss curve grows while it trains; a fellow that is killed turns dead on the
page within the membership's detection time and two seconds. Waiting is always on a
condition (Playwright's expect / wait_for_function), never a fixed sleep.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from playwright.sync_api import Page, expect

from tests.chromium import browser_fixture, open_page, shot  # noqa: F401 (a fixture)
from tests.http_swarm import LoopbackSwarm, serve_body
from tests.training_swarm import job_config

TIMEOUT_MS = 60_000
PAGE_SLACK_S = 2.0  # the page shows a death at most this long after the membership knows


@pytest.fixture
def page(browser: Any) -> Iterator[Page]:
    yield from open_page(browser, 390, 844, TIMEOUT_MS)  # a phone


def curve_points(page: Page, job_id: str) -> int:
    return int(page.locator(f".job[data-job-id='{job_id}'] svg.curve")
               .get_attribute("data-points") or 0)


def test_the_dashboard_shows_the_swarm_live_and_a_death_in_time(
        page: Page, tmp_path: Path) -> None:
    with LoopbackSwarm(tmp_path, 3) as swarm:
        client = httpx.Client(base_url=swarm.url(0), timeout=120)
        watched = swarm.agents[0]
        victim = swarm.agents[2]
        # the load and the job stay off the fellow that will be killed
        off = [f"{victim.node_id.hex()}:cpu"]

        page.goto(swarm.url(0) + "/swarm")
        tiles = page.locator(".tile")
        expect(tiles).to_have_count(3)
        for agent in swarm.agents:
            expect(page.locator(f".tile[data-fellow='{agent.name}']")).to_have_attribute(
                "data-state", "alive")
        leader = swarm.leader()
        expect(page.locator("#leader")).to_have_text(
            f"Leader {leader.name} · term {leader.leadership.term()}")
        expect(page.locator(f".tile[data-fellow='{leader.name}'] .badge.leader")).to_be_visible()

        loaded = client.post("/api/models/load", json=serve_body(exclude_cards=off))
        assert loaded.status_code == 200, loaded.text
        plan_id = loaded.json()["plan_id"]
        load = page.locator(f".load[data-plan-id='{plan_id}']")
        expect(load).to_be_visible()
        expect(load.locator(".strip .stage")).to_have_count(2)
        # generations through the page's fellow: its tokens and tokens/s go up
        made = client.post("/v1/completions", json={"model": "tiny-llama", "prompt": "hello",
                                                    "max_tokens": 12, "temperature": 0})
        assert made.status_code == 200, made.text
        expect(load.locator("[data-role=tokens]")).not_to_have_text("0")
        expect(load.locator("[data-role=tokens-per-s]")).not_to_have_text("0.0")

        job = client.post("/api/jobs", json={"config": job_config(steps=400, replicas=1),
                                             "exclude_cards": off})
        assert job.status_code == 200, job.text
        job_id = job.json()["job_id"]
        page.wait_for_function(
            "id => { const s = document.querySelector(`.job[data-job-id='${id}'] svg.curve`);"
            " return s && Number(s.dataset.points) >= 2; }", arg=job_id)
        seen = curve_points(page, job_id)
        # live: the curve grows while the job trains, with no reload
        page.wait_for_function(
            "([id, n]) => Number(document.querySelector("
            "`.job[data-job-id='${id}'] svg.curve`).dataset.points) > n", arg=[job_id, seen])
        assert page.locator(f".job[data-job-id='{job_id}'] polyline").count() == 1
        shot(page, "swarm-live.png")
        client.post(f"/api/jobs/{job_id}/cancel")  # its CPU back for the detection below

        killed_at = swarm.run_sync(trio.current_time)
        wall_killed = time.monotonic()
        swarm.run_sync(victim.stop)
        expect(page.locator(f".tile[data-fellow='{victim.name}']")).to_have_attribute(
            "data-state", "dead")
        page_s = time.monotonic() - wall_killed
        member = swarm.run_sync(lambda: watched.membership.member(victim.node_id))
        assert member is not None and member.state == "dead"
        detection_s = member.state_since_s - killed_at
        assert page_s <= detection_s + PAGE_SLACK_S, (page_s, detection_s)
        expect(page.locator("#events li[data-kind='dead']").first).to_contain_text(victim.name)
        shot(page, "swarm-dead.png")
        client.close()


def test_the_page_is_usable_from_the_keyboard_and_pauses(page: Page, tmp_path: Path) -> None:
    with LoopbackSwarm(tmp_path, 2) as swarm:
        page.goto(swarm.url(0) + "/swarm")
        expect(page.locator(".tile")).to_have_count(2)
        page.keyboard.press("Tab")  # the first stop: back to the models
        assert page.evaluate("document.activeElement.id") == "back"
        page.keyboard.press("Tab")
        assert page.evaluate("document.activeElement.id") == "pause"
        page.keyboard.press("Enter")
        expect(page.locator("#pause")).to_have_attribute("aria-pressed", "true")
        page.keyboard.press("Enter")
        expect(page.locator("#pause")).to_have_attribute("aria-pressed", "false")
        # reachable from the other pages, the token kept
        page.goto(swarm.url(0) + "/?token=abc")
        assert page.locator("#to-swarm").get_attribute("href") == "/swarm?token=abc"
        # the models page has its answer before the page closes (none cut short)
        expect(page.locator("#models tbody tr[data-model='tiny-llama']")).to_have_count(1)
