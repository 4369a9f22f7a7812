"""The RWKV authors' ``.pth`` checkpoints of RWKV-7, read as a tensor source.

A published RWKV-7 is one ``torch.save``d state dict with names such as
``blocks.0.att.receptance.weight``, ``blocks.0.att.w1`` and ``emb.weight``; its shape
says everything (vocab, width, heads from ``att.r_k``, layers, low-rank widths), as the
``rwkv`` package reads it. Tensors are handed out under the Hugging Face names
(``p2pswarm.models.rwkv7``), transposed and flattened where the two layouts differ:

    blocks.{i}.ln0 / ln1 / ln2      model.layers.{i}.pre_norm / attn_norm / ffn_norm
    blocks.{i}.att.receptance       model.layers.{i}.attn.r_proj (key k_proj, value
                                    v_proj, output o_proj, ln_x g_norm)
    blocks.{i}.att.{w,a,v,g}1       attn.{w,a,v,g}_lora.lora.0.weight, transposed
    blocks.{i}.att.{w,a,v,g}2       attn.{w,a,v,g}_lora.lora.2.weight, transposed
    blocks.{i}.att.{w,a,v}0         attn.{w,a,v}_lora.lora.2.bias, flattened
    emb, ln_out, head               model.embeddings, model.norm, lm_head

Layer 0's ``v0/v1/v2`` may be there or not: they are never read. bf16 files are cast
when a stage loads them. The file is opened memory-mapped and ``weights_only``, so only
tensors (no pickled code) are accepted and a stage reads only its own.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from p2pswarm.errors import ConfigError
from p2pswarm.models.files import pth_file
from p2pswarm.shapes.model_config import UNBOUNDED_CONTEXT_TOKENS, ModelConfig

_ENDS = {"model.embeddings.weight": "emb.weight", "model.norm.weight": "ln_out.weight",
         "model.norm.bias": "ln_out.bias", "lm_head.weight": "head.weight"}
_NORMS = {"pre_norm": "ln0", "attn_norm": "ln1", "ffn_norm": "ln2"}
_PROJ = {"r_proj": "receptance", "k_proj": "key", "v_proj": "value", "o_proj": "output",
         "g_norm": "ln_x"}
_LORA = re.compile(r"([wavg])_lora\.lora\.(0\.weight|2\.weight|2\.bias)$")
_LORA_PART = {"0.weight": "1", "2.weight": "2", "2.bias": "0"}


def find_pth(path: Path) -> Path | None:
    """The ``.pth`` a model path names (``files.pth_file``)."""
    return pth_file(path)


def pth_name(hf_name: str) -> tuple[str, bool]:
    """The ``.pth`` name of a Hugging Face-layout tensor, and whether it is transposed."""
    if hf_name in _ENDS:
        return _ENDS[hf_name], False
    match = re.fullmatch(r"model\.layers\.(\d+)\.(\w+)\.(.+)", hf_name)
    if match is None:
        raise ConfigError(f"no RWKV-7 tensor {hf_name!r}")
    layer, part, rest = match.groups()
    if part in _NORMS:
        return f"blocks.{layer}.{_NORMS[part]}.{rest}", False
    if part == "ffn":
        return f"blocks.{layer}.ffn.{rest}", False
    if part != "attn":
        raise ConfigError(f"no RWKV-7 tensor {hf_name!r}")
    lora = _LORA.fullmatch(rest)
    if lora is not None:
        kind, tail = lora.groups()
        number = _LORA_PART[tail]
        return f"blocks.{layer}.att.{kind}{number}", number != "0"
    module, _, attr = rest.partition(".")
    if module in _PROJ:
        return f"blocks.{layer}.att.{_PROJ[module]}.{attr}", False
    return f"blocks.{layer}.att.{rest}", False


class PthCheckpoint:
    """An RWKV-7 ``.pth`` file as a tensor source (names in the Hugging Face layout)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            loaded = torch.load(self.path, map_location="cpu", mmap=True, weights_only=True)
        except Exception as exc:  # a bad pickle raises anything
            raise ConfigError(f"cannot read {self.path}: {str(exc)[:200]}") from None
        if not isinstance(loaded, dict) or not all(
                isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in loaded.items()):
            raise ConfigError(f"{self.path} is not a state dict of tensors")
        self._tensors: dict[str, torch.Tensor] = loaded
        self.config = config_from_pth(self._tensors, self.path)
        self.hf_config: dict[str, Any] = self.config.to_hf()

    @property
    def name(self) -> str:
        return self.path.stem

    @property
    def model_dir(self) -> Path:
        return self.path.parent

    def read(self, names: Sequence[str],
             device: torch.device | str) -> Iterator[tuple[str, torch.Tensor]]:
        for name in names:
            source, transposed = pth_name(name)
            tensor = self._tensors.get(source)
            if tensor is None:
                raise ConfigError(f"{self.path} has no tensor {source!r} (for {name})")
            if transposed:
                tensor = tensor.t()
            elif tensor.dim() == 3 and tensor.shape[:2] == (1, 1):
                tensor = tensor.reshape(-1)  # (1, 1, C) vectors
            yield name, tensor.contiguous().to(device)


