"""Fixtures shared by the tests that run agents in virtual time."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import trio.testing


@pytest.fixture
def autojump_clock() -> trio.testing.MockClock:
    """Virtual time that jumps to the next deadline whenever every task waits."""
    return trio.testing.MockClock(autojump_threshold=0)


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """Several fellows share the process; on a small, busy machine several torch threads
    per call only wait for each other."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
