"""Broken variants of the attention stages' kernels, each rejected by the check its real test uses.

Every mutant is the smallest realistic bug of its kind in one kernel: a helper swapped through
tests.mutants.mutant (a rounding that truncates, an entry skipped), or one line of the kernel's own
source edited (`edited`: a position off by one, a term left out, a constant 1% off). Each runs
through the same `check_...` function of tests/test_attention_kernels.py, on the same inputs, as the
kernel's real test, and the check must raise AssertionError; `test_unmutated_passes` runs every
check on those inputs with the real kernels, so no mutant "fails" because the setup is broken. The
simulator runs the CI shapes; `gpu` tests repeat the sparse attention, index score and selection
mutants at V4.1-Flash sizes (64 heads x 512 over a 128 window + top-512; 32 index heads x 128
against 4096 keys; top-512 of 32768).

What rejects each (measured on the simulator, at the CI shape and, for the `gpu` ones, the flash shape):
- sparse attention: p or the output truncated to bf16, the output 1% large: only the bit-equal share
  (SPARSE_EQUAL_MIN = 99%: the mutants keep 60% / 51% / 0% at the CI shape, 52% / 50% / 0% at the
  flash shape; the kernel 100% / 99.97%); the softmax scale 1% large, a dropped chunk row or ring
  slot, the sink left out: sparse_bound (40-327 of 512 values out of it; 1657-87662 of 131072).
  The sink counts because attention_inputs puts each head's sink near its log-sum-exp, and a
  window row because its queries' entries are the layer's own lists (each names every window row).
  The folded RoPE of the queries and inverse RoPE of the output (either's position one late,
  either rotated the wrong way, a sine term dropped): sparse_bound rotated (rotated_bound).
  The split path's kernels carry the same mutants (sparse_mutants) and fail the same checks: on the
  simulator with the same numbers, since there the two paths give the same bits, mutated or not.
  The fused kernel (stages.sparse_fused, the GPU's default for a prefill chunk) carries them too
  (its own scale and sink lines: the sink left out of its first eight heads), and three of its own:
  the last entry block dropped, the running output not rescaled, the values' B fragments swapped;
  each fails check_sparse_attention at the CI shape on the simulator.
- sparse attention in sub-chunks (a prefill chunk of 10 tokens through a workspace of 4): the chunk's
  first position taken from the sub-chunk's own positions (by _attend, or by the scores kernel alone)
  or one token late: sparse_bound (701-941 of 1280 values out of it).
- entries: the oracle's entry lists (exact), the whole chunk's and each sub-chunk's (entry_at's chunk
  start read from the sub-chunk's positions shows only in the latter).
- index scores: exact scores (14-52 of 65 differ; 5919-11752 of 12288 at flash).
- selection: exact selections and masks. The short visible width shows in the candidate blocks
  (CI) and, at flash, only in the "rising" score pattern (newest positions ranked first: without it
  the check let this mutant through); the long one reads the score row's spare columns, which sit
  above every score (SPARE_SCORE).
- RoPE, RMSNorm: exact (130-534 values differ).
- act_quant, fp4_quant: exact. Most mutants show on the random rows or the crafted ties (the E2M1
  tie rule only there); act_quant's scale one step high at exact powers of two, and the limits
  1 / 448 and 1 / 6 taken 1% small, show only on scale_boundary_blocks (12-24 values), which were
  added for them.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from numba import float32, int32, uint16  # noqa: E402  (after conftest chose the backend)

from flashv41.model import load_model
from flashv41.stages import device as device_module  # noqa: E402
from flashv41.stages import (  # noqa: E402
    index_scores_tc,
    indexer,
    sparse_entries,
    sparse_fused,
    sparse_one_block,
    sparse_split,
    topk,
)
from flashv41.stages import norm_rope_quant as nrq  # noqa: E402
from flashv41.stages import sparse_attention as sa  # noqa: E402
from flashv41.stages.device import bf16_to_f32, device, f32_bits, f32_to_bf16
from tests.mutants import edited, mutant_across
from tests.test_attention_kernels import (
    ENTRY_CASES,
    FLASH_SELECT_CASE,
    FLASH_SPARSE_CASE,
    FLASH_SUBCHUNK_CASE,
    SELECT_CASES,
    SPARSE_CASE,
    SUBCHUNK_CASES,
    check_act_quant,
    check_entries,
    check_fp4_quant,
    check_index_scores,
    check_rms_norm,
    check_rope,
    check_select,
    check_sparse_attention,
    check_sparse_subchunks,
)

# ---- replacement helpers (device functions on a GPU, plain Python on the simulator) --------------------

@device
def f32_to_bf16_truncating(x):
    """bf16 bits of x, rounded toward zero (the low 16 bits dropped)."""
    return uint16(f32_bits(x) >> 16)


@device
def bf16_round_truncating(x):
    return bf16_to_f32(f32_to_bf16_truncating(x))


@device
def f32_to_bf16_one_percent_large(x):
    return f32_to_bf16(x * float32(1.01))


# the split select's per-slice low-byte counts: at or above each byte (the kernel), or above it only
SUFFIX_INCLUSIVE = "c += local[DIGIT_BINS - 1 - r]\n                slice_counts[slot, DIGIT_BINS - 1 - r] = int32(c)"
SUFFIX_EXCLUSIVE = "slice_counts[slot, DIGIT_BINS - 1 - r] = int32(c)\n                c += local[DIGIT_BINS - 1 - r]"

_resolve = sparse_entries._resolve  # the real one, which the replacements below fall back on
FP4_BLOCK = indexer.FP4_BLOCK


@device
def resolve_skipping_first_chunk_row(e, window, chunk_rows):
    if e == window:
        return int32(-1), int32(0)
    return _resolve(e, window, chunk_rows)


@device
def resolve_skipping_ring_slot_0(e, window, chunk_rows):
    if e == 0:
        return int32(-1), int32(0)
    return _resolve(e, window, chunk_rows)


@device
def block_dot_without_last_term(qs, h, ks, g, d0):
    """indexer._block_dot, but the very last product of each head's dot left out (the shared key
    rows are padded by one column, so the row's last block ends at ks.shape[1] - 1)."""
    end = d0 + FP4_BLOCK
    if end == ks.shape[1] - 1:
        end -= 1
    s = float32(0)
    for d in range(d0, end):
        s += qs[h, d] * ks[g, d]
    return s


