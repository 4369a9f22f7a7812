"""What a fleet plan adds to a training request: the number of replicas, the batch rule,
the round's length and the sync codecs, read from a request dict and checked.

It stands apart from the fleet plan (``fleet``) so the round's sizing (``fleet_round``)
can name the request without importing the fleet plan back (no import cycle).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from p2pswarm.errors import ConfigError
from p2pswarm.planner.request import MAX_COUNT
from p2pswarm.planner.sync_cost import CODECS


@dataclass(frozen=True, slots=True)
class FleetRequest:
    """What a fleet plan adds to a training request: replicas, batch rule, sync."""

    replicas: int | None = None  # None: "auto"
    auto_batch: bool = True  # micro_batch "auto": per replica, from memory and speed
    inner_steps: int | None = None  # None: "auto", sized to the links
    codec: str = "int8"
    codec_options: tuple[tuple[str, Any], ...] = ()
    update_codec: str | None = None  # None: as codec
    update_codec_options: tuple[tuple[str, Any], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"replicas": "auto" if self.replicas is None else self.replicas,
                "micro_batch": "auto" if self.auto_batch else "fixed",
                "inner_steps": "auto" if self.inner_steps is None else self.inner_steps,
                "codec": self.codec,
                "codec_options": dict(self.codec_options),
                "update_codec": self.update_codec or self.codec,
                "update_codec_options": dict(self.update_codec_options
                                             if self.update_codec else self.codec_options)}


def fleet_request_from_dict(data: Mapping[str, Any]) -> tuple[FleetRequest, dict[str, Any]]:
    """Split a training request dict into the fleet's part and the plan request's part
    (``micro_batch: "auto"``, the default, becomes 1 there: each replica gets its own;
    ``inner_steps`` is "auto" unless given)."""
    rest = {k: v for k, v in data.items() if k not in (
        "replicas", "inner_steps", "codec", "codec_options", "update_codec",
        "update_codec_options")}
    replicas = data.get("replicas", "auto")
    if replicas in (None, "auto"):
        replicas = None
    elif isinstance(replicas, bool) or not isinstance(replicas, int) \
            or not 1 <= replicas <= MAX_COUNT:
        raise ConfigError(f"replicas must be \"auto\" or a whole number from 1, got "
                          f"{str(replicas)[:40]!r}")
    auto = data.get("micro_batch", "auto") in ("auto", None)
    if auto:
        rest["micro_batch"] = 1
    inner = data.get("inner_steps", "auto")
    if inner in ("auto", None):
        inner = None
    elif isinstance(inner, bool) or not isinstance(inner, int) or not 1 <= inner <= MAX_COUNT:
        raise ConfigError(f"sync.inner_steps must be \"auto\" or a whole number from 1, got "
                          f"{str(inner)[:40]!r}")
    codec = data.get("codec", "int8")
    update = data.get("update_codec")
    for name in (codec, update):
        if name is not None and name not in CODECS:
            raise ConfigError(f"codec {str(name)[:40]!r} must be one of {', '.join(CODECS)}")
    options = _codec_options(codec, data.get("codec_options"))
    update_options = _codec_options(update or codec, data.get("update_codec_options"))
    return FleetRequest(replicas=replicas, auto_batch=auto, inner_steps=inner, codec=codec,
                        codec_options=tuple(sorted(options.items())), update_codec=update,
                        update_codec_options=tuple(sorted(update_options.items()))), rest


def _codec_options(codec: str, raw: Any) -> dict[str, Any]:
    """The options the planner reads of a codec, checked (the rest it does not need)."""
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise ConfigError("codec_options must be an object, e.g. {\"fraction\": 0.01}")
    out: dict[str, Any] = {}
    for key, value in sorted(raw.items(), key=lambda kv: str(kv[0])):
        number = not isinstance(value, bool) and isinstance(value, (int, float))
        if codec == "topk" and key == "fraction" and not (number and 0 < value <= 1):
            raise ConfigError(f"topk codec: fraction must be in (0, 1], got {str(value)[:40]!r}")
        if codec == "qsgd" and key == "bits" and value not in (2, 4, 8):
            raise ConfigError(f"qsgd codec: bits must be 2, 4 or 8, got {str(value)[:40]!r}")
        if codec == "qsgd" and key == "bucket" and not (
                number and isinstance(value, int) and 1 <= value <= 2**31):
            raise ConfigError(f"qsgd codec: bucket must be a whole number from 1, got "
                              f"{str(value)[:40]!r}")
        if isinstance(key, str) and len(key) <= 40 and (number or isinstance(value, str)):
            out[key] = value if number else str(value)[:40]
    return out


__all__ = ["FleetRequest", "fleet_request_from_dict"]
