"""dev/gemm_tma.py against the oracle's linear (host.numerics), as tests/test_gemm_wgmma.py holds
stages.gemm_wgmma (tests/test_gemm_pipe.py's weights, tests/bounds.py's rules): bf16 and fp32 out,
partial tiles, the ring of stages wrapping more than once, grouped products, K an odd count of 32.
`python -m pytest dev/test_gemm_tma.py` on the simulator (TMA, mbarriers and wgmma emulated) or a
Hopper GPU (the flash shapes too); `python -m dev.test_gemm_tma` times it beside stages.gemm_wgmma
and cuBLAS fp16 (CuPy, where installed) at bench/gemv.py's prefill shapes, 4096 tokens."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from numba import cuda

from dev import gemm_tma as gt
from flashv41.bench.gemv import SHAPES
from flashv41.host.numerics import bf16, from_bits, to_bits
from flashv41.host.quants import GGMLType
from flashv41.stages.device import SIM
from tests.test_gemm_pipe import weight
from tests.test_linear import check_groups


def check(tokens, groups, rows, width, out_bf16, seed) -> float:
    w, wq = weight(groups * rows, width, GGMLType.BF16)
    x = bf16(np.random.default_rng(seed).standard_normal((tokens, groups * width)).astype(np.float32))
    y = cuda.device_array((tokens, groups * rows), np.uint16 if out_bf16 else np.float32)
    gt.gemm_tma(cuda.to_device(to_bits(x)), w, y, tokens, group_rows=rows if groups > 1 else 0)
    got = from_bits(y.copy_to_host()) if out_bf16 else y.copy_to_host()
    what = f"tma [{groups * rows}, {width}] T={tokens} {'bf16' if out_bf16 else 'f32'} out"
    return check_groups(got, x, wq, rows, out_bf16, what, {})


def test_partial_tiles_wrapping_stages():
    """Two token tiles and two output tiles, each second one partial; K of 2 STAGES + 1 steps, so
    each stage's mbarriers go round more than once."""
    check(gt.BM + 5, 1, gt.BN + 8, (2 * gt.STAGES + 1) * gt.BK, True, 1)


def test_grouped_f32_out_half_step():
    """Three groups, fewer tokens and outputs than a tile, K of 2.5 steps; fp32 out."""
    check(20, 3, 24, 5 * gt.BK // 2, False, 5)


@pytest.mark.skipif(SIM, reason="the flash shapes take hours on the simulator")
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s[0])
def test_flash_shapes(shape):
    _, n, k, groups = shape
    check(4096, groups, n // groups, k, True, 9)


def time_them(tokens: int = 4096) -> None:
    from dev.gemm_timing import time_shapes
    from flashv41.stages.gemm_wgmma import gemm_wgmma

    time_shapes(GGMLType.BF16, [("wgmma", gemm_wgmma), ("tma", gt.gemm_tma)], tokens)


if __name__ == "__main__":
    from flashv41.stages.backend import select_backend

    select_backend()
    time_them(int(sys.argv[1]) if len(sys.argv) > 1 else 4096)
