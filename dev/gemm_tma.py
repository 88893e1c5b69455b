"""BF16 prefill GEMM on wgmma fed by the Tensor Memory Accelerator, one producer warp and two
consumer warpgroups meeting at mbarriers (issue 44; not in the package: it has not run on a GPU).

y[t, n] = sum_k x[t, k] w[n, k], the arguments and results of stages.gemm_wgmma (BF16 weights, bf16
inputs, bf16 or fp32 out, grouped products), with the same tiles (BM = 128 tokens x BN = 128
outputs a block, warpgroup c taking tokens 64 c .. 64 c + 63, K steps of 64, the 128-byte swizzled
K-major layout read by descriptor) and so the same roundings and oracle.

What differs, and why (stages.gemm_wgmma: 0.39-0.68x cuBLAS on an H100, 2026-12-07). There, all
256 threads issue eight 16-byte cp.async a step, then every step ends in `wgmma.wait_group 0`, a
cp.async wait and a block-wide barrier: the tensor cores drain at every step, and a block's two
warpgroups move in lockstep. Here:
- one thread issues a step's two tiles as two TMA copies (`cp.async.bulk.tensor`, the hardware
  writing the 128-byte swizzle and zero-filling past T, past a group's rows and past K), completing
  on the stage's `full` mbarrier with its byte count;
- each consumer warpgroup waits only on that mbarrier, issues its four wgmma, and keeps one step's
  group in flight (`wait_group 1`): the step before it is then done, and its warps arrive on that
  stage's `empty` mbarrier, which the producer waits on before refilling it. No block barrier in
  the K loop; STAGES = 4 stages ring.
- Grouped products and the tails come from the tensor maps: x as [T, groups, K] and w as [groups,
  group_rows, K] (3-D maps, a box one group of rows), so a box never reads another group's rows.

Expected (written before any GPU run): the per-step drain and barrier gone, a block's mainloop
should approach the tensor cores' rate less the epilogue; at one block an SM (288 threads, 4 x 32
KiB stages) about 0.6-0.75x cuBLAS on engram.wkv and attn.wo_b, where the K loop is long; the
short-K shapes (K = 1280: wq_b, index.wq_b) gain less (prologue and epilogue are a larger share).

SASS (ptxas 13.5, sm_90a, 2026-12-08): 90 registers, no stack, no spills; UTMALDG.3D for the copies,
SYNCS.* for the mbarriers, four HGMMA.64x128x16 a step. The host side (the tensor maps) needs a GPU
driver and has never run.

The tensor maps (cuTensorMapEncodeTiled, CUDA's driver through cuda.bindings) are 128-byte
descriptors the wrapper writes into device memory once per (array, shape); the kernel takes their
global address. On the simulator there is no TMA and no mbarrier: `tma_load` copies the box in
Python into the same swizzled layout (zeros past the tensor's ends) and the mbarriers are Python
objects with the PTX semantics used here (arrival counts, expected bytes, phase parity).
"""

from __future__ import annotations

import os
from functools import cache

import numpy as np
from numba import cuda, float32, uint32, uint64

from flashv41.host.quants import GGMLType
from flashv41.stages import gemm_pipe
from flashv41.stages import gemm_wgmma as wgm
from flashv41.stages.device import SIM, WARP, jit_kernel, launch_dynamic_shared
from flashv41.stages.gemm_wgmma import BK, BN, N_ACC, ROW_WORDS, chunk_word, wg_mma
from flashv41.stages.smem import ALIGN, store_pair

