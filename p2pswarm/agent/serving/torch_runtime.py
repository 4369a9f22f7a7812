"""Serving's compute in torch: the ``StageRuntime`` the agent uses (the one module of
serving that imports torch; ``runtime.TorchOnFirstUse`` imports it on first use).

A stage is built from its order and a weight source (a built-in model's name, a model
directory, or tensors in the verified cache); with a LoRA adapter, ``AdaptedSource``
wraps that source and merges ``W + (alpha / rank) * B @ A`` (in float32) into each
adapted weight as the stage reads it, before any cast or quantization, so the stage holds
exactly the base's bytes and the plan's memory claim stays true.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from p2pswarm.agent.adapter import TENSOR_NAME
from p2pswarm.agent.serving.records import CachedWeights, StageOrder, WeightSource
from p2pswarm.agent.serving.runtime import AdapterPart, AdapterWeights, BatchStep, Stepped
from p2pswarm.agent.weights import Manifest, WeightsCache
from p2pswarm.errors import ConfigError, PlacementError, RemoteProtocolError
from p2pswarm.models.loader import open_model
from p2pswarm.models.model_dir import model_file
from p2pswarm.runtime.frame import decode_tensor, encode_tensor
from p2pswarm.runtime.sampler import Sampler
from p2pswarm.runtime.stage import Stage
from p2pswarm.shapes.model_config import ModelConfig


class TorchRuntime:
    """``StageRuntime`` on torch: ``p2pswarm.runtime.Stage`` per stage."""

    def build(self, order: StageOrder, source: WeightSource,
              adapter: AdapterWeights | None) -> Stage:
        tensors: Any = source
        if isinstance(source, CachedWeights):
            tensors = CachedTensors(source.manifest, source.cache)
        if adapter is not None:  # merge W += scale * B @ A as the stage reads its weights
            if isinstance(tensors, (str, Path)):
                tensors = open_model(tensors)
            tensors = AdaptedSource(tensors, adapter.part.scale, adapter.tensors,
                                    *order.layers)
        try:
            return Stage.load(tensors, order.spec())
        except (RuntimeError, MemoryError) as exc:  # torch's out-of-memory and kin
            raise PlacementError(f"stage {order.stage} could not be allocated on "
                                 f"{order.device}: {exc}") from exc

    def sampler(self, temperature: float, top_k: int, top_p: float, seed: int) -> Sampler:
        return Sampler(temperature, top_k, top_p if top_p > 0 else 1.0, seed)

    def step(self, stage: Stage, session: str, frame: bytes, position: int,
             sampler: Sampler | None, keep_logits: bool) -> Stepped:
        began = time.perf_counter()
        inputs = decode_tensor(frame)
        out = stage.prefill(session, inputs, position)
        forward_s = time.perf_counter() - began
        tokens = int(inputs.shape[0]) if inputs.dim() else 0
        if not stage.is_last:
            return Stepped(frame=bytes(encode_tensor(out)), forward_s=forward_s, tokens=tokens)
        if sampler is None:  # a prompt chunk before the last
            return Stepped(forward_s=forward_s, tokens=tokens)
        logits = out[-1]
        token = sampler.sample(logits, position + tokens)  # where the token will sit
        return Stepped(token=token, logits=bytes(encode_tensor(logits)) if keep_logits else b"",
                       forward_s=forward_s, tokens=tokens)

    def step_batch(self, stage: Stage, steps: Sequence[BatchStep]) -> list[Stepped]:
        rows = [decode_tensor(s.frame) for s in steps]
        if any(r.dim() == 0 or r.shape[0] != 1 for r in rows):
            raise RemoteProtocolError("bad-stage-input", "a decode step takes one position")
        began = time.perf_counter()
        out = stage.decode_batch([s.session for s in steps], torch.cat(rows),
                                 [s.position for s in steps])
        forward_s = time.perf_counter() - began
        if not stage.is_last:
            return [Stepped(frame=bytes(encode_tensor(out[i:i + 1])), forward_s=forward_s,
                            tokens=1) for i in range(len(steps))]
        results = []
        for i, s in enumerate(steps):
            logits = out[i]
            token = s.sampler.sample(logits, s.position + 1) if s.sampler is not None else None
            kept = bytes(encode_tensor(logits)) if s.keep_logits else b""
            results.append(Stepped(token=token, logits=kept, forward_s=forward_s, tokens=1))
        return results

    def token_frame(self, ids: Sequence[int]) -> bytes:
        return bytes(encode_tensor(torch.tensor(list(ids), dtype=torch.long)))

    def read_logits(self, frame: bytes) -> torch.Tensor:
        return decode_tensor(frame)

    def adapter_tensors(self, part: AdapterPart, cache: WeightsCache | None) -> AdapterWeights:
        return AdapterWeights(part, read_adapter_tensors(part.manifest, cache, part.local))


SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16",
                      "BF16": "bfloat16", "I64": "int64", "I32": "int32", "I16": "int16",
                      "I8": "int8", "U8": "uint8", "BOOL": "bool"}


class CachedTensors:
    """A stage's tensors from the verified cache: a tensor source like ``Checkpoint``,
    which checks each tensor's SHA-256 again as it reads it."""

    def __init__(self, manifest: Manifest, cache: WeightsCache) -> None:
        self.name = manifest.name
        self.config: ModelConfig = ModelConfig.from_hf(manifest.hf_config)
        self._manifest = manifest
        self._cache = cache

    def read(self, names: Sequence[str],
             device: torch.device | str) -> Iterator[tuple[str, torch.Tensor]]:
        for name in names:
            entry = self._manifest.tensor(name)
            try:
                data = bytearray(self._cache.path(entry.sha256).read_bytes())
            except OSError as exc:
                raise ConfigError(f"cached tensor {name} is unreadable: {exc}") from exc
            if len(data) != entry.nbytes or hashlib.sha256(data).hexdigest() != entry.sha256:
                self._cache.path(entry.sha256).unlink(missing_ok=True)
                raise PlacementError(f"cached tensor {name} no longer matches its SHA-256; "
                                     "it was dropped, load again to fetch it")
            dtype = getattr(torch, SAFETENSORS_DTYPES.get(entry.dtype, ""), None)
            if not isinstance(dtype, torch.dtype):
                raise ConfigError(f"tensor {name} has dtype {entry.dtype}, which p2pswarm "
                                  "cannot read")
            tensor = torch.frombuffer(data, dtype=dtype) if data else torch.empty(0, dtype=dtype)
            yield name, tensor.reshape(entry.shape).to(device)


