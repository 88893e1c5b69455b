"""Benchmark rows of the prefill GEMMs (PERF.md P5) at V4.1-Flash dimensions.

`prefill.gemm.<matrix>.<type>`: PREFILL_TOKENS tokens through one weight matrix of a layer (every
shape of flashv41.bench_gemv's SHAPES; the grouped wo_a in one call), our kernel (stages.linear's
choice: the tensor cores where they apply) against cuBLAS on the same shape through CuPy, fp16
in, fp32 accumulate (the rate of bf16: CuPy has no bf16 type), timed in the same run. Bound =
cuBLAS's time, so ratio <= 2 meets P5 (>= 0.5x cuBLAS). Without CuPy the bound is the time at
the tensor cores' bf16 peak (PEAK_TFLOPS) and the note says so.
"""

from __future__ import annotations

import statistics

import numpy as np

from flashv41.bench import BenchCase, BenchContext, BenchOptions, BenchRow
from flashv41.bench_gemv import SHAPES, time_product

PREFILL_TOKENS = 4096
PEAK_TFLOPS = 790.0  # H200 dense bf16, PERF.md


def cublas_time(t: int, n: int, k: int, groups: int, reps: int) -> float | None:
    """Median seconds of the same product on cuBLAS (CuPy fp16), or None without CuPy."""
    try:
        import cupy as cp
    except ImportError:
        return None
    a = [cp.asarray(np.random.default_rng(g).standard_normal((t, k)), dtype=cp.float16) for g in range(groups)]
    b = [cp.asarray(np.random.default_rng(g + 9).standard_normal((n // groups, k)), dtype=cp.float16).T
         for g in range(groups)]

    def product() -> None:
        for g in range(groups):  # one plain GEMM a group: CuPy's batched path skips the tensor cores
            a[g] @ b[g]

    for _ in range(3):
        product()
    start, end = cp.cuda.Event(), cp.cuda.Event()
    times = []
    for _ in range(reps):
        start.record()
        for _ in range(4):
            product()
        end.record()
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end) / 1e3 / 4)
    return statistics.median(times)


def prefill_case(matrix: str, n: int, k: int, groups: int, wtype: str) -> BenchCase:
    name = f"prefill.gemm.{matrix}.{wtype}"

    def run(ctx: BenchContext) -> list[BenchRow]:
        t = PREFILL_TOKENS
        median, kernel = time_product(ctx, matrix, n, k, groups, wtype, t, hold_s=0.02)
        flops = 2 * t * n * k
        reference = cublas_time(t, n, k, groups, ctx.options.reps)
        if reference is None:
            bound, against = flops / (PEAK_TFLOPS * 1e12), f"no CuPy: bound = the {PEAK_TFLOPS:.0f} TFLOP/s peak"
        else:
            bound, against = reference, f"cuBLAS fp16 {flops / reference / 1e12:.0f} TFLOP/s"
        return [BenchRow(name, median, bound, flops=flops,
                         note=f"[{t} x {k}] @ [{n}, {k}]^T{f' in {groups} groups' if groups > 1 else ''}, "
                              f"{kernel}: {flops / median / 1e12:.0f} TFLOP/s; {against}")]

    return BenchCase(name, run)


def cases(options: BenchOptions) -> list[BenchCase]:
    return [prefill_case(m, n, k, g, wtype) for wtype in options.weight_types for m, n, k, g in SHAPES]
