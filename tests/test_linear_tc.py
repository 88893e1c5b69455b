"""stages.linear_tc against the oracle's linear (host.numerics): BF16, row-split Q8_0 and Q2_K
weights, bf16 and fp32 outputs, the grouped product, partial tiles. On the simulator the mma is
emulated and the shapes tiny (a few tiles); the flash shapes run on a GPU. Bounds: tests/bounds.py
(fp32 summation + one bf16 step; the module docstring says why Q2_K stays inside them)."""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import pytest
from numba import cuda  # noqa: E402  (after conftest chose the backend)

from host.numerics import bf16, from_bits, matmul_t, to_bits
from host.numerics import linear as oracle_linear
from host.quants import Q2_K_BLOCK, Q8_0_BLOCK, GGMLType, dequantize
from stages.device import SIM
from stages.linear import DeviceWeight
from stages.linear_tc import BM, BN, linear_tc, supports
from tests.bounds import assert_bf16_product, assert_within, f32_sum_error

TYPES = [GGMLType.BF16, GGMLType.Q8_0, GGMLType.Q2_K]


def stored_rows(rng, n, k, gtype) -> np.ndarray:
    """Random stored rows (uint8 [n, row_bytes]) of weights of RMS about k**-0.5. The quantised
    types' levels, sub-scales and mins are drawn over their whole range (sc * q up to 45, the
    largest integer the kernel puts in bf16), and flash-sized weights take no quantiser time."""
    if gtype == GGMLType.BF16:
        return to_bits(rng.standard_normal((n, k)).astype(np.float32) * np.float32(k**-0.5)).view(np.uint8)
    block = Q8_0_BLOCK if gtype == GGMLType.Q8_0 else Q2_K_BLOCK
    blocks = np.zeros((n, k // (32 if gtype == GGMLType.Q8_0 else 256)), block)
    if gtype == GGMLType.Q8_0:
        blocks["qs"] = rng.integers(-128, 128, blocks["qs"].shape)
        blocks["d"] = rng.uniform(0.5, 1.5, blocks.shape) * k**-0.5 / 74
    else:
        blocks["scales"] = rng.integers(0, 256, blocks["scales"].shape)
        blocks["qs"] = rng.integers(0, 256, blocks["qs"].shape)
        blocks["d"] = rng.uniform(0.5, 1.5, blocks.shape) * k**-0.5 / 20
        blocks["dmin"] = rng.uniform(0.5, 1.5, blocks.shape) * k**-0.5 / 20
    return blocks.view(np.uint8).reshape(n, -1)


@lru_cache(maxsize=1)  # the flash tests reuse a weight for each token count
def weight(n, k, gtype):
    """A random weight [n, k] as linear_tc takes it, and its dequantised values (the oracle's)."""
    stored = stored_rows(np.random.default_rng(int(gtype) + n + k), n, k, gtype)
    w = DeviceWeight.from_stored("w", gtype, stored, k, layout="split" if gtype == GGMLType.Q8_0 else "stored")
    return w, dequantize(stored, gtype, k)


def run(gtype, tokens, groups, rows, width, out_bf16, seed):
    """linear_tc on random bf16 inputs [tokens, groups * width] (from `seed`) and a random weight
    [groups * rows, width]; checks every group's outputs against the oracle."""
    w, wq = weight(groups * rows, width, gtype)
    x = bf16(np.random.default_rng(seed).standard_normal((tokens, groups * width)).astype(np.float32))
    y = cuda.device_array((tokens, groups * rows), np.uint16 if out_bf16 else np.float32)
    linear_tc(cuda.to_device(to_bits(x)), w, y, tokens, group_rows=rows if groups > 1 else 0)
    got = from_bits(y.copy_to_host()) if out_bf16 else y.copy_to_host()
    for g in range(groups):
        xs, ws = x[:, g * width:(g + 1) * width], wq[g * rows:(g + 1) * rows]
        gy = got[:, g * rows:(g + 1) * rows]
        what = f"{gtype.name} T={tokens} [{rows}, {width}] group {g}"
        if out_bf16:
            assert_bf16_product(gy, oracle_linear(xs, ws), xs, ws, what)
        else:
            ref = matmul_t(xs, ws)
            abs_sum = np.abs(xs.astype(np.float64)) @ np.abs(ws.astype(np.float64)).T
            assert_within(gy, ref, f32_sum_error(abs_sum, width) + np.abs(ref) * 2.0**-24, what)


@pytest.mark.parametrize("gtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("out_bf16", [True, False], ids=["bf16", "f32"])
def test_partial_tile(gtype, out_bf16):
    """Fewer tokens and outputs than one block tile; K is two blocks (Q8_0 and BF16: two K steps)."""
    run(gtype, 20, 1, 24, 512 if gtype == GGMLType.Q2_K else 64, out_bf16, int(gtype))


@pytest.mark.parametrize("gtype", [GGMLType.Q8_0, GGMLType.BF16], ids=lambda t: t.name)
def test_several_tiles_f32_out(gtype):
    """Two block tiles along both tokens and outputs, each with a partial edge; fp32 out."""
    run(gtype, BM + 6, 1, BN + 8, 64, False, 3 + int(gtype))


def test_grouped():
    """The attention's wo_a: groups of outputs, each reading its own slice of the inputs (grid z)."""
    run(GGMLType.Q8_0, 20, 3, 24, 64, True, 5)


def test_refuses_what_it_does_not_take():
    w, _ = weight(8, 64, GGMLType.BF16)
    assert supports(w, np.uint16) == (not SIM)
    assert not supports(w, np.float32)
    with pytest.raises(ValueError, match="not supported"):
        linear_tc(cuda.to_device(np.zeros((2, 64), np.float32)), w, cuda.device_array((2, 8), np.float32), 2)
    odd, _ = weight(8, 96, GGMLType.Q8_0)  # 3 blocks: rows are not whole 32-bit words
    assert not supports(odd, np.uint16)
    with pytest.raises(ValueError, match="linear_tc w"):
        linear_tc(cuda.to_device(np.zeros((2, 32), np.uint16)), w, cuda.device_array((2, 8), np.uint16), 2)


# Flash shapes: (N, K) of each projection that prefill runs through a GEMM (wo_a grouped 8 x 1024).
FLASH = {"wq_a": (1280, 5120), "wq_b": (32768, 1280), "wkv": (512, 5120), "wo_b": (5120, 8192),
         "idx_wq_b": (4096, 1280), "idx_proj": (32, 5120), "wk": (128, 512), "engram_wkv": (25600, 6144)}


# the token counts vary fastest (the outermost parametrize), so the weight is made once for them
@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [9, 64, 300])
@pytest.mark.parametrize("name", list(FLASH))
@pytest.mark.parametrize("gtype", TYPES, ids=lambda t: t.name)
def test_flash_shapes(tokens, name, gtype):
    n, k = FLASH[name]
    run(gtype, tokens, 1, n, k, True, tokens)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [64, 300])
@pytest.mark.parametrize("out_bf16", [True, False], ids=["bf16", "f32"])
@pytest.mark.parametrize("gtype", TYPES, ids=lambda t: t.name)
def test_flash_grouped_wo_a(tokens, out_bf16, gtype):
    run(gtype, tokens, 8, 1024, 4096, out_bf16, tokens)


@pytest.mark.gpu
@pytest.mark.parametrize("gtype", TYPES, ids=lambda t: t.name)
def test_flash_long_prefill(gtype):
    """A 4096-token prefill's wq_a (plus a partial token tile), fp32 out."""
    run(gtype, 4096 + 37, 1, 1280, 5120, False, 1)
