"""The indexer's scores on the tensor cores: what stages.indexer.score_kernel computes, bit for bit.

score[t, g] = bf16(sum_h bf16(relu(bf16(iq_h . k_g)) * w_h)), w_h = bf16(hw_h * scale), for the
G = (positions[T-1] + 1) // ratio key rows of the chunk (tables: row t's own keys and its own G);
iq bf16 [T, IH * ID], hw bf16 [T, IH], keys bf16 [>= G, ID], score bf16 [T, >= G] (stages.indexer
has the shapes and the oracle).

Why the tensor cores give the same bits. Along ID the queries and keys are fp4 blocks of 32: each
value an E2M1 level (a multiple of 1/2, at most 6) times its block's power-of-two scale, so a
product is an integer of at most 144 times s_q s_k / 4, exact in bf16 x bf16 -> fp32, and a
block's sum of 32 of them is an integer of at most 4608 (13 bits) times that quantum. Every partial
sum the mma forms within a block is such an integer, so it is exact however the mma adds and
rounds. The ID / 32 block sums are added in float64 (exact), and the head terms as in score_kernel.

Layout: the mma's rows are 16 keys (A, row-major), its columns 8 heads of one token (B^T, the
queries as stored), k the 32 dims of one fp4 block in two k16 steps. Lane (g, t) = (lane >> 2,
lane & 3) loads dims 8 t .. 8 t + 7 of each block (one 16-byte unit) of keys g and g + 8 and of
head g of each 8-head fragment; word w of the unit enters step w // 2 as slot 2 t (w even) or 2 t + 8
(w odd). Both operands are permuted alike, so each step multiplies matching dims. A warp holds its
token's queries in registers (IH / 8 fragments x ID / 32 blocks x 4 words) and walks tiles of 16
keys, strided over the grid; the blocks of a token stride together, so a graph captured for the
whole cache launches what fills the GPU and each block stops at the width it reads off positions.

On the simulator the mma is stages.warp_mma's emulation (exact), so the kernel's indexing is
tested there on small shapes; its blocks are at most linear_tc's four warps.
"""

from __future__ import annotations

from functools import cache

import numpy as np
from numba import cuda, float32, float64, uint32

from flashv41.stages.device import SIM, WARP, bf16_round, bf16_to_f32, f32_to_bf16, jit_kernel, load_words4, mul_rn
from flashv41.stages.row_tables import u32_rows
from flashv41.stages.warp_mma import kernel_mma as mma

FP4_BLOCK = 32  # the fp4 (E8M0) block of the index queries and keys: one mma k32 (two k16 steps)
KEYS = 16  # keys a warp's tile (the mma's rows)
HEADS = 8  # heads a fragment (the mma's columns)
WARPS = 1 if SIM else 4  # warps a block
BLOCKS_PER_SM = 4  # at most this many blocks a multiprocessor per token row (the blocks stride over it)


def supports(index_heads: int, index_dim: int) -> bool:
    """Whether the kernel takes this indexer shape (whole fragments of heads, whole fp4 blocks)."""
    return index_heads % HEADS == 0 and index_dim % FP4_BLOCK == 0


