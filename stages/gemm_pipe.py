"""Pipelined tensor-core prefill GEMM: y[t, n] = sum_k x[t, k] * dequant(w)[n, k] on bf16
`mma.sync.m16n8k16` with fp32 accumulation, the tiles streamed into shared memory by `cp.async`
several K steps ahead and read into fragments with `ldmatrix`.

Shapes and dtypes as stages.linear.linear: x [T, K_total] bf16 bits (uint16), w a
stages.linear.DeviceWeight of BF16 ([N, K] bf16) or Q8_0 (split device layout: per row the K int8
levels, then the K/32 fp16 scales d, padded to whole 16-byte pieces), y [T, N] bf16 bits or float32.
Grouped product (group_rows > 0): output row n reads x[:, (n // group_rows) * K :][:K]. Meant for
prefill: stages.linear picks it past NARROW_MAX_TOKENS tokens on a GPU (`supports`) for Q8_0, and
for BF16 where stages.gemm_wgmma is not (a GPU other than compute capability 9.0: on an H100 wgmma
took BF16's products in 0.63-0.90x pipe's time). It took BF16 and Q8_0 products at 2.1-6.1x
cuBLAS's time against stages.linear_tc's 8.9-12.6x on them (H100, 4096 tokens), so linear_tc takes
neither type.

Oracle: host.numerics.linear (bf16 out) / host.numerics.matmul_t (fp32 out), with tests/bounds.py's
rules (>= 99% of bf16 outputs bit-equal to the oracle's, every output within half a bf16 ulp plus
8 sqrt(K) 2^-24 sum_k |x_k w_k| of the exact product).

Roundings per output. Every product the tensor cores form is exact (bf16 times bf16, or bf16 times
an integer level |q| <= 128, which bf16 holds exactly).
- BF16: one fp32 chain along the whole K, two k16 mma a K step of 32 into the accumulator: a term
  passes through the mma's sum of its 16 products and about K/16 additions into C (about K/16 + 16
  roundings), then the output's.
- Q8_0: per 32-value block b, part = the block's two k16 mma sums from zero, then
  acc = fma(d_b, part, acc) (d_b an fp16, exact in fp32; the product and the add round once): about
  K/32 + 34 roundings, then the output's. (The simulator's fma rounds the product apart.)
- Output: bf16 by `cvt.rn.bf16x2.f32`, to nearest, ties to even (stages.device.f32_to_bf16's
  rounding for every value but NaN, which stays a NaN of the instruction's bits;
  tests/test_gemm_pipe.py holds it to the host's rounding on a GPU); fp32 as summed.
Both counts are well inside the K roundings the sqrt(K) rule allows.

Kernel. A block computes BM = 128 tokens x BN = 128 outputs of one group (grid z) in K steps of
BK = 32 values; 8 warps, 2 along tokens and 4 along outputs, each a 64 x 32 tile of 4 x 4 fragments
of 16 x 8 held in registers (64 fp32 a thread). STAGES = 3 shared stages form a ring: the block
issues step s + 2's 16-byte `cp.async.cg` copies (zero-filled past T and past the group's rows) while
it multiplies step s, one commit group an iteration, `cp.async.wait_group 1` and one barrier before
each step. Tile rows are 64 bytes (32 bf16) with their four 16-byte chunks swizzled (chunk c of row r
at c ^ ((r >> 1) & 3)), so the 8 row addresses of an ldmatrix matrix, and the copies' stores, fall on
distinct banks without padding: three stages of BF16 tiles fill the 48 KiB of static shared memory a
block may have without the driver's maximum-dynamic-shared-memory attribute (which
stages.device.allow_dynamic_shared now sets for stages.sparse_fused; deeper rings of this kernel in
dynamic shared memory have not been tried). A warp
reads a K step's fragments with 12 `ldmatrix.x4` (8 for A: 16 tokens x 16 k each; 4 for B: two
fragments of 8 outputs x 16 k each) for its 32 mma. The lanes' ldmatrix offsets and the copies'
addresses are computed once, before the K loop (`pinned`).

Q8_0: the stages hold the stored bytes: the levels (32 bytes a row a step, one 16-byte copy a thread)
and the 4-byte word of fp16 scales that holds the step's (`cp.async.ca` of 4 bytes: .cg copies only
16). After the step's barrier the block converts the step's levels once into a bf16 tile (a thread
16 levels: one 16-byte shared load, one XOR for the four bytes' bias, a byte permute per level into
the fp32 pattern of 2^23 + 128 + q and one subtract giving q exactly, a permute packing two as bf16,
two 16-byte stores) and the 128 scales into fp32; a second barrier, then the warps read B with
ldmatrix as for BF16. Chosen over converting in each warp's B fragments by instruction count: there a
lane would convert 32 levels a step instead of 16 (the two warps along tokens converting the same
ones) and gather them with 8 16-byte shared loads (int8 rows do not fit ldmatrix's b16 layout),
about 104 instructions a thread a step against about 51 here, for one barrier more.

SASS (ptxas 13 for sm_90, launch bounds 256 threads x 2 blocks an SM): BF16 121 registers, no
spills, 49152 bytes of shared memory; its K loop 104 instructions a warp a step: 32 HMMA, 12 LDSM,
4 LDGSTS, 1 BAR, 1 DEPBAR, 54 others (address and loop arithmetic). Q8_0 128 registers, no spills,
47104 bytes; its loop 294: 32 HMMA, 12 LDSM, 4 LDGSTS, the conversion (24 PRMT, 16 FADD, 1 LDS.128,
2 STS.128), 64 FFMA for the scales, 2 BAR. Two blocks (16 warps) an SM: the registers' limit.

The copies, ldmatrix and the other shared-memory instructions are stages.smem's. On the simulator
they and the mma are emulated (stages.smem, stages.warp_mma); blocks have 4 warps of 32 x 32 tiles
(a Python thread per CUDA thread there), whose loops over fragments and copies run more than once,
as on a GPU.
"""