@device
def e2m1_round_truncating(v):
    """E2M1 rounding toward zero: the largest grid value at or below |v|."""
    m = abs(float32(v))
    if m < 0.5:
        r = float32(0.0)
    elif m < 1.0:
        r = float32(0.5)
    elif m < 1.5:
        r = float32(1.0)
    elif m < 2.0:
        r = float32(1.5)
    elif m < 3.0:
        r = float32(2.0)
    elif m < 4.0:
        r = float32(3.0)
    elif m < 6.0:
        r = float32(4.0)
    else:
        r = float32(6.0)
    return -r if (f32_bits(v) >> 31) != 0 else r


# ---- the mutants ----------------------------------------------------------------------------------------

E4M3_RNE = "u = (u + uint32(0x7FFFF) + ((u >> 20) & 1)) & uint32(0xFFF00000)"  # e4m3_round's rounding
SUBCHUNK_VIEWS = "positions[part], positions, chosen[part]"  # _attend: a sub-chunk's positions, the chunk's first
POW2_CEIL = "(1 if (bits & 0x7FFFFF) != 0 else 0)"  # pow2_ceil's "round the log2 up"


def e4m3_truncating() -> dict[str, Any]:
    return {"e4m3_round": edited(nrq, "e4m3_round", E4M3_RNE, "u = u & uint32(0xFFF00000)")}


def e4m3_ties_away() -> dict[str, Any]:
    return {"e4m3_round": edited(nrq, "e4m3_round", E4M3_RNE, "u = (u + uint32(0x80000)) & uint32(0xFFF00000)")}


def pow2_floor_plus_1() -> dict[str, Any]:
    return {"pow2_ceil": edited(nrq, "pow2_ceil", POW2_CEIL, "1")}


@dataclass(frozen=True)
class Mutant:
    check: str  # the key of CHECKS (and FLASH_CHECKS) that must reject it
    key: str  # the test id
    bug: str
    module: types.ModuleType | tuple[types.ModuleType, ...]  # a tuple: each swap made in every one that has it
    replacements: Callable[[], dict[str, Any]]  # built inside the test, before the check runs
    flash: bool = True  # False: the kernel it edits is not one the check runs at flash dimensions (FLASH_CHECKS)


