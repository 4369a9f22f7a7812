"""The leader's record of a load it leads: typed inside serving, a document at the edge.

A ``LeaderLoad`` is what ``Loads`` keeps in its table for each load this agent leads
(brought up here, adopted from its fellows, or re-cut into). Failover, copies and the
watch change it in place while they hold the load's lock (a stage moved, the load
waiting for a card, a faster placement seen, copies made ahead), so it is a small
mutable class rather than a frozen value; the table says which record is current
(``serial``), so a move that outlived an unload can tell, without comparing identities.

Its document (``to_doc``: the ``loads`` listing, a ``LoadDone`` reply) keeps the keys a
plain map had, in the order they were set: the optional ones go through the methods
below, which remember that order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from p2pswarm.agent.serving.records import route_dict, route_hop
from p2pswarm.wire.loads import RouteHop
from p2pswarm.wire.orders import pack_doc

_OPTIONAL = ("load_s", "adapter", "adopted", "moves", "waiting", "faster", "copies",
             "recut_from")


@dataclass(eq=False, slots=True)
class LeaderLoad:
    """A load this agent leads. Change the optional fields through the methods."""

    plan_id: str
    model: dict[str, Any]  # the model's public identity (``public_model``)
    runtime: dict[str, Any]  # the plan's runtime document (``runtime_doc``)
    stages: tuple[RouteHop, ...]  # the route, in pipeline order
    serial: int = 0  # which record of the plan the leader's table holds (``Loads.lead``)
    load_s: float | None = None  # how long its bring-up took (None: not brought up here)
    adapter: dict[str, Any] | None = None  # ``public_adapter``; None: no adapter
    adopted: dict[str, Any] | None = None  # when, in which term and by whom it was adopted
    moves: tuple[dict[str, Any], ...] = ()  # the last moves of its stages, the oldest first
    waiting: str = ""  # why a lost stage waits for a card ("": it does not)
    faster: dict[str, Any] | None = None  # the markedly faster placement seen (``moves``)
    copies: tuple[dict[str, Any], ...] = ()  # its stages' copies ahead (``copies``)
    recut_from: tuple[str, ...] = ()  # the plan_ids it went by before live re-cuts
    _order: list[str] = field(default_factory=list)  # the optional keys, as they were set

    def _note(self, key: str, present: bool) -> None:
        """Keep ``key``'s place in the document as a plain map would: set last when it
        appears, dropped when it goes."""
        if not present:
            if key in self._order:
                self._order.remove(key)
        elif key not in self._order:
            self._order.append(key)

    def _present(self, key: str) -> bool:
        value = getattr(self, key)
        return value is not None if key in ("load_s", "adapter", "adopted", "faster") \
            else bool(value)

    # --- changes ---------------------------------------------------------------------

    def set_load_s(self, seconds: float) -> None:
        self.load_s = seconds
        self._note("load_s", True)

    def set_adapter(self, adapter: dict[str, Any]) -> None:
        self.adapter = adapter
        self._note("adapter", True)

    def set_adopted(self, adopted: dict[str, Any]) -> None:
        self.adopted = adopted
        self._note("adopted", True)

    def set_moves(self, moves: tuple[dict[str, Any], ...]) -> None:
        self.moves = moves
        self._note("moves", bool(moves))

    def add_move(self, move: dict[str, Any], kept: int) -> None:
        """Record a move, keeping the last ``kept``."""
        self.set_moves((*self.moves, move)[-kept:])

    def set_waiting(self, why: str) -> None:
        """Why a lost stage waits for a card; "" when nothing waits."""
        self.waiting = why
        self._note("waiting", bool(why))

    def set_faster(self, faster: dict[str, Any] | None) -> None:
        self.faster = faster
        self._note("faster", faster is not None)

    def set_copies(self, copies: tuple[dict[str, Any], ...]) -> None:
        self.copies = copies
        self._note("copies", bool(copies))

    def set_recut_from(self, plan_ids: tuple[str, ...]) -> None:
        self.recut_from = plan_ids
        self._note("recut_from", bool(plan_ids))

    # --- reading ---------------------------------------------------------------------

    @property
    def fellow_ids(self) -> tuple[str, ...]:
        return tuple(h.fellow_id for h in self.stages)

    @property
    def addrs(self) -> set[str]:
        return {h.addr for h in self.stages}

    # --- the edge --------------------------------------------------------------------

    def to_doc(self) -> dict[str, Any]:
        """The record as the ``loads`` listing and the leader's replies show it."""
        doc: dict[str, Any] = {"plan_id": self.plan_id, "model": self.model,
                               "runtime": self.runtime,
                               "stages": [route_dict(h) for h in self.stages]}
        for key in self._order:
            if self._present(key):
                value = getattr(self, key)
                doc[key] = list(value) if isinstance(value, tuple) else value
        return doc

    @staticmethod
    def from_doc(doc: dict[str, Any]) -> LeaderLoad:
        """``to_doc`` back (the optional keys in the order the document has them)."""
        load = LeaderLoad(str(doc["plan_id"]), dict(doc["model"]), dict(doc["runtime"]),
                          tuple(route_hop(h, i) for i, h in enumerate(doc["stages"])))
        for key in doc:
            if key not in _OPTIONAL:
                continue
            value = doc[key]
            if key in ("moves", "copies", "recut_from"):
                value = tuple(value)
            setattr(load, key, value)
            load._note(key, load._present(key))
        return load


@dataclass(frozen=True, slots=True)
class LoadAsked:
    """What a load was asked as: the plan request, the model's identity and the whole
    adapter (None: none). A live re-cut plans it again (``recut``); its keepers keep it
    (``to_doc``; read back, checked, by ``loads.asked_from_doc``)."""

    request: dict[str, Any]
    model: dict[str, Any]
    adapter: dict[str, Any] | None = None

    def to_doc(self) -> bytes:
        """As the load's keepers keep it (the model travels with the stage orders)."""
        return pack_doc({"request": self.request, "adapter": self.adapter})


__all__ = ["LeaderLoad", "LoadAsked"]
