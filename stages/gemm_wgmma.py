"""Prefill GEMM on Hopper's warpgroup tensor cores (`wgmma.mma_async`, sm_90a) for BF16 weights:
y[t, n] = sum_k x[t, k] w[n, k], bf16 in, fp32 accumulation.

Shapes and dtypes as stages.gemm_pipe: x [T, K_total] bf16 bits (uint16), w a
stages.linear.DeviceWeight of BF16 ([N, K] bf16, K a multiple of 32), y [T, N] bf16 bits or float32.
Grouped product (group_rows > 0): output row n reads x[:, (n // group_rows) * K :][:K]. stages.linear
picks it past NARROW_MAX_TOKENS tokens for BF16 weights and bf16 x on a GPU of compute capability
9.0 (`supports`); gemm_pipe keeps Q8_0 (this kernel's Q8_0 variant lost to it on every shape timed,
2,240 against 1,924 us on wq_b, so it stayed out) and every other GPU.

Measured (H100 80GB HBM3, 2026-12-07, 4096 tokens, best of five wall-clock launches from Python,
beside stages.gemm_pipe's BF16 kernel and cuBLAS fp16 through CuPy): this kernel as dev/gemm_wgmma.py's
default variant, whose BF16 PTX is this one's but for the 1 KiB shared array of its Q8_0 path, which
the BF16 kernel declared and never used:

| matrix | wgmma | gemm_pipe | cuBLAS fp16 |
|---|---|---|---|
| attn.wq_a [1280, 5120] | 239-245 us (219-225 TFLOP/s) | 268-307 (175-200) | 96-112 (479-559) |
| attn.wq_b [32768, 1280] | 1,099 (313) | 1,478 (232) | 493 (697) |
| attn.wo_a [8192, 4096] x8 | about 683 (402) | 918 (299) | |
| attn.wo_b [5120, 8192] | 699 (492) | 1,100 (312) | 476 (722) |
| engram.wkv [25600, 6144] | 3,528 (365) | 5,236 (246) | 1,761 (732) |

So 1.1-1.6x gemm_pipe's speed and 0.39-0.68x cuBLAS's (issue 44 asks >= 0.5x). wq_a's figures span
several runs (the default's own line was not kept), wo_a's is of a run close to this kernel. Blocks
of 128 x 256 outputs with one wgmma group in flight across the barrier took 543 us on wo_a but were
no faster elsewhere, and did not come in. The bench's `prefill.gemm.<matrix>.BF16` rows time the
picked kernel, `prefill.gemm.pipe.<matrix>.BF16` gemm_pipe, each against cuBLAS (bench/prefill.py).

How Numba reaches wgmma: numba-cuda 0.30 compiles a kernel on a GPU of compute capability 9.0 or
more for the arch-specific target (its code library's `_ensure_cc` asks NVVM for compute_90a, so the
PTX says `.target sm_90a`), and inline PTX may then use `wgmma.mma_async`. Only sm_90a has it:
Ampere and Ada (8.x) have no wgmma, Blackwell's sm_100a and sm_120a targets do not take it. So
`supports` asks for compute capability 9.0 exactly (`device_capability`, the current device's), and
`gemm_wgmma` refuses any other GPU.

Oracle: host.numerics.linear (bf16 out) / host.numerics.matmul_t (fp32 out), with tests/bounds.py's
rules (>= 99% of bf16 outputs bit-equal to the oracle's, every output within half a bf16 ulp plus
8 sqrt(K) 2^-24 sum_k |x_k w_k| of the exact product); tests/test_gemm_wgmma.py. Roundings per
output: every product is exact (bf16 times bf16); one fp32 chain along the whole K, each k16 wgmma
adding its 16 products into the accumulator (about K/16 + 16 roundings a term, gemm_pipe's BF16
count, well inside the K the sqrt(K) rule allows); the output rounded by stages.smem.store_pair
(`cvt.rn.bf16x2.f32`, to nearest, ties to even) or stored as summed.

Kernel. A block of two warpgroups (256 threads) computes BM = 128 tokens x BN = 128 outputs of one
group (grid: output tiles of the group, token tiles, groups) in K steps of BK = 64 values; warpgroup
w takes tokens 64 w .. 64 w + 63 with one m64n128k16 wgmma a k16 (four a step), its accumulators in
registers (64 fp32 a thread, in the mma.sync m16n8 fragment order, one fragment per 8 outputs: warp
v of the group holds rows 16 v .. 16 v + 15). Both operands come from shared memory, K-major, in
the 128-byte swizzled layout: a tile row's 128 bytes (its 64 values of the step) at byte 128 r, its
16-byte chunk c at chunk c ^ (r % 8), the tiles 1024-byte aligned (the hardware takes the XOR from
address bits 7-9); descriptor: leading byte offset unused (16), stride byte offset 1024 (8 rows),
swizzle mode 1 (128 bytes); a k16 step is the start address 32 bytes on, the hardware's XOR applying
to the sum. A warp's copies of one chunk column land on all 32 banks.
STAGES = 3 stages ring through dynamic shared memory (99,328 bytes a block with the alignment's
slack: two blocks an SM), filled by 16-byte `cp.async.cg` copies issued two steps ahead, zero-filled
past T and past the group's rows (K an odd count of 32: the last step's values 32-63 zero-filled
too). After each step's wait and before the barrier every thread fences its copies into the async
proxy (`fence.proxy.async.shared::cta`), which wgmma reads through; a warpgroup waits for its own
wgmma before the next step's barrier (`wgmma.wait_group 0`), so a stage is never refilled under a
read. At the end the accumulators go out through shared memory (the stages are free then) in one
short loop, then to y by store_pair, two outputs a store.

SASS (ptxas 13.5 for sm_90a, launch bounds 256 threads x 2 blocks an SM): 121 registers for bf16
and for fp32 out, no stack, no spills, and no note of a serialised wgmma (ptxas's C7514).

On the simulator (no wgmma) `wg_mma` is the same product as m16n8k16 mma.sync fragments side by side
(stages.warp_mma's emulation), read from the same swizzled shared layout, and the block is one
warpgroup of 64 tokens x 32 outputs; tests/test_gemm_wgmma.py runs it there through
linear(kernel="wgmma"). stages.linear never picks it on the simulator (`supports`). The copies and
stores are stages.smem's.
"""

