"""Does Hopper's `wgmma` reach us through Numba, and which shared-memory layout does its descriptor
mean? A GPU-only probe for issue 44 (prefill GEMMs >= 0.5x cuBLAS), run as
`python -m dev.wgmma_probe` on the GPU machine.

Why: numba-cuda 0.30 compiles a kernel for the device's arch-specific target on Hopper
(`CUDACodeLibrary._ensure_cc` gives (9, 0, "a"), so the PTX says `.target sm_90a`), and inline PTX
may then use `wgmma.mma_async`, the warpgroup matrix product that cuBLAS's prefill speed comes from
(mma.sync, which stages.gemm_pipe uses, reaches about half of it).

What it checks: one warpgroup (128 threads) computes D[64, 64] = A[64, K] B[64, K]^T in fp32 from
bf16 A and B in shared memory, K = 64 as four k16 steps, both operands K-major (rows of K, as x
[T, K] and a weight [N, K] are stored). The operands lie in the no-swizzle layout: "core matrices"
of 8 rows x 16 bytes (8 bf16 of K), 128 contiguous bytes each; core matrix (i along M or N, j along
K) at byte i * S_MN + j * S_K. The matrix descriptor carries two of those strides, the leading and
the stride dimension byte offsets; which is which for a K-major operand without swizzle is what
the probe finds out, by trying both and comparing with NumPy: the integer-valued inputs make every
product and sum exact, so the right one matches bit for bit and the wrong one does not.

Accumulator layout assumed (the PTX ISA's figure for m64nNk16 with fp32 D): warp w of the group
holds rows 16 w .. 16 w + 15; within it, register 4 j + r of lane l is row 16 w + l // 4 + 8 (r // 2),
column 8 j + 2 (l % 4) + r % 2, as mma.sync's m16n8 fragments side by side. A mismatch that is a
permutation of the right values says this part is wrong instead.

On an H100 (2026-12-07) the probe ended in CUDA_ERROR_ILLEGAL_ADDRESS (its per-case lines were
lost to the call's output limit): a descriptor with the strides swapped reads past the 16 KiB of
shared memory, and the error ends the context. The layout itself is settled by dev/gemm_wgmma.py,
whose flash-shape tests passed there with the leading byte offset the K stride (128) and the
stride byte offset the next 8 rows' (1024), as the PTX ISA describes K-major operands. To rerun it,
try one case a process.
"""

from __future__ import annotations

import os

import numpy as np
from llvmlite import ir
from numba import cuda, float32, types, uint32, uint64
from numba.cuda.extending import intrinsic

M = N = 64
K = 64
THREADS = 128
CORE = 128  # bytes of a core matrix: 8 rows x 16 bytes
N_ACC = N // 2  # fp32 accumulators a thread for m64n64
A_WORDS = M * K // 2  # words of an operand's shared image (M = N)


def _shared_address(context, builder, array_type, array):
    """The 32-bit `.shared` window address of a shared array's first byte."""
    data = context.make_array(array_type)(context, builder, array).data
    return builder.ptrtoint(builder.addrspacecast(data, ir.PointerType(data.type.pointee, 3)), ir.IntType(32))


@intrinsic
def shared_address(typingctx, a):
    """The `.shared` address (uint32) of the shared array a's first byte."""
    def codegen(context, builder, signature, args):
        return _shared_address(context, builder, signature.args[0], args[0])

    return types.uint32(a), codegen


def _statement(text: str):
    @intrinsic
    def statement(typingctx):
        def codegen(context, builder, signature, args):
            builder.call(ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), text, "~{memory}", side_effect=True), [])
            return context.get_dummy_value()

        return types.void(), codegen

    return statement


wgmma_fence = _statement("wgmma.fence.sync.aligned;")
wgmma_commit = _statement("wgmma.commit_group.sync.aligned;")
wgmma_wait0 = _statement("wgmma.wait_group.sync.aligned 0;")
fence_proxy_async = _statement("fence.proxy.async.shared::cta;")


@intrinsic
def wgmma_m64n64(typingctx, acc, desc_a, desc_b, accumulate):
    """acc[0 .. 31] (a local float32 array) = A B^T (+ acc where accumulate != 0): one
    `wgmma.mma_async` m64n64k16, bf16 inputs, fp32 out, the operands by their descriptors."""
    sig = types.void(acc, types.uint64, types.uint64, types.uint32)

    def codegen(context, builder, signature, args):
        arr_t = signature.args[0]
        arr = context.make_array(arr_t)(context, builder, args[0])
        f32 = ir.FloatType()
        ptrs = [builder.gep(arr.data, [ir.Constant(ir.IntType(64), i)]) for i in range(N_ACC)]
        vals = [builder.load(p) for p in ptrs]
        regs = ", ".join(f"${i}" for i in range(N_ACC))
        a, b, s = N_ACC * 2, N_ACC * 2 + 1, N_ACC * 2 + 2
        text = ("{ .reg .pred p; setp.ne.b32 p, $" + str(s) + ", 0; "
                "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {" + regs + "}, $" + str(a) + ", $"
                + str(b) + ", p, 1, 1, 0, 0; }")
        constraints = ",".join(["=f"] * N_ACC + [str(i) for i in range(N_ACC)] + ["l", "l", "r"]) + ",~{memory}"
        fn = ir.FunctionType(ir.LiteralStructType([f32] * N_ACC), [f32] * N_ACC + [ir.IntType(64)] * 2
                             + [ir.IntType(32)])
        got = builder.call(ir.InlineAsm(fn, text, constraints, side_effect=True), vals + list(args[1:]))
        for i in range(N_ACC):
            builder.store(builder.extract_value(got, i), ptrs[i])
        return context.get_dummy_value()

    return sig, codegen


