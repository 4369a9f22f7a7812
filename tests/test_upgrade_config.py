"""What a rolling upgrade relies on, without processes: the health check that says a
fellow is a member again (``p2pswarm.health``, piped from ``p2pswarm status --json``), and
``docker/stack.yml``'s update and rollback settings (one task at a time, stop first, the
health check waited for, rollback on failure). The upgrade itself, on real fellows of
two releases: ``tests/test_rolling_upgrade_real.py``."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from p2pswarm.health import is_member, why_not_member
from tests.test_docker import STACK_ENV, load

LEADER = {"id": "aa" * 16, "name": "a", "term": 3}


def status(leader: dict[str, Any] | None, *states: tuple[str, str]) -> dict[str, Any]:
    return {"leader": leader, "members": [{"id": i, "name": i[:1], "state": s}
                                          for i, s in states]}


def test_a_member_names_a_leader_it_sees_alive() -> None:
    assert is_member(status(LEADER, ("aa" * 16, "alive"), ("bb" * 16, "alive")))
    assert is_member(status(LEADER, ("aa" * 16, "alive")))  # leading a swarm of one
    assert why_not_member(status(None, ("bb" * 16, "alive"))) == "names no leader yet"
    assert why_not_member(status(LEADER, ("bb" * 16, "alive"))) == \
        "does not know its leader a as a member yet"
    assert why_not_member(status(LEADER, ("aa" * 16, "suspect"))) == \
        "sees its leader a suspect"
    # whatever a status holds, an answer and no exception
    for odd in ({}, {"leader": "x"}, {"leader": LEADER, "members": "x"},
                {"leader": LEADER, "members": [1, None, {"id": 5}]}):
        assert not is_member(odd)


def check(text: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "p2pswarm.health"], input=text,
                          capture_output=True, text=True, timeout=60)


def test_the_health_check_exits_0_for_a_member_else_1_with_one_line() -> None:
    assert check(json.dumps(status(LEADER, ("aa" * 16, "alive")))).returncode == 0
    for text, says in (("", "no status"), ("[]", "no object"),
                       (json.dumps(status(None)), "names no leader yet")):
        done = check(text)
        assert done.returncode == 1 and done.stdout == "", done
        assert done.stderr.count("\n") == 1 and says in done.stderr, done.stderr


def test_the_stack_updates_one_fellow_at_a_time_once_the_last_is_a_member() -> None:
    stack = load("stack.yml", STACK_ENV)
    for name, service in stack["services"].items():
        health = service["healthcheck"]
        assert health["test"] == ["CMD-SHELL",
                                  "p2pswarm status --json | python3 -m p2pswarm.health"], name
        update, rollback = service["deploy"]["update_config"], \
            service["deploy"]["rollback_config"]
        for config in (update, rollback):
            # stop first: the new task wants the old one's port and state volume
            assert config["parallelism"] == 1 and config["order"] == "stop-first", name
        assert update["failure_action"] == "rollback" and update["delay"], name
        assert rollback["failure_action"] == "pause", name