from __future__ import annotations

from functools import cache

import numpy as np
from numba import cuda, float32, uint32, uint64

from flashv41.host.quants import GGMLType
from flashv41.stages import gemm_pipe
from flashv41.stages.device import SIM, WARP, jit_kernel, launch_dynamic_shared
from flashv41.stages.smem import (
    ALIGN,
    WORD_UNITS,
    cp_async16,
    cp_async_commit,
    cp_async_wait_one,
    pinned,
    pinned64,
    store_pair,
    word_address,
)
from flashv41.stages.warp_mma import kernel_mma as mma

WGMMA_CAPABILITY = (9, 0)  # the one compute capability with wgmma (sm_90a)
PREFETCH = 2  # steps the copies run ahead of the products (cp_async_wait_one: one group in flight)
STAGES = PREFETCH + 1
BK = 64  # values of k a step
WG = 4 * WARP  # threads of a warpgroup
if SIM:
    GROUPS, BN = 1, 32
else:
    GROUPS, BN = 2, 128
THREADS = GROUPS * WG
BM = 64 * GROUPS
N_ACC = BN // 2  # a thread's fp32 accumulators: BN / 8 fragments of 4
CHUNK_ROW = BK // 8  # 16-byte chunks of a tile row a step
A_STAGE = BM * BK // 2  # words of a stage's input tile
B_STAGE = BN * BK // 2  # of its weight tile
A_COPIES = BM * CHUNK_ROW // THREADS
COPY_ROWS = THREADS // CHUNK_ROW  # tile rows from one of a thread's 16-byte copies to its next
B_COPIES = BN * CHUNK_ROW // THREADS
assert A_COPIES * THREADS == BM * CHUNK_ROW and B_COPIES * THREADS == BN * CHUNK_ROW
assert THREADS % 64 == 0 and COPY_ROWS % 8 == 0  # (a thread's copies are of one chunk column, one swizzle)
GROUP_WORDS = 256  # words from 8 rows to the next 8 (1024 bytes): the descriptor's stride
KSTEP_WORDS = 8  # from a k16 step's start to the next (32 bytes)
ROW_WORDS = 32  # a tile row (128 bytes)
DESC_LBO, DESC_MODE = 16, 1  # leading byte offset (unused by the swizzle), 128-byte swizzle
ALIGN_WORDS = 256  # the dynamic shared memory's slack for aligning the tiles to 1024 bytes