from __future__ import annotations

from functools import cache

import numpy as np
from numba import cuda, float32, uint32, uint64

from flashv41.host.quants import GGMLType
from flashv41.stages.device import (
    CHUNK,
    SIM,
    WARP,
    byte_perm,
    f16x2_f32,
    f32_bits,
    f32_from_bits,
    jit_kernel,
    product_groups,
)
from flashv41.stages.smem import (
    ALIGN,
    WORD_UNITS,
    cp_async4,
    cp_async16,
    cp_async_commit,
    cp_async_wait_one,
    ldmatrix_x4,
    lds4,
    pinned,
    pinned64,
    store_pair,
    sts4,
    word_address,
)
from flashv41.stages.warp_mma import kernel_mma as mma

BK = CHUNK  # values of k per step: one Q8_0 block
KW = BK // 2  # 32-bit words (bf16 pairs) of a bf16 tile row per step: 64 bytes
CHUNKS = KW // 4  # its 16-byte chunks (one cp.async, one ldmatrix row each)
QW = BK // 4  # words of int8 levels of a Q8_0 tile row per step: 32 bytes, two chunks
STAGES = 3  # cp_async_wait_one: the ring keeps STAGES - 2 = 1 copy group in flight
if SIM:  # four warps (the meeting's), each 2 x 4 fragments: two copies a thread a step, as on a GPU
    WARPS_M, WARPS_N, FM, FN = 2, 2, 2, 4
else:
    WARPS_M, WARPS_N, FM, FN = 2, 4, 4, 4