# the sparse attention stage's modules: a swap is made in each that holds the name (defines or imports it),
# so that it reaches every kernel and helper that calls it, whichever module that is
SPARSE = (sa, sparse_entries, sparse_one_block, sparse_split, sparse_fused)


SCALED = "mul_rn(part, scale)"  # where the score kernels scale a dot product
SINK_ADDED = "sum_exp = sum_exp + exp_f32(sinks[h] - run_max)"  # where the combines add the sink's term


def sparse_mutants(check: str, scores_home: types.ModuleType, scores: str, combine_home: types.ModuleType,
                   combine: str, scaled: str = SCALED, sink_added: str = SINK_ADDED,
                   sink_left_out: str = "sum_exp = sum_exp if sum_exp > 0 else float32(np.inf)") -> list[Mutant]:
    """The sparse attention mutants of one path: the one-block-a-head kernel (check "sparse_attention",
    both kernels sparse_kernel) or the split path ("sparse_split": split_score_kernel scales the dot
    products, split_combine_kernel adds the sink), each kernel edited in the module that defines it
    (`*_home`). The rounding and _resolve swaps reach every kernel of the path that calls them (both
    split kernels resolve the entries)."""
    return [
        Mutant(check, "p_truncated", "p rounded toward zero to bf16 before the value product", SPARSE,
               lambda: {"bf16_round": bf16_round_truncating}),
        Mutant(check, "out_truncated", "the output rounded toward zero to bf16", SPARSE,
               lambda: {"f32_to_bf16": f32_to_bf16_truncating}),
        Mutant(check, "out_1pct", "the output 1% large", SPARSE,
               lambda: {"f32_to_bf16": f32_to_bf16_one_percent_large}),
        Mutant(check, "scale_1pct", "the softmax scale 1% large", SPARSE,
               lambda: {scores: edited(scores_home, scores, scaled,
                                       scaled.replace("scale)", "scale * float32(1.01))"))}),
        Mutant(check, "first_chunk_row_dropped", "entries naming the chunk's first row skipped", SPARSE,
               lambda: {"_resolve": resolve_skipping_first_chunk_row}),
        Mutant(check, "ring_slot_dropped", "entries naming ring slot 0 skipped", SPARSE,
               lambda: {"_resolve": resolve_skipping_ring_slot_0}),
        # a kernel that forgot the sink and then guarded the row without entries (0 / 0) on its own
        Mutant(check, "o_rope_position_plus_1", "the output rotated back by the angle of position p + 1", SPARSE,
               lambda: {"_output_pair": edited(sparse_entries, "_output_pair", "cos[pos, pair], -sin[pos, pair]",
                                               "cos[pos + 1, pair], -sin[pos + 1, pair]")}),
        Mutant(check, "o_rope_forward", "the output rotated forward, not back (the sine's sign)", SPARSE,
               lambda: {"_output_pair": edited(sparse_entries, "_output_pair", "-sin[pos, pair]", "sin[pos, pair]")}),
        Mutant(check, "q_rope_position_plus_1", "the queries rotated by the angle of position p + 1", SPARSE,
               lambda: {"_pair_angle": edited(sparse_entries, "_pair_angle", "cos[pos, pair], sin[pos, pair]",
                                              "cos[pos + 1, pair], sin[pos + 1, pair]")}),
        Mutant(check, "q_rope_inverse", "the queries rotated back, not forward (the sine's sign)", SPARSE,
               lambda: {"_pair_angle": edited(sparse_entries, "_pair_angle", "cos[pos, pair], sin[pos, pair]",
                                              "cos[pos, pair], -sin[pos, pair]")}),
        Mutant(check, "rope_sin_dropped", "b sin left out of the first value of each rotated pair (q and out)", SPARSE,
               lambda: {"rotate_pair": edited(device_module, "rotate_pair", "mul_rn(a, c) - mul_rn(b, s)",
                                              "mul_rn(a, c)")}),
        Mutant(check, "sink_ignored", "the sink's term left out of the denominator", SPARSE,
               lambda: {combine: edited(combine_home, combine, sink_added, sink_left_out)}),
    ]


