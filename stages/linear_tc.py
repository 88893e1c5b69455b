"""Tensor-core linear layers for prefill: y[t, n] = sum_k x[t, k] * dequant(w)[n, k] on bf16
`mma.sync.m16n8k16` with fp32 accumulation.

Shapes and dtypes as stages.linear.linear: x [T, K_total] bf16 bits (uint16; fp32 inputs are
refused), w a stages.linear.DeviceWeight of Q2_K, Q3_K, Q4_K, Q5_K, Q6_K or MXFP4 in its device
layout (stages.quants: Q2_K, Q3_K, Q6_K and MXFP4 rows split, quants first; Q4_K and Q5_K the GGUF
blocks), y [T, N] bf16 bits (rounded to nearest even) or float32. Grouped product
(group_rows > 0): output row n reads x[:, (n // group_rows) * K :][:K]. BF16 and Q8_0 weights are
stages.gemm_wgmma's and stages.gemm_pipe's (stages.linear picks them), and their records have no
tc pieces.

The tensor cores only ever multiply exact values: the inputs are bf16 already, and a quantised
weight enters as an integer, which bf16 holds exactly when it has at most 8 significant bits (every
integer of magnitude <= 256). The fp32 scales, each an exact product of an fp16 or power-of-two
scale and small integers, are applied to fp32 partial sums, a K step's (or half-step's) sums of
x * level from zero, then acc += scale * sums:
- Q2_K: value = d * sc_j * q - dmin * m_j in 16-value group j of a 256-value block: sc * q (<= 45)
  enters, acc += d * (sum of x * (sc * q) over each 32 values), and at a block's end
  acc -= dmin * sum_j m_j * S_j, S_j the sum of group j's 16 inputs (fp32): one more mma a block,
  S_j split exactly into three bf16 pieces (8 + 8 + 8 significant bits) against the integer m_j.
- Q4_K, Q5_K: value = d * sc_j * q - dmin * m_j in 32-value sub-block j (sc, m 6-bit): a K step is
  one sub-block; q (0..15, 0..31) enters, acc += (d * sc_j) * (sum of x * q) with d * sc_j exact in
  fp32 (11 + 6 bits); the mins as Q2_K's, m_j (6 bits) for both 16-value groups of sub-block j.
- Q3_K: value = d * (sc_j - 32) * q in 16-value group j, q in -4..3: q enters and each k16
  half-step's sums are scaled by d * (sc_j - 32) (11 + 6 bits). (sc_j - 32) * q (|.| <= 128) would
  be exact in bf16 as well, but putting it would take three stored words for each word of levels
  (low bits, high bits, scale bytes), one more than a fetch brings.
- Q6_K: value = d * sc_j * (q - 32) in 16-value group j (sc_j int8): q - 32 (-32..31) enters, as
  sc_j * (q - 32), up to 128 * 32, would not be exact; each half-step's sums are scaled by d * sc_j
  (11 + 8 bits).
- MXFP4: value = v * 2^(e - 128), v a doubled E2M1 level (an integer in -12..12), e the exponent
  byte of its 32-value block: v enters and 2^(e - 128) scales the step's sums (exactly: a power of
  two, the subnormal 2^-128 and 2^-127 included; a sum it scales into fp32's subnormals rounds once
  there, as each product would). From MXFP4_INF_E on, where a value can be inf, a block enters as
  its values, d * v as the host's dequantiser has them (two significant bits, or inf: exact in bf16
  as well), under a step scale of 1, so that inf and NaN come out where the oracle's do.

Oracle: host.numerics.linear (bf16 out) / host.numerics.matmul_t (fp32 out), with the rules of
tests/bounds.py (>= 99% of bf16 outputs bit-equal to the oracle's, every output within half a bf16
ulp plus 8 sqrt(n) 2^-24 sum_k |x_k w_k| of the exact product). The result is an fp32 sum of the
exact products x * w in another order: each passes through about K/32 + 34 roundings (a step's
two k16 mma sums, its scaled add, the chain of steps along K; K/16 + 18 for Q3_K and Q6_K, scaled
every half-step). Q2_K, Q4_K and Q5_K sum a weight's two parts apart (d sc q and dmin m), which the
bound counts as 2K terms of those magnitudes. Measured on the H200 at flash shapes: 99.91% and up
of outputs bit-equal for Q2_K; Q3_K-Q6_K and MXFP4 99.967% and up (wq_b, wo_b, the index wq_b and
the grouped wo_a, T = 64; tests/test_linear_tc.py also holds their pieces to the host's dequantiser
bit for bit).

Kernel: a block computes BM tokens x BN outputs in K steps of BK = 32 values; each warp a WM x WN
tile of 16 x 8 mma fragments held in registers. A step's inputs and weights are staged in shared
memory as bf16 pairs (the weights converted on the way in); the next step's global loads are
issued before the current step's mma, into registers. One launch covers every group (grid z).
Launch bounds hold a thread to 128 registers (two blocks of 256 threads an SM; ptxas 13.5 for
sm_90: Q3_K, Q6_K and MXFP4 fit; the types with mins, whose mins' mma holds twelve registers more,
spill: Q2_K 12 to 88 bytes, Q4_K 24 to 28, Q5_K 32 to 36).

On the simulator the mma is emulated (the lanes of a warp meet at each call, the last to come
computing the warp's tile), so the kernel's indexing is tested there, slowly: `supports` says no on
the simulator, for callers that want the fast path.
"""

