"""stages.gemm_pipe with its shared stages in dynamic shared memory, any number of them (issue 44:
prefill GEMMs at >= 0.5x cuBLAS; not in the package until it has run on a GPU and won).

The package's pipe keeps its three stages of BF16 tiles (48 KiB) in static shared memory, all a
block may declare. Here the same kernel, line for line, keeps its stage rings (the inputs' tiles,
the BF16 weights' or the Q8_0 levels and scale words) in the launch's dynamic shared memory
(`cuda.shared.array(0, uint32)`, each stage read through a view from its offset, `layout`), so
`stages` can be 4 (64 KiB of BF16 tiles) or more once dev.dynamic_smem's attribute lets the launch
past 48 KiB; Q8_0's converted tile and scales stay static. `cp.async.wait_group` waits for all but
the newest stages - 2 groups. The kernel function runs with stages.gemm_pipe's globals (see
pipe_kernel_dyn). ptxas 13.5 for sm_90 (launch bounds 256 x 2): BF16 121 registers and Q8_0 128 at
3 and 4 stages, as the package's kernels, no spills.

What it should gain: one more K step of loads in flight, for the copies' latency that three stages
leave exposed. On an H100 (2026-12-07) the package's pipe ran BF16 at 227-345 TFLOP/s, 0.31-0.47x
cuBLAS; with 16 warps an SM issuing 104 instructions a K step for 32 mma, the tensor cores would
allow about twice that. Expect 5-20% from the fourth stage, most on the shapes with the fewest K
steps a block (wq_b and the index wq_b: K = 1280, 40 steps, where the prologue and drain weigh
most): not enough alone for 0.5x everywhere; larger warp tiles are the next step. Unmeasured:
`python -m dev.time_pipe_dyn` on a GPU times it against the package's pipe and checks the bits.

Launch: `gemm_pipe_dyn(x, w, y, n_tokens, group_rows, stream, stages)` as stages.gemm_pipe.gemm_pipe
(same shapes, dtypes, tiles and oracle), the dynamic size `shared_bytes(quant, stages)`.
"""

from __future__ import annotations

import types
from functools import cache

import numpy as np
from numba import cuda, float32, uint32, uint64

from dev.dynamic_smem import allow_dynamic_shared
from flashv41.host.quants import GGMLType
from flashv41.stages import gemm_pipe as pipe
from flashv41.stages.device import SIM, WARP, f16x2_f32, product_groups
from flashv41.stages.gemm_pipe import (
    A_COPIES,
    A_STAGE,
    ALIGN,
    B_COPIES,
    B_STAGE,
    BK,
    BM,
    BN,
    CHUNKS,
    FM,
    FN,
    FRAG_WORDS,
    FRAGS,
    HALF_WORDS,
    KW,
    LEVEL_BIAS,
    Q_STAGE,
    QW,
    SCALE_BYTES,
    THREADS,
    WARPS_N,
    WM,
    WN,
    WORD_UNITS,
    bf16x2,
    cp_async4,
    cp_async16,
    cp_async_commit,
    ldmatrix_x4,
    lds4,
    level_pair,
    pinned,
    pinned64,
    store_bf16x2,
    store_f32x2,
    sts4,
    swizzled,
    takes,
    word_address,
)
from flashv41.stages.warp_mma import kernel_mma as mma

ALIGN_WORDS = 32  # each array of the carve starts on 128 bytes, as the package's are aligned
_ALLOWED: set = set()  # (kernel, argument types) whose overload may take its stages' dynamic bytes


