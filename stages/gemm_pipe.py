"""Pipelined tensor-core prefill GEMM: y[t, n] = sum_k x[t, k] * dequant(w)[n, k] on bf16
`mma.sync.m16n8k16` with fp32 accumulation, the tiles streamed into shared memory by `cp.async`
several K steps ahead and read into fragments with `ldmatrix`.

Shapes and dtypes as stages.linear.linear: x [T, K_total] bf16 bits (uint16), w a
stages.linear.DeviceWeight of BF16 ([N, K] bf16) or Q8_0 (split device layout: per row the K int8
levels, then the K/32 fp16 scales d, padded to whole 16-byte pieces), y [T, N] bf16 bits (rounded
to nearest even) or float32. Grouped product (group_rows > 0): output row n reads
x[:, (n // group_rows) * K :][:K]. Forced only (stages.linear's kernel="pipe"); never picked.

Oracle: host.numerics.linear (bf16 out) / host.numerics.matmul_t (fp32 out), with tests/bounds.py's
rules (>= 99% of bf16 outputs bit-equal to the oracle's, every output within half a bf16 ulp plus
8 sqrt(K) 2^-24 sum_k |x_k w_k| of the exact product).

Roundings per output. Every product the tensor cores form is exact (bf16 times bf16, or bf16 times
an integer level |q| <= 128, which bf16 holds exactly).
- BF16: one fp32 chain along the whole K: each K step of 32 adds two k16 mma results into the
  accumulator, so a term passes through about K/16 + 16 roundings (the mma's own sum of 16 products
  and its add into C), then the bf16 one.
- Q8_0: per 32-value block b, part = the block's two k16 mma sums (from zero), then
  acc = fma(d_b, part, acc): d_b (fp16, exact in fp32) times part rounds once with the add. A term
  passes through about K/32 + 34 roundings, then the bf16 one.
These are linear_tc's orders and counts, well inside the K roundings bounds.py's sqrt(K) rule allows.

Kernel. A block computes BM tokens x BN outputs of one group (grid z) over K steps of BK = 32
values; 8 warps, 2 along tokens and 4 along outputs, each a 64 x 32 tile of 4 x 4 fragments of
16 x 8 held in registers. STAGES shared stages form a ring: the block issues step s + STAGES - 1's
16-byte `cp.async.cg` copies (zero-filled past T and past the group's rows) while it multiplies
step s, one commit group a step, `cp.async.wait_group STAGES - 2` and one barrier before each
step. Shared rows are 64 bytes (32 bf16) with their four 16-byte chunks swizzled (chunk c of row r
stored at c ^ ((r >> 1) & 3)), so the eight row addresses of an `ldmatrix` matrix, and the copies'
stores, fall on distinct banks without padding: three stages of BF16 tiles take exactly the 48 KiB
of static shared memory a block may have. (Numba has no launch option for more: past 48 KiB a
kernel needs the driver's maximum-dynamic-shared-memory attribute, which numba-cuda does not set.)
Fragments: per K step a warp reads 8 `ldmatrix.x4` for A (a fragment of 16 tokens x 16 k each) and
4 for B (two fragments of 8 outputs x 16 k each) for its 32 mma.

Q8_0: the stages hold the stored bytes (cp.async of the int8 levels, 32 bytes a row a step, and the
4-byte word of fp16 scales that holds the step's, `cp.async.ca` of 4 bytes: .cg copies only 16), and
after the step's barrier the block converts the step's levels once into one bf16 tile (16 levels a
thread: one 16-byte shared load, for each level a byte permute into an fp32 pattern 2^23 + 128 + q and
one subtract, giving q exactly; a permute packs two as bf16; two 16-byte stores) and the 128 scales
to fp32; a second barrier, then the warps read B by `ldmatrix` as for BF16. Chosen over converting in
each warp's B fragments by instruction count: a lane would convert 32 levels a step instead of 16
(the block's two warps along tokens each converting the same ones), and gather them with 8 16-byte
shared loads where its half of the block conversion takes one load, two stores and the 4 ldmatrix
BF16 has anyway (about 104 against 51 instructions a thread a step, for one barrier more).

On the simulator the copies are plain copies (commit and wait do nothing), `ldmatrix` a gather in
which every lane brings the 16 bytes at its own row address to the warp's meeting
(stages.linear_tc's) and takes back its words of the four matrices, the mma linear_tc's emulation;
blocks have 4 warps of 16 x 16 tiles (a Python thread per CUDA thread there).
"""

from __future__ import annotations

from functools import cache

import numpy as np
from numba import cuda, float32, uint32

