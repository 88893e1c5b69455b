"""The V4.1 GGUF layouts flashv41 reads (llama.cpp, mxxm-t and ds4): key and tensor names, shapes, roles.

Shared by the reader (`host.gguf_model`) and the synthetic writer (`host.synth`), so the two can
never disagree. A tensor's role is its name in llama.cpp's V4.1 converter and loader (the engine
asks for tensors by role); `TENSOR_NAMES` says what each layout calls it in the file. The mxxm-t
layout (HF mxxm-t/DeepSeek-V4.1-Flash-GGUF, for mxxm-t/mx-llama.cpp) keeps llama.cpp's keys, adds
explicit kv / index source lists and names its engram keys and three tensors differently. The ds4
layout (antirez/ds4) names every key as HF's config.json does (`DS4_*` below), lists its sources,
computes its engram offsets and head count from the primes, stores its engram tables as I8 rows
of 264 bytes (the E4M3_ROW264 table format of host.quants) and renames the engram projection and
gate weights. Shapes
here are in NumPy order ([out, in]: the reverse of the ggml dims the file lists).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

ARCH = "deepseek41"
LLAMA_CPP = "llama.cpp"
MXXM_T = "mxxm-t"
DS4 = "ds4"
LAYOUTS = (LLAMA_CPP, MXXM_T, DS4)
# Architecture of the DSpark speculative-decoding draft published beside V4.1 models (refused).
DRAFT_ARCH = "dflash"

# Defaults of the optional candidate keys (the published llama.cpp files carry none).
DEFAULT_CANDIDATE_SOURCE = 20
DEFAULT_CANDIDATE_BLOCK = 8
DEFAULT_CANDIDATE_TOPK_BLOCKS = 2048

U32_KEYS = {
    "n_layers": "block_count",
    "context_length": "context_length",
    "dim": "embedding_length",
    "n_heads": "attention.head_count",
    "head_dim": "attention.key_length",
    "rope_dim": "rope.dimension_count",
    "q_lora_rank": "attention.q_lora_rank",
    "window": "attention.sliding_window",
    "index_heads": "attention.indexer.head_count",
    "index_head_dim": "attention.indexer.key_length",
    "index_topk": "attention.indexer.top_k",
    "o_groups": "attention.output_group_count",
    "o_lora_rank": "attention.output_lora_rank",
    "hc": "hyper_connection.count",
    "sinkhorn_iters": "hyper_connection.sinkhorn_iterations",
    "rope_original_ctx": "rope.scaling.original_context_length",
}
F32_KEYS = {
    "norm_eps": "attention.layer_norm_rms_epsilon",
    "rope_theta": "rope.freq_base",
    "compress_rope_theta": "attention.compress_rope_freq_base",
    "hc_eps": "hyper_connection.epsilon",
    "rope_factor": "rope.scaling.factor",
    "beta_fast": "rope.scaling.yarn_beta_fast",
    "beta_slow": "rope.scaling.yarn_beta_slow",
}
OPTIONAL_U32_KEYS = {
    "candidate_source": ("attention.candidate_source_layer_id", DEFAULT_CANDIDATE_SOURCE),
    "candidate_block_size": ("attention.candidate_block_size", DEFAULT_CANDIDATE_BLOCK),
    "candidate_topk_blocks": ("attention.candidate_topk_blocks", DEFAULT_CANDIDATE_TOPK_BLOCKS),
}
KEY_VOCAB = "vocab_size"
KEY_HEAD_COUNT_KV = "attention.head_count_kv"
KEY_VALUE_LENGTH = "attention.value_length"
KEY_COMPRESS_RATIOS = "attention.compress_ratios"
KEY_ROPE_SCALING_TYPE = "rope.scaling.type"

ENGRAM_KEYS = {
    "layer_ids": "engram.layer_ids",
    "n_heads": "engram.head_count",
    "head_dim": "engram.key_length",
    "max_ngram": "engram.max_ngram_size",
    "multipliers": "engram.multipliers",
    "primes": "engram.primes",
    "offsets": "engram.offsets",
    "token_map": "engram.token_map",
    "pad_id": "engram.pad_id",
}
# mxxm-t's engram keys: the same quantities under other names, a RAW pad token id (compressed through
# the token map on reading), and two sizes to check against (the compressed vocabulary, table rows).
MXXM_ENGRAM_KEYS = {
    "layer_ids": "engram.layer_ids",
    "n_heads": "engram.n_heads",
    "head_dim": "engram.head_dim",
    "max_ngram": "engram.max_ngram_size",
    "multipliers": "engram.multipliers",
    "primes": "engram.primes",
    "offsets": "engram.offsets",
    "token_map": "engram.token_map",
    "pad_token_id": "engram.pad_token_id",
    "compressed_vocab": "engram.compressed_vocab_size",
    "num_embeddings": "engram.num_embeddings",
}
# mxxm-t's explicit source lists (u32 arrays of layer ids); llama.cpp files have none and a layer's
# role follows from its tensors.
KEY_KV_SOURCES = "attention.kv_source_layer_ids"
KEY_INDEX_SOURCES = "attention.index_source_layer_ids"

# ds4's keys (antirez/ds4 gguf-tools/deepseek41_metadata.py): HF config.json names, `deepseek41.` + name.
# u32 sizes; rope_theta / compress_rope_theta are u32 in the file, floats in the config; the f32
# original_max_position_embeddings is an integer in the config.
DS4_U32_KEYS = {
    "n_layers": "num_hidden_layers",
    "context_length": "max_position_embeddings",
    "dim": "hidden_size",
    "n_heads": "num_attention_heads",
    "head_dim": "head_dim",
    "rope_dim": "qk_rope_head_dim",
    "q_lora_rank": "q_lora_rank",
    "window": "sliding_window",
    "index_heads": "index_n_heads",
    "index_head_dim": "index_head_dim",
    "index_topk": "index_topk",
    "o_groups": "o_groups",
    "o_lora_rank": "o_lora_rank",
    "hc": "hc_mult",
    "sinkhorn_iters": "hc_sinkhorn_iters",
    "candidate_source": "candidate_source_layer_id",
    "candidate_block_size": "candidate_block_size",
    "candidate_topk_blocks": "candidate_topk_blocks",
}
DS4_U32_FLOAT_KEYS = {"rope_theta": "rope_theta", "compress_rope_theta": "compress_rope_theta"}
DS4_F32_KEYS = {
    "norm_eps": "rms_norm_eps",
    "hc_eps": "hc_eps",
    "rope_factor": "rope_scaling.factor",
    "beta_fast": "rope_scaling.beta_fast",
    "beta_slow": "rope_scaling.beta_slow",
}
DS4_F32_INT_KEYS = {"rope_original_ctx": "rope_scaling.original_max_position_embeddings"}
DS4_KEY_HEAD_COUNT_KV = "num_key_value_heads"
DS4_KEY_COMPRESS_RATIOS = "compress_ratios"
DS4_KV_SOURCES = "kv_source_layer_ids"
DS4_INDEX_SOURCES = "index_source_layer_ids"
DS4_KEY_CONFIG = "config"  # the whole config.json as a string (cross-checked against the keys)
DS4_ENGRAM_KEYS = {
    "encoding": "engram.encoding",
    "layer_ids": "engram.layer_ids",
    "rows": "engram.rows",
    "compressed_vocab": "engram.compressed_vocab_size",
    "pad_id": "engram.pad_id",
    "token_map": "engram.token_map",
    "primes": "engram.primes",
    "multipliers": "engram.multipliers",
}
DS4_ENCODING = "e4m3_e8m0_32_row264"  # the one engram table encoding ds4 writes
DS4_ALIGNMENT = 16384  # ds4 files' general.alignment

# Markers of the layouts besides llama.cpp's: mxxm-t, ds4.
MXXM_MARKERS = (KEY_KV_SOURCES, KEY_INDEX_SOURCES, "engram.pad_token_id", "engram.compressed_vocab_size",
                "engram.num_embeddings")
DS4_MARKERS = ("hidden_size", "engram.encoding", "num_hidden_layers")
# Files converted before 2026-09-11 carry their engram keys under this prefix, not `deepseek41.`, and
# only the geometry: the rest is rebuilt from the file's tokenizer (host.engram_rebuild), or, without
# one, added by the vcruz305 recipe's repair script.
OLD_ENGRAM_PREFIX = "deepseek4.engram."
OLD_ENGRAM_REPAIR = "fix_gguf_engram_kv.py"
# their full key names (not arch-relative)
OLD_ENGRAM_KEYS = {name: OLD_ENGRAM_PREFIX + ENGRAM_KEYS[name].removeprefix("engram.")
                   for name in ("layer_ids", "n_heads", "head_dim", "max_ngram")}


def engram_keys(layout: str) -> dict[str, str]:
    """The arch-relative engram key names of a layout."""
    return {MXXM_T: MXXM_ENGRAM_KEYS, DS4: DS4_ENGRAM_KEYS}.get(layout, ENGRAM_KEYS)


def source_list_keys(layout: str) -> tuple[str, str] | None:
    """The arch-relative keys of a layout's kv-source and index-source lists; None for llama.cpp,
    whose layers' roles follow from their tensors."""
    return {MXXM_T: (KEY_KV_SOURCES, KEY_INDEX_SOURCES), DS4: (DS4_KV_SOURCES, DS4_INDEX_SOURCES)}.get(layout)


