"""stages.linear_narrow against the oracle's linear (host.numerics): BF16 and Q8_0 weights, bf16 and
fp32 out, partial row tiles, slices of K ending inside a walk step, the grouped product, through
test_linear.check_linear and tests/bounds.py's product rules (bf16 out: at least 99% of outputs
bit-equal to the oracle, the rest within the sqrt(K) bound; fp32 out: the sqrt(K) bound). And
what batched decode rests on: a token's outputs are bit for bit the same whatever batch it is in.
On the simulator the mma is emulated and the shapes small; the flash shapes run on a GPU.
tests/test_mutants_products.py runs broken narrow kernels through the same check."""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda  # noqa: E402  (after conftest chose the backend)

from flashv41.host.numerics import bf16, to_bits
from flashv41.host.quants import GGMLType
from flashv41.stages.device import SIM
from flashv41.stages.linear import DeviceWeight, pick_kernel
from flashv41.stages.linear_narrow import NARROW_MAX_TOKENS, linear_narrow, plan, supports
from tests.test_linear import check_linear, weight
from tests.test_linear_tc import FLASH
from tests.test_linear_tc import weight as tc_weight

TYPES = [GGMLType.Q8_0, GGMLType.BF16]


@pytest.mark.parametrize("gtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("tokens,out", [(1, "bf16"), (9, "f32"), (20, "bf16")])
def test_narrow(gtype, tokens, out):
    """40 outputs (two whole tiles of 16 and a partial one) of K = 352: 11 blocks, so the warps'
    slices end inside a walk step of four. Simulator: 100% bit-equal (bf16 out); fp32 out within
    a few hundredths of the bound."""
    w, wq = weight(np.random.default_rng(int(gtype) + tokens), 40, 352, gtype)
    assert plan(40, 352, 1)[1] > 1  # several warps a tile: their sums added in order
    check_linear(w, wq, tokens, "narrow", out_bf16=out == "bf16", seed=tokens)


def test_narrow_grouped():
    """The attention's wo_a: three groups of 32 outputs, each reading its own slice of x."""
    w, wq = weight(np.random.default_rng(3), 96, 128, GGMLType.Q8_0)
    check_linear(w, wq, 5, "narrow", group_rows=32, seed=5)


def outputs(w: DeviceWeight, x: np.ndarray, group_rows: int = 0) -> np.ndarray:
    """linear_narrow's bf16 outputs for the bf16 inputs x [T, K_total], as bits."""
    y = cuda.device_array((x.shape[0], w.n), np.uint16)
    linear_narrow(cuda.to_device(to_bits(x)), w, y, x.shape[0], group_rows)
    return y.copy_to_host()


def assert_batch_independent(w: DeviceWeight, tokens: int, alone: list[int], group_rows: int = 0) -> None:
    """Each token of `alone`, run by itself, gives bit for bit its outputs in the batch of `tokens`."""
    groups = w.n // group_rows if group_rows else 1
    x = bf16(np.random.default_rng(tokens).standard_normal((tokens, groups * w.k)).astype(np.float32))
    batch = outputs(w, x, group_rows)
    for t in alone:
        one = outputs(w, x[t:t + 1], group_rows)
        assert np.array_equal(one[0], batch[t]), (
            f"token {t} alone differs from its outputs in a batch of {tokens}: "
            f"{int(np.sum(one[0] != batch[t]))} of {w.n} outputs")


@pytest.mark.parametrize("gtype", TYPES, ids=lambda t: t.name)
def test_a_token_is_the_same_in_any_batch(gtype):
    """Tokens 0 and 11 of a batch of 12 (two token fragments, another compiled cap than a token's
    alone) give the same bits alone."""
    w, _ = weight(np.random.default_rng(7), 40, 352, gtype)
    assert_batch_independent(w, 12, [0, 11])


def test_refuses_what_it_does_not_take():
    w, _ = weight(np.random.default_rng(1), 32, 64, GGMLType.Q8_0)
    assert supports(w, np.uint16) == (not SIM)
    assert not supports(w, np.float32)
    assert not supports(w, np.uint16, group_rows=8)  # groups of rows that are not whole tiles
    q2, _ = weight(np.random.default_rng(2), 8, 256, GGMLType.Q2_K)
    assert not supports(q2, np.uint16)
    y = cuda.device_array((2, 32), np.uint16)
    with pytest.raises(ValueError, match="not supported"):
        linear_narrow(cuda.to_device(np.zeros((2, 64), np.float32)), w, y, 2)
    with pytest.raises(ValueError, match="at most 64"):
        linear_narrow(cuda.to_device(np.zeros((65, 64), np.uint16)), w, cuda.device_array((65, 32), np.uint16), 65)
    assert pick_kernel(w, True, NARROW_MAX_TOKENS) == ("gemm" if SIM else "narrow")
    assert pick_kernel(w, True, NARROW_MAX_TOKENS + 1) == ("gemm" if SIM else "pipe")


# ------------------------------------------------------------------------ flash sizes (GPU)

@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8, 32, 64])
@pytest.mark.parametrize("name", list(FLASH))
@pytest.mark.parametrize("gtype", TYPES, ids=lambda t: t.name)
def test_flash_shapes(tokens, name, gtype):
    """Every decode shape at the batch sizes a step runs (-s prints each check's bit-equal fraction)."""
    n, k = FLASH[name]
    w, wq, _ = tc_weight(n, k, gtype)
    check_linear(w, wq, tokens, "narrow", seed=tokens)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens,out", [(1, "bf16"), (32, "f32")])
@pytest.mark.parametrize("gtype", TYPES, ids=lambda t: t.name)
def test_flash_grouped_wo_a(gtype, tokens, out):
    w, wq, _ = tc_weight(8 * 1024, 4096, gtype)
    check_linear(w, wq, tokens, "narrow", group_rows=1024, out_bf16=out == "bf16", seed=tokens)


@pytest.mark.gpu
@pytest.mark.parametrize("gtype", TYPES, ids=lambda t: t.name)
def test_flash_a_token_is_the_same_in_any_batch(gtype):
    """wo_b and the grouped wo_a: tokens of a batch of 64 alone."""
    w, _, _ = tc_weight(*FLASH["wo_b"], gtype)
    assert_batch_independent(w, 64, [0, 31, 63])
    grouped, _, _ = tc_weight(8 * 1024, 4096, gtype)
    assert_batch_independent(grouped, 33, [0, 32], group_rows=1024)
