"""Narrow tensor-core products: y[t, n] = sum_k x[t, k] * dequant(w)[n, k] for the few tokens of
a decode step or a batch of them (T <= NARROW_MAX_TOKENS), bf16 x, BF16 and Q8_0 weights, on
`mma.sync.m16n8k16` (bf16 in, fp32 accumulation), each weight byte read once for all T tokens.

Shapes and dtypes as stages.linear.linear: x [T, K_total] bf16 bits (uint16), w a
stages.linear.DeviceWeight in its device layout (Q8_0 split: the row's K int8 levels, then its
K/32 fp16 scales), y [T, N] bf16 bits (rounded to nearest even) or float32. Grouped product
(group_rows > 0, a multiple of 16): output row n reads x[:, (n // group_rows) * K :][:K].

The weights are the mma's A operand (16 output rows a fragment), the tokens its B operand (8 a
fragment), so one token costs what eight do. Lane (g, t) of a warp loads, from each 32-value
block of its rows g and g + 8, the values 8 t .. 8 t + 7 (Q8_0: 8 bytes, BF16: 16) and the same
eight inputs of its token g, and they enter the block's two k16 steps permuted alike (the
quant-type table's `narrow` pieces, stages.quants): no shared memory, no shuffles.

Exactness as stages.linear_tc's: the tensor cores multiply exact values (bf16 inputs; a Q8_0
level, |q| <= 128, is exact in bf16) and sum in fp32. BF16 accumulates along the warp's slice of
K in the mma; Q8_0 takes each block's two-step sum and adds d_b times it (fp32). A block's warps
each walk a slice of K (`slice_blocks` blocks), and their sums are added in warp order. Every
output's sum depends on its row and token alone, never on the other tokens or T: a token's result
is bit for bit the same whatever batch it is in (tests/test_linear_narrow.py). Oracle:
host.numerics.linear / matmul_t with tests/bounds.py's rules (about K/32 + 4 + warps roundings a
sum, as tc's).

Launch: a block is a tile of 16 * FM rows of one group (grid x over every group's tiles), its
`warps` warps each a slice of K; `warps` (1 to MAX_WARPS) is picked from the matrix's shape alone
(`plan`), so that short-and-wide matrices still fill the GPU: enough warps, each at least one
walk step (UNROLL blocks, whose loads a lane issues together) of K.

On the simulator the mma is stages.warp_mma's emulation (the lanes of a warp meet at each call),
so blocks have at most four warps there.
"""

from __future__ import annotations

from functools import cache

import numpy as np
from numba import cuda, float32, uint32

from flashv41.stages.device import CHUNK, SIM, WARP, f32_to_bf16, inlined, jit_kernel, load_words4, product_groups
from flashv41.stages.quants.records import NarrowType
from flashv41.stages.quants.table import DEVICE_TYPES
from flashv41.stages.warp_mma import kernel_mma as mma

NARROW_MAX_TOKENS = 64  # the largest batch bucket of a decode step
TOKEN_CAPS = (8, 16, 32, 64)  # compiled per cap: accumulators for cap / 8 token fragments
UNROLL = 4  # blocks of 32 values a walk step loads together (the Q8_0 scales: one 8-byte load)
MAX_WARPS = 4 if SIM else 8  # a block's warps (the simulator's emulated mma meets at most four)
TARGET_WARPS = 4 if SIM else 2048  # warps a launch aims for (measured on the H200 at T = 32: see `plan`)
FM = 1  # 16-row fragments a warp holds (two: half the tiles; on the H200 a tie at best, up to 2x slower)
RED_SHAPE = (MAX_WARPS, 4 * FM, WARP)  # [warp, register, lane]: the slices' sums


def token_cap(n_tokens: int) -> int:
    return next(cap for cap in TOKEN_CAPS if n_tokens <= cap)


