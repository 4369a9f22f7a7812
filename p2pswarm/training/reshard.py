"""A checkpoint cut one way, re-sharded onto another cut: same model, same replicas.

A stage's state keys its parameters by the stage's own layer index (``layers.0...``).
Re-sharding rebuilds one state per parameter of the whole model, keyed by the global
layer index: the parameter, its optimizer state (AdamW's moments and step, SGD's
momentum), and its slices of every flat vector a stage or a keeper keeps in parameter
order (the sync anchor and snapshot, the error-feedback residuals, the keeper's global
parameters and outer momentum). It then splits them by the new cut, in the order each new
stage lists its parameters (embedding, layers by index, norm, head), so a stage built on
the new cut loads its state as if it had been trained there. Everything per parameter is
exact; what cannot be split is dropped or carried over from the nearest old stage: a
keeper's history of encoded updates (replicas resumed together need none), a codec's
random generator.

A tied head (the head sharing the embedding's weight) is a parameter of its own on a
last stage that is not also the first, left out of that stage's sync; a stage holding
both ends keeps one tensor for both. Re-sharding follows the same rule, copying the
embedding's state where a new last stage needs a tied head the old cut never had.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from p2pswarm.errors import ConfigError
from p2pswarm.training.checkpoint import CheckpointStore
from p2pswarm.training.replica import stage_bounds

EMBED = "embed_tokens.weight"
HEAD = "lm_head.weight"
LAYER = re.compile(r"layers\.(\d+)\.(.+)")
POSITIONS = ("data_position", "pipeline_steps", "samples_unsent", "steps_unsent")


@dataclass
class ParamState:
    """One parameter of the whole model: its value, optimizer state and flat slices."""

    value: torch.Tensor
    optimizer: dict[str, Any]
    decay: bool  # in the weight-decay group (2-D and up)
    synced: bool  # in its stage's sync vectors
    flats: dict[str, torch.Tensor] = field(default_factory=dict)


def _global(name: str, start: int) -> str:
    m = LAYER.fullmatch(name)
    return f"layers.{int(m.group(1)) + start}.{m.group(2)}" if m else name


def _local(name: str, start: int) -> str:
    m = LAYER.fullmatch(name)
    return f"layers.{int(m.group(1)) - start}.{m.group(2)}" if m else name


def _layer(name: str) -> int | None:
    m = LAYER.fullmatch(name)
    return int(m.group(1)) if m else None


def _groups_by_name(names: Sequence[str], params: Mapping[str, torch.Tensor],
                    optimizer: Mapping[str, Any]) -> list[list[str]]:
    """The optimizer's parameter groups as names: the decay group (2-D and up) first, then
    the rest, empty ones left out (``stage.make_optimizer``)."""
    decay = [n for n in names if params[n].dim() >= 2]
    rest = [n for n in names if params[n].dim() < 2]
    groups = [g for g in (decay, rest) if g]
    got = [len(g["params"]) for g in optimizer["param_groups"]]
    if got != [len(g) for g in groups] and not (not groups and got == [0]):
        raise ConfigError(f"a stage's optimizer state holds groups of {got} parameters, "
                          f"its parameters make {[len(g) for g in groups]}")
    return groups


def _synced_names(stage: Mapping[str, Any], names: list[str], is_first: bool,
                  sync: Mapping[str, Any] | None) -> list[str]:
    """The names in the stage's sync vectors: all, less a tied head on a last stage."""
    if sync is None or HEAD not in names or is_first:
        return names
    params = stage["params"]
    total = sum(params[n].numel() for n in names)
    if int(sync["anchor"].numel()) == total - params[HEAD].numel():
        return [n for n in names if n != HEAD]
    return names


def _split(flat: torch.Tensor, names: Sequence[str], sizes: Mapping[str, int],
           what: str) -> dict[str, torch.Tensor]:
    if flat.numel() != sum(sizes[n] for n in names):
        raise ConfigError(f"{what}: {flat.numel()} values for parameters of "
                          f"{sum(sizes[n] for n in names)}")
    out, offset = {}, 0
    for n in names:
        out[n] = flat[offset:offset + sizes[n]]
        offset += sizes[n]
    return out


