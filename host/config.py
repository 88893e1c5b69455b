"""The model's configuration as flashv41 runs it: every size, epsilon and RoPE parameter, each
layer's role in the shared attention runtime, and the engram hash tables.

A `ModelConfig` is built once from a GGUF file (`host.gguf_model`) or by the synthetic-model
writer (`host.synth`), and is immutable; nothing about the model is hard-coded elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class LayerRole:
    """What one attention layer is in the shared runtime.

    ratio: 0 = sliding window only; 1 or 2 = window plus compressed rows chosen by an indexer.
    kv_source: owns a compressor and index keys and publishes both caches.
    index_source: runs an indexer and publishes its selection.
    candidate_source: the index source whose block mask later index sources respect.
    uses_candidates: an index source after the candidate source.
    engram: an engram sublayer runs before this layer's attention.
    """

    layer: int
    ratio: int
    kv_source: bool
    index_source: bool
    candidate_source: bool
    uses_candidates: bool
    engram: bool

    @property
    def block_type(self) -> str:
        """One of the six V4.1 block types, in the words the tests and tables use."""
        if self.ratio == 0:
            return "swa"
        if self.candidate_source:
            return f"candidate_source_r{self.ratio}"
        if self.kv_source:
            return f"kv_index_source_r{self.ratio}"
        if self.index_source:
            return f"candidate_index_source_r{self.ratio}" if self.uses_candidates else f"index_source_r{self.ratio}"
        return f"consumer_r{self.ratio}"


@dataclass(frozen=True, eq=False)
class EngramConfig:
    """The engram n-gram hash and table geometry.

    layer_ids: the model layers with an engram sublayer, in hash order.
    multipliers: int64 [layers, max_ngram]; primes, offsets: int64 [layers, max_ngram - 1, heads].
    token_map: int64 [vocab], raw id -> compressed id, -1 = unmapped.
    pad_id: the compressed id that fills blocked n-gram slots.
    table_rows: rows of each layer's `engram_embd`.
    rebuilt: the token map, pad id, primes, offsets and multipliers were rebuilt from the file's
    tokenizer and table sizes (a file with the old `deepseek4.engram.*` keys; host.engram_rebuild),
    not read from it.
    """

    layer_ids: tuple[int, ...]
    n_heads: int
    head_dim: int
    max_ngram: int
    multipliers: np.ndarray
    primes: np.ndarray
    offsets: np.ndarray
    token_map: np.ndarray
    pad_id: int
    table_rows: tuple[int, ...]
    rebuilt: bool = False

    @property
    def cols(self) -> int:
        """Row ids per token and layer: (max_ngram - 1) * heads, in [shift - 1][head] order."""
        return (self.max_ngram - 1) * self.n_heads

    def hash_index(self, layer: int) -> int:
        """Position of model layer `layer` in `layer_ids`."""
        return self.layer_ids.index(layer)


# V4.1's own MoE values (the official config.json): what a file that does not say takes
V41_SCORE_FUNC = "sqrtsoftplus"
V41_ROUTE_SCALE = 1.5
V41_SWIGLU_LIMIT = 10.0
SCORE_FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")


@dataclass(frozen=True)
class MoEConfig:
    """The routed experts of the FFN sublayer (the reference's MoE, Gate and Expert), as
    flashv41.HostMoE computes them: every layer the same.

    n_experts: routed experts [384]; n_active: experts a token goes through [6]; inter_dim: an
    expert's hidden width [2304]; shared_inter_dim: the shared expert's [2304].
    score_func: "sqrtsoftplus" (V4.1), "sigmoid" or "softmax", of the gate's fp32 scores; the
    correction bias `exp_probs_b` only chooses the experts. norm_topk: the chosen scores divided by
    their sum (+ 1e-20) when n_active > 1. route_scale [1.5] multiplies them. swiglu_limit [10]:
    the up branch clamped to [-limit, limit], the gate branch from above (0: no clamp).
    defaults: the fields the file does not record, which take V4.1's values.
    """

    n_experts: int
    n_active: int
    inter_dim: int
    shared_inter_dim: int
    score_func: str = V41_SCORE_FUNC
    route_scale: float = V41_ROUTE_SCALE
    norm_topk: bool = True
    swiglu_limit: float = V41_SWIGLU_LIMIT
    defaults: tuple[str, ...] = ()

    def describe(self) -> str:
        said = f" (V4.1's {', '.join(self.defaults)}: the file does not record them)" if self.defaults else ""
        return (f"{self.n_experts} experts, top-{self.n_active}, hidden {self.inter_dim} (shared expert "
                f"{self.shared_inter_dim}), {self.score_func} scores{', normalised' if self.norm_topk else ''}, "
                f"route scale {self.route_scale:g}, swiglu limit {self.swiglu_limit:g}{said}")


@dataclass(frozen=True, eq=False)
class ModelConfig:
    """Every number the engine needs, read from the GGUF (names follow ModelArgs where they can)."""

    n_layers: int
    context_length: int
    vocab_size: int
    dim: int
    n_heads: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    window: int
    index_heads: int
    index_head_dim: int
    index_topk: int
    o_groups: int
    o_lora_rank: int
    hc: int
    sinkhorn_iters: int
    norm_eps: float
    hc_eps: float
    rope_theta: float
    compress_rope_theta: float
    rope_factor: float
    rope_original_ctx: int
    beta_fast: float
    beta_slow: float
    compress_ratios: tuple[int, ...]
    candidate_source: int
    candidate_block_size: int
    candidate_topk_blocks: int
    roles: tuple[LayerRole, ...]
    engram: EngramConfig | None = None
    # the FFN sublayer and the head, where the file carries them (host.gguf_moe reads them): every
    # layer's ffn_norm (what an FFN callback's input is normed with), the routed experts (MoEConfig:
    # flashv41.HostMoE), output_norm and output (the head: Sequence.logits)
    ffn_norm: bool = False
    moe: MoEConfig | None = None
    head: bool = False
    name: str = field(default="deepseek41")
    layout: str = field(default="llama.cpp")  # the GGUF layout it was read from: "llama.cpp", "mxxm-t" or "ds4"

    @property
    def mix_hc(self) -> int:
        """Width of one hc mix projection: (2 + hc) * hc."""
        return (2 + self.hc) * self.hc

    @property
    def group_width(self) -> int:
        """Attention-output values per output group: heads * head_dim / o_groups."""
        return self.n_heads * self.head_dim // self.o_groups

    def role(self, layer: int) -> LayerRole:
        return self.roles[layer]

    def max_groups(self, max_seq: int) -> int:
        """The most compressed groups a layer holds for max_seq positions: those of the finest
        compression ratio (0 without compressed layers); the width of the index scores."""
        ratios = [r.ratio for r in self.roles if r.ratio > 0]
        return max_seq // min(ratios) if ratios else 0

    def describe(self) -> str:
        """A short one-line summary (sizes only)."""
        return (
            f"{self.n_layers} layers, dim {self.dim}, hc {self.hc}, {self.n_heads} heads x {self.head_dim}, "
            f"q_lora {self.q_lora_rank}, window {self.window}, index {self.index_heads} x "
            f"{self.index_head_dim} top-{self.index_topk}, vocab {self.vocab_size}"
        )
