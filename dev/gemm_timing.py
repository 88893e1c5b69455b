"""The dev GEMMs' timing beside the kernels they would displace and cuBLAS fp16 (CuPy, where
installed): best of five wall-clock launches from Python at bench/gemv.py's prefill shapes, each
line one shape (`python -m dev.test_gemm_tma`, `python -m dev.test_gemm_wgmma_q8`)."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
from numba import cuda

from flashv41.bench.gemv import SHAPES
from flashv41.host.numerics import bf16, to_bits
from flashv41.host.quants import GGMLType
from tests.test_gemm_pipe import weight


def best_of(fn: Callable[[], object]) -> float:
    """Seconds of the fastest of five calls of fn (after one to compile and warm up)."""
    fn()
    cuda.synchronize()
    best = 1e9
    for _ in range(5):
        t = time.perf_counter()
        fn()
        cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return best


def time_shapes(gtype: GGMLType, kernels: list[tuple[str, Callable]], tokens: int = 4096) -> None:
    """Print, per prefill shape, each (label, kernel(x, w, y, tokens, group_rows=...)) and cuBLAS."""
    try:
        import cupy
    except ImportError:
        cupy = None
    for name, n, k, groups in SHAPES:
        rows = n // groups if groups > 1 else 0
        flops = 2.0 * tokens * n * k
        x = cuda.to_device(to_bits(bf16(np.random.default_rng(1).standard_normal((tokens, k * groups))
                                        .astype(np.float32))))
        w, _ = weight(n, k, gtype)
        y = cuda.device_array((tokens, n), np.uint16)
        line = [f"{name:14s} [{n}, {k}] x{groups}"]
        for label, fn in kernels:
            best = best_of(lambda fn=fn, x=x, w=w, y=y, rows=rows: fn(x, w, y, tokens, group_rows=rows))
            line.append(f"{gtype.name} {label} {best * 1e6:7.0f} us {flops / best / 1e12:5.0f} TF")
        if cupy is not None and groups == 1:
            a = cupy.random.standard_normal((tokens, k), dtype=cupy.float32).astype(cupy.float16)
            b = cupy.random.standard_normal((n, k), dtype=cupy.float32).astype(cupy.float16)
            best = best_of(lambda a=a, b=b: a @ b.T)
            line.append(f"cuBLAS fp16 {best * 1e6:7.0f} us {flops / best / 1e12:5.0f} TF")
        print(" | ".join(line), flush=True)