class ModelState:
    """The per-parameter state of one replica's whole model, from its stages' states."""

    def __init__(self, stages: Sequence[Mapping[str, Any]]) -> None:
        self.params: dict[str, ParamState] = {}
        self.order: list[str] = []  # global names in pipeline order
        self.stage_names: list[list[str]] = []  # each old stage's synced global names
        first = stages[0]["stage"]
        self.steps = int(first["steps"])
        self.num_layers = int(stages[-1]["stage"]["end_layer"])
        self.group_settings: dict[bool, dict[str, Any]] = {}
        self.tied = False
        self.sync_version = int(stages[0]["sync"]["version"]) if "sync" in stages[0] else 0
        self.codecs = [s["sync"]["compressor"]["codec"] for s in stages if "sync" in s]
        for index, shard in enumerate(stages):
            self._add(shard, is_first=index == 0, is_last=index == len(stages) - 1)

    def _add(self, shard: Mapping[str, Any], *, is_first: bool, is_last: bool) -> None:
        stage, sync = shard["stage"], shard.get("sync")
        start = int(stage["start_layer"])
        params: dict[str, torch.Tensor] = stage["params"]
        names = list(params)
        groups = _groups_by_name(names, params, stage["optimizer"])
        opt_state = stage["optimizer"]["state"]
        for n in names:  # in the stage's own order, which the flat vectors follow
            self._put(_global(n, start), params[n])
        for names_in, group in zip(groups, stage["optimizer"]["param_groups"], strict=True):
            decay = params[names_in[0]].dim() >= 2
            self.group_settings.setdefault(
                decay, {k: v for k, v in group.items() if k != "params"})
            for n, pid in zip(names_in, group["params"], strict=True):
                entry = self.params[_global(n, start)]
                entry.optimizer, entry.decay = dict(opt_state.get(pid, {})), decay
        synced = _synced_names(stage, names, is_first, sync)
        if is_last and not is_first and HEAD in names and HEAD not in synced:
            self.tied = True
        if is_first and is_last and HEAD not in names and EMBED in names:
            self.tied = True  # one tensor for both ends
        for n in names:
            self.params[_global(n, start)].synced = n in synced
        glob = [_global(n, start) for n in synced]
        self.stage_names.append(glob)
        if sync is not None:
            sizes = {_global(n, start): params[n].numel() for n in names}
            for key, flat in (("anchor", sync["anchor"]), ("snapshot", sync["snapshot"]),
                              ("residual", sync["compressor"]["residual"])):
                for g, piece in _split(flat, glob, sizes, f"sync {key}").items():
                    self.params[g].flats[key] = piece

    def _put(self, name: str, value: torch.Tensor) -> None:
        if name in self.params:
            raise ConfigError(f"the checkpoint holds parameter {name} twice")
        self.params[name] = ParamState(value, {}, value.dim() >= 2, synced=True)
        self.order.append(name)

    def names_for(self, start: int, end: int) -> list[str]:
        """The global names a stage of layers [start, end) lists, in its order."""
        first, last = start == 0, end == self.num_layers
        out = []
        for n in self.order:
            layer = _layer(n)
            if layer is not None:
                if start <= layer < end:
                    out.append(n)
            elif n == EMBED:
                if first:
                    out.append(n)
            elif n == HEAD:
                if last and not (first and self.tied):
                    out.append(n)
            elif last:
                out.append(n)  # the final norm
        if last and not first and self.tied and HEAD not in out:
            out.append(HEAD)
        return out

    def param(self, name: str) -> ParamState:
        if name == HEAD and name not in self.params and self.tied:
            embed = self.params[EMBED]  # the tied head takes the embedding's state
            return ParamState(embed.value, embed.optimizer, embed.decay, synced=False)
        try:
            return self.params[name]
        except KeyError:
            raise ConfigError(f"the checkpoint holds no parameter {name}") from None

    def stage_state(self, index: int, start: int, end: int) -> dict[str, Any]:
        """The state (``stage`` and ``sync``) of stage ``index`` of layers [start, end)."""
        names = self.names_for(start, end)
        first, last = start == 0, end == self.num_layers
        states = {n: self.param(n) for n in names}
        groups = [g for g in ([n for n in names if states[n].decay],
                              [n for n in names if not states[n].decay]) if g]
        opt_state: dict[int, dict[str, Any]] = {}
        param_groups = []
        pid = 0
        for group in groups:
            ids = []
            for n in group:
                if states[n].optimizer:
                    opt_state[pid] = {k: v.clone() if isinstance(v, torch.Tensor) else v
                                      for k, v in states[n].optimizer.items()}
                ids.append(pid)
                pid += 1
            settings = self.group_settings.get(states[group[0]].decay) \
                or next(iter(self.group_settings.values()))
            param_groups.append({**settings, "params": ids})
        if not param_groups:
            param_groups = [{**next(iter(self.group_settings.values()), {}), "params": []}]
        stage = {"start_layer": start, "end_layer": end, "steps": self.steps,
                 "params": {_local(n, start): states[n].value.clone() for n in names},
                 "optimizer": {"state": opt_state, "param_groups": param_groups}}
        synced = [n for n in names
                  if not (last and not first and self.tied and n == HEAD)]
        out: dict[str, Any] = {"stage": stage}
        if self.codecs:
            flat = {key: _cat([states[n].flats[key] for n in synced])
                    for key in ("anchor", "snapshot", "residual")}
            out["sync"] = {"anchor": flat["anchor"], "snapshot": flat["snapshot"],
                           "version": self.sync_version,
                           "compressor": {"residual": flat["residual"],
                                          "codec": self.codecs[min(index,
                                                                   len(self.codecs) - 1)]}}
        return out

    def synced_of(self, start: int, end: int) -> list[str]:
        names = self.names_for(start, end)
        first, last = start == 0, end == self.num_layers
        return [n for n in names if not (last and not first and self.tied and n == HEAD)]


