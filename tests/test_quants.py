"""host.quants against gguf-py: dequantisation bit for bit, Q8_0 and BF16 quantisation byte for byte,
and the Q2_K quantiser's error against what the format allows."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as GQ

from flashv41.host.errors import UnsupportedError
from flashv41.host.quants import FORMATS, Q2_K_BLOCK, GGMLType, _sum16, dequantize, quantize

ROWS, K = 64, 512


def _finite_f16(rng: np.random.Generator, n: int) -> np.ndarray:
    """Finite fp16 values of both signs over many binades, subnormals included."""
    mags = rng.standard_normal(n) * 10.0 ** rng.uniform(-6, 2, n)
    return np.clip(mags, -60000, 60000).astype(np.float16)


def _finite_half_bits(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Random 16-bit patterns whose exponent field is not all ones (so no inf / NaN for fp16 and bf16)."""
    bits = rng.integers(0, 1 << 16, size=shape, dtype=np.uint16)
    return np.where((bits & 0x7C00) == 0x7C00, bits & 0x83FF, bits).astype(np.uint16)


def _stored(qtype: GGMLType, rng: np.random.Generator) -> np.ndarray:
    """Random stored data of one type, as a file holds it: typed for F32 / F16, bytes otherwise."""
    if qtype == GGMLType.F32:
        return (rng.standard_normal((ROWS, K)) * 10.0 ** rng.uniform(-30, 30, (ROWS, K))).astype(np.float32)
    if qtype == GGMLType.F16:
        return _finite_half_bits(rng, (ROWS, K)).view(np.float16)
    if qtype == GGMLType.BF16:
        bits = rng.integers(0, 1 << 16, size=(ROWS, K), dtype=np.uint16)
        bits = np.where((bits & 0x7F80) == 0x7F80, bits & 0x807F, bits).astype(np.uint16)
        return bits.view(np.uint8).reshape(ROWS, -1)
    fmt = FORMATS[qtype]
    block = fmt.block
    n_blocks = ROWS * K // fmt.block_values
    raw = rng.integers(0, 256, size=(n_blocks, block.itemsize), dtype=np.uint8)
    blocks = raw.view(block).reshape(-1)
    # random bytes would make some scales inf / NaN; the format's scales are finite fp16 values
    blocks["d"] = _finite_f16(rng, n_blocks)
    if qtype == GGMLType.Q2_K:
        blocks["dmin"] = _finite_f16(rng, n_blocks)
    return blocks.view(np.uint8).reshape(ROWS, -1)


@pytest.mark.parametrize("qtype", list(GGMLType), ids=lambda t: t.name)
def test_table_matches_gguf_py(qtype: GGMLType) -> None:
    """The table's block layout (values a block, bytes a block) is ggml's, as gguf-py records it."""
    fmt = FORMATS[qtype]
    assert fmt.ggml_type == qtype
    assert (fmt.block_values, fmt.block_bytes) == gguf.GGML_QUANT_SIZES[GQ(int(qtype))]


@pytest.mark.parametrize("qtype", [GGMLType.F32, GGMLType.F16, GGMLType.BF16, GGMLType.Q8_0, GGMLType.Q2_K],
                         ids=lambda t: t.name)
def test_dequantize_matches_gguf_py_bit_for_bit(qtype: GGMLType) -> None:
    rng = np.random.default_rng(100 + int(qtype))
    data = _stored(qtype, rng)
    ours = dequantize(data, qtype, K)
    theirs = np.asarray(gguf.quants.dequantize(data, GQ(int(qtype))), dtype=np.float32).reshape(ROWS, K)
    assert ours.shape == (ROWS, K) and ours.dtype == np.float32
    mismatch = np.flatnonzero(ours.view(np.uint32) != theirs.view(np.uint32))
    assert mismatch.size == 0, f"{mismatch.size} values differ, first at {mismatch[0]}: " \
                               f"{ours.reshape(-1)[mismatch[0]]!r} vs {theirs.reshape(-1)[mismatch[0]]!r}"
    # the same data as raw bytes [rows, row bytes] (how TensorRef.raw() hands every type over)
    as_bytes = dequantize(np.ascontiguousarray(data).view(np.uint8).reshape(ROWS, -1), qtype, K)
    assert np.array_equal(as_bytes.view(np.uint32), ours.view(np.uint32))


def _q8_0_inputs(rng: np.random.Generator) -> np.ndarray:
    x = rng.standard_normal((ROWS, K)).astype(np.float32) * np.float32(10.0) ** rng.uniform(-4, 4, (ROWS, 1))
    x = x.astype(np.float32)
    x[0, :32] = 0  # an all-zero block: d = 0, levels 0
    x[1, :32] = -3.25  # a constant block
    # levels at exact halves (amax 127 makes d = 1): round half away from zero, both signs
    x[2, :32] = np.concatenate([[127.0], np.arange(-15.5, 15.5, 1.0, dtype=np.float32)])
    return x