def _round(words: int) -> int:
    return -(-words // ALIGN_WORDS) * ALIGN_WORDS


def layout(quant: bool, stages: int) -> tuple[tuple[int, ...], int]:
    """The word offsets of the dynamic rings (inputs, BF16 weights, Q8_0 levels, their scale words)
    and their total words; a type's unused rings are empty."""
    sizes = (stages * A_STAGE, 0 if quant else stages * B_STAGE, stages * Q_STAGE if quant else 0,
             stages * BN if quant else 0)
    offsets, at = [], 0
    for size in sizes:
        offsets.append(at)
        at += _round(size)
    return tuple(offsets), at


def shared_bytes(quant: bool, stages: int) -> int:
    return 4 * layout(quant, stages)[1]


def _wait(stages: int):
    """cp.async.wait_group for `stages` stages: all but the newest stages - 2 groups landed."""
    if SIM:
        def wait():
            """Nothing is in flight here."""
        return wait
    from flashv41.stages.gemm_pipe import _statement

    return _statement(f"cp.async.wait_group {stages - 2};", "~{memory}")


@cache
def pipe_kernel_dyn(quant: bool, out_bf16: bool, stages: int):
    """stages.gemm_pipe.pipe_kernel with `stages` stages in dynamic shared memory."""
    if stages < 2:
        raise ValueError(f"gemm_pipe_dyn: {stages} stages; at least 2 (one in flight while one is read)")
    t_shape = B_STAGE if quant else 4  # [output x word] the step's levels as bf16 pairs (static, as the package's)
    d_shape = BN if quant else 1  # [output] the step's scales (static)
    (A_AT, B_AT, Q_AT, E_AT), _ = layout(quant, stages)
    wait = _wait(stages)

    def gemm_pipe_dyn(x, w, y, n_tokens, n_rows, width):
        # the stage rings in the launch's dynamic shared memory (`layout`): stage i of the inputs'
        # tiles at word A_AT + i A_STAGE, of the BF16 weights' at B_AT + i B_STAGE, of the Q8_0 levels'
        # at Q_AT + i Q_STAGE, of their scale words at E_AT + i BN; each read through a view from there
        dyn = cuda.shared.array(0, uint32)
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
        for it in range(n_steps + stages - 1):
            # one loop for prologue and main: iteration it issues step it's copies and, once
            # stages - 1 steps are in flight, multiplies step it - (stages - 1)
            if it >= stages - 1:
                wait()
                cuda.syncthreads()  # the step's tiles visible; every warp done with the stage refilled below
            if it < n_steps:
                step_at = uint64(WORD_UNITS * KW * it)  # the step's first word in x's and BF16 rows
                for i in range(A_COPIES):
                    cp_async16(dyn[A_AT + write * A_STAGE:], a_dst[i], xw, a_src[i] + step_at, a_size[i])
                if quant:
                    if tid < BN * 2:
                        cp_async16(dyn[Q_AT + write * Q_STAGE:], b_dst[0], w32, b_src[0] + uint64(WORD_UNITS * QW * it),
                                   b_size[0])
                    if tid < BN:
                        cp_async4(dyn[E_AT + write * BN:], tid, w32, e_src + uint64(WORD_UNITS * (it >> 1)), e_size)
                else:
                    for i in range(B_COPIES):
                        cp_async16(dyn[B_AT + write * B_STAGE:], b_dst[i], w32, b_src[i] + step_at, b_size[i])
                write = uint32(write + 1) if write < stages - 1 else uint32(0)
            cp_async_commit()  # every iteration, empty or not: wait_group counts groups
            if it < stages - 1:
                continue
            step = it - (stages - 1)
            if quant:
                # the step's levels to bf16 pairs, the scales to fp32, once for the block
                if tid < BN * 2:
                    r, h = tid // 2, tid % 2  # 16 levels: k 16 h .. 16 h + 15 of row r
                    u0, u1, u2, u3 = lds4(dyn[Q_AT + read * Q_STAGE:], r * QW + h * 4)
                    u0, u1, u2, u3 = u0 ^ LEVEL_BIAS, u1 ^ LEVEL_BIAS, u2 ^ LEVEL_BIAS, u3 ^ LEVEL_BIAS
                    sts4(t_s, r * KW + swizzled(r, 2 * h),
                         level_pair(u0, 0, 1), level_pair(u0, 2, 3), level_pair(u1, 0, 1), level_pair(u1, 2, 3))
                    sts4(t_s, r * KW + swizzled(r, 2 * h + 1),
                         level_pair(u2, 0, 1), level_pair(u2, 2, 3), level_pair(u3, 0, 1), level_pair(u3, 2, 3))
                if tid < BN:
                    lo, hi = f16x2_f32(dyn[E_AT + read * BN + tid])
                    d_s[tid] = hi if step & 1 else lo
                cuda.syncthreads()
            # B fragments of both k16 halves, then per fragment row A's, then the mma
            for kk in range(2):
                for p in range(FN // 2):
                    if quant:
                        b0, b1, b2, b3 = ldmatrix_x4(t_s, (b_word ^ HALF_WORDS * kk) + p * FRAG_WORDS)
                    else:
                        b0, b1, b2, b3 = ldmatrix_x4(dyn[B_AT + read * B_STAGE:],
                                                     (b_word ^ HALF_WORDS * kk) + p * FRAG_WORDS)
                    bf[kk, 2 * p, 0] = b0
                    bf[kk, 2 * p, 1] = b1
                    bf[kk, 2 * p + 1, 0] = b2
                    bf[kk, 2 * p + 1, 1] = b3
            for fm in range(FM):
                for kk in range(2):
                    a0, a1, a2, a3 = ldmatrix_x4(dyn[A_AT + read * A_STAGE:],
                                                 (a_word ^ HALF_WORDS * kk) + fm * FRAG_WORDS)
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
            read = uint32(read + 1) if read < stages - 1 else uint32(0)
        # the outputs: a lane's two columns (2 t4, 2 t4 + 1) of a fragment row in one store where y's
        # rows and the groups are of even length (the pair then aligned), else one at a time
        pairs = y.shape[1] % 2 == 0 and group_rows % 2 == 0
        for fm in range(FM):
            for h in range(2):
                t = t0 + wm + fm * 16 + g + 8 * h
                if t < n_tokens:
                    for fn in range(FN):
                        n = n0 + wn + fn * 8 + 2 * t4
                        v0, v1 = acc[fm, fn, 2 * h], acc[fm, fn, 2 * h + 1]
                        if out_bf16:
                            word = bf16x2(v0, v1)
                            if pairs and n + 1 < group_rows:
                                store_bf16x2(y, t, row0 + n, word)
                            else:
                                if n < group_rows:
                                    y[t, row0 + n] = word & 0xFFFF
                                if n + 1 < group_rows:
                                    y[t, row0 + n + 1] = word >> 16
                        elif pairs and n + 1 < group_rows:
                            store_f32x2(y, t, row0 + n, v0, v1)
                        else:
                            if n < group_rows:
                                y[t, row0 + n] = v0
                            if n + 1 < group_rows:
                                y[t, row0 + n + 1] = v1

    # the kernel runs with stages.gemm_pipe's globals, every name it reads being the same object
    # there: the simulator gives a launched kernel's module its own `cuda` (threadIdx and the rest),
    # and the package's simulator helpers (ldmatrix_x4's lane) read theirs from that module
    kernel = types.FunctionType(gemm_pipe_dyn.__code__, vars(pipe), "gemm_pipe_dyn", None,
                                gemm_pipe_dyn.__closure__)
    return cuda.jit(kernel) if SIM else cuda.jit(launch_bounds=(THREADS, 2))(kernel)  # type: ignore[call-arg]


def gemm_pipe_dyn(x, w, y, n_tokens: int, group_rows: int = 0, stream=0, stages: int = 4) -> None:
    """y[:n_tokens] = x[:n_tokens] @ w^T with `stages` shared stages (stages.gemm_pipe.gemm_pipe's
    arguments, rules and errors)."""
    if not takes(w, x.dtype):
        raise ValueError(f"gemm_pipe_dyn {w.name}: {w.gtype.name} weight [{w.n}, {w.k}] with {x.dtype} inputs "
                         f"is not supported (bf16 inputs; BF16 or Q8_0 weights, K a multiple of {BK})")
    groups, group_rows = product_groups("gemm_pipe_dyn", x, w, y, n_tokens, group_rows)
    if x.shape[1] % 8:
        raise ValueError(f"gemm_pipe_dyn {w.name}: x {x.shape}: its rows are not whole 16-byte pieces")
    if n_tokens == 0:
        return
    quant = w.gtype == GGMLType.Q8_0
    kernel = pipe_kernel_dyn(quant, y.dtype == np.uint16, stages)
    nbytes = shared_bytes(quant, stages)
    from numba import typeof

    args = (x, w.data, y, np.int64(n_tokens), np.int64(group_rows), np.int64(w.k))
    argtypes = tuple(typeof(a) for a in args)
    if (kernel, argtypes) not in _ALLOWED:  # once an overload: a driver call is microseconds a launch
        allow_dynamic_shared(kernel, argtypes, nbytes)
        _ALLOWED.add((kernel, argtypes))
    grid = ((group_rows + BN - 1) // BN, (n_tokens + BM - 1) // BM, groups)
    kernel[grid, THREADS, stream, nbytes](*args)
