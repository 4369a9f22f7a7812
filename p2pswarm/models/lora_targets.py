"""Which linear maps of a layer a LoRA adapter may sit on, per family (torch-free).

Training puts adapters on these maps and names them in PEFT's layout
(``base_model.model.model.layers.{i}.{parent}.{proj}.lora_{A,B}.weight``); serving reads
the same names back and merges them. One table for both sides, so an adapter a job
exported is one a load accepts.
"""

from __future__ import annotations

LLAMA_PROJ_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
                     "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp",
                     "down_proj": "mlp"}
# RWKV-7: the time-mix's four maps and the channel-mix's two (not its small low-rank ones)
RWKV7_PROJ_PARENT = {"r_proj": "attn", "k_proj": "attn", "v_proj": "attn", "o_proj": "attn",
                     "key": "ffn", "value": "ffn"}
# a Llama target name's RWKV-7 counterpart, so one job's targets mean the same on both
RWKV7_TARGET = {"q_proj": "r_proj", "gate_proj": "key", "up_proj": "key", "down_proj": "value"}


def proj_parents(model_type: str) -> dict[str, str]:
    """Adaptable map name -> the module inside a layer that holds it."""
    return RWKV7_PROJ_PARENT if model_type == "rwkv7" else LLAMA_PROJ_PARENT


def family_targets(model_type: str, targets: tuple[str, ...] | list[str]) -> list[str]:
    """Target names as this family calls them (Llama names translated for RWKV-7),
    in order, without repeats."""
    if model_type != "rwkv7":
        return list(dict.fromkeys(targets))
    return list(dict.fromkeys(RWKV7_TARGET.get(t, t) for t in targets))