def config_from_pth(tensors: dict[str, torch.Tensor], path: Path) -> ModelConfig:
    """The model's sizes, read off its tensors' shapes as the ``rwkv`` package does."""
    def shape(name: str) -> tuple[int, ...]:
        tensor = tensors.get(name)
        if tensor is None:
            raise ConfigError(f"{path}: no {name!r}; not an RWKV-7 checkpoint")
        return tuple(tensor.shape)

    heads, head_size = shape("blocks.0.att.r_k")
    vocab, hidden = shape("emb.weight")
    layers = 0
    while f"blocks.{layers}.ffn.key.weight" in tensors:
        layers += 1
    v_rank = shape("blocks.1.att.v1")[1] if layers > 1 else 32
    return ModelConfig(
        vocab_size=vocab, hidden_size=hidden,
        intermediate_size=shape("blocks.0.ffn.key.weight")[0], num_layers=layers,
        num_heads=heads, num_kv_heads=heads, head_dim=head_size,
        max_context_tokens=UNBOUNDED_CONTEXT_TOKENS, rms_norm_eps=1e-5, model_type="rwkv7",
        decay_low_rank_dim=shape("blocks.0.att.w1")[1],
        a_low_rank_dim=shape("blocks.0.att.a1")[1], v_low_rank_dim=v_rank,
        gate_low_rank_dim=shape("blocks.0.att.g1")[1],
    )


def save_pth(tensors: dict[str, torch.Tensor], hf_layout: bool, path: str | Path) -> Path:
    """Write ``tensors`` (Hugging Face names if ``hf_layout``) as an authors' ``.pth``,
    vectors as (1, 1, C) as the authors store them."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        target, transposed = pth_name(name) if hf_layout else (name, False)
        if transposed:
            tensor = tensor.t()
        elif tensor.dim() == 1 and not re.search(r"(ln\w*|ln_out)\.(weight|bias)$", target):
            tensor = tensor.view(1, 1, -1)
        out[target] = tensor.contiguous()
    path = Path(path)
    torch.save(out, path)
    return path


def convert_to_hf(pth: str | Path, out_dir: str | Path) -> Path:
    """Write an authors' ``.pth`` as a Hugging Face directory (``config.json`` and
    safetensors in its own dtype, the World vocabulary beside it if the ``.pth`` has one),
    the layout a swarm ships to its fellows stage by stage."""
    import shutil

    from p2pswarm.models.checkpoint import save_checkpoint
    from p2pswarm.models.rwkv7 import hf_tensor_map
    from p2pswarm.models.tokenizer import WORLD_VOCAB_FILE

    source = PthCheckpoint(pth)
    names = list(hf_tensor_map(source.config, 0, source.config.num_layers))
    out = save_checkpoint(source.hf_config, list(source.read(names, "cpu")), out_dir)
    vocab = source.path.parent / WORLD_VOCAB_FILE
    if vocab.is_file():
        shutil.copyfile(vocab, Path(out) / WORLD_VOCAB_FILE)
    return Path(out)


if __name__ == "__main__":  # python -m p2pswarm.models.rwkv7_pth MODEL.pth OUT_DIR
    import sys

    if len(sys.argv) != 3:
        sys.exit("usage: python -m p2pswarm.models.rwkv7_pth MODEL.pth OUT_DIR")
    try:
        print(convert_to_hf(sys.argv[1], sys.argv[2]))
    except ConfigError as exc:
        sys.exit(f"error: {exc}")
