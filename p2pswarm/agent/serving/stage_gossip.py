"""What fellows gossip about loads, read in one place: the stages a fellow serves.

``fellow_meta`` checks a fellow's metadata once into a ``FellowSays`` (its stages as
``SaidStage``s, its kept loads); the loads' side reads those values.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from p2pswarm.agent.fellow_meta import FellowSays


def gossiped_plan_ids(says: FellowSays) -> set[str]:
    """The plan_ids of the loads a fellow says it serves a stage of."""
    return {s.plan_id for s in says.stages}


__all__ = ["gossiped_plan_ids"]