def chunk_word(r, c):
    """The word where 16-byte chunk c (values 8 c .. 8 c + 7) of tile row r starts."""
    return r * ROW_WORDS + ((c ^ (r & 7)) << 2)


def copy_row(idx):
    """The tile row of a step's 16-byte copy number idx: eight copies a row."""
    return idx >> 3


def copy_chunk(idx):
    """The chunk (0 .. 7) of the row copy number idx brings."""
    return idx & 7


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
    wg_commit = wg_wait = proxy_fence = wg_fence
else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    from flashv41.stages.smem import _shared_word

    @intrinsic
    def descriptor(typingctx, smem, word):
        """The wgmma matrix descriptor of the swizzled tile at word `word` of the shared array smem:
        start address >> 4 (bits 0-13), leading byte offset >> 4 (16-29), stride byte offset
        1024 >> 4 (32-45), the swizzle mode (62-63)."""
        sig = types.uint64(smem, word)

        def codegen(context, builder, signature, args):
            at = _shared_word(context, builder, signature.args[0], args[0], args[1], signature.args[1])
            i64 = ir.IntType(64)
            start = builder.and_(builder.lshr(builder.zext(at, i64), ir.Constant(i64, 4)), ir.Constant(i64, 0x3FFF))
            fixed = ((DESC_LBO >> 4) << 16) | ((GROUP_WORDS * 4 >> 4) << 32) | (DESC_MODE << 62)
            return builder.or_(start, ir.Constant(i64, fixed))

        return sig, codegen

    def _statement(text: str):
        """An intrinsic of no operands: one PTX statement that orders memory around it."""
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


SHARED_WORDS = STAGES * (A_STAGE + B_STAGE) + ALIGN_WORDS  # the dynamic shared memory: the stages, the slack


