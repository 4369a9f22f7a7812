"""The fleet training plan on the target fleet: aggregate tokens/s against one pipeline.

    python simulations/bench_fleet.py                      # 1.1B Llama shape, the table
    python simulations/bench_fleet.py --model DIR|NAME     # any model the planner reads
    python simulations/bench_fleet.py --json               # the numbers

    python simulations/bench_fleet.py --seq-len 512 --bandwidth 1.25e6 --latency 0.04

On simulations/clusters/fleet.json (2 servers, 10 desktops, 6 laptops, 20 Raspberry Pi
4s on WiFi links of 4 MB/s, the laptops and Pis behind three access points of 20 MB/s),
full training in bf16 with AdamW and the plan's defaults: ``micro_batch: "auto"``,
``replicas: "auto"``, int8 sync by a sharded all-reduce every ``--inner-steps`` steps
of the fastest replica (``auto``: sized so a round's communication is at most a third
of its compute). ``--bandwidth``/``--latency`` set every link between two fellows.
Prints every replica (its cards, its batch, its tokens/s), the cards left out, then the
figure: the fellows used, the fleet's estimated tokens/s against the best single-pipeline
plan the planner makes on the same file (its default and ``--maximize speed`` plans,
each with the same batch rule), the round's communication against its compute, and the
busiest fellow's bytes a round against one replica's compressed delta. All of it is the
planner's estimate (no training runs): deterministic, so no load average applies.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from p2pswarm.models.files import read_model_config  # noqa: E402
from p2pswarm.planner import cluster_from_dict, fleet_plan_message  # noqa: E402

FLEET = ROOT / "simulations" / "clusters" / "fleet.json"
# TinyLlama-1.1B's published shape: the "1B Llama-shaped model" of the figure
LLAMA_1B = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 2048,
            "intermediate_size": 5632, "num_hidden_layers": 22, "num_attention_heads": 32,
            "num_key_value_heads": 4, "max_position_embeddings": 2048,
            "tie_word_embeddings": False, "hidden_act": "silu"}


def figure(model: str | None, cluster: Path, seq_len: int, inner_steps: int | str,
           codec: str, bandwidth: float | None = None,
           latency: float | None = None) -> dict[str, Any]:
    if model is None:
        name, config = "llama-1.1b (TinyLlama shape)", LLAMA_1B
    else:
        name, config = read_model_config(model)
    data = json.loads(cluster.read_text())
    if bandwidth is not None or latency is not None:  # every link between two fellows
        default = dict(data.get("links", {}).get("default") or {})
        if bandwidth is not None:
            default["bandwidth_bytes_s"] = bandwidth
        if latency is not None:
            default["latency_s"] = latency
        data["links"] = {**data.get("links", {}), "default": default}
    view = cluster_from_dict(data)
    message = {"model": {"name": name, "config": config}, "kind": "train",
               "seq_len": seq_len, "weights_dtype": "bf16", "optimizer": "adamw",
               "replicas": "auto", "inner_steps": inner_steps, "codec": codec}
    return fleet_plan_message(message, view)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="a model directory, config.json or known name "
                        "(default: the 1.1B Llama shape)")
    parser.add_argument("--cluster", type=Path, default=FLEET)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--inner-steps", default="auto",
                        help="auto (sized to the links, the default) or a number")
    parser.add_argument("--bandwidth", type=float, help="bytes/s of every link between two "
                        "fellows (default: the file's), e.g. 1.25e6")
    parser.add_argument("--latency", type=float, help="seconds of every link's latency")
    parser.add_argument("--codec", default="int8")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    inner: int | str = args.inner_steps if args.inner_steps == "auto" else int(args.inner_steps)
    plan = figure(args.model, args.cluster, args.seq_len, inner, args.codec, args.bandwidth,
                  args.latency)
    fleet = plan["fleet"]
    rnd = fleet["round"] or {}
    result = {
        "model": plan["model"], "cluster": str(args.cluster), "seq_len": args.seq_len,
        "replicas": len(plan["replicas"]), "fleet_tokens_per_s": fleet["tokens_per_s"],
        "single_pipeline_tokens_per_s": fleet["single_pipeline_tokens_per_s"],
        "speedup": fleet["speedup"], "round": rnd, "plan_id": plan["plan_id"],
        "cards_used": sum(c["used"] for c in plan["cards"]), "cards": len(plan["cards"]),
        "per_replica": [{"stages": len(r["stages"]), "micro_batch": r["micro_batch"],
                         "micro_batches": r["micro_batches"],
                         "tokens_per_s": r["tokens_per_s"],
                         "fellows": [s["fellow"] for s in r["stages"]]}
                        for r in plan["replicas"]],
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{plan['model']['name']} on {args.cluster.name}: {fleet['sentence']}")
    for r in result["per_replica"]:
        print(f"  {r['stages']} stage(s), micro-batch {r['micro_batch']} x "
              f"{r['micro_batches']}, {r['tokens_per_s']:.1f} tokens/s: "
              f"{', '.join(r['fellows'])}")
    print(f"cards used {result['cards_used']} of {result['cards']}")
    for ap in rnd.get("access_points") or ():
        print(f"access point {ap['name']}: {ap['air_bytes'] / 1e9:.2f} GB over the air a "
              f"round, {ap['seconds']:,.0f} s")
    print(f"FIGURE fellows used {result['cards_used']} of {result['cards']}; aggregate "
          f"{result['fleet_tokens_per_s']:.1f} tokens/s = "
          f"{result['speedup']:.2f}x the best single pipeline "
          f"({result['single_pipeline_tokens_per_s']:.1f} tokens/s); round communication "
          f"{rnd.get('comm_s', 0):,.0f} s = {rnd.get('comm_fraction', 0):.2f} of its compute "
          f"({rnd.get('compute_s', 0):,.0f} s, {rnd.get('inner_steps')} steps"
          f"{', sized to the links' if rnd.get('inner_steps_auto') else ''}); busiest "
          f"fellow {rnd.get('busiest_fellow')} sends {rnd.get('busiest_bytes', 0) / 1e9:.2f} "
          f"GB = {rnd.get('busiest_over_delta', 0):.2f}x one replica's compressed delta")


if __name__ == "__main__":
    main()
