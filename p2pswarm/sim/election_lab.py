"""Election safety under partitions and flaps: many short seeded runs, checked for two
leaders in one term.

Theory of operation. One run is a small swarm (3 to 9 fellows, drawn from the seed) of
the real ``Membership`` and ``Election`` machines in ``GossipLab`` on W2-like radios. It
forms, then for ``chaos_s`` virtual seconds suffers a drawn mix of what breaks elections:
partitions into two or three sides (the leader's side drawn too), heals, flapping links
(a side cut and rejoined every fraction of a second), leader kills and crashes of any
fellow, each restarted after a while with the term and vote it had kept. It then calms
down for ``calm_s``. Every ``elected`` event gives the term's winners, every ``leader``
event whom a fellow followed in that term; a term with two winners, or whose followers
named two different leaders, is a safety failure. A run whose swarm has no single leader
after the calm is counted too (liveness, not safety).

A run takes tens of milliseconds, so ten thousand fit in minutes; the harness's
whole-agent runs of ``partition-flap`` check the same property through the agent.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from p2pswarm.config import preset
from p2pswarm.membership import Event
from p2pswarm.sim.gossip_lab import GossipLab, LabNode
from p2pswarm.transport.memory import GilbertElliott

W2_RADIO = GilbertElliott(bad_fraction=0.05, mean_burst_s=0.1)
SIZES = (3, 4, 5, 5, 7, 7, 9)  # drawn uniformly: 5 and 7 twice as often


@dataclass
class SafetyRun:
    seed: int
    nodes: int
    elections: int = 0
    terms: int = 0
    actions: int = 0
    two_leaders: list[int] = field(default_factory=list)  # terms won twice
    two_followed: list[int] = field(default_factory=list)  # terms with two leaders followed
    settled: bool = False  # one leader, followed by every live fellow, after the calm

    def as_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "nodes": self.nodes, "elections": self.elections,
                "terms": self.terms, "actions": self.actions,
                "two_leaders": self.two_leaders, "two_followed": self.two_followed,
                "settled": self.settled}


def safety_run(seed: int, *, chaos_s: float = 120.0, calm_s: float = 30.0,
               lab_class: type[GossipLab] = GossipLab) -> SafetyRun:
    draw = random.Random(seed)
    n = draw.choice(SIZES)
    priorities = {i: draw.choice((0, 0, 0, 10)) for i in range(n)}
    lab = lab_class(n, seed=seed, config=preset("wifi"), radio=W2_RADIO,
                    delay_s=(0.002, 0.012), priorities=priorities)
    run = SafetyRun(seed, n)
    followed: dict[int, set[bytes]] = {}

    def listen(now: float, node: LabNode, event: Event) -> None:
        if event.kind == "leader" and event.node_id:
            followed.setdefault(event.term, set()).add(event.node_id)

    lab.listeners.append(listen)
    lab.start(converged=True)
    lab.run_until(10.0)
    end = lab.now + chaos_s
    while lab.now < end:
        lab.run_for(draw.uniform(0.2, 8.0))
        run.actions += 1
        _disturb(lab, draw)
    lab.heal()
    for node in lab.nodes:
        if not node.up:
            lab.restart(node.index)
    lab.run_for(calm_s)

    winners = lab.leaders_per_term()
    run.elections = sum(len(w) for w in winners.values())
    run.terms = len(winners)
    run.two_leaders = sorted(t for t, w in winners.items() if len(w) > 1)
    run.two_followed = sorted(t for t, ids in followed.items() if len(ids) > 1)
    seen = {lab.leader_seen(x.index) for x in lab.live()}
    run.settled = len(seen) == 1 and None not in seen
    return run


def _disturb(lab: GossipLab, draw: random.Random) -> None:
    """One drawn disturbance: cut, heal, flap, or crash (and later restart) a fellow."""
    n = len(lab.nodes)
    what = draw.random()
    if what < 0.35:  # cut into sides; a third of the time the leader is on a small one
        order = list(range(n))
        draw.shuffle(order)
        leader = _leader_index(lab)
        if leader is not None and draw.random() < 0.33:
            order.remove(leader)
            order.insert(0, leader)
        sides = 3 if n >= 5 and draw.random() < 0.3 else 2
        cuts = sorted(draw.sample(range(1, n), sides - 1))
        lab.partition(*[order[a:b] for a, b in zip([0, *cuts], [*cuts, n], strict=True)])
    elif what < 0.55:
        lab.heal()
    elif what < 0.75:  # flap: one side cut off and back, again and again
        side = draw.sample(range(n), draw.randint(1, max(1, n // 2)))
        rest = [i for i in range(n) if i not in side]
        t = lab.now
        for _ in range(draw.randint(2, 8)):
            t += draw.uniform(0.1, 1.5)
            lab.at(t, lambda: lab.partition(side, rest))
            t += draw.uniform(0.1, 1.5)
            lab.at(t, lab.heal)
    else:  # crash the leader (or anyone), back after a while with its kept vote
        leader = _leader_index(lab)
        live = [x.index for x in lab.live()]
        if not live:
            return
        victim = leader if leader is not None and draw.random() < 0.6 else draw.choice(live)
        lab.crash(victim)
        lab.at(lab.now + draw.uniform(1.0, 20.0), lambda: _restart(lab, victim))


def _restart(lab: GossipLab, i: int) -> None:
    if not lab.nodes[i].up:
        lab.restart(i)


def _leader_index(lab: GossipLab) -> int | None:
    for node in lab.live():
        if node.election is not None and node.election.role == "leader":
            return node.index
    return None


__all__ = ["SafetyRun", "safety_run"]