from __future__ import annotations

from functools import cache

import numpy as np
from numba import cuda, float32, uint32

from flashv41.host.quants import FORMATS
from flashv41.stages.device import (
    CHUNK,
    SIM,
    WARP,
    bf16_to_f32,
    device,
    f32_to_bf16,
    inlined,
    jit_kernel,
    product_groups,
)
from flashv41.stages.quants.records import DeviceType
from flashv41.stages.quants.table import DEVICE_TYPES
from flashv41.stages.quants.units import NO_SCALES, TC_BLOCK_GROUPS, TC_BLOCK_STEPS, TC_STEP_WORDS, pack
from flashv41.stages.warp_mma import kernel_mma as mma

BK = CHUNK  # values of k per step: the table's tensor-core pieces fetch a chunk a step
KW = TC_STEP_WORDS  # 32-bit words (bf16 pairs) per tile row per step
PAD = 4  # shared rows of KW + 4 words: a fragment read (8 rows x 4 words) hits 32 distinct banks
if SIM:  # 4 warps: two along each axis, each 2 x 2 fragments (a Python thread per CUDA thread there)
    WARPS_M, WARPS_N, FM, FN = 2, 2, 2, 2
else:
    WARPS_M, WARPS_N, FM, FN = 2, 4, 2, 4
WM, WN = 16 * FM, 8 * FN  # a warp's tile: FM x FN fragments of 16 tokens x 8 outputs
BM, BN = WARPS_M * WM, WARPS_N * WN  # a block's tile: tokens x outputs
THREADS = WARP * WARPS_M * WARPS_N
A_LOADS = BM * KW // THREADS  # input words each thread loads per step
assert A_LOADS * THREADS == BM * KW and THREADS >= BN and THREADS >= 2 * BM

TILE_A = (BM, KW + PAD)  # [token, word]
TILE_B = (BN, KW + PAD)  # [output, word]
FRAGS = (FM, FN, 4)  # a warp's accumulators: [fragment m, fragment n, register]

@device
def split3(s):
    """s = hi + mid + lo exactly, each a bf16 (fp32 has 24 significant bits, bf16 8): the bits."""
    hi = f32_to_bf16(s)
    r = s - bf16_to_f32(hi)
    mid = f32_to_bf16(r)
    return hi, mid, f32_to_bf16(r - bf16_to_f32(mid))


