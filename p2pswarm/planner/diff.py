"""What changed between two views, or two plans, in words a person can act on.

A pinned load whose ``plan_id`` no longer matches is refused as ``plan-changed`` (409)
with these lines, e.g. ``fxserver's GTX 1050 Ti #0 now has 2.1 GB free, was 3.9 GB``
or ``fellow laptop-2 went away``. Changes that touch the plan's own cards come first.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from p2pswarm.planner import wording
from p2pswarm.planner.cluster import CardView, ClusterView, Fellow


def _amount(n_bytes: int) -> str:
    return wording.gb(n_bytes)


def _moved(label: str, what: str, now: int, was: int) -> str:
    a, b = _amount(now), _amount(was)
    if a == b:  # below the GB rounding: say it in MB rather than "3.9 GB, was 3.9 GB"
        a, b = f"{now / 1e6:,.0f} MB", f"{was / 1e6:,.0f} MB"
    return f"{label} now has {a} {what}, was {b}"


def _card_changes(fellow: Fellow, old: CardView, new: CardView) -> list[str]:
    label = wording.fellows_card(fellow.name, new.kind, new.index, new.name)
    out = []
    if old.total_bytes != new.total_bytes:
        out.append(_moved(label, "in all", new.total_bytes, old.total_bytes))
    if old.free_bytes != new.free_bytes:
        out.append(_moved(label, "free", new.free_bytes, old.free_bytes))
    if (old.flops, old.mem_bandwidth, old.speed_measured) != \
            (new.flops, new.mem_bandwidth, new.speed_measured):
        out.append(f"{label}'s speed changed")
    return out


def _fellow_changes(old: Fellow | None, new: Fellow | None) -> list[str]:
    if old is None and new is not None:
        return [f"fellow {new.name} joined"]
    if new is None and old is not None:
        return [f"fellow {old.name} went away"]
    assert old is not None and new is not None
    out = []
    if old.connected != new.connected:
        out.append(f"fellow {new.name} " + ("is connected again" if new.connected
                                            else "is not connected"))
    if old.training != new.training:
        out.append(f"fellow {new.name} " + ("started training" if new.training
                                            else "stopped training"))
    old_cards = {c.key: c for c in old.cards}
    new_cards = {c.key: c for c in new.cards}
    for key in sorted(old_cards.keys() | new_cards.keys()):
        a, b = old_cards.get(key), new_cards.get(key)
        if a is not None and b is None:
            out.append(f"{wording.fellows_card(old.name, a.kind, a.index, a.name)} is gone")
        elif b is not None and a is None:
            out.append(f"{wording.fellows_card(new.name, b.kind, b.index, b.name)} appeared")
        elif a is not None and b is not None:
            out.extend(_card_changes(new, a, b))
    return out


def diff_views(old: ClusterView, new: ClusterView, plan: Any = None) -> list[str]:
    """Lines naming what differs from ``old`` to ``new``; with a plan (a ``Plan`` or its
    dict), the fellows it runs on come first, in stage order."""
    first: list[str] = []
    if plan is not None:
        stages = plan["stages"] if isinstance(plan, Mapping) else [s.to_dict() for s in plan.stages]
        for s in stages:
            if s["fellow_id"] not in first:
                first.append(s["fellow_id"])
    ids = sorted({f.id for f in old.fellows} | {f.id for f in new.fellows},
                 key=lambda i: (first.index(i) if i in first else len(first), i))
    out = []
    for fid in ids:
        out.extend(_fellow_changes(old.fellow(fid), new.fellow(fid)))
    names = {f.id: f.name for f in (*old.fellows, *new.fellows)}
    for attr, words in (("default_link", "the default link"), ("local_link", "the local link")):
        if getattr(old, attr) != getattr(new, attr):
            out.append(f"{words} changed")
    old_links, new_links = dict(old.links), dict(new.links)
    for pair in sorted(old_links.keys() | new_links.keys()):
        if old_links.get(pair) != new_links.get(pair):
            a, b = pair
            out.append(f"the link between {names.get(a, a)} and {names.get(b, b)} changed")
    return out


def _dtype_changes(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """A card whose stage's weights dtype changed (``auto``): ``pi-1's CPU now takes
    int4 weights, it took int8 (int4: f16 needs ...)``."""
    def dtypes(plan: Mapping[str, Any]) -> dict[tuple[Any, Any, Any], Mapping[str, Any]]:
        return {(s.get("fellow_id"), s.get("kind"), s.get("index")): s
                for s in plan.get("stages", ()) if isinstance(s, Mapping)}

    was, now = dtypes(old), dtypes(new)
    out = []
    for key, stage in now.items():
        before = was.get(key)
        if before is None or not stage.get("weights_dtype") or \
                before.get("weights_dtype") == stage.get("weights_dtype"):
            continue
        label = wording.fellows_card(str(stage.get("fellow")), str(stage.get("kind")),
                                     int(stage.get("index") or 0), str(stage.get("name")))
        why = f" ({stage['dtype_reason']})" if stage.get("dtype_reason") else ""
        took = before.get("weights_dtype") or "the request's"
        out.append(f"{label} now takes {stage['weights_dtype']} weights, it took {took}{why}")
    return out


def diff_plans(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """Lines naming what differs between two plan dicts (``Plan.to_dict()``) made for the
    same request: works from the plans alone, e.g. on a client that kept the old one."""
    def cards(plan: Mapping[str, Any]) -> dict[tuple[str, str, int], Mapping[str, Any]]:
        return {(c["fellow_id"], c["kind"], c["index"]): c for c in plan.get("cards", ())}

    a, b = cards(old), cards(new)
    order = [(s["fellow_id"], s["kind"], s["index"]) for s in old.get("stages", ())]
    keys = sorted(a.keys() | b.keys(),
                  key=lambda k: (order.index(k) if k in order else len(order), k[0],
                                 k[1], k[2]))
    old_fellows = {k[0] for k in a}
    new_fellows = {k[0] for k in b}
    out: list[str] = []
    said: set[str] = set()
    for key in keys:
        was, now = a.get(key), b.get(key)
        card = now or was
        assert card is not None
        label = wording.fellows_card(card["fellow"], card["kind"], card["index"], card["name"])
        fid = key[0]
        if now is None:
            if fid not in new_fellows:
                if fid not in said:
                    out.append(f"fellow {card['fellow']} went away")
                    said.add(fid)
            else:
                out.append(f"{label} is gone")
            continue
        if was is None:
            if fid not in old_fellows:
                if fid not in said:
                    out.append(f"fellow {card['fellow']} joined")
                    said.add(fid)
            else:
                out.append(f"{label} appeared")
            continue
        flagged = {wording.NOT_CONNECTED: "is not connected", wording.TRAINING: "is training"}
        for reason, words in flagged.items():
            if now.get("reason") == reason and was.get("reason") != reason and fid not in said:
                out.append(f"fellow {card['fellow']} {words}")
                said.add(fid)
        if was["total_bytes"] != now["total_bytes"]:
            out.append(_moved(label, "in all", now["total_bytes"], was["total_bytes"]))
        if was["free_bytes"] != now["free_bytes"]:
            out.append(_moved(label, "free", now["free_bytes"], was["free_bytes"]))
    out += _dtype_changes(old, new)
    old_strip = old.get("layout", {}).get("strip_text", "")
    new_strip = new.get("layout", {}).get("strip_text", "")
    if old_strip != new_strip:
        out.append(f"the layers now run {new_strip or 'nowhere'}; "
                   f"they ran {old_strip or 'nowhere'}")
    elif old.get("plan_id") != new.get("plan_id") and not out:
        out.append("the cards' byte claims changed")
    return out


__all__ = ["diff_plans", "diff_views"]
