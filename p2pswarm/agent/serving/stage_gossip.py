"""What fellows gossip about loads, read in one place: the stages a fellow serves
(metadata ``stages``, each a map ``fellow_meta`` checked) and the loads whose orders it
keeps without serving them (``kept_loads``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def gossiped_stages(metadata: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The stage entries ``metadata`` gossips (maps only)."""
    return [e for e in metadata.get("stages") or [] if isinstance(e, dict)]


def gossiped_plan_ids(metadata: Mapping[str, Any]) -> set[str]:
    """The plan_ids of the loads ``metadata`` gossips a stage of."""
    return {str(e["plan_id"]) for e in gossiped_stages(metadata) if "plan_id" in e}


def kept_plan_ids(metadata: Mapping[str, Any]) -> list[str]:
    """The plan_ids of the loads ``metadata`` says it keeps the orders of unserved."""
    return list(metadata.get("kept_loads") or [])


__all__ = ["gossiped_plan_ids", "gossiped_stages", "kept_plan_ids"]
