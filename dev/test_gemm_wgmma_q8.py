"""dev/gemm_wgmma_q8.py against the oracle's linear (host.numerics), with tests/test_gemm_pipe.py's
Q8_0 weights and tests/bounds.py's rules through test_linear.check_groups: bf16 and fp32 out,
partial tiles along tokens and outputs, the ring of stages wrapping, a grouped product, K an odd
count of 32. `python -m pytest dev/test_gemm_wgmma_q8.py` on the simulator (wgmma emulated as
mma.sync fragments side by side) or a Hopper GPU (the flash shapes too); `python -m
dev.test_gemm_wgmma_q8` times it beside stages.gemm_pipe's Q8_0 and cuBLAS fp16 (CuPy, where
installed) at bench/gemv.py's prefill shapes, 4096 tokens."""

from __future__ import annotations

import sys

import pytest

from dev import gemm_wgmma_q8 as wq
from dev.gemm_harness import check_gemm
from flashv41.bench.gemv import SHAPES
from flashv41.host.quants import GGMLType
from flashv41.stages.device import SIM


def check(tokens, groups, rows, width, out_bf16, seed) -> float:
    return check_gemm("wgmma_q8", wq.gemm_wgmma_q8, GGMLType.Q8_0, tokens, groups, rows, width, out_bf16, seed)


def test_partial_tiles_wrapping_stages():
    """Two token tiles and two output tiles, each second one partial; K of STAGES + 1 steps."""
    check(wq.BT + 5, 1, wq.BO + 8, (wq.STAGES + 1) * wq.BK, True, 1)


def test_grouped_f32_out_half_step():
    """Three groups, fewer tokens and outputs than a tile, K of 2.5 steps (the last step's block 1
    absent, its scale the row's padding); fp32 out."""
    check(20, 3, 24, 5 * wq.BK // 2, False, 5)


@pytest.mark.skipif(SIM, reason="the flash shapes take hours on the simulator")
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s[0])
def test_flash_shapes(shape):
    """4096 tokens through every attention and engram matrix of the flash model (wo_a grouped)."""
    _, n, k, groups = shape
    check(4096, groups, n // groups, k, True, 9)


def time_them(tokens: int = 4096) -> None:
    from dev.gemm_harness import time_shapes
    from flashv41.stages.gemm_pipe import gemm_pipe

    time_shapes(GGMLType.Q8_0, [("pipe", gemm_pipe), ("wgmma_q8", wq.gemm_wgmma_q8)], tokens)


if __name__ == "__main__":
    from flashv41.stages.backend import select_backend

    select_backend()
    time_them(int(sys.argv[1]) if len(sys.argv) > 1 else 4096)
