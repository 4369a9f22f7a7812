"""The sessions a driver keeps between the turns of a chat, and which one a new prompt
can continue.

A chat resends the whole conversation every turn. When a generation asked to be
remembered ends, its stages keep the session's KV cache in its slot (``SessionEnd.keep``)
and this fellow notes the tokens that cache holds: the prompt and every generated token
but the last (the last was never fed back). A later prompt that begins with some of those
tokens continues that session from the longest such prefix (``SessionOpen.resume_from``),
so stage 0 prefills only what is new; a prefix shorter than half the kept tokens (another
chat's opening) is not worth ending that conversation's cache for. Stages evict kept
caches, least recently kept first, when a new session needs their slot: the KV budget of
the plan bounds them, and a prefix found here may be gone there (the driver then starts
the session afresh). A kept session is taken out while a generation uses it, so two
never share one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Kept:
    session: str
    tokens: tuple[int, ...]  # what the stages' caches of the session hold, in order


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class PrefixCache:
    """Per load (``plan_id``): kept sessions, least recently used first, at most
    ``limit`` (the load's slots: its stages cannot keep more)."""

    def __init__(self) -> None:
        self._kept: dict[str, list[Kept]] = {}

    def kept(self, plan_id: str) -> tuple[Kept, ...]:
        return tuple(self._kept.get(plan_id, ()))

    def take(self, plan_id: str, ids: Sequence[int]) -> tuple[str, int] | None:
        """The kept session sharing the longest prefix with ``ids`` and how many of its
        positions to reuse (at least one token is always left to prefill); None when
        none shares at least half of what it holds. Taking a session ends it for the
        conversation that kept it, so a new chat that shares only an opening (a system
        prompt, the template's first line) with a longer one starts afresh instead."""
        entries = self._kept.get(plan_id, [])
        best, reuse = None, 0
        for entry in entries:
            n = min(common_prefix(entry.tokens, ids), len(ids) - 1)
            if n > reuse and 2 * n >= len(entry.tokens):
                best, reuse = entry, n
        if best is None:
            return None
        entries.remove(best)
        return best.session, reuse

    def put(self, plan_id: str, session: str, tokens: Sequence[int], limit: int) -> None:
        entries = self._kept.setdefault(plan_id, [])
        entries[:] = [e for e in entries if e.session != session]
        entries.append(Kept(session, tuple(tokens)))
        del entries[:max(0, len(entries) - max(1, limit))]

    def forget(self, plan_id: str) -> None:
        self._kept.pop(plan_id, None)


__all__ = ["Kept", "PrefixCache", "common_prefix"]
