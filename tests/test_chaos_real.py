"""The chaos run's short version (``simulations/chaos_real.py`` is the long one): four
real `join` fellows take leaves, crashes, freezes and leader kills for about 20 s while
a model is loaded and a tiny DiLoCo job trains, beside a calm twin swarm.

Opt-in (``P2PSWARM_CHAOS_CI=1``): eight processes training beside each other need the
machine's cores to themselves. On a shared two-core machine at load 15 the calm swarm
alone flapped its leader (its fellows starved of CPU past their probe timeouts) and the
run took over five minutes, so it stays out of the default suite until it runs on a
machine of its own."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from p2pswarm.demo import DEMO_TRAIN_MODEL
from p2pswarm.sim.chaos import job_config, run, verdict

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not os.environ.get("P2PSWARM_CHAOS_CI"),
                                 reason="opt-in: set P2PSWARM_CHAOS_CI=1 (eight processes)")]


def test_a_job_and_the_leadership_come_through_twenty_seconds_of_chaos() -> None:
    job = job_config(model=DEMO_TRAIN_MODEL, steps=24, seed=3, seq_len=32,
                     checkpoint_dir=Path("checkpoints"), inner_steps=4, checkpoint_every=8)
    report = run(fellows=4, minutes=20 / 60, seed=3, say=lambda line: None, job=job,
                 load_model="tiny-llama", first_hit_s=2.0, gap_s=(3.0, 6.0),
                 job_timeout_s=120.0, idle_window_s=5.0)
    assert report["events"] >= 2, report
    assert verdict(report) == [], report