@cache
def narrow_kernel(qt_narrow: NarrowType, fragments: int, out_bf16: bool):
    """A block: 16 * FM output rows of one group, `fragments` token fragments of 8, its warps the
    slices of K; grid = (tiles of every group,), block = 32 * warps threads."""
    fm, unroll = FM, UNROLL
    fetch, pairs, scales, scaled = qt_narrow.fetch, qt_narrow.pairs, qt_narrow.scales, qt_narrow.scaled
    rows_per_tile = 16 * fm
    acc_shape = (fm, fragments, 4)  # [row fragment, token fragment, register]
    held_shape = (unroll, fm, 2, 4)  # [block, row fragment, row half, word] a walk step's loads
    scales_shape = (unroll, fm, 2)  # [block, row fragment, row half] their scales
    frags_shape = (fm, 2, 4)  # [row fragment, k16 step, register] a block's A fragments
    assert unroll == 4  # the scales' load covers four blocks

    @inlined
    def load_step(w32, held, d, b0, kb, k, row0, last, first, g, t4):
        """A walk step's loads: blocks b0 .. b0 + unroll - 1 of the lane's rows (first + 16 f + 8 h
        + g of the group at row0, clamped to its last), and their scales."""
        for j in range(unroll):
            b = min(b0 + j, kb - 1)  # (past the slice: loaded from a real block, not used)
            for f in range(fm):
                for h in range(2):
                    w0, w1, w2, w3 = fetch(w32, row0 + min(first + f * 16 + h * 8 + g, last), b, t4)
                    held[j, f, h, 0] = w0
                    held[j, f, h, 1] = w1
                    held[j, f, h, 2] = w2
                    held[j, f, h, 3] = w3
        if scaled:
            for f in range(fm):
                for h in range(2):
                    d0, d1, d2, d3 = scales(w32, row0 + min(first + f * 16 + h * 8 + g, last), b0, k)
                    d[0, f, h] = d0
                    d[1, f, h] = d1
                    d[2, f, h] = d2
                    d[3, f, h] = d3

    @jit_kernel((WARP * MAX_WARPS, 1))
    def narrow(x, w, y, n_tokens, group_rows, k, slice_blocks):
        red = cuda.shared.array(RED_SHAPE, float32)
        x32 = x.view(np.uint32)  # [T, K_total / 2] bf16 pairs
        w32 = w.view(np.uint32)
        tid = uint32(cuda.threadIdx.x)
        warps = uint32(cuda.blockDim.x) // WARP
        warp, lane = tid // WARP, tid % WARP
        g, t4 = lane >> 2, lane & 3
        rows = uint32(group_rows)
        kk = uint32(k)
        kb = kk // CHUNK  # blocks of 32 values a row
        tiles = (rows + rows_per_tile - 1) // rows_per_tile  # a group's
        tile = uint32(cuda.blockIdx.x)
        group = tile // tiles
        first = (tile % tiles) * rows_per_tile  # the tile's first row within its group
        x0 = group * (kk // 2)  # the group's first input word
        last_token = uint32(n_tokens) - 1
        b_start = warp * uint32(slice_blocks)
        b_end = min(b_start + uint32(slice_blocks), kb)
        acc = cuda.local.array(acc_shape, float32)
        held = cuda.local.array(held_shape, uint32)
        d = cuda.local.array(scales_shape, float32)
        af = cuda.local.array(frags_shape, uint32)
        part = cuda.local.array(4, float32)  # a block's sums of one fragment pair
        for f in range(fm):
            for nf in range(fragments):
                for i in range(4):
                    acc[f, nf, i] = float32(0)
        for b0 in range(b_start, b_end, unroll):
            load_step(w32, held, d, b0, kb, kk, group * rows, rows - 1, first, g, t4)
            for j in range(unroll):
                if b0 + j < b_end:
                    b = b0 + j
                    for f in range(fm):
                        for s in range(2):
                            lo0, hi0 = pairs(held[j, f, 0, 0], held[j, f, 0, 1], held[j, f, 0, 2], held[j, f, 0, 3], s)
                            lo1, hi1 = pairs(held[j, f, 1, 0], held[j, f, 1, 1], held[j, f, 1, 2], held[j, f, 1, 3], s)
                            af[f, s, 0] = lo0
                            af[f, s, 1] = lo1
                            af[f, s, 2] = hi0
                            af[f, s, 3] = hi1
                    for nf in range(fragments):
                        xt = min(uint32(nf * 8) + g, last_token)  # (past the tokens: a real row, not stored)
                        xa, xb, xc, xd = load_words4(x32, xt, x0 + uint32(16) * b + uint32(4) * t4)
                        for f in range(fm):
                            # the block's two steps: a scaled type's sum from zero, then d times it
                            # into acc; BF16's straight into acc
                            for i in range(4):
                                part[i] = float32(0) if scaled else acc[f, nf, i]
                            p0, p1, p2, p3 = mma(af[f, 0, 0], af[f, 0, 1], af[f, 0, 2], af[f, 0, 3], xa, xb,
                                                 part[0], part[1], part[2], part[3])
                            p0, p1, p2, p3 = mma(af[f, 1, 0], af[f, 1, 1], af[f, 1, 2], af[f, 1, 3], xc, xd,
                                                 p0, p1, p2, p3)
                            part[0], part[1], part[2], part[3] = p0, p1, p2, p3
                            for i in range(4):  # registers 0, 1: row g; 2, 3: row g + 8
                                acc[f, nf, i] = acc[f, nf, i] + part[i] * d[j, f, i // 2] if scaled else part[i]
        # the slices' sums, in warp order, then out: lane (g, t) holds rows g, g + 8 of each
        # fragment and tokens 2 t, 2 t + 1 of each token fragment
        for nf in range(fragments):
            if warps > 1:
                for f in range(fm):
                    for i in range(4):
                        red[warp, f * 4 + i, lane] = acc[f, nf, i]
                cuda.syncthreads()
            if warp == 0:
                for f in range(fm):
                    for i in range(4):
                        v = acc[f, nf, i]
                        for other in range(1, warps):
                            v += red[other, f * 4 + i, lane]
                        t = uint32(nf * 8) + 2 * t4 + i % 2
                        n = first + f * 16 + g + 8 * (i // 2)
                        if t < uint32(n_tokens) and n < rows:
                            if out_bf16:
                                y[t, group * rows + n] = f32_to_bf16(v)
                            else:
                                y[t, group * rows + n] = v
            if warps > 1:
                cuda.syncthreads()

    return narrow


def supports(w, x_dtype, group_rows: int = 0) -> bool:
    """Whether linear_narrow takes this weight, input dtype and grouping (any token count up to
    NARROW_MAX_TOKENS). Never on the simulator, whose emulated mma is far slower than the stream
    kernel (linear_narrow itself still runs there)."""
    return not SIM and _takes(w, x_dtype, group_rows)


def _takes(w, x_dtype, group_rows: int) -> bool:
    return (np.dtype(x_dtype) == np.uint16 and DEVICE_TYPES[w.gtype].narrow is not None
            and w.k % CHUNK == 0 and group_rows % 16 == 0)


def plan(n: int, k: int, groups: int) -> tuple[int, int, int]:
    """(tiles, warps a block, blocks of K a warp's slice) for a product of `groups` groups of n
    rows: warps a power of two up to MAX_WARPS, the fewest that make tiles * warps >= TARGET_WARPS,
    but no more than there are walk steps of K to share (each slice a whole number of them). From
    the shape alone, never from the token count: the order of a sum must not depend on the batch.
    On the H200 (2026-12-02, flash shapes, T = 32) more warps a block lost wherever the tiles
    already filled the GPU (the grouped wo_a: 31 us with four, 39 with eight, 62 with sixteen) and
    won on the short matrices (wq_a, wkv: eight against four, 17 us against 24)."""
    tiles = groups * -(-n // (16 * FM))
    steps = -(-(k // CHUNK) // UNROLL)
    warps = 1
    while warps < MAX_WARPS and tiles * warps < TARGET_WARPS and 2 * warps <= steps:
        warps *= 2
    return tiles, warps, -(-steps // warps) * UNROLL


def linear_narrow(x, w, y, n_tokens: int, group_rows: int = 0, stream=0) -> None:
    """y[:n_tokens] = x[:n_tokens] @ w^T on the tensor cores, n_tokens <= NARROW_MAX_TOKENS (y's
    dtype picks bf16 or fp32 out). group_rows > 0: grouped product, output row n reads
    x[:, (n // group_rows) * K : ... + K]. Raises ValueError for what it does not take."""
    if not _takes(w, x.dtype, group_rows):
        raise ValueError(f"linear_narrow {w.name}: {w.gtype.name} weight [{w.n}, {w.k}] with {x.dtype} inputs "
                         f"in groups of {group_rows} rows is not supported (bf16 inputs; BF16 or Q8_0 weights, "
                         f"K a multiple of {CHUNK}, groups of a multiple of 16 rows)")
    groups, rows = product_groups("linear_narrow", x, w, y, n_tokens, group_rows, NARROW_MAX_TOKENS)
    if n_tokens == 0:
        return
    tiles, warps, slice_blocks = plan(rows, w.k, groups)
    kernel = narrow_kernel(DEVICE_TYPES[w.gtype].narrow, token_cap(n_tokens) // 8, y.dtype == np.uint16)
    kernel[tiles, WARP * warps, stream](x, w.data, y, n_tokens, rows, w.k, slice_blocks)
