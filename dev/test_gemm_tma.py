"""dev/gemm_tma.py against the oracle's linear (host.numerics), as tests/test_gemm_wgmma.py holds
stages.gemm_wgmma (tests/test_gemm_pipe.py's weights, tests/bounds.py's rules): bf16 and fp32 out,
partial tiles, the ring of stages wrapping more than once, grouped products, K an odd count of 32.
`python -m pytest dev/test_gemm_tma.py` on the simulator (TMA, mbarriers and wgmma emulated) or a
Hopper GPU (the flash shapes too); `python -m dev.test_gemm_tma` times it beside stages.gemm_wgmma
and cuBLAS fp16 (CuPy, where installed) at bench/gemv.py's prefill shapes, 4096 tokens."""

from __future__ import annotations

import sys

import pytest

from dev import gemm_tma as gt
from dev.gemm_harness import check_gemm
from flashv41.bench.gemv import SHAPES
from flashv41.host.quants import GGMLType
from flashv41.stages.device import SIM


def check(tokens, groups, rows, width, out_bf16, seed) -> float:
    return check_gemm("tma", gt.gemm_tma, GGMLType.BF16, tokens, groups, rows, width, out_bf16, seed)


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
    from dev.gemm_harness import time_shapes
    from flashv41.stages.gemm_wgmma import gemm_wgmma

    time_shapes(GGMLType.BF16, [("wgmma", gemm_wgmma), ("tma", gt.gemm_tma)], tokens)


if __name__ == "__main__":
    from flashv41.stages.backend import select_backend

    select_backend()
    time_them(int(sys.argv[1]) if len(sys.argv) > 1 else 4096)
