"""Benchmark rows of the prefill GEMMs (docs/performance.md P5) at V4.1-Flash dimensions.

`prefill.gemm.<matrix>.<type>`: PREFILL_TOKENS tokens through one weight matrix of a layer (every
shape of flashv41.bench.gemv's SHAPES; the grouped wo_a in one call), our kernel (stages.linear's
choice: the warpgroup GEMM stages.gemm_wgmma for BF16 on a GPU of compute capability 9.0, the
pipelined GEMM stages.gemm_pipe for Q8_0 and for BF16 on other GPUs, the tensor-core GEMM
stages.linear_tc for Q2_K-Q6_K and MXFP4) against cuBLAS on the same shape through CuPy, fp16 in,
fp32 accumulate (the rate of bf16: CuPy has no bf16 type), timed in the same run. Bound = cuBLAS's
time, so ratio <= 2 meets P5 (>= 0.5x cuBLAS). Without CuPy the bound is the time at the tensor
cores' bf16 peak (PEAK_TFLOPS) and the note says so.

L2: a GEMM reuses its input tiles from the L2 by design, so nothing is rotated; what must not
happen is a repetition finding the previous one's weight, input and output still in the L2.
Where those (weight + [T, K] bf16 input + [T, N] bf16 output; for cuBLAS the fp16 operands)
are under 4x L2 (wq_a, wkv, wo_b and the index wq_b, every type), both our kernel and
cuBLAS run with the L2 evicted before each repetition (the read-only kernel of stages.bandwidth
reading 3x L2, on the same stream: CuPy runs on the Numba stream through cupy.cuda.ExternalStream),
each repetition timed with its own pair of events behind the sleeping kernel. The others are
timed back to back. Each row's JSON `l2` gives the plan of our kernel's timing; the note gives
cuBLAS's when it differs.

`prefill.gemm.pipe.<matrix>.BF16`: the same with gemm_pipe forced, the kernel gemm_wgmma displaced
for BF16 (on a GPU without wgmma the picked row's kernel too), so one run times wgmma, pipe and
cuBLAS on each shape. The note of every row names the kernel that ran.
"""

from __future__ import annotations

import numpy as np

from flashv41.bench.core import PEAK_TFLOPS, BenchCase, BenchContext, BenchOptions, BenchRow, L2Plan
from flashv41.bench.gemv import SHAPES, time_product

PREFILL_TOKENS = 4096


def cublas_time(ctx: BenchContext, t: int, n: int, k: int, groups: int) -> tuple[float, L2Plan] | None:
    """Median seconds of the same product on cuBLAS (CuPy fp16) and its L2 plan, or None
    without CuPy."""
    try:
        import cupy as cp
    except ImportError:
        return None
    from numba import cuda

    stream = cuda.stream()
    # the evictor and the events run on the Numba stream: CuPy is told to launch there too
    on_stream = cp.cuda.ExternalStream(int(stream.handle))  # type: ignore[attr-defined]
    with on_stream:
        a = [cp.asarray(np.random.default_rng(g).standard_normal((t, k)), dtype=cp.float16) for g in range(groups)]
        b = [cp.asarray(np.random.default_rng(g + 9).standard_normal((n // groups, k)), dtype=cp.float16).T
             for g in range(groups)]

    def product() -> None:
        with on_stream:
            for g in range(groups):  # one plain GEMM a group: CuPy's batched path skips the tensor cores
                a[g] @ b[g]

    data = 2 * (t * k * groups + n * k + t * n)  # fp16 inputs, weights and outputs
    try:
        return ctx.stage_time(product, data, stream, n=4, hold_s=0.02)
    finally:
        a.clear()
        b.clear()
        cp.get_default_memory_pool().free_all_blocks()


def prefill_case(matrix: str, n: int, k: int, groups: int, wtype: str, forced: str = "") -> BenchCase:
    """The row of PREFILL_TOKENS tokens through the matrix, `prefill.gemm.<matrix>.<type>`, with the
    kernel stages.linear picks, or `prefill.gemm.<forced>.<matrix>.<type>` with that kernel forced
    (stages.linear's name)."""
    name = f"prefill.gemm.{forced + '.' if forced else ''}{matrix}.{wtype}"

    def run(ctx: BenchContext) -> list[BenchRow]:
        t = PREFILL_TOKENS
        median, kernel, plan = time_product(ctx, matrix, n, k, groups, wtype, t, hold_s=0.02, kernel=forced)
        flops = 2 * t * n * k
        reference = cublas_time(ctx, t, n, k, groups)
        if reference is None:
            bound, against = flops / (PEAK_TFLOPS * 1e12), f"no CuPy: bound = the {PEAK_TFLOPS:.0f} TFLOP/s peak"
        else:
            bound, theirs = reference
            against = f"cuBLAS fp16 {flops / bound / 1e12:.0f} TFLOP/s"
            if theirs.mode != plan.mode:
                against += f" ({theirs.short()})"
        return [BenchRow(name, median, bound, flops=flops,
                         note=f"[{t} x {k}] @ [{n}, {k}]^T{f' in {groups} groups' if groups > 1 else ''}, "
                              f"{kernel}: {flops / median / 1e12:.0f} TFLOP/s; {against}", l2=plan)]

    return BenchCase(name, run)


DISPLACED = {"BF16": "pipe"}  # beside a type's picked prefill kernel, the one it displaced (forced)


def cases(options: BenchOptions) -> list[BenchCase]:
    rows = []
    for wtype in options.weight_types:
        for m, n, k, g in SHAPES:
            rows.append(prefill_case(m, n, k, g, wtype))
            if wtype in DISPLACED:
                rows.append(prefill_case(m, n, k, g, wtype, DISPLACED[wtype]))
    return rows