from flashv41.host.quants import GGMLType
from flashv41.stages import linear_tc
from flashv41.stages.device import CHUNK, SIM, WARP, byte_perm, f16x2_f32, f32_bits, f32_from_bits, f32_to_bf16

BK = CHUNK  # values of k per step: one Q8_0 block
KW = BK // 2  # 32-bit words (bf16 pairs) of a bf16 tile row per step: 64 bytes
CHUNKS = KW // 4  # its 16-byte chunks (one cp.async, one ldmatrix row each)
QW = BK // 4  # words of int8 levels of a Q8_0 tile row per step: 32 bytes, two chunks
STAGES = 3
if SIM:  # four warps (the meeting's), each 1 x 2 fragments
    WARPS_M, WARPS_N, FM, FN = 2, 2, 1, 2
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
ALIGN = None if SIM else 128  # cp.async and ldmatrix need aligned shared rows (the simulator refuses the option)
LEVEL_BIAS = uint32(0x80808080)  # q + 128 in each byte of a word of levels
MAGIC = uint32(0x4B000000)  # the fp32 pattern of 2^23: its low mantissa bits take an integer below 2^23
MAGIC_LEVEL = float32(8388736.0)  # 2^23 + 128: a biased level's fp32 pattern less this is q
SCALE_WORD = 4  # bytes of the fp16 scale word a Q8_0 step copies (its scale and its neighbour's)
FRAGS = (FM, FN, 4)  # a warp's accumulators: [fragment m, fragment n, register]
TYPES = (GGMLType.BF16, GGMLType.Q8_0)


if SIM:
    def cp_async16(dst, s, r, c, src, row, col, size):
        """dst[s, r, c .. c + 3] = src[row, col .. col + 3] (uint32) where size is 16, zeros where 0."""
        for i in range(4):
            dst[s, r, c + i] = src[row, col + i] if size else uint32(0)

    def cp_async4(dst, s, r, src, row, col, size):
        """dst[s, r] = src[row, col] (uint32) where size is 4, zero where 0."""
        dst[s, r] = src[row, col] if size else uint32(0)

    def cp_async_commit():
        """The copies above complete at once here: nothing to group."""

    def cp_async_wait():
        """Nothing is in flight here."""

    def ldmatrix_x4(a, s, r, c):
        """Four 8 x 8 matrices of b16 from shared memory: lane l brings the address a[s, r, c .. c + 3]
        of row l % 8 of matrix l // 8 and gets, of each matrix i, word l % 4 of its row l // 4."""
        tid = cuda.threadIdx.x
        rows = linear_tc.kernel_warp_meet((a[s, r, c], a[s, r, c + 1], a[s, r, c + 2], a[s, r, c + 3], 0, 0),
                                          ldmatrix_tile)
        lane = tid % WARP
        return (uint32(rows[lane >> 2, lane & 3]), uint32(rows[8 + (lane >> 2), lane & 3]),
                uint32(rows[16 + (lane >> 2), lane & 3]), uint32(rows[24 + (lane >> 2), lane & 3]))

    def ldmatrix_tile(regs):
        """The rows the lanes brought, [lane, word]: row j of matrix i is lane 8 i + j's."""
        return regs[:, :4].copy()

    def lds4(a, s, r, c):
        """a[s, r, c .. c + 3] (uint32, shared; one 16-byte load on a GPU)."""
        return a[s, r, c], a[s, r, c + 1], a[s, r, c + 2], a[s, r, c + 3]

    def sts4(a, s, r, c, v0, v1, v2, v3):
        """a[s, r, c .. c + 3] = v0 .. v3 (uint32, shared; one 16-byte store on a GPU)."""
        a[s, r, c], a[s, r, c + 1], a[s, r, c + 2], a[s, r, c + 3] = v0, v1, v2, v3
