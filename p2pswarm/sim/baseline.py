"""The memberlist-defaults baseline: the preset every figure is compared against.

memberlist's ``DefaultLANConfig``: probe every 1 s with a 500 ms timeout, 3 indirect
checks, suspicion multiplier 4 and max multiplier 6, gossip every 200 ms to 3 fellows,
retransmit multiplier 4, push-pull every 30 s. Its suspicion timeout starts at
``6 * 4 * log10(N) * 1 s`` and shrinks with confirmations (``4 - 2`` expected) to
``4 * log10(N) * 1 s``.

The baseline is one more config preset, ``memberlist_config(N)``: memberlist's timings in
``gossip``, and in ``gossip.tuning`` every switch our membership machine exposes beyond
Lifeguard set to memberlist's behaviour (the suspicion floor depends on N):

- probe order: plain shuffled round-robin (no ring successors);
- an update rides on datagrams its retransmit limit of times, not longer;
- no doubt before suspicion: one failed probe makes a suspect, whatever the loss;
- suspicion floor = memberlist's minimum timeout for this N (not a loss-dependent floor),
  every confirmation counts (no independence gap), 2 expected confirmations;
- fellows do not probe a suspect they hear about; no refuting unasked when deaf; no
  refutation pushed over a stream; a fresh gossip round goes to ``gossip_nodes``, not
  twice that; suspects are probed at the ordinary interval;
- any node with any health may declare dead.

What cannot be switched off (so the baseline is somewhat better than memberlist):
a dead verdict still needs the declaring node's own failed probes spanning the floor,
so a node that merely heard the suspicion probes the suspect first; a probe that got
neither an ack nor a nack raises no suspicion; suspects are still preferred as probe
targets. Our ``suspicion_timeout_s`` caps its top at ``suspicion_max_s(mult)``, so the
baseline passes ``suspicion_mult = 4 * 6`` to make the top memberlist's ``6 x`` the
minimum; the floor comes from the tuning. memberlist has no leader election: the
baseline runs our election with the ``lan`` timings and tuning on top.
"""

from __future__ import annotations

import math
from dataclasses import replace

from p2pswarm.config import GossipConfig, GossipTuning, SwarmConfig, lan

MEMBERLIST_SUSPICION_MULT = 4.0
MEMBERLIST_SUSPICION_MAX_MULT = 6.0


def memberlist_min_suspicion_s(n_members: int, probe_interval_s: float = 1.0) -> float:
    """memberlist's suspicion timeout before confirmations shrink it... to itself: the
    minimum, ``mult * log10(max(1, N)) * interval`` (we floor N at 10 as our machine does)."""
    return MEMBERLIST_SUSPICION_MULT * max(1.0, math.log10(max(n_members, 10))) \
        * probe_interval_s


def memberlist_config(n_members: int) -> SwarmConfig:
    """memberlist's LAN defaults for a swarm of ``n_members``: its timings, and every
    switch of our machine set to its behaviour (the election is ``lan``'s)."""
    gossip = GossipConfig(
        probe_interval_s=1.0, probe_timeout_s=0.5, indirect_checks=3,
        suspicion_mult=MEMBERLIST_SUSPICION_MULT * MEMBERLIST_SUSPICION_MAX_MULT,
        suspicion_max_timeout_mult=MEMBERLIST_SUSPICION_MAX_MULT, retransmit_mult=4,
        gossip_interval_s=0.2, gossip_nodes=3, push_pull_interval_s=30.0,
        awareness_max_multiplier=8, tuning=_memberlist_tuning(n_members))
    return replace(lan(), preset="memberlist", gossip=gossip)


def _memberlist_switches(n_members: int) -> dict[str, object]:
    floor_s = memberlist_min_suspicion_s(n_members)
    return dict(
        ring_probe_every=0,  # (older name) no ring successors
        random_probe_every=1,  # every probe walks the shuffled round-robin
        linger_s=0.0,  # an update is piggybacked its retransmit limit, no more
        loss_prior=0.0,
        recheck_above_loss=1.0,
        doubt_span_lossy_s=0.0,
        doubt_span_max_s=0.0,
        suspicion_floor_clean_s=floor_s,
        suspicion_floor_lossy_s=floor_s,
        confirmations_expected=int(MEMBERLIST_SUSPICION_MULT) - 2,
        independence_gap_clean_s=0.0,
        independence_gap_lossy_s=0.0,
        confirm_fanout=0,
        evidence_fresh_s=math.inf,
        watch_fraction=1.0,
        deaf_refute_s=math.inf,
        declare_max_score=1 << 30,
        fresh_fanout_mult=1,
        gossip_to_dead_s=30.0,
        refute_by_stream=False,
    )


def _memberlist_tuning(n_members: int) -> GossipTuning:
    """Our tuning with every switch the machine has set to memberlist's behaviour (a
    switch this version of the machine lacks is skipped: see ``missing_switches``)."""
    fields = GossipTuning.__dataclass_fields__
    return GossipTuning(**{k: v for k, v in _memberlist_switches(n_members).items()  # type: ignore[arg-type]
                     if k in fields})


def missing_switches() -> list[str]:
    """Switches the baseline would set that this version of the machine does not have."""
    fields = GossipTuning.__dataclass_fields__
    renamed = {"ring_probe_every": "random_probe_every", "random_probe_every": "ring_probe_every"}
    return [k for k in _memberlist_switches(10)
            if k not in fields and renamed.get(k) not in fields]


__all__ = [
    "memberlist_config",
    "memberlist_min_suspicion_s",
    "missing_switches",
]
