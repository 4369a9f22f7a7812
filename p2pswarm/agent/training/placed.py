"""Where a job's replicas were placed: per replica, its stages with their fellows."""

from __future__ import annotations

from typing import Any

Placement = list[list[dict[str, Any]]]  # per replica, its stages with their fellows

__all__ = ["Placement"]
