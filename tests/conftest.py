"""Fixtures shared by the tests: virtual time, torch threads, a stand-in agent."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import trio.testing

# The slowest files first (real processes, long virtual runs), so the two workers finish
# together instead of one running the last slow file alone while the other idles.
# `--dist loadfile` hands files out in collection order only without xdist's own
# reordering (most tests first), which would put these few-test files last.
SLOW_FIRST = ("test_rolling_upgrade_real.py", "test_interrupts.py", "test_field_election.py",
              "test_serving_failover_real.py", "test_training_replicas_real.py",
              "test_agent_training_churn.py", "test_training_takeover_real.py",
              "test_demo.py", "test_chaos_real.py", "test_serving_live_real.py")


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        name = item.path.name
        if name in SLOW_FIRST:
            return SLOW_FIRST.index(name)
        return len(SLOW_FIRST) + (0 if name.endswith("_real.py") else 1)

    items.sort(key=rank)  # stable: each file keeps its own order


@pytest.fixture
def autojump_clock() -> trio.testing.MockClock:
    """Virtual time that jumps to the next deadline whenever every task waits."""
    return trio.testing.MockClock(autojump_threshold=0)


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Torch computes on ``n`` threads inside, and on as many as before after."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """Several fellows share the process; on a small, busy machine several torch threads
    per call only wait for each other."""
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def one_torch_thread_per_module() -> Iterator[None]:
    """One torch thread for a whole module, its module-scoped fixtures included: for
    modules whose tests each compute a little on one process."""
    with torch_threads(1):
        yield


@pytest.fixture
def agent(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A stand-in agent behind the control client, for the CLI tests: it answers each
    op from a table (``tests.fakes.FakeAgent``)."""
    import p2pswarm.control.client as control_client
    from tests.fakes import FakeAgent

    fake = FakeAgent({})
    monkeypatch.setattr(control_client, "request", fake.request)
    monkeypatch.setattr(control_client, "stream", fake.stream)
    return fake
