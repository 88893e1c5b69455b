"""The dev GEMMs' check against the oracle and their timing: `check_gemm` holds a product to the
oracle's linear as tests/test_gemm_pipe.py's check_gemm holds the package's (its weights,
tests/bounds.py's rules through test_linear.check_groups), for a kernel called directly;
`time_shapes` times kernels beside the ones they would displace and cuBLAS fp16 (CuPy, where
installed): best of five wall-clock launches from Python at bench/gemv.py's prefill shapes, each
line one shape (`python -m dev.test_gemm_tma`, `python -m dev.test_gemm_wgmma_q8`)."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
from numba import cuda

from flashv41.bench.gemv import SHAPES
from flashv41.host.numerics import bf16, from_bits, to_bits
from flashv41.host.quants import GGMLType
from tests.test_gemm_pipe import weight
from tests.test_linear import check_groups


def check_gemm(label: str, fn: Callable, gtype: GGMLType, tokens: int, groups: int, rows: int, width: int,
               out_bf16: bool, seed: int) -> float:
    """fn(x, w, y, tokens, group_rows=...) on seeded bf16 inputs [tokens, groups * width] and a
    random weight of gtype [groups * rows, width], every group held to the oracle; check_groups'
    figure."""
    w, wq = weight(groups * rows, width, gtype)
    x = bf16(np.random.default_rng(seed).standard_normal((tokens, groups * width)).astype(np.float32))
    y = cuda.device_array((tokens, groups * rows), np.uint16 if out_bf16 else np.float32)
    fn(cuda.to_device(to_bits(x)), w, y, tokens, group_rows=rows if groups > 1 else 0)
    got = from_bits(y.copy_to_host()) if out_bf16 else y.copy_to_host()
    what = f"{label} {gtype.name} [{groups * rows}, {width}] T={tokens} {'bf16' if out_bf16 else 'f32'} out"
    return check_groups(got, x, wq, rows, out_bf16, what, {})


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