# TMA_STAGES=3 in the environment: three stages, 97 KiB, so two blocks share an SM (90 registers
# allow it); the default four (129 KiB) leaves one block an SM
STAGES = int(os.environ.get("TMA_STAGES", "4"))
BLOCKS_PER_SM = 2 if STAGES <= 3 else 1
WG = 4 * WARP
CONSUMERS = 1 if SIM else 2  # warpgroups of 64 tokens
BM = 64 * CONSUMERS
THREADS = CONSUMERS * WG + WARP  # the consumers, then the producer warp
PRODUCER = CONSUMERS * WG  # the producer warp's first thread (its lane 0 issues every copy)
A_STAGE = BM * ROW_WORDS  # words of a stage's x tile (BM rows x 128 bytes)
B_STAGE = BN * ROW_WORDS
STAGE_BYTES = 4 * (A_STAGE + B_STAGE)  # what a stage's two copies bring
B_AT = STAGES * A_STAGE
SHARED_WORDS = STAGES * (A_STAGE + B_STAGE) + wgm.ALIGN_WORDS
EMPTY_ARRIVALS = CONSUMERS * 4  # a consumer warp's lane 0 each
BARRIERS = 2 * STAGES  # [full of stage s, empty of stage s]
TYPES = (GGMLType.BF16,)

