"""The warp's bf16 tensor-core product, one 16x8x16 tile: `mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32`,
the primitive under every tensor-core kernel (the prefill GEMM, the narrow product, the index scores,
the sparse attention), and its emulation on the simulator.

On a GPU `mma` is an intrinsic emitting the PTX instruction through llvmlite inline assembly. On the
simulator it is emulated: the 32 lanes of a warp meet at each call and the last to come computes the
warp's tile from all their fragment registers, exactly (float64 sums of products of bf16 values),
while the others wait. `warp_meet` is that meeting with the tile left to the caller, for the other
emulated warp instructions (stages.linear_imma's integer mma, stages.gemm_pipe's ldmatrix).

Kernels call `kernel_mma` (and, on the simulator, `kernel_warp_meet`).
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from flashv41.stages.device import SIM, WARP

MAX_WARPS = 32  # the most warps a block can hold (1024 threads)

if SIM:
    import threading

    from flashv41.stages.device import _BF16_VALUES

    MMA_WAIT_S = 30.0  # a lane that waits longer for the rest of its warp: one of them has failed

    class WarpMeeting:
        """Where the 32 lanes of a simulated warp meet at each mma: the last to come computes the
        warp's tile from all their fragments while the others wait. A barrier of the warp alone:
        the simulator's barrier of the block costs several times more."""

        def __init__(self):
            self.ready = threading.Condition()
            self.regs = np.zeros((WARP, 6), np.uint32)  # [lane, register] this call's fragments
            self.come = 0  # lanes whose fragments are in
            self.calls = 0  # calls completed
            self.d = np.zeros((16, 8))  # the last call's tile (A @ B)

    _LANE = threading.local()  # a simulated thread's meeting place
    _FIRST = threading.Lock()

    def meeting(tid):
        """The meeting of thread tid's warp: one a warp of each block (they live in a shared array,
        which the simulator allocates once a block), found at a thread's first call."""
        place = getattr(_LANE, "meeting", None)
        if place is None:
            warps = cuda.shared.array(MAX_WARPS, np.object_)  # [warp]
            with _FIRST:
                if warps[tid // WARP] is None:
                    warps[tid // WARP] = WarpMeeting()
            place = _LANE.meeting = warps[tid // WARP]
        return place

    def warp_tile(regs):
        """A @ B (float64, exact: 16 products of 8-bit values) from the 32 lanes' registers [lane, 6]."""
        # [g, t, reg, half]: lane 4g + t's registers, each two bf16 (the lower column in the low half)
        vals = _BF16_VALUES[np.stack([regs & 0xFFFF, regs >> 16], axis=-1).reshape(8, 4, 6, 2)]
        a = np.empty((16, 16), np.float64)
        a[:8, :8], a[8:, :8] = vals[:, :, 0].reshape(8, 8), vals[:, :, 1].reshape(8, 8)
        a[:8, 8:], a[8:, 8:] = vals[:, :, 2].reshape(8, 8), vals[:, :, 3].reshape(8, 8)
        bt = np.concatenate([vals[:, :, 4].reshape(8, 8), vals[:, :, 5].reshape(8, 8)], axis=1)  # B^T [n, k]
        return a @ bt.T

    def warp_meet(regs, tile):
        """The lanes of the calling warp meet, each bringing its six fragment registers `regs`; the
        last to come computes tile(registers [lane, 6]) for the warp, and every lane returns it.
        The mma emulations (this module's, stages.linear_imma's) differ only in their tile."""
        tid = cuda.threadIdx.x
        place = meeting(tid)
        with place.ready:
            call = place.calls
            place.regs[tid % WARP] = regs
            place.come += 1
            if place.come == WARP:
                place.d = tile(place.regs)
                place.come = 0
                place.calls += 1
                place.ready.notify_all()
            while place.calls == call:
                if not place.ready.wait(MMA_WAIT_S):
                    raise RuntimeError(f"mma: the rest of warp {tid // WARP} never came")
            return place.d

    def mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        """The warp's 16x8 tile D = A @ B + C, from the lanes' fragments (PTX m16n8k16 layout)."""
        tid = cuda.threadIdx.x
        d = warp_meet((a0, a1, a2, a3, b0, b1), warp_tile)
        g, t = (tid % WARP) >> 2, tid & 3
        return (np.float32(d[g, 2 * t] + c0), np.float32(d[g, 2 * t + 1] + c1),
                np.float32(d[g + 8, 2 * t] + c2), np.float32(d[g + 8, 2 * t + 1] + c3))
else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    @intrinsic
    def mma(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        """D = A @ B + C on one 16x8x16 tile: `mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32`.
        Lane (g, t) = (lane >> 2, lane & 3) holds A (row-major, bf16 pairs) at rows g, g+8 and
        columns 2t, 2t+8 (a0 (g, 2t), a1 (g+8, 2t), a2 (g, 2t+8), a3 (g+8, 2t+8)); B^T (output-major)
        at row g, columns 2t (b0), 2t+8 (b1); C and D at rows g, g+8, columns 2t, 2t+1."""
        sig = types.UniTuple(types.float32, 4)(*([types.uint32] * 6), *([types.float32] * 4))

        def codegen(context, builder, sig, args):
            f32 = ir.FloatType()
            fn = ir.FunctionType(ir.LiteralStructType([f32] * 4), [ir.IntType(32)] * 6 + [f32] * 4)
            asm = ir.InlineAsm(fn, "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                               "{$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, {$10,$11,$12,$13};",
                               "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f")
            d = builder.call(asm, args)
            return context.make_tuple(builder, sig.return_type, [builder.extract_value(d, i) for i in range(4)])

        return sig, codegen

# mma as the kernels call it: on the simulator a device function, which gets this module's
# simulated `cuda` (the thread indices) when a kernel of another module calls it; the meeting
# itself likewise, for the integer and ldmatrix emulations (stages.linear_imma, stages.gemm_pipe)
kernel_mma = cuda.jit(device=True)(mma) if SIM else mma
if SIM:
    kernel_warp_meet = cuda.jit(device=True)(warp_meet)
