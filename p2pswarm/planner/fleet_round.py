"""The fleet's round, sized to the links: what the replicas' sharded all-reduce sends
from fellow to fellow, how long it takes on their links and access points, and the
``inner_steps`` that keep it at most ``COMM_SHARE`` of the round's compute.

The fleet plan (``fleet``) forms the replicas; this prices their meeting once a round.
It reads only the replicas' plans and step times, never the fleet plan's module, so it
reads on its own and imports nothing back.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from p2pswarm.planner.cluster import ClusterView
from p2pswarm.planner.fleet_request import FleetRequest
from p2pswarm.planner.plan import Plan
from p2pswarm.planner.profile import ModelProfile
from p2pswarm.planner.request import MAX_COUNT, PlanRequest
from p2pswarm.planner.sync_cost import encoded_bytes, round_traffic, share_bytes

MIN_AUTO_INNER_STEPS = 10  # inner_steps auto on fast links: no round shorter
COMM_SHARE = 1 / 3  # inner_steps auto: a round's communication / its compute, at most


@dataclass(frozen=True, slots=True)
class RoundEstimate:
    inner_steps: int
    inner_steps_auto: bool  # sized to the links (``COMM_SHARE``)
    compute_s: float  # inner_steps steps of the fastest replica
    bytes: int  # what every fellow sends in the all-reduce, together
    comm_s: float  # its slowest fellow or access point
    limit: str  # what sets comm_s: a fellow's links or an access point's airtime
    busiest_fellow: str
    busiest_bytes: int  # what the busiest fellow sends a round
    delta_bytes: int  # one replica's compressed delta (every trained parameter)
    access_points: tuple[tuple[str, int, float], ...]  # (name, air bytes, seconds)
    codec: str
    update_codec: str
    fellows: tuple[tuple[str, int, int, float], ...] = ()  # (name, sent, received, s)

    @property
    def comm_fraction(self) -> float:
        return self.comm_s / self.compute_s if self.compute_s > 0 else 0.0

    @property
    def busiest_over_delta(self) -> float:
        return self.busiest_bytes / self.delta_bytes if self.delta_bytes > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"inner_steps": self.inner_steps, "inner_steps_auto": self.inner_steps_auto,
                "compute_s": self.compute_s, "bytes": self.bytes, "comm_s": self.comm_s,
                "comm_fraction": self.comm_fraction, "limit": self.limit,
                "busiest_fellow": self.busiest_fellow, "busiest_bytes": self.busiest_bytes,
                "delta_bytes": self.delta_bytes,
                "busiest_over_delta": self.busiest_over_delta,
                "access_points": [{"name": n, "air_bytes": b, "seconds": t}
                                  for n, b, t in self.access_points],
                "codec": self.codec, "update_codec": self.update_codec,
                "fellows": [{"fellow": n, "sent_bytes": a, "received_bytes": b, "seconds": t}
                            for n, a, b, t in self.fellows]}


def synced_params(profile: ModelProfile, request: PlanRequest, n: int, first: bool,
                  last: bool) -> int:
    """What one stage syncs each round: its trained parameters, less a tied head (the
    first stage syncs the embedding it shares)."""
    if request.method == "lora":
        return n * profile.lora_params_layer(request.lora_rank, request.lora_targets)
    count = n * profile.layer_params()
    if first:
        count += profile.embed_params()
    if last:
        count += profile.hidden + (0 if profile.tied else profile.vocab * profile.hidden)
    return count


def _overlap_params(profile: ModelProfile, r: PlanRequest, a: tuple[int, int, bool, bool],
                    b: tuple[int, int, bool, bool]) -> int:
    """Trained parameters two stages (``(start, stop, first, last)``) of different
    replicas both hold: what they average between them."""
    p = profile
    layers = max(0, min(a[1], b[1]) - max(a[0], b[0]))
    if r.method == "lora":
        return layers * p.lora_params_layer(r.lora_rank, r.lora_targets)
    count = layers * p.layer_params()
    if a[2] and b[2]:
        count += p.embed_params()
    if a[3] and b[3]:
        count += p.hidden + (0 if p.tied else p.vocab * p.hidden)
    return count


def round_flows(profile: ModelProfile, r: PlanRequest, fleet: FleetRequest,
                plans: Sequence[Plan]) -> dict[tuple[str, str], int]:
    """Bytes from fellow to fellow in one round's sharded all-reduce: between two stages
    of different replicas, each way one part of the delta they share (to its reducer)
    and one part of its update (back)."""
    update = fleet.update_codec or fleet.codec
    options = dict(fleet.codec_options)
    update_options = dict(fleet.update_codec_options if fleet.update_codec
                          else fleet.codec_options)
    n = len(plans)
    shapes = []
    for one in plans:
        k = len(one.stages)
        shapes.append([(s.fellow_id, (s.layers[0], s.layers[1], j == 0, j == k - 1))
                       for j, s in enumerate(one.stages)])
    flows: dict[tuple[str, str], int] = {}
    for i in range(n):
        for k in range(n):
            if i == k:
                continue
            for a, sa in shapes[i]:
                for b, sb in shapes[k]:
                    shared = _overlap_params(profile, r, sa, sb)
                    if shared:
                        nbytes = (share_bytes(fleet.codec, options, shared, n)
                                  + share_bytes(update, update_options, shared, n))
                        flows[(a, b)] = flows.get((a, b), 0) + nbytes
    return flows


def _delta_bytes(profile: ModelProfile, r: PlanRequest, fleet: FleetRequest) -> int:
    """One replica's compressed delta: every trained parameter, encoded."""
    params = synced_params(profile, r, profile.n_layers, True, True)
    return encoded_bytes(fleet.codec, dict(fleet.codec_options), params)