if SIM:
    import threading

    class MBarrier:
        """An mbarrier as this kernel uses it: a phase completes when `count` arrivals and every
        expected byte have come; waits name the parity of the phase they wait to complete."""

        def __init__(self):
            self.ready = threading.Condition()
            self.count = 0
            self.pending = 0
            self.tx = 0
            self.phase = 0

        def init(self, count):
            """(The simulator keeps a launch's shared arrays from one block to the next, its blocks
            one at a time: each block's init starts the barrier afresh.)"""
            with self.ready:
                self.count = self.pending = count
                self.tx = self.phase = 0

        def _arrive(self, tx):
            self.tx += tx
            self.pending -= 1
            self._complete()

        def _complete(self):
            if self.pending == 0 and self.tx == 0:
                self.phase += 1
                self.pending = self.count
                self.ready.notify_all()

        def arrive(self, expect_tx=0):
            with self.ready:
                self._arrive(expect_tx)

        def complete_tx(self, nbytes):
            with self.ready:
                self.tx -= nbytes
                self._complete()

        def wait(self, parity):
            with self.ready:
                while self.phase & 1 == parity:
                    if not self.ready.wait(30.0):
                        raise RuntimeError("mbarrier: a phase never completed")

    _FIRST = threading.Lock()

    def barriers():
        """The block's 2 STAGES mbarriers ([full of stage s, empty of stage s]), made by the first
        thread to ask (a shared array: one a block)."""
        bars = cuda.shared.array(2 * STAGES, np.object_)
        with _FIRST:
            if bars[0] is None:
                for i in range(2 * STAGES):
                    bars[i] = MBarrier()
        return bars

    def mbar_init(bars, i, count):
        bars[i].init(count)

    def mbar_arrive(bars, i):
        bars[i].arrive()

    def mbar_arrive_tx(bars, i, nbytes):
        bars[i].arrive(nbytes)

    def mbar_wait(bars, i, parity):
        bars[i].wait(int(parity))

    def fence_init():
        """Nothing to order here."""

    def tma_load(smem, word, src, desc, c0, c1, c2, rows, bars, i):
        """The box at coordinates (c0, c1, c2) of the source's tensor map (tensor_map's orders: x
        (K, groups, T), w (K, rows, groups); desc = (rows of a group, K, groups, whether x)): `rows`
        rows of BK values into the swizzled tile at word `word`, zeros past the ends; then its bytes
        complete on barrier i."""
        extent, kk, is_x = desc[0], desc[1], desc[3]
        k, row, group = (c0, c2, c1) if is_x else (c0, c1, c2)
        flat = smem.reshape(-1)
        s16 = src.view(np.uint16)
        for r in range(rows):
            for c in range(BK // 2):  # bf16 pairs of the row
                v = [0, 0]
                for h in range(2):
                    kc = k + 2 * c + h
                    t = row + r
                    if t < extent and kc < kk:
                        v[h] = int(s16[t, group * kk + kc]) if is_x else int(s16[group * extent + t, kc])
                flat[word + chunk_word(r, c >> 2) + (c & 3)] = uint32(v[0] | (v[1] << 16))
        bars[i].complete_tx(4 * rows * ROW_WORDS)

    def align_words(smem):
        return 0

    def wg_wait_one():
        """Nothing is asynchronous here."""

    wg_fence = wg_commit = wg_wait = wg_wait_one
else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    from flashv41.stages.gemm_wgmma import align_words, wg_commit, wg_fence, wg_wait
    from flashv41.stages.smem import _shared_word, _statement

    wg_wait_one = _statement("wgmma.wait_group.sync.aligned 1;", "~{memory}")  # all but the newest group
    fence_init = _statement("fence.mbarrier_init.release.cluster;", "~{memory}")

    @cuda.jit(device=True, inline="always")
    def barriers():
        """The block's 2 STAGES mbarriers (8 bytes each): [full of stage s, empty of stage s]."""
        return cuda.shared.array(BARRIERS, uint64)

    def _bar_address(context, builder, signature, args):
        """The 32-bit shared address of mbarrier args[1] of the array args[0] (8 bytes each)."""
        a, i32 = signature.args, ir.IntType(32)
        base = _shared_word(context, builder, a[0], args[0], ir.Constant(i32, 0), types.uint32)
        return builder.add(base, builder.shl(context.cast(builder, args[1], a[1], types.uint32), ir.Constant(i32, 3)))

    def _bar_op(text: str, with_value: bool):
        """An intrinsic (bars, i) or (bars, i, value): one PTX statement on mbarrier i of bars ($0 its
        address, $1 the value)."""
        def codegen(context, builder, signature, args):
            values = [_bar_address(context, builder, signature, args)]
            if with_value:
                values.append(context.cast(builder, args[2], signature.args[2], types.uint32))
            fn = ir.FunctionType(ir.VoidType(), [ir.IntType(32)] * len(values))
            builder.call(ir.InlineAsm(fn, text, ",".join(["r"] * len(values)) + ",~{memory}", side_effect=True),
                         values)
            return context.get_dummy_value()

        if with_value:
            @intrinsic
            def op_value(typingctx, bars, i, value):
                return types.void(bars, i, value), codegen

            return op_value

        @intrinsic
        def op(typingctx, bars, i):
            return types.void(bars, i), codegen

        return op

    _init = _bar_op("mbarrier.init.shared::cta.b64 [$0], $1;", True)
    _arrive = _bar_op("mbarrier.arrive.shared::cta.b64 _, [$0];", False)
    _arrive_tx = _bar_op("mbarrier.arrive.expect_tx.shared::cta.b64 _, [$0], $1;", True)
    _wait = _bar_op("{ .reg .pred done; wait_${:uid}: mbarrier.try_wait.parity.shared::cta.b64 done, [$0], $1; "
                    "@!done bra wait_${:uid}; }", True)

    @cuda.jit(device=True, inline="always")
    def mbar_init(bars, i, count):
        _init(bars, i, uint32(count))

    @cuda.jit(device=True, inline="always")
    def mbar_arrive(bars, i):
        _arrive(bars, i)

    @cuda.jit(device=True, inline="always")
    def mbar_arrive_tx(bars, i, nbytes):
        _arrive_tx(bars, i, uint32(nbytes))

    @cuda.jit(device=True, inline="always")
    def mbar_wait(bars, i, parity):
        _wait(bars, i, uint32(parity))

    @intrinsic
    def _tma(typingctx, smem, word, desc, c0, c1, c2, bars, i):
        """`cp.async.bulk.tensor.3d` of the box at coordinates (c0, c1, c2) of the tensor map at
        desc's address (a device array holding it) into word `word` of smem, completing on mbarrier
        i of bars."""
        sig = types.void(smem, word, desc, types.uint32, types.uint32, types.uint32, bars, i)

        def codegen(context, builder, signature, args):
            a = signature.args
            i32 = ir.IntType(32)
            to = _shared_word(context, builder, a[0], args[0], args[1], a[1])
            tmap = builder.ptrtoint(context.make_array(a[2])(context, builder, args[2]).data, ir.IntType(64))
            bar = _bar_address(context, builder, types.void(a[6], a[7]), args[6:8])
            fn = ir.FunctionType(ir.VoidType(), [i32, ir.IntType(64), i32, i32, i32, i32])
            text = ("cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes "
                    "[$0], [$1, {$2, $3, $4}], [$5];")
            builder.call(ir.InlineAsm(fn, text, "r,l,r,r,r,r,~{memory}", side_effect=True),
                         [to, tmap, args[3], args[4], args[5], bar])
            return context.get_dummy_value()

        return sig, codegen

    @cuda.jit(device=True, inline="always")
    def tma_load(smem, word, src, desc, c0, c1, c2, rows, bars, i):
        _tma(smem, word, desc, uint32(c0), uint32(c1), uint32(c2), bars, i)


@cache
def tma_kernel(out_bf16: bool):
    """Tiles of BM tokens x BN outputs of one group; block = THREADS, grid = (output tiles per group,
    token tiles, groups); SHARED_WORDS words of dynamic shared memory. x_desc / w_desc: the tensor
    maps' device arrays on a GPU, (extent, K, groups, x-or-w) on the simulator."""

    @jit_kernel((THREADS, BLOCKS_PER_SM))
    def gemm_tma(x, w, x_desc, w_desc, y, n_tokens, n_rows, width):
        dynamic = cuda.shared.array(0, uint32, alignment=ALIGN) if ALIGN else cuda.shared.array(0, uint32)
        smem = dynamic[align_words(dynamic):]
        out_s = smem.view(np.float32)
        bars = barriers()
        tid = uint32(cuda.threadIdx.x)
        group_rows = uint32(n_rows)
        k = uint32(width)
        n0 = uint32(cuda.blockIdx.x) * BN
        t0 = uint32(cuda.blockIdx.y) * BM
        group = uint32(cuda.blockIdx.z)
        n_steps = (k + BK - 1) // BK
        if tid == 0:
            for s in range(STAGES):
                mbar_init(bars, s, 1)  # full: the producer's arrival (and the copies' bytes)
                mbar_init(bars, STAGES + s, EMPTY_ARRIVALS)  # empty: each consumer warp's
            fence_init()
        cuda.syncthreads()
        acc = cuda.local.array(N_ACC, float32)
        for i in range(N_ACC):
            acc[i] = float32(0)
        if tid >= PRODUCER:
            if tid == PRODUCER:
                for it in range(n_steps):
                    stage = it % STAGES
                    if it >= STAGES:  # the consumers done with this stage's previous round
                        mbar_wait(bars, STAGES + stage, ((it // STAGES) - 1) & 1)
                    mbar_arrive_tx(bars, stage, STAGE_BYTES)
                    tma_load(smem, stage * A_STAGE, x, x_desc, it * BK, group, t0, BM, bars, stage)
                    tma_load(smem, B_AT + stage * B_STAGE, w, w_desc, it * BK, n0, group, BN, bars, stage)
        else:
            wg = tid // WG
            lane = tid % WARP
            a_rows = wg * (64 // 8) * wgm.GROUP_WORDS  # the warpgroup's 64 rows in a stage's x tile
            for it in range(n_steps):
                stage = it % STAGES
                mbar_wait(bars, stage, (it // STAGES) & 1)
                wg_fence()
                for s in range(BK // 16):
                    wg_mma(acc, smem, a_rows + stage * A_STAGE, B_AT + stage * B_STAGE, s, 1)
                wg_commit()
                wg_wait_one()  # the step before is done: its stage goes back to the producer
                if it > 0 and lane == 0:
                    mbar_arrive(bars, STAGES + (it - 1) % STAGES)
            wg_wait()
        cuda.syncthreads()  # every stage read (and every copy landed): the tiles' memory is free
        if tid < PRODUCER:
            for i in range(N_ACC):
                out_s[i * PRODUCER + tid] = acc[i]
        cuda.syncthreads()
        if tid < PRODUCER:
            wg = tid // WG
            lane = tid % WARP
            v = (tid // WARP) % 4
            g, t4 = lane >> 2, lane & 3
            row0 = group * group_rows
            pairs = y.shape[1] % 2 == 0 and group_rows % 2 == 0
            for h in range(2):
                t = t0 + wg * 64 + v * 16 + g + 8 * h
                if t < n_tokens:
                    for j in range(BN // 8):
                        n = n0 + 8 * j + 2 * t4
                        if n < group_rows:
                            store_pair(y, t, row0, n, group_rows, out_s[(4 * j + 2 * h) * PRODUCER + tid],
                                       out_s[(4 * j + 2 * h + 1) * PRODUCER + tid], pairs, out_bf16)

    return gemm_tma


_MAPS: dict = {}  # (pointer, shape, strides, box rows) -> the tensor map's device array


def tensor_map(a, extent: int, k: int, groups: int, box_rows: int, is_x: bool):
    """The device array holding the 3-D tensor map of a bf16 matrix seen as [extent rows, groups, K]
    (x: rows are tokens, each row `groups` runs of K; box 1 group x box_rows rows) or [groups,
    extent rows, K] (w; box box_rows rows of 1 group), BK values a box row, 128-byte swizzle, zeros
    past the ends; coordinates in the map's order, K first (tma_load). On the simulator a tuple
    (extent, K, groups, is_x) for tma_load's emulation."""
    if SIM:
        return np.array([extent, k, groups, int(is_x)], np.int64)
    pitch = a.strides[0]  # bytes from one row to the next
    key = (a.device_ctypes_pointer.value, a.shape, pitch, box_rows, is_x, extent, k, groups)
    if key not in _MAPS:
        from cuda.bindings import driver as cu

        base = a.device_ctypes_pointer.value
        if is_x:  # dims (K, groups, rows): a group's run K values on, a token a row on; box (BK, 1, rows)
            dims, strides, box = (k, groups, extent), (2 * k, pitch), (BK, 1, box_rows)
        else:  # (K, rows, groups): a row a row on, a group group_rows rows on; box (BK, rows, 1)
            dims, strides, box = (k, extent, groups), (pitch, pitch * extent), (BK, box_rows, 1)
        err, tmap = cu.cuTensorMapEncodeTiled(
            cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, base,
            [cu.cuuint64_t(d) for d in dims], [cu.cuuint64_t(s) for s in strides],
            [cu.cuuint32_t(b) for b in box],
            [cu.cuuint32_t(1)] * 3, cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
            cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
            cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
        if err != cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuTensorMapEncodeTiled: {err}")
        _MAPS[key] = cuda.to_device(np.array([int(v) for v in tmap.opaque], np.uint64))
    return _MAPS[key]


def gemm_tma(x, w, y, n_tokens: int, group_rows: int = 0, stream=0) -> None:
    """y[:n_tokens] = x[:n_tokens] @ w^T, as stages.gemm_wgmma.gemm_wgmma."""
    if not wgm.takes(w, x.dtype):
        raise ValueError(f"gemm_tma {w.name}: {w.gtype.name} weight with {x.dtype} inputs is not supported")
    if not SIM and wgm.device_capability() != wgm.WGMMA_CAPABILITY:
        raise ValueError(f"gemm_tma {w.name}: compute capability {wgm.device_capability()} has no wgmma")
    groups, group_rows = gemm_pipe.piece_groups("gemm_tma", x, w, y, n_tokens, group_rows)
    if n_tokens == 0:
        return
    x_desc = tensor_map(x, n_tokens, w.k, groups, BM, True)
    w_desc = tensor_map(w.data, group_rows, w.k, groups, BN, False)
    grid = ((group_rows + BN - 1) // BN, (n_tokens + BM - 1) // BM, groups)
    launch_dynamic_shared(tma_kernel(y.dtype == np.uint16), grid, THREADS, stream, 4 * SHARED_WORDS,
                          x, w.data, x_desc, w_desc, y, n_tokens, group_rows, w.k)
