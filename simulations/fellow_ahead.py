"""A fellow a term ahead of the live leader: seconds until it follows, in virtual time.

    python simulations/fellow_ahead.py [--seeds 10] [--timeout 600]

The chaos run's 11:02 stall (issue 20) as ``p2pswarm.sim.election_churn`` builds it:
five fellows on the in-memory network follow a leader; one of them comes back from its
record of a candidacy it lost above the leader's term (its vote its own), so the
leader's beats and proofs are of an earlier term than its own. Prints, per seed, the
virtual seconds from its restart until all five follow one leader, then the median and
the maximum; a seed that reaches ``--timeout`` says so.
"""

from __future__ import annotations

import argparse
import logging
import statistics

import trio

from p2pswarm.sim.election_churn import fellow_a_term_ahead
from p2pswarm.sim.virtual import JumpClock


def timed_out(error: BaseException) -> bool:
    if isinstance(error, trio.TooSlowError):
        return True
    return any(timed_out(e) for e in getattr(error, "exceptions", ()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="virtual seconds to wait for one leader of all five")
    args = parser.parse_args()
    logging.getLogger("p2pswarm").setLevel(logging.ERROR)  # the fellows' own events
    took = []
    for seed in range(1, args.seeds + 1):
        seconds = float("inf")
        try:
            seconds = trio.run(fellow_a_term_ahead, seed, args.timeout, clock=JumpClock())
        except Exception as error:  # (a nursery's group around it)
            if not timed_out(error):
                raise
            print(f"seed {seed}: no one leader of all five within {args.timeout:.0f} s",
                  flush=True)
        else:
            print(f"seed {seed}: one leader of all five {seconds:.2f} s after the restart",
                  flush=True)
        took.append(seconds)
    print(f"median {statistics.median(took):.2f} s, max {max(took):.2f} s "
          f"({len(took)} seeds)")


if __name__ == "__main__":
    main()
