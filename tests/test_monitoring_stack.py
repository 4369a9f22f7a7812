"""docker/monitoring.yaml, Prometheus' and Grafana's files: the fellows' commands parse
with the real `p2pswarm join` parser and serve HTTP beyond loopback only with a token,
Prometheus scrapes /metrics with that token, and every series the shipped Grafana
dashboard asks for is one the agent's /metrics has (read from a live scrape)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from p2pswarm.http.app import http_settings
from tests.http_swarm import LoopbackSwarm
from tests.test_docker import COMPOSE_ENV, check_join_command, interpolate

MONITORING = Path(__file__).resolve().parent.parent / "docker" / "monitoring"
ENV = {**COMPOSE_ENV, "P2PSWARM_HTTP_TOKEN_FILE": "/run/p2pswarm-http-token"}


def test_the_overlay_serves_http_with_a_token_and_runs_prometheus_and_grafana() -> None:
    overlay = interpolate(yaml.safe_load((MONITORING.parent / "monitoring.yaml").read_text()),
                          ENV)
    services = overlay["services"]
    assert {"seed", "fellow", "prometheus", "grafana"} <= set(services)
    for name in ("seed", "fellow"):
        params = check_join_command(services[name]["command"])
        assert params["http_token_file"] is not None
        assert "p2pswarm_http_token" in services[name]["secrets"]
        settings = http_settings(params["http"], "a-token")
        assert settings is not None and settings.port == 7780
    assert overlay["secrets"]["p2pswarm_http_token"] == {"file": "/run/p2pswarm-http-token"}
    for name in ("prometheus", "grafana"):  # published on the host's loopback only
        assert all(p.startswith("127.0.0.1:") for p in services[name]["ports"])


def test_prometheus_scrapes_metrics_with_the_token() -> None:
    config = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    job = config["scrape_configs"][0]
    assert job["metrics_path"] == "/metrics"
    assert job["authorization"] == {"type": "Bearer",
                                    "credentials_file": "/run/secrets/p2pswarm_http_token"}
    assert job["dns_sd_configs"][0]["port"] == 7780


def test_every_series_of_the_grafana_dashboard_is_scraped(tmp_path: Path) -> None:
    dashboard = json.loads((MONITORING / "grafana" / "dashboards" / "p2pswarm.json")
                           .read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert len(exprs) >= 16
    with LoopbackSwarm(tmp_path, 2) as swarm:
        text = httpx.get(swarm.url(0) + "/metrics").text
    samples = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    families = {f.name for f in text_string_to_metric_families(text)}
    for expr in exprs:
        names = set(re.findall(r"\b(p2pswarm_[a-z0-9_]+)", expr))
        assert names, expr
        for name in names:
            # a histogram's _bucket, a summary's _sum/_count come once it has samples
            base = re.sub(r"_(bucket|sum|count|total)$", "", name)
            assert name in samples or base in families, (name, expr)
    datasource = yaml.safe_load((MONITORING / "grafana" / "provisioning" / "datasources" /
                                 "prometheus.yml").read_text())["datasources"][0]
    assert all(p["datasource"]["uid"] == datasource["uid"] for p in dashboard["panels"])
