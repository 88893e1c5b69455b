"""stages.linear against the oracle's linear (host.numerics): every weight type, both kernels,
bf16 and fp32 inputs and outputs, the grouped product. Bounds: tests/bounds.py."""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda  # noqa: E402  (after conftest chose the backend)

from host.numerics import bf16, from_bits, matmul_t, to_bits
from host.numerics import linear as oracle_linear
from host.quants import GGMLType, dequantize, quantize
from stages.linear import GEMV_MAX_TOKENS, SEG_VALUES, DeviceWeight, linear, split_q8_0  # noqa: E402
from tests.bounds import assert_bf16_product, assert_within, f32_sum_error

TYPES = [GGMLType.Q8_0, GGMLType.Q2_K, GGMLType.BF16, GGMLType.F16, GGMLType.F32]


def weight(rng, n, k, gtype, layout=None):
    values = (rng.standard_normal((n, k)) * k**-0.5).astype(np.float32)
    stored = np.ascontiguousarray(quantize(values, gtype)).view(np.uint8).reshape(n, -1)
    return DeviceWeight.from_values("w", values, gtype, layout), dequantize(stored, gtype, k)


def stream_layout(gtype):
    """What the stream kernel reads: Q8_0 split (the GPU's default, not the simulator's)."""
    return "split" if gtype == GGMLType.Q8_0 else None


