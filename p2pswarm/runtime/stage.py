"""The stage host: one stage's layers on one card, with a KV cache per session.

A session's tokens go through ``prefill`` (the prompt, in chunks of
``prefill_chunk_tokens`` so activations stay bounded) and then ``decode`` (one token per
step). The first stage takes token ids, the others the previous stage's hidden states;
the last returns float32 logits, the others hidden states for the next stage. Positions
are checked against the cache: a stage refuses tokens that do not continue its session
exactly where its cache ends, so a lost or repeated frame cannot silently corrupt it.

A stage runs one call at a time (its dequant workspace and cache are shared state); the
agent serialises calls, e.g. one worker thread per card.
"""

from __future__ import annotations

import gc
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from p2pswarm.errors import PlacementError, RemoteProtocolError
from p2pswarm.models.families import AnyStageModel, hidden_width
from p2pswarm.models.llama import StageModel, fuse_linears
from p2pswarm.models.loader import TensorSource, compute_dtype, load_stage_model, open_model
from p2pswarm.models.quant import packed_bytes
from p2pswarm.runtime.batch import batchable, batched_decode
from p2pswarm.runtime.kv_cache import KVCache
from p2pswarm.runtime.recurrent_state import RecurrentState
from p2pswarm.runtime.spec import StageSpec
from p2pswarm.shapes.model_config import ModelConfig

StageInput = torch.Tensor | Sequence[int]


