"""Prefill GEMM on Hopper's warpgroup tensor cores (`wgmma.mma_async`, sm_90a): y[t, n] = sum_k
x[t, k] dequant(w)[n, k], the products and arguments of stages.gemm_pipe (BF16 and Q8_0 weights,
bf16 or fp32 out, grouped products). A dev/ kernel for issue 44 (prefill GEMMs >= 0.5x cuBLAS):
gemm_pipe's mma.sync reaches 0.31-0.47x cuBLAS for BF16 and 0.16-0.26x for Q8_0 (H100, 4096 tokens),
and mma.sync's own rate is about half of what cuBLAS's wgmma runs at.

Measured (H100 80GB HBM3, 2026-12-07, `python -m dev.test_gemm_wgmma`, best of five, 4096 tokens):
correct (dev/test_gemm_wgmma.py passed there, the seven flash shapes of both types included), and
slower than gemm_pipe on every shape: BF16 87-141 TFLOP/s against pipe's 151-316, Q8_0 81-124
against 102-185 (cuBLAS fp16 380-734). So it stays here. Not yet known where the time goes (no
profile was taken); what this kernel does that a fast wgmma GEMM does not: the no-swizzle operand
layout (the 128-byte swizzle is the usual one), a `wgmma.wait_group 0` after every step (no wgmma in
flight across the barrier), copies by cp.async from every thread rather than by the tensor memory
accelerator from one warp, and 128 x 128 block tiles. Those are the next things to try, one at a
time, each timed.

Since then (simulator and ptxas only), variants chosen by the environment at import, so that one
GPU call times them all, each process running `python -m pytest dev/test_gemm_wgmma.py` and then
`python -m dev.test_gemm_wgmma` under one setting:
- WGMMA_SWIZZLE: the 128-byte swizzled layout (1, the default now) or the measured no-swizzle one
  (0). ptxas for sm_90a: BF16 121 registers either way, Q8_0 197-201.
- WGMMA_INFLIGHT=1: BF16 keeps one step's wgmma in flight across the next barrier (four stages,
  one block an SM): 128 registers. Both pass on the simulator; no spills, and ptxas does not report
  serialising the wgmma (its C7514 note) for any of these.
- WGMMA_BN=256 (BF16 blocks of 128 x 256, a third less L2 traffic a FLOP than 128 x 128): 207
  registers, no spills, with or without INFLIGHT. It first left its 128-float accumulator array in
  local memory (a 720-byte stack frame, and with INFLIGHT=1 ptxas serialised the wgmma, C7514): the
  output loop, 32 fragments with the stores' branches, was too long for the compiler to unroll, so
  it indexed the array at run time. The accumulators now go out through shared memory in one short
  loop first (the stages are free by then). Q8_0 at 256 spills (two accumulator sets): BF16 only.

Why it can be done from Numba: numba-cuda 0.30 compiles kernels for the arch-specific target on
Hopper (its code library asks NVVM for compute_90a), so inline PTX may use wgmma; dev/wgmma_probe.py
checks that on a GPU, and which shared-memory layout the descriptors mean.

Kernel. A block of two warpgroups (256 threads) computes BM = 128 tokens x BN outputs of one group
in K steps of BK = 64 values (two Q8_0 blocks); warpgroup w takes tokens 64 w .. 64 w + 63 with one
m64nBNk16 wgmma a k16 (four a step), its accumulators in registers (BN / 2 fp32 a thread, in the
mma.sync m16n8 fragment order, one fragment per 8 outputs: warp v of the group holds rows
16 v .. 16 v + 15). Both operands come from shared memory, K-major, in the no-swizzle layout of
"core matrices" (8 rows x 16 bytes, 128 contiguous bytes): core matrix (i, j) (rows 8 i.., values
8 j..) at byte 1024 i + 128 j, so a tile's 16-byte chunk number 64 i + 8 j + (row % 8) is its byte
16 x that number: the copies write a stage linearly, and a warp's eight rows of one chunk column
land on all 32 banks. Descriptor: leading byte offset 128 (K's next core matrix), stride byte
offset 1024 (the next 8 rows), no swizzle; a k16 step is 256 bytes further.
STAGES = 3 stages ring through dynamic shared memory as in gemm_pipe (copies by 16-byte
`cp.async.cg`, issued two steps ahead, zero-filled past T and past the group's rows); after each
step's wait and before the barrier every thread fences its copies into the async proxy
(`fence.proxy.async.shared::cta`), which wgmma reads through. A warpgroup waits for its own wgmma
before the next step's barrier (`wgmma.wait_group 0`), so a stage is never refilled under a read
(WGMMA_INFLIGHT=1: `wait_group 1` and a fourth stage, the one refilled being two steps back).

Q8_0: the stages hold the stored levels (64 bytes a row a step) and the word of the step's two fp16
scales; after the barrier the block converts the step's levels into one bf16 tile in the core
layout (gemm_pipe's exact conversion, 32 levels a thread) and the scales into fp32 (static shared
memory), then a second
fence and barrier. Per block b of 32 values: part = its two k16 wgmma from zero, then acc =
fma(d_b, part, acc) per output, as gemm_pipe: the same roundings (about K/32 + 34 a term).

BF16 roundings: one fp32 chain along K, each k16's 16 products summed into it (gemm_pipe's count).

On the simulator (no wgmma), `wg_mma` is the same product as m16n8k16 mma.sync fragments side by
side (stages.warp_mma's emulation), read from the same shared layout, and the block is one
warpgroup of 64 tokens x 32 outputs.
"""

