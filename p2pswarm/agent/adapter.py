"""LoRA adapters served on top of their base: read, checked, shipped per stage, merged.

Theory of operation. ``load MODEL --adapter DIR`` reads the adapter directory where the
load runs (``adapter_config.json`` and ``adapter_model.safetensors``, as ``save_adapters``
and ``jobs export`` write them) and makes an ``AdapterManifest``: each adapter tensor's
byte range and SHA-256, and a content hash over the config and every tensor. Before the
leader is asked, the adapter is checked against the base: the base it names, its target
modules (the model's family must have them: Llama's ``self_attn``/``mlp`` maps, RWKV-7's
``attn.{r,k,v,o}_proj`` and ``ffn.key``/``ffn.value``) and every tensor's shape against
the base's own tensor. The load request carries
the content hash, so the plan and its ``plan_id`` differ with and without an adapter
(``adapted_plan``), and a pin made for one is never taken for the other.

The adapter's tensors travel like weights (``p2pswarm.agent.weights``): the fellow where
``load`` runs offers them, each stage order names only its own layers' tensors, and a
stage fellow fetches those into its verified cache (or, on the fellow that has the
directory, reads them from it and checks them there). The torch runtime's
``AdaptedSource`` (``p2pswarm.agent.serving.torch_runtime``) wraps the stage's tensor
source and merges ``W + (alpha / rank) * B @ A`` (in float32) into each adapted weight
as the stage reads it, before any cast or quantization: the stage holds exactly the
base's bytes, so decode costs nothing extra and the plan's memory claim stays true.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypedDict

from p2pswarm.agent.weights import Manifest, ManifestTensor
from p2pswarm.errors import ConfigError
from p2pswarm.models.lora_targets import family_targets, proj_parents
from p2pswarm.models.model_dir import model_file
from p2pswarm.planner.plan_values import Plan
from p2pswarm.shapes.model_config import ModelConfig

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# any family's adapted map (Llama's self_attn/mlp, RWKV-7's attn/ffn); check_adapter then
# holds each tensor to its base's own family
TENSOR_NAME = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp|attn|ffn)\."
                   r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|r_proj|key|value)"
                   r"\.lora_([AB])\.weight$")
_FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")


class AdapterPublic(TypedDict):
    """What a load's adapter block says of the adapter (its asker adds where it is served
    from and its tensors' manifest)."""

    name: str
    path: str
    sha256: str
    base: str
    rank: int
    alpha: float
    targets: list[str]


@dataclass(frozen=True, slots=True)
class AdapterManifest:
    """An adapter directory, tensor by tensor, with hashes; ``sha256``: its content."""

    path: str
    name: str
    base: str  # the base it names (base_model_name_or_path), "" if none
    rank: int
    alpha: float
    targets: tuple[str, ...]
    sha256: str
    manifest: Manifest  # the tensors, served and fetched like a model's

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def public(self) -> AdapterPublic:
        # the directory's name only: paths on this fellow never travel
        return AdapterPublic(name=self.name, path=self.name, sha256=self.sha256,
                             base=self.base, rank=self.rank, alpha=self.alpha,
                             targets=list(self.targets))


def read_adapter(adapter_dir: str | Path) -> AdapterManifest:
    """Read and hash an adapter directory (blocking); ConfigError says what is wrong."""
    from p2pswarm.models.checkpoint import read_safetensors_header

    root = Path(adapter_dir).expanduser().resolve()
    if not root.is_dir():
        raise ConfigError(f"adapter directory {root} does not exist")
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if not model_file(root, name).is_file():
            raise ConfigError(f"{root} has no {name}: not a LoRA adapter directory "
                              "(`p2pswarm jobs export` writes one)")
    try:
        raw = json.loads((root / ADAPTER_CONFIG).read_text())
        rank, alpha = int(raw["r"]), float(raw["lora_alpha"])
        targets = tuple(sorted(str(t) for t in raw["target_modules"]))
        base = str(raw.get("base_model_name_or_path") or "")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"cannot read {root / ADAPTER_CONFIG}: {exc}") from None
    if rank < 1:
        raise ConfigError(f"{root / ADAPTER_CONFIG}: rank r must be at least 1, got {rank}")
    entries = read_safetensors_header(root / ADAPTER_WEIGHTS, ADAPTER_WEIGHTS)
    tensors = []
    for name in sorted(entries):
        e = entries[name]
        if not TENSOR_NAME.match(name):
            raise ConfigError(f"{root / ADAPTER_WEIGHTS}: {name!r} is not a LoRA adapter "
                              "tensor of a layer's projection")
        if e.dtype not in _FLOAT_DTYPES:
            raise ConfigError(f"{root / ADAPTER_WEIGHTS}: {name} has dtype {e.dtype}")
        digest = hashlib.sha256()
        with (root / ADAPTER_WEIGHTS).open("rb") as f:
            f.seek(e.offset_bytes)
            data = f.read(e.nbytes)
        if len(data) != e.nbytes:
            raise ConfigError(f"{root / ADAPTER_WEIGHTS} is truncated at {name}")
        digest.update(data)
        tensors.append(ManifestTensor(name, ADAPTER_WEIGHTS, e.dtype, e.shape, e.offset_bytes,
                                      e.nbytes, digest.hexdigest()))
    if not tensors:
        raise ConfigError(f"{root / ADAPTER_WEIGHTS} holds no adapter tensors")
    config = {"r": rank, "lora_alpha": alpha, "target_modules": list(targets), "base": base}
    canon = json.dumps([config, [t.to_list()[:1] + t.to_list()[2:] for t in tensors]],
                       sort_keys=True)
    sha = hashlib.sha256(canon.encode()).hexdigest()
    manifest = Manifest(key=sha[:16], name=root.name, path=str(root), hf_config=config,
                        tensors=tuple(tensors), files=())
    return AdapterManifest(path=str(root), name=root.name, base=base, rank=rank, alpha=alpha,
                           targets=targets, sha256=sha, manifest=manifest)


