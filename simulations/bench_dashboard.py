"""The dashboard's and /metrics' figures on a real swarm on loopback.

1. Death to page: fellows are killed one at a time, followers first and then the
   leader (the page is served by a fellow that is neither); for each, the time from the
   kill to the swarm page (headless Chromium, polling /api/swarm about once a second) showing
   it dead, beside the membership's own detection time (kill to the watching agent's
   membership marking it dead). Target: page <= detection + 2 s.
2. Scrape time: GET /metrics on a 10-fellow swarm, from the leader and from a follower,
   wall time at the client (HTTP included) and the collector's own time on the agents'
   loop. Target: <= 50 ms.

    PYTHONPATH=$PWD python simulations/bench_dashboard.py [--fellows 10] [--kills 3] [--json]

Without Chromium (Debian's /usr/bin/chromium and playwright) the page is stood in for by
a client that polls /api/swarm every second as the page does, and the report says so.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import trio
from prometheus_client import generate_latest

from tests.http_swarm import LoopbackSwarm

POLL_S = 1.0  # as the page polls


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class PollingPage:
    """Stands in for the page: /api/swarm every second; when each fellow was first dead."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.dead_at: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with httpx.Client(timeout=10) as client:
            while not self._stop.is_set():
                doc = client.get(self.url + "/api/swarm").json()
                for f in doc["fellows"]:
                    if f["state"] == "dead":
                        self.dead_at.setdefault(f["name"], time.monotonic())
                self._stop.wait(POLL_S)

    def wait_dead(self, name: str, timeout_s: float = 120) -> float:
        deadline = time.monotonic() + timeout_s
        while name not in self.dead_at:
            if time.monotonic() > deadline:
                raise TimeoutError(name)
            time.sleep(0.01)
        return self.dead_at[name]

    def close(self) -> None:
        self._stop.set()


class ChromiumPage:
    def __init__(self, url: str, chromium: str) -> None:
        from playwright.sync_api import sync_playwright

        self._pw = sync_playwright().start()
        self._browser = self._pw.chromium.launch(executable_path=chromium, args=[
            "--headless", "--no-sandbox", "--disable-gpu"])
        self.page = self._browser.new_page()
        self.page.goto(url + "/swarm")
        self.page.wait_for_selector(".tile")

    def wait_dead(self, name: str, timeout_s: float = 120) -> float:
        self.page.wait_for_selector(f".tile[data-fellow='{name}'][data-state='dead']",
                                    timeout=timeout_s * 1000)
        return time.monotonic()

    def close(self) -> None:
        self._browser.close()
        self._pw.stop()


def death_to_page(fellows: int, kills: int) -> dict[str, Any]:
    chromium = next((p for p in ("/usr/bin/chromium", shutil.which("chromium") or "")
                     if p and Path(p).exists()), None)
    rows = []
    with tempfile.TemporaryDirectory() as root, LoopbackSwarm(Path(root), fellows) as swarm:
        leader = swarm.leader()
        others = [a for a in swarm.agents if a is not leader]
        watched = others[0]
        url = swarm.url(swarm.agents.index(watched))
        page: Any = ChromiumPage(url, chromium) if chromium else PollingPage(url)
        try:
            for victim in [*others[1:][-(kills - 1):], leader] if kills > 1 else [leader]:
                killed_at = swarm.run_sync(trio.current_time)
                wall = time.monotonic()
                swarm.run_sync(victim.stop)
                shown = page.wait_dead(victim.name) - wall
                member = swarm.run_sync(lambda v=victim: watched.membership.member(v.node_id))
                detection = member.state_since_s - killed_at
                rows.append({"fellow": victim.name, "was_leader": victim is leader,
                             "detection_s": round(detection, 3),
                             "page_s": round(shown, 3),
                             "page_after_detection_s": round(shown - detection, 3)})
        finally:
            page.close()
    return {"page": "chromium" if chromium else "a client polling /api/swarm every 1 s",
            "fellows": fellows, "kills": rows,
            "worst_page_after_detection_s": max(r["page_after_detection_s"] for r in rows),
            "target": "page <= detection + 2 s"}


def scrape_time(fellows: int, scrapes: int) -> dict[str, Any]:
    out: dict[str, Any] = {"fellows": fellows, "scrapes": scrapes, "target_ms": 50}
    with tempfile.TemporaryDirectory() as root, LoopbackSwarm(Path(root), fellows) as swarm:
        leader = swarm.leader()
        follower = next(a for a in swarm.agents if a is not leader)
        for role, agent in (("leader", leader), ("follower", follower)):
            url = swarm.url(swarm.agents.index(agent))
            with httpx.Client(base_url=url) as client:
                client.get("/metrics")  # warm
                wall = []
                for _ in range(scrapes):
                    began = time.perf_counter()
                    answer = client.get("/metrics")
                    wall.append((time.perf_counter() - began) * 1000)
                    assert answer.status_code == 200
            from p2pswarm.http.metrics import Metrics
            metrics = Metrics(agent, __import__("collections").Counter())

            def collect(m: Metrics = metrics) -> float:
                began = time.perf_counter()
                generate_latest(m.registry)
                return (time.perf_counter() - began) * 1000

            own = [swarm.run_sync(collect) for _ in range(scrapes)]
            out[role] = {"http_median_ms": round(statistics.median(wall), 2),
                         "http_p95_ms": round(percentile(wall, 0.95), 2),
                         "collector_median_ms": round(statistics.median(own), 2),
                         "bytes": len(answer.content)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fellows", type=int, default=10)
    parser.add_argument("--death-fellows", type=int, default=5)
    parser.add_argument("--kills", type=int, default=2)
    parser.add_argument("--scrapes", type=int, default=50)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    report = {"death_to_page": death_to_page(args.death_fellows, args.kills),
              "scrape": scrape_time(args.fellows, args.scrapes)}
    if args.json:
        print(json.dumps(report, indent=2))
        return
    death = report["death_to_page"]
    print(f"death to page ({death['page']}, {death['fellows']} fellows):")
    for row in death["kills"]:
        role = " (the leader)" if row["was_leader"] else ""
        print(f"  {row['fellow']}{role}: membership {row['detection_s']:.2f} s, page "
              f"{row['page_s']:.2f} s (+{row['page_after_detection_s']:.2f} s)")
    scrape = report["scrape"]
    print(f"/metrics on {scrape['fellows']} fellows, {scrape['scrapes']} scrapes each:")
    for role in ("leader", "follower"):
        r = scrape[role]
        print(f"  {role}: HTTP median {r['http_median_ms']} ms, p95 {r['http_p95_ms']} ms; "
              f"collector {r['collector_median_ms']} ms; {r['bytes']} bytes")


if __name__ == "__main__":
    main()
