"""Q8_0 prefill GEMM on Hopper's warpgroup tensor cores with the weights as wgmma's register operand
(issue 44: Q8_0 products at >= 0.5x cuBLAS; not in the package: it has not run on a GPU yet).

y[t, n] = sum_b d[n, b] sum_{k in b} q[n, k] x[t, k], the arguments of stages.gemm_pipe's Q8_0
path: x [T, K_total] bf16 bits, w a stages.linear.DeviceWeight of Q8_0 (split device layout: per
row the K int8 levels, then the K/32 fp16 scales), y [T, N] bf16 bits or float32, grouped products
as there.

Why another shape of the product. stages.gemm_pipe's Q8_0 loop spends 294 instructions a warp a K
step of 32 on 32 mma (H100: 0.22-0.26x cuBLAS); the wgmma variant that converted the levels into a
bf16 tile in shared memory (a second barrier a step, 197 registers, one block an SM) lost to it
(2,240 against 1,924 us on attn.wq_b). Here the outputs are wgmma's M and the tokens its N:
`wgmma.mma_async ... m64n{BT}k16` takes A (64 outputs x 16 levels) from registers, so each thread
converts just its own fragment's levels from the stored bytes (no converted tile, no second
barrier), and B (BT tokens x 16 values) from the swizzled x tile by descriptor, as
stages.gemm_wgmma reads its tiles. A Q8_0 block's scale then belongs to an accumulator *row*: a
thread holds two outputs (rows g and g + 8 of its warp's 16), so it reads two scale words a step.

Per Q8_0 block b (two k16): part = two wgmma from zero (scale-d 0, then 1), wait, then
acc = fma(d[n, b], part, acc) for each of the thread's BT / 2 accumulators: gemm_pipe's roundings
(about K/32 + 34 a term), the same oracle and bounds (tests/bounds.py). The next block's fragment is
converted while this block's wgmma runs (its registers are read asynchronously until the wait);
the two warpgroups of a block meet only at a step's barrier, so one's scaling overlaps the other's
wgmma.

What it should gain (written before any GPU run): the levels' conversion costs a thread about 13
instructions a row a k16 (two shared loads, a byte permute, gemm_pipe's exact conversion), 104 a K
step of 64; the scaling 2 x BT / 2 = 128 FFMA a step; four wgmma. Against stages.gemm_pipe's
Q8_0 loop (294 instructions a warp for 32 mma of m16n8k16, that is per 16 x 256 x 32 products)
this is about 250 a warp for 64 x 128 x 64 products: about 4x fewer issue slots a product. If
issue-bound at that rate it would reach about 0.6x cuBLAS on attn.wq_b; the wait per block (the
scaling needs the part) and one block an SM (about 170 registers) may hold it nearer 0.4x.

Levels in shared memory: a stage's BO rows x 64 bytes (four 16-byte chunks, chunk c of row r at
chunk c ^ ((r >> 1) & 3)), so a warp's two 32-bit loads of one k16 (rows g = 0 .. 7, words
t >> 1 and 2 + (t >> 1) of the chunk) touch 16 distinct banks. Thread (g, t) needs levels 2t, 2t + 1
(its fragment's a0 / a1) and 2t + 8, 2t + 9 (a2 / a3) of each k16 of its rows: half (t & 1) of each
of the two words, gathered into one word by a byte permute, then to two bf16 pairs exactly
(stages.gemm_pipe.level_pair). The x tile: BT rows x 128 bytes a stage in stages.gemm_wgmma's
swizzled layout (its descriptor, its k16 steps). Scales: one word a row a step (the fp16 pair of
blocks 2 it, 2 it + 1: a 4-byte cp.async). A step K an odd count of 32 leaves the last step's upper
half zero-filled and its block 1 skipped (that scale is the row's padding).

SASS (ptxas for sm_90a, 2026-12-08): 198 registers, no stack, no spills, no serialised wgmma; a
K step is 4 HGMMA.64x128x16, 2 WARPGROUP.DEPBAR, 128 FFMA, 56 PRMT of the conversion. ptxas places
block 1's conversion after block 0's wait (next to its use), whatever the PTX order: the overlap is
between the two warpgroups, not inside one.

On the simulator (no wgmma) `wg_mma_ra` is the same product as m16n8k16 mma.sync fragments side by
side: A the thread's registers, B read from the same swizzled tile; a block there is one warpgroup
of 64 outputs x 32 tokens.
"""

from __future__ import annotations

from functools import cache

import numpy as np
from numba import cuda, float32, uint32, uint64