class Stage:
    """Layers [spec.start_layer, spec.end_layer) of one model on ``spec.device``, with the
    KV cache the spec sizes (a recurrent model: its fixed-size state per session),
    allocated whole when the stage is made."""

    def __init__(self, model: AnyStageModel, spec: StageSpec) -> None:
        if (model.start_layer, model.end_layer) != (spec.start_layer, spec.end_layer):
            raise ValueError("model and spec disagree on the layer range")
        self.spec = spec
        self.config: ModelConfig = model.config
        self.is_first = model.is_first
        self.is_last = model.is_last
        self.dtype = compute_dtype(spec.dtype)
        self.device = torch.device(spec.device)
        self.hidden_width = hidden_width(self.config)
        self._model: AnyStageModel | None = model
        self._fused = False  # ``fuse_linears`` done (at the first step, see ``_loaded``)
        self._kv: KVCache | RecurrentState | None
        if self.config.recurrent:
            self._kv = RecurrentState(
                num_layers=spec.end_layer - spec.start_layer,
                hidden_size=self.config.hidden_size, num_heads=self.config.num_heads,
                head_size=self.config.head_dim, max_sessions=spec.max_sessions,
                compute_dtype=self.dtype, device=self.device)
        else:
            self._kv = KVCache(
                num_layers=spec.end_layer - spec.start_layer,
                num_kv_heads=self.config.num_kv_heads, head_dim=self.config.head_dim,
                max_context_tokens=spec.max_context_tokens, max_sessions=spec.max_sessions,
                kv_dtype=spec.kv_dtype, compute_dtype=self.dtype, device=self.device,
                layer_windows=[self.config.layer_window(i)
                               for i in range(spec.start_layer, spec.end_layer)],
            )

    @classmethod
    def load(cls, source: TensorSource | str | Path, spec: StageSpec) -> Stage:
        """Load from a built-in model name, a model directory, or any tensor source."""
        if isinstance(source, (str, Path)):
            source = open_model(source)
        if spec.max_context_tokens > source.config.max_context_tokens:
            raise PlacementError(
                f"context of {spec.max_context_tokens} tokens exceeds the model's "
                f"{source.config.max_context_tokens}")
        if spec.end_layer > source.config.num_layers:
            raise PlacementError(
                f"layers [{spec.start_layer}, {spec.end_layer}) do not exist in a "
                f"{source.config.num_layers}-layer model")
        model = load_stage_model(source, spec.start_layer, spec.end_layer, dtype=spec.dtype,
                                 device=spec.device, quant=spec.quant,
                                 group_size=spec.quant_group_size)
        return cls(model, spec)

    @classmethod
    def from_checkpoint(cls, model_dir: str | Path, spec: StageSpec) -> Stage:
        return cls.load(Path(model_dir), spec)

    @classmethod
    def from_builtin(cls, name: str, spec: StageSpec) -> Stage:
        return cls.load(name, spec)

    @property
    def start_layer(self) -> int:
        return self.spec.start_layer

    @property
    def end_layer(self) -> int:
        return self.spec.end_layer

    @property
    def sessions(self) -> tuple[str, ...]:
        return self._loaded()[1].sessions

    def session_length(self, session: str) -> int:
        return self._loaded()[1].length(session)

    def prefill(self, session: str, inputs: StageInput,
                positions: torch.Tensor | int | None = None, *,
                all_logits: bool = False) -> torch.Tensor:
        """Run the next tokens of ``session`` through this stage, in chunks.

        ``inputs``: token ids (T,) on the first stage, hidden states (T, hidden) on the
        others. ``positions``: the first position, or all T of them; by default the
        session continues where its cache ends. Returns hidden states (T, hidden), or on
        the last stage float32 logits (1, vocab) for the last token, (T, vocab) with
        ``all_logits``.
        """
        model, kv = self._loaded()
        x = self._check_inputs(inputs)
        T = x.shape[0]
        start = self._check_positions(session, positions, T, kv)
        kv.open(session)
        view = kv.view(session)
        outputs: list[torch.Tensor] = []
        keep_all = not self.is_last or all_logits
        chunk = self.spec.prefill_chunk_tokens
        with torch.inference_mode():  # no autograd bookkeeping per op
            for begin in range(0, T, chunk):
                part = x[begin:begin + chunk].unsqueeze(0)
                out = model(part, start + begin, view,
                            last_logits_only=not keep_all)
                if keep_all or begin + chunk >= T:
                    outputs.append(out[0])
                kv.set_length(session, start + begin + part.shape[1])
        return torch.cat(outputs) if len(outputs) > 1 else outputs[0]

    def decode(self, session: str, inputs: StageInput,
               position: torch.Tensor | int | None = None) -> torch.Tensor:
        """One token of ``session``: a token id (or (1,) ids) or hidden states (1, hidden).
        Returns (1, hidden), or (1, vocab) logits on the last stage."""
        if isinstance(inputs, int):
            inputs = [inputs]
        x = self._check_inputs(inputs)
        if x.shape[0] != 1:
            raise RemoteProtocolError("bad-stage-input", f"decode takes 1 token, got {x.shape[0]}")
        return self.prefill(session, x, position)

    def end_session(self, session: str) -> None:
        if self._kv is not None:
            self._kv.close(session)

    def keep_session(self, session: str) -> None:
        """End ``session`` but keep its cache for a later turn (evicted when a new session
        needs the slot). A recurrent state cannot be cut back to a prefix: it ends."""
        if isinstance(self._kv, KVCache):
            self._kv.keep(session)
        elif self._kv is not None:
            self._kv.close(session)

    def resume_session(self, session: str, length: int) -> bool:
        """Continue a kept ``session`` from its first ``length`` positions; False when the
        cache was evicted (or is shorter)."""
        return isinstance(self._kv, KVCache) and self._kv.resume(session, length)

    def has_room(self, session: str) -> bool:
        """Whether ``session`` can take (or holds) a slot now."""
        if isinstance(self._kv, KVCache):
            return self._kv.has_room(session)
        return self._kv is not None and (session in self._kv.sessions
                                         or len(self._kv.sessions) < self.spec.max_sessions)

    @property
    def kept_sessions(self) -> tuple[str, ...]:
        return self._kv.kept if isinstance(self._kv, KVCache) else ()

    def decode_batch(self, sessions: Sequence[str], inputs: torch.Tensor,
                     positions: Sequence[int]) -> torch.Tensor:
        """One token for each of several sessions, in one forward: token ids (B,) on the
        first stage, hidden states (B, hidden) elsewhere, each session at its own
        position (where its cache ends). Returns (B, hidden), or (B, vocab) logits."""
        model, kv = self._loaded()
        if len(set(sessions)) != len(sessions) or len(positions) != len(sessions):
            raise RemoteProtocolError("bad-stage-input", "a batch names a session twice")
        x = self._check_batch_inputs(inputs, len(sessions))
        if not (isinstance(kv, KVCache) and isinstance(model, StageModel)
                and batchable(model)):  # recurrent, sliding windows, capped scores: one by one
            return torch.cat([self.prefill(session, x[i:i + 1], position)
                              for i, (session, position) in enumerate(zip(sessions, positions))])
        for session, position in zip(sessions, positions):
            self._check_positions(session, position, 1, kv)
            kv.open(session)
        slots = [kv.slot(s) for s in sessions]
        with torch.inference_mode():  # no autograd bookkeeping per op
            out = batched_decode(model, kv, slots, x, list(positions))
        for session, position in zip(sessions, positions):
            kv.set_length(session, position + 1)
        return out

    def unload(self) -> None:
        """Free the weights and the KV cache; the stage cannot run again."""
        if self._kv is not None:
            self._kv.release()
        self._model = None
        self._kv = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @property
    def loaded(self) -> bool:
        return self._model is not None

    def allocated_bytes(self) -> int:
        """Bytes this stage really holds: parameters, buffers, prepacked int8 weights (held
        by the kernel library, not in tensors), dequant workspace, KV cache.

        Storages shared by several tensors (a tied head) count once.
        """
        if self._model is None or self._kv is None:
            return 0
        tensors: list[torch.Tensor] = [*self._model.parameters(), *self._model.buffers()]
        if self._model.workspace is not None:
            tensors.append(self._model.workspace.buffer)
        return (_storage_bytes(tensors) + packed_bytes(self._model)
                + self._kv.allocated_bytes())

    def _loaded(self) -> tuple[AnyStageModel, KVCache | RecurrentState]:
        if self._model is None or self._kv is None:
            raise PlacementError(f"stage [{self.start_layer}, {self.end_layer}) is unloaded")
        if not self._fused:
            # at the first step, not at load: adapters put on the loaded model (a resumed
            # LoRA) keep their linears separate, which fusing leaves as they are
            self._fused = True
            if isinstance(self._model, StageModel):
                fuse_linears(self._model)
        return self._model, self._kv

    def _check_batch_inputs(self, inputs: torch.Tensor, n: int) -> torch.Tensor:
        x = self._check_inputs(inputs)
        if x.shape[0] != n:
            raise RemoteProtocolError("bad-stage-input",
                                      f"a batch of {n} sessions got {x.shape[0]} rows")
        return x

    def _check_inputs(self, inputs: StageInput) -> torch.Tensor:
        if not isinstance(inputs, torch.Tensor):
            inputs = torch.tensor(list(inputs), dtype=torch.long)
        if self.is_first:
            if inputs.dim() != 1 or inputs.dtype not in (torch.int64, torch.int32):
                raise RemoteProtocolError(
                    "bad-stage-input",
                    f"first stage takes token ids (T,), got {inputs.dtype} {tuple(inputs.shape)}")
            if inputs.numel() and (inputs.min() < 0 or inputs.max() >= self.config.vocab_size):
                raise RemoteProtocolError("bad-stage-input", "token id outside the vocabulary")
            x = inputs.to(device=self.device, dtype=torch.long)
        else:
            if (inputs.dim() != 2 or inputs.shape[1] != self.hidden_width
                    or not inputs.is_floating_point()):
                raise RemoteProtocolError(
                    "bad-stage-input",
                    f"stage takes hidden states (T, {self.hidden_width}), "
                    f"got {inputs.dtype} {tuple(inputs.shape)}")
            x = inputs.to(device=self.device, dtype=self.dtype)  # stages may differ in dtype
        if x.shape[0] == 0:
            raise RemoteProtocolError("bad-stage-input", "no tokens")
        return x

    def _check_positions(self, session: str, positions: torch.Tensor | int | None, T: int,
                         kv: KVCache | RecurrentState) -> int:
        start = kv.length(session) if session in kv.sessions else 0
        if isinstance(positions, torch.Tensor):
            expected = torch.arange(start, start + T)
            if positions.shape != (T,) or not torch.equal(positions.cpu().long(), expected):
                raise RemoteProtocolError(
                    "position-mismatch", f"session {session} continues at position {start}")
        elif positions is not None and positions != start:
            raise RemoteProtocolError(
                "position-mismatch",
                f"session {session} continues at position {start}, not {positions}")
        if start + T > self.spec.max_context_tokens and not self.config.recurrent:
            raise PlacementError(
                f"session {session} would reach {start + T} tokens; this stage holds "
                f"{self.spec.max_context_tokens}")
        return start


def _storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    storages: dict[tuple[str, int], int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        storages[(str(t.device), storage.data_ptr())] = storage.nbytes()
    return sum(storages.values())