@pytest.mark.parametrize("gtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("kernel,tokens", [("", 1), ("gemm", 3), ("", 19)])
def test_bf16_in_bf16_out(gtype, kernel, tokens):
    rng = np.random.default_rng(int(gtype) * 100 + tokens)
    n, k = 40, 256
    w, wq = weight(rng, n, k, gtype)
    x = bf16(rng.standard_normal((tokens, k)).astype(np.float32))
    y = cuda.device_array((tokens, n), np.uint16)
    linear(cuda.to_device(to_bits(x)), w, y, tokens, kernel=kernel)
    got = from_bits(y.copy_to_host())
    assert_bf16_product(got, oracle_linear(x, wq), x, wq, f"{gtype.name} {kernel or 'auto'} T={tokens}")


STREAM = [GGMLType.Q8_0, GGMLType.Q2_K, GGMLType.BF16]


@pytest.mark.parametrize("gtype", STREAM, ids=lambda t: t.name)
@pytest.mark.parametrize("tokens,out", [(1, "bf16"), (3, "f32"), (GEMV_MAX_TOKENS, "bf16")])
def test_stream(gtype, tokens, out):
    """The decode kernel: each type's decoding, K split over warps (two on the simulator), tokens
    under a cap, fp32 and bf16 out."""
    rng = np.random.default_rng(int(gtype) * 10 + tokens)
    n, k = 6, 320 if gtype == GGMLType.BF16 else 512
    w, wq = weight(rng, n, k, gtype, stream_layout(gtype))
    x = bf16(rng.standard_normal((tokens, k)).astype(np.float32))
    y = cuda.device_array((tokens, n), np.uint16 if out == "bf16" else np.float32)
    linear(cuda.to_device(to_bits(x)), w, y, tokens, kernel="stream")
    got = y.copy_to_host()
    if out == "bf16":
        assert_bf16_product(from_bits(got), oracle_linear(x, wq), x, wq, f"stream {gtype.name} T={tokens}")
    else:
        ref = matmul_t(x, wq)
        abs_sum = np.abs(x.astype(np.float64)) @ np.abs(wq.astype(np.float64)).T
        bound = f32_sum_error(abs_sum, k) + np.abs(ref) * 2.0**-24
        assert_within(got, ref, bound, f"stream {gtype.name} T={tokens} f32")


@pytest.mark.parametrize("kernel,tokens", [("gemm", 1), ("gemm", 11)])
def test_gemm_reads_split_q8_0(kernel, tokens):
    """The GPU's Q8_0 layout through the fp32 tiles (what an fp32 input or a kernel without tensor
    cores reads), on the simulator too, where weights default to the stored layout."""
    rng = np.random.default_rng(17)
    w, wq = weight(rng, 12, 128, GGMLType.Q8_0, "split")
    x = bf16(rng.standard_normal((tokens, 128)).astype(np.float32))
    y = cuda.device_array((tokens, 12), np.uint16)
    linear(cuda.to_device(to_bits(x)), w, y, tokens, kernel=kernel)
    assert_bf16_product(from_bits(y.copy_to_host()), oracle_linear(x, wq), x, wq, f"split Q8_0 T={tokens}")


def test_q8_0_split_layout():
    """The split layout keeps every byte: quants in block order, then the scales."""
    rng = np.random.default_rng(3)
    values = rng.standard_normal((3, 96)).astype(np.float32)
    stored = np.ascontiguousarray(quantize(values, GGMLType.Q8_0)).view(np.uint8).reshape(3, -1)
    split = split_q8_0(stored, 96)
    blocks = stored.reshape(3, 3, 34)
    assert split.shape == stored.shape
    assert (split[:, :96].reshape(3, 3, 32) == blocks[:, :, 2:]).all()
    assert (split[:, 96:].reshape(3, 3, 2) == blocks[:, :, :2]).all()


@pytest.mark.parametrize("kernel", ["gemv", "gemm"])
def test_f32_in_f32_out(kernel):
    """The hc mixes' product: fp32 highway in, fp32 mixes out."""
    rng = np.random.default_rng(7)
    n, k, tokens = 24, 128, 5
    w, wq = weight(rng, n, k, GGMLType.F32)
    x = rng.standard_normal((tokens, k)).astype(np.float32)
    y = cuda.device_array((tokens, n), np.float32)
    linear(cuda.to_device(x), w, y, tokens, kernel=kernel)
    ref = matmul_t(x, wq)
    bound = f32_sum_error(np.abs(x.astype(np.float64)) @ np.abs(wq.astype(np.float64)).T, k) + np.abs(ref) * 2.0**-24
    assert_within(y.copy_to_host(), ref, bound, f"f32 {kernel}")


@pytest.mark.parametrize("kernel,tokens", [("stream", 2), ("gemm", 9)])
def test_grouped(kernel, tokens):
    """The attention's wo_a: G groups of R outputs, group g reading its own slice of the input."""
    rng = np.random.default_rng(11)
    groups, rows, width = 3, 8, 256
    w, wq = weight(rng, groups * rows, width, GGMLType.Q8_0, stream_layout(GGMLType.Q8_0))
    x = bf16(rng.standard_normal((tokens, groups * width)).astype(np.float32))
    y = cuda.device_array((tokens, groups * rows), np.uint16)
    linear(cuda.to_device(to_bits(x)), w, y, tokens, group_rows=rows, kernel=kernel)
    got = from_bits(y.copy_to_host())
    for g in range(groups):
        xs, ws = x[:, g * width:(g + 1) * width], wq[g * rows:(g + 1) * rows]
        assert_bf16_product(got[:, g * rows:(g + 1) * rows], oracle_linear(xs, ws), xs, ws, f"group {g}")


@pytest.mark.parametrize("gtype,extra", [(GGMLType.F16, 32), (GGMLType.F16, 64), (GGMLType.F32, 32)],
                         ids=["F16-odd-blocks", "F16", "F32"])
def test_gemv_several_segments(gtype, extra):
    """K past one gemv segment (SEG_VALUES) with a partial last one, and groups of a row count that
    does not fill the kernel's blocks: every output row of every group, against the oracle (the
    gemv serves the types the stream kernel does not)."""
    rng = np.random.default_rng(int(gtype) + extra)
    groups, rows, width, tokens = 2, 5, SEG_VALUES + extra, 3
    w, wq = weight(rng, groups * rows, width, gtype)
    x = bf16(rng.standard_normal((tokens, groups * width)).astype(np.float32))
    y = cuda.device_array((tokens, groups * rows), np.uint16)
    linear(cuda.to_device(to_bits(x)), w, y, tokens, group_rows=rows, kernel="gemv")
    got = from_bits(y.copy_to_host())
    for g in range(groups):
        xs, ws = x[:, g * width:(g + 1) * width], wq[g * rows:(g + 1) * rows]
        assert_bf16_product(got[:, g * rows:(g + 1) * rows], oracle_linear(xs, ws), xs, ws, f"group {g}")


def test_shape_errors_are_clear():
    rng = np.random.default_rng(0)
    w, _ = weight(rng, 8, 64, GGMLType.BF16)
    x = cuda.to_device(np.zeros((2, 32), np.uint16))
    with pytest.raises(ValueError, match="linear w"):
        linear(x, w, cuda.device_array((2, 8), np.uint16), 2)
    with pytest.raises(ValueError, match="stream takes at most"):
        linear(cuda.to_device(np.zeros((9, 64), np.uint16)), w, cuda.device_array((9, 8), np.uint16), 9,
               kernel="stream")