def test_q8_0_quantize_matches_gguf_py() -> None:
    x = _q8_0_inputs(np.random.default_rng(8))
    ours = quantize(x, GGMLType.Q8_0)
    theirs = gguf.quants.quantize(x, GQ.Q8_0)
    assert ours.shape == theirs.shape == (ROWS, FORMATS[GGMLType.Q8_0].row_bytes(K))
    assert np.array_equal(ours, theirs)


def test_bf16_quantize_matches_gguf_py() -> None:
    rng = np.random.default_rng(16)
    x = (rng.standard_normal((ROWS, K)) * 10.0 ** rng.uniform(-35, 35, (ROWS, K))).astype(np.float32)
    bits = x.view(np.uint32)
    bits[0, :8] = [0x3F808000, 0x3F818000, 0xBF808000, 0x3F807FFF, 0x7F7FFFFF, 0x00008000, 0x80018000, 0]
    x[1, :4] = [np.inf, -np.inf, np.nan, -np.nan]
    bits[1, 4:6] = [0x7F800001, 0xFFC12345]  # signalling and payload NaNs
    ours = quantize(x, GGMLType.BF16)
    theirs = gguf.quants.quantize(x, GQ.BF16)
    assert ours.shape == theirs.shape == (ROWS, 2 * K)
    assert np.array_equal(ours, theirs)


def _q2_k_grid(stored: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per 16-value sub-block: the step d * sc and the lowest grid value -dmin * m, float32 [blocks, 16]."""
    blocks = stored.reshape(-1, Q2_K_BLOCK.itemsize).view(Q2_K_BLOCK).reshape(-1)
    d = blocks["d"].astype(np.float32)[:, None]
    dmin = blocks["dmin"].astype(np.float32)[:, None]
    step = d * (blocks["scales"] & 0xF).astype(np.float32)
    low = -(dmin * (blocks["scales"] >> 4).astype(np.float32))
    return step, low


def _q2_k_excess(x: np.ndarray, y: np.ndarray, stored: np.ndarray) -> np.ndarray:
    """How far each value's error |x - y| exceeds what the stored scales allow; <= 0 means within.

    Sub-block j of a block can represent only g_L = low_j + step_j * L for L = 0..3 (step_j =
    d * sc_j, low_j = -dmin * m_j). Whatever scales the quantiser chose, the best level for x is the
    nearest g_L: within half a step, step_j / 2, while x lies inside [g_0, g_3]; past either end
    the level clamps and the error is exactly the distance to that end, g_0 - x or x - g_3. So
    |x - y| <= max(step_j / 2, g_0 - x, x - g_3), up to fp32 rounding of the level decision and the
    reconstruction (a few ulps of the magnitudes involved, allowed below).
    """
    step, low = _q2_k_grid(stored)
    xs = x.reshape(step.shape[0], 16, 16)
    ys = y.reshape(xs.shape)
    step, low = step[:, :, None], low[:, :, None]
    high = low + 3 * step
    bound = np.maximum(step / 2, np.maximum(low - xs, xs - high))
    rounding = 4 * np.finfo(np.float32).eps * (np.abs(xs) + np.abs(low) + 3 * step)
    return (np.abs(xs - ys) - bound - rounding).reshape(x.shape)


@pytest.mark.parametrize("dist", ["gaussian", "uniform"])
def test_q2_k_error_within_format_bound(dist: str) -> None:
    rng = np.random.default_rng(2 if dist == "gaussian" else 3)
    if dist == "gaussian":
        x = rng.standard_normal((ROWS, K)).astype(np.float32)
    else:
        x = rng.uniform(-1.0, 3.0, (ROWS, K)).astype(np.float32)
    stored = quantize(x, GGMLType.Q2_K)
    assert stored.shape == (ROWS, FORMATS[GGMLType.Q2_K].row_bytes(K))
    y = dequantize(stored, GGMLType.Q2_K, K)
    excess = _q2_k_excess(x, y, stored)
    worst = np.unravel_index(np.argmax(excess), x.shape)
    assert excess.max() <= 0, f"at {worst}: x={x[worst]!r} y={y[worst]!r}, {excess[worst]!r} past the bound"


def test_q2_k_rmse() -> None:
    rng = np.random.default_rng(4)
    gaussian = rng.standard_normal((256, 1024)).astype(np.float32)
    uniform = rng.uniform(-1.0, 1.0, (256, 1024)).astype(np.float32)
    # measured with seed 4: 0.298 on N(0, 1), 0.136 on U(-1, 1); the limits leave a little headroom
    for x, limit in ((gaussian, 0.35), (uniform, 0.16)):
        y = dequantize(quantize(x, GGMLType.Q2_K), GGMLType.Q2_K, x.shape[1])
        rmse = float(np.sqrt(np.mean((x - y) ** 2)))
        assert rmse < limit, f"Q2_K RMSE {rmse:.4f} >= {limit}"


def test_q2_k_zero_block_round_trips_exactly() -> None:
    x = np.zeros((3, 512), np.float32)
    stored = quantize(x, GGMLType.Q2_K)
    y = dequantize(stored, GGMLType.Q2_K, 512)
    assert np.array_equal(y.view(np.uint32), x.view(np.uint32))  # +0.0, not -0.0


# A constant block c comes back exactly when the quantiser's fitted scale lands on an fp16 value: a
# positive block is fitted as level 3 of step c/3 stored as d = c/45 with sc = 15, a negative one as
# level 0 of offset dmin * 15 with dmin = |c|/15. These constants make c/45 (or |c|/15) exact in fp16.
# (Other constants come back within half an fp16 ulp of that scale, see the next test; the format
# could also store any fp16 c exactly as d = c, sc = 1, level 1, but the quantiser does not aim for it.)
@pytest.mark.parametrize("c", [45 / 64, 45 / 1024 * 3, -15 / 16, -15 * 2.0 ** -12, 45.0])
def test_q2_k_constant_block_round_trips_exactly(c: float) -> None:
    x = np.full((2, 256), c, np.float32)
    y = dequantize(quantize(x, GGMLType.Q2_K), GGMLType.Q2_K, 256)
    assert np.array_equal(y, x), f"constant {c!r} came back as {np.unique(y)}"


@pytest.mark.parametrize("c", [1.0, -1.0, 0.1, -0.37, 3.0, 1e-3])
def test_q2_k_constant_block_stays_constant(c: float) -> None:
    x = np.full((1, 256), c, np.float32)
    y = dequantize(quantize(x, GGMLType.Q2_K), GGMLType.Q2_K, 256)
    assert np.unique(y).size == 1
    # the stored scale is c/45 or |c|/15 rounded to fp16: relative error at most 2^-11
    assert abs(float(y[0, 0]) - c) <= abs(c) * 2.0 ** -11


def test_sum16_adds_in_numpys_order() -> None:
    """The quantiser's sums of 16 (host.quants._sum16, over a transposed block) have the bits
    NumPy's own row sums have, in float32 and float64, over magnitudes that make the order show."""
    rng = np.random.default_rng(8)
    for dtype in (np.float32, np.float64):
        a = (rng.standard_normal((20000, 16)) * 10.0 ** rng.integers(-6, 7, (20000, 16))).astype(dtype)
        want = a.sum(axis=1)
        got = _sum16(np.ascontiguousarray(a.T))
        assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), f"{dtype.__name__}: other sums"