else:
    from llvmlite import ir
    from numba import types
    from numba.cuda import cgutils  # type: ignore[attr-defined]
    from numba.cuda.extending import intrinsic

    def _pointer(context, builder, array_type, array, index_types, index):
        """The generic address of array[index...]."""
        arr = context.make_array(array_type)(context, builder, array)
        at = [context.cast(builder, v, t, types.intp) for v, t in zip(index, index_types, strict=True)]
        return cgutils.get_item_pointer(context, builder, array_type, arr, at)

    def _shared(builder, pointer):
        """A shared array element's generic address as a 32-bit `.shared` window address: the cast
        back to the shared space undoes Numba's cast of the array to generic, so NVVM emits the
        array's own shared address (no cvta)."""
        shared = builder.addrspacecast(pointer, ir.PointerType(pointer.type.pointee, 3))
        return builder.ptrtoint(shared, ir.IntType(32))

    def _src_size(context, builder, size, size_type):
        return context.cast(builder, size, size_type, types.uint32)

    @intrinsic
    def cp_async16(typingctx, dst, s, r, c, src, row, col, size):
        """`cp.async.cg.shared.global` of 16 bytes: src[row, col ..] (global) to dst[s, r, c ..]
        (shared), only the first `size` (16 or 0) read, the rest zero-filled; through L2 only."""
        sig = types.void(dst, s, r, c, src, row, col, size)

        def codegen(context, builder, signature, args):
            a = signature.args
            to = _shared(builder, _pointer(context, builder, a[0], args[0], a[1:4], args[1:4]))
            frm = builder.ptrtoint(_pointer(context, builder, a[4], args[4], a[5:7], args[5:7]), ir.IntType(64))
            fn = ir.FunctionType(ir.VoidType(), [ir.IntType(32), ir.IntType(64), ir.IntType(32)])
            asm = ir.InlineAsm(fn, "cp.async.cg.shared.global [$0], [$1], 16, $2;", "r,l,r", side_effect=True)
            builder.call(asm, [to, frm, _src_size(context, builder, args[7], a[7])])
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def cp_async4(typingctx, dst, s, r, src, row, col, size):
        """`cp.async.ca.shared.global` of 4 bytes: src[row, col] (global) to dst[s, r] (shared), read
        where size is 4, zero where 0."""
        sig = types.void(dst, s, r, src, row, col, size)

        def codegen(context, builder, signature, args):
            a = signature.args
            to = _shared(builder, _pointer(context, builder, a[0], args[0], a[1:3], args[1:3]))
            frm = builder.ptrtoint(_pointer(context, builder, a[3], args[3], a[4:6], args[4:6]), ir.IntType(64))
            fn = ir.FunctionType(ir.VoidType(), [ir.IntType(32), ir.IntType(64), ir.IntType(32)])
            asm = ir.InlineAsm(fn, "cp.async.ca.shared.global [$0], [$1], 4, $2;", "r,l,r", side_effect=True)
            builder.call(asm, [to, frm, _src_size(context, builder, args[6], a[6])])
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def cp_async_commit(typingctx):
        """`cp.async.commit_group`: the copies issued since the last commit form one group."""
        sig = types.void()

        def codegen(context, builder, signature, args):
            asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), "cp.async.commit_group;", "", side_effect=True)
            builder.call(asm, [])
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def cp_async_wait(typingctx):
        """`cp.async.wait_group STAGES - 2`: all but the newest STAGES - 2 groups of this thread's
        copies have landed (a barrier then makes every thread's visible). A memory clobber, so no
        shared load moves above it."""
        sig = types.void()

        def codegen(context, builder, signature, args):
            asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), f"cp.async.wait_group {STAGES - 2};",
                               "~{memory}", side_effect=True)
            builder.call(asm, [])
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def ldmatrix_x4(typingctx, a, s, r, c):
        """`ldmatrix.sync.aligned.m8n8.x4.shared.b16`: lane l gives the address of a[s, r, c ..] (16
        bytes: row l % 8 of matrix l // 8) and gets, of each matrix i, word l % 4 of its row l // 4."""
        sig = types.UniTuple(types.uint32, 4)(a, s, r, c)

        def codegen(context, builder, signature, args):
            at = _shared(builder, _pointer(context, builder, signature.args[0], args[0], signature.args[1:],
                                           args[1:]))
            word = ir.IntType(32)
            fn = ir.FunctionType(ir.LiteralStructType([word] * 4), [word])
            asm = ir.InlineAsm(fn, "ldmatrix.sync.aligned.m8n8.x4.shared.b16 {$0,$1,$2,$3}, [$4];",
                               "=r,=r,=r,=r,r,~{memory}", side_effect=True)
            got = builder.call(asm, [at])
            return context.make_tuple(builder, signature.return_type, [builder.extract_value(got, i) for i in range(4)])

        return sig, codegen

    @intrinsic
    def lds4(typingctx, a, s, r, c):
        """a[s, r, c .. c + 3] of a shared uint32 array: one `ld.shared.v4.u32`."""
        sig = types.UniTuple(types.uint32, 4)(a, s, r, c)

        def codegen(context, builder, signature, args):
            at = _shared(builder, _pointer(context, builder, signature.args[0], args[0], signature.args[1:],
                                           args[1:]))
            word = ir.IntType(32)
            fn = ir.FunctionType(ir.LiteralStructType([word] * 4), [word])
            asm = ir.InlineAsm(fn, "ld.shared.v4.u32 {$0,$1,$2,$3}, [$4];", "=r,=r,=r,=r,r,~{memory}",
                               side_effect=True)
            got = builder.call(asm, [at])
            return context.make_tuple(builder, signature.return_type, [builder.extract_value(got, i) for i in range(4)])

        return sig, codegen

    @intrinsic
    def sts4(typingctx, a, s, r, c, v0, v1, v2, v3):
        """a[s, r, c .. c + 3] = v0 .. v3 in a shared uint32 array: one `st.shared.v4.u32`."""
        sig = types.void(a, s, r, c, v0, v1, v2, v3)

        def codegen(context, builder, signature, args):
            at = _shared(builder, _pointer(context, builder, signature.args[0], args[0], signature.args[1:4],
                                           args[1:4]))
            values = [context.cast(builder, v, t, types.uint32) for v, t in zip(args[4:], signature.args[4:],
                                                                                 strict=True)]
            word = ir.IntType(32)
            fn = ir.FunctionType(ir.VoidType(), [word] * 5)
            asm = ir.InlineAsm(fn, "st.shared.v4.u32 [$0], {$1,$2,$3,$4};", "r,r,r,r,r,~{memory}", side_effect=True)
            builder.call(asm, [at, *values])
            return context.get_dummy_value()

        return sig, codegen