from __future__ import annotations

import os
from functools import cache

import numpy as np
from numba import cuda, float32, uint32, uint64

from flashv41.host.quants import GGMLType
from flashv41.stages.device import (
    SIM,
    WARP,
    f16x2_f32,
    jit_kernel,
    launch_dynamic_shared,
    product_groups,
)
from flashv41.stages.gemm_pipe import LEVEL_BIAS, level_pair, takes
from flashv41.stages.smem import (
    ALIGN,
    WORD_UNITS,
    cp_async4,
    cp_async16,
    cp_async_commit,
    cp_async_wait_one,
    lds4,
    pinned,
    pinned64,
    store_pair,
    sts4,
    word_address,
)
from flashv41.stages.warp_mma import kernel_mma as mma

# Variants to time (environment, read at import; the defaults are the measured kernel's but the swizzle):
# WGMMA_INFLIGHT=1 keeps one step's wgmma in flight across the next step's barrier (BF16; a fourth
# stage holds what it reads), WGMMA_BN=256 the BF16 block's outputs (one block an SM then; Q8_0's
# accumulators would not fit the registers at 256).
INFLIGHT = int(os.environ.get("WGMMA_INFLIGHT", "0"))
PREFETCH = 2  # steps the copies run ahead of the products (cp_async_wait_one: one group in flight)
STAGES = PREFETCH + 1 + INFLIGHT
BK = 64  # values of k a step: two Q8_0 blocks
WG = 4 * WARP  # threads of a warpgroup
if SIM:
    GROUPS, BN = 1, 32
else:
    GROUPS, BN = 2, int(os.environ.get("WGMMA_BN", "128"))