def _base_matches(base: str, model_name: str, model_path: str | None) -> bool:
    if not base:
        return True  # nothing named: the shapes decide
    if base == model_name:
        return True
    where = Path(base).expanduser()
    if model_path is not None:
        try:
            if where.resolve() == Path(model_path).resolve():
                return True
        except OSError:
            pass
    return where.name == model_name  # a path, or a hub id "org/name", ending in the name


def check_adapter(adapter: AdapterManifest, hf_config: dict[str, Any], model_name: str,
                  model_path: str | None = None) -> None:
    """Refuse (ConfigError) an adapter that is not for this base: another base named,
    target modules the model lacks, or any tensor's shape not the base's."""
    from p2pswarm.models.checkpoint import stage_tensor_names  # imports torch
    from p2pswarm.models.families import tensor_shape

    where = adapter.path
    if not _base_matches(adapter.base, model_name, model_path):
        raise ConfigError(f"adapter {where} is for the base {adapter.base!r}, not "
                          f"{model_name!r}: load it on its own base")
    config = ModelConfig.from_hf(hf_config)
    names = set(stage_tensor_names(config, 0, config.num_layers))
    parents = proj_parents(config.model_type)
    # a job on RWKV-7 may name its targets the Llama way (q_proj for r_proj, ...)
    targets = family_targets(config.model_type, adapter.targets)
    lacking = [t for t in targets
               if t not in parents or f"model.layers.0.{parents[t]}.{t}.weight" not in names]
    if lacking:
        raise ConfigError(f"adapter {where} targets {', '.join(lacking)}, which {model_name} "
                          "does not have")
    by_name = {t.name: t for t in adapter.manifest.tensors}
    for t in adapter.manifest.tensors:
        layer, parent, proj, which = TENSOR_NAME.match(t.name).groups()  # type: ignore[union-attr]
        if int(layer) >= config.num_layers:
            raise ConfigError(f"adapter {where} has layer {layer}; {model_name} has "
                              f"{config.num_layers} layers: not an adapter for this base")
        if proj not in targets or parents.get(proj) != parent:
            raise ConfigError(f"adapter {where}: {t.name} is not among its target_modules "
                              f"as {model_name} names them")
        base = f"model.layers.{layer}.{parent}.{proj}.weight"
        if base not in names:
            raise ConfigError(f"adapter {where}: {model_name} has no {base}")
        out_f, in_f = tensor_shape(config, base)
        want = (adapter.rank, in_f) if which == "A" else (out_f, adapter.rank)
        if t.shape != want:
            raise ConfigError(f"adapter {where}: {t.name} has shape {list(t.shape)}, "
                              f"{model_name} needs {list(want)}: not an adapter for this base")
        pair = t.name[:-len("A.weight")] + ("B" if which == "A" else "A") + ".weight"
        if pair not in by_name:
            raise ConfigError(f"adapter {where} lacks {pair}")


def _adapter_sha(adapter_sha256: object) -> str:
    sha = str(adapter_sha256)
    if not re.fullmatch(r"[0-9a-f]{64}", sha):
        raise ConfigError("\"adapter\" in a plan request must be the adapter's SHA-256")
    return sha


def _adapted_id(plan_id: str, sha: str) -> str:
    return hashlib.sha256(f"{plan_id}/adapter/{sha}".encode()).hexdigest()[:16]


def adapted(plan: Plan, adapter_sha256: str) -> Plan:
    """The plan with the adapter in it: its content hash, and a ``plan_id`` that differs
    from the base's (and from any other adapter's); ``plan`` itself without one."""
    if not adapter_sha256:
        return plan
    sha = _adapter_sha(adapter_sha256)
    return replace(plan, plan_id=_adapted_id(plan.plan_id, sha), base_plan_id=plan.plan_id,
                   adapter=sha)


def adapted_plan(plan: Any, adapter_sha256: Any) -> Any:
    """``adapted`` on a plan's document (a fleet plan's too), for the readers that still
    hold one: the same ``plan_id``, ``base_plan_id`` and ``adapter``."""
    base_id = plan.get("plan_id") if isinstance(plan, dict) else None
    if not isinstance(base_id, str) or not adapter_sha256:
        return plan
    sha = _adapter_sha(adapter_sha256)
    return {**plan, "plan_id": _adapted_id(base_id, sha), "base_plan_id": base_id,
            "adapter": sha}


# --- on the stage's fellow ---------------------------------------------------------------


def stage_block(adapter: dict[str, Any], start_layer: int, end_layer: int) -> dict[str, Any]:
    """What one stage's order carries of the adapter: its config and source, and only its
    own layers' tensors."""
    manifest = Manifest.from_dict(adapter.get("manifest") or {})
    mine = [t.to_list() for t in manifest.tensors
            if start_layer <= int(TENSOR_NAME.match(t.name).group(1)) < end_layer]  # type: ignore[union-attr]
    return {**adapter, "manifest": {**manifest.to_dict(), "tensors": mine}}


def block_manifest(block: dict[str, Any]) -> Manifest:
    return Manifest.from_dict(block.get("manifest") or {})
