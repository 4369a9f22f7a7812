"""Membership scenarios on gossip_lab: virtual time, seeded, exact."""

from __future__ import annotations

from p2pswarm.config import lan, wifi
from p2pswarm.sim.gossip_lab import GossipLab
from p2pswarm.transport.memory import GilbertElliott

BURSTY = GilbertElliott(bad_fraction=0.2, mean_burst_s=0.3)


def converged_at(lab: GossipLab, limit_s: float, step_s: float = 0.5) -> float | None:
    while lab.now < limit_s:
        lab.run_for(step_s)
        if lab.all_see_all():
            return lab.now
    return None


def test_fifty_fellows_join_through_one_seed() -> None:
    lab = GossipLab(50, seed=1, config=lan(), election=False)
    lab.start()  # node 0 founds the swarm; 49 others know only its address
    t = converged_at(lab, 30.0)
    assert t is not None and t <= 5.0, t
    assert all(n.membership.joined for n in lab.nodes)
    assert lab.oracle.false_dead == []


def test_joins_retry_until_the_seed_comes_up() -> None:
    lab = GossipLab(5, seed=2, config=lan(), election=False)
    lab.crash(0)  # the seed is down when the others start
    lab.start()
    lab.run_until(8.0)
    assert not any(n.membership.joined for n in lab.nodes[1:])
    lab.at(8.0, lambda: lab.restart(0, seeds=()))
    t = converged_at(lab, 60.0)
    assert t is not None and t <= 8.0 + 17.0  # the backoff reached 8 s before the seed was up


def test_crash_dead_everywhere_then_restart_rejoins_higher() -> None:
    lab = GossipLab(20, seed=3, config=lan(), election=False)
    lab.start(converged=True)
    lab.run_until(30.0)
    victim = lab.nodes[7]
    old_incarnation = victim.membership.incarnation
    lab.crash(7)
    lab.run_until(40.0)
    assert all(lab.state_seen(n.index, 7) == "dead" for n in lab.live())
    latencies = [v for (s, _, _), v in lab.oracle.dead_learned.items() if s == 7]
    assert len(latencies) == 19 and max(latencies) < 6.0, sorted(latencies)[-3:]
    lab.restart(7)
    lab.run_until(50.0)
    assert victim.membership.incarnation > old_incarnation
    seen = {n.membership.member(victim.node_id).incarnation for n in lab.live() if n is not victim}
    assert seen == {victim.membership.incarnation}
    assert lab.all_see_all()


def test_a_leaving_fellow_is_left_never_dead() -> None:
    lab = GossipLab(20, seed=4, config=lan(), election=False, link_loss=0.1)
    lab.start(converged=True)
    lab.run_until(20.0)
    lab.leave(5)
    lab.run_until(40.0)
    assert all(lab.state_seen(n.index, 5) == "left" for n in lab.live())
    assert lab.oracle.dead_learned == {} and lab.oracle.false_dead == []
    lab.run_until(20.0 + lan().gossip.dead_reap_after_s + 5.0)
    assert all(lab.state_seen(n.index, 5) is None for n in lab.live())  # reaped


# Half an hour each here; 24 hours of 50 fellows: simulations/bench_membership.py
def test_no_live_fellow_declared_dead_in_half_an_hour_of_independent_loss() -> None:
    lab = GossipLab(12, seed=5, config=wifi(), link_loss=0.2, election=False)
    lab.start(converged=True)
    lab.run_until(1800.0)
    assert lab.oracle.false_dead == []
    assert lab.all_see_all()


def test_no_live_fellow_declared_dead_in_half_an_hour_of_bursty_loss() -> None:
    lab = GossipLab(12, seed=6, config=wifi(), radio=BURSTY, election=False)
    lab.start(converged=True)
    lab.run_until(1800.0)
    assert lab.oracle.false_dead == []
    raised = sum(n.membership.counters()["suspicions_raised"] for n in lab.nodes)
    assert raised > 0  # the fades were real: suspicions came, and were refuted


def test_a_partition_heals_into_one_view() -> None:
    lab = GossipLab(10, seed=7, config=lan(), election=False)
    lab.start(converged=True)
    lab.run_until(10.0)
    lab.partition(range(6), range(6, 10))
    lab.run_until(40.0)
    assert lab.state_seen(0, 8) == "dead" and lab.state_seen(8, 0) == "dead"
    lab.heal()
    t = converged_at(lab, 160.0)
    assert t is not None and t <= 40.0 + 60.0, t  # via refutation and anti-entropy


def test_metadata_reaches_everyone_and_never_goes_back() -> None:
    lab = GossipLab(20, seed=8, config=wifi(), election=False, link_loss=0.1)
    seen: dict[tuple[int, int], int] = {}
    regressions: list[tuple[int, int, int, int]] = []

    def watch(now: float, observer, event) -> None:  # type: ignore[no-untyped-def]
        if event.kind != "metadata":
            return
        subject = lab.node_by_id(event.node_id)
        version = observer.membership.member(event.node_id).meta_version
        key = (observer.index, subject.index)
        if version < seen.get(key, 0):
            regressions.append((*key, seen[key], version))
        seen[key] = version

    lab.listeners.append(watch)
    lab.start(converged=True)
    lab.run_until(10.0)
    for k in range(1, 6):  # five inventory changes in quick succession
        lab.at(10.0 + 0.3 * k, lambda k=k: lab.set_metadata(3, b"cards=%d" % k))
    lab.run_until(30.0)
    source = lab.nodes[3].membership
    assert source.meta_version == 5
    for node in lab.nodes:
        if node.index != 3:
            m = node.membership.member(source.node_id)
            assert (m.meta_version, m.metadata) == (5, b"cards=5")
    assert regressions == []


def test_same_seed_same_trace() -> None:
    def run(seed: int) -> str:
        lab = GossipLab(15, seed=seed, config=wifi(), radio=BURSTY, link_loss=0.05)
        lab.start()
        lab.at(20.0, lambda: lab.crash(3))
        lab.at(40.0, lambda: lab.restart(3))
        lab.run_until(60.0)
        return lab.trace_hash

    first = run(9)
    assert run(9) == first
    assert run(10) != first