THREADS = GROUPS * WG
BM = 64 * GROUPS
N_ACC = BN // 2  # a thread's fp32 accumulators: BN / 8 fragments of 4
SCALES = 2 * BN  # Q8_0: a step's fp32 scales, [block, output]
CHUNK_ROW = BK // 8  # 16-byte chunks of a tile row a step (bf16)
A_STAGE = BM * BK // 2  # words of a stage's input tile
B_STAGE = BN * BK // 2  # of a BF16 weight tile (and of Q8_0's converted one)
Q_STAGE = BN * BK // 4  # of Q8_0 levels
A_COPIES = BM * CHUNK_ROW // THREADS
COPY_ROWS = THREADS // CHUNK_ROW  # tile rows from one of a thread's 16-byte copies to its next
B_COPIES = BN * CHUNK_ROW // THREADS
Q_COPIES = BN * (BK // 16) // THREADS  # of Q8_0 levels (16 levels a copy)
CONVERTS = BN * (BK // 16) // THREADS  # 16-level units a thread converts a step
assert A_COPIES * THREADS == BM * CHUNK_ROW and B_COPIES * THREADS == BN * CHUNK_ROW
assert Q_COPIES * THREADS == BN * (BK // 16) and THREADS >= BN and THREADS % 64 == 0 and COPY_ROWS % 8 == 0
# The operand layout (WGMMA_SWIZZLE=0 in the environment for the no-swizzle one, to time the two):
# - no swizzle: core matrix (i, j) at byte 1024 i + 128 j (module docstring);
# - 128-byte swizzle: row r's 128 bytes (its 64 values of the step) at byte 128 r, its 16-byte chunk
#   c at chunk c ^ (r % 8); the tile 1024-byte aligned (the hardware takes the XOR from address bits
#   7-9); descriptor: leading byte offset unused (16), stride byte offset 1024 (8 rows), swizzle mode
#   1; a k16 step is the start address 32 bytes on, the hardware's XOR applying to the sum.
SWIZZLE = os.environ.get("WGMMA_SWIZZLE", "1") != "0"
CORE_WORDS = 32  # no swizzle: words from a core matrix to K's next one (128 bytes)
GROUP_WORDS = 256  # from 8 rows to the next 8 (1024 bytes), both layouts
KSTEP_WORDS = 8 if SWIZZLE else 64  # from a k16 step's start to the next
ROW_WORDS = 32  # swizzle: a tile row (128 bytes)
DESC_LBO, DESC_MODE = (16, 1) if SWIZZLE else (128, 0)
ALIGN_WORDS = 256 if SWIZZLE else 0  # the dynamic shared memory's slack for aligning the tiles to 1024 bytes
TYPES = (GGMLType.BF16, GGMLType.Q8_0)


def chunk_word(r, c):
    """The word where 16-byte chunk c (values 8 c .. 8 c + 7) of tile row r starts."""
    if SWIZZLE:
        return r * ROW_WORDS + ((c ^ (r & 7)) << 2)
    return (r >> 3) * GROUP_WORDS + c * CORE_WORDS + (r & 7) * 4


def copy_row(idx):
    """The tile row of a step's 16-byte copy number idx: eight copies a row, in the order the layout
    stores them (so a warp's copies fill whole banks' rows)."""
    if SWIZZLE:
        return idx >> 3
    return (idx >> 6) * 8 + (idx & 7)


def copy_chunk(idx):
    """The chunk (0 .. 7) of the row copy number idx brings."""
    if SWIZZLE:
        return idx & 7
    return (idx >> 3) & 7


if not SIM:
    chunk_word = cuda.jit(device=True, inline="always")(chunk_word)
    copy_row = cuda.jit(device=True, inline="always")(copy_row)
    copy_chunk = cuda.jit(device=True, inline="always")(copy_chunk)


if SIM:
    def tile_word(base, r, k):
        """The word of the bf16 pair (k, k + 1) (k even) of row r of the tile at word base."""
        return base + chunk_word(r, k >> 3) + ((k & 7) >> 1)

    def wg_mma(acc, smem, a_word, b_word, step, accumulate):
        """acc (a thread's N_ACC) = A B^T (+ acc where accumulate) for k16 step `step` of the K step:
        A the warpgroup's 64 rows of the tile at word a_word, B the BN rows of the tile at b_word;
        here m16n8k16 mma fragments side by side, as wgmma's accumulators lie."""
        flat = smem.reshape(-1)
        lane = cuda.threadIdx.x % WARP
        v = (cuda.threadIdx.x // WARP) % 4
        g, t = lane >> 2, lane & 3
        r0, r1 = 16 * v + g, 16 * v + g + 8
        k0 = 16 * step + 2 * t
        a0, a1 = flat[tile_word(a_word, r0, k0)], flat[tile_word(a_word, r1, k0)]
        a2, a3 = flat[tile_word(a_word, r0, k0 + 8)], flat[tile_word(a_word, r1, k0 + 8)]
        for j in range(BN // 8):
            b0 = flat[tile_word(b_word, 8 * j + g, k0)]
            b1 = flat[tile_word(b_word, 8 * j + g, k0 + 8)]
            c = [acc[4 * j + i] if accumulate else float32(0) for i in range(4)]
            d = mma(a0, a1, a2, a3, b0, b1, c[0], c[1], c[2], c[3])
            for i in range(4):
                acc[4 * j + i] = d[i]

    def wg_fence():
        """Nothing is asynchronous here."""

    def align_words(smem):
        """The simulator's arrays need no alignment."""
        return 0

    wg_mma = cuda.jit(device=True)(wg_mma)  # (a device function: it reads the simulated thread index)
    wg_commit = wg_wait = wg_wait_inflight = proxy_fence = wg_fence
else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    from flashv41.stages.smem import _shared_word

    @intrinsic
    def descriptor(typingctx, smem, word):
        """The wgmma matrix descriptor of the core-layout tile at word `word` of the shared array
        smem: start address >> 4 (bits 0-13), leading byte offset 128 >> 4 (16-29), stride byte
        offset 1024 >> 4 (32-45), no swizzle."""
        sig = types.uint64(smem, word)

        def codegen(context, builder, signature, args):
            at = _shared_word(context, builder, signature.args[0], args[0], args[1], signature.args[1])
            i64 = ir.IntType(64)
            start = builder.and_(builder.lshr(builder.zext(at, i64), ir.Constant(i64, 4)), ir.Constant(i64, 0x3FFF))
            fixed = ((DESC_LBO >> 4) << 16) | ((GROUP_WORDS * 4 >> 4) << 32) | (DESC_MODE << 62)
            return builder.or_(start, ir.Constant(i64, fixed))

        return sig, codegen

    def _statement(text: str):
        @intrinsic
        def statement(typingctx):
            def codegen(context, builder, signature, args):
                builder.call(ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), text, "~{memory}", side_effect=True),
                             [])
                return context.get_dummy_value()

            return types.void(), codegen

        return statement

    wg_fence = _statement("wgmma.fence.sync.aligned;")  # the accumulators' registers settled before a wgmma
    wg_commit = _statement("wgmma.commit_group.sync.aligned;")
    wg_wait = _statement("wgmma.wait_group.sync.aligned 0;")
    wg_wait_inflight = _statement(f"wgmma.wait_group.sync.aligned {INFLIGHT};")
    proxy_fence = _statement("fence.proxy.async.shared::cta;")  # this thread's shared writes visible to wgmma

    @intrinsic
    def _wgmma(typingctx, acc, desc_a, desc_b, accumulate):
        """acc[0 .. N_ACC - 1] (a local float32 array) = A B^T (+ acc where accumulate != 0): one
        `wgmma.mma_async` m64nBNk16, bf16 in, fp32 out, both operands K-major by descriptor."""
        sig = types.void(acc, types.uint64, types.uint64, types.uint32)

        def codegen(context, builder, signature, args):
            arr = context.make_array(signature.args[0])(context, builder, args[0])
            f32 = ir.FloatType()
            ptrs = [builder.gep(arr.data, [ir.Constant(ir.IntType(64), i)]) for i in range(N_ACC)]
            vals = [builder.load(p) for p in ptrs]
            regs = ", ".join(f"${i}" for i in range(N_ACC))
            a, b, s = 2 * N_ACC, 2 * N_ACC + 1, 2 * N_ACC + 2
            text = (f"{{ .reg .pred p; setp.ne.b32 p, ${s}, 0; wgmma.mma_async.sync.aligned.m64n{BN}k16.f32.bf16.bf16 "
                    f"{{{regs}}}, ${a}, ${b}, p, 1, 1, 0, 0; }}")
            constraints = ",".join(["=f"] * N_ACC + [str(i) for i in range(N_ACC)] + ["l", "l", "r"])
            fn = ir.FunctionType(ir.LiteralStructType([f32] * N_ACC),
                                 [f32] * N_ACC + [ir.IntType(64)] * 2 + [ir.IntType(32)])
            got = builder.call(ir.InlineAsm(fn, text, constraints + ",~{memory}", side_effect=True),
                               vals + list(args[1:]))
            for i in range(N_ACC):
                builder.store(builder.extract_value(got, i), ptrs[i])
            return context.get_dummy_value()

        return sig, codegen

    @cuda.jit(device=True, inline="always")
    def wg_mma(acc, smem, a_word, b_word, step, accumulate):
        _wgmma(acc, descriptor(smem, a_word + step * KSTEP_WORDS), descriptor(smem, b_word + step * KSTEP_WORDS),
               uint32(accumulate))

    @intrinsic
    def align_words(typingctx, smem):
        """The words from the shared array smem's start to its first 1024-byte boundary."""
        def codegen(context, builder, signature, args):
            i32 = ir.IntType(32)
            at = _shared_word(context, builder, signature.args[0], args[0], ir.Constant(i32, 0), types.uint32)
            pad = builder.and_(builder.sub(ir.Constant(i32, 0), at), ir.Constant(i32, 1023))
            return builder.lshr(pad, ir.Constant(i32, 2))

        return types.uint32(smem), codegen


def shared_words(quant: bool) -> int:
    """Words of the dynamic shared memory: the stages' inputs and weights; Q8_0 also the stages'
    scale words and its converted tile; the slack that aligns the tiles."""
    if quant:
        return STAGES * (A_STAGE + Q_STAGE + BN) + B_STAGE + ALIGN_WORDS
    return STAGES * (A_STAGE + B_STAGE) + ALIGN_WORDS


@cache
def wgmma_kernel(quant: bool, out_bf16: bool):
    """Tiles of BM tokens x BN outputs of one group; block = THREADS, grid = (output tiles per group,
    token tiles, groups); shared_words(quant) words of dynamic shared memory."""
    a_at = 0  # the stages' input tiles (each a whole number of KiB: the swizzle's alignment holds)
    t_at = STAGES * A_STAGE  # Q8_0: the converted tile
    b_at = t_at + (B_STAGE if quant else 0)  # BF16 weight tiles / Q8_0 level tiles
    e_at = b_at + STAGES * Q_STAGE  # Q8_0: [stage, output] the step's scale word

    @jit_kernel((THREADS, 2 if not quant and BN == 128 and INFLIGHT == 0 else 1))
    def gemm_wgmma(x, w, y, n_tokens, n_rows, width):
        dynamic = cuda.shared.array(0, uint32, alignment=ALIGN) if ALIGN else cuda.shared.array(0, uint32)
        smem = dynamic[align_words(dynamic):]  # the tiles from a 1024-byte boundary (for the swizzle)
        dsc = cuda.shared.array(SCALES, float32)  # Q8_0: [block, output] the step's scales
        out_s = smem.view(np.float32)  # [accumulator, thread] at the end
        xw = x.view(np.uint32)
        w32 = w.view(np.uint32)
        tid = uint32(cuda.threadIdx.x)
        group_rows = uint32(n_rows)
        k = uint32(width)
        wg = tid // WG
        lane = tid % WARP
        v = (tid // WARP) % 4
        g, t4 = lane >> 2, lane & 3
        n0 = uint32(cuda.blockIdx.x) * BN
        t0 = uint32(cuda.blockIdx.y) * BM
        row0 = uint32(cuda.blockIdx.z) * group_rows
        x0 = uint32(cuda.blockIdx.z) * (k // 2)
        n_steps = (k + BK - 1) // BK  # the last one half (K an odd count of 32) where k % BK
        scale_word = k // 4
        acc = cuda.local.array(N_ACC, float32)
        part = cuda.local.array(N_ACC, float32)
        for i in range(N_ACC):
            acc[i] = float32(0)
        # this thread's copies of a step (bf16 tiles): copy i is tile row copy_row(tid) + COPY_ROWS i,
        # chunk copy_chunk(tid) of it (the same for every i), at word chunk_word(copy_row(tid),
        # chunk) + COPY_ROWS ROW_WORDS i of the stage, its source COPY_ROWS rows further each time;
        # worked out at each copy from a base, not kept a copy each (registers: BN = 256 spilled so).
        # Rows past T or the group read the tile's first row, nothing copied
        chunk = copy_chunk(tid)
        row = copy_row(tid)
        dst_0 = pinned(chunk_word(row, chunk))
        a_0 = pinned64(word_address(xw, t0 + row, x0 + chunk * 4))  # (an address, read only where the row is)
        a_spare = pinned64(word_address(xw, t0, x0 + chunk * 4))
        a_pitch = uint64(WORD_UNITS * COPY_ROWS) * uint64(xw.shape[1])
        b_0 = pinned64(word_address(w32, row0 + n0 + row, chunk * 4))
        b_spare = pinned64(word_address(w32, row0 + n0, chunk * 4))
        b_pitch = uint64(WORD_UNITS * COPY_ROWS) * uint64(w32.shape[1])
        b_src = cuda.local.array(Q_COPIES, uint64)
        b_size = cuda.local.array(Q_COPIES, uint32)
        if quant:  # levels: copy idx is row idx // 4, bytes 16 (idx % 4) of the step's 64; scale words
            for i in range(Q_COPIES):
                idx = tid + i * THREADS
                n = n0 + (idx >> 2)
                b_src[i] = pinned64(word_address(w32, row0 + (n if n < group_rows else n0), (idx & 3) * 4))
                b_size[i] = uint32(16) if n < group_rows else uint32(0)
            n = n0 + tid
            e_src = pinned64(word_address(w32, row0 + (n if n < group_rows else n0), scale_word))
            e_size = uint32(4) if n < group_rows else uint32(0)
        a_rows = pinned(a_at + wg * (64 // 8) * GROUP_WORDS)  # the warpgroup's 64 rows in a stage's tile
        write = uint32(0)
        read = uint32(0)
        for it in range(n_steps + PREFETCH):
            if it >= PREFETCH:
                cp_async_wait_one()
                proxy_fence()
                cuda.syncthreads()  # the step's tiles visible; every warpgroup done with the stage refilled below
            if it < n_steps:
                step_at = uint64(WORD_UNITS * (BK // 2) * it)
                # a half step: the copies of values 32 .. 63 zero-fill (a thread's copies are all of
                # one column: THREADS is a multiple of 64)
                cut = it == n_steps - 1 and k % BK != 0
                a_live = not (cut and chunk >= 4)
                for i in range(A_COPIES):
                    live = t0 + row + i * COPY_ROWS < n_tokens
                    src = a_0 + uint64(i) * a_pitch if live else a_spare
                    cp_async16(smem, a_at + write * A_STAGE + dst_0 + i * COPY_ROWS * ROW_WORDS, xw, src + step_at,
                               uint32(16) if live and a_live else uint32(0))
                if quant:
                    q_live = not (cut and tid & 3 >= 2)
                    for i in range(Q_COPIES):
                        cp_async16(smem, b_at + write * Q_STAGE + (tid + i * THREADS) * 4, w32,
                                   b_src[i] + uint64(WORD_UNITS * (BK // 4) * it), b_size[i] if q_live else uint32(0))
                    if tid < BN:
                        cp_async4(smem, e_at + write * BN + tid, w32, e_src + uint64(WORD_UNITS * it), e_size)
                else:
                    for i in range(B_COPIES):
                        live = n0 + row + i * COPY_ROWS < group_rows
                        src = b_0 + uint64(i) * b_pitch if live else b_spare
                        cp_async16(smem, b_at + write * B_STAGE + dst_0 + i * COPY_ROWS * ROW_WORDS, w32,
                                   src + step_at, uint32(16) if live and a_live else uint32(0))
                write = uint32(write + 1) if write < STAGES - 1 else uint32(0)
            cp_async_commit()
            if it < PREFETCH:
                continue
            a_word = a_rows + read * A_STAGE
            if quant:
                # the step's levels to bf16 in the core layout, its two scales to fp32
                for i in range(CONVERTS):
                    u = tid + i * THREADS
                    r, h = u >> 2, u & 3  # levels 16 h .. 16 h + 15 of row r
                    q0, q1, q2, q3 = lds4(smem, b_at + read * Q_STAGE + r * (BK // 4) + h * 4)
                    q0, q1, q2, q3 = q0 ^ LEVEL_BIAS, q1 ^ LEVEL_BIAS, q2 ^ LEVEL_BIAS, q3 ^ LEVEL_BIAS
                    sts4(smem, t_at + chunk_word(r, 2 * h),
                         level_pair(q0, 0, 1), level_pair(q0, 2, 3), level_pair(q1, 0, 1), level_pair(q1, 2, 3))
                    sts4(smem, t_at + chunk_word(r, 2 * h + 1),
                         level_pair(q2, 0, 1), level_pair(q2, 2, 3), level_pair(q3, 0, 1), level_pair(q3, 2, 3))
                if tid < BN:
                    lo, hi = f16x2_f32(smem[e_at + read * BN + tid])
                    dsc[tid] = lo
                    dsc[BN + tid] = hi
                proxy_fence()
                cuda.syncthreads()
                for b in range(2):
                    wg_fence()
                    wg_mma(part, smem, a_word, t_at, 2 * b, 0)
                    wg_mma(part, smem, a_word, t_at, 2 * b + 1, 1)
                    wg_commit()
                    wg_wait()
                    for j in range(BN // 8):
                        c = b * BN + 8 * j + 2 * t4
                        d0, d1 = dsc[c], dsc[c + 1]
                        acc[4 * j] = cuda.fma(d0, part[4 * j], acc[4 * j])
                        acc[4 * j + 1] = cuda.fma(d1, part[4 * j + 1], acc[4 * j + 1])
                        acc[4 * j + 2] = cuda.fma(d0, part[4 * j + 2], acc[4 * j + 2])
                        acc[4 * j + 3] = cuda.fma(d1, part[4 * j + 3], acc[4 * j + 3])
            else:
                b_word = b_at + read * B_STAGE
                wg_fence()
                for s in range(BK // 16):
                    wg_mma(acc, smem, a_word, b_word, s, 1)
                wg_commit()
                wg_wait_inflight()  # all but INFLIGHT groups done: the stage refilled next is free
            read = uint32(read + 1) if read < STAGES - 1 else uint32(0)
        wg_wait()
        pairs = y.shape[1] % 2 == 0 and group_rows % 2 == 0
        # the outputs through shared memory (the tiles' stages are free now): each thread's
        # accumulators in one short loop, which the compiler unrolls, so it keeps them in registers
        # (a loop over them with the stores' branches in it left BN = 256's in local memory)
        cuda.syncthreads()
        for i in range(N_ACC):
            out_s[i * THREADS + tid] = acc[i]
        for h in range(2):
            t = t0 + wg * 64 + v * 16 + g + 8 * h
            if t < n_tokens:
                for j in range(BN // 8):
                    n = n0 + 8 * j + 2 * t4
                    store_pair(y, t, row0, n, group_rows, out_s[(4 * j + 2 * h) * THREADS + tid],
                               out_s[(4 * j + 2 * h + 1) * THREADS + tid], pairs, out_bf16)

    return gemm_wgmma



def gemm_wgmma(x, w, y, n_tokens: int, group_rows: int = 0, stream=0) -> None:
    """y[:n_tokens] = x[:n_tokens] @ w^T, as stages.gemm_pipe.gemm_pipe (the same arguments and
    refusals)."""
    if not takes(w, x.dtype):
        raise ValueError(f"gemm_wgmma {w.name}: {w.gtype.name} weight [{w.n}, {w.k}] with {x.dtype} inputs "
                         f"is not supported (bf16 inputs; BF16 or Q8_0 weights, K a multiple of 32)")
    groups, group_rows = product_groups("gemm_wgmma", x, w, y, n_tokens, group_rows)
    if x.shape[1] % 8:
        raise ValueError(f"gemm_wgmma {w.name}: x {x.shape}: its rows are not whole 16-byte pieces")
    if n_tokens == 0:
        return
    quant = w.gtype == GGMLType.Q8_0
    kernel = wgmma_kernel(quant, y.dtype == np.uint16)
    args = (x, w.data, y, n_tokens, group_rows, w.k)
    nbytes = 4 * shared_words(quant)
    grid = ((group_rows + BN - 1) // BN, (n_tokens + BM - 1) // BM, groups)
    launch_dynamic_shared(kernel, grid, THREADS, stream, nbytes, *args)
