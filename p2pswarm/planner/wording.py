"""The exact words a plan uses: reasons, card labels and number formats.

These strings are part of the interface (agents and scripts match on them), so they
live in one place. GB here is 10**9 bytes, printed with one decimal.
"""

from __future__ import annotations

NOT_CONNECTED = "fellow not connected"
TRAINING = "fellow training"
LEFT_OUT_BY_YOU = "left out by you"
NOT_NEEDED = "not needed: the plan fits without it"


def gb(n_bytes: float) -> str:
    return f"{n_bytes / 1e9:.1f} GB"


def mb(n_bytes: float) -> str:
    return f"{n_bytes / 1e6:.1f} MB"


def tokens(n: int) -> str:
    return f"{n:,}"


def held_by(held_bytes: int, program: str) -> str:
    return f"{gb(held_bytes)} held by {program} (not p2pswarm)"


def below_floor(free_bytes: int, floor_bytes: int) -> str:
    return f"{gb(free_bytes)} free, below the {gb(floor_bytes)} floor"


def stage_needs(need_bytes: int) -> str:
    return f"less than the {gb(need_bytes)} a stage needs free"


def card_label(kind: str, index: int, name: str) -> str:
    """``GTX 1050 Ti #0`` for a GPU, ``CPU (Intel i7-8550U)`` for a CPU."""
    if kind == "cpu":
        return "CPU" if name in ("", "CPU") else f"CPU ({name})"
    return f"{name} #{index}"


def fellows_card(fellow: str, kind: str, index: int, name: str) -> str:
    """``fxserver's GTX 1050 Ti #0``."""
    return f"{fellow}'s {card_label(kind, index, name)}"


__all__ = [
    "LEFT_OUT_BY_YOU",
    "NOT_CONNECTED",
    "NOT_NEEDED",
    "TRAINING",
    "below_floor",
    "card_label",
    "fellows_card",
    "gb",
    "held_by",
    "mb",
    "stage_needs",
    "tokens",
]


def seconds(t: float) -> str:
    """A duration at the precision its size deserves: 2.41 s, 380.0 ms, 950 µs."""
    return f"{t:.2f} s" if t >= 1 else f"{t * 1000:.1f} ms" if t >= 1e-3 else f"{t * 1e6:.0f} µs"
