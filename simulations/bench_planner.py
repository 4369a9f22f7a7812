"""Figures for the planner: speed of planning, optimality, and plans against other tools'.

    python simulations/bench_planner.py            # the table
    python simulations/bench_planner.py --json     # the numbers
    python simulations/bench_planner.py --quick    # fewer runs, for a smoke test

1. Planning time on 64 fellows x 4 cards (3 GPUs and a CPU each) with an 80-layer model
   (Llama-3.1-70B, f16): the median of one default plan and of ``maximize context``.
2. Optimality on 500 seeded random small clusters (1-6 cards, 2-16 layers): ``maximize
   speed`` against the exhaustive optimum of the same cost model, ``maximize context``
   against the exhaustive maximum (both enumerate every placement of the plan space).
3. The reference heterogeneous cluster (simulations/clusters/reference.json): estimated
   tokens/s of ``maximize speed`` against a split in proportion to free memory (exo's
   ring and llama.cpp's default tensor split) and a greedy fill counting weights only
   (Accelerate's ``device_map="auto"``), each scored with the same cost model, and which
   of theirs would run out of memory once the KV cache at the requested context counts.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from p2pswarm.models.files import load_profile
from p2pswarm.planner import cluster_from_dict, plan, request_from_dict
from p2pswarm.planner.cluster import ClusterView
from p2pswarm.planner.costs import CostModel
from p2pswarm.planner.exhaustive import fastest_exhaustive, most_tokens_exhaustive
from p2pswarm.planner.placement import Placement, Search, Slot, pipeline_order
from p2pswarm.planner.profile import ModelProfile, profile_from_config
from p2pswarm.planner.request import PlanRequest, resolve

REFERENCE = Path(__file__).resolve().parent / "clusters" / "reference.json"
GB = 10**9

GPU_CATALOG = [  # name, total GB, FLOP/s (f16), bytes/s
    ("RTX 4090", 24, 1.5e14, 9.5e11), ("RTX 3090", 24, 5.8e13, 8.1e11),
    ("RTX A4000", 16, 3.8e13, 4.2e11), ("RTX 3060", 12, 2.5e13, 3.3e11),
    ("GTX 1080 Ti", 11, 1.0e13, 4.4e11), ("RTX 2070", 8, 3.0e13, 4.0e11),
    ("GTX 1050 Ti", 4, 1.9e12, 9.8e10),
]


def big_cluster(seed: int, fellows: int = 64) -> dict[str, Any]:
    """``fellows`` machines with three GPUs and a CPU each; a few busy or gone."""
    rng = random.Random(seed)
    out = []
    for f in range(fellows):
        cards = []
        for i in range(3):
            name, total, flops, bw = rng.choice(GPU_CATALOG)
            held = []
            if rng.random() < 0.05:
                held = [{"pid": 100 + i, "name": "/usr/bin/game", "bytes": int(total * 0.9 * GB)}]
            free = 0.04 * total * GB if held else rng.uniform(0.55, 0.97) * total * GB
            cards.append({"index": i, "kind": "cuda", "name": name, "total_bytes": total * GB,
                          "free_bytes": int(free), "held_by_others": held, "flops": flops,
                          "mem_bandwidth": bw})
        ram = rng.choice([16, 32, 64])
        cards.append({"index": 0, "kind": "cpu", "name": "CPU", "total_bytes": ram * GB,
                      "free_bytes": int(rng.uniform(0.3, 0.8) * ram * GB),
                      "flops": rng.uniform(1e11, 6e11), "mem_bandwidth": rng.uniform(1.5e10, 5e10)})
        out.append({"id": f"{rng.getrandbits(48):012x}", "name": f"host-{f:02d}",
                    "connected": rng.random() > 0.02, "training": rng.random() < 0.02,
                    "cards": cards})
    return {"fellows": out, "links": {"default": {"bandwidth_bytes_s": 117e6,
                                                  "latency_s": 3e-4}}}


def median_ms(fn: Any, runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def planning_time(quick: bool) -> dict[str, Any]:
    profile = load_profile("llama-3.1-70b")
    clusters = [cluster_from_dict(big_cluster(seed)) for seed in range(3 if quick else 11)]
    runs = 3 if quick else 5
    default_req = request_from_dict({"context": 8192, "sequences": 8})
    context_req = request_from_dict({"maximize": "context", "sequences": 32})
    default_ms = statistics.median(median_ms(lambda v=v: plan(profile, v, default_req), runs)
                                   for v in clusters)
    context_ms = statistics.median(median_ms(lambda v=v: plan(profile, v, context_req), runs)
                                   for v in clusters)
    sample = plan(profile, clusters[0], context_req)
    return {"fellows": 64, "cards": 256, "layers": profile.n_layers,
            "default_plan_median_ms": round(default_ms, 2),
            "maximize_context_median_ms": round(context_ms, 2),
            "maximize_context_sample": sample.limit.sentence}


# --- optimality --------------------------------------------------------------------------------

def small_case(seed: int) -> tuple[ModelProfile, ClusterView, dict[str, Any]]:
    rng = random.Random(seed)
    layers = rng.randint(2, 16)
    profile = profile_from_config({
        "model_type": "llama", "vocab_size": rng.choice([259, 32000]),
        "hidden_size": rng.choice([512, 1024]), "intermediate_size": rng.choice([1408, 2816]),
        "num_hidden_layers": layers, "num_attention_heads": 8,
        "num_key_value_heads": rng.choice([2, 4, 8]), "max_position_embeddings": 4096,
        "tie_word_embeddings": rng.random() < 0.5}, f"random-{seed}")
    fellows: dict[str, list[dict[str, Any]]] = {}
    for _ in range(rng.randint(1, 6)):
        fid = f"f{rng.randint(0, 3)}"
        mine = fellows.setdefault(fid, [])
        cpu = not any(c["kind"] == "cpu" for c in mine) and rng.random() < 0.3
        free = rng.uniform(0.35, 1.6) * GB
        mine.append({"index": 0 if cpu else sum(c["kind"] == "cuda" for c in mine),
                     "kind": "cpu" if cpu else "cuda", "name": "card",
                     "total_bytes": int(free + rng.uniform(0, 1) * GB), "free_bytes": int(free),
                     "flops": rng.uniform(1e10, 3e13), "mem_bandwidth": rng.uniform(2e9, 9e11)})
    links: dict[str, Any] = {"default": {"bandwidth_bytes_s": rng.uniform(1e7, 1e9),
                                         "latency_s": rng.uniform(0, 3e-3)}}
    ids = sorted(fellows)
    if len(ids) > 1 and rng.random() < 0.5:
        links[f"{ids[0]}|{ids[1]}"] = {"bandwidth_bytes_s": rng.uniform(1e7, 1e9),
                                       "latency_s": rng.uniform(0, 3e-3)}
    view = cluster_from_dict({"fellows": [{"id": f, "cards": c} for f, c in fellows.items()],
                              "links": links})
    request = {"context": rng.choice([256, 1024, 2048, 4096]), "sequences": rng.randint(1, 16),
               "weights_dtype": rng.choice(["f32", "f16", "int8", "int4"]),
               "kv_dtype": rng.choice(["f32", "f16", "int8"]),
               "floors_bytes": {"cuda": 10**8, "cpu": 10**8}}
    return profile, view, request


def searches(profile: ModelProfile, view: ClusterView, r: PlanRequest) -> Any:
    slots = pipeline_order([Slot(f.id, c) for f in view.fellows for c in f.cards])
    pairs = {x for (a, b), _ in view.links for x in (a, b)}

    def at(tokens: int) -> Search:
        return Search(CostModel(profile, replace(r, context=tokens), tokens), slots, view.link,
                      lambda f: f in pairs)
    return at


def optimality(n: int) -> dict[str, Any]:
    speed_equal = context_equal = speed_feasible = context_feasible = 0
    worst_gap = 0.0
    for seed in range(n):
        profile, view, request = small_case(seed)
        fast = plan(profile, view, request_from_dict({**request, "maximize": "speed"}))
        r = resolve(request_from_dict(request), profile)
        at = searches(profile, view, r)
        best = fastest_exhaustive(at(r.context))
        if best is None:
            speed_equal += not fast.fits
        else:
            speed_feasible += 1
            ours = fast.estimate.time_per_token_s
            gap = (ours - best) / best
            worst_gap = max(worst_gap, gap)
            speed_equal += fast.fits and gap <= 1e-12
        most = plan(profile, view, request_from_dict({**request, "maximize": "context"}))
        exhaustive = most_tokens_exhaustive(at, profile.max_context, 256)
        ours_context = most.request.context if most.fits else 0
        context_feasible += exhaustive > 0
        context_equal += ours_context == exhaustive
    return {"clusters": n, "speed_optimal": speed_equal, "speed_feasible": speed_feasible,
            "speed_worst_relative_gap": worst_gap, "context_exact": context_equal,
            "context_feasible": context_feasible}


# --- against the others' splits ------------------------------------------------------------

def _split(layers: int, weights: list[int]) -> list[int]:
    """Layers in proportion to ``weights`` (largest remainder), at least one each."""
    total = sum(weights)
    parts = [max(1, layers * w // total) for w in weights]
    order = sorted(range(len(weights)), key=lambda i: -(layers * weights[i] / total - parts[i]))
    i = 0
    while sum(parts) < layers:
        parts[order[i % len(order)]] += 1
        i += 1
    while sum(parts) > layers:
        j = max(range(len(parts)), key=lambda k: parts[k])
        parts[j] -= 1
    return parts


def proportional_split(search: Search) -> Placement:
    """exo / llama.cpp: every card, layers in proportion to its free memory, cards with
    the most memory first (exo's ring order)."""
    order = sorted(range(len(search.slots)), key=lambda i: (-search.slots[i].card.free_bytes, i))
    order = order[:search.layers]
    parts = _split(search.layers, [search.slots[i].card.free_bytes for i in order])
    return tuple(zip(order, parts))


def greedy_fill(search: Search, view: ClusterView, file_order: list[str]) -> Placement:
    """Accelerate's ``device_map="auto"``: GPUs in order, then CPUs, each filled with
    layers while their weights (embeddings on the first, the head on the last) fit its
    free memory; activations and the KV cache are not counted."""
    p, wd = search.model.profile, search.model.weights_dtype
    index = {(s.fellow_id, s.card.kind, s.card.index): i for i, s in enumerate(search.slots)}
    rank = {fid: k for k, fid in enumerate(file_order)}
    devices = sorted(index, key=lambda key: (key[1] != "cuda", rank[key[0]], key[2]))
    layer = p.layer_weight_bytes(wd)
    placement: list[tuple[int, int]] = []
    placed = 0
    for key in devices:
        if placed == p.n_layers:
            break
        room = search.slots[index[key]].card.free_bytes
        room -= p.embed_bytes(wd) if placed == 0 else 0
        n = 0
        while placed + n < p.n_layers and room >= layer:
            room -= layer
            n += 1
        if n:
            placement.append((index[key], n))
            placed += n
    if placed < p.n_layers and placement:  # the rest would go to disk: keep it on the last
        i, n = placement[-1]
        placement[-1] = (i, n + p.n_layers - placed)
    return tuple(placement)


def overflow(search: Search, placement: Placement) -> list[str]:
    """Cards whose full claims (KV cache, workspace, ...) exceed their free memory."""
    out = []
    for pos, (i, n) in enumerate(placement):
        slot = search.slots[i]
        claims = search.model.claims(slot.card.kind, n, pos == 0, pos == len(placement) - 1)
        if claims.total > slot.card.free_bytes:
            out.append(f"{slot.fellow_id}:{slot.card.kind}{slot.card.index} short by "
                       f"{(claims.total - slot.card.free_bytes) / GB:.1f} GB")
    return out


REFERENCE_CASES = [
    ("llama-3-8b", {"context": 8192}),
    ("llama-2-13b", {"context": 4096}),
    ("qwen2-7b", {"context": 32768}),
    ("llama-3.1-8b", {"context": 65536}),
    ("llama-3.1-70b", {"context": 8192, "weights_dtype": "int4"}),
]


def against_others() -> list[dict[str, Any]]:
    data = json.loads(REFERENCE.read_text())
    view = cluster_from_dict(data)
    names = {f["id"]: f["name"] for f in data["fellows"]}
    file_order = [f["id"] for f in data["fellows"]]
    rows = []
    for model, request in REFERENCE_CASES:
        profile = load_profile(model)
        ours = plan(profile, view, request_from_dict({**request, "maximize": "speed"}))
        r = resolve(request_from_dict(request), profile)
        search = searches(profile, view, r)(r.context)
        row: dict[str, Any] = {"model": model, **request,
                               "ours_tokens_per_s": ours.estimate.tokens_per_s,
                               "ours_fits": ours.fits, "ours_stages": ours.strip_text}
        for label, placement in (("proportional", proportional_split(search)),
                                 ("greedy", greedy_fill(search, view, file_order))):
            short = overflow(search, placement)
            for fid, name in names.items():
                short = [s.replace(fid, name) for s in short]
            row[f"{label}_tokens_per_s"] = 1 / search.time_s(placement)
            row[f"{label}_out_of_memory"] = short
        better = max(row["proportional_tokens_per_s"], row["greedy_tokens_per_s"])
        row["speedup_vs_better"] = row["ours_tokens_per_s"] / better
        # a split that runs out of memory does not run: compare with theirs that fit too
        fitting = [row[f"{k}_tokens_per_s"] for k in ("proportional", "greedy")
                   if not row[f"{k}_out_of_memory"]]
        row["speedup_vs_better_that_fits"] = (row["ours_tokens_per_s"] / max(fitting)
                                              if fitting else None)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print the numbers as JSON")
    parser.add_argument("--quick", action="store_true", help="fewer runs and clusters")
    args = parser.parse_args()
    timing = planning_time(args.quick)
    optimal = optimality(60 if args.quick else 500)
    rows = against_others()
    if args.json:
        print(json.dumps({"planning_time": timing, "optimality": optimal, "reference": rows},
                         indent=2))
        return
    print("Planning time, 64 fellows x 4 cards, 80-layer model (Llama-3.1-70B f16)")
    print(f"  one plan (default, 8 sequences x 8,192):  median {timing['default_plan_median_ms']}"
          f" ms")
    print(f"  maximize context (32 sequences):          median "
          f"{timing['maximize_context_median_ms']} ms")
    print(f"  ({timing['maximize_context_sample']})")
    print()
    print(f"Optimality on {optimal['clusters']} seeded random small clusters "
          "(1-6 cards, 2-16 layers)")
    print(f"  maximize speed = exhaustive optimum:  {optimal['speed_optimal']}/"
          f"{optimal['clusters']} ({optimal['speed_feasible']} feasible; worst relative gap "
          f"{optimal['speed_worst_relative_gap']:.1e})")
    print(f"  maximize context = exhaustive maximum: {optimal['context_exact']}/"
          f"{optimal['clusters']} ({optimal['context_feasible']} hold some context)")
    print()
    print("Reference cluster (GTX 1050 Ti + RTX 3090 desktops, 2 laptops, 4 Raspberry Pi 4)")
    print(f"  {'model':<14} {'request':<16} {'ours':>7} {'prop.':>7} {'greedy':>7} "
          f"{'x best':>6} {'x fits':>6}  out of memory once the KV cache counts")
    for row in rows:
        req = f"ctx {row['context']:,}" + (f" {row['weights_dtype']}"
                                          if "weights_dtype" in row else "")
        oom = []
        if row["proportional_out_of_memory"]:
            oom.append("proportional: " + ", ".join(row["proportional_out_of_memory"]))
        if row["greedy_out_of_memory"]:
            oom.append("greedy: " + ", ".join(row["greedy_out_of_memory"]))
        fits = row["speedup_vs_better_that_fits"]
        print(f"  {row['model']:<14} {req:<16} {row['ours_tokens_per_s']:>7.2f} "
              f"{row['proportional_tokens_per_s']:>7.2f} {row['greedy_tokens_per_s']:>7.2f} "
              f"{row['speedup_vs_better']:>6.1f} {'-' if fits is None else f'{fits:.1f}':>6}  "
              f"{'; '.join(oom) or '-'}")
    print("  tokens/s estimated by the planner's cost model for all three splits; x best: ours"
          " over the faster of theirs; x fits: over the faster of theirs that fits")


if __name__ == "__main__":
    main()
