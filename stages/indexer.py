"""The indexer on the device: index queries, index scores, candidate blocks and the top-k selection.

Shapes (T tokens, IH x ID index heads, G = width groups, K = index_topk, B = candidate block size,
NB = ceil(G / B) blocks; bf16 = uint16 bit patterns). Each wrapper takes the arguments of its
oracle function in host.oracle.attention in the same order, then the device's own (outputs, row
count, the positions the kernels read widths off, the stream):
- `index_queries(w, x, qr, cos, sin, positions, iq, hw, n_tokens)`: x bf16 [T, C], qr bf16 [T, Q] ->
  iq = fp4_32(RoPE(qr @ wq_b^T)) bf16 [T, IH*ID] (the oracle's [T, IH, ID]) and hw = x @ proj^T bf16
  [T, IH]. Oracle: index_queries(w, x, qr, cos, sin, positions).
- `index_scores(iq, hw, keys, scale, score, n_tokens, positions, ratio, width)`: iq, hw, keys bf16
  [>=G, ID] -> score bf16 [T, >=G]: score[t, g] = bf16(sum_h bf16(relu(bf16(iq_h . k_g)) * w_h)),
  w_h = bf16(hw_h * scale), scale = ID^-0.5 * IH^-0.5, for g < G = (positions[T-1] + 1) // ratio (the
  oracle's keys are those G rows). Oracle: index_scores(iq, hw, keys, scale). On a GPU the scores
  run on the tensor cores (stages.index_scores_tc: the same bits; score_cores picks), on the
  simulator and for other shapes on the CUDA cores (score_kernel).
- `select(cfg, role, score, positions, candidates, selection, n_tokens)`: score -> selection int32
  [T, K] (ascending, -1 padded) and, on the candidate source, the block mask uint8 [T, >=NB] in
  `candidates` that later index sources respect (the oracle's mask is per position, [T, G] bool:
  each block's flag repeated over its B positions). Oracle: select(cfg, role, score, positions,
  candidates), with candidate_blocks and topk_positions.

Exactness. The index queries and keys are fp4 values: in a block of 32 along ID every value is an
E2M1 code times the block's power-of-two scale, so a product is (an integer <= 144) * s_q * s_k / 4
and the fp32 sum of a block's 32 products is exact in any order; the ID / 32 block sums and the
IH head terms (bf16 values) are added in float64, exactly. So a score equals the oracle's bit for
bit (for other inputs the block sums would carry fp32 rounding). The selection is integer logic on
the bf16 scores and equals the oracle's exactly: a score maps to a 16-bit key whose unsigned order
is the score order (-0 and +0 one key, -inf the lowest; stages.topk.score_key), a radix select
finds the k-th largest key tau and how many keys lie above it, and an ordered compaction over
positions keeps every key above tau plus the first ties at tau, lower positions first: (score
desc, position asc), written ascending. Candidate blocks are the same routine over block keys (the
max key of the block's visible positions, the newest visible block pinned at +inf, kept only if
above -inf). Two paths give that result: up to stages.topk.SPLIT_ROWS rows (decode steps and
batches) the split path of stages.topk (each row in slices over the whole GPU, three kernels,
the work following the visible width; a row of few items one block's, in the first kernel);
more rows (prefill chunks) `select_kernel`, one block of threads a row (stages.topk's
one_block_top_k: 16 / RADIX_BITS histogram passes, then a block-wide prefix sum over per-thread
segments). Nothing leaves the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import numpy as np
from numba import cuda, float32, float64, int32, int64

from flashv41.host.config import LayerRole, ModelConfig
from flashv41.host.errors import InputError
from flashv41.stages import index_scores_tc
from flashv41.stages.device import (
    SIM,
    DeviceArray,
    bf16_round,
    bf16_to_f32,
    check_array,
    check_rows,
    f32_to_bf16,
    jit_kernel,
    mul_rn,
)
from flashv41.stages.index_scores_tc import FP4_BLOCK  # the fp4 (E8M0) block of the index queries and keys
from flashv41.stages.linear import DeviceWeight, linear
from flashv41.stages.norm_rope_quant import norm_rope_quant
from flashv41.stages.row_tables import u16_rows
from flashv41.stages.topk import (
    BLOCKS,
    MASKED,
    POSITIONS,
    SPLIT_ROWS,
    SelectWorkspace,
    one_block_top_k,
    split_select,
)
from flashv41.stages.trace import Mark, unmarked

# Score tiles: SCORE_GROUPS groups per block, SCORE_HEAD_THREADS threads over the heads; a block
# walks its row's tiles with a grid stride, so the grid need not follow the width. Block sizes keep
# registers x threads well inside the 64 K registers of a block (ptxas for sm_90: the score kernel
# takes 64 registers a thread at flash sizes, the select kernel 152); launch bounds (jit_kernel) make
# sure of it for any size.
SCORE_GROUPS = 1 if SIM else 16
SCORE_HEAD_THREADS = 1 if SIM else 32
# blocks per row: at most SCORE_BLOCKS_PER_SM a multiprocessor (the blocks stride over the row), so
# a graph captured for the whole cache launches what fills the GPU, not a block per 16 cache rows
SCORE_BLOCKS_PER_SM = 2
SELECT_THREADS = 1 if SIM else 256
RADIX_BITS = 4 if SIM else 8

if SIM:
    def _block_dot(qs, h, ks, g, d0):
        return np.float32(np.dot(qs[h, d0:d0 + FP4_BLOCK], ks[g, d0:d0 + FP4_BLOCK]))
else:
    @cuda.jit(device=True)
    def _block_dot(qs, h, ks, g, d0):
        s = float32(0)
        for d in range(d0, d0 + FP4_BLOCK):
            s += qs[h, d] * ks[g, d]
        return s


@cache
def score_kernel(index_heads: int, index_dim: int, head_threads: int, groups: int, tables: bool = False):
    """Block (head_threads, groups) per tile of `groups` groups of one query row. iq bf16 [T, IH * ID],
    hw bf16 [T, IH], keys bf16 [>= G, ID], score bf16 [T, >= G], positions int32 [T]. tables: keys
    is an address table [T, 2] of each row's own keys (a batch of sequences, stages.row_tables), and
    row t's width is its own, (positions[t] + 1) // ratio."""
    nt = head_threads * groups
    sync = nt > 1
    dims = index_dim + 1  # padded shared rows: threads of a warp read different heads' rows

    @jit_kernel(nt)
    def kernel(iq, hw, key_rows, score, positions, n_tokens, ratio, w_scale):
        qs = cuda.shared.array((index_heads, dims), float32)  # [IH, ID + 1]: the row's queries
        ks = cuda.shared.array((groups, dims), float32)  # [groups, ID + 1]: the tile's keys
        ws = cuda.shared.array(index_heads, float32)  # [IH]: the scaled head weights
        part = cuda.shared.array((groups, head_threads), float64)  # [groups, head threads]: sums over heads
        t = cuda.blockIdx.y
        tx = cuda.threadIdx.x
        ty = cuda.threadIdx.y
        tid = ty * head_threads + tx
        keys = u16_rows(key_rows, t, index_dim) if tables else key_rows
        width = (positions[t if tables else n_tokens - 1] + 1) // ratio
        for i in range(tid, index_heads * index_dim, nt):
            qs[i // index_dim, i % index_dim] = bf16_to_f32(iq[t, i])
        for h in range(tid, index_heads, nt):
            ws[h] = bf16_round(mul_rn(bf16_to_f32(hw[t, h]), w_scale))
        for g0 in range(cuda.blockIdx.x * groups, width, cuda.gridDim.x * groups):
            if sync:
                cuda.syncthreads()  # queries loaded; the previous tile's keys and partials consumed
            for i in range(tid, groups * index_dim, nt):
                g = g0 + i // index_dim
                ks[i // index_dim, i % index_dim] = bf16_to_f32(keys[g, i % index_dim]) if g < width else float32(0)
            if sync:
                cuda.syncthreads()
            acc = float64(0)
            for h in range(tx, index_heads, head_threads):
                dot = float64(0)
                for d0 in range(0, index_dim, FP4_BLOCK):
                    dot += float64(_block_dot(qs, h, ks, ty, d0))
                v = bf16_round(float32(dot))
                if v > 0:  # relu: a zero or negative dot adds a zero term
                    acc += float64(bf16_round(mul_rn(v, ws[h])))
            part[ty, tx] = acc
            if sync:
                cuda.syncthreads()
            g = g0 + ty
            if tx == 0 and g < width:
                total = float64(0)
                for j in range(head_threads):
                    total += part[ty, j]
                score[t, g] = f32_to_bf16(float32(total))

    return kernel


@cache
def select_kernel(threads: int, radix_bits: int, own_rows: bool = False):
    """One block of `threads` threads per query row: candidate blocks (candidate source), then the
    top-k positions. own_rows: each row is its own sequence's (a batch), its candidate blocks those
    of its own width."""
    nt = threads
    bins = 1 << radix_bits
    top_k = one_block_top_k(nt, radix_bits)

    @jit_kernel(nt)
    def kernel(score, cand, sel, positions, n_tokens, ratio, candidate_source, masked, blk, topk_blocks):
        # score bf16 [T, >= G], cand uint8 [T, >= NB], sel int32 [T, K], positions int32 [T]
        hist = cuda.shared.array(bins, int32)  # [2^radix_bits]: one pass's histogram of key digits
        buf = cuda.shared.array(nt, int64)  # [threads]: the scans'
        found = cuda.shared.array(2, int64)  # the pass's digit of the k-th key, and the count above it
        t = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        width = (positions[t if own_rows else n_tokens - 1] + 1) // ratio
        visible = (positions[t] + 1) // ratio
        if candidate_source:
            nb = (width + blk - 1) // blk
            top_k(BLOCKS, score, cand, sel, t, nb, min(topk_blocks, nb), visible, blk, True, hist, buf, found, tid)
        mode = MASKED if masked else POSITIONS
        top_k(mode, score, cand, sel, t, visible, min(sel.shape[1], visible), visible, blk, False, hist, buf, found,
              tid)

    return kernel


@dataclass
class IndexerWeights:
    """One index source's indexer weights on the device."""

    wq_b: DeviceWeight  # [IH * ID, Q]
    proj: DeviceWeight  # [IH, C]


def index_queries(w: IndexerWeights, x: DeviceArray, qr: DeviceArray, cos: DeviceArray, sin: DeviceArray,
                  positions: DeviceArray, iq: DeviceArray, hw: DeviceArray, n_tokens: int, stream=0,
                  mark: Mark = unmarked) -> None:
    """iq[:T] = fp4_32(RoPE(qr @ wq_b^T)) per head; hw[:T] = x @ proj^T (bf16, unscaled). mark:
    called with "index products" after both products (stages.trace), which run first so that the
    caller's next mark times the queries' RoPE and quantiser alone."""
    heads = w.proj.n
    linear(qr, w.wq_b, iq, n_tokens, stream=stream)
    linear(x, w.proj, hw, n_tokens, stream=stream)
    mark("index products")
    norm_rope_quant(iq, None, None, cos, sin, positions, False, "fp4_e8m0_32", n_tokens, heads, stream=stream)


@cache
def score_block_cap() -> int:
    """The most blocks index_scores launches per query row (1 on the simulator, which pays about a
    millisecond a block)."""
    return 1 if SIM else SCORE_BLOCKS_PER_SM * cuda.get_current_device().MULTIPROCESSOR_COUNT


def index_scores(iq: DeviceArray, hw: DeviceArray, keys: DeviceArray, scale: float, score: DeviceArray,
                 n_tokens: int, positions: DeviceArray, ratio: int, width: int, stream=0,
                 tile: tuple[int, int] = (0, 0), cores: str = "") -> None:
    """score[t, g] for t < T and g < G = (positions[T-1] + 1) // ratio (bf16 bits).

    scale: ID^-0.5 * IH^-0.5, rounded to fp32 here as the oracle does. width: G as the host knows
    it; it only sizes the grid (the kernel reads G off the positions, and its blocks stride over
    the row, so a captured graph may pass the cache's length). tile: (head threads, groups) per
    block of the CUDA-core kernel (0 = the default; tests force others). cores: where the scores
    run (score_cores; "" = the default).
    """
    check_array(keys, (np.uint16,), 2, "index_scores keys")
    index_dim = keys.shape[1]
    heads = _check_queries(iq, hw, score, positions, n_tokens, index_dim, "index_scores")
    if width > min(keys.shape[0], score.shape[1]):
        raise InputError(f"index_scores: {width} groups, keys {keys.shape}, score {score.shape}")
    if n_tokens == 0 or width == 0:
        return
    _launch_scores(iq, hw, keys, scale, score, n_tokens, positions, ratio, width, heads, index_dim, tile, False,
                   stream, cores)


def index_scores_tables(iq: DeviceArray, hw: DeviceArray, keys: DeviceArray, scale: float, score: DeviceArray,
                        n_tokens: int, positions: DeviceArray, ratio: int, width: int, index_dim: int,
                        stream=0, cores: str = "") -> None:
    """index_scores for a batch of T sequences, row t its sequence's only token: keys is an address
    table (uint64 [>= T, 2], stages.row_tables) of each row's own key cache [>= G_t, ID], and row t's
    scores are those of its own G_t = (positions[t] + 1) // ratio groups (what index_scores gives it
    alone). width: the largest G_t as the host knows it (it sizes the grid only)."""
    check_array(keys, (np.uint64,), 2, "index_scores_tables keys")
    check_rows(keys, n_tokens, "index_scores_tables keys")
    heads = _check_queries(iq, hw, score, positions, n_tokens, index_dim, "index_scores_tables")
    if width > score.shape[1]:
        raise InputError(f"index_scores_tables: {width} groups, score {score.shape}")
    if n_tokens == 0 or width == 0:
        return
    _launch_scores(iq, hw, keys, scale, score, n_tokens, positions, ratio, width, heads, index_dim, (0, 0), True,
                   stream, cores)


def _check_queries(iq, hw, score, positions, n_tokens: int, index_dim: int, what: str) -> int:
    """The arguments index_scores and index_scores_tables share, checked: the index heads."""
    for a, name in ((iq, "iq"), (hw, "hw"), (score, "score")):
        check_array(a, (np.uint16,), 2, f"{what} {name}")
    check_array(positions, (np.int32,), 1, f"{what} positions")
    for a, name in ((iq, "iq"), (hw, "hw"), (score, "score"), (positions, "positions")):
        check_rows(a, n_tokens, f"{what} {name}")
    heads = hw.shape[1]
    if iq.shape[1] != heads * index_dim or index_dim % FP4_BLOCK:
        raise InputError(f"{what}: iq {iq.shape} is not {heads} heads of {index_dim}")
    return heads


def score_cores(heads: int, index_dim: int, cores: str = "") -> str:
    """Where index_scores runs: `cores` if given ("tc": stages.index_scores_tc; "cuda":
    score_kernel), else the tensor cores on a GPU where the shape is whole fragments
    (index_scores_tc.supports), the CUDA cores otherwise and on the simulator (whose emulated mma is
    slow). Both give the same bits."""
    if cores not in ("", "tc", "cuda"):
        raise InputError(f"index_scores: cores {cores!r} is not one of 'tc', 'cuda'")
    if cores == "tc" and not index_scores_tc.supports(heads, index_dim):
        raise InputError(f"index_scores: the tensor-core kernel needs heads a multiple of {index_scores_tc.HEADS} "
                         f"and index_dim of {FP4_BLOCK}, not {heads} x {index_dim}")
    return cores or ("tc" if not SIM and index_scores_tc.supports(heads, index_dim) else "cuda")


def _launch_scores(iq, hw, keys, scale, score, n_tokens, positions, ratio, width, heads, index_dim, tile, tables,
                   stream, cores) -> None:
    if score_cores(heads, index_dim, cores) == "tc" and tile == (0, 0):
        index_scores_tc.launch(iq, hw, keys, scale, score, n_tokens, positions, ratio, width, heads, index_dim,
                               tables, stream)
        return
    head_threads = tile[0] or min(SCORE_HEAD_THREADS, heads)
    groups = tile[1] or SCORE_GROUPS
    blocks = min((width + groups - 1) // groups, score_block_cap())
    kernel = score_kernel(heads, index_dim, head_threads, groups, tables)
    kernel[(blocks, n_tokens), (head_threads, groups), stream](
        iq, hw, keys, score, positions, n_tokens, ratio, np.float32(scale))


def select(cfg: ModelConfig, role: LayerRole, score: DeviceArray, positions: DeviceArray, candidates: DeviceArray,
           selection: DeviceArray, n_tokens: int, stream=0, threads: int = 0, radix_bits: int = 0,
           own_rows: bool = False, width: int = 0, workspace: SelectWorkspace | None = None,
           split: bool | None = None, slices: int = 0) -> None:
    """selection[:T] (int32 [T, K], K = cfg.index_topk): the top min(K, visible) visible positions
    of each row by (score desc, position asc), ascending, -1 padded; visible = (positions[t] + 1) //
    role.ratio.

    The candidate source first writes candidates[t, b] (uint8) = block b kept, for b < NB (blocks
    of cfg.candidate_block_size, cfg.candidate_topk_blocks of them); on a later index source
    (role.uses_candidates) positions in blocks with candidates[t, b] == 0 rank as -inf.
    own_rows: the rows are a batch of sequences' tokens, one each (each row's candidate blocks cover
    its own visible width; a row with none visible selects nothing).

    Two paths, the same result: up to SPLIT_ROWS rows (decode steps, batches) take the split path
    (stages.topk: each row in slices over the GPU, its cost following the visible width), more
    rows (prefill chunks, which fill the GPU with their rows) the one-block-a-row select_kernel.
    split forces one (None: by the row count). width: the widest row's groups as the host knows
    them, >= the real ones (0 = the score row's length; it sizes the split grid only). workspace:
    the split path's scratch (None: a fresh one). threads (a power of two; <= 256 when split),
    radix_bits (4 or 8; the one-block kernel's), slices (the split path's): the kernels' shapes
    (0 = the defaults; tests force others).
    """
    check_array(score, (np.uint16,), 2, "select score")
    check_array(positions, (np.int32,), 1, "select positions")
    check_array(candidates, (np.uint8,), 2, "select candidates")
    check_array(selection, (np.int32,), 2, "select selection")
    for a, what in ((score, "score"), (positions, "positions"), (candidates, "candidates"), (selection, "selection")):
        check_rows(a, n_tokens, f"select {what}")
    if selection.shape[1] != cfg.index_topk:
        raise InputError(f"select: selection {selection.shape} for the top {cfg.index_topk}")
    if n_tokens == 0:
        return
    masked = bool(role.uses_candidates and not role.candidate_source)
    source, blk, topk_blocks = bool(role.candidate_source), cfg.candidate_block_size, cfg.candidate_topk_blocks
    if n_tokens <= SPLIT_ROWS if split is None else split:
        ws = workspace or SelectWorkspace.allocate(n_tokens, 2 * n_tokens * slices)
        split_select(score, positions, candidates, selection, n_tokens, role.ratio, source, masked, blk, topk_blocks,
                     width or score.shape[1], own_rows, ws, stream, threads, slices)
        return
    nt = threads or SELECT_THREADS
    select_kernel(nt, radix_bits or RADIX_BITS, own_rows)[n_tokens, nt, stream](
        score, candidates, selection, positions, n_tokens, role.ratio, source, masked, blk, topk_blocks)
