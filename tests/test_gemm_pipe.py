"""stages.gemm_pipe against the oracle's linear (host.numerics): BF16 and Q8_0 weights, bf16 and
fp32 outputs, partial tiles along tokens and outputs, more K steps than shared stages (the ring of
stages wraps), the grouped product, through test_linear_tc's weights and tests/bounds.py's product
rules (test_linear.check_groups: bf16 out at least 99% of outputs bit-equal to the oracle and the
rest within the sqrt(K) bound; fp32 out the sqrt(K) bound). The emulated intrinsics are held to
NumPy references of what the PTX does (ldmatrix's lane mapping, the zero-filling copy), and three
broken kernels (tests/mutants.py) must fail the same checks. On the simulator the tiles are small
(gemm_pipe's SIM configuration) and K a few steps; the flash shapes run on a GPU. Run with -s to
see each check's figure."""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda, uint32  # noqa: E402  (after conftest chose the backend)

from flashv41.host.numerics import bf16, from_bits, to_bits
from flashv41.host.quants import GGMLType
from flashv41.stages import gemm_pipe as pipe
from flashv41.stages.device import SIM, WARP
from flashv41.stages.linear import DeviceWeight, linear
from tests.mutants import edited, mutant
from tests.test_linear import check_groups
from tests.test_linear_tc import FLASH, stored_rows
from tests.test_mutants_products import rejected

TYPES = [GGMLType.BF16, GGMLType.Q8_0]


def weight(n, k, gtype):
    """A random weight [n, k] (test_linear_tc's rows) as a DeviceWeight and its dequantised values."""
    from flashv41.host.quants import dequantize

    stored = stored_rows(np.random.default_rng(int(gtype) + n + k), n, k, gtype)
    return DeviceWeight.from_stored("w", gtype, stored, k), dequantize(stored, gtype, k)


def check_pipe(gtype, tokens, groups, rows, width, out_bf16, seed) -> float:
    """linear(kernel="pipe") on seeded bf16 inputs [tokens, groups * width] and a random weight
    [groups * rows, width], every group held to the oracle; returns check_groups' figure."""
    w, wq = weight(groups * rows, width, gtype)
    x = bf16(np.random.default_rng(seed).standard_normal((tokens, groups * width)).astype(np.float32))
    y = cuda.device_array((tokens, groups * rows), np.uint16 if out_bf16 else np.float32)
    linear(cuda.to_device(to_bits(x)), w, y, tokens, group_rows=rows if groups > 1 else 0, kernel="pipe")
    got = from_bits(y.copy_to_host()) if out_bf16 else y.copy_to_host()
    what = f"pipe {gtype.name} [{groups * rows}, {width}] T={tokens} {'bf16' if out_bf16 else 'f32'} out"
    figure = check_groups(got, x, wq, rows, out_bf16, what, {})
    print(f"{what}: {figure:.4f}")
    return figure


@pytest.mark.parametrize("gtype", TYPES, ids=lambda t: t.name)
def test_partial_tiles_wrapping_stages(gtype):
    """Two token tiles and two output tiles, each second one partial (T, N not multiples of the
    tile); K of STAGES + 2 steps, so the ring of stages wraps. Simulator: 100% bit-equal."""
    check_pipe(gtype, pipe.BM + 5, 1, pipe.BN + 8, (pipe.STAGES + 2) * pipe.BK, True, 1 + int(gtype))


@pytest.mark.parametrize("gtype", TYPES, ids=lambda t: t.name)
def test_grouped_f32_out(gtype):
    """The attention's wo_a: three groups of outputs, each reading its own slice of the inputs (grid z),
    fewer tokens and outputs than a tile, an odd count of K steps (Q8_0: the last scale word's upper
    half is the row's padding); fp32 out. Simulator: largest error 0.2% of the bound."""
    check_pipe(gtype, 20, 3, 24, 3 * pipe.BK, False, 5 + int(gtype))


def test_refuses_what_it_does_not_take():
    """A Q2_K weight, and fp32 inputs: ValueError naming the weight."""
    wk, _ = weight(16, 256, GGMLType.Q2_K)
    wk.name = "blk.0.attn_q_b"
    with pytest.raises(ValueError, match="blk.0.attn_q_b: Q2_K"):
        linear(cuda.to_device(np.zeros((4, 256), np.uint16)), wk, cuda.device_array((4, 16), np.uint16), 4,
               kernel="pipe")
    wb, _ = weight(16, 64, GGMLType.BF16)
    wb.name = "blk.0.attn_q_a"
    with pytest.raises(ValueError, match="blk.0.attn_q_a: BF16 .* float32 inputs"):
        linear(cuda.to_device(np.zeros((4, 64), np.float32)), wb, cuda.device_array((4, 16), np.float32), 4,
               kernel="pipe")
