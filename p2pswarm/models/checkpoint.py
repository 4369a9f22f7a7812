"""A Hugging Face model directory: ``config.json`` and safetensors weights, sharded or not.

Only headers are read up front (8-byte little-endian length, then JSON naming each
tensor's dtype, shape and byte range), so listing what a stage needs costs nothing.
Weights are read with ``safe_open`` one tensor at a time, straight to the target device.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from p2pswarm.errors import ConfigError
from p2pswarm.models.families import tensor_map
from p2pswarm.models.model_dir import link_root, model_file
from p2pswarm.shapes.model_config import ModelConfig

INDEX_FILE = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 * 1024 * 1024
# bytes per element of every safetensors dtype; another is refused, not guessed
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2,
               "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
MAX_DIMS = 8


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One tensor in a safetensors file: enough to ship its raw bytes and check them."""

    name: str
    file: str  # relative to the model directory
    dtype: str  # safetensors dtype string: "BF16", "F16", "F32", ...
    shape: tuple[int, ...]
    offset_bytes: int  # where the tensor's bytes start in the file
    nbytes: int


class Checkpoint:
    """Reads config and weights of one model directory."""

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir)
        config_path = model_file(self.model_dir, "config.json")
        try:
            self.hf_config: dict[str, Any] = json.loads(config_path.read_text())
        except FileNotFoundError as exc:
            raise ConfigError(f"{config_path} not found: not a model directory") from exc
        except (OSError, ValueError, RecursionError) as exc:
            raise ConfigError(f"cannot read {config_path}: {exc}") from exc
        self.config = ModelConfig.from_hf(self.hf_config)
        self._headers: dict[str, dict[str, TensorEntry]] = {}
        self._weight_map = self._read_weight_map()

    @property
    def name(self) -> str:
        """The directory's name; for a hub snapshot, its repository's (not the commit)."""
        root = link_root(self.model_dir)
        if root != self.model_dir.resolve() and root.name.count("--") >= 2:
            return root.name.split("--", 2)[2]  # models--ORG--NAME
        return self.model_dir.name

    def tensor_names(self) -> list[str]:
        return sorted(self._weight_map)

    def entry(self, name: str) -> TensorEntry:
        try:
            file = self._weight_map[name]
        except KeyError:
            raise ConfigError(f"{self.model_dir} has no tensor {name!r}") from None
        try:
            return self._header(file)[name]
        except KeyError:
            raise ConfigError(f"{file} does not hold {name!r} as its index says") from None

    def read(self, names: Sequence[str],
             device: torch.device | str) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (name, tensor) for ``names``, each loaded alone onto ``device`` as stored."""
        by_file: dict[str, list[str]] = {}
        for name in names:
            by_file.setdefault(self.entry(name).file, []).append(name)
        for file, file_names in by_file.items():
            with safe_open(str(self.file_path(file)), framework="pt",
                           device=str(device)) as handle:
                for name in file_names:
                    yield name, handle.get_tensor(name)

    def _read_weight_map(self) -> dict[str, str]:
        index_path = model_file(self.model_dir, INDEX_FILE)
        if index_path.exists():
            try:
                raw = json.loads(index_path.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise ConfigError(f"cannot read {index_path}: {exc}") from exc
            if not isinstance(raw, dict):
                raise ConfigError(f"{index_path}: weight_map is not a mapping")
            indexed = {str(k): str(v) for k, v in raw.items()}
            for file in sorted(set(indexed.values())):
                self.file_path(file)  # refuses a name that leads out of the directory
            return indexed
        files = sorted(p.name for p in self.model_dir.glob("*.safetensors"))
        if not files:
            raise ConfigError(f"{self.model_dir} holds no *.safetensors weights")
        weight_map: dict[str, str] = {}
        for file in files:
            for name in self._header(file):
                weight_map[name] = file
        return weight_map

    def _header(self, file: str) -> dict[str, TensorEntry]:
        if file not in self._headers:
            self._headers[file] = read_safetensors_header(self.file_path(file), file)
        return self._headers[file]

    def file_path(self, file: str) -> Path:
        """The weights file ``file`` (as the index names it) in this directory: one plain
        file name, and, symlinks followed, inside the directory (or, for a Hugging Face
        hub snapshot, inside its repository folder, where the blobs it links to live)."""
        try:
            return model_file(self.model_dir, file, "weights file name")
        except ConfigError as exc:
            raise ConfigError(f"{self.model_dir / INDEX_FILE}: {exc}") from None


def read_safetensors_header(path: Path, file: str) -> dict[str, TensorEntry]:
    """Tensor entries of one safetensors file, from its header alone; every byte range
    lies inside the file and holds exactly its shape in its dtype (ConfigError if not)."""
    try:
        with path.open("rb") as f:
            file_bytes = os.fstat(f.fileno()).st_size
            size_bytes = int.from_bytes(f.read(8), "little")
            if not 0 < size_bytes <= min(MAX_HEADER_BYTES, file_bytes - 8):
                raise ConfigError(f"{path}: implausible header size {size_bytes} in a file "
                                  f"of {file_bytes} bytes: not a safetensors file")
            header = json.loads(f.read(size_bytes))
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from exc
    except (ValueError, RecursionError) as exc:
        raise ConfigError(f"{path}: header is not JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise ConfigError(f"{path}: header is not a mapping")
    data_start = 8 + size_bytes
    entries: dict[str, TensorEntry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        entries[name] = _header_entry(path, file, name, info, data_start, file_bytes)
    return entries


def _header_entry(path: Path, file: str, name: str, info: Any, data_start: int,
                  file_bytes: int) -> TensorEntry:
    def whole(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(value)
        return value

    where = f"{path}: tensor {name[:80]!r}"
    try:
        begin, end = (whole(x) for x in info["data_offsets"])
        dtype = info["dtype"]
        shape = tuple(whole(d) for d in info["shape"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"{where} has a bad header entry") from exc
    if dtype not in DTYPE_BYTES or len(shape) > MAX_DIMS:
        raise ConfigError(f"{where} has dtype {str(dtype)[:20]!r} and {len(shape)} "
                          "dimensions: not a tensor this reader knows")
    if not begin <= end or data_start + end > file_bytes:
        raise ConfigError(f"{where} claims bytes {begin}-{end} of the data, past the end of "
                          f"the file ({file_bytes - data_start} data bytes): the file is "
                          "truncated or corrupt")
    elements = 1
    for d in shape:
        elements *= d
    if elements * DTYPE_BYTES[dtype] != end - begin:
        raise ConfigError(f"{where}: shape {list(shape)} in {dtype} is "
                          f"{elements * DTYPE_BYTES[dtype]} bytes, its range {end - begin}")
    return TensorEntry(name=name, file=file, dtype=dtype, shape=shape,
                       offset_bytes=data_start + begin, nbytes=end - begin)


def stage_tensor_names(config: ModelConfig, start_layer: int, end_layer: int) -> list[str]:
    """Checkpoint tensor names a stage running layers [start_layer, end_layer) reads."""
    return list(tensor_map(config, start_layer, end_layer))


def stage_tensors(checkpoint: Checkpoint, start_layer: int, end_layer: int) -> list[TensorEntry]:
    """Where each tensor of a stage lives (file, byte range): what to ship to its fellow."""
    return [checkpoint.entry(name)
            for name in stage_tensor_names(checkpoint.config, start_layer, end_layer)]


def read_tensor_bytes(checkpoint: Checkpoint, entry: TensorEntry) -> bytes:
    """The raw bytes of one tensor as stored (little-endian, row-major)."""
    with checkpoint.file_path(entry.file).open("rb") as f:
        f.seek(entry.offset_bytes)
        data = f.read(entry.nbytes)
    if len(data) != entry.nbytes:
        raise ConfigError(f"{entry.file} is truncated at {entry.name!r}")
    return data


def tensor_sha256(checkpoint: Checkpoint, entry: TensorEntry, chunk_bytes: int = 1 << 22) -> str:
    """Hex SHA-256 of one tensor's stored bytes, read in chunks."""
    digest = hashlib.sha256()
    remaining = entry.nbytes
    with checkpoint.file_path(entry.file).open("rb") as f:
        f.seek(entry.offset_bytes)
        while remaining:
            chunk = f.read(min(chunk_bytes, remaining))
            if not chunk:
                raise ConfigError(f"{entry.file} is truncated at {entry.name!r}")
            digest.update(chunk)
            remaining -= len(chunk)
    return digest.hexdigest()


def save_checkpoint(hf_config: dict[str, Any], tensors: Sequence[tuple[str, torch.Tensor]],
                    model_dir: str | Path, *, max_shard_bytes: int | None = None) -> Path:
    """Write ``config.json`` and safetensors weights; sharded with an index when the
    tensors exceed ``max_shard_bytes``. Returns the directory."""
    from safetensors.torch import save_file

    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True))
    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if max_shard_bytes is not None and shards[-1] and shard_bytes + nbytes > max_shard_bytes:
            shards.append({})
            shard_bytes = 0
        shards[-1][name] = tensor.detach().contiguous().cpu()
        shard_bytes += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(model_dir / "model.safetensors"))
        return model_dir
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards, start=1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(model_dir / file))
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(t.numel() * t.element_size() for _, t in tensors)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (model_dir / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True))
    return model_dir