def round_estimate(profile: ModelProfile, r: PlanRequest, fleet: FleetRequest,
                   view: ClusterView, plans: Sequence[Plan], steps_s: Sequence[float]
                   ) -> RoundEstimate | None:
    """The round of replicas ``plans`` (one optimizer step each: ``steps_s``), its
    ``inner_steps`` sized to the links when the request leaves it auto."""
    if not plans:
        return None
    fastest = min(steps_s)
    traffic = round_traffic(round_flows(profile, r, fleet, plans), view)
    inner = fleet.inner_steps
    if inner is None:  # the fewest steps whose compute covers the sync COMM_SHARE-fold
        need = traffic.seconds / COMM_SHARE / fastest if fastest > 0 else 0.0
        inner = min(MAX_COUNT, max(MIN_AUTO_INNER_STEPS, math.ceil(need - 1e-9)))
    names = {x.id: x.name for x in view.fellows}
    busiest = traffic.busiest
    limit = traffic.limit
    if limit.startswith("fellow "):
        limit = f"{names.get(limit[7:], limit[7:])}'s links"
    return RoundEstimate(
        inner_steps=inner, inner_steps_auto=fleet.inner_steps is None,
        compute_s=inner * fastest, bytes=traffic.total_sent_bytes, comm_s=traffic.seconds,
        limit=limit,
        busiest_fellow=names.get(busiest.fellow_id, busiest.fellow_id) if busiest else "",
        busiest_bytes=busiest.sent_bytes if busiest else 0,
        delta_bytes=_delta_bytes(profile, r, fleet),
        access_points=tuple((t.name, t.air_bytes, t.seconds)
                            for t in traffic.access_points),
        codec=fleet.codec, update_codec=fleet.update_codec or fleet.codec,
        fellows=tuple((names.get(t.fellow_id, t.fellow_id), t.sent_bytes, t.received_bytes,
                       t.seconds) for t in traffic.fellows))


__all__ = ["COMM_SHARE", "MIN_AUTO_INNER_STEPS", "RoundEstimate", "round_estimate",
           "round_flows", "synced_params"]
