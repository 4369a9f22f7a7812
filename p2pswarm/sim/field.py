"""Field scenarios: the election paths a user walks into, on real `join` processes.

- ``seed_last``: two fellows point at a seed that starts once both have tried it in
  vain a few times, as when the machine everyone names boots last. A lone seed must
  not win a term on its own while the others are knocking: the whole swarm ends up with
  one leader per term.
- ``leave_then_leader_crash``: four fellows; one leaves (``p2pswarm leave``); then the
  leader is killed. The two left must elect a new leader within seconds (a leave shrinks
  the electorate), and after every fellow is restarted from its own state directory, on
  its own address, the swarm has a leader again.

Whom each fellow followed in each term comes from its own log (its ``leader`` events),
so a term followed to two different leaders is caught even if it lasted a moment.
"""

from __future__ import annotations

import random
import re
import signal
import socket
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from p2pswarm.errors import ControlError, SwarmError
from p2pswarm.sim.commands import cli, poll
from p2pswarm.sim.processes import LocalSwarm

# "12:00:01 INFO    b: leader a (aa5eee8d): leader a (term 3)" or "...: leader of term 3"
_LEADER_LINE = re.compile(r"\s(\S+): leader \S+ \(([0-9a-f]{8})\): leader .*term (\d+)\)?$")


def _ephemeral_floor() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A loopback port free for both UDP and TCP now, drawn below the kernel's ephemeral
    range: a fellow that is restarted on its old port must not find it taken by some
    process's outgoing connection, nor by a port another test drew at the same time."""
    floor = _ephemeral_floor()
    draw = random.Random()
    for _ in range(200):
        port = draw.randrange(10000, max(10001, floor))
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as tcp, \
                    socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
                tcp.bind(("127.0.0.1", port))
                udp.bind(("127.0.0.1", port))
        except OSError:
            continue
        return port
    raise SwarmError("no free loopback port found below the ephemeral range")


def free_address() -> str:
    """A loopback address no one listens on now (UDP and TCP share the port)."""
    return f"127.0.0.1:{free_port()}"


def followed_per_term(swarm: LocalSwarm) -> dict[int, set[str]]:
    """Per term, the leaders (id prefixes) the fellows followed, from every fellow's log
    (by id: a fellow may not know the leader's name yet when it first follows it)."""
    terms: dict[int, set[str]] = {}
    for name in swarm.homes:
        log = swarm.root / f"{name}.log"
        if not log.exists():
            continue
        for line in log.read_text(errors="replace").splitlines():
            found = _LEADER_LINE.search(line)
            if found:
                terms.setdefault(int(found.group(3)), set()).add(found.group(2))
    return terms


def two_leaders(terms: dict[int, set[str]]) -> dict[int, list[str]]:
    return {t: sorted(leaders) for t, leaders in terms.items() if len(leaders) > 1}


def one_leader(swarm: LocalSwarm, names: Iterable[str]) -> tuple[str, int] | None:
    """The leader (name, term) every one of ``names`` follows, if they agree."""
    seen = set()
    for name in names:
        try:
            leader = swarm.status(name).get("leader")
        except ControlError:
            return None
        if not leader:
            return None
        seen.add((leader["name"], leader["term"]))
    return seen.pop() if len(seen) == 1 else None


def member_state(swarm: LocalSwarm, observer: str, name: str) -> str | None:
    try:
        members = swarm.status(observer)["members"]
    except ControlError:
        return None
    return next((m["state"] for m in members if m["name"] == name), None)


def knocked(swarm: LocalSwarm, name: str, seed: str) -> bool:
    """Whether fellow ``name`` has tried ``seed`` in vain a few times (``rejoin``'s hint
    that the seed did not answer, in its log)."""
    log = swarm.root / f"{name}.log"
    return log.exists() and f"the seed {seed} did not answer" in log.read_text(
        errors="replace")


def seed_last(swarm: LocalSwarm) -> dict[str, Any]:
    """Two joiners first, their seed once both have knocked on it in vain; then one
    leader for all three."""
    seed = free_address()
    for name in ("b", "c"):
        swarm.launch(name, seeds=(seed,))
    for name in ("b", "c"):
        swarm.address(name)
    # the scenario itself: the seed boots late, while both joiners keep knocking
    poll("both joiners knocking on the seed", lambda: all(
        knocked(swarm, name, seed) for name in ("b", "c")), 60)
    swarm.launch("a", listen=seed)
    swarm.address("a")
    started = time.monotonic()
    leader = poll("one leader for all three", lambda: one_leader(swarm, ("a", "b", "c")), 60)
    return {"leader": leader[0], "term": leader[1],
            "leader_after_s": round(time.monotonic() - started, 2),
            "two_leaders": two_leaders(followed_per_term(swarm))}


def leave_then_leader_crash(swarm: LocalSwarm) -> dict[str, Any]:
    """Four fellows; one leaves; the leader is killed; then all are restarted."""
    names = ["a", "b", "c", "d"]
    addresses = {name: free_address() for name in names}
    for name in names:
        seeds: tuple[str, ...] = () if name == "a" else (addresses["a"],)
        swarm.launch(name, seeds=seeds, listen=addresses[name])
    for name in names:
        swarm.address(name)
    first = poll("one leader for all four", lambda: one_leader(swarm, names), 60)
    leaver = next(n for n in names if n != first[0])
    cli("leave", "--home", str(swarm.homes[leaver]), timeout_s=30, check=True)
    rest = [n for n in names if n != leaver]

    def recorded() -> str | None:
        states = {member_state(swarm, n, leaver) for n in rest}
        return states.pop() if len(states) == 1 and states <= {"left", "dead"} else None

    recorded_as = poll(f"{leaver}'s leave to be recorded", recorded, 30)
    swarm.processes[leaver].wait(timeout=30)
    swarm.processes[first[0]].send_signal(signal.SIGKILL)
    swarm.processes[first[0]].wait()
    killed_at = time.monotonic()
    survivors = [n for n in rest if n != first[0]]
    second = poll("a new leader after the crash", lambda: (
        lambda ld: ld if ld and ld[1] > first[1] else None)(one_leader(swarm, survivors)), 60)
    new_leader_s = time.monotonic() - killed_at
    # everyone down, then back from the same homes on the same addresses
    for name in survivors:
        swarm.processes[name].send_signal(signal.SIGKILL)
        swarm.processes[name].wait()
    for name in names:
        seeds = tuple(addresses[n] for n in names if n != name)
        swarm.launch(name, seeds=seeds, listen=addresses[name])
    for name in names:
        swarm.address(name)
    restarted = time.monotonic()
    third = poll("a leader after restarting everyone", lambda: one_leader(swarm, names), 60)
    return {"first": first, "leaver": leaver, "leave_recorded_as": recorded_as,
            "second": second, "new_leader_s": round(new_leader_s, 2), "third": third,
            "restart_leader_s": round(time.monotonic() - restarted, 2),
            "two_leaders": two_leaders(followed_per_term(swarm))}


__all__ = ["followed_per_term", "free_address", "leave_then_leader_crash", "one_leader",
           "seed_last", "two_leaders"]