assert FN % 2 == 0  # an ldmatrix.x4 of B gives two fragments along the outputs
WM, WN = 16 * FM, 8 * FN  # a warp's tile: FM x FN fragments of 16 tokens x 8 outputs
BM, BN = WARPS_M * WM, WARPS_N * WN  # a block's tile: tokens x outputs
THREADS = WARP * WARPS_M * WARPS_N
A_COPIES = BM * CHUNKS // THREADS  # a thread's 16-byte copies of inputs a step
B_COPIES = BN * CHUNKS // THREADS  # of BF16 weights
assert A_COPIES * THREADS == BM * CHUNKS and B_COPIES * THREADS == BN * CHUNKS
assert THREADS >= 2 * BN  # Q8_0: a thread copies and converts each half row of levels
LEVEL_BIAS = uint32(0x80808080)  # q + 128 in each byte of a word of levels
MAGIC = uint32(0x4B000000)  # the fp32 pattern of 2^23: its low mantissa bits take an integer below 2^23
MAGIC_LEVEL = float32(8388736.0)  # 2^23 + 128: a biased level's fp32 pattern less this is q
SCALE_BYTES = 4  # of the fp16 scales a Q8_0 step copies: its own and its neighbour's (a word)
A_STAGE = BM * KW  # words of a stage's tiles: inputs, BF16 weights, Q8_0 levels
B_STAGE = BN * KW
Q_STAGE = BN * QW
FRAG_WORDS = 16 * KW  # from one ldmatrix.x4's rows to the next fragment's: 16 rows
HALF_WORDS = 8  # from a k16 half's chunks to the other's: chunks 0, 1 and 2, 3, swizzled alike
FRAGS = (FM, FN, 4)  # a warp's accumulators: [fragment m, fragment n, register]
TYPES = (GGMLType.BF16, GGMLType.Q8_0)



def swizzled(r, c):
    """The word where chunk c (0 .. CHUNKS - 1) of shared tile row r starts: the chunk index XOR
    bits 1-2 of the row, so 8 consecutive rows at one chunk (an ldmatrix matrix) fill all 32 banks."""
    return (c ^ ((r >> 1) & 3)) * 4


def level_pair(u, lo, hi):
    """bf16 pair word of the levels in bytes lo and hi of u (biased levels q + 128): q exactly."""
    f0 = f32_from_bits(byte_perm(u, MAGIC, uint32(0x7440 | lo))) - MAGIC_LEVEL
    f1 = f32_from_bits(byte_perm(u, MAGIC, uint32(0x7440 | hi))) - MAGIC_LEVEL
    return byte_perm(f32_bits(f0), f32_bits(f1), uint32(0x7632))


if not SIM:
    swizzled = cuda.jit(device=True, inline="always")(swizzled)
    level_pair = cuda.jit(device=True, inline="always")(level_pair)


