"""What fellows gossip about loads, read in one place: the stages a fellow serves and the
loads whose orders it keeps without serving them (``kept_loads``).

``fellow_meta`` checks a fellow's metadata once into a ``FellowSays`` (its stages as
``SaidStage``s, its kept loads); the loads' side reads those values. The two readers of
the gossip form (``gossiped_stages``, ``kept_plan_ids``) serve the rooms that still take
metadata as its document.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from p2pswarm.agent.fellow_meta import FellowSays


def gossiped_stages(metadata: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The stage entries ``metadata`` gossips (maps only)."""
    return [e for e in metadata.get("stages") or [] if isinstance(e, dict)]


def gossiped_plan_ids(says: FellowSays) -> set[str]:
    """The plan_ids of the loads a fellow says it serves a stage of."""
    return {s.plan_id for s in says.stages}


def kept_plan_ids(metadata: Mapping[str, Any]) -> list[str]:
    """The plan_ids of the loads ``metadata`` says it keeps the orders of unserved
    (``FellowSays.kept_loads``, in gossip form)."""
    return list(metadata.get("kept_loads") or [])


__all__ = ["gossiped_plan_ids", "gossiped_stages", "kept_plan_ids"]
