"""The synthetic models' presets (host.synth writes them): every size of a model, by name, with any
field replaced (`preset`).

Presets:
- `tiny`: simulator-sized, the reference's six-layer schedule (every block type), engram on a
  window-only layer and a kv source, window 8 and ratio 2 so a few dozen tokens cross the window
  wrap and many compressor groups; engram rows of 256 so Q2_K tables are real.
- `small`: the reference tests' sizes (`testing.py`).
- `tiny256`: tiny with dim, q_lora_rank, the heads' values per output group and the output lora 256
  wide, so that every matrix but the index keys' holds K-quant super-blocks (`--weight-type Q4_K`).
- `flash`: V4.1-Flash dimensions on the six-layer schedule, engram tables of `engram_rows` rows.
- `flash40`: the flash dimensions on V4.1-Flash's own 40-layer schedule (FLASH40_SCHEDULE: 2
  window-only layers, ratio 2 for layers 2-19 and 1 for 20-39, kv sources 2, 8, 14, 20, index
  sources 2, 8, 14, 20, 24, 28, 32, 36, candidate source 20, engram before layers 1 and 14), drawn
  in the stored format: 7.2 GB in Q8_0, about 6 GB of which a decode step streams.
- `flash-realtables`: flash40 with V4.1-Flash's real engram tables, Q2_K: engram_vocab_size
  16,000,000 (REAL_ENGRAM_VOCAB), from which the prime construction (engram_primes: per table, per
  n-gram order, the next unused primes above 15,999,999, the second table's after the first's) gives
  the official config's rows exactly, 384,006,168 and 384,016,682 (REAL_TABLE_ROWS; 24 primes of
  about 16.0M each), so the hash covers their full range. Every table and matrix is a hole
  (`holes="matrices"`): 71.2 GB of file (60.1 GiB of tables) written in 0.2 s into 2.3 MiB of disk
  (ext4). It loads, pins, hashes and gathers as the real file would and `flashv41 info` prints the
  real memory plan per residency; it is not for numerics: its matrices are zeros, so the engine's
  output is zero and `run --check` reports a disagreement (cosine 0). `holes="tables"` over it gives

Oracle: none; host.synth's files are read back by host.gguf_model and checked against the preset
(tests/test_synth.py, test_gguf_layouts.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from flashv41.host.engram_tables import MAX_PRIME, engram_primes
from flashv41.host.errors import InputError
from flashv41.host.vocab import MIN_SYNTHETIC_VOCAB


@dataclass(frozen=True)
class Preset:
    """Every size of a synthetic model (names as in ModelConfig)."""

    vocab: int
    dim: int
    n_heads: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    window: int
    index_heads: int
    index_head_dim: int
    index_topk: int
    candidate_block_size: int
    candidate_topk_blocks: int
    compress_ratios: tuple[int, ...] = (0, 2, 2, 1, 1, 1)
    kv_sources: tuple[int, ...] = (1, 3)
    index_sources: tuple[int, ...] = (1, 3, 5)
    candidate_source: int = 3
    engram_layers: tuple[int, ...] = (0, 1)
    engram_heads: int = 2
    engram_head_dim: int = 256
    max_ngram: int = 4
    engram_vocab_size: int = 100
    engram_pad_token: int = 2
    unmapped_tail: int = 2
    # the engram token map: "stub" (raw ids 2k, 2k+1 -> k, the last unmapped_tail ids unmapped) or
    # "tokenizer": the reference's normalised map of the file's tokenizer (host.engram_rebuild), for
    # presets whose vocabulary carries one (258 tokens or more); the multipliers follow its size
    engram_map: str = "stub"
    hc: int = 4
    sinkhorn_iters: int = 20
    context_length: int = 4096
    norm_eps: float = 1e-20
    hc_eps: float = 1e-6
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_factor: float = 4.0
    rope_original_ctx: int = 32
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    default_table_type: str = "Q2_K"
    # Q8_0 and BF16 matrices and tables drawn straight in the stored format (`draw_q8_0`,
    # `draw_bf16`) instead of quantised from Gaussian values: other bytes, same statistics, 10x faster
    stored_draw: bool = False
    # tensors written as holes (HOLES: seeked past, not written; read back as zero bytes, which every
    # type flashv41 reads decodes to zeros): "" none, "tables" the engram tables, "matrices" the tables
    # and every other tensor of two or more dimensions (only the 1-D norms, sinks and hc bases stay drawn)
    holes: str = ""
    # the FFN sublayer's and the head's tensors (host.synth_moe): every layer's ffn_norm, router,
    # routed and shared experts, then output_norm and output; off, a file's bytes are those of a
    # file written before they existed. Small expert counts (the flash presets keep V4.1's widths:
    # dim 5120, hidden 2304; n_experts=384, n_active=6 give its real shapes)
    moe: bool = False
    n_experts: int = 4
    n_active: int = 2
    expert_inter: int = 64
    score_func: str = "sqrtsoftplus"
    route_scale: float = 1.5
    swiglu_limit: float = 10.0

    @property
    def n_layers(self) -> int:
        return len(self.compress_ratios)


PRESETS: dict[str, Preset] = {
    "tiny": Preset(
        vocab=128, dim=32, n_heads=2, head_dim=64, rope_dim=16, q_lora_rank=32, o_groups=2, o_lora_rank=32,
        window=8, index_heads=2, index_head_dim=32, index_topk=4, candidate_block_size=2,
        candidate_topk_blocks=3, max_ngram=3, engram_heads=1, engram_head_dim=256, engram_vocab_size=37,
        context_length=256,
    ),
    "small": Preset(
        vocab=512, dim=256, n_heads=4, head_dim=64, rope_dim=16, q_lora_rank=64, o_groups=2, o_lora_rank=64,
        window=16, index_heads=4, index_head_dim=64, index_topk=8, candidate_block_size=4,
        candidate_topk_blocks=3, max_ngram=4, engram_heads=2, engram_head_dim=32, engram_vocab_size=100,
        default_table_type="Q8_0", expert_inter=128,
    ),
    "flash": Preset(
        vocab=129280, dim=5120, n_heads=64, head_dim=512, rope_dim=64, q_lora_rank=1280, o_groups=8,
        o_lora_rank=1024, window=128, index_heads=32, index_head_dim=128, index_topk=512, candidate_block_size=8,
        candidate_topk_blocks=2048, max_ngram=4, engram_heads=8, engram_head_dim=256,
        engram_vocab_size=125_000, rope_factor=16.0, rope_original_ctx=65536, context_length=65536,
        n_experts=8, n_active=6, expert_inter=2304,
    ),
}
# tiny with every streamed matrix's rows 256 values wide (dim, q_lora_rank, the heads' values per output
# group, the output lora): the smallest model whose matrices all hold K-quant super-blocks but the
# index keys' (indexer.attn_k, rows of head_dim 64)
PRESETS["tiny256"] = replace(PRESETS["tiny"], dim=256, q_lora_rank=256, n_heads=4, o_groups=1, o_lora_rank=256,
                             expert_inter=256)
# V4.1-Flash's own 40-layer schedule (docs/performance.md): 2 window-only layers, ratio 2 for
# layers 2-19 and ratio 1 for 20-39, kv sources 2, 8, 14, 20, index sources 2, 8, ..., 36 (every
# kv source, then every fourth layer), candidate source 20, engram before layers 1 and 14
FLASH40_SCHEDULE: dict[str, Any] = {
    "compress_ratios": (0,) * 2 + (2,) * 18 + (1,) * 20,
    "kv_sources": (2, 8, 14, 20),
    "index_sources": (2, 8, 14, 20, 24, 28, 32, 36),
    "candidate_source": 20,
    "engram_layers": (1, 14),
}
# the flash dimensions on that schedule: about 6 GB of weights a decode step streams (docs/performance.md's
# 5.7 GB of Q8_0 attention and wkv weights, the hc mixes' fp32 weights, the sources' compressors and
# indexers), 7.2 GB of file with the embedding and the two Q2_K tables: drawn in the stored format
PRESETS["flash40"] = replace(PRESETS["flash"], **FLASH40_SCHEDULE, stored_draw=True)
# V4.1-Flash's official engram geometry: with an engram vocabulary of 16,000,000 the prime
# construction (engram_primes: per layer, per n-gram order, the next unused primes above 15,999,999)
# gives the published table sizes exactly, 384,006,168 rows before layer 1 and 384,016,682 before
# layer 14 (24 primes of about 16.0M each)
REAL_ENGRAM_VOCAB = 16_000_000
REAL_TABLE_ROWS = (384_006_168, 384_016_682)
HOLES = ("", "tables", "matrices")
ENGRAM_MAPS = ("stub", "tokenizer")
# flash40 with those tables, Q2_K (60 GiB), every table and matrix a hole: a 71 GB sparse file written
# in 0.2 s that takes a few MiB of disk, for table residency, pinning, the hash's full range, gathers
# and `flashv41 info`'s memory plan at the real sizes; not for numerics (its matrices are zeros)
PRESETS["flash-realtables"] = replace(PRESETS["flash40"], engram_vocab_size=REAL_ENGRAM_VOCAB, holes="matrices")


def preset(name: str, **overrides) -> Preset:
    """A preset by name, with any field replaced (`engram_rows` sets the table size instead of
    `engram_vocab_size`: rows per layer ~= engram_rows)."""
    if name not in PRESETS:
        raise InputError(f"unknown preset {name!r} (known: {', '.join(PRESETS)})")
    p = PRESETS[name]
    rows = overrides.pop("engram_rows", None)
    if rows is not None:
        max_ngram = overrides.get("max_ngram", p.max_ngram)
        heads = overrides.get("engram_heads", p.engram_heads)
        # every n-gram order and head takes a distinct prime number of rows (at least 2), so a
        # table has at least the sum of the smallest such primes; fewer rows cannot be written
        fewest = int(engram_primes(1, max_ngram, heads, 2).sum())
        if int(rows) < fewest:
            raise InputError(f"engram rows {rows}: the smallest engram table preset {name!r} can hold has "
                             f"{fewest} rows (a distinct prime of at least 2 rows per n-gram order and head)")
        per_column = int(rows) // ((max_ngram - 1) * heads)
        if per_column >= MAX_PRIME:
            raise InputError(f"engram rows {rows}: the engram hash takes tables of fewer than 2^51 rows per "
                             f"n-gram order and head ({(max_ngram - 1) * heads} of them in preset {name!r})")
        overrides["engram_vocab_size"] = per_column
    out = replace(p, **overrides)
    if out.engram_map not in ENGRAM_MAPS:
        raise InputError(f"engram_map {out.engram_map!r}: one of {', '.join(repr(m) for m in ENGRAM_MAPS)}")
    if out.engram_map == "tokenizer" and out.vocab < MIN_SYNTHETIC_VOCAB:
        raise InputError(f"engram_map 'tokenizer': preset {name!r} has {out.vocab} tokens, too few for a tokenizer "
                         f"(a byte-level BPE needs {MIN_SYNTHETIC_VOCAB})")
    return out