MUTANTS = [
    *sparse_mutants("sparse_attention", sparse_one_block, "sparse_kernel", sparse_one_block, "sparse_kernel"),
    *sparse_mutants("sparse_split", sparse_split, "split_score_kernel", sparse_split, "split_combine_kernel"),
    # the fused kernel scales and adds the sink itself (its low heads' sink left out: half the heads)
    *sparse_mutants("sparse_fused", sparse_fused, "fused_kernel", sparse_fused, "fused_kernel",
                    scaled="mul_rn(s[f, i], scale)",
                    sink_added="total_lo = sum_lo + exp_f32(sinks[min(h0 + g, n_heads - 1)] - m_lo)",
                    sink_left_out="total_lo = sum_lo"),
    Mutant("sparse_fused", "block_dropped", "the entry list's last block of 64 left out", SPARSE,
           lambda: {"fused_kernel": edited(sparse_fused, "fused_kernel",
                                           "n_blocks = (n_entries + SPARSE_BLOCK - 1) // SPARSE_BLOCK",
                                           "n_blocks = (n_entries - 1) // SPARSE_BLOCK")}),
    Mutant("sparse_fused", "no_rescale", "the running output not rescaled when a block raises the max", SPARSE,
           lambda: {"fused_kernel": edited(sparse_fused, "fused_kernel", "r_lo = exp_f32(m_lo - new_lo)",
                                           "r_lo = float32(1)")}),
    Mutant("sparse_fused", "value_operands_swapped", "the values' two B fragments of a pair swapped", SPARSE,
           lambda: {"fused_kernel": edited(sparse_fused, "fused_kernel",
                                           "b00, b01, b10, b11 = ldmatrix_x4_trans",
                                           "b00, b10, b01, b11 = ldmatrix_x4_trans")}),
    Mutant("sparse_subchunks", "own_start", "a sub-chunk's first position taken for the chunk's: the window rows of "
           "the chunk's earlier tokens read from the ring", SPARSE,
           lambda: {"_attend": edited(sa, "_attend", SUBCHUNK_VIEWS,
                                      "positions[part], positions[part], chosen[part]")}),
    Mutant("sparse_subchunks", "start_one_late", "the chunk's first position taken one token late", SPARSE,
           lambda: {"_attend": edited(sa, "_attend", SUBCHUNK_VIEWS, "positions[part], positions[1:], chosen[part]")}),
    Mutant("sparse_subchunks", "scores_own_start", "the scores kernel's chunk start from the sub-chunk's positions",
           SPARSE, lambda: {"split_score_kernel": edited(sparse_split, "split_score_kernel", "else first[0]",
                                                         "else positions[0]")}),
    Mutant("sparse_subchunks", "entry_at_own_start", "entry_at's chunk start from the sub-chunk's positions (the "
           "value kernel's)", SPARSE,
           lambda: {"entry_at": edited(sparse_entries, "entry_at", "else first[0]", "else positions[0]")}),
    Mutant("entries", "subchunk_own_start", "entry_at's chunk start read from the sub-chunk's positions", SPARSE,
           lambda: {"entry_at": edited(sparse_entries, "entry_at", "else first[0]", "else positions[0]")}),
    Mutant("entries", "window_one_early", "window positions p - W .. p - 1 instead of p - W + 1 .. p", SPARSE,
           lambda: {"entry_from": edited(sparse_entries, "entry_from", "wp = pos - window + 1 + j",
                                       "wp = pos - window + j")}),
    Mutant("entries", "chunk_start_from_ring", "the chunk's first position read from the ring", SPARSE,
           lambda: {"entry_from": edited(sparse_entries, "entry_from", "if wp >= start:", "if wp > start:")}),
    Mutant("entries", "own_row_first", "a batch's tokens all reading chunk row 0 as their own", SPARSE,
           lambda: {"entry_from": edited(sparse_entries, "entry_from", "(t if own_rows else 0)", "0")}),
    Mutant("entries", "selection_one_late", "selected group s read as s + 1", SPARSE,
           lambda: {"entry_from": edited(sparse_entries, "entry_from", "int32(window + chunk_rows + s)",
                                       "int32(window + chunk_rows + s + 1)")}),
    Mutant("index_scores", "dot_term_dropped", "the last product of each head's q . k left out", indexer,
           lambda: {"_block_dot": block_dot_without_last_term}),
    Mutant("index_scores", "weight_1pct", "the head weights 1% large", indexer,
           lambda: {"score_kernel": edited(indexer, "score_kernel", "mul_rn(bf16_to_f32(hw[t, h]), w_scale)",
                                           "mul_rn(bf16_to_f32(hw[t, h]), w_scale * float32(1.01))")}),
    Mutant("index_scores", "bf16_truncated", "the dot, weight and weighted-term roundings toward zero", indexer,
           lambda: {"bf16_round": bf16_round_truncating}),
    Mutant("index_scores", "score_truncated", "the score rounded toward zero to bf16", indexer,
           lambda: {"f32_to_bf16": f32_to_bf16_truncating}),
    Mutant("index_scores_tc", "slots_swapped", "a query's two words of a k16 step swapped (dims mismatched)",
           index_scores_tc, lambda: {"score_tc_kernel": edited(
               index_scores_tc, "score_tc_kernel", "kw[1, b, 1], qw[f, b, 0], qw[f, b, 1],",
               "kw[1, b, 1], qw[f, b, 1], qw[f, b, 0],")}),
    Mutant("index_scores_tc", "second_key_one_late", "the tile's keys g + 8 read one row late", index_scores_tc,
           lambda: {"score_tc_kernel": edited(index_scores_tc, "score_tc_kernel", "rb = min(g0 + g + 8, width - 1)",
                                              "rb = min(g0 + g + 9, width - 1)")}),
    Mutant("index_scores_tc", "weight_1pct", "the head weights 1% large", index_scores_tc,
           lambda: {"score_tc_kernel": edited(index_scores_tc, "score_tc_kernel", "]), w_scale))",
                                              "]), w_scale * float32(1.01)))")}),
    Mutant("index_scores_tc", "bf16_truncated", "the dot, weight and weighted-term roundings toward zero",
           index_scores_tc, lambda: {"bf16_round": bf16_round_truncating}),
    Mutant("index_scores_tc", "score_truncated", "the score rounded toward zero to bf16", index_scores_tc,
           lambda: {"f32_to_bf16": f32_to_bf16_truncating}),
    Mutant("select", "visible_one_short", "the query's newest position masked out", indexer,
           lambda: {"select_kernel": edited(indexer, "select_kernel", "visible = (positions[t] + 1) // ratio",
                                            "visible = positions[t] // ratio")}),
    Mutant("select", "visible_one_long", "the position after the query's visible", indexer,
           lambda: {"select_kernel": edited(indexer, "select_kernel", "visible = (positions[t] + 1) // ratio",
                                            "visible = (positions[t] + 2) // ratio")}),
    Mutant("select", "split_visible_one_short", "the split path: the query's newest position masked out", topk,
           lambda: {"problem": edited(topk, "problem", "visible = (positions[t] + 1) // ratio",
                                      "visible = positions[t] // ratio")}),
    Mutant("select", "split_ties_last", "the split path: the ties at tau after the first `need` taken", topk,
           lambda: {"write_kernel": edited(topk, "write_kernel", "take = tie < need", "take = tie >= need")}),
    # indexer imports one_block_top_k for the unsplit path: the swap is made there too. The ties
    # taken are shifted by one rather than all those after the first `need` (as split_ties_last
    # takes), which would write past the row's k slots: a wrong selection, never a wrong write
    Mutant("select", "one_block_ties_shifted", "one block's select: the first tie at tau skipped, the one after the "
           "first `need` taken", (topk, indexer),
           lambda: {"one_block_top_k": edited(topk, "one_block_top_k", "take = tie < need",
                                              "take = tie >= 1 and tie <= need")}),
    Mutant("select", "split_prefix_one_short", "the split path: a slice's prefix misses the slice before it",
           topk, lambda: {"write_kernel": edited(topk, "write_kernel", "for j in range(tid, s, nt):",
                                                 "for j in range(tid, s - 1, nt):")}),
    Mutant("select", "split_wrong_digit", "the split path: the second histogram of the high byte", topk,
           lambda: {"digit_kernel": edited(topk, "digit_kernel",
                                           "cuda.atomic.add(local, int32(key & (DIGIT_BINS - 1)), 1)",
                                           "cuda.atomic.add(local, int32(key >> DIGIT_BITS), 1)")}),
    Mutant("select", "split_suffix_exclusive", "the split path: a slice's low-byte counts above, not at or above",
           topk, lambda: {"digit_kernel": edited(topk, "digit_kernel",
                                                 SUFFIX_INCLUSIVE, SUFFIX_EXCLUSIVE)}),
    Mutant("rope", "position_plus_1", "rotated by the angle of position p + 1", nrq,
           lambda: {"_rope_kernel": edited(nrq, "_rope_kernel", "pos = positions[r]", "pos = positions[r] + 1")}),
    Mutant("rope", "product_dropped", "b sin left out of the first output of each pair", nrq,
           lambda: {"rotate_pair": edited(device_module, "rotate_pair", "mul_rn(a, c) - mul_rn(b, s)",
                                          "mul_rn(a, c)")}),
    Mutant("act_quant", "e4m3_truncated", "e4m3 rounding toward zero", nrq, e4m3_truncating),
    Mutant("act_quant", "e4m3_ties_away", "e4m3 ties rounded away from zero, not to even", nrq, e4m3_ties_away),
    Mutant("act_quant", "scale_floor_plus_1", "the power-of-two scale as floor + 1: one step high at exact powers",
           nrq, pow2_floor_plus_1),
    Mutant("act_quant", "scale_floor", "the power-of-two scale rounded down: one step low", nrq,
           lambda: {"pow2_ceil": edited(nrq, "pow2_ceil", POW2_CEIL, "0")}),
    Mutant("act_quant", "scale_1pct", "1 / 448 taken 1% small", nrq,
           lambda: {"FP8_MAX_INV": float32(0.99 / 448.0)}),
    Mutant("fp4_e4m3", "e2m1_truncated", "E2M1 rounding toward zero", nrq,
           lambda: {"e2m1_round": e2m1_round_truncating}),
    Mutant("fp4_e8m0", "e2m1_tie_up", "E2M1: 0.25 rounds up to 0.5, not to the even code 0", nrq,
           lambda: {"e2m1_round": edited(nrq, "e2m1_round", "if m <= 0.25:", "if m < 0.25:")}),
    Mutant("fp4_e4m3", "scale_e4m3_truncated", "the e4m3 block scale rounded toward zero", nrq, e4m3_truncating),
    Mutant("fp4_e4m3", "scale_e4m3_1pct", "the e4m3 block scale's amax / 6 taken 1% small", nrq,
           lambda: {"quant_scale": edited(nrq, "quant_scale", "max(amax, FP4_E4M3_FLOOR) / FP4_MAX",
                                          "max(amax, FP4_E4M3_FLOOR) / (FP4_MAX * float32(1.01))")}),
    Mutant("fp4_e8m0", "scale_floor_plus_1", "the power-of-two block scale as floor + 1", nrq, pow2_floor_plus_1),
    Mutant("fp4_e8m0", "scale_1pct", "1 / 6 taken 1% small", nrq,
           lambda: {"FP4_MAX_INV": float32(0.99 / 6.0)}),
    Mutant("rms_norm", "scale_1pct", "rsqrt 1% large", nrq,
           lambda: {"rms_norm_kernel": edited(nrq, "rms_norm_kernel", "float32(1.0 / math.sqrt(",
                                              "float32(1.01 / math.sqrt(")}),
    Mutant("rms_norm", "out_truncated", "the output rounded toward zero to bf16", nrq,
           lambda: {"f32_to_bf16": f32_to_bf16_truncating}),
]


