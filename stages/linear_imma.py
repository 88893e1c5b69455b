"""Integer tensor-core decode products: y[t, n] = sum_k x[t, k] * dequant(w)[n, k] for the few
tokens of a decode step (any T, launches of MAX_TOKENS), bf16 x, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K
or MXFP4 weights, on `mma.sync.m16n8k32.s32.s8.s8` with the stored levels as the mma's A operand,
unconverted.

Shapes and dtypes as stages.linear.linear: x [T, K_total] bf16 bits (uint16), w a
stages.linear.DeviceWeight of Q8_0 in its split device layout (per row the K int8 levels, then the
K/32 fp16 scales d), of Q4_K or Q5_K in its stored one (144-byte super-blocks: d, dmin, 12 scale
bytes, 128 level bytes; Q5_K's 176 with 32 fifth-bit bytes before the levels) or of MXFP4 in its
split one (per row the K/32 blocks' 16 code bytes, then their exponent bytes), of Q2_K in its split
one (per row every super-block's 16 scale bytes, then their 64 level bytes, then their d and dmin),
of Q6_K in its split one (per row every super-block's ql, qh and 16 int8 scales, 208 bytes, then
their fp16 d's), of Q3_K in its split one (per row every super-block's hmask and qs, 96 bytes, then
their 12 scale bytes, then their fp16 d's), y [T, N] bf16 bits (rounded to nearest even) or float32.
Grouped product (group_rows > 0, a multiple of 16): output row n reads
x[:, (n // group_rows) * K :][:K].

One mma covers one Q8_0 block (32 levels q, one scale d) of 16 rows: its int32 result is that
block's exact sum of q times the B columns. Lane (g, t) = (lane >> 2, lane & 3) loads bytes
8 t .. 8 t + 7 of the block from rows g and g + 8 (8 bytes each); PTX puts a lane's A registers at
(row g, k 4 t ..), (g + 8, 4 t ..), (g, 16 + 4 t ..), (g + 8, 16 + 4 t ..) and its B registers at
(k 4 t .., column g), (k 16 + 4 t .., column g), so logical k 4 t + i is stored k 8 t + i and
logical 16 + 4 t + i is stored 8 t + 4 + i, for A and B alike (an integer sum in any order is the
same sum).

The inputs become integers. For token t and 32-value block b of x let E be the binary exponent of
the block's largest magnitude (its bf16 exponent field less 127, at least FIELD_MIN - 127) and
X_k = round(x_k * 2^(29 - E)), |X_k| <= 255 * 2^22 < 2^30: exact for every |x_k| >= 2^(E - 22) (a
bf16 value has 8 significant bits), smaller ones rounded to nearest even, off by at most 2^(E - 30).
(2^29, not 2^30: four balanced digits reach 0x7F7F7F7F, short of 255 * 2^23.) X is split into four
balanced base-256 digits D0..D3 in [-128, 127], X = D0 + 2^8 D1 + 2^16 D2 + 2^24 D3, each an int8
column of B: token j's digit p is column 4 j + p, two tokens an mma, more tokens more mmas on the
same A registers, columns of absent tokens zero. S_p = sum_k q_k D_p,k is exact (|S_p| <= 2^19).
Lane (g, t) holds columns 2 t, 2 t + 1: one token's digits p = 2 (t & 1) and p + 1, so it adds them
in int32, P = S_p + 2^8 S_p+1 (exact, |P| < 2^28), converts P to fp32 (one I2FP on sm_90: exact
below 2^24, which P passes rarely: the top pair's when its block's largest inputs meet large levels
of one sign, |S_3| <= 2^18 and typically ~2^13; the low pair's digits are zero for inputs of at least
2^(E - 6), whose bits all sit in digits 2 and 3; else rounded once) and accumulates acc += fp32(P) *
(d * 2^(E - 29)) per (row, token) in one fused multiply-add, the scale an exact product (fp16 d
times a power of two) unless it falls below fp32's normal range. (Converting each S_p exactly
instead costs two more conversions and multiply-adds, less two integer adds, a token pair and
block: 8% more of the walk's instructions for a rounding that rarely happens.) At the end
y = acc_lo + 2^16 acc_hi (digits 0, 1 and 2, 3: a lane pair's sums, exchanged through shared memory).

The weight types' walk steps and pieces, and how each type's values enter the mma, are
stages.imma_walks'; the integer mma and the digits (the prologue's pieces) stages.imma_digits'.

Oracle: host.numerics.linear (bf16 out) / host.numerics.matmul_t (fp32 out), with tests/bounds.py's
rules (>= 99% of bf16 outputs bit-equal to the oracle's, every output within half a bf16 ulp plus
8 sqrt(K) 2^-24 sum_k |x_k w_k| of the exact product).

Exactness. Each block's sum over its 32 values is exact for the X above. Then each output meets
these fp32 roundings: the conversion of P (one a block and digit pair, only where |P| >= 2^24), the
accumulation (one a block and digit pair along the warp's slice, at most SLICE_STEPS_MAX * UNROLL),
the digit pairs' sum (one), the slices' sums (slices - 1, in slice order) and the bf16 rounding. So
each exact term (a block and digit pair's d 2^(E - 29) P) passes through at most K/32 + slices + 1
roundings before the bf16 one, fewer than the K a term may meet under bounds.py's sqrt(K) rule, in
the same model (terms of random sign, rounded to nearest). Q4_K, Q5_K and Q2_K add each value's two
parts apart (tests/bounds.py's SPLIT_KERNELS: 2K terms of magnitudes |x| |d sc q| and |x| |dmin m|):
per sub-block and digit pair a scaled term and a minimum term, each rounded once into acc (Q5_K's
scaled term once more where its P's conversion rounds; Q2_K's terms at most 8 + 2 times in a step,
above), so a term meets at most 2 K/32 + slices + 2 roundings before the bf16 one (Q2_K: at most 2
K/256 + 9 + slices, acc meeting two a step, fewer for K >= 256), under the 2K of that bound. (Q3_K
adds each value as one term, at most K/256 + slices + 9 roundings: stages.imma_q3_k.) The
rounding of X is not of that kind: its error, at most 2^(E - 30) |w_k| for each input below 2^(E -
22) of its block's largest, is bounded by 2^-30 times the block's largest |x| times |w_k|, not by
|x_k w_k|, so bounds.py covers it only while each block's largest input meets a weight of comparable
size; it is not claimed beyond that (on the tests' Gaussian inputs a value 2^-22 below its block's
largest is about one in 10^6; tests/test_linear_imma.py also puts inputs 2^-20 of their block's
largest beside it, and holds the digits to a host reference of X). Blocks whose largest |x| is below
2^(FIELD_MIN - 7) = 2^-97 are scaled as if it were 2^-97 (their inputs rounded to multiples of
2^-127, about as fp32's subnormals would); non-finite inputs are not supported (an inf or NaN makes
its block's sums wrong). Every output's sum depends on its row and token alone, never on T or the
other tokens: the launch (`plan`) comes from the shape.

Launch (`plan`): a block is DIGIT_TILES 16-row tiles of one group (one a warp) over one slice of
K; the tiles' K is split into `slices` slices (each a whole number of walk steps of UNROLL blocks,
at most SLICE_STEPS_MAX: the shared digits' room), about enough for TARGET_WARPS warps in all, so
that every flash decode shape fills the GPU (at least 160 blocks). A lane issues a walk step's
loads (UNROLL blocks of its two rows, their scales) before its mmas. With several slices each
block writes its sums to a workspace and the last of a tile group's blocks to finish (a counter)
adds them in slice order and writes y.

The digits are made in each block's prologue, into shared memory: the block's slice of K for all
its tokens, four lanes a (token, block of 32), for the DIGIT_TILES tiles (warps) that share them;
the first walk step's loads are issued before it, so the weights stream while the digits are made.
Chosen over a separate digits kernel by SASS count (sm_90, ptxas 13.5; probes/imma_sass.py): a
lane's eight inputs cost about 200 instructions (the block's largest exponent read by each of its
four lanes, 8 x (convert, scale, round, bias), a byte transpose, four 8-byte stores), against 101
for a walk step of a tile (4 blocks x 16 rows x 32 bytes: 1.6 instructions a weight byte a thread,
where the stream kernel's Q8_0 walk takes 4.8). At T = 1 the prologue is 3-5% of a block's issued
instructions on wq_b, wo_a, wo_b and the engram wkv, 11% on wq_a and the index wq_b (slices of two
steps), 20% on wkv (of one); T = 2: 6-8%, 19%, 31%; T = 8: 7-8%, 23%, 38%. A separate kernel would
cost a launch and a dependency in the step's graph (a microsecond or two against these products'
5-50 us) and a round trip of the digits through L2; a launch's x and every scale come from device
memory either way (decode steps are replayed as graphs).

On the simulator the mma is emulated exactly (stages.warp_mma's warp meeting with an integer
tile), blocks have at most four warps and slices are short, so the tests reach every path; NumPy
rounds the accumulation's product apart from its sum there (one rounding more a term).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from functools import cache

import numpy as np
from numba import cuda, float32, int32, uint32, uint64

from flashv41.host.quants import GGMLType
from flashv41.stages.device import CHUNK, WARP, f32_to_bf16, jit_kernel, product_groups, row_address
from flashv41.stages.imma_digits import (
    COLUMN_WORDS,
    DIGIT_PAIR,
    DIGIT_TILES,
    SLICE_BLOCKS_MAX,
    TARGET_WARPS,
    UNROLL,
    e2m1_octet_digits,
    load_l2,
    octet_digits,
    pair_sum,
    zero_digits,
)
from flashv41.stages.imma_walks import K_STEP, walk_steps

MAX_TOKENS = 8  # tokens a launch: stages.linear's GEMV_MAX_TOKENS (which imports this module)
TOKEN_CAPS = (1, 2, 4, 8)  # compiled per cap: cap / 2 mmas (token pairs) per A fragment
RED_SHAPE = (DIGIT_TILES, 2, WARP)  # [warp, row half, lane] a token pair's sums, for the digit pairs' sum
LINE = 32  # floats of a 128-byte line: each block's rows of the partial sums start one (no line shared)


@dataclass(frozen=True)
class ImmaType:
    """What the generic kernel needs to know of a weight type: the blocks of 32 values a walk step
    takes (its loads issued together; a super-block's make a slice whole super-blocks), and whether
    its values' minimum term takes each block's sums of digits (then made by a second prologue
    pass; Q2_K's takes an mma instead)."""

    step_blocks: int
    sums: bool


IMMA_TYPES = {GGMLType.Q8_0: ImmaType(UNROLL, False), GGMLType.Q4_K: ImmaType(K_STEP, True),
              GGMLType.Q5_K: ImmaType(K_STEP, True), GGMLType.MXFP4: ImmaType(UNROLL, False),
              GGMLType.Q2_K: ImmaType(K_STEP, False), GGMLType.Q6_K: ImmaType(K_STEP, False),
              GGMLType.Q3_K: ImmaType(K_STEP, False)}


def token_cap(n_tokens: int) -> int:
    """The smallest compiled token cap that holds n_tokens (<= MAX_TOKENS)."""
    return next(cap for cap in TOKEN_CAPS if n_tokens <= cap)


@cache
def imma_kernel(gtype: GGMLType, cap: int, out_bf16: bool):
    """A block: DIGIT_TILES tiles of 16 rows of one group (a warp each) over one slice of K, for up
    to `cap` tokens, weights of type gtype (IMMA_TYPES); grid = (tile groups x slices,), block =
    32 x warps threads."""
    kind = IMMA_TYPES[gtype]
    step_blocks, block_sums = kind.step_blocks, kind.sums
    pairs = max(cap, 2) // 2  # mmas a block of A meets: two tokens each
    # flat shared arrays, indexed by uint64 offsets from a lane's base (constant offsets fold into the loads)
    digits_shape = 8 * pairs * COLUMN_WORDS  # [column 4 token + digit][8 values] int8 digits, eight a word
    mx = gtype == GGMLType.MXFP4
    # [token][block] 2^(E - X_BITS); MXFP4: [token][digit pair][block] 2^(E - X_BITS + 16 pair)
    scales_shape = (4 if mx else 2) * pairs * SLICE_BLOCKS_MAX
    pair_weight = float32(1) if mx else DIGIT_PAIR  # the top digit pair's sums' weight in y
    # [token][digit pair][block] 2^(E - X_BITS) times the block's sum of the pair's D_p + 2^8 D_p+1
    sums_shape = 4 * pairs * SLICE_BLOCKS_MAX if block_sums else 1
    acc_shape = (pairs, 2)  # [token pair, row half]
    fifth = gtype == GGMLType.Q5_K
    # [block (Q4_K, Q5_K, Q2_K: run of level bytes; Q5_K's fifth bits after them), row half, word] a
    # walk step's levels; Q6_K: four runs of ql, two of qh; Q3_K: hmask, two runs of qs
    held_shape = ({GGMLType.Q6_K: 6, GGMLType.Q3_K: 3}.get(gtype, UNROLL + fifth), 2, 2)
    # Q8_0: [block, row half] the step's scales; Q4_K: [row half, word] its super-block's first 16
    # bytes; Q3_K: [row half, word] its three words of scale bytes, then the word of its d; MXFP4:
    # [row half, 0] the word of the step's exponent bytes
    d_shape, d_type = ((UNROLL, 2), float32) if gtype == GGMLType.Q8_0 else ((2, 4), uint32)
    if gtype in (GGMLType.Q2_K, GGMLType.Q6_K):  # [row half, word] its 16 scale bytes, then its d (and dmin)
        d_shape = (2, 5)
    sum_items = 4 * pairs * SLICE_BLOCKS_MAX  # (token, digit pair, block) items of the sums
    walk_load, walk_tail, walk_block, walk_mmas, mxfp4_inf_blocks = walk_steps(gtype, pairs)
    partial_steps = step_blocks == UNROLL  # (a K-quant's slice is whole super-blocks)
    digits_of = e2m1_octet_digits if gtype == GGMLType.MXFP4 else octet_digits

    @jit_kernel((WARP * DIGIT_TILES, 1))
    def imma_gemv(x, w, y, partials, counters, n_tokens, group_rows, k, per_group, slices, slice_blocks):
        digits = cuda.shared.array(digits_shape, uint64)
        scales = cuda.shared.array(scales_shape, float32)
        sums = cuda.shared.array(sums_shape, float32)
        red = cuda.shared.array(RED_SHAPE, float32)
        last_flag = cuda.shared.array(1, int32)
        x32 = x.view(np.uint32)  # [T, K_total / 2] bf16 pairs
        w32 = w.view(np.uint32)
        tid = uint32(cuda.threadIdx.x)
        threads = uint32(cuda.blockDim.x)
        warps = uint32(threads // uint32(WARP))
        warp, lane = uint32(tid // uint32(WARP)), uint32(tid % uint32(WARP))
        g, t4 = uint32(lane >> uint32(2)), uint32(lane & uint32(3))
        rows = uint32(group_rows)
        kk = uint32(k)
        kb = uint32(kk // uint32(CHUNK))
        block = uint32(cuda.blockIdx.x)
        n_slices = uint32(slices)
        tile_group = uint32(block // n_slices)  # a group's blocks side by side: its slices finish together
        slice_ = uint32(block % n_slices)
        group = uint32(tile_group // uint32(per_group))
        tile0 = uint32((tile_group % uint32(per_group)) * warps)  # the block's first tile within its group
        first = uint32((tile0 + warp) * uint32(16))  # the warp's first row within its group
        b_start = uint32(slice_ * uint32(slice_blocks))
        b_end = uint32(min(b_start + uint32(slice_blocks), kb))
        nb = uint32(b_end - b_start)
        row0 = uint32(group * rows)
        last_row = uint32(rows - uint32(1))
        lo = row_address(w32, row0 + min(first + g, last_row))  # (past the group: a real row, not stored)
        hi = row_address(w32, row0 + min(first + g + uint32(8), last_row))
        acc = cuda.local.array(acc_shape, float32)
        held = cuda.local.array(held_shape, uint32)
        d = cuda.local.array(d_shape, d_type)
        for p in range(pairs):
            acc[p, 0] = float32(0)
            acc[p, 1] = float32(0)
        # the first step's loads, in flight while the digits are made
        if not partial_steps or b_start + uint32(step_blocks) <= b_end:
            walk_load(lo, hi, kk, b_start, held, d, t4)
        else:
            walk_tail(lo, hi, kk, b_start, uint32(b_end - uint32(1)), held, d, t4)
        half = uint32(CHUNK // 2)  # input words a block
        x_word = uint32(group * (kk >> uint32(1)) + b_start * half)  # the slice's first input word
        live = uint32(n_tokens)
        # the digits: four lanes a (token, block) item, eight inputs each
        for item in range(tid, uint32(2 * pairs * SLICE_BLOCKS_MAX * 4), threads):
            q = uint32(uint32(item) & uint32(3))
            ts = uint32(uint32(item) >> uint32(2))  # token * SLICE_BLOCKS_MAX + slot
            t = uint32(ts // uint32(SLICE_BLOCKS_MAX))  # (a constant divisor: no division)
            slot = uint32(ts % uint32(SLICE_BLOCKS_MAX))
            at = uint64(t) * uint64(4 * COLUMN_WORDS) + uint64(4) * uint64(slot) + uint64(q)
            # the block's scale back (MXFP4: the low digit pair's; the top pair's a row of blocks on)
            s_at = uint64(ts) + (uint64(t) * uint64(SLICE_BLOCKS_MAX) if mx else uint64(0))
            if slot < nb:
                if t < live:
                    digits_of(x32, t, uint32(x_word + slot * half), q, digits, at, scales, s_at)
                else:
                    zero_digits(digits, at, scales, s_at, q)
                    if mx and q == 1:
                        scales[s_at + uint64(SLICE_BLOCKS_MAX)] = float32(0)
        cuda.syncthreads()
        if block_sums:  # each block's inputs' sum, a digit pair at a time, scaled (exact: module docstring)
            for item in range(tid, uint32(sum_items), threads):
                slot = uint32(uint32(item) % uint32(SLICE_BLOCKS_MAX))
                th = uint32(uint32(item) // uint32(SLICE_BLOCKS_MAX))  # 2 token + digit pair
                if slot < nb:
                    t = uint32(th >> uint32(1))
                    at = uint64(uint32(2) * th) * uint64(COLUMN_WORDS) + uint64(4) * uint64(slot)
                    sums[item] = float32(pair_sum(digits, at)) * scales[uint64(t) * uint64(SLICE_BLOCKS_MAX) + slot]
            cuda.syncthreads()
        lane_dig = uint64(g) * uint64(COLUMN_WORDS) + uint64(t4)  # B column g, the lane's 8 bytes of block 0
        # its D columns' token's block 0 scale (MXFP4: that of its digit pair)
        lane_sc = uint64(t4 if mx else t4 >> uint32(1)) * uint64(SLICE_BLOCKS_MAX)
        lane_sm = uint64(t4) * uint64(SLICE_BLOCKS_MAX)  # and its digit pair's block 0 sum
        b0 = b_start
        while b0 + uint32(step_blocks) <= b_end:
            if b0 != b_start:
                walk_load(lo, hi, kk, b0, held, d, t4)
            step = uint64(b0 - b_start)
            ctx = (x32, uint32(x_word + uint32(step) * half), lo, hi, b0, live, t4)  # (MXFP4's inf blocks)
            walk_mmas(digits, scales, sums, held, d, acc, lane_dig + uint64(4) * step, lane_sc + step, lane_sm + step,
                      ctx)
            b0 = uint32(b0 + uint32(step_blocks))
        if partial_steps and b0 < b_end:
            if b0 != b_start:
                walk_tail(lo, hi, kk, b0, uint32(b_end - uint32(1)), held, d, t4)
            step = uint64(b0 - b_start)
            ctx = (x32, uint32(x_word + uint32(step) * half), lo, hi, b0, live, t4)
            for j in range(UNROLL):
                if b0 + uint32(j) < b_end:
                    walk_block(digits, scales, held, d, acc, j, lane_dig + uint64(4) * step, lane_sc + step, ctx)
            if mx:
                mxfp4_inf_blocks(d, acc, uint32(b_end - b0), ctx)
        # out: lane (g, t) holds rows g, g + 8 and token 2 p + t // 2's digits 2 (t % 2), + 1; a lane
        # of the pair's sum takes row i = lane % 16 and token 2 p + lane // 16
        i = uint32(lane % uint32(16))
        h = uint32(i >> uint32(3))
        src = uint32(uint32(4) * (i % uint32(8)) + uint32(2) * (lane >> uint32(4)))
        n = uint32(first + i)
        # the floats a block's rows take in each partial row (Plan.region), and this lane's output's
        region = uint32((warps * uint32(16) + uint32(LINE - 1)) // uint32(LINE) * uint32(LINE))
        at = uint32(tile_group * region + warp * uint32(16) + i)
        for p in range(pairs):
            red[warp, 0, lane] = acc[p, 0]
            red[warp, 1, lane] = acc[p, 1]
            cuda.syncthreads()
            v = red[warp, h, src] + pair_weight * red[warp, h, src + uint32(1)]
            t = uint32(uint32(2 * p) + (lane >> uint32(4)))
            if t < live:
                if n_slices == 1:
                    if n < rows:
                        if out_bf16:
                            y[t, row0 + n] = f32_to_bf16(v)
                        else:
                            y[t, row0 + n] = v
                else:
                    partials[slice_, t, at] = v
            cuda.syncthreads()
        if n_slices == 1:
            return
        # the last of the tile group's blocks adds the slices' sums in slice order, read from L2
        cuda.threadfence()
        cuda.syncthreads()
        if tid == 0:
            last_flag[0] = int32(cuda.atomic.add(counters, tile_group, 1) == slices - 1)
            cuda.threadfence()
        cuda.syncthreads()
        if last_flag[0]:
            span = uint32(warps * uint32(16))
            for out in range(tid, span * uint32(cap), threads):
                t = uint32(uint32(out) // span)
                r = uint32(uint32(out) % span)
                n = uint32(tile0 * uint32(16) + r)
                at = uint32(tile_group * region + r)
                if t < live and n < rows:
                    total = load_l2(partials, 0, t, at)
                    for s in range(1, slices):
                        total += load_l2(partials, s, t, at)
                    if out_bf16:
                        y[t, row0 + n] = f32_to_bf16(total)
                    else:
                        y[t, row0 + n] = total
            if tid == 0:
                counters[tile_group] = 0  # ready for the next launch (a replayed graph's)

    return imma_gemv


@dataclass(frozen=True)
class Plan:
    """How a product of `groups` groups of `rows` outputs and K inputs is launched (`plan`)."""

    warps: int  # tiles of 16 rows a block, one a warp: they share the block's digits
    per_group: int  # blocks a group's tiles take
    slices: int  # slices of K a tile's sums are split over, added in slice order
    slice_blocks: int  # blocks of 32 values a slice (a whole number of walk steps)
    tile_groups: int  # blocks a slice: groups * per_group

    @property
    def region(self) -> int:
        """Floats a block's rows take in each partial row (whole 128-byte lines)."""
        return -(-self.warps * 16 // LINE) * LINE


def plan(rows: int, k: int, groups: int, step_blocks: int = UNROLL) -> Plan:
    """The launch of a product, from its shape alone (never the token count: a token's sums must not
    depend on its batch): DIGIT_TILES tiles a block (fewer in a group of fewer), and K split into the
    fewest slices, at most SLICE_BLOCKS_MAX blocks of 32 each, that give TARGET_WARPS warps (or one
    walk step of step_blocks blocks each), then rounded to slices of whole steps (which keeps at least
    half the warps). On the flash shapes with Q8_0's steps of four blocks (slices x steps each, blocks,
    warps): wq_a 20 x 2, 200, 1600; wkv 40 x 1, 160, 1280; wq_b 1 x 10, 256, 2048; wo_a 4 x 8, 256,
    2048; wo_b 7 x 10, 280, 2240; the index wq_b 5 x 2, 160, 1280; the engram wkv 5 x 10, 1000, 8000:
    at least 160 blocks of 8 warps for 132 SMs. Q4_K's steps (a super-block) halve the slices of wq_a
    (10 x 2), wkv (20 x 1) and the index wq_b (5 x 1): 100, 80 and 160 blocks."""
    tiles = -(-rows // 16)
    warps = min(DIGIT_TILES, tiles)
    per_group = -(-tiles // warps)
    steps = -(-(k // CHUNK) // step_blocks)
    steps_max = SLICE_BLOCKS_MAX // step_blocks
    slices = -(-steps // steps_max)
    while slices < steps and groups * per_group * slices * warps < TARGET_WARPS:
        slices += 1
    per_slice = -(-steps // slices)
    return Plan(warps, per_group, -(-steps // per_slice), per_slice * step_blocks, groups * per_group)


@dataclass
class Workspace:
    """A product's partial sums (float32 [slices, MAX_TOKENS, tile_groups * region]) and its tile
    groups' counters of finished slices (int32 [tile_groups], zero between launches)."""

    partials: object
    counters: object


_WORKSPACES: dict[tuple[int, Plan] | None, Workspace] = {}  # by (id of the DeviceWeight, plan), dropped with it


def workspace(w, p: Plan) -> Workspace:
    """The workspace of weight w's product under plan p (allocated at its first launch, which must
    therefore come before a graph capture, as its compilation does; products of one slice share a
    dummy that they never touch)."""
    key = (id(w), p) if p.slices > 1 else None
    ws = _WORKSPACES.get(key)
    if ws is None:
        shape = (p.slices, MAX_TOKENS, p.tile_groups * p.region) if key else (1, 1, 1)
        ws = Workspace(cuda.device_array(shape, np.float32),
                       cuda.to_device(np.zeros(p.tile_groups if key else 1, np.int32)))
        _WORKSPACES[key] = ws
        if key:
            weakref.finalize(w, _WORKSPACES.pop, key, None)
    return ws


DECODE_MIN_VALUES = 1 << 24  # the weights (N x K values) imma is picked for: none of 6.5M or less won
# The weight types imma is picked for at up to MAX_TOKENS tokens, each with the least N / K (the
# weight's aspect) it is picked for (measured on an H100, 2026-12-07, docs/performance-log.md, us at
# T = 1 / T = 8, stream -> imma):
# - Q4_K, Q5_K: every product of 16M values or more (wq_b 24.3 -> 15.1 / 110 -> 23; wo_a 22.7 ->
#   15.3 / 85 -> 24; wo_b 24.0 -> 21.5 / 103 -> 34; the engram wkv 69 -> 52 / 381 -> 85; Q5_K alike);
# - Q2_K, MXFP4, Q3_K: those with N >= K (wq_b, wo_a, the engram wkv: at T = 1 1.06-1.36x faster or
#   within 3%, at T = 8 2.3-3.9x; MXFP4's engram wkv was timed at T = 8 only, 250 -> 101 us); on the
#   wide wo_b (K = 8192) imma lost 21-23% at T = 1. Q3_K (H100, later the same day): wq_b 19.3 ->
#   15.2 / 63.9 -> 21.7, wo_a 16.0 -> 15.2 / 56.6 -> 22.6, the engram wkv 50.0 -> 50.0 / 223 -> 78;
#   on wo_b imma lost 25% at T = 1 (17.0 -> 21.2) and won 2x at T = 8 (64.5 -> 31.8);
# - Q8_0, Q6_K: those with N >= 8 K, the tall wq_b (N / K = 25.6): Q8_0 22.2 -> 21.7 / 50.8 -> 26.3,
#   Q6_K 21.1 -> 20.1 / 64.8 -> 36.4. Their stream units are short already: at T = 1 imma lost 7-25%
#   on wo_a, wo_b and the engram wkv (N / K 4.2 and less), though it won 33-48% there at T = 8. One
#   kernel serves every count up to MAX_TOKENS (a batch's bits are each step's), and decode is mostly
#   one token a step, so T = 1 decides.
# Below 16M values (wq_a, wkv, the index wq_b) the digits' prologue costs imma 2-60% at T = 1 (one
# exception, within the noise: Q3_K's wq_a, 9.5 -> 9.2 us).
DECODE_PICKS = {GGMLType.Q4_K: 0, GGMLType.Q5_K: 0, GGMLType.Q2_K: 1, GGMLType.MXFP4: 1, GGMLType.Q8_0: 8,
                GGMLType.Q6_K: 8, GGMLType.Q3_K: 1}


def decode_pick(gtype: GGMLType, n: int, k: int) -> bool:
    """Whether stages.linear picks imma for a decode product (up to MAX_TOKENS tokens) of an [n, k]
    weight of type gtype (bf16 inputs, on a GPU, where `takes` holds): DECODE_PICKS' rule."""
    aspect = DECODE_PICKS.get(gtype)
    return aspect is not None and n * k >= DECODE_MIN_VALUES and n >= aspect * k


def takes(w, x_dtype, group_rows: int = 0) -> bool:
    """Whether linear_imma takes this weight, input dtype and grouping."""
    kind = IMMA_TYPES.get(w.gtype)
    values = CHUNK * (kind.step_blocks if kind and kind.step_blocks == K_STEP else 1)  # a K-quant's: whole super-blocks
    return kind is not None and np.dtype(x_dtype) == np.uint16 and w.k % values == 0 and group_rows % 16 == 0


def linear_imma(x, w, y, n_tokens: int, group_rows: int = 0, stream=0) -> None:
    """y[:n_tokens] = x[:n_tokens] @ w^T on the integer tensor cores, in launches of MAX_TOKENS
    tokens (y's dtype picks bf16 or fp32 out). group_rows > 0: grouped product, output row n reads
    x[:, (n // group_rows) * K : ... + K]. Raises ValueError for what it does not take."""
    if not takes(w, x.dtype, group_rows):
        blocks = ", ".join(t.name for t, kind in IMMA_TYPES.items() if kind.step_blocks != K_STEP)
        supers = ", ".join(t.name for t, kind in IMMA_TYPES.items() if kind.step_blocks == K_STEP)
        raise ValueError(f"linear_imma {w.name}: {w.gtype.name} weight [{w.n}, {w.k}] with {x.dtype} inputs in "
                         f"groups of {group_rows} rows is not supported (bf16 inputs; {blocks} weights with K a "
                         f"multiple of {CHUNK}, or {supers} of {K_STEP * CHUNK}; groups of a multiple of 16 rows)")
    groups, rows = product_groups("linear_imma", x, w, y, n_tokens, group_rows)
    if n_tokens == 0:
        return
    p = plan(rows, w.k, groups, IMMA_TYPES[w.gtype].step_blocks)
    ws = workspace(w, p)
    for t0 in range(0, n_tokens, MAX_TOKENS):
        live = min(MAX_TOKENS, n_tokens - t0)
        xt, yt = (x, y) if t0 == 0 else (x[t0:], y[t0:])
        imma_kernel(w.gtype, token_cap(live), y.dtype == np.uint16)[p.tile_groups * p.slices, WARP * p.warps, stream](
            xt, w.data, yt, ws.partials, ws.counters, live, rows, w.k, p.per_group, p.slices, p.slice_blocks)
