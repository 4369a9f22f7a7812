"""The cluster view the planner plans on, and the cluster file that writes it down.

A view is a frozen value: fellows (sorted by id) with their cards (sorted by kind and
index), connected/training flags, each card's speed, and the links between fellows.
Building it sorts everything, so the order in which fellows and cards arrived (gossip
order, file order) can never reach the plan.

The cluster file (``p2pswarm plan --cluster FILE``, ``p2pswarm cluster export``)::

    {"fellows": [{"id", "name", "connected", "training",
                  "cards": [{"index", "kind": "cuda"|"cpu", "name", "total_bytes",
                             "free_bytes", "held_by_others": [{"pid", "name", "bytes"}],
                             "flops", "mem_bandwidth",
                             "dtype_tokens_per_s": {"f16", "int8", "int4"}}]}],
     "links": {"default": {"bandwidth_bytes_s", "latency_s"},
               "local": {...}, "FELLOW_A|FELLOW_B": {...}},
     "access_points": {"NAME": {"capacity_bytes_s", "fellows": [ID or name, ...]}}}

``access_points`` (optional) groups fellows that share one WiFi access point's airtime:
every byte a member sends or receives over the air counts against the group's
``capacity_bytes_s`` (a byte between two members of the group crosses the air twice).
A fellow belongs to at most one group. The training planner's sync estimate uses it
(``planner.sync_cost``); a fellow's own link still bounds its own traffic.

Sizes may be integers (bytes) or strings such as "24GB"; a card without ``flops`` and
``mem_bandwidth`` gets the conservative estimate and the plan says so. The optional
``dtype_tokens_per_s`` is what ``p2pswarm bench`` measured of each weights dtype on the
card (tokens/s of one reference linear); without it an int8/int4 stage is taken at
``costs.UNMEASURED_QUANT_FACTOR`` times its f16 time.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from p2pswarm.cards import (
    CARD_KINDS,
    ESTIMATED_FLOPS,
    ESTIMATED_MEM_BANDWIDTH,
    MAX_SIZE_BYTES,
    Benchmark,
    DtypeRates,
    Holder,
    Inventory,
    dtype_rates,
    parse_size,
)
from p2pswarm.errors import ConfigError

FORMAT_VERSION = 1


@dataclass(frozen=True, slots=True)
class Link:
    bandwidth_bytes_s: float
    latency_s: float

    def to_dict(self) -> dict[str, float]:
        return {"bandwidth_bytes_s": self.bandwidth_bytes_s, "latency_s": self.latency_s}


@dataclass(frozen=True, slots=True)
class AccessPoint:
    """Fellows behind one WiFi access point: they share its airtime."""

    name: str
    capacity_bytes_s: float
    fellows: tuple[str, ...]  # fellow ids, sorted

    def to_dict(self) -> dict[str, Any]:
        return {"capacity_bytes_s": self.capacity_bytes_s, "fellows": list(self.fellows)}


MAX_ACCESS_POINTS = 1024
MAX_ACCESS_POINT_NAME_CHARS = 64


# Defaults when the file or the agent says nothing: gigabit Ethernet between fellows,
# PCIe / shared memory between two cards of one fellow.
DEFAULT_LINK = Link(bandwidth_bytes_s=100e6, latency_s=1e-3)
LOCAL_LINK = Link(bandwidth_bytes_s=10e9, latency_s=2e-5)


@dataclass(frozen=True, slots=True)
class CardView:
    index: int
    kind: str
    name: str
    total_bytes: int
    free_bytes: int  # what p2pswarm may use now
    held_by_others: tuple[Holder, ...]
    flops: float  # FLOP/s in the card's compute dtype
    mem_bandwidth: float  # bytes/s
    speed_measured: bool  # False: flops and mem_bandwidth are conservative estimates
    # tokens/s of a reference linear per weights dtype, as bench measured it (() never)
    dtype_tokens_per_s: DtypeRates = ()

    @property
    def key(self) -> str:
        return f"{self.kind}:{self.index}"

    @property
    def sort_key(self) -> tuple[int, int]:
        return (CARD_KINDS.index(self.kind), self.index)

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "index": self.index, "kind": self.kind, "name": self.name,
            "total_bytes": self.total_bytes, "free_bytes": self.free_bytes,
            "held_by_others": [h.to_dict() for h in self.held_by_others],
        }
        if self.speed_measured:
            data["flops"] = self.flops
            data["mem_bandwidth"] = self.mem_bandwidth
        if self.dtype_tokens_per_s:
            data["dtype_tokens_per_s"] = dict(self.dtype_tokens_per_s)
        return data


@dataclass(frozen=True, slots=True)
class Fellow:
    id: str
    name: str
    connected: bool
    training: bool
    cards: tuple[CardView, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "cards", tuple(sorted(self.cards, key=lambda c: c.sort_key)))

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "name": self.name, "connected": self.connected,
                "training": self.training, "cards": [c.to_dict() for c in self.cards]}


@dataclass(frozen=True, slots=True)
class ClusterView:
    fellows: tuple[Fellow, ...]
    default_link: Link = DEFAULT_LINK
    local_link: Link = LOCAL_LINK
    links: tuple[tuple[tuple[str, str], Link], ...] = ()  # sorted (id_a, id_b) pairs
    access_points: tuple[AccessPoint, ...] = ()  # sorted by name

    def __post_init__(self) -> None:
        fellows = tuple(sorted(self.fellows, key=lambda f: f.id))
        ids = [f.id for f in fellows]
        if len(set(ids)) != len(ids):
            dup = next(i for i in ids if ids.count(i) > 1)
            raise ConfigError(f"fellow id {dup!r} appears twice: give each fellow its own id")
        object.__setattr__(self, "fellows", fellows)
        object.__setattr__(self, "links", tuple(sorted(self.links, key=lambda kv: kv[0])))
        object.__setattr__(self, "access_points",
                           tuple(sorted(self.access_points, key=lambda a: a.name)))

    def access_point(self, fellow_id: str) -> AccessPoint | None:
        """The access point whose airtime ``fellow_id`` shares, if the file says so."""
        for ap in self.access_points:
            if fellow_id in ap.fellows:
                return ap
        return None

    def fellow(self, fellow_id: str) -> Fellow | None:
        for f in self.fellows:
            if f.id == fellow_id:
                return f
        return None

    def link(self, a: str, b: str) -> Link:
        if a == b:
            return self.local_link
        pair = (a, b) if a < b else (b, a)
        for key, link in self.links:
            if key == pair:
                return link
        return self.default_link

    def to_dict(self) -> dict[str, Any]:
        """The cluster file form (links between two fellows keyed by their ids)."""
        links: dict[str, Any] = {"default": self.default_link.to_dict(),
                                 "local": self.local_link.to_dict()}
        for (a, b), link in self.links:
            links[f"{a}|{b}"] = link.to_dict()
        out: dict[str, Any] = {"version": FORMAT_VERSION,
                               "fellows": [f.to_dict() for f in self.fellows], "links": links}
        if self.access_points:
            out["access_points"] = {a.name: a.to_dict() for a in self.access_points}
        return out


# --- reading the cluster file / agent metadata -------------------------------------------


def _size(value: Any, where: str, allow_zero: bool = True) -> int:
    if isinstance(value, str):
        try:
            return parse_size(value)
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None
    # ``not 0 <= value`` also refuses NaN; infinity is past the cap
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not 0 <= value <= MAX_SIZE_BYTES or (value == 0 and not allow_zero):
        raise ConfigError(f"{where} must be a number of bytes (or e.g. \"24GB\"), got "
                          f"{_shown(value)}")
    return int(value)


def _speed(value: Any, where: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not 0 < value < math.inf:
        raise ConfigError(f"{where} must be a positive number, got {_shown(value)}")
    return float(value)


def _shown(value: Any) -> str:
    text = repr(value) if not isinstance(value, int) or abs(value) < 10**40 else "a huge number"
    return text if len(text) <= 60 else text[:57] + "..."


def card_view(data: Mapping[str, Any], where: str = "card",
              benchmark: Benchmark | None = None) -> CardView:
    """A card from its cluster-file or inventory dict, with its speed if known."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where} must be a JSON object")
    kind = data.get("kind", "cuda")
    if kind not in CARD_KINDS:
        raise ConfigError(f"{where}.kind {kind!r} must be \"cuda\" or \"cpu\"")
    index = data.get("index", 0)
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < 2**16:
        raise ConfigError(f"{where}.index must be a card index such as 0, got {index!r}")
    if "total_bytes" not in data:
        raise ConfigError(f"{where} has no total_bytes: add the card's memory, e.g. \"24GB\"")
    total = _size(data["total_bytes"], f"{where}.total_bytes", allow_zero=False)
    free = _size(data.get("free_bytes", total), f"{where}.free_bytes")
    if free > total:
        raise ConfigError(f"{where}: free_bytes {free} is more than total_bytes {total}")
    holders = []
    for i, h in enumerate(data.get("held_by_others") or ()):
        hw = f"{where}.held_by_others[{i}]"
        if not isinstance(h, Mapping) or "bytes" not in h:
            raise ConfigError(f"{hw} must be {{\"pid\", \"name\", \"bytes\"}}")
        pid = h.get("pid", 0)
        if isinstance(pid, bool) or not isinstance(pid, int) or not 0 <= pid < 2**32:
            raise ConfigError(f"{hw}.pid must be a process id, got {_shown(pid)}")
        holders.append(Holder(pid=pid, name=str(h.get("name", "?")),
                              held_bytes=_size(h["bytes"], f"{hw}.bytes")))
    holders.sort(key=lambda h: (-h.held_bytes, h.pid, h.name))
    flops = _speed(data.get("flops"), f"{where}.flops")
    bandwidth = _speed(data.get("mem_bandwidth"), f"{where}.mem_bandwidth")
    rates = dtype_rates(data.get("dtype_tokens_per_s"), f"{where}.dtype_tokens_per_s")
    if benchmark is not None and benchmark.measured:
        flops, bandwidth = benchmark.flops, benchmark.mem_bandwidth
        rates = benchmark.dtype_tokens_per_s or rates
    measured = flops is not None and bandwidth is not None
    return CardView(
        index=index, kind=kind, name=str(data.get("name") or ("CPU" if kind == "cpu" else "GPU")),
        total_bytes=total, free_bytes=free, held_by_others=tuple(holders),
        flops=flops if measured and flops else ESTIMATED_FLOPS[kind],
        mem_bandwidth=bandwidth if measured and bandwidth else ESTIMATED_MEM_BANDWIDTH[kind],
        speed_measured=measured, dtype_tokens_per_s=rates,
    )


