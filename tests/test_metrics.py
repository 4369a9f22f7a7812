"""``/metrics`` and ``/api/swarm`` on a real swarm on loopback: the text parses with
prometheus_client's own parser, carries every family the dashboard's operators watch,
counts a refusal when one happens, and sits behind the --http-token guard."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from p2pswarm.agent.event_ring import EVENTS_KEPT, EventRing
from p2pswarm.http.app import HttpSettings
from p2pswarm.http.metrics import Metrics
from p2pswarm.http.swarm_view import Rates, job_rows, replica_rates
from p2pswarm.membership.round_trips import ProbeRoundTrips
from tests.http_swarm import LoopbackSwarm, serve_body

FAMILIES = {
    # membership
    "p2pswarm_members", "p2pswarm_membership_suspicions", "p2pswarm_membership_refutations",
    "p2pswarm_membership_probe_rtt_seconds",
    # election
    "p2pswarm_election_term", "p2pswarm_election_leader_changes",
    # transport
    "p2pswarm_transport_bytes", "p2pswarm_transport_drops", "p2pswarm_loop_lag_max_seconds",
    # serving
    "p2pswarm_serving_tokens_per_second", "p2pswarm_serving_first_token_seconds",
    "p2pswarm_serving_queue_depth", "p2pswarm_serving_failovers",
    # training
    "p2pswarm_training_loss", "p2pswarm_training_replica_tokens_per_second",
    "p2pswarm_training_round_seconds", "p2pswarm_training_bytes_per_round",
    # refusals
    "p2pswarm_refused", "p2pswarm_http_refused",
}


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoopbackSwarm]:
    with LoopbackSwarm(tmp_path_factory.mktemp("metrics"), 3) as swarm:
        yield swarm


def families(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(family: Any, sample: str, **labels: str) -> float:
    return sum(s.value for s in family.samples
               if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()))


def test_metrics_parse_and_carry_every_family(swarm: LoopbackSwarm) -> None:
    with httpx.Client(base_url=swarm.url(0)) as client:
        answer = client.get("/metrics")
    assert answer.status_code == 200
    assert answer.headers["content-type"].startswith("text/plain")
    got = families(answer.text)
    assert FAMILIES <= set(got), sorted(FAMILIES - set(got))
    assert value(got["p2pswarm_members"], "p2pswarm_members", state="alive") == 3
    assert value(got["p2pswarm_election_term"], "p2pswarm_election_term") >= 1
    assert value(got["p2pswarm_election_leader_changes"],
                 "p2pswarm_election_leader_changes_total") >= 1
    assert value(got["p2pswarm_transport_bytes"], "p2pswarm_transport_bytes_total",
                 direction="in") > 0
    rtt = got["p2pswarm_membership_probe_rtt_seconds"]
    assert value(rtt, "p2pswarm_membership_probe_rtt_seconds_count") > 0
    assert value(rtt, "p2pswarm_membership_probe_rtt_seconds_bucket", le="+Inf") == \
        value(rtt, "p2pswarm_membership_probe_rtt_seconds_count")


def test_a_refusal_is_counted(swarm: LoopbackSwarm) -> None:
    def refused(client: httpx.Client) -> float:
        got = families(client.get("/metrics").text)
        return value(got["p2pswarm_http_refused"], "p2pswarm_http_refused_total",
                     code="plan-changed")

    with httpx.Client(base_url=swarm.url(1), timeout=60) as client:
        before = refused(client)
        # a pin the leader never showed: refused as plan-changed (409), nothing loaded
        answer = client.post("/api/models/load", json=serve_body(plan_id="0123456789abcdef"))
        assert answer.status_code == 409, answer.text
        assert answer.json()["error"]["code"] == "plan-changed"
        assert refused(client) == before + 1


def test_metrics_and_the_swarm_document_need_the_token(swarm: LoopbackSwarm) -> None:
    bound = swarm.serve_http(0, HttpSettings("127.0.0.1", 0, "s3cret"))
    with httpx.Client(base_url=f"http://{bound}") as client:
        for path in ("/metrics", "/api/swarm"):
            assert client.get(path).status_code == 401
            assert client.get(path, headers={"Authorization": "Bearer s3cret"}) \
                .status_code == 200
        assert client.get("/swarm").status_code == 200  # the page holds no data


def test_the_swarm_document(swarm: LoopbackSwarm) -> None:
    with httpx.Client(base_url=swarm.url(2)) as client:
        doc = client.get("/api/swarm").json()
    assert {f["name"] for f in doc["fellows"]} == {"fellow-1", "fellow-2", "fellow-3"}
    leaders = [f["name"] for f in doc["fellows"] if f["leader"]]
    assert leaders == [doc["leader"]["name"]] and doc["term"] == doc["leader"]["term"] >= 1
    assert all(f["cards"] and f["state"] == "alive" for f in doc["fellows"])
    assert doc["jobs"] == [] and doc["jobs_note"] == ""
    kinds = {e["kind"] for e in doc["events"]}
    assert "leader" in kinds or "elected" in kinds
    assert "metadata" not in kinds  # counted, not shown


def test_training_families_from_the_leaders_job_records(swarm: LoopbackSwarm) -> None:
    metrics = Metrics(swarm.agents[0], Counter())
    metrics.collector.jobs = [{
        "job_id": "job-1", "state": "running", "step": 12, "loss": 2.5,
        "tokens_per_s": 300.0, "bytes_sent": 4000, "replica_steps": {"r0": 8, "r1": 4},
        "rounds": [{"step": 4, "version": 1, "closed_at_s": 10.0},
                   {"step": 8, "version": 2, "closed_at_s": 16.0}]}]
    got = families(swarm.run_sync(lambda: generate_latest(metrics.registry)).decode())
    assert value(got["p2pswarm_training_loss"], "p2pswarm_training_loss", job_id="job-1") == 2.5
    speed = got["p2pswarm_training_replica_tokens_per_second"]
    assert value(speed, speed.name, replica="r0") == 200.0
    assert value(speed, speed.name, replica="r1") == 100.0
    assert value(got["p2pswarm_training_round_seconds"], "p2pswarm_training_round_seconds") \
        == 6.0
    assert value(got["p2pswarm_training_bytes_per_round"],
                 "p2pswarm_training_bytes_per_round") == 2000.0


def test_rates_rings_and_round_trips() -> None:
    rates = Rates(window_s=10.0)
    assert rates.look(0.0, {"a": 0}) == {"a": 0.0}
    assert rates.look(2.0, {"a": 20, "b": 5}) == {"a": 10.0, "b": 2.5}
    assert rates.look(30.0, {"a": 20, "b": 5})["a"] == 0.0  # nothing new in the window

    ring = EventRing()
    for i in range(EVENTS_KEPT + 50):
        ring.note(float(i), "dead", "ab", "f", "x" * 1000)
        ring.note(float(i), "metadata", "ab", "f")
    events = ring.events()
    assert len(events) == EVENTS_KEPT and events[-1].at_s == EVENTS_KEPT + 49
    assert all(len(e.detail) <= 300 and e.kind == "dead" for e in events)
    assert ring.kinds == {"dead": EVENTS_KEPT + 50, "metadata": EVENTS_KEPT + 50}

    trips = ProbeRoundTrips()
    for rtt in (0.0005, 0.003, 0.003, 9.0):
        trips.note(rtt)
    cumulative = dict(trips.cumulative())
    assert cumulative[0.001] == 1 and cumulative[0.005] == 3 and cumulative[float("inf")] == 4
    assert trips.count == 4

    lockstep = replica_rates({"tokens_per_s": 90.0, "stages": [[{}], [{}], [{}]]})
    assert [r["tokens_per_s"] for r in lockstep] == [30.0, 30.0, 30.0]
    row = job_rows([{"job_id": "j", "model": "tiny-llama", "losses": [1.0] * 1000,
                     "moves": [], "rounds": []}])[0]
    assert row["model"] == "tiny-llama" and len(row["losses"]) == 400
    assert row["losses_from_step"] == 601