@cache
def pipe_kernel(quant: bool, out_bf16: bool):
    """Tiles of BM tokens x BN outputs of one group; block = THREADS, grid = (output tiles per group,
    token tiles, groups). quant: Q8_0 weights, else BF16."""
    b_shape = (1, 4) if quant else (STAGES, B_STAGE)  # [stage, output x word] BF16 weights, swizzled rows
    q_shape = (STAGES, Q_STAGE) if quant else (1, 4)  # [stage, output x word] Q8_0 levels, stored order
    e_shape = (STAGES, BN) if quant else (1, 1)  # [stage, output] the word holding the step's fp16 scale
    t_shape = B_STAGE if quant else 4  # [output x word] the step's levels as bf16 pairs, swizzled rows
    d_shape = BN if quant else 1  # [output] the step's scales

    @jit_kernel((THREADS, 2))
    def gemm_pipe(x, w, y, n_tokens, n_rows, width):
        a_s = cuda.shared.array((STAGES, A_STAGE), uint32, alignment=ALIGN)  # [stage, token x word] swizzled rows
        b_s = cuda.shared.array(b_shape, uint32, alignment=ALIGN)
        q_s = cuda.shared.array(q_shape, uint32, alignment=ALIGN)
        e_s = cuda.shared.array(e_shape, uint32, alignment=ALIGN)
        t_s = cuda.shared.array(t_shape, uint32, alignment=ALIGN)
        d_s = cuda.shared.array(d_shape, float32)
        xw = x.view(np.uint32)  # [T, K_total / 2] bf16 pairs
        w32 = w.view(np.uint32)  # [N, row words]
        # unsigned 32-bit indices: known non-negative, so index wraparound and floor-division fixups
        # fold away, and shared word offsets stay 32-bit sums
        tid = uint32(cuda.threadIdx.x)
        group_rows = uint32(n_rows)
        k = uint32(width)
        warp, lane = tid // WARP, tid % WARP
        g, t4 = lane >> 2, lane & 3
        wm = (warp // WARPS_N) * WM
        wn = (warp % WARPS_N) * WN
        n0 = uint32(cuda.blockIdx.x) * BN
        t0 = uint32(cuda.blockIdx.y) * BM
        row0 = uint32(cuda.blockIdx.z) * group_rows
        x0 = uint32(cuda.blockIdx.z) * (k // 2)
        n_steps = k // BK
        scale_word = k // 4  # Q8_0: the first word of a row's scales
        acc = cuda.local.array(FRAGS, float32)
        af = cuda.local.array((2, FM, 4), uint32)  # [k16 half, fragment m, register]
        bf = cuda.local.array((2, FN, 2), uint32)  # [k16 half, fragment n, register]
        for fm in range(FM):
            for fn in range(FN):
                for i in range(4):
                    acc[fm, fn, i] = float32(0)
        # ldmatrix row addresses: lane l names row l % 8 of matrix l // 8. A's matrices: tokens 0-7 and
        # 8-15 (bit 0) of k 0-7 and 8-15 (bit 1); B's: k 0-7 and 8-15 (bit 0) of outputs 0-7 and 8-15
        # (bit 1). Fragment rows start at multiples of 8, so every fragment's swizzle is its first's; the
        # second k16 half is chunks 2 and 3, the first's words XOR 8.
        mat = lane >> 3
        a_row = wm + (mat & 1) * 8 + (lane & 7)
        b_row = wn + (mat >> 1) * 8 + (lane & 7)
        a_word = pinned(a_row * KW + swizzled(a_row, mat >> 1))
        b_word = pinned(b_row * KW + swizzled(b_row, mat & 1))
        # this thread's copies: where each lands in a stage, where its first step is in device memory,
        # and how many bytes it reads (0 for rows past T or the group: zeros, from a row that exists)
        a_dst = cuda.local.array(A_COPIES, uint32)
        a_src = cuda.local.array(A_COPIES, uint64)
        a_size = cuda.local.array(A_COPIES, uint32)
        b_dst = cuda.local.array(B_COPIES, uint32)
        b_src = cuda.local.array(B_COPIES, uint64)
        b_size = cuda.local.array(B_COPIES, uint32)
        for i in range(A_COPIES):
            idx = tid + i * THREADS
            r, c = idx // CHUNKS, idx % CHUNKS
            t = t0 + r
            a_dst[i] = pinned(r * KW + swizzled(r, c))
            a_src[i] = pinned64(word_address(xw, t if t < n_tokens else t0, x0 + c * 4))
            a_size[i] = uint32(16) if t < n_tokens else uint32(0)
        if quant:  # a half row of levels (threads < 2 BN), and a scale word (threads < BN)
            r = tid // 2
            n = n0 + r
            b_dst[0] = pinned(r * QW + (tid % 2) * 4)
            b_src[0] = pinned64(word_address(w32, row0 + (n if n < group_rows else n0), (tid % 2) * 4))
            b_size[0] = uint32(16) if n < group_rows else uint32(0)
            n = n0 + tid
            e_src = pinned64(word_address(w32, row0 + (n if n < group_rows else n0), scale_word))
            e_size = uint32(SCALE_BYTES) if n < group_rows else uint32(0)
        else:
            for i in range(B_COPIES):
                idx = tid + i * THREADS
                r, c = idx // CHUNKS, idx % CHUNKS
                n = n0 + r
                b_dst[i] = pinned(r * KW + swizzled(r, c))
                b_src[i] = pinned64(word_address(w32, row0 + (n if n < group_rows else n0), c * 4))
                b_size[i] = uint32(16) if n < group_rows else uint32(0)
        write = uint32(0)  # the stage the next copies fill
        read = uint32(0)  # the stage the next mma read
        for it in range(n_steps + STAGES - 1):
            # one loop for prologue and main: iteration it issues step it's copies and, once
            # STAGES - 1 steps are in flight, multiplies step it - (STAGES - 1)
            if it >= STAGES - 1:
                cp_async_wait_one()
                cuda.syncthreads()  # the step's tiles visible; every warp done with the stage refilled below
            if it < n_steps:
                step_at = uint64(WORD_UNITS * KW * it)  # the step's first word in x's and BF16 rows
                for i in range(A_COPIES):
                    cp_async16(a_s[write], a_dst[i], xw, a_src[i] + step_at, a_size[i])
                if quant:
                    if tid < BN * 2:
                        cp_async16(q_s[write], b_dst[0], w32, b_src[0] + uint64(WORD_UNITS * QW * it), b_size[0])
                    if tid < BN:
                        cp_async4(e_s[write], tid, w32, e_src + uint64(WORD_UNITS * (it >> 1)), e_size)
                else:
                    for i in range(B_COPIES):
                        cp_async16(b_s[write], b_dst[i], w32, b_src[i] + step_at, b_size[i])
                write = uint32(write + 1) if write < STAGES - 1 else uint32(0)
            cp_async_commit()  # every iteration, empty or not: wait_group counts groups
            if it < STAGES - 1:
                continue
            step = it - (STAGES - 1)
            if quant:
                # the step's levels to bf16 pairs, the scales to fp32, once for the block
                if tid < BN * 2:
                    r, h = tid // 2, tid % 2  # 16 levels: k 16 h .. 16 h + 15 of row r
                    u0, u1, u2, u3 = lds4(q_s[read], r * QW + h * 4)
                    u0, u1, u2, u3 = u0 ^ LEVEL_BIAS, u1 ^ LEVEL_BIAS, u2 ^ LEVEL_BIAS, u3 ^ LEVEL_BIAS
                    sts4(t_s, r * KW + swizzled(r, 2 * h),
                         level_pair(u0, 0, 1), level_pair(u0, 2, 3), level_pair(u1, 0, 1), level_pair(u1, 2, 3))
                    sts4(t_s, r * KW + swizzled(r, 2 * h + 1),
                         level_pair(u2, 0, 1), level_pair(u2, 2, 3), level_pair(u3, 0, 1), level_pair(u3, 2, 3))
                if tid < BN:
                    lo, hi = f16x2_f32(e_s[read, tid])
                    d_s[tid] = hi if step & 1 else lo
                cuda.syncthreads()
            # B fragments of both k16 halves, then per fragment row A's, then the mma
            for kk in range(2):
                for p in range(FN // 2):
                    if quant:
                        b0, b1, b2, b3 = ldmatrix_x4(t_s, (b_word ^ HALF_WORDS * kk) + p * FRAG_WORDS)
                    else:
                        b0, b1, b2, b3 = ldmatrix_x4(b_s[read], (b_word ^ HALF_WORDS * kk) + p * FRAG_WORDS)
                    bf[kk, 2 * p, 0] = b0
                    bf[kk, 2 * p, 1] = b1
                    bf[kk, 2 * p + 1, 0] = b2
                    bf[kk, 2 * p + 1, 1] = b3
            for fm in range(FM):
                for kk in range(2):
                    a0, a1, a2, a3 = ldmatrix_x4(a_s[read], (a_word ^ HALF_WORDS * kk) + fm * FRAG_WORDS)
                    af[kk, fm, 0] = a0
                    af[kk, fm, 1] = a1
                    af[kk, fm, 2] = a2
                    af[kk, fm, 3] = a3
                for fn in range(FN):
                    if quant:
                        p0, p1, p2, p3 = mma(af[0, fm, 0], af[0, fm, 1], af[0, fm, 2], af[0, fm, 3],
                                             bf[0, fn, 0], bf[0, fn, 1], float32(0), float32(0), float32(0), float32(0))
                        p0, p1, p2, p3 = mma(af[1, fm, 0], af[1, fm, 1], af[1, fm, 2], af[1, fm, 3],
                                             bf[1, fn, 0], bf[1, fn, 1], p0, p1, p2, p3)
                        c = wn + fn * 8 + 2 * t4
                        d0, d1 = d_s[c], d_s[c + 1]
                        acc[fm, fn, 0] = cuda.fma(d0, p0, acc[fm, fn, 0])
                        acc[fm, fn, 1] = cuda.fma(d1, p1, acc[fm, fn, 1])
                        acc[fm, fn, 2] = cuda.fma(d0, p2, acc[fm, fn, 2])
                        acc[fm, fn, 3] = cuda.fma(d1, p3, acc[fm, fn, 3])
                    else:
                        for kk in range(2):
                            c0, c1, c2, c3 = mma(af[kk, fm, 0], af[kk, fm, 1], af[kk, fm, 2], af[kk, fm, 3],
                                                 bf[kk, fn, 0], bf[kk, fn, 1],
                                                 acc[fm, fn, 0], acc[fm, fn, 1], acc[fm, fn, 2], acc[fm, fn, 3])
                            acc[fm, fn, 0] = c0
                            acc[fm, fn, 1] = c1
                            acc[fm, fn, 2] = c2
                            acc[fm, fn, 3] = c3
            read = uint32(read + 1) if read < STAGES - 1 else uint32(0)
        # the outputs: a lane's two columns (2 t4, 2 t4 + 1) of a fragment row in one store where y's
        # rows and the groups are of even length (the pair then aligned), else one at a time
        pairs = y.shape[1] % 2 == 0 and group_rows % 2 == 0
        for fm in range(FM):
            for h in range(2):
                t = t0 + wm + fm * 16 + g + 8 * h
                if t < n_tokens:
                    for fn in range(FN):
                        n = n0 + wn + fn * 8 + 2 * t4
                        store_pair(y, t, row0, n, group_rows, acc[fm, fn, 2 * h], acc[fm, fn, 2 * h + 1],
                                   pairs, out_bf16)

    return gemm_pipe


def supports(w, x_dtype) -> bool:
    """Whether stages.linear may pick gemm_pipe for this weight and input dtype. Never on the
    simulator, where the emulated mma is far slower than stages.linear's gemm (gemm_pipe itself
    still runs there)."""
    return not SIM and takes(w, x_dtype)


def takes(w, x_dtype) -> bool:
    """Whether gemm_pipe takes this weight and input dtype: bf16 inputs, BF16 or Q8_0 weights, K a
    multiple of BK, device rows of whole 16-byte pieces (the copies' unit; both layouts have them)."""
    return np.dtype(x_dtype) == np.uint16 and w.gtype in TYPES and w.k % BK == 0 and w.data.shape[1] % 16 == 0


def piece_groups(what: str, x, w, y, n_tokens: int, group_rows: int) -> tuple[int, int]:
    """product_groups' (groups, rows a group) for a GEMM whose copies read x's rows in 16-byte
    pieces (gemm_pipe, stages.gemm_wgmma), or the ValueError naming the weight, also where x's rows
    are not whole pieces."""
    groups, group_rows = product_groups(what, x, w, y, n_tokens, group_rows)
    if x.shape[1] % 8:
        raise ValueError(f"{what} {w.name}: x {x.shape}: its rows are not whole 16-byte pieces")
    return groups, group_rows


def gemm_pipe(x, w, y, n_tokens: int, group_rows: int = 0, stream=0) -> None:
    """y[:n_tokens] = x[:n_tokens] @ w^T (y's dtype picks bf16 or fp32 out).

    group_rows > 0: grouped product, output row n reads x[:, (n // group_rows) * K : ... + K].
    Raises ValueError, naming the weight, for what it does not take (x's rows must be whole 16-byte
    pieces, as the copies read them)."""
    if not takes(w, x.dtype):
        raise ValueError(f"gemm_pipe {w.name}: {w.gtype.name} weight [{w.n}, {w.k}] with {x.dtype} inputs "
                         f"is not supported (bf16 inputs; BF16 or Q8_0 weights, K a multiple of {BK})")
    groups, group_rows = piece_groups("gemm_pipe", x, w, y, n_tokens, group_rows)
    if n_tokens == 0:
        return
    grid = ((group_rows + BN - 1) // BN, (n_tokens + BM - 1) // BM, groups)
    pipe_kernel(w.gtype == GGMLType.Q8_0, y.dtype == np.uint16)[grid, THREADS, stream](
        x, w.data, y, n_tokens, group_rows, w.k)