from flashv41.host.quants import GGMLType
from flashv41.stages import gemm_pipe
from flashv41.stages import gemm_wgmma as wgm
from flashv41.stages.device import SIM, WARP, byte_perm, f16x2_f32, jit_kernel, launch_dynamic_shared
from flashv41.stages.gemm_pipe import LEVEL_BIAS, level_pair
from flashv41.stages.gemm_wgmma import KSTEP_WORDS, ROW_WORDS, chunk_word
from flashv41.stages.smem import (
    ALIGN,
    WORD_UNITS,
    cp_async4,
    cp_async16,
    cp_async_commit,
    pinned,
    pinned64,
    store_pair,
    word_address,
)
from flashv41.stages.warp_mma import kernel_mma as mma

PREFETCH = 4  # steps the copies run ahead of the products: one block an SM, so the ring hides the latency
STAGES = PREFETCH + 1
BK = 64  # values of k a step: two Q8_0 blocks
WG = 4 * WARP
if SIM:
    GROUPS, BT = 1, 32
else:
    GROUPS, BT = 2, 128
THREADS = GROUPS * WG
BO = 64 * GROUPS  # outputs a block: warpgroup w has rows 64 w .. 64 w + 63
N_ACC = BT // 2  # a thread's fp32 accumulators (and parts)
X_STAGE = BT * ROW_WORDS  # words of a stage's x tile (BT rows x 128 bytes)
L_ROW = 16  # words of a levels row a step (64 bytes)
L_STAGE = BO * L_ROW
X_COPIES = BT * 8 // THREADS  # a thread's 16-byte copies of x a step
X_ROWS = THREADS // 8  # tile rows from one x copy of a thread to its next
L_COPIES = BO * 4 // THREADS  # of levels
L_ROWS = THREADS // 4
assert X_COPIES * THREADS == BT * 8 and L_COPIES * THREADS == BO * 4 and X_ROWS % 8 == 0
OUT_PITCH = BO + 4  # words of a token's row of the epilogue's tile: a warp's writes on distinct banks
X_AT = 0
L_AT = STAGES * X_STAGE
E_AT = L_AT + STAGES * L_STAGE
SHARED_WORDS = max(E_AT + STAGES * BO, BT * OUT_PITCH) + wgm.ALIGN_WORDS
TYPES = (GGMLType.Q8_0,)


def level_word(r, c):
    """The word where 16-byte chunk c (levels 16 c .. 16 c + 15 of the step) of levels row r starts."""
    return r * L_ROW + ((c ^ ((r >> 1) & 3)) << 2)


def fragment_pairs(smem, word, select):
    """A thread's two bf16 pairs of one levels row for one k16: levels 2t, 2t + 1 (word `word`, the
    chunk's word t >> 1) and 2t + 8, 2t + 9 (two words on), their bytes picked by `select`."""
    u = byte_perm(smem[word], smem[word + 2], select) ^ LEVEL_BIAS
    return level_pair(u, 0, 1), level_pair(u, 2, 3)


