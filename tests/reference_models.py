"""Tiny random transformers models, the references the family tests compare with."""

from __future__ import annotations

from typing import Any

import torch
import transformers


def random_reference(config_name: str, model_name: str, config: dict[str, Any], *,
                     gemma: bool, weight_std: float) -> Any:
    """transformers' ``model_name`` of ``config``, eager attention (the reference
    semantics, Gemma's soft-capping included), weights drawn from seed 0."""
    made = getattr(transformers, config_name)(**config)
    made._attn_implementation = "eager"
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(made).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            # Gemma's norms scale by (1 + w): centre theirs on 0, the others' on 1
            centre = 0.0 if gemma or "norm" not in name else 1.0
            p.copy_(centre + 0.1 * torch.randn_like(p) if "norm" in name
                    else weight_std * torch.randn_like(p))
    return model