def fellow_view(fellow_id: str, name: str | None, inventory: Inventory | Mapping[str, Any],
                benchmarks: Mapping[str, Benchmark] | None = None, connected: bool = True,
                training: bool = False) -> Fellow:
    """A fellow as the agent knows it from membership: its gossiped inventory (an
    ``Inventory`` or its dict) and its benchmarks by card key (``cuda:0``)."""
    inv = inventory.to_dict() if isinstance(inventory, Inventory) else inventory
    cards = []
    for i, c in enumerate(inv.get("cards", ())):
        key = f"{c.get('kind', 'cuda')}:{c.get('index', 0)}"
        bench = (benchmarks or {}).get(key)
        cards.append(card_view(c, f"fellow {fellow_id} card {i}", bench))
    return Fellow(id=str(fellow_id), name=str(name or fellow_id), connected=connected,
                  training=training, cards=tuple(cards))


def _link(data: Any, where: str) -> Link:
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where} must be {{\"bandwidth_bytes_s\", \"latency_s\"}}")
    bandwidth = _speed(data.get("bandwidth_bytes_s"), f"{where}.bandwidth_bytes_s")
    latency = data.get("latency_s", 0.0)
    if isinstance(latency, bool) or not isinstance(latency, (int, float)) \
            or not 0 <= latency < math.inf:
        raise ConfigError(f"{where}.latency_s must be zero or more seconds, got "
                          f"{_shown(latency)}")
    if bandwidth is None:
        raise ConfigError(f"{where} needs bandwidth_bytes_s, e.g. 100e6 for gigabit Ethernet")
    return Link(bandwidth_bytes_s=bandwidth, latency_s=float(latency))


def access_points_from_dict(data: Any, fellows: Iterable[Fellow]) -> tuple[AccessPoint, ...]:
    """The ``access_points`` object of a cluster file, checked: each a positive capacity
    and fellows (ids or names) of the cluster, no fellow in two groups."""
    if data is None:
        return ()
    if not isinstance(data, Mapping):
        raise ConfigError('"access_points" must be a JSON object such as {"ap-1": '
                          '{"capacity_bytes_s": 12e6, "fellows": ["pi-01", "pi-02"]}}')
    if len(data) > MAX_ACCESS_POINTS:
        raise ConfigError(f'"access_points" lists {len(data)} groups; at most '
                          f"{MAX_ACCESS_POINTS}")
    fellows = tuple(fellows)
    by_name = {f.name: f.id for f in fellows}
    ids = {f.id for f in fellows}
    seen: dict[str, str] = {}
    out = []
    for name in sorted(data, key=str):
        value = data[name]
        shown = _shown(name)
        if not isinstance(name, str) or not 0 < len(name) <= MAX_ACCESS_POINT_NAME_CHARS:
            raise ConfigError(f"access_points: a group's name is 1 to "
                              f"{MAX_ACCESS_POINT_NAME_CHARS} characters, got {shown}")
        where = f"access_points[{shown}]"
        if not isinstance(value, Mapping):
            raise ConfigError(f'{where} must be {{"capacity_bytes_s", "fellows"}}')
        capacity = _speed(value.get("capacity_bytes_s"), f"{where}.capacity_bytes_s")
        if capacity is None:
            raise ConfigError(f"{where} needs capacity_bytes_s: the airtime its fellows "
                              "share, e.g. 12e6 for a busy 802.11ac access point")
        members = value.get("fellows")
        if not isinstance(members, list) or not members or len(members) > len(ids):
            raise ConfigError(f"{where}.fellows must list the group's fellows (ids or names)")
        group = []
        for m in members:
            fid = m if isinstance(m, str) and m in ids else (
                by_name.get(m, "") if isinstance(m, str) else "")
            if not fid:
                raise ConfigError(f"{where}.fellows names {_shown(m)}, not a fellow of the "
                                  "cluster")
            if fid in seen:
                raise ConfigError(f"{where}: fellow {_shown(m)} is already behind "
                                  f"{_shown(seen[fid])}; a fellow shares one access point")
            seen[fid] = name
            group.append(fid)
        out.append(AccessPoint(name=name, capacity_bytes_s=capacity,
                               fellows=tuple(sorted(group))))
    return tuple(out)


def cluster_view(fellows: Iterable[Fellow], links: Mapping[str, Any] | None = None,
                 access_points: Any = None) -> ClusterView:
    """A view from fellows, a links dict keyed ``default``, ``local`` or ``A|B`` (A and
    B fellow ids or names) and the ``access_points`` groups, if any."""
    fellows = tuple(fellows)
    by_name = {f.name: f.id for f in fellows}
    ids = {f.id for f in fellows}
    default, local, pairs = DEFAULT_LINK, LOCAL_LINK, {}
    for key in sorted((links or {}).keys()):
        value = (links or {})[key]
        where = f"links[{key!r}]"
        if key == "default":
            default = _link(value, where)
        elif key == "local":
            local = _link(value, where)
        else:
            parts = str(key).split("|")
            if len(parts) != 2:
                raise ConfigError(f"{where}: a link key is \"default\", \"local\" or \"A|B\"")
            a, b = (p if p in ids else by_name.get(p, "") for p in parts)
            if not a or not b:
                raise ConfigError(f"{where} names a fellow that is not in the cluster")
            pairs[(a, b) if a < b else (b, a)] = _link(value, where)
    return ClusterView(fellows=fellows, default_link=default, local_link=local,
                       links=tuple(pairs.items()),
                       access_points=access_points_from_dict(access_points, fellows))


def cluster_from_dict(data: Mapping[str, Any]) -> ClusterView:
    """Read a cluster file's dict (or ``cluster export``'s), checking every field."""
    if not isinstance(data, Mapping) or not isinstance(data.get("fellows"), list):
        raise ConfigError("a cluster file is a JSON object with a \"fellows\" list: "
                          "see docs/planner.md or `p2pswarm cluster export`")
    fellows = []
    for i, f in enumerate(data["fellows"]):
        where = f"fellows[{i}]"
        if not isinstance(f, Mapping) or not f.get("id"):
            raise ConfigError(f"{where} needs an \"id\"")
        cards = [card_view(c, f"{where}.cards[{j}]") for j, c in enumerate(f.get("cards") or ())]
        keys = [c.key for c in cards]
        if len(set(keys)) != len(keys):
            raise ConfigError(f"{where} lists the same card twice: give each card its own index")
        fellows.append(Fellow(id=str(f["id"]), name=str(f.get("name") or f["id"]),
                              connected=bool(f.get("connected", True)),
                              training=bool(f.get("training", False)), cards=tuple(cards)))
    links = data.get("links") or {}
    if not isinstance(links, Mapping):
        raise ConfigError("\"links\" must be a JSON object keyed \"default\" or \"A|B\"")
    return cluster_view(fellows, links, data.get("access_points"))


def cluster_to_dict(view: ClusterView) -> dict[str, Any]:
    return view.to_dict()


__all__ = [
    "DEFAULT_LINK",
    "LOCAL_LINK",
    "AccessPoint",
    "CardView",
    "ClusterView",
    "Fellow",
    "Link",
    "access_points_from_dict",
    "card_view",
    "cluster_from_dict",
    "cluster_to_dict",
    "cluster_view",
    "fellow_view",
]