@cache
def score_tc_kernel(index_heads: int, index_dim: int, warps: int, tables: bool = False):
    """Blocks of `warps` warps, grid (blocks, T): warp w of block b walks key tiles b * warps + w,
    then + gridDim.x * warps, ... of its token's row. iq32 uint32 [T, IH * ID / 2] (the queries' bf16
    pairs), hw bf16 [T, IH], key_rows uint32 [>= G, ID / 2] (tables: an address table [T, 2] of each
    row's own keys), score bf16 [T, >= G], positions int32 [T]."""
    frags = index_heads // HEADS
    blocks = index_dim // FP4_BLOCK
    row_words = index_dim // 2
    q_shape = (frags, blocks, 4)  # [fragment, block, word]: head 8 f + g's unit t of each block
    w_shape = (frags, 2)  # [fragment, column]: the weights of heads 8 f + 2 t, 8 f + 2 t + 1
    k_shape = (2, blocks, 4)  # [keys g / g + 8, block, word]: the tile's unit t of each block
    dot_shape = (frags, 4)  # [fragment, register]: float64 q . k, the C layout's keys and heads
    part_shape = (warps, KEYS, 4)  # [warp, key, t]: a lane's sum over its heads of a key

    @jit_kernel(WARP * warps)
    def kernel(iq32, hw, key_rows, score, positions, n_tokens, ratio, w_scale):
        part = cuda.shared.array(part_shape, float64)
        tid = cuda.threadIdx.x
        warp = tid // WARP
        lane = tid % WARP
        g = lane >> 2
        t4 = lane & 3
        t = cuda.blockIdx.y
        keys = u32_rows(key_rows, t, row_words) if tables else key_rows
        width = (positions[t if tables else n_tokens - 1] + 1) // ratio
        qw = cuda.local.array(q_shape, uint32)
        wt = cuda.local.array(w_shape, float32)
        for f in range(frags):
            for b in range(blocks):
                qw[f, b, 0], qw[f, b, 1], qw[f, b, 2], qw[f, b, 3] = load_words4(
                    iq32, t, (HEADS * f + g) * row_words + 16 * b + 4 * t4)
            for c in range(2):
                wt[f, c] = bf16_round(mul_rn(bf16_to_f32(hw[t, HEADS * f + 2 * t4 + c]), w_scale))
        dot = cuda.local.array(dot_shape, float64)
        kw = cuda.local.array(k_shape, uint32)
        tiles = (width + KEYS - 1) // KEYS
        stride = cuda.gridDim.x * warps
        for base in range(cuda.blockIdx.x * warps, tiles, stride):  # the block's warps go round together
            g0 = (base + warp) * KEYS
            ra = min(g0 + g, width - 1)  # keys past the width read the last one; their scores are not written
            rb = min(g0 + g + 8, width - 1)
            for f in range(frags):
                for i in range(4):
                    dot[f, i] = float64(0)
            for b in range(blocks):  # every load of the tile issued before the first mma
                kw[0, b, 0], kw[0, b, 1], kw[0, b, 2], kw[0, b, 3] = load_words4(keys, ra, 16 * b + 4 * t4)
                kw[1, b, 0], kw[1, b, 1], kw[1, b, 2], kw[1, b, 3] = load_words4(keys, rb, 16 * b + 4 * t4)
            for b in range(blocks):
                for f in range(frags):
                    # step 0: words 0 (slots 2 t, 2 t + 1) and 1 (slots 2 t + 8, 2 t + 9); step 1: words 2, 3
                    p0, p1, p2, p3 = mma(kw[0, b, 0], kw[1, b, 0], kw[0, b, 1], kw[1, b, 1], qw[f, b, 0], qw[f, b, 1],
                                         float32(0), float32(0), float32(0), float32(0))
                    p0, p1, p2, p3 = mma(kw[0, b, 2], kw[1, b, 2], kw[0, b, 3], kw[1, b, 3], qw[f, b, 2], qw[f, b, 3],
                                         p0, p1, p2, p3)
                    dot[f, 0] += float64(p0)
                    dot[f, 1] += float64(p1)
                    dot[f, 2] += float64(p2)
                    dot[f, 3] += float64(p3)
            # lane (g, t) holds keys g (registers 0, 1) and g + 8 (2, 3) at heads 8 f + 2 t, 8 f + 2 t + 1
            sum_a = float64(0)
            sum_b = float64(0)
            for f in range(frags):
                for i in range(4):
                    v = bf16_round(float32(dot[f, i]))
                    if v > 0:  # relu: a zero or negative dot adds a zero term
                        term = float64(bf16_round(mul_rn(v, wt[f, i % 2])))
                        if i < 2:
                            sum_a += term
                        else:
                            sum_b += term
            part[warp, g, t4] = sum_a
            part[warp, g + 8, t4] = sum_b
            cuda.syncthreads()
            key = g0 + lane
            if lane < KEYS and key < width:
                total = part[warp, lane, 0] + part[warp, lane, 1] + part[warp, lane, 2] + part[warp, lane, 3]
                score[t, key] = f32_to_bf16(float32(total))
            cuda.syncthreads()

    return kernel


@cache
def block_cap() -> int:
    """The most blocks a launch gives one token row (1 on the simulator, which pays about a
    millisecond a block)."""
    return 1 if SIM else BLOCKS_PER_SM * cuda.get_current_device().MULTIPROCESSOR_COUNT


def launch(iq, hw, keys, scale: float, score, n_tokens: int, positions, ratio: int, width: int, heads: int,
           index_dim: int, tables: bool, stream=0) -> None:
    """score_tc_kernel over n_tokens rows of `width` groups as the host knows it (it sizes the grid
    only), for stages.indexer.index_scores (keys bf16 [>= G, ID]) and index_scores_tables (keys an
    address table), whose checks the arguments have passed."""
    tiles = -(-width // KEYS)
    blocks = min(-(-tiles // WARPS), block_cap())
    score_tc_kernel(heads, index_dim, WARPS, tables)[(blocks, n_tokens), WARP * WARPS, stream](
        iq.view(np.uint32), hw, keys if tables else keys.view(np.uint32), score, positions, n_tokens, ratio,
        np.float32(scale))