def key(name: str) -> str:
    """The full metadata key of an arch-relative name."""
    return f"{ARCH}.{name}"


@dataclass(frozen=True)
class Dims:
    """The sizes that tensor shapes are made of."""

    vocab: int
    dim: int
    n_heads: int
    head_dim: int
    q_lora: int
    o_groups: int
    o_lora: int
    hc: int
    index_heads: int
    index_head_dim: int
    engram_head_dim: int = 0
    engram_cols: int = 0
    n_experts: int = 0
    expert_inter: int = 0
    shared_inter: int = 0

    @property
    def mix(self) -> int:
        return (2 + self.hc) * self.hc


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a layer: its role name (the file name between `blk.{i}.` and `.weight`), its
    NumPy shape as a function of the dims, and whether it is a matrix the engine multiplies by."""

    role: str
    shape: Callable[[Dims], tuple[int, ...]]
    matrix: bool = True


ATTENTION_TENSORS = (
    TensorSpec("attn_norm", lambda d: (d.dim,), False),
    TensorSpec("attn_sinks", lambda d: (d.n_heads,), False),
    TensorSpec("attn_q_a", lambda d: (d.q_lora, d.dim)),
    TensorSpec("attn_q_a_norm", lambda d: (d.q_lora,), False),
    TensorSpec("attn_q_b", lambda d: (d.n_heads * d.head_dim, d.q_lora)),
    TensorSpec("attn_kv", lambda d: (d.head_dim, d.dim)),
    TensorSpec("attn_kv_a_norm", lambda d: (d.head_dim,), False),
    TensorSpec("attn_output_a", lambda d: (d.o_groups * d.o_lora, d.n_heads * d.head_dim // d.o_groups)),
    TensorSpec("attn_output_b", lambda d: (d.dim, d.o_groups * d.o_lora)),
    TensorSpec("hc_attn_fn", lambda d: (d.mix, d.hc * d.dim)),
    TensorSpec("hc_attn_base", lambda d: (d.mix,), False),
    TensorSpec("hc_attn_scale", lambda d: (3,), False),
    TensorSpec("hc_ffn_fn", lambda d: (d.mix, d.hc * d.dim)),
    TensorSpec("hc_ffn_base", lambda d: (d.mix,), False),
    TensorSpec("hc_ffn_scale", lambda d: (3,), False),
)
KV_SOURCE_TENSORS = (
    TensorSpec("attn_compressor_kv", lambda d: (d.head_dim, d.dim)),
    TensorSpec("attn_compressor_norm", lambda d: (d.head_dim,), False),
    TensorSpec("indexer.attn_k", lambda d: (d.index_head_dim, d.head_dim)),
    TensorSpec("indexer.k_norm", lambda d: (d.index_head_dim,), False),
)
COMPRESSOR_GATE = TensorSpec("attn_compressor_gate", lambda d: (d.head_dim, d.dim))
INDEX_SOURCE_TENSORS = (
    TensorSpec("indexer.attn_q_b", lambda d: (d.index_heads * d.index_head_dim, d.q_lora)),
    TensorSpec("indexer.proj", lambda d: (d.index_heads, d.dim)),
)
# engram_embd's row count comes from the file; only its width is checked against the dims.
ENGRAM_TENSORS = (
    TensorSpec("engram_wkv", lambda d: (d.dim * (d.hc + 1), d.engram_cols * d.engram_head_dim)),
    TensorSpec("engram_q", lambda d: (d.hc, d.dim)),
    TensorSpec("engram_k", lambda d: (d.hc, d.dim)),
)
ENGRAM_TABLE = "engram_embd"
TOKEN_EMBD = "token_embd"

# The FFN sublayer (its norm, the router, the routed and the shared experts: llama.cpp's deepseek2
# names, which ds4 writes too) and the head. The engine reads ffn_norm (an FFN callback's input),
# output_norm and output (the head); flashv41.HostMoE the rest. A file carries every one or none.
FFN_NORM = "ffn_norm"
FFN_NORM_TENSOR = TensorSpec(FFN_NORM, lambda d: (d.dim,), False)
MOE_TENSORS = (
    TensorSpec("ffn_gate_inp", lambda d: (d.n_experts, d.dim)),
    TensorSpec("exp_probs_b", lambda d: (d.n_experts,), False),
    TensorSpec("ffn_gate_exps", lambda d: (d.n_experts, d.expert_inter, d.dim)),
    TensorSpec("ffn_up_exps", lambda d: (d.n_experts, d.expert_inter, d.dim)),
    TensorSpec("ffn_down_exps", lambda d: (d.n_experts, d.dim, d.expert_inter)),
    TensorSpec("ffn_gate_shexp", lambda d: (d.shared_inter, d.dim)),
    TensorSpec("ffn_up_shexp", lambda d: (d.shared_inter, d.dim)),
    TensorSpec("ffn_down_shexp", lambda d: (d.dim, d.shared_inter)),
)
OUTPUT_NORM = "output_norm"
OUTPUT = "output"
HEAD_TENSORS = (TensorSpec(OUTPUT_NORM, lambda d: (d.dim,), False), TensorSpec(OUTPUT, lambda d: (d.vocab, d.dim)))
# a role whose file name ends otherwise than `.weight` (the router's correction bias)
TENSOR_SUFFIX = {"exp_probs_b": "bias"}

# The attention tensors by the names the oracle's AttentionWeights and the attention stage give
# them: every layer's, then those of kv sources (compressor, index keys) and index sources.
ATTENTION_ROLES = {
    "attn_norm": "attn_norm", "sinks": "attn_sinks", "wq_a": "attn_q_a", "q_norm": "attn_q_a_norm",
    "wq_b": "attn_q_b", "wkv": "attn_kv", "kv_norm": "attn_kv_a_norm", "wo_a": "attn_output_a",
    "wo_b": "attn_output_b",
}
OPTIONAL_ATTENTION_ROLES = {
    "comp_kv": "attn_compressor_kv", "comp_gate": "attn_compressor_gate", "comp_norm": "attn_compressor_norm",
    "wk": "indexer.attn_k", "k_norm": "indexer.k_norm", "idx_wq_b": "indexer.attn_q_b", "idx_proj": "indexer.proj",
}


# What each layout calls a role in the file (between `blk.{i}.` and `.weight`): one table per
# layout, complete over the roles flashv41 reads (the FFN's and the head's keep their names in all).
ALL_ROLES = tuple(dict.fromkeys(
    [TOKEN_EMBD, ENGRAM_TABLE]
    + [s.role for s in (*ATTENTION_TENSORS, *KV_SOURCE_TENSORS, COMPRESSOR_GATE, *INDEX_SOURCE_TENSORS,
                        *ENGRAM_TENSORS, FFN_NORM_TENSOR, *MOE_TENSORS, *HEAD_TENSORS)]
))
TENSOR_NAMES: dict[str, dict[str, str]] = {
    LLAMA_CPP: {role: role for role in ALL_ROLES},
    MXXM_T: {
        **{role: role for role in ALL_ROLES},
        ENGRAM_TABLE: "engram_embed",
        "indexer.attn_k": "indexer_compressor_kv",
        "indexer.k_norm": "indexer_compressor_norm",
    },
    DS4: {
        **{role: role for role in ALL_ROLES},
        "engram_wkv": "engram_kv",
        "engram_q": "engram_q_norm",
        "engram_k": "engram_k_norm",
    },
}


def tensor_name(layer: int | None, role: str, layout: str = LLAMA_CPP) -> str:
    """The file name of a role in a layout: `blk.{layer}.{name}.weight`, or `{name}.weight` for a
    model-level tensor (a role outside the table keeps its own name; `.bias` for TENSOR_SUFFIX's)."""
    name = f"{TENSOR_NAMES[layout].get(role, role)}.{TENSOR_SUFFIX.get(role, 'weight')}"
    return name if layer is None else f"blk.{layer}.{name}"


def layer_tensor_specs(ratio: int, kv_source: bool, index_source: bool, engram: bool) -> list[TensorSpec]:
    """Every tensor a layer of this role must carry (engram_embd aside)."""
    specs = list(ATTENTION_TENSORS)
    if kv_source:
        specs += KV_SOURCE_TENSORS
        if ratio > 1:
            specs.append(COMPRESSOR_GATE)
    if index_source:
        specs += INDEX_SOURCE_TENSORS
    if engram:
        specs += ENGRAM_TENSORS
    return specs