@inlined
def add_scaled(acc, part, d_s, h, wn, t4):
    """acc += d_s[h, output] * part over a warp's fragments, and part back to zero."""
    for fm in range(FM):
        for fn in range(FN):
            for i in range(4):
                acc[fm, fn, i] += d_s[h, wn + fn * 8 + 2 * t4 + i % 2] * part[fm, fn, i]
                part[fm, fn, i] = float32(0)


@cache
def tc_kernel(qt: DeviceType, out_bf16: bool):
    """Tiles of BM tokens x BN outputs of one group; block = THREADS, grid = (output tiles per group,
    token tiles, groups). The weight type enters through its record's tc pieces (stages.quants)."""
    tc = qt.tc
    assert tc is not None
    fetch, put, fetch_scales, put_scales = tc.fetch, tc.put, tc.fetch_scales, tc.put_scales
    words, mins, halves = tc.words, tc.mins, tc.halves
    # stored weight words each thread loads per step: consecutive ones of one row (a Q2_K thread's
    # are in one group of 16 values, so it reads the group's scale once)
    b_loads = BN * words // THREADS
    assert b_loads * THREADS == BN * words
    scales_shape = (2 if halves else 1, BN)  # [half-step, output]
    mins_shape = (BN, TC_BLOCK_STEPS + PAD) if mins else (1, 1)  # [output, group pair] the mins, bf16 pairs
    sums_shape = (BM, TC_BLOCK_GROUPS + 1) if mins else (1, 1)  # [token, group] the groups' input sums

    @jit_kernel((THREADS, 2))
    def gemm_tc(x, w, y, n_tokens, n_rows, width):
        a_s = cuda.shared.array(TILE_A, uint32)  # [token, word] the step's inputs, bf16 pairs
        b_s = cuda.shared.array(TILE_B, uint32)  # [output, word] the step's weights, bf16 pairs
        d_s = cuda.shared.array(scales_shape, float32)  # [half-step, output] the step's scale (halves: each half's)
        m_s = cuda.shared.array(BN, float32)  # [output] types with mins: the block's dmin
        mins_s = cuda.shared.array(mins_shape, uint32)
        sums_s = cuda.shared.array(sums_shape, float32)
        xw = x.view(np.uint32)  # [T, K_total / 2] bf16 pairs
        w32 = w.view(np.uint32)
        w16 = w.view(np.uint16)
        # indices from unsigned 32-bit values: known non-negative, so Numba's index wraparound and
        # floor-division fixups fold away (fewer instructions and registers)
        tid = uint32(cuda.threadIdx.x)
        group_rows = uint32(n_rows)  # outputs per group
        k = uint32(width)  # inputs per group
        warp, lane = tid // WARP, tid % WARP
        g, t4 = lane >> 2, lane & 3
        wm = (warp // WARPS_N) * WM
        wn = (warp % WARPS_N) * WN
        n0 = uint32(cuda.blockIdx.x) * BN  # within the group
        t0 = uint32(cuda.blockIdx.y) * BM
        row0 = uint32(cuda.blockIdx.z) * group_rows  # the group's first output row
        x0 = uint32(cuda.blockIdx.z) * (k // 2)  # the group's first input word
        acc = cuda.local.array(FRAGS, float32)
        part = cuda.local.array(FRAGS, float32)  # the step's (or half-step's) sums, before their scale
        af = cuda.local.array((FM, 4), uint32)
        bf = cuda.local.array((FN, 2), uint32)
        pa = cuda.local.array(A_LOADS, uint32)  # the next step's global words, in flight
        pb = cuda.local.array(b_loads, uint32)
        pbx = cuda.local.array(b_loads, uint32)
        hi = cuda.local.array(4, uint32)  # Q2_K: an A fragment of group sums, as three bf16 pieces
        mid = cuda.local.array(4, uint32)
        lo = cuda.local.array(4, uint32)
        for fm in range(FM):
            for fn in range(FN):
                for i in range(4):
                    acc[fm, fn, i] = float32(0)
                    part[fm, fn, i] = float32(0)
        n_steps = k // BK
        s0, s1, s2, s3 = NO_SCALES  # the scale words of row n0 + tid (threads tid < BN)
        # Iteration `it` stores step it - 1's words (fetched by the previous iteration) in shared
        # memory, issues step it's global loads, and runs step it - 1's mma while those are in flight.
        for it in range(n_steps + 1):
            step = it - 1
            if it > 0:
                for i in range(A_LOADS):
                    idx = tid + i * THREADS
                    a_s[idx // KW, idx % KW] = pa[i]
                for i in range(b_loads):
                    idx = tid * b_loads + i
                    put(b_s, idx // words, idx % words, pb[i], pbx[i], step)
                if tid < BN:
                    put_scales(d_s, m_s, mins_s, tid, step, s0, s1, s2, s3)
                cuda.syncthreads()
            if it < n_steps:
                for i in range(A_LOADS):
                    idx = tid + i * THREADS
                    t = t0 + idx // KW
                    pa[i] = xw[t, x0 + it * KW + idx % KW] if t < n_tokens else uint32(0)
                for i in range(b_loads):
                    idx = tid * b_loads + i
                    n = n0 + idx // words
                    word, aux = uint32(0), uint32(0)
                    if n < group_rows:
                        word, aux = fetch(w32, w16, row0 + n, it, idx % words, k)
                    pb[i] = word
                    pbx[i] = aux
                if tid < BN:
                    s0, s1, s2, s3 = NO_SCALES
                    if n0 + tid < group_rows:
                        s0, s1, s2, s3 = fetch_scales(w32, w16, row0 + n0 + tid, it, k)
            if it == 0:
                continue
            if mins and tid < 2 * BM:  # the sums of the step's two groups of 16 inputs, every token
                r, h = tid // 2, tid % 2
                s = float32(0)
                for j in range(8):
                    word = a_s[r, 8 * h + j]
                    s += bf16_to_f32(word & 0xFFFF)
                    s += bf16_to_f32(word >> 16)
                sums_s[r, 2 * (step % TC_BLOCK_STEPS) + h] = s
            for kk in range(2):  # two k16 mma steps
                kw = kk * 8 + t4
                for fm in range(FM):
                    r = wm + fm * 16 + g
                    af[fm, 0] = a_s[r, kw]
                    af[fm, 1] = a_s[r + 8, kw]
                    af[fm, 2] = a_s[r, kw + 4]
                    af[fm, 3] = a_s[r + 8, kw + 4]
                for fn in range(FN):
                    c = wn + fn * 8 + g
                    bf[fn, 0] = b_s[c, kw]
                    bf[fn, 1] = b_s[c, kw + 4]
                for fm in range(FM):
                    for fn in range(FN):
                        d0, d1, d2, d3 = mma(af[fm, 0], af[fm, 1], af[fm, 2], af[fm, 3], bf[fn, 0], bf[fn, 1],
                                             part[fm, fn, 0], part[fm, fn, 1], part[fm, fn, 2], part[fm, fn, 3])
                        part[fm, fn, 0] = d0
                        part[fm, fn, 1] = d1
                        part[fm, fn, 2] = d2
                        part[fm, fn, 3] = d3
                if halves:  # this half-step's sums, times its scales, into acc
                    add_scaled(acc, part, d_s, kk, wn, t4)
            if not halves:  # the step's sums, times their scales, into acc
                add_scaled(acc, part, d_s, 0, wn, t4)
            if mins and step % TC_BLOCK_STEPS == TC_BLOCK_STEPS - 1:  # a block's end: minus dmin * sum_j m_j S_j
                cuda.syncthreads()  # every group's sums are in sums_s
                for fm in range(FM):
                    for i in range(4):  # the A fragment of the sums [token, group], in three bf16 pieces
                        r = wm + fm * 16 + g + 8 * (i % 2)
                        c = 2 * t4 + 8 * (i // 2)
                        h0, m0, l0 = split3(sums_s[r, c])
                        h1, m1, l1 = split3(sums_s[r, c + 1])
                        hi[i], mid[i], lo[i] = pack(h0, h1), pack(m0, m1), pack(l0, l1)
                    for fn in range(FN):
                        nf = wn + fn * 8  # the fragment's first output
                        b0, b1 = mins_s[nf + g, t4], mins_s[nf + g, t4 + 4]
                        p0, p1, p2, p3 = mma(hi[0], hi[1], hi[2], hi[3], b0, b1,
                                             float32(0), float32(0), float32(0), float32(0))
                        p0, p1, p2, p3 = mma(mid[0], mid[1], mid[2], mid[3], b0, b1, p0, p1, p2, p3)
                        p0, p1, p2, p3 = mma(lo[0], lo[1], lo[2], lo[3], b0, b1, p0, p1, p2, p3)
                        c = nf + 2 * t4
                        acc[fm, fn, 0] -= m_s[c] * p0
                        acc[fm, fn, 1] -= m_s[c + 1] * p1
                        acc[fm, fn, 2] -= m_s[c] * p2
                        acc[fm, fn, 3] -= m_s[c + 1] * p3
            cuda.syncthreads()
        for fm in range(FM):
            for fn in range(FN):
                for i in range(4):
                    t = t0 + wm + fm * 16 + g + 8 * (i // 2)
                    n = n0 + wn + fn * 8 + 2 * t4 + i % 2
                    if t < n_tokens and n < group_rows:
                        if out_bf16:
                            y[t, row0 + n] = f32_to_bf16(acc[fm, fn, i])
                        else:
                            y[t, row0 + n] = acc[fm, fn, i]

    return gemm_tc


TC_TYPES = ", ".join(gtype.name for gtype, qt in DEVICE_TYPES.items() if qt.tc is not None)


def supports(w, x_dtype) -> bool:
    """Whether linear_tc takes this weight and input dtype. Never on the simulator, where the
    emulated mma is far slower than stages.linear's gemm (linear_tc itself still runs there)."""
    return not SIM and _takes(w, x_dtype)


def _takes(w, x_dtype) -> bool:
    fmt = FORMATS[w.gtype]
    return (np.dtype(x_dtype) == np.uint16 and DEVICE_TYPES[w.gtype].tc is not None
            and w.k % max(BK, fmt.block_values) == 0
            and w.data.shape[1] % 4 == 0)  # device rows of whole 32-bit words (padded ones are)


def linear_tc(x, w, y, n_tokens: int, group_rows: int = 0, stream=0) -> None:
    """y[:n_tokens] = x[:n_tokens] @ w^T on the tensor cores (y's dtype picks bf16 or fp32 out).

    group_rows > 0: grouped product, output row n reads x[:, (n // group_rows) * K : ... + K].
    Raises ValueError for what it does not take (see `supports`; on the simulator it runs anyway).
    """
    if not _takes(w, x.dtype):
        raise ValueError(f"linear_tc {w.name}: {w.gtype.name} weight [{w.n}, {w.k}] with {x.dtype} inputs "
                         f"is not supported (bf16 inputs; {TC_TYPES} weights, K a multiple of their block "
                         f"and of {BK})")
    groups, group_rows = product_groups("linear_tc", x, w, y, n_tokens, group_rows)
    if n_tokens == 0:
        return
    grid = ((group_rows + BN - 1) // BN, (n_tokens + BM - 1) // BM, groups)
    tc_kernel(DEVICE_TYPES[w.gtype], y.dtype == np.uint16)[grid, THREADS, stream](
        x, w.data, y, n_tokens, group_rows, w.k)
