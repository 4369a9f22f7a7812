"""A leader thawed after its successor died: seconds to the next leader, in virtual time.

    python simulations/thawed_leader.py [--seeds 10] [--timeout 600]

The chaos run's 10:02 stall (issue 20) as ``p2pswarm.sim.election_churn`` builds it:
five fellows on the in-memory network, one dead; the leader frozen (SIGSTOP) and cut off
until the others have declared it dead and elected a successor; then thawed, still
leading its old term, as the successor is killed. Three of five are up, a majority only
with the thawed fellow. Prints, per seed, the virtual seconds from the kill until the
three follow one leader of a later term, then the median and the maximum.
"""

from __future__ import annotations

import argparse
import logging
import statistics

import trio

from p2pswarm.sim.election_churn import thawed_stale_leader
from p2pswarm.sim.virtual import JumpClock


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="virtual seconds to wait for the next leader")
    args = parser.parse_args()
    logging.getLogger("p2pswarm").setLevel(logging.ERROR)  # the fellows' own events
    took = []
    for seed in range(1, args.seeds + 1):
        seconds = trio.run(thawed_stale_leader, seed, args.timeout, clock=JumpClock())
        took.append(seconds)
        print(f"seed {seed}: a leader {seconds:.2f} s after the kill", flush=True)
    print(f"median {statistics.median(took):.2f} s, max {max(took):.2f} s "
          f"({len(took)} seeds)")


if __name__ == "__main__":
    main()
