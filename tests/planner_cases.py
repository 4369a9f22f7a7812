"""Clusters and models for the planner tests: cards, fellows and clusters as the cluster
file writes them, a model whose layers make 1-2 GB cards interesting, random clusters,
and the reference clusters of ``simulations/clusters``."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from p2pswarm.planner import (
    ModelProfile,
    Plan,
    cluster_from_dict,
    plan,
    profile_from_config,
    request_from_dict,
)

REFERENCE = Path(__file__).resolve().parent.parent / "simulations" / "clusters" / "reference.json"
GB = 10**9
MB = 10**6

# a model whose layers are tens of MB, so clusters of 1-2 GB cards are interesting
MID_CONFIG: dict[str, Any] = {
    "model_type": "llama", "vocab_size": 32000, "hidden_size": 1024,
    "intermediate_size": 2816, "num_hidden_layers": 16, "num_attention_heads": 8,
    "num_key_value_heads": 4, "max_position_embeddings": 8192, "tie_word_embeddings": False,
}
MID = profile_from_config(MID_CONFIG, "mid")


def card(index: int = 0, kind: str = "cuda", free: float = 2.0, total: float | None = None,
         name: str | None = None, flops: float | None = 1e13, bw: float | None = 3e11,
         held: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    data: dict[str, Any] = {
        "index": index, "kind": kind, "name": name or ("CPU" if kind == "cpu" else "GPU"),
        "total_bytes": int((total if total is not None else free + 0.5) * GB),
        "free_bytes": int(free * GB), "held_by_others": held or []}
    if flops is not None:
        data["flops"] = flops
    if bw is not None:
        data["mem_bandwidth"] = bw
    return data


def fellow(fid: str, *cards: dict[str, Any], name: str | None = None, connected: bool = True,
           training: bool = False) -> dict[str, Any]:
    return {"id": fid, "name": name or fid, "connected": connected, "training": training,
            "cards": list(cards)}


def cluster(*fellows: dict[str, Any], links: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"fellows": list(fellows), "links": links or {}}


def make(profile: ModelProfile, data: dict[str, Any], **request: Any) -> Plan:
    return plan(profile, cluster_from_dict(data), request_from_dict(request))


def reference() -> dict[str, Any]:
    return json.loads(REFERENCE.read_text())


def random_cluster(rng: random.Random, n_cards: int) -> dict[str, Any]:
    fellows: dict[str, list[dict[str, Any]]] = {}
    for _ in range(n_cards):
        fid = f"f{rng.randint(0, 3)}"
        mine = fellows.setdefault(fid, [])
        kind = "cpu" if not any(c["kind"] == "cpu" for c in mine) and rng.random() < 0.3 \
            else "cuda"
        index = 0 if kind == "cpu" else sum(c["kind"] == "cuda" for c in mine)
        free = rng.uniform(0.35, 1.6)
        mine.append(card(index, kind, free=free, total=free + rng.uniform(0, 1),
                         flops=rng.uniform(1e10, 3e13), bw=rng.uniform(2e9, 9e11)))
    links: dict[str, Any] = {"default": {"bandwidth_bytes_s": rng.uniform(1e7, 1e9),
                                         "latency_s": rng.uniform(0, 3e-3)}}
    ids = sorted(fellows)
    if len(ids) > 1 and rng.random() < 0.5:
        links[f"{ids[0]}|{ids[1]}"] = {"bandwidth_bytes_s": rng.uniform(1e7, 1e9),
                                       "latency_s": rng.uniform(0, 3e-3)}
    return cluster(*(fellow(f, *cs) for f, cs in fellows.items()), links=links)
