"""Whether a fellow is a member of its swarm, from its ``p2pswarm status --json``: what a
container's health check asks, so that a rolling update (``docker/stack.yml``'s
``update_config``) moves on to the next fellow only once this one is back in the swarm.

    p2pswarm status --json | python3 -m p2pswarm.health

exits 0 when the fellow is a member, else 1 with one line saying why."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from typing import Any

MAX_STATUS_BYTES = 16 * 1024 * 1024  # a status of thousands of fellows fits


def why_not_member(status: Mapping[str, Any]) -> str | None:
    """None when the fellow names a leader that it sees alive (itself, when it leads a
    swarm of one); else what is missing, in words."""
    leader = status.get("leader")
    if not isinstance(leader, Mapping) or not leader.get("id"):
        return "names no leader yet"
    members = status.get("members")
    rows = members if isinstance(members, list) else []
    seen = next((m for m in rows if isinstance(m, Mapping) and m.get("id") == leader["id"]),
                None)
    if seen is None:
        return f"does not know its leader {leader.get('name')} as a member yet"
    if seen.get("state") != "alive":
        return f"sees its leader {leader.get('name')} {seen.get('state')}"
    return None


def is_member(status: Mapping[str, Any]) -> bool:
    return why_not_member(status) is None


def main() -> int:
    text = sys.stdin.read(MAX_STATUS_BYTES + 1)
    if len(text) > MAX_STATUS_BYTES:
        print("not a member: the status is too long to read", file=sys.stderr)
        return 1
    try:
        status = json.loads(text)
    except ValueError:
        print("not a member: no status (is the agent running?)", file=sys.stderr)
        return 1
    why = why_not_member(status) if isinstance(status, Mapping) else "the status is no object"
    if why is not None:
        print(f"not a member: {why}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