def scale_into(acc, part, da, db):
    """acc += the block's part times its scale: da for the thread's row g, db for row g + 8 (an
    accumulator's row is bit 1 of its index in each group of four)."""
    for j in range(N_ACC // 4):
        acc[4 * j] = cuda.fma(da, part[4 * j], acc[4 * j])
        acc[4 * j + 1] = cuda.fma(da, part[4 * j + 1], acc[4 * j + 1])
        acc[4 * j + 2] = cuda.fma(db, part[4 * j + 2], acc[4 * j + 2])
        acc[4 * j + 3] = cuda.fma(db, part[4 * j + 3], acc[4 * j + 3])


if not SIM:
    level_word = cuda.jit(device=True, inline="always")(level_word)
    scale_into = cuda.jit(device=True, inline="always")(scale_into)
    fragment_pairs = cuda.jit(device=True, inline="always")(fragment_pairs)

if SIM:
    def wg_mma_ra(acc, a0, a1, a2, a3, smem, b_word, step, accumulate):
        """acc (a thread's N_ACC) = A B^T (+ acc where accumulate): A the warpgroup's 64 x 16 from
        the lanes' fragments (a0 .. a3 as mma.sync's), B the BT rows of the x tile at word b_word,
        k16 step `step`; here m16n8k16 mma fragments side by side."""
        flat = smem.reshape(-1)
        lane = cuda.threadIdx.x % WARP
        g, t = lane >> 2, lane & 3
        k0 = 16 * step + 2 * t
        for j in range(BT // 8):
            b0 = flat[b_word + chunk_word(8 * j + g, k0 >> 3) + ((k0 & 7) >> 1)]
            b1 = flat[b_word + chunk_word(8 * j + g, (k0 + 8) >> 3) + ((k0 & 7) >> 1)]
            c = [acc[4 * j + i] if accumulate else float32(0) for i in range(4)]
            d = mma(a0, a1, a2, a3, b0, b1, c[0], c[1], c[2], c[3])
            for i in range(4):
                acc[4 * j + i] = d[i]

    def align_words(smem):
        return 0

    def cp_async_wait_prefetch():
        """The copies complete at once here."""

    wg_mma_ra = cuda.jit(device=True)(wg_mma_ra)
    wg_fence = wg_commit = wg_wait = proxy_fence = cp_async_wait_prefetch
else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    from flashv41.stages.gemm_wgmma import align_words, descriptor, proxy_fence, wg_commit, wg_fence, wg_wait
    from flashv41.stages.smem import _statement

    # all but the newest PREFETCH - 1 groups of this thread's copies have landed
    cp_async_wait_prefetch = _statement(f"cp.async.wait_group {PREFETCH - 1};", "~{memory}")

    @intrinsic
    def _wgmma_ra(typingctx, acc, a0, a1, a2, a3, desc_b, accumulate):
        """acc[0 .. N_ACC - 1] (a local float32 array) = A B^T (+ acc where accumulate != 0): one
        `wgmma.mma_async` m64nBTk16, bf16 in, fp32 out, A from the four registers a0 .. a3, B K-major
        by descriptor."""
        sig = types.void(acc, types.uint32, types.uint32, types.uint32, types.uint32, types.uint64, types.uint32)

        def codegen(context, builder, signature, args):
            arr = context.make_array(signature.args[0])(context, builder, args[0])
            f32, i32 = ir.FloatType(), ir.IntType(32)
            ptrs = [builder.gep(arr.data, [ir.Constant(ir.IntType(64), i)]) for i in range(N_ACC)]
            vals = [builder.load(p) for p in ptrs]
            regs = ", ".join(f"${i}" for i in range(N_ACC))
            a = ", ".join(f"${2 * N_ACC + i}" for i in range(4))
            b, s = 2 * N_ACC + 4, 2 * N_ACC + 5
            text = (f"{{ .reg .pred p; setp.ne.b32 p, ${s}, 0; wgmma.mma_async.sync.aligned.m64n{BT}k16.f32.bf16.bf16 "
                    f"{{{regs}}}, {{{a}}}, ${b}, p, 1, 1, 0; }}")
            constraints = ",".join(["=f"] * N_ACC + [str(i) for i in range(N_ACC)] + ["r"] * 4 + ["l", "r"])
            fn = ir.FunctionType(ir.LiteralStructType([f32] * N_ACC), [f32] * N_ACC + [i32] * 4 + [ir.IntType(64), i32])
            got = builder.call(ir.InlineAsm(fn, text, constraints + ",~{memory}", side_effect=True),
                               vals + list(args[1:]))
            for i in range(N_ACC):
                builder.store(builder.extract_value(got, i), ptrs[i])
            return context.get_dummy_value()

        return sig, codegen

    @cuda.jit(device=True, inline="always")
    def wg_mma_ra(acc, a0, a1, a2, a3, smem, b_word, step, accumulate):
        _wgmma_ra(acc, a0, a1, a2, a3, descriptor(smem, b_word + step * KSTEP_WORDS), uint32(accumulate))


@cache
def wgmma_q8_kernel(out_bf16: bool):
    """Tiles of BO outputs x BT tokens of one group; block = THREADS, grid = (output tiles per group,
    token tiles, groups); SHARED_WORDS words of dynamic shared memory."""

    @jit_kernel((THREADS, 1))
    def gemm_wgmma_q8(x, w, y, n_tokens, n_rows, width):
        dynamic = cuda.shared.array(0, uint32, alignment=ALIGN) if ALIGN else cuda.shared.array(0, uint32)
        smem = dynamic[align_words(dynamic):]  # the x tiles from a 1024-byte boundary (for the swizzle)
        out_s = smem.view(np.float32)  # [token, output] at the end
        xw = x.view(np.uint32)  # [T, K_total / 2] bf16 pairs
        w32 = w.view(np.uint32)  # [N, row words]: levels, then scales
        tid = uint32(cuda.threadIdx.x)
        group_rows = uint32(n_rows)
        k = uint32(width)
        wg = tid // WG
        lane = tid % WARP
        v = (tid // WARP) % 4
        g, t4 = lane >> 2, lane & 3
        n0 = uint32(cuda.blockIdx.x) * BO
        t0 = uint32(cuda.blockIdx.y) * BT
        row0 = uint32(cuda.blockIdx.z) * group_rows
        x0 = uint32(cuda.blockIdx.z) * (k // 2)
        n_steps = (k + BK - 1) // BK  # the last one half (K an odd count of 32) where k % BK
        scale_word = k // 4  # a row's first word of scales
        acc = cuda.local.array(N_ACC, float32)
        part = cuda.local.array(N_ACC, float32)
        for i in range(N_ACC):
            acc[i] = float32(0)
        # this thread's fragment rows: ra = 64 wg + 16 v + g and ra + 8 (the same swizzle); the word
        # of its chunk c is at level_word(ra, c) + (t4 >> 1) of a stage, ra + 8's 8 L_ROW further
        ra = wg * 64 + v * 16 + g
        frag_0 = pinned(L_AT + level_word(ra, 0) + (t4 >> 1))
        frag_1 = pinned(L_AT + level_word(ra, 1) + (t4 >> 1))
        frag_2 = pinned(L_AT + level_word(ra, 2) + (t4 >> 1))
        frag_3 = pinned(L_AT + level_word(ra, 3) + (t4 >> 1))
        select = uint32(0x7632) if t4 & 1 else uint32(0x5410)  # the bytes of levels 2t, 2t+1 and 2t+8, 2t+9
        # copies: x chunk (tid & 7) of tile rows (tid >> 3) + X_ROWS i; levels chunk (tid & 3) of rows
        # (tid >> 2) + L_ROWS i; threads below BO the scale word of row tid. Rows past T or the group
        # read the tile's first row, nothing copied (zeros)
        x_chunk = tid & 7
        x_row = tid >> 3
        x_dst = pinned(X_AT + chunk_word(x_row, x_chunk))
        x_src = pinned64(word_address(xw, t0 + x_row, x0 + x_chunk * 4))
        x_spare = pinned64(word_address(xw, t0, x0 + x_chunk * 4))
        x_pitch = uint64(WORD_UNITS * X_ROWS) * uint64(xw.shape[1])
        l_chunk = tid & 3
        l_row = tid >> 2
        l_dst = pinned(L_AT + level_word(l_row, l_chunk))
        l_src = pinned64(word_address(w32, row0 + n0 + l_row, l_chunk * 4))
        l_spare = pinned64(word_address(w32, row0 + n0, l_chunk * 4))
        l_pitch = uint64(WORD_UNITS * L_ROWS) * uint64(w32.shape[1])
        e_live = tid < BO and n0 + tid < group_rows
        e_src = pinned64(word_address(w32, row0 + (n0 + tid if e_live else n0), scale_word))
        write = uint32(0)
        read = uint32(0)
        for it in range(n_steps + PREFETCH):
            if it >= PREFETCH:
                cp_async_wait_prefetch()
                proxy_fence()
                cuda.syncthreads()  # the step's tiles visible; every warpgroup done with the stage refilled below
            if it < n_steps:
                cut = it == n_steps - 1 and k % BK != 0  # a half step: values 32 .. 63 zero-filled
                x_step = uint64(WORD_UNITS * (BK // 2) * it)
                x_live = not (cut and x_chunk >= 4)
                for i in range(X_COPIES):
                    live = t0 + x_row + i * X_ROWS < n_tokens
                    src = x_src + uint64(i) * x_pitch if live else x_spare
                    cp_async16(smem, x_dst + write * X_STAGE + i * X_ROWS * ROW_WORDS, xw, src + x_step,
                               uint32(16) if live and x_live else uint32(0))
                l_step = uint64(WORD_UNITS * L_ROW * it)
                l_live = not (cut and l_chunk >= 2)
                for i in range(L_COPIES):
                    live = n0 + l_row + i * L_ROWS < group_rows
                    src = l_src + uint64(i) * l_pitch if live else l_spare
                    cp_async16(smem, l_dst + write * L_STAGE + i * L_ROWS * L_ROW, w32, src + l_step,
                               uint32(16) if live and l_live else uint32(0))
                if tid < BO:
                    cp_async4(smem, E_AT + write * BO + tid, w32, e_src + uint64(WORD_UNITS * it),
                              uint32(4) if e_live else uint32(0))
                write = uint32(write + 1) if write < STAGES - 1 else uint32(0)
            cp_async_commit()
            if it < PREFETCH:
                continue
            cut = it - PREFETCH == n_steps - 1 and k % BK != 0  # the step multiplied now: block 1 absent
            b_word = X_AT + read * X_STAGE
            l_at = read * L_STAGE
            da0, da1 = f16x2_f32(smem[E_AT + read * BO + ra])
            db0, db1 = f16x2_f32(smem[E_AT + read * BO + ra + 8])
            # block 0: its two k16 fragments, its wgmma; block 1's fragments while they run
            p0, p2 = fragment_pairs(smem, frag_0 + l_at, select)
            p1, p3 = fragment_pairs(smem, frag_0 + l_at + 8 * L_ROW, select)
            q0, q2 = fragment_pairs(smem, frag_1 + l_at, select)
            q1, q3 = fragment_pairs(smem, frag_1 + l_at + 8 * L_ROW, select)
            wg_fence()
            wg_mma_ra(part, p0, p1, p2, p3, smem, b_word, 0, 0)
            wg_mma_ra(part, q0, q1, q2, q3, smem, b_word, 1, 1)
            wg_commit()
            r0, r2 = fragment_pairs(smem, frag_2 + l_at, select)
            r1, r3 = fragment_pairs(smem, frag_2 + l_at + 8 * L_ROW, select)
            s0, s2 = fragment_pairs(smem, frag_3 + l_at, select)
            s1, s3 = fragment_pairs(smem, frag_3 + l_at + 8 * L_ROW, select)
            wg_wait()
            scale_into(acc, part, da0, db0)
            if not cut:
                wg_fence()
                wg_mma_ra(part, r0, r1, r2, r3, smem, b_word, 2, 0)
                wg_mma_ra(part, s0, s1, s2, s3, smem, b_word, 3, 1)
                wg_commit()
                wg_wait()  # this warpgroup's wgmma done: the stage refilled next is free
                scale_into(acc, part, da1, db1)
            read = uint32(read + 1) if read < STAGES - 1 else uint32(0)
        pairs = y.shape[1] % 2 == 0 and group_rows % 2 == 0
        # the outputs through shared memory, transposed to [token, output] (a thread's accumulators
        # are two outputs' runs of tokens), then two outputs a store along y's rows
        cuda.syncthreads()
        for j in range(N_ACC // 4):
            for i in range(4):
                out_s[(8 * j + 2 * t4 + (i & 1)) * OUT_PITCH + ra + 8 * (i >> 1)] = acc[4 * j + i]
        cuda.syncthreads()
        for idx in range(tid, BT * BO // 2, THREADS):
            tok = idx // (BO // 2)
            p = idx % (BO // 2)
            t = t0 + tok
            if t < n_tokens:
                store_pair(y, t, row0, n0 + 2 * p, group_rows, out_s[tok * OUT_PITCH + 2 * p],
                           out_s[tok * OUT_PITCH + 2 * p + 1], pairs, out_bf16)

    return gemm_wgmma_q8


def takes(w, x_dtype) -> bool:
    """Q8_0 weights with what gemm_pipe asks of them (bf16 inputs, K a multiple of 32, whole 16-byte
    pieces)."""
    return w.gtype == GGMLType.Q8_0 and gemm_pipe.takes(w, x_dtype)


def gemm_wgmma_q8(x, w, y, n_tokens: int, group_rows: int = 0, stream=0) -> None:
    """y[:n_tokens] = x[:n_tokens] @ dequant(w)^T (y's dtype picks bf16 or fp32 out), grouped as
    stages.gemm_pipe."""
    if not takes(w, x.dtype):
        raise ValueError(f"gemm_wgmma_q8 {w.name}: {w.gtype.name} weight [{w.n}, {w.k}] with {x.dtype} inputs "
                         f"is not supported (bf16 inputs; Q8_0 weights, K a multiple of {gemm_pipe.BK})")
    if not SIM and wgm.device_capability() != wgm.WGMMA_CAPABILITY:
        raise ValueError(f"gemm_wgmma_q8 {w.name}: compute capability {wgm.device_capability()} has no wgmma")
    groups, group_rows = gemm_pipe.piece_groups("gemm_wgmma_q8", x, w, y, n_tokens, group_rows)
    if n_tokens == 0:
        return
    grid = ((group_rows + BO - 1) // BO, (n_tokens + BT - 1) // BT, groups)
    launch_dynamic_shared(wgmma_q8_kernel(y.dtype == np.uint16), grid, THREADS, stream, 4 * SHARED_WORDS,
                          x, w.data, y, n_tokens, group_rows, w.k)
