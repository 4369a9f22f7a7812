"""Load events: what the leader's loads tell the rest of serving, and the weights in use.

``Serving``'s constructor builds one ``LoadEvents`` and one ``WeightsInUse`` and subscribes
every listener in one place, in the order they run; the publisher (``Loads``) only
publishes, and no service assigns another's callback. Subscribers run in the order they
subscribed, one after another:

- ``loaded`` (a load came up): failover's watch first, then the copies ahead (a copy
  follows the watch the load starts);
- ``unloaded(plan_id)`` (a load went, its orders too): failover drops its orders here and
  at their keepers;
- ``forgotten(plan_id, generation)`` (a bring-up went for good: unload or re-cut): the
  unload is handed to every fellow, so no later leader adopts it (awaited in turn);
- ``unleading(plan_id)`` (a leader is about to unload a load its fellows serve that it
  does not lead yet, elected a moment ago): failover adopts it first, so that the
  unload's tombstone names its bring-up (awaited).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable


class LoadEvents:
    """Loads come up and go: a small publish/subscribe of the four events above."""

    __slots__ = ("_forgotten", "_loaded", "_unleading", "_unloaded")

    def __init__(self) -> None:
        self._loaded: list[Callable[[], None]] = []
        self._unloaded: list[Callable[[str], None]] = []
        self._forgotten: list[Callable[[str, str], Awaitable[None]]] = []
        self._unleading: list[Callable[[str], Awaitable[None]]] = []

    def on_loaded(self, listener: Callable[[], None]) -> None:
        self._loaded.append(listener)

    def on_unloaded(self, listener: Callable[[str], None]) -> None:
        self._unloaded.append(listener)

    def on_forgotten(self, listener: Callable[[str, str], Awaitable[None]]) -> None:
        self._forgotten.append(listener)

    def on_unleading(self, listener: Callable[[str], Awaitable[None]]) -> None:
        self._unleading.append(listener)

    def loaded(self) -> None:
        for listener in self._loaded:
            listener()

    def unloaded(self, plan_id: str) -> None:
        for listener in self._unloaded:
            listener(plan_id)

    async def forgotten(self, plan_id: str, generation: str) -> None:
        for listener in self._forgotten:
            await listener(plan_id, generation)

    async def unleading(self, plan_id: str) -> None:
        for listener in self._unleading:
            await listener(plan_id)


class WeightsInUse:
    """The SHA-256 of the tensors live stages read and copies ahead keep: the weights
    cache never evicts these. Each source answers for its own; the union is asked."""

    __slots__ = ("_sources",)

    def __init__(self) -> None:
        self._sources: list[Callable[[], Iterable[str]]] = []

    def add(self, source: Callable[[], Iterable[str]]) -> None:
        self._sources.append(source)

    def __call__(self) -> set[str]:
        return {h for source in self._sources for h in source()}


__all__ = ["LoadEvents", "WeightsInUse"]