# ---- the checks, on the real tests' inputs -----------------------------------------------------------

def _every(check: Callable[..., Any], cases) -> None:
    for case in cases:
        check(*case)


CHECKS: dict[str, Callable[[Any], Any]] = {
    "sparse_attention": lambda cfg: check_sparse_attention(*SPARSE_CASE, "sparse attention"),
    "sparse_split": lambda cfg: check_sparse_attention(*SPARSE_CASE, "sparse attention (split)", split=True,
                                                       cores="cuda"),
    "sparse_fused": lambda cfg: check_sparse_attention(*SPARSE_CASE, "sparse attention (fused)", split=True,
                                                       cores="fused"),
    # a chunk of 10 tokens in sub-chunks of 4 (the workspace's tokens), 4 and 2
    "sparse_subchunks": lambda cfg: check_sparse_subchunks(SUBCHUNK_CASES[0], "sparse attention (sub-chunks)", "cuda"),
    "entries": lambda cfg: _every(check_entries, ENTRY_CASES),
    "index_scores": lambda cfg: check_index_scores(cfg, 9, heads=3, dim=64, t=5, width=13, spare=3, c=32),
    # the emulated mma: two head fragments, three key tiles
    "index_scores_tc": lambda cfg: check_index_scores(cfg, 10, heads=16, dim=64, t=2, width=37, spare=3, c=32,
                                                      cores="tc"),
    "select": lambda cfg: _every(lambda case: check_select(cfg, case), [(c,) for c in SELECT_CASES]),
    # one spare table row past the last position, so that a kernel reading position p + 1 stays inside
    "rope": lambda cfg: _every(lambda compressed: check_rope(cfg, 3, compressed, max_seq=201), [(False,), (True,)]),
    "act_quant": lambda cfg: check_act_quant(),
    "fp4_e4m3": lambda cfg: check_fp4_quant(16, True),
    "fp4_e8m0": lambda cfg: check_fp4_quant(32, False),
    "rms_norm": lambda cfg: _every(check_rms_norm, [(np.uint16,), (np.float32,)]),
}
FLASH_CHECKS: dict[str, Callable[[Any], Any]] = {
    "sparse_attention": lambda cfg: check_sparse_attention(*FLASH_SPARSE_CASE, "sparse attention (flash)"),
    "sparse_split": lambda cfg: check_sparse_attention(*FLASH_SPARSE_CASE, "sparse attention (flash, split)",
                                                       split=True, cores="cuda"),
    "sparse_fused": lambda cfg: check_sparse_attention(*FLASH_SPARSE_CASE, "sparse attention (flash, fused)",
                                                       split=True, cores="fused"),
    # the 150-token chunk in the engine's sub-chunks of 64, on the split path (the fused kernel takes
    # the whole chunk in one launch: no sub-chunks)
    "sparse_subchunks": lambda cfg: check_sparse_subchunks(FLASH_SUBCHUNK_CASE, "sparse attention (flash, sub-chunks)",
                                                           "cuda"),
    "index_scores": lambda cfg: check_index_scores(cfg, 15, heads=32, dim=128, t=3, width=4096, spare=0, c=64,
                                                   cores="cuda"),
    "index_scores_tc": lambda cfg: check_index_scores(cfg, 15, heads=32, dim=128, t=3, width=4096, spare=0, c=64,
                                                      cores="tc"),
    "select": lambda cfg: check_select(cfg, FLASH_SELECT_CASE, seed=13),
}