def tricky_rows() -> np.ndarray:
    """Gaussian rows with zero, constant, one-signed, sparse, integer and extreme blocks."""
    x = np.random.default_rng(5).standard_normal((300, 768)).astype(np.float32)
    x[3] = 0
    x[5, :16] = 1.5
    x[7, 16:32] = -2
    x[9, ::2] = 0
    x[11] = np.abs(x[11])
    x[13] = -np.abs(x[13])
    x[15, :256] *= 1e-30
    x[17, :256] *= 1e30
    x[19] = np.rint(x[19] * 2)
    return x


def test_q2_k_bytes_are_those_of_the_row_major_quantiser(monkeypatch: pytest.MonkeyPatch) -> None:
    """quantize_q2_k fits a few hundred rows at a time on transposed blocks; the bytes are those
    the earlier quantiser (one piece, row-major sums; commit 5d65449) wrote for these inputs (SHA-256
    of its output), and do not depend on where the pieces split."""
    import hashlib

    from flashv41.host import quants

    with np.errstate(over="ignore", invalid="ignore"):
        got = quantize(tricky_rows(), GGMLType.Q2_K)
        assert hashlib.sha256(got.tobytes()).hexdigest()[:32] == "9396b79e267dbea9ec93c030bf05954b"
        monkeypatch.setattr(quants, "Q2_K_CHUNK_VALUES", 7 * 768)  # pieces of 7 rows: 300 = 42 * 7 + 6
        assert np.array_equal(quantize(tricky_rows(), GGMLType.Q2_K), got)


def test_rows_must_hold_whole_blocks() -> None:
    with pytest.raises(UnsupportedError, match="256"):
        quantize(np.zeros((2, 384), np.float32), GGMLType.Q2_K)
    with pytest.raises(UnsupportedError, match="Q8_0.*32"):
        quantize(np.zeros((2, 48), np.float32), GGMLType.Q8_0)
    with pytest.raises(UnsupportedError, match="Q2_K.*256"):
        dequantize(np.zeros(2 * Q2_K_BLOCK.itemsize, np.uint8), GGMLType.Q2_K, 384)


def test_unsupported_type_is_named() -> None:
    with pytest.raises(UnsupportedError, match="Q4_K"):
        quantize(np.zeros((1, 256), np.float32), "Q4_K")