@cache
def wgmma_kernel(out_bf16: bool):
    """Tiles of BM tokens x BN outputs of one group; block = THREADS, grid = (output tiles per group,
    token tiles, groups); SHARED_WORDS words of dynamic shared memory."""
    a_at = 0  # the stages' input tiles (each a whole number of KiB: the swizzle's alignment holds)
    b_at = STAGES * A_STAGE  # the stages' weight tiles

    @jit_kernel((THREADS, 2))
    def gemm_wgmma(x, w, y, n_tokens, n_rows, width):
        dynamic = cuda.shared.array(0, uint32, alignment=ALIGN) if ALIGN else cuda.shared.array(0, uint32)
        smem = dynamic[align_words(dynamic):]  # the tiles from a 1024-byte boundary (for the swizzle)
        out_s = smem.view(np.float32)  # [accumulator, thread] at the end
        xw = x.view(np.uint32)  # [T, K_total / 2] bf16 pairs
        w32 = w.view(np.uint32)  # [N, K / 2]
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
        acc = cuda.local.array(N_ACC, float32)
        for i in range(N_ACC):
            acc[i] = float32(0)
        # this thread's copies of a step: copy i is tile row copy_row(tid) + COPY_ROWS i, chunk
        # copy_chunk(tid) of it (the same for every i), at word chunk_word(copy_row(tid), chunk) +
        # COPY_ROWS ROW_WORDS i of the stage, its source COPY_ROWS rows further each time; worked
        # out at each copy from a base, not kept a copy each (fewer registers). Rows past T or the
        # group read the tile's first row, nothing copied
        chunk = copy_chunk(tid)
        row = copy_row(tid)
        dst_0 = pinned(chunk_word(row, chunk))
        a_0 = pinned64(word_address(xw, t0 + row, x0 + chunk * 4))  # (an address, read only where the row is)
        a_spare = pinned64(word_address(xw, t0, x0 + chunk * 4))
        a_pitch = uint64(WORD_UNITS * COPY_ROWS) * uint64(xw.shape[1])
        b_0 = pinned64(word_address(w32, row0 + n0 + row, chunk * 4))
        b_spare = pinned64(word_address(w32, row0 + n0, chunk * 4))
        b_pitch = uint64(WORD_UNITS * COPY_ROWS) * uint64(w32.shape[1])
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
            b_word = b_at + read * B_STAGE
            wg_fence()
            for s in range(BK // 16):
                wg_mma(acc, smem, a_word, b_word, s, 1)
            wg_commit()
            wg_wait()  # this warpgroup's wgmma done: the stage refilled next is free
            read = uint32(read + 1) if read < STAGES - 1 else uint32(0)
        wg_wait()
        pairs = y.shape[1] % 2 == 0 and group_rows % 2 == 0
        # the outputs through shared memory (the tiles' stages are free now): each thread's
        # accumulators in one short loop, which the compiler unrolls, so it keeps them in registers
        # (a loop over them with the stores' branches in it can leave them in local memory)
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


def device_capability() -> tuple[int, int]:
    """The current GPU's compute capability (major, minor)."""
    major, minor = cuda.get_current_device().compute_capability[:2]
    return major, minor


def takes(w, x_dtype) -> bool:
    """Whether gemm_wgmma takes this weight and input dtype: bf16 inputs, BF16 weights, and what
    gemm_pipe asks of them (K a multiple of 32, device rows of whole 16-byte pieces)."""
    return w.gtype == GGMLType.BF16 and gemm_pipe.takes(w, x_dtype)


def supports(w, x_dtype) -> bool:
    """Whether stages.linear may pick gemm_wgmma: a product it takes, on a GPU of compute capability
    9.0 (WGMMA_CAPABILITY: the one with wgmma). Never on the simulator (the emulation is far slower
    than stages.linear's gemm), where the capability is not asked."""
    return not SIM and takes(w, x_dtype) and device_capability() == WGMMA_CAPABILITY


def gemm_wgmma(x, w, y, n_tokens: int, group_rows: int = 0, stream=0) -> None:
    """y[:n_tokens] = x[:n_tokens] @ w^T (y's dtype picks bf16 or fp32 out).

    group_rows > 0: grouped product, output row n reads x[:, (n // group_rows) * K : ... + K].
    Raises ValueError, naming the weight, for what it does not take (x's rows must be whole 16-byte
    pieces, as the copies read them) and on a GPU without wgmma."""
    if not takes(w, x.dtype):
        raise ValueError(f"gemm_wgmma {w.name}: {w.gtype.name} weight [{w.n}, {w.k}] with {x.dtype} inputs "
                         f"is not supported (bf16 inputs; BF16 weights, K a multiple of {gemm_pipe.BK})")
    if not SIM and device_capability() != WGMMA_CAPABILITY:
        raise ValueError(f"gemm_wgmma {w.name}: a GPU of compute capability {device_capability()} has no wgmma "
                         f"(sm_90a only: compute capability 9.0)")
    groups, group_rows = gemm_pipe.piece_groups("gemm_wgmma", x, w, y, n_tokens, group_rows)
    if n_tokens == 0:
        return
    grid = ((group_rows + BN - 1) // BN, (n_tokens + BM - 1) // BM, groups)
    launch_dynamic_shared(wgmma_kernel(y.dtype == np.uint16), grid, THREADS, stream, 4 * SHARED_WORDS,
                          x, w.data, y, n_tokens, group_rows, w.k)
