"""The stage host in torch (no sockets): stages, KV cache, tensor frames, sampling.

Names are imported on first use, so the torch-free parts (``spec``, ``memory``) can be
imported by the pure planner without pulling torch in.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "decode_tensor": "frame", "encode_tensor": "frame",
    "KVCache": "kv_cache",
    "StageMemory": "memory", "stage_memory": "memory",
    "Generation": "pipeline", "LocalPipeline": "pipeline",
    "Sampler": "sampler",
    "StageSpec": "spec",
    "Stage": "stage",
}

__all__ = [
    "Generation", "KVCache", "LocalPipeline", "Sampler", "Stage", "StageMemory", "StageSpec",
    "decode_tensor", "encode_tensor", "stage_memory",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


if TYPE_CHECKING:
    from p2pswarm.runtime.frame import decode_tensor, encode_tensor
    from p2pswarm.runtime.kv_cache import KVCache
    from p2pswarm.runtime.memory import StageMemory, stage_memory
    from p2pswarm.runtime.pipeline import Generation, LocalPipeline
    from p2pswarm.runtime.sampler import Sampler
    from p2pswarm.runtime.spec import StageSpec
    from p2pswarm.runtime.stage import Stage
