"""Where a job's weights and tokenizer come from, and stage models made trainable.

A job names a built-in model, a model directory, or a config to start from scratch.
From scratch, each tensor is drawn as the built-in models draw theirs (a generator per
tensor, seeded by the job seed and the tensor's name), so every fellow builds the same
initial weights for its own layers without any of them being sent.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from p2pswarm.models.builtin import RWKV7_VECTOR_INIT, BuiltinModel
from p2pswarm.models.checkpoint import Checkpoint
from p2pswarm.models.families import AnyStageModel, tensor_map, tensor_shape
from p2pswarm.models.loader import TensorSource, load_stage_model, open_model
from p2pswarm.models.rwkv7_pth import PthCheckpoint
from p2pswarm.models.tokenizer import ByteTokenizer, HFTokenizer, WorldTokenizer, load_tokenizer
from p2pswarm.shapes.model_config import ModelConfig
from p2pswarm.training.job import ModelSpec

DTYPE_NAMES = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}


class ScratchModel:
    """A model initialised from a config alone: GPT-2 style normal(0, 0.02) weights, the
    residual projections scaled down by sqrt(2 * layers), norms at one, biases at zero."""

    def __init__(self, hf_config: dict[str, Any], seed: int, name: str = "scratch") -> None:
        self.hf_config = dict(hf_config)
        self.config = ModelConfig.from_hf(self.hf_config)
        self.seed = seed
        self.name = name

    def tensor_names(self) -> list[str]:
        return list(tensor_map(self.config, 0, self.config.num_layers))

    def tensor(self, name: str) -> torch.Tensor:
        shape = tensor_shape(self.config, name)
        if name.endswith("norm.weight"):  # a norm that scales by (1 + w) starts at w = 0
            return torch.zeros(shape) if self.config.unit_offset_norms else torch.ones(shape)
        if name.endswith(".bias"):
            return torch.zeros(shape)
        tail = name.rsplit(".", 1)[-1]
        if self.config.model_type == "rwkv7" and tail in RWKV7_VECTOR_INIT:
            return torch.full(shape, RWKV7_VECTOR_INIT[tail])
        std = 0.02
        if name.endswith(("o_proj.weight", "down_proj.weight", "ffn.value.weight")):
            std /= math.sqrt(2 * self.config.num_layers)
        digest = hashlib.sha256(f"scratch/{self.seed}/{name}".encode()).digest()
        generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
        return torch.randn(shape, generator=generator) * std

    def read(self, names: Sequence[str],
             device: torch.device | str) -> Iterator[tuple[str, torch.Tensor]]:
        for name in names:
            yield name, self.tensor(name).to(device)


def open_job_model(spec: ModelSpec, seed: int
                   ) -> Checkpoint | BuiltinModel | ScratchModel | PthCheckpoint:
    if spec.init_config is not None:
        return ScratchModel(dict(spec.init_config), seed)
    assert spec.name is not None
    return open_model(spec.name)


def job_tokenizer(spec: ModelSpec) -> ByteTokenizer | HFTokenizer | WorldTokenizer:
    """Byte-level for built-ins and scratch models, the directory's tokenizer otherwise."""
    if spec.init_config is not None:
        return ByteTokenizer()
    assert spec.name is not None
    return load_tokenizer(spec.name)


def trainable_stage(source: TensorSource, start_layer: int, end_layer: int, *,
                    dtype: str = "f32", quant: str = "none",
                    device: torch.device | str = "cpu") -> AnyStageModel:
    """Layers [start_layer, end_layer) with every weight trainable (LoRA freezes it again).

    A quantized base (``quant`` int8/int4) keeps its quantized linears frozen; only
    adapters on top of them can learn.
    """
    model = load_stage_model(source, start_layer, end_layer, dtype=DTYPE_NAMES.get(dtype, dtype),
                             quant=quant, device=device)
    for p in model.parameters():
        if p.is_floating_point():
            p.requires_grad_(True)
    return model.train()
