"""The planner's cost model: what a stage claims on a card (bytes) and how long it takes.

Bytes. A stage of ``n`` layers claims ``fixed + n * per_layer`` bytes, where ``fixed``
depends on the card's kind and on whether the stage is the first (input embeddings)
and/or the last (final norm, head, logits). Every layer of a Llama-family model has the
same shape, which is what makes this linear form exact and the searches fast.

Serving, per card: weights of its layers; embeddings/head/dequantisation buffer;
KV cache = layers x context x sequences x ``2 * n_kv_heads * head_dim * bytes(kv)``;
activations of one prefill chunk (and the last position's f32 logits on the last
stage); workspace = CUDA context or OS headroom plus blockwise attention scratch.

Training, per card: weights; gradients and optimizer state (f32 gradients, f32 master
weights for 16-bit weights, two AdamW moments or one SGD momentum) for the trained
parameters; LoRA adapters in f32; activations of every micro-batch of a step kept
until its backward (a conservative bound on 1F1B), only layer inputs plus one layer's
recomputation under activation checkpointing; logits and their gradient on the last.

Time. A roofline per stage, ``max(FLOPs / FLOP/s, bytes read / bandwidth)`` with the
card's measured (or estimated) speed; a quantised stage (int8, int4) takes its f16
roofline times the card's measured speed ratio of the two (``p2pswarm bench`` runs a
linear of each dtype: ``CardView.dtype_tokens_per_s``), or, never measured,
``UNMEASURED_QUANT_FACTOR`` times it: fewer bytes are not assumed to be faster, since a
kernel that dequantises may be far slower than its bytes say. Plus per hop between
stages the link's latency plus the activation bytes over its bandwidth. Serving time per
token is one decode step of every sequence through all stages; training's is one
micro-batch forward and backward through all stages.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from p2pswarm.planner.cluster import CardView, Link
from p2pswarm.planner.profile import QUANTIZED, SERVING_DTYPE, ModelProfile, compute_bytes
from p2pswarm.planner.request import PlanRequest, serving_dtype

WORKSPACE_BYTES = {"cuda": 320 * 2**20, "cpu": 256 * 2**20}  # CUDA context / OS headroom
PREFILL_CHUNK_TOKENS = 256  # prompt tokens per forward while prefilling (the runtime's)
ATTENTION_BLOCK_TOKENS = 1024  # keys per block of blockwise attention
OPTIMIZER_STATE_BYTES = {"adamw": 8, "sgd": 4}  # per trained parameter, f32
GRAD_BYTES = 4  # gradients accumulate in f32
# A quantised stage on a card whose int8/int4 speed was never measured: this many times
# the same stage's f16 time (conservative: dequantising kernels can be slower than f16)
UNMEASURED_QUANT_FACTOR = 2.0


@dataclass(frozen=True, slots=True)
class Claims:
    """Bytes one stage claims on its card, by segment."""

    weights: int = 0
    embeddings_head_buffers: int = 0
    kv_cache: int = 0
    activations: int = 0
    optimizer: int = 0
    lora: int = 0
    workspace: int = 0

    @property
    def total(self) -> int:
        return (self.weights + self.embeddings_head_buffers + self.kv_cache + self.activations
                + self.optimizer + self.lora + self.workspace)

    def plus_layers(self, per_layer: Claims, n: int) -> Claims:
        return Claims(*(getattr(self, f.name) + n * getattr(per_layer, f.name)
                        for f in fields(self)))


class CostModel:
    """Bytes and seconds of stages for one profile, one resolved request and one
    context (serving) or sequence length (training) in ``tokens``."""

    def __init__(self, profile: ModelProfile, request: PlanRequest, tokens: int,
                 weights_dtype: str | None = None) -> None:
        self.profile = profile
        self.request = request
        self.tokens = tokens
        self.train = request.kind == "train"
        # a stage's own dtype (``auto`` gives stages their own); else the request's
        self.weights_dtype = weights_dtype or serving_dtype(request)
        self.quantized = self.weights_dtype in QUANTIZED
        self.act_bytes = compute_bytes(self.weights_dtype)
        self._per_layer = self._per_layer_claims()
        self._per_layer_total = self._per_layer.total
        self._fixed: dict[tuple[str, bool, bool], Claims] = {}
        self._fixed_total: dict[tuple[str, bool, bool], int] = {}
        p = profile
        # bytes a step reads, for the roofline: a quantised stage's is its f16 one's,
        # scaled by the card's measured speed ratio (``_dtype_factor``)
        read_dtype = SERVING_DTYPE if self.quantized else self.weights_dtype
        self._layer_weight_bytes = p.layer_weight_bytes(read_dtype)
        self._head_read_bytes = p.head_read_bytes(read_dtype)
        self._dtyped: dict[str, CostModel] = {self.weights_dtype: self}

    def with_dtype(self, weights_dtype: str) -> CostModel:
        """The same stages with their weights in ``weights_dtype`` (one model per dtype)."""
        if weights_dtype not in self._dtyped:
            self._dtyped[weights_dtype] = CostModel(self.profile, self.request, self.tokens,
                                                    weights_dtype)
        return self._dtyped[weights_dtype]

    def _dtype_factor(self, card: CardView) -> float:
        """How much slower than f16 this stage's dtype runs on ``card`` (1 unquantised)."""
        if not self.quantized:
            return 1.0
        rates = dict(card.dtype_tokens_per_s)
        base, mine = rates.get(SERVING_DTYPE), rates.get(self.weights_dtype)
        if base and mine:
            return base / mine
        return UNMEASURED_QUANT_FACTOR

    # --- bytes ------------------------------------------------------------------------

    def _trained_bytes_per_param(self) -> int:
        master = 0 if self.weights_dtype == "f32" else 4
        return GRAD_BYTES + OPTIMIZER_STATE_BYTES[self.request.optimizer] + master

    def _per_layer_claims(self) -> Claims:
        p, r = self.profile, self.request
        weights = p.layer_weight_bytes(self.weights_dtype)
        if not self.train:
            kv = r.sequences * (p.kv_tokens_per_layer(self.tokens)
                                * p.kv_bytes_per_token_layer(r.kv_dtype)
                                + p.state_bytes_per_sequence_layer(self.weights_dtype))
            return Claims(weights=weights, kv_cache=kv)
        tokens = r.micro_batch * self.tokens
        per_token = (p.hidden * self.act_bytes if r.checkpointing
                     else p.train_activation_bytes_per_token_layer(self.act_bytes))
        activations = r.micro_batches * tokens * per_token
        if r.method == "lora":
            lora_params = p.lora_params_layer(r.lora_rank, r.lora_targets)
            return Claims(weights=weights, activations=activations, lora=lora_params * 4,
                          optimizer=lora_params * (GRAD_BYTES
                                                   + OPTIMIZER_STATE_BYTES[r.optimizer]))
        return Claims(weights=weights, activations=activations,
                      optimizer=p.layer_params() * self._trained_bytes_per_param())

    def fixed_claims(self, kind: str, first: bool, last: bool) -> Claims:
        """What a stage claims besides its layers (the ``n``-independent part)."""
        key = (kind, first, last)
        if key not in self._fixed:
            self._fixed[key] = self._fixed_claims(kind, first, last)
            self._fixed_total[key] = self._fixed[key].total
        return self._fixed[key]

    def _fixed_claims(self, kind: str, first: bool, last: bool) -> Claims:
        p, r, wd, ab = self.profile, self.request, self.weights_dtype, self.act_bytes
        buffers = p.stage_buffer_bytes(wd)
        if first:
            buffers += p.embed_bytes(wd)
        if last:
            buffers += p.head_bytes(wd, shares_embeddings=first)
        q_dim, kv_dim = p.n_heads * p.head_dim, p.n_kv_heads * p.head_dim
        block = min(self.tokens, ATTENTION_BLOCK_TOKENS)
        if not self.train:
            chunk = min(PREFILL_CHUNK_TOKENS, self.tokens)
            elements = 4 * p.hidden + q_dim + 2 * kv_dim + 3 * p.intermediate
            activations = r.sequences * chunk * elements * ab
            if last:
                activations += r.sequences * p.vocab * 4  # f32 logits of the last position
            # blockwise attention's scores; a recurrent model has none
            scratch = 0 if p.recurrent else r.sequences * p.n_heads * chunk * block * ab
            return Claims(embeddings_head_buffers=buffers, activations=activations,
                          workspace=WORKSPACE_BYTES[kind] + scratch)
        tokens = r.micro_batch * self.tokens
        activations = 0
        if r.checkpointing:  # one layer's full activations while it is recomputed
            activations += tokens * p.train_activation_bytes_per_token_layer(ab)
        if last:
            activations += 2 * tokens * p.vocab * 4  # f32 logits and their gradient
        optimizer = 0
        if r.method == "full":
            trained = (p.embed_params() if first else 0)
            if last:
                trained += p.hidden + (p.vocab * p.hidden if not (p.tied and first) else 0)
            optimizer = trained * self._trained_bytes_per_param()
        chunk = min(PREFILL_CHUNK_TOKENS, self.tokens)
        scratch = r.micro_batch * p.n_heads * chunk * block * ab
        return Claims(embeddings_head_buffers=buffers, activations=activations,
                      optimizer=optimizer, workspace=WORKSPACE_BYTES[kind] + scratch)

    def claims(self, kind: str, n: int, first: bool, last: bool,
               start: int | None = None) -> Claims:
        """A stage's bytes; given its first layer, the KV cache of a model whose layers
        differ (sliding windows on some) is exact rather than its upper bound."""
        total = self.fixed_claims(kind, first, last).plus_layers(self._per_layer, n)
        p = self.profile
        if first and n:
            total = replace(total, weights=total.weights
                            + p.first_layer_weight_delta(self.weights_dtype))
        if start is None or self.train or not p.sliding_layers:
            return total
        kv = (p.kv_tokens_of(start, n, self.tokens) * self.request.sequences
              * p.kv_bytes_per_token_layer(self.request.kv_dtype))
        return replace(total, kv_cache=kv)

    def fixed_bytes(self, kind: str, first: bool, last: bool) -> int:
        key = (kind, first, last)
        if key not in self._fixed_total:
            self.fixed_claims(kind, first, last)
        return self._fixed_total[key]

    @property
    def layer_bytes(self) -> int:
        """What each layer of a stage claims, all segments together."""
        return self._per_layer_total

    def capacity(self, card: CardView, first: bool, last: bool) -> int:
        """Most layers this card holds in that position (0: not even one)."""
        room = card.free_bytes - self.fixed_bytes(card.kind, first, last)
        if room < self._per_layer_total:
            return 0
        return min(self.profile.n_layers, room // self._per_layer_total)

    def stage_need_bytes(self, kind: str) -> int:
        """Free memory the smallest stage (one middle layer) needs."""
        return self.claims(kind, 1, False, False).total

    # --- time ---------------------------------------------------------------------------

    def stage_time_s(self, card: CardView, n: int, last: bool) -> float:
        """Seconds of one decode step (serve) or one micro-batch (train) on this stage."""
        p, r = self.profile, self.request
        flops_layer = p.flops_per_token_layer(self.tokens)
        if not self.train:
            flops = r.sequences * (n * flops_layer + (p.head_flops_per_token() if last else 0))
            read = (n * self._layer_weight_bytes + (self._head_read_bytes if last else 0)
                    + r.sequences * n * p.kv_tokens_per_layer(self.tokens)
                    * p.kv_bytes_per_token_layer(r.kv_dtype)
                    + r.sequences * n * p.state_bytes_per_sequence_layer(self.weights_dtype))
            return max(flops / card.flops, read / card.mem_bandwidth) * self._dtype_factor(card)
        tokens = r.micro_batch * self.tokens
        passes = (3 if r.method == "full" else 2) + (1 if r.checkpointing else 0)
        # causal attention over a training sequence: half the full window on average
        flops_layer = p.flops_per_token_layer(self.tokens // 2 or 1)
        flops = passes * tokens * (n * flops_layer + (p.head_flops_per_token() if last else 0))
        read = passes * (n * self._layer_weight_bytes + (self._head_read_bytes if last else 0))
        return max(flops / card.flops, read / card.mem_bandwidth) * self._dtype_factor(card)

    def prefill_time_s(self, card: CardView, n: int, last: bool) -> float:
        """Seconds to push one prefill chunk of every sequence through this stage."""
        p, r = self.profile, self.request
        chunk = min(PREFILL_CHUNK_TOKENS, self.tokens)
        flops = r.sequences * chunk * n * p.flops_per_token_layer(self.tokens)
        if last:
            flops += r.sequences * p.head_flops_per_token()  # logits of the last position
        read = (n * self._layer_weight_bytes + (self._head_read_bytes if last else 0)
                + r.sequences * n * chunk * p.kv_bytes_per_token_layer(r.kv_dtype))
        return max(flops / card.flops, read / card.mem_bandwidth) * self._dtype_factor(card)

    def hop_bytes(self, prefill: bool = False) -> int:
        p, r = self.profile, self.request
        if self.train:  # activations forward, their gradients backward
            return 2 * r.micro_batch * self.tokens * p.hop_width * self.act_bytes
        chunk = min(PREFILL_CHUNK_TOKENS, self.tokens) if prefill else 1
        return r.sequences * chunk * p.hop_width * self.act_bytes

    def hop_time_s(self, link: Link, prefill: bool = False) -> float:
        trips = 2 if self.train else 1
        return trips * link.latency_s + self.hop_bytes(prefill) / link.bandwidth_bytes_s


__all__ = ["PREFILL_CHUNK_TOKENS", "UNMEASURED_QUANT_FACTOR", "WORKSPACE_BYTES", "Claims",
           "CostModel"]