@cuda.jit(device=True, inline="always")
def descriptor(address, lbo, sbo):
    """A shared-memory matrix descriptor, no swizzle: start address, leading and stride byte
    offsets, each in 16-byte units (bits 0-13, 16-29, 32-45)."""
    return (uint64((address >> 4) & 0x3FFF) | (uint64((lbo >> 4) & 0x3FFF) << 16)
            | (uint64((sbo >> 4) & 0x3FFF) << 32))


@cuda.jit
def probe_kernel(a_image, b_image, d, lbo, sbo, k_step_bytes):
    """a_image, b_image: the operands' shared images (uint32 words, laid out by the host); d [64, 64]
    float32 out. lbo, sbo: the descriptor's offsets; k_step_bytes: from one k16 step's start to the
    next."""
    a_s = cuda.shared.array(A_WORDS, uint32, alignment=128)
    b_s = cuda.shared.array(A_WORDS, uint32, alignment=128)
    tid = cuda.threadIdx.x
    for i in range(tid, A_WORDS, THREADS):
        a_s[i] = a_image[i]
        b_s[i] = b_image[i]
    fence_proxy_async()
    cuda.syncthreads()
    acc = cuda.local.array(N_ACC, float32)
    for i in range(N_ACC):
        acc[i] = float32(0)
    a0, b0 = shared_address(a_s), shared_address(b_s)
    wgmma_fence()
    for s in range(K // 16):
        wgmma_m64n64(acc, descriptor(a0 + uint32(s * k_step_bytes), lbo, sbo),
                     descriptor(b0 + uint32(s * k_step_bytes), lbo, sbo), uint32(s))
    wgmma_commit()
    wgmma_wait0()
    warp, lane = tid // 32, tid % 32
    for j in range(N // 8):
        for r in range(4):
            d[16 * warp + lane // 4 + 8 * (r // 2), 8 * j + 2 * (lane % 4) + r % 2] = acc[4 * j + r]


def image(mat: np.ndarray, s_mn: int, s_k: int) -> np.ndarray:
    """mat [R, K] bf16 bits (uint16) as the no-swizzle shared image: core matrix (i, j) of 8 rows x 8
    values at byte i s_mn + j s_k, its rows 16 bytes apart."""
    rows, k = mat.shape
    out = np.zeros(max((rows // 8 - 1) * s_mn + (k // 8 - 1) * s_k + CORE, rows * k * 2) // 2, np.uint16)
    for i in range(rows // 8):
        for j in range(k // 8):
            at = (i * s_mn + j * s_k) // 2
            out[at:at + 64] = mat[8 * i:8 * i + 8, 8 * j:8 * j + 8].reshape(-1)
    return out.view(np.uint32)


def main() -> None:
    rng = np.random.default_rng(7)
    a = rng.integers(-8, 9, (M, K)).astype(np.float32)
    b = rng.integers(-8, 9, (N, K)).astype(np.float32)
    want = a @ b.T
    bits = lambda v: (v.view(np.uint32) >> 16).astype(np.uint16)  # noqa: E731 (exact: small integers)
    print("PTX target:", [line for line in probe_kernel.inspect_asm(
        (types.uint32[::1], types.uint32[::1], types.float32[:, ::1], types.uint32, types.uint32, types.uint32)
    ).splitlines() if line.startswith(".target")] if os.environ.get("PROBE_PTX") else "(PROBE_PTX=1 to print)")
    # layouts: (S_MN, S_K) of the image; K-steps advance by two core matrices along K
    for name, s_mn, s_k in (("K-packed", 2 * CORE * (K // 16), CORE), ("MN-packed", CORE, CORE * M // 8)):
        ai, bi = image(bits(a), s_mn, s_k), image(bits(b), s_mn, s_k)
        for lbo, sbo, what in ((s_k, s_mn, "LBO=K stride"), (s_mn, s_k, "LBO=MN stride")):
            d = cuda.device_array((M, N), np.float32)
            try:
                probe_kernel[1, THREADS](cuda.to_device(ai), cuda.to_device(bi), d, lbo, sbo, 2 * s_k)
                got = d.copy_to_host()
                same = np.array_equal(got, want)
                perm = np.array_equal(np.sort(got.ravel()), np.sort(want.ravel()))
                print(f"{name:9s} S_MN={s_mn:5d} S_K={s_k:5d} {what:14s}: "
                      f"{'MATCH' if same else 'permuted' if perm else 'wrong'} (max err {np.abs(got - want).max()})")
            except Exception as exc:  # noqa: BLE001 (a probe: report and go on)
                print(f"{name} {what}: {type(exc).__name__}: {exc}")
                return


if __name__ == "__main__":
    main()
