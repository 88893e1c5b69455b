"""dev/gemm_wgmma.py against the oracle's linear (host.numerics), with tests/test_gemm_pipe.py's
weights and tests/bounds.py's rules through test_linear.check_groups: BF16 and Q8_0, bf16 and fp32
out, partial tiles, the ring of stages wrapping, a grouped product. `python -m pytest
dev/test_gemm_wgmma.py` on the simulator (wgmma emulated as mma.sync fragments side by side) or a GPU
(the real instruction, the flash shapes too); `python -m dev.test_gemm_wgmma` times it beside
gemm_pipe and cuBLAS (CuPy, where installed) at bench/gemv.py's prefill shapes, 4096 tokens."""

from __future__ import annotations

import sys
import time

import numpy as np
import pytest
from numba import cuda

from dev import gemm_wgmma as wg
from flashv41.host.numerics import bf16, from_bits, to_bits
from flashv41.host.quants import GGMLType
from flashv41.stages.device import SIM
from tests.test_gemm_pipe import weight
from tests.test_linear import check_groups

TYPES = [GGMLType.BF16, GGMLType.Q8_0]


def check(gtype, tokens, groups, rows, width, out_bf16, seed) -> float:
    w, wq = weight(groups * rows, width, gtype)
    x = bf16(np.random.default_rng(seed).standard_normal((tokens, groups * width)).astype(np.float32))
    y = cuda.device_array((tokens, groups * rows), np.uint16 if out_bf16 else np.float32)
    wg.gemm_wgmma(cuda.to_device(to_bits(x)), w, y, tokens, group_rows=rows if groups > 1 else 0)
    got = from_bits(y.copy_to_host()) if out_bf16 else y.copy_to_host()
    what = f"wgmma {gtype.name} [{groups * rows}, {width}] T={tokens} {'bf16' if out_bf16 else 'f32'} out"
    return check_groups(got, x, wq, rows, out_bf16, what, {})


@pytest.mark.parametrize("gtype", TYPES, ids=lambda t: t.name)
def test_partial_tiles_wrapping_stages(gtype):
    check(gtype, wg.BM + 5, 1, wg.BN + 8, (wg.STAGES + 1) * wg.BK, True, 1 + int(gtype))


@pytest.mark.parametrize("gtype", TYPES, ids=lambda t: t.name)
def test_grouped_f32_out(gtype):
    """Three groups, K of 2.5 steps: the last step's upper half zero-filled (Q8_0: the last scale
    word's upper half is the row's padding)."""
    check(gtype, 20, 3, 24, 5 * wg.BK // 2, False, 5 + int(gtype))


@pytest.mark.skipif(SIM, reason="the flash shapes take hours on the simulator")
@pytest.mark.parametrize("gtype", TYPES, ids=lambda t: t.name)
def test_flash_shape(gtype):
    check(gtype, 4096, 1, 4096, 4096, True, 9)


def time_them(tokens: int = 4096) -> None:
    from flashv41.bench.gemv import SHAPES
    from flashv41.stages.gemm_pipe import gemm_pipe

    try:
        import cupy
    except ImportError:
        cupy = None
    for name, n, k, groups in SHAPES:
        rows = n // groups
        flops = 2.0 * tokens * n * k
        x = cuda.to_device(to_bits(bf16(np.random.default_rng(1).standard_normal((tokens, k * groups))
                                        .astype(np.float32))))
        line = [f"{name:14s} [{n}, {k}] x{groups}"]
        for gtype in TYPES:
            w, _ = weight(n, k, gtype)
            y = cuda.device_array((tokens, n), np.uint16)
            for label, fn in (("pipe", gemm_pipe), ("wgmma", wg.gemm_wgmma)):
                fn(x, w, y, tokens, group_rows=rows if groups > 1 else 0)
                cuda.synchronize()
                best = 1e9
                for _ in range(5):
                    t = time.perf_counter()
                    fn(x, w, y, tokens, group_rows=rows if groups > 1 else 0)
                    cuda.synchronize()
                    best = min(best, time.perf_counter() - t)
                line.append(f"{gtype.name} {label} {best * 1e6:7.0f} us {flops / best / 1e12:5.0f} TF")
        if cupy is not None and groups == 1:
            a = cupy.random.standard_normal((tokens, k), dtype=cupy.float32).astype(cupy.float16)
            b = cupy.random.standard_normal((n, k), dtype=cupy.float32).astype(cupy.float16)
            a @ b.T
            cupy.cuda.Device().synchronize()
            best = 1e9
            for _ in range(5):
                t = time.perf_counter()
                a @ b.T
                cupy.cuda.Device().synchronize()
                best = min(best, time.perf_counter() - t)
            line.append(f"cuBLAS fp16 {best * 1e6:7.0f} us {flops / best / 1e12:5.0f} TF")
        print(" | ".join(line), flush=True)


if __name__ == "__main__":
    from flashv41.stages.backend import select_backend

    select_backend()
    time_them(int(sys.argv[1]) if len(sys.argv) > 1 else 4096)