def _cat(pieces: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([p.reshape(-1) for p in pieces]) if pieces else torch.zeros(0)


def reshard_keepers(keepers: Sequence[Mapping[str, Any]], model: ModelState,
                    cut: Sequence[int]) -> list[dict[str, Any]]:
    """The keepers' states (global parameters, outer momentum, residual) on the new cut;
    their update histories are dropped (resumed replicas are at the keepers' version)."""
    if len(keepers) != len(model.stage_names):
        raise ConfigError(f"{len(keepers)} keepers for {len(model.stage_names)} stages")
    sizes = {n: p.value.numel() for n, p in model.params.items()}
    pieces: dict[str, dict[str, torch.Tensor]] = {}
    versions = {int(k["version"]) for k in keepers}
    if len(versions) != 1:
        raise ConfigError(f"the keepers stand at different versions {sorted(versions)}")
    for keeper, names in zip(keepers, model.stage_names, strict=True):
        for key, flat in (("params", keeper["params"]), ("momentum", keeper["momentum"]),
                          ("residual", keeper["compressor"]["residual"])):
            for n, piece in _split(flat, names, sizes, f"keeper {key}").items():
                pieces.setdefault(n, {})[key] = piece
    out = []
    for s, (start, end) in enumerate(stage_bounds(model.num_layers, cut)):
        names = model.synced_of(start, end)
        old = keepers[min(s, len(keepers) - 1)]
        out.append({"version": int(old["version"]),
                    "params": _cat([pieces[n]["params"] for n in names]),
                    "momentum": _cat([pieces[n]["momentum"] for n in names]),
                    "compressor": {"residual": _cat([pieces[n]["residual"] for n in names]),
                                   "codec": old["compressor"]["codec"]},
                    "history": {}})
    return out


def reshard_stages(stages: Sequence[Mapping[str, Any]], cut: Sequence[int]
                   ) -> tuple[list[dict[str, Any]], ModelState]:
    """One replica's stage states, cut anew at ``cut``."""
    model = ModelState(stages)
    bounds = stage_bounds(model.num_layers, cut)
    return [model.stage_state(i, a, b) for i, (a, b) in enumerate(bounds)], model


def reshard_checkpoint(store: CheckpointStore, step: int, cut: Sequence[int]
                       ) -> CheckpointStore:
    """Checkpoint ``step`` of ``store`` re-sharded onto ``cut``, written as a checkpoint
    of its own (same step, same meta but the cut) in a scratch directory beside it."""
    manifest = store.manifest(step)
    meta = dict(manifest["meta"])
    names = set(manifest["shards"])
    old_stages = len(meta["cut"]) + 1
    replicas = int(meta["replicas"])
    positions = meta.get("positions") or {}
    shards: dict[str, dict[str, Any]] = {}
    new_positions: dict[str, dict[str, int]] = {}
    first_model: ModelState | None = None
    for i in range(replicas):
        olds = [store.read(step, f"replica-{i}.stage-{s}") for s in range(old_stages)]
        news, model = reshard_stages(olds, cut)
        first_model = first_model or model
        old = positions.get(f"replica-{i}.stage-0") or olds[0]
        where = {k: int(old[k]) for k in POSITIONS}
        where["version"] = int(old["version"] if "version" in old
                               else olds[0]["sync"]["version"])
        if old.get("global_state"):  # its shards stand in: it resumes on the global state
            where["global_state"] = 1
        for s, state in enumerate(news):
            shards[f"replica-{i}.stage-{s}"] = state
            new_positions[f"replica-{i}.stage-{s}"] = where
    if "keeper.stage-0" in names and first_model is not None:
        keepers = [store.read(step, f"keeper.stage-{s}") for s in range(old_stages)]
        for s, state in enumerate(reshard_keepers(keepers, first_model, cut)):
            shards[f"keeper.stage-{s}"] = state
    out = CheckpointStore(store.directory / f".reshard-{step:08d}", keep=1)
    out.write(step, shards, {**meta, "cut": list(cut), "positions": new_positions})
    return out


__all__ = ["ModelState", "reshard_checkpoint", "reshard_keepers", "reshard_stages"]
