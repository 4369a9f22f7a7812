"""Built-in models: no files, weights drawn from a fixed seed, a byte-level vocabulary.

Every fellow that builds ``tiny-llama`` layers 3..5 gets bit-identical weights, because
each tensor is drawn from its own generator seeded by (model name, tensor name): what a
stage draws does not depend on which other tensors it draws. The draw happens on the
CPU in float32 and is then cast and moved, so the card makes no difference either.
The configs are Hugging Face ``config.json`` dicts, the same shape a real model has;
they live with the planner's model profiles (``p2pswarm.planner.profile``), one source
for what is planned and what is built.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from p2pswarm.errors import ConfigError
from p2pswarm.models.checkpoint import save_checkpoint
from p2pswarm.models.families import tensor_map, tensor_shape
from p2pswarm.models.tokenizer import ByteTokenizer
from p2pswarm.planner.profile import BUILTIN_MODELS
from p2pswarm.shapes.model_config import ModelConfig

BUILTIN_SEED = 5
# token-shift mixes halfway, kk's scale, the in-context rate's share of k, the bonus
RWKV7_VECTOR_INIT = {"x_r": 0.5, "x_w": 0.5, "x_k": 0.5, "x_v": 0.5, "x_a": 0.5, "x_g": 0.5,
                     "k_k": 0.85, "k_a": 1.0, "r_k": -0.04}

__all__ = ["BUILTIN_MODELS", "BUILTIN_SEED", "BuiltinModel", "write_builtin_checkpoint"]


class BuiltinModel:
    """A built-in model as a tensor source, interchangeable with ``Checkpoint``."""

    def __init__(self, name: str) -> None:
        if name not in BUILTIN_MODELS:
            raise ConfigError(
                f"no built-in model {name!r}; built-ins: {', '.join(sorted(BUILTIN_MODELS))}")
        self.name = name
        self.hf_config = dict(BUILTIN_MODELS[name])
        self.config = ModelConfig.from_hf(self.hf_config)

    def tensor_names(self) -> list[str]:
        return list(tensor_map(self.config, 0, self.config.num_layers))

    def read(self, names: Sequence[str],
             device: torch.device | str) -> Iterator[tuple[str, torch.Tensor]]:
        for name in names:
            yield name, self.tensor(name).to(device)

    def tensor(self, name: str) -> torch.Tensor:
        """The float32 CPU tensor ``name``, the same on every machine."""
        shape = tensor_shape(self.config, name)
        if name.endswith("norm.weight"):
            return torch.ones(shape)
        if name.endswith(".bias"):
            return torch.zeros(shape)
        tail = name.rsplit(".", 1)[-1]
        if tail in RWKV7_VECTOR_INIT:  # RWKV-7's mixing vectors: constants, as its authors
            return torch.full(shape, RWKV7_VECTOR_INIT[tail])
        std = 0.02
        if name.endswith(("o_proj.weight", "down_proj.weight", "ffn.value.weight")):
            std /= math.sqrt(2 * self.config.num_layers)  # residual branches, as in GPT-2
        seed = int.from_bytes(
            hashlib.sha256(f"{BUILTIN_SEED}/{self.name}/{name}".encode()).digest()[:8], "little")
        generator = torch.Generator(device="cpu").manual_seed(seed & (2**63 - 1))
        return torch.randn(shape, generator=generator) * std

    def tokenizer(self) -> ByteTokenizer:
        return ByteTokenizer()


def write_builtin_checkpoint(name: str, model_dir: str | Path, *,
                             max_shard_bytes: int | None = None) -> Path:
    """Save a built-in model as a Hugging Face directory (float32 safetensors)."""
    model = BuiltinModel(name)
    tensors = [(n, model.tensor(n)) for n in model.tensor_names()]
    return save_checkpoint(model.hf_config, tensors, model_dir, max_shard_bytes=max_shard_bytes)