def read_adapter_tensors(manifest: Manifest, cache: WeightsCache | None,
                         local: bool) -> dict[str, torch.Tensor]:
    """This stage's adapter tensors (``manifest``) as float32, each checked against its
    SHA-256, from the adapter directory (``local``: this fellow has it) or the cache."""
    out: dict[str, torch.Tensor] = {}
    for t in manifest.tensors:
        try:
            if local:
                with model_file(manifest.path, t.file).open("rb") as f:
                    f.seek(t.offset_bytes)
                    data = bytearray(f.read(t.nbytes))
            else:
                assert cache is not None
                data = bytearray(cache.path(t.sha256).read_bytes())
        except OSError as exc:
            raise ConfigError(f"adapter tensor {t.name} is unreadable: {exc}") from None
        if len(data) != t.nbytes or hashlib.sha256(data).hexdigest() != t.sha256:
            if not local and cache is not None:
                cache.path(t.sha256).unlink(missing_ok=True)
            raise PlacementError(f"adapter tensor {t.name} does not match its SHA-256 "
                                 "(the adapter changed since the load began?): refused")
        dtype = getattr(torch, SAFETENSORS_DTYPES.get(t.dtype, ""), None)
        if not isinstance(dtype, torch.dtype):
            raise ConfigError(f"adapter tensor {t.name} has dtype {t.dtype}")
        out[t.name] = torch.frombuffer(data, dtype=dtype).reshape(t.shape).float()
    return out


class AdaptedSource:
    """A tensor source whose adapted weights come out merged: ``W + scale * B @ A``."""

    def __init__(self, source: Any, scale: float, tensors: dict[str, torch.Tensor],
                 start_layer: int, end_layer: int) -> None:
        self._source = source
        self.name = source.name
        self.config = source.config
        self.scale = scale
        self._pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for name, a in tensors.items():
            layer, parent, proj, which = TENSOR_NAME.match(name).groups()  # type: ignore[union-attr]
            if which != "A":
                continue
            if not start_layer <= int(layer) < end_layer:
                raise PlacementError(f"adapter tensor {name} is not of this stage's layers")
            b = tensors.get(name[:-len("A.weight")] + "B.weight")
            if b is None:
                raise ConfigError(f"the adapter lacks the B of {name}")
            self._pairs[f"model.layers.{layer}.{parent}.{proj}.weight"] = (a, b)

    def read(self, names: Sequence[str], device: Any) -> Iterator[tuple[str, torch.Tensor]]:
        absent = sorted(set(self._pairs) - set(names))
        if absent:
            raise PlacementError(f"the model has no {absent[0]} for the adapter to go on")
        for name, tensor in self._source.read(names, device):
            pair = self._pairs.get(name)
            if pair is not None:
                a, b = pair
                delta = (b @ a) * self.scale
                if tuple(delta.shape) != tuple(tensor.shape):
                    raise PlacementError(f"adapter for {name} has shape {list(delta.shape)}, "
                                         f"the base's is {list(tensor.shape)}: refused")
                with torch.no_grad():
                    tensor = tensor.float() + delta.to(tensor.device)
            yield name, tensor


__all__ = ["AdaptedSource", "CachedTensors", "TorchRuntime", "read_adapter_tensors"]
