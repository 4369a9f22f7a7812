"""A load as this agent knows it: typed inside, the ``loads`` listing's document at the edge.

``Loads.views`` gives one ``LoadView`` per load: those this agent leads (their
``LeaderLoad``), and those its fellows say they serve (the checked ``SaidStage`` of the
first stage heard, which carries the whole route). Each stage is a ``ViewHop`` with its
fellow's membership state. ``to_doc`` is the one place a view becomes the map the CLI,
the HTTP API and a ``LoadsShown`` answer show, with the keys in the order they always
had.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, TypedDict

from p2pswarm.agent.serving.leader_load import LeaderLoad
from p2pswarm.membership.states import PRESENT_NAMES
from p2pswarm.wire.loads import RouteHop

if TYPE_CHECKING:
    from p2pswarm.agent.fellow_meta import SaidHop, SaidStage
    from p2pswarm.membership.member import Member

UNKNOWN = "unknown"  # the state of a stage whose fellow this agent does not know


class _ViewHopSaid(TypedDict):
    stage: int
    fellow_id: str
    fellow: str
    addr: str
    layers: list[int]


class ViewHopDoc(_ViewHopSaid, total=False):
    """A stage as the ``loads`` listing shows it: what was said of it, in the order of a
    route's document (``RouteDoc``), and its fellow's state last."""

    card: str
    claim_bytes: int
    allocated_bytes: int
    fetched_bytes: int  # a load this agent leads
    fetch_s: float
    state: str


@dataclass(frozen=True, slots=True)
class ViewHop:
    """One stage of a load as the listing shows it. What a fellow gossips may leave out
    the card and the byte counts (None); a load this agent leads says how much its
    stage fetched (``fetched``: bytes and seconds)."""

    stage: int
    fellow_id: str  # hex
    fellow: str
    addr: str
    layers: tuple[int, int]
    card: str | None = None
    claim_bytes: int | None = None
    allocated_bytes: int | None = None
    fetched: tuple[int, float] | None = None  # (fetched_bytes, fetch_s)
    state: str = UNKNOWN  # its fellow's membership state

    @property
    def present(self) -> bool:
        """Whether its fellow is alive or suspect (an unload releases the stage there)."""
        return self.state in PRESENT_NAMES

    @staticmethod
    def led(hop: RouteHop, state: str = UNKNOWN) -> ViewHop:
        """A stage of a load this agent leads."""
        return ViewHop(hop.stage, hop.fellow_id, hop.fellow, hop.addr,
                       (hop.start_layer, hop.end_layer), hop.card, hop.claim_bytes,
                       hop.allocated_bytes, (hop.fetched_bytes, hop.fetch_s), state)

    @staticmethod
    def said(hop: SaidHop | SaidStage, fellow_id: str, fellow: str, addr: str
             ) -> ViewHop:
        """A stage as a fellow gossips it: a hop of the route it says, or its own entry
        (which names no fellow: ``fellow_id``, ``fellow``, ``addr`` say whose it is)."""
        return ViewHop(hop.stage, fellow_id, fellow, addr, hop.layers, hop.card,
                       hop.claim_bytes, hop.allocated_bytes)

    def over(self, entry: ViewHop) -> ViewHop:
        """This hop of a gossiped route, with what the stage's own fellow says of it
        (``entry``) taking precedence, as far as it says it."""
        return ViewHop(self.stage, entry.fellow_id, entry.fellow, entry.addr, entry.layers,
                       entry.card if entry.card is not None else self.card,
                       entry.claim_bytes if entry.claim_bytes is not None
                       else self.claim_bytes,
                       entry.allocated_bytes if entry.allocated_bytes is not None
                       else self.allocated_bytes)

    def at(self, member: Member | None) -> ViewHop:
        """With the name and address membership knows its fellow by, where it knows it."""
        return self if member is None else replace(self, fellow=member.name,
                                                   addr=member.addr)

    def with_state(self, state: str) -> ViewHop:
        return replace(self, state=state)

    def to_doc(self) -> ViewHopDoc:
        """The stage as the listing shows it (a led stage: ``route_dict``, and its state)."""
        doc: ViewHopDoc = {"stage": self.stage, "fellow_id": self.fellow_id,
                           "fellow": self.fellow, "addr": self.addr,
                           "layers": list(self.layers)}
        if self.card is not None:
            doc["card"] = self.card
        if self.claim_bytes is not None:
            doc["claim_bytes"] = self.claim_bytes
        if self.allocated_bytes is not None:
            doc["allocated_bytes"] = self.allocated_bytes
        if self.fetched is not None:
            doc["fetched_bytes"], doc["fetch_s"] = self.fetched
        doc["state"] = self.state
        return doc


@dataclass(frozen=True, slots=True)
class LoadView:
    """A load as this agent knows it: its stages in the order its record or its
    gossiped route lists them. ``source``: the load's record where this agent leads it
    (read when the view is shown: a view is made to be shown at once), or else the stage
    its fellows gossip it by, whose model, runtime and adapter blocks the listing shows."""

    plan_id: str
    stages: tuple[ViewHop, ...]
    source: LeaderLoad | SaidStage

    @property
    def complete(self) -> bool:
        """Every stage from 0 is there, and every one's fellow is alive or suspect."""
        present = sorted(s.stage for s in self.stages)
        return present == list(range(len(present))) and all(s.present for s in self.stages)

    @property
    def live(self) -> dict[int, tuple[str, str, str]]:
        """stage -> (fellow id hex, name, addr) of its stages whose fellow is present:
        what an unload releases."""
        return {s.stage: (s.fellow_id, s.fellow, s.addr) for s in self.stages if s.present}

    def to_doc(self) -> dict[str, Any]:
        """The load as the ``loads`` listing shows it."""
        stages = [s.to_doc() for s in self.stages]
        said = self.source
        if isinstance(said, LeaderLoad):  # its stages keep their place in its record
            return {**said.to_doc(), "stages": stages, "complete": self.complete}
        return {"plan_id": self.plan_id, "model": said.model.block, "runtime": said.runtime,
                "stages": stages, **({"adapter": said.adapter} if said.adapter else {}),
                "complete": self.complete}


__all__ = ["UNKNOWN", "LoadView", "ViewHop", "ViewHopDoc"]