mma = linear_tc.kernel_mma


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
    b_shape = (1, 1, 4) if quant else (STAGES, BN, KW)  # [stage, output, word] BF16 weights, swizzled
    q_shape = (STAGES, BN, QW) if quant else (1, 1, 4)  # [stage, output, word] Q8_0 levels, stored order
    e_shape = (STAGES, BN) if quant else (1, 1)  # [stage, output] the word holding the step's fp16 scale
    t_shape = (1, BN, KW) if quant else (1, 1, 4)  # [1, output, word] the step's levels as bf16, swizzled
    d_shape = BN if quant else 1  # [output] the step's scales

    @cuda.jit if SIM else cuda.jit(launch_bounds=(THREADS, 2))  # type: ignore[call-arg]
    def gemm_pipe(x, w, y, n_tokens, n_rows, width):
        a_s = cuda.shared.array((STAGES, BM, KW), uint32, alignment=ALIGN)  # [stage, token, word] swizzled
        b_s = cuda.shared.array(b_shape, uint32, alignment=ALIGN)
        q_s = cuda.shared.array(q_shape, uint32, alignment=ALIGN)
        e_s = cuda.shared.array(e_shape, uint32, alignment=ALIGN)
        t_s = cuda.shared.array(t_shape, uint32, alignment=ALIGN)
        d_s = cuda.shared.array(d_shape, float32)
        xw = x.view(np.uint32)  # [T, K_total / 2] bf16 pairs
        w32 = w.view(np.uint32)  # [N, row words]
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
        # (bit 1). Rows start at multiples of 8, so lane l's swizzle is that of row l % 8.
        mat = lane >> 3
        a_row = wm + (mat & 1) * 8 + (lane & 7)
        a_chunk = mat >> 1
        b_row = wn + (mat >> 1) * 8 + (lane & 7)
        b_chunk = mat & 1
        for it in range(n_steps + STAGES - 1):
            # one loop for prologue and main: iteration it issues step it's copies and, once
            # STAGES - 1 steps are in flight, multiplies step it - (STAGES - 1)
            step = it - (STAGES - 1)
            if it >= STAGES - 1:
                cp_async_wait()
                cuda.syncthreads()  # step's tiles visible; every warp done with the stage refilled below
            if it < n_steps:
                stage = it % STAGES
                for i in range(A_COPIES):
                    idx = tid + i * THREADS
                    r, c = idx // CHUNKS, idx % CHUNKS
                    t = t0 + r
                    cp_async16(a_s, stage, r, swizzled(r, c), xw, t if t < n_tokens else uint32(0),
                               x0 + it * KW + c * 4, uint32(16) if t < n_tokens else uint32(0))
                if quant:
                    if tid < BN * 2:
                        r, c = tid // 2, tid % 2
                        n = n0 + r
                        cp_async16(q_s, stage, r, c * 4, w32, row0 + (n if n < group_rows else uint32(0)),
                                   it * QW + c * 4, uint32(16) if n < group_rows else uint32(0))
                    if tid < BN:
                        n = n0 + tid
                        cp_async4(e_s, stage, tid, w32, row0 + (n if n < group_rows else uint32(0)),
                                  scale_word + it // 2, uint32(SCALE_WORD) if n < group_rows else uint32(0))
                else:
                    for i in range(B_COPIES):
                        idx = tid + i * THREADS
                        r, c = idx // CHUNKS, idx % CHUNKS
                        n = n0 + r
                        cp_async16(b_s, stage, r, swizzled(r, c), w32, row0 + (n if n < group_rows else uint32(0)),
                                   it * KW + c * 4, uint32(16) if n < group_rows else uint32(0))
            cp_async_commit()  # every iteration, empty or not: wait_group counts groups
            if step < 0:
                continue
            stage = step % STAGES
            if quant:
                # the step's levels to bf16 pairs, the scales to fp32, once for the block
                if tid < BN * 2:
                    r, h = tid // 2, tid % 2  # 16 levels: k 16 h .. 16 h + 15 of row r
                    u0, u1, u2, u3 = lds4(q_s, stage, r, h * 4)
                    u0, u1, u2, u3 = u0 ^ LEVEL_BIAS, u1 ^ LEVEL_BIAS, u2 ^ LEVEL_BIAS, u3 ^ LEVEL_BIAS
                    sts4(t_s, 0, r, swizzled(r, 2 * h),
                         level_pair(u0, 0, 1), level_pair(u0, 2, 3), level_pair(u1, 0, 1), level_pair(u1, 2, 3))
                    sts4(t_s, 0, r, swizzled(r, 2 * h + 1),
                         level_pair(u2, 0, 1), level_pair(u2, 2, 3), level_pair(u3, 0, 1), level_pair(u3, 2, 3))
                if tid < BN:
                    lo, hi = f16x2_f32(e_s[stage, tid])
                    d_s[tid] = hi if step % 2 else lo
                cuda.syncthreads()
            # B fragments of both k16 halves, then per fragment row A's, then the mma
            for kk in range(2):
                for p in range(FN // 2):
                    r = b_row + p * 16
                    if quant:
                        b0, b1, b2, b3 = ldmatrix_x4(t_s, 0, r, swizzled(r, 2 * kk + b_chunk))
                    else:
                        b0, b1, b2, b3 = ldmatrix_x4(b_s, stage, r, swizzled(r, 2 * kk + b_chunk))
                    bf[kk, 2 * p, 0] = b0
                    bf[kk, 2 * p, 1] = b1
                    bf[kk, 2 * p + 1, 0] = b2
                    bf[kk, 2 * p + 1, 1] = b3
            for fm in range(FM):
                r = a_row + fm * 16
                for kk in range(2):
                    a0, a1, a2, a3 = ldmatrix_x4(a_s, stage, r, swizzled(r, 2 * kk + a_chunk))
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

    return gemm_pipe


def takes(w, x_dtype) -> bool:
    """Whether gemm_pipe takes this weight and input dtype: bf16 inputs, BF16 or Q8_0 weights, K a
    multiple of BK (the device rows of both are whole 16-byte pieces)."""
    return np.dtype(x_dtype) == np.uint16 and w.gtype in TYPES and w.k % BK == 0


def gemm_pipe(x, w, y, n_tokens: int, group_rows: int = 0, stream=0) -> None:
    """y[:n_tokens] = x[:n_tokens] @ w^T (y's dtype picks bf16 or fp32 out).

    group_rows > 0: grouped product, output row n reads x[:, (n // group_rows) * K : ... + K].
    Raises ValueError, naming the weight, for what it does not take."""
    if not takes(w, x.dtype):
        raise ValueError(f"gemm_pipe {w.name}: {w.gtype.name} weight [{w.n}, {w.k}] with {x.dtype} inputs "
                         f"is not supported (bf16 inputs; BF16 or Q8_0 weights, K a multiple of {BK})")
    groups = w.n // group_rows if group_rows else 1
    group_rows = group_rows or w.n
    if (groups * group_rows != w.n or x.shape[1] < groups * w.k or y.shape[1] < w.n
            or n_tokens > min(x.shape[0], y.shape[0]) or y.dtype not in (np.uint16, np.float32)):
        raise ValueError(f"gemm_pipe {w.name}: x {x.shape}, y {y.shape}, weight [{w.n}, {w.k}], "
                         f"{n_tokens} tokens, group rows {group_rows}")
    if n_tokens == 0:
        return
    grid = ((group_rows + BN - 1) // BN, (n_tokens + BM - 1) // BM, groups)
    pipe_kernel(w.gtype == GGMLType.Q8_0, y.dtype == np.uint16)[grid, THREADS, stream](
        x, w.data, y, n_tokens, group_rows, w.k)
