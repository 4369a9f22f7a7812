"""The sharded all-reduce of a stage's deltas, measured: bytes per fellow per round.

N fellows (4, 8, 16, 32) each hold one replica of a stage of ``--numel`` parameters; one
round of ``agent.training.allreduce`` runs in virtual time over ``MemoryPartNet`` (every
message encoded and decoded as on the wire, counted each way). The figure is the busiest
fellow's bytes (sent, and received) over one replica's compressed delta: about
2 (N - 1) / N plus the codec's overhead per part, whatever N; a hub keeper would receive
N - 1 deltas and send N - 1 updates. Codecs: int8 (8 bits) and qsgd at 4 bits.

It also kills one fellow mid-round (N = 8) and reports when the survivors applied the
round (virtual seconds; its deadline is 60 s) and whether they stayed bit-equal.

Run:  python simulations/bench_allreduce.py [--numel 262144]
About half a minute of CPU.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch
import trio
import trio.testing

from p2pswarm.agent.training.allreduce import AllReduceFellow, MemoryPartNet
from p2pswarm.training.allreduce import PartedSync
from p2pswarm.training.codec import make_codec
from p2pswarm.training.job import SyncConfig
from p2pswarm.training.sync import LocalSync

CODECS: dict[str, SyncConfig] = {
    "int8": SyncConfig(codec="int8"),
    "qsgd-4bit": SyncConfig(codec="qsgd", codec_options=(("bits", 4),)),
}


def fellows(n: int, numel: int, config: SyncConfig, net: MemoryPartNet
            ) -> list[AllReduceFellow]:
    generator = torch.Generator().manual_seed(n)
    start = torch.randn(numel, generator=generator)
    names = [f"f{i}" for i in range(n)]
    out = []
    for i, name in enumerate(names):
        p = start.clone()
        local = LocalSync([p], config, noise_seed=i)
        p.add_(0.01 * torch.randn(numel, generator=generator))
        out.append(AllReduceFellow(name, names, PartedSync(local, n), net, net.attach(name),
                                   round_deadline_s=config.round_deadline_s))
    return out


async def one_round(group: list[AllReduceFellow], kill: str | None = None,
                    net: MemoryPartNet | None = None) -> dict[str, float]:
    finished: dict[str, float] = {}
    scopes = {f.name: trio.CancelScope() for f in group}
    rounds_of = {f.name: trio.CancelScope() for f in group}

    async def run(f: AllReduceFellow, *,
                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with scopes[f.name]:
            await f.run(task_status=task_status)

    async def reduce(f: AllReduceFellow) -> None:
        with rounds_of[f.name]:
            await f.reduce(8)
            finished[f.name] = trio.current_time()

    async with trio.open_nursery() as nursery:
        for f in group:
            await nursery.start(run, f)
        async with trio.open_nursery() as rounds:
            for f in group:
                rounds.start_soon(reduce, f)
            if kill is not None and net is not None:
                await trio.sleep(0.015)
                net.kill(kill)
                scopes[kill].cancel()
                rounds_of[kill].cancel()
                await trio.sleep(0.5)  # membership notices
                for f in group:
                    if f.name != kill:
                        f.down(kill)
        nursery.cancel_scope.cancel()
    return finished


def measure(numel: int) -> dict[str, Any]:
    rows = []
    for codec, config in CODECS.items():
        one = make_codec(config.codec, **config.codec_kwargs()).encode(torch.randn(numel))
        for n in (4, 8, 16, 32):
            net = MemoryPartNet(latency_s=0.01)
            group = fellows(n, numel, config, net)
            trio.run(one_round, group, clock=trio.testing.MockClock(autojump_threshold=0))
            sent, got = max(net.sent_bytes.values()), max(net.received_bytes.values())
            rows.append({"codec": codec, "fellows": n, "delta_bytes": one.nbytes,
                         "busiest_sent": sent, "busiest_received": got,
                         "ratio": max(sent, got) / one.nbytes,
                         "hub_ratio": n - 1})
    net = MemoryPartNet(latency_s=0.01)
    group = fellows(8, numel, CODECS["int8"], net)
    finished = trio.run(one_round, group, "f1", net,
                        clock=trio.testing.MockClock(autojump_threshold=0))
    survivors = [f for f in group if f.name != "f1"]
    anchors = [f.sync.params() for f in survivors]  # type: ignore[attr-defined]
    equal = all(torch.equal(a, anchors[0]) for a in anchors)
    return {"rows": rows, "kill": {"survivors_done": len(finished),
                                   "last_done_s": max(finished.values()),
                                   "bit_equal": equal}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=1 << 18,
                        help="parameters of the stage (default 262144)")
    args = parser.parse_args(argv)
    if args.numel < 1024:
        print("--numel must be at least 1024", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    result = measure(args.numel)
    print(f"{'codec':<10} {'fellows':>7} {'delta B':>9} {'busiest sent':>12} "
          f"{'busiest recv':>12} {'/ delta':>7} {'hub':>5}")
    for r in result["rows"]:
        print(f"{r['codec']:<10} {r['fellows']:>7} {r['delta_bytes']:>9} "
              f"{r['busiest_sent']:>12} {r['busiest_received']:>12} {r['ratio']:>7.2f} "
              f"{r['hub_ratio']:>5}")
    kill = result["kill"]
    print(f"8 fellows, one killed mid-round: {kill['survivors_done']} survivors applied the "
          f"round by {kill['last_done_s']:.2f} s (deadline 60 s), bit-equal: "
          f"{kill['bit_equal']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
