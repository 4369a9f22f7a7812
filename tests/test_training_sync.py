"""DiLoCo-style sync: the keeper's rounds (deadline, staleness, outer Nesterov), replicas
mirroring the global parameters bit for bit, speed-aware budgets, and a replica killed
and restarted mid-run in virtual time while the job goes on."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pswarm.errors import RemoteProtocolError
from p2pswarm.training.job import JobConfig, SyncConfig
from p2pswarm.training.source import ScratchModel
from p2pswarm.training.sync import LocalSync, OuterSync, flatten, step_budgets
from p2pswarm.training.virtual import FellowPlan, LinkModel, SharedLink, VirtualSwarm
from tests.byte_llama import byte_llama, byte_token_data

EXACT = SyncConfig(outer_lr=1.0, outer_momentum=0.0, codec="fp32", staleness_bound=2,
                   staleness_decay=0.5, round_deadline_s=10.0)


pytestmark = pytest.mark.usefixtures("one_torch_thread_per_module")


def test_step_budgets_by_speed() -> None:
    assert step_budgets({"pi": 1, "laptop": 1, "desk": 2, "gpu": 10}, 50) == {
        "pi": 5, "laptop": 5, "desk": 10, "gpu": 50}
    assert step_budgets({"a": 0.01, "b": 10}, 50) == {"a": 1, "b": 50}  # at least one
    assert step_budgets({}, 50) == {}


def test_one_exact_contribution_becomes_the_global_model() -> None:
    start = torch.randn(100)
    keeper = OuterSync(start, EXACT)
    keeper.join("r0")
    delta = torch.randn(100) * 0.01
    assert keeper.contribute("r0", 0, delta, 16).accepted
    assert keeper.ready(now=0.0)  # every member has sent: no need to wait
    result = keeper.close_round(now=1.0)
    assert result is not None and result.version == 1 and result.samples == 16
    assert torch.allclose(keeper.params, start - delta, atol=1e-7)
    assert keeper.next_deadline() == 11.0


def test_staleness_weights_and_bound() -> None:
    keeper = OuterSync(torch.zeros(4), replace(EXACT, staleness_bound=1))
    for name in ("a", "b", "c"):
        keeper.join(name)
    keeper.contribute("a", 0, torch.ones(4), 10)
    keeper.close_round(now=1.0)
    keeper.contribute("a", 1, torch.ones(4), 10)
    keeper.contribute("b", 0, torch.full((4,), 3.0), 10)  # one round late: half weight
    assert keeper.contribute("c", 2, torch.ones(4), 10).reason == "future"
    keeper.close_round(now=2.0)
    # g = (10 * 1 + 10 * 0.5 * 3) / 20 = 1.25, lr 1, no momentum
    assert torch.allclose(keeper.params, torch.full((4,), -1.0 - 1.25))
    verdict = keeper.contribute("b", 0, torch.ones(4), 10)  # two rounds late: dropped
    assert not verdict.accepted and verdict.reason == "stale" and verdict.staleness == 2


def test_deadline_and_empty_rounds() -> None:
    keeper = OuterSync(torch.zeros(3), EXACT, now=0.0)
    keeper.join("a")
    keeper.join("b")
    assert not keeper.ready(now=100.0)  # nothing arrived: nothing to close
    assert keeper.close_round(now=100.0) is None and keeper.version == 0
    assert keeper.next_deadline() == 110.0  # the round stays open
    keeper.contribute("a", 0, torch.ones(3), 1)
    assert not keeper.ready(now=105.0)  # b has not sent
    assert keeper.ready(now=110.0)  # the deadline: close with what arrived
    keeper.leave("b")
    assert keeper.ready(now=105.0)  # nobody left to wait for


def test_outer_step_is_nesterov_sgd() -> None:
    config = replace(EXACT, outer_lr=0.7, outer_momentum=0.9)
    start = torch.randn(50)
    keeper = OuterSync(start, config)
    keeper.join("r")
    reference = torch.nn.Parameter(start.clone())
    sgd = torch.optim.SGD([reference], lr=0.7, momentum=0.9, nesterov=True)
    for round_ in range(6):
        g = torch.randn(50) * 0.1
        keeper.contribute("r", round_, g, 8)
        keeper.close_round(now=float(round_))
        reference.grad = g.clone()
        sgd.step()
    assert torch.allclose(keeper.params, reference.detach(), atol=1e-5)


@settings(max_examples=20, deadline=None)
@given(order=st.permutations(range(4)), codec=st.sampled_from(["int8", "topk", "qsgd"]))
def test_arrival_order_does_not_change_the_update(order: list[int], codec: str) -> None:
    config = replace(EXACT, codec=codec, outer_lr=0.7, outer_momentum=0.9)
    deltas = [torch.randn(300, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    results = []
    for arrival in (list(range(4)), order):
        keeper = OuterSync(torch.zeros(300), config)
        for i in arrival:
            keeper.contribute(f"r{i}", 0, deltas[i], 4 + i)
        result = keeper.close_round(now=1.0)
        assert result is not None
        results.append(result.update.to_bytes())
    assert results[0] == results[1]


def test_replicas_mirror_the_global_model_and_keep_unsent_progress() -> None:
    config = replace(EXACT, codec="int8", outer_lr=0.7, outer_momentum=0.9)
    start = torch.randn(200)
    keeper = OuterSync(start, config)
    params = [[torch.nn.Parameter(start.clone())] for _ in range(2)]
    syncs = [LocalSync(p, config) for p in params]
    for round_ in range(5):
        for i, sync in enumerate(syncs):
            with torch.no_grad():
                params[i][0].sub_(torch.randn(200) * 0.01)  # local training
            _, decoded, version = sync.take_delta()
            keeper.contribute(f"r{i}", version, decoded, 8)
        result = keeper.close_round(now=float(round_))
        assert result is not None
        with torch.no_grad():
            params[0][0].add_(1.0)  # progress made after the delta was taken
        for sync in syncs:
            sync.apply(result.update, result.version)
        for sync in syncs:
            assert torch.equal(sync.anchor, keeper.params)  # bit for bit, lossy codec
        assert torch.allclose(params[0][0].detach(), keeper.params + 1.0, atol=1e-6)
        with torch.no_grad():
            params[0][0].sub_(1.0)
    with pytest.raises(RemoteProtocolError, match="sync-gap"):
        syncs[0].apply(result.update, result.version + 2)
    missed = keeper.updates_since(2)
    assert missed is not None and len(missed) == 3
    assert keeper.updates_since(-5) is None  # older than the history: pull the state


def test_shared_link_queues_transfers() -> None:
    link = SharedLink(LinkModel(bandwidth_bps=8e6, rtt_s=0.02))
    assert link.send(0.0, 1_000_000) == pytest.approx(1.01)
    assert link.send(0.5, 1_000_000) == pytest.approx(2.01)  # waits for the first
    assert link.send(5.0, 0) == pytest.approx(5.01)
    assert link.bytes_sent == 2_000_000


# --- a replica killed and restarted, in virtual time ---------------------------------------

MODEL = byte_llama(hidden_size=32, layers=2, positions=64, tied=True)


def test_killed_replica_rejoins_and_the_job_never_restarts() -> None:
    job = JobConfig.from_dict({
        "model": {"config": MODEL}, "seq_len": 32, "micro_batch": 4, "steps": 90,
        "lr": {"peak": 3e-3, "min": 3e-4, "warmup_steps": 5},
        "sync": {"inner_steps": 10, "codec": "int8", "outer_lr": 1.0, "outer_momentum": 0.0,
                 "round_deadline_s": 15.0}})
    data = byte_token_data()
    source = ScratchModel(MODEL, seed=0)
    batches = data.holdout_batches(32, 8, max_batches=4)
    samples = 3 * 90 * 4

    def swarm(fellows: list[FellowPlan]) -> VirtualSwarm:
        return VirtualSwarm(job, source, data, fellows, rng=random.Random(0),
                            eval_batches=batches)

    calm = swarm([FellowPlan(f"f{i}") for i in range(3)]).run(until_samples=samples)
    churned = swarm([FellowPlan("f0"), FellowPlan("f1"),
                     FellowPlan("f2", kill_at_s=25.0, rejoin_at_s=45.0)])
    report = churned.run(until_samples=samples)
    versions = [r.version for r in report.rounds]
    assert versions == list(range(1, len(versions) + 1))  # never reset, never repeated
    closed_while_dead = [r for r in report.rounds if 25.0 < r.closed_at_s < 45.0]
    assert len(closed_while_dead) >= 2  # the others went on without it
    assert report.max_round_gap_s <= 15.0  # nobody waited past a deadline
    assert report.rejoins == 1 and report.global_restarts == 0
    # productive within a round: its first delta after rejoining was accepted
    assert len(report.rejoin_to_useful_s) == 1 and report.rejoin_to_useful_s[0] <= 10.5
    f2 = churned.fellows["f2"].replica
    assert f2 is not None and f2.version >= report.rounds[-2].version
    assert calm.final_loss is not None and report.final_loss is not None
    assert calm.final_loss < 3.5  # it learned
    assert abs(report.final_loss / calm.final_loss - 1) < 0.05
    # every live replica mirrors the keeper's global model, once it has the last update
    keeper = churned.keepers[0]
    for name in ("f0", "f2"):
        replica = churned.fellows[name].replica
        assert replica is not None
        missed = keeper.updates_since(replica.version)
        assert missed is not None
        for update in missed:
            replica.apply([update], replica.version + 1)
        assert torch.equal(replica.syncs[0].anchor, keeper.params)
        assert torch.equal(flatten(replica.stages[0].trainable), keeper.params)


def test_heterogeneous_fellows_all_stay_useful() -> None:
    data = byte_token_data()
    speeds = [1.0, 1.0, 2.0, 10.0]

    def utilisation(speed_aware: bool) -> float:
        job = JobConfig.from_dict({
            "model": {"config": MODEL}, "seq_len": 32, "micro_batch": 4, "steps": 200,
            "sync": {"inner_steps": 20, "codec": "qsgd", "outer_lr": 1.0,
                     "outer_momentum": 0.0, "round_deadline_s": 3.0,
                     "speed_aware": speed_aware}})
        swarm = VirtualSwarm(job, ScratchModel(MODEL, seed=0), data,
                             [FellowPlan(f"f{i}", speed=s) for i, s in enumerate(speeds)],
                             rng=random.Random(0))
        report = swarm.run(until_s=8.5)
        rounds = report.rounds[:-1]  # the last one is the final flush
        useful = sum(r.applied_samples for r in rounds) / rounds[-1].closed_at_s
        return useful / (sum(speeds) * 4)

    assert utilisation(speed_aware=True) >= 0.9
    # every fellow taking the fast one's 20 steps: the slow ones' deltas come too late
    assert utilisation(speed_aware=False) < 0.8
