"""stages.gemm_wgmma against the oracle's linear (host.numerics): BF16 weights, bf16 and fp32
outputs, partial tiles along tokens and outputs, more K steps than shared stages (the ring of stages
wraps), the grouped product, K an odd count of 32 (a half step), through tests/test_gemm_pipe.py's
check_gemm (test_linear_tc's random weights, test_linear.check_groups: tests/bounds.py's rules,
bf16 out at least 99% of outputs bit-equal to the oracle, every output within the sqrt(K) bound; fp32
out the bound). On the simulator wgmma is emulated as mma.sync fragments side by side, a block one
warpgroup of 64 tokens x 32 outputs; the flash shapes run on a GPU of compute capability 9.0 (4096
tokens, bench/gemv.py's SHAPES). Its broken kernels are tests/test_mutants_products.py's
(test_wgmma_mutants); stages.linear's pick of it, test_linear.py's. Run with -s to see each check's
figure."""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda  # noqa: E402  (after conftest chose the backend)

from flashv41.bench.gemv import SHAPES
from flashv41.host.quants import GGMLType
from flashv41.stages import gemm_wgmma as wg
from flashv41.stages.device import SIM
from flashv41.stages.linear import linear, pick_kernel
from tests.test_gemm_pipe import check_gemm, check_refusals, weight


def check_wgmma(tokens, groups, rows, width, out_bf16, seed) -> float:
    """check_gemm of gemm_wgmma (BF16 weights)."""
    return check_gemm("wgmma", GGMLType.BF16, tokens, groups, rows, width, out_bf16, seed)


def test_partial_tiles_wrapping_stages():
    """Two token tiles and two output tiles, each second one partial (T, N not multiples of the
    tile); K of STAGES + 1 steps, so the ring of stages wraps. Simulator: 100% bit-equal."""
    check_wgmma(wg.BM + 5, 1, wg.BN + 8, (wg.STAGES + 1) * wg.BK, True, 1)


def test_grouped_f32_out_half_step():
    """The attention's wo_a: three groups of outputs, each reading its own slice of the inputs (grid
    z), fewer tokens and outputs than a tile; K of 2.5 steps, the last step's values 32-63
    zero-filled; fp32 out. Simulator: largest error 0.009 of the bound."""
    check_wgmma(20, 3, 24, 5 * wg.BK // 2, False, 5)


def test_refuses_what_it_does_not_take():
    """A Q8_0 weight (gemm_pipe's), fp32 inputs, input rows not of whole 16-byte pieces: ValueError
    naming the weight."""
    check_refusals("wgmma", GGMLType.Q8_0, 64)


def test_refuses_a_gpu_without_wgmma(monkeypatch: pytest.MonkeyPatch):
    """On a GPU of another compute capability than 9.0 (here pretended: an sm_80) forcing it is a
    ValueError naming the weight, not a PTX error; the simulator emulates wgmma and takes it."""
    monkeypatch.setattr(wg, "SIM", False)
    monkeypatch.setattr(wg, "device_capability", lambda: (8, 0))
    wb, _ = weight(16, 64, GGMLType.BF16)
    wb.name = "blk.0.attn_q_a"
    with pytest.raises(ValueError, match=r"blk.0.attn_q_a: a GPU of compute capability \(8, 0\) has no wgmma"):
        linear(cuda.to_device(np.zeros((80, 64), np.uint16)), wb, cuda.device_array((80, 16), np.uint16), 80,
               kernel="wgmma")


@pytest.mark.gpu
def test_picked_on_this_gpu():
    """stages.linear picks wgmma for a BF16 prefill on this GPU exactly where its compute capability
    (the driver's, not a pretended one: test_linear's pick test pretends) is 9.0, else pipe."""
    w, _ = weight(256, 512, GGMLType.BF16)
    want = "wgmma" if wg.device_capability() == wg.WGMMA_CAPABILITY else "pipe"
    assert pick_kernel(w, True, 4096) == want


def on_hopper() -> None:
    """Skips a GPU test on a GPU without wgmma."""
    if not SIM and wg.device_capability() != wg.WGMMA_CAPABILITY:
        pytest.skip(f"wgmma needs compute capability 9.0, this GPU is {wg.device_capability()}")


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s[0])
def test_flash_shapes(shape):
    """4096 tokens through every attention and engram matrix of the flash model (wo_a grouped)."""
    on_hopper()
    _, n, k, groups = shape
    check_wgmma(4096, groups, n // groups, k, True, 11)


@pytest.mark.gpu
def test_flash_partial_tiles_f32_out():
    """A token count that is not a multiple of the tile, fp32 out, wq_a's shape."""
    on_hopper()
    check_wgmma(4000, 1, 1280, 5120, False, 12)