@pytest.fixture(scope="module")
def cfg(tiny_path):
    model = load_model(tiny_path)
    yield model.config
    model.close()


def assert_rejected(m: Mutant, check: Callable[[], Any]) -> None:
    replacements = m.replacements()  # a MutationError here is a failure, never a rejection
    modules = m.module if isinstance(m.module, tuple) else (m.module,)
    with mutant_across(modules, **replacements), pytest.raises(AssertionError):
        check()


# checks that take 5-13 s each on the simulator: they and their mutants run in the full suite only
SLOW_CHECKS = ("index_scores_tc", "select")


def slow_if(check: str) -> tuple[pytest.MarkDecorator, ...]:
    return (pytest.mark.slow,) if check in SLOW_CHECKS else ()


@pytest.mark.parametrize("kernel", [pytest.param(k, marks=slow_if(k)) for k in CHECKS])
def test_unmutated_passes(cfg, kernel):
    CHECKS[kernel](cfg)


@pytest.mark.parametrize("m", [pytest.param(m, marks=slow_if(m.check)) for m in MUTANTS],
                         ids=lambda m: f"{m.check}-{m.key}")
def test_mutant_rejected(cfg, m):
    assert_rejected(m, lambda: CHECKS[m.check](cfg))


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", list(FLASH_CHECKS))
def test_flash_unmutated_passes(cfg, kernel):
    FLASH_CHECKS[kernel](cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [m for m in MUTANTS if m.check in FLASH_CHECKS and m.flash],
                         ids=lambda m: f"{m.check}-{m.key}")
def test_flash_mutant_rejected(cfg, m):
    assert_rejected(m, lambda: FLASH_CHECKS[m.check](cfg))
