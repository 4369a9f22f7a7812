"""Real-network mode: three agent processes in network namespaces, 20% loss, one link
down for 5 s; the run completes and leaves no namespace, link or rule behind.

Needs root, Linux, `ip` (iproute2) and `nft` (nftables); skipped otherwise, saying why.
"""

from __future__ import annotations

import subprocess
import warnings

import pytest

from p2pswarm.sim.netns import missing_requirements, run_real
from p2pswarm.sim.scenario import load_scenario

pytestmark = pytest.mark.slow  # real processes: minutes, not seconds

WHY = missing_requirements()


@pytest.mark.skipif(WHY is not None, reason=WHY or "")
def test_three_namespaces_with_loss_and_a_link_down_run_and_clean_up() -> None:
    before = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                            check=False).stdout
    scenario = load_scenario("real-small").with_overrides(duration_s=30.0)
    result = run_real(scenario)
    assert result["leftovers"] == []
    after = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                           check=False).stdout
    assert after == before
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True,
                           check=False).stdout
    assert "p2sb" not in links or "p2sb" in before
    assert result["nodes"] == 3 and result["node_hours"] > 0.015  # three fellows ran ~20 s
    assert result["traffic"]["datagrams_out_per_fellow_s"]["count"] == 3
    assert result["events"].get("leader", 0) >= 3  # every fellow came to know a leader
    if not result["ok"]:
        warnings.warn(f"the real run's oracle reported: {result['failures']}")
