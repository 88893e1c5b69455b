"""Q3_K, Q4_K, Q5_K, Q6_K and MXFP4 everywhere the engine reads weights: the host dequantisers
against gguf-py bit for bit (random valid blocks, corner blocks), MXFP4 quantisation byte for byte,
the device chunk dequantisers against the host bit for bit (every chunk of a few rows), and the
products (stages.linear's stream and gemm kernels, stream_partials) against the oracle through
test_linear's checks and tests/bounds.py's rules, with mutants that those checks must reject.
MXFP4's own stream unit and split layout besides: its code decoding, rows of odd block and row
counts, fp32 x, groups, the hc mixes' partial sums and every exponent corner (the tensor-core
GEMM's too)."""

from __future__ import annotations

import dataclasses
import re

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as GQ
from numba import cuda, float32  # noqa: E402  (after conftest chose the backend)

from flashv41 import stages
from flashv41.host.errors import UnsupportedError
from flashv41.host.gguf_model import TensorRef
from flashv41.host.numerics import bf16, from_bits, matmul_t, to_bits
from flashv41.host.numerics import linear as oracle_linear
from flashv41.host.quants import FORMATS, MXFP4_BLOCK, MXFP4_DOUBLED, GGMLType, dequantize, quantize, random_blocks
from flashv41.stages.device import CHUNK, device
from flashv41.stages.linear import DeviceWeight, linear, stream_partials
from flashv41.stages.quants.mxfp4 import e2m1_word
from flashv41.stages.quants.table import DEVICE_TYPES
from flashv41.stages.quants.units import chunk_stream
from tests.blocks import corner_rows
from tests.bounds import BOUND_RULE, assert_bf16_product, assert_f32_product, stored_rows, weight_terms
from tests.mutants import edited, mutant
from tests.test_linear import check_linear
from tests.test_mutants_products import MUTANTS, SCALE, rejected, run_mutant, scaled_values

NEW = [GGMLType.Q3_K, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K, GGMLType.MXFP4]
K_QUANTS = NEW[:4]


def bits(a: np.ndarray) -> np.ndarray:
    """float32 values as their bit patterns (array_equal of these: bit for bit, inf and -0 included)."""
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def gguf_values(raw: np.ndarray, gtype: GGMLType) -> np.ndarray:
    with np.errstate(over="ignore"):  # MXFP4's largest exponents: inf
        return np.asarray(gguf.quants.dequantize(raw, GQ(int(gtype))), dtype=np.float32)


@pytest.mark.parametrize("gtype", NEW, ids=lambda t: t.name)
def test_host_matches_gguf_py_bit_for_bit(gtype):
    """Random valid rows, rows of wholly random bytes under finite scales of every size and sign,
    and the corner rows: host.quants.dequantize == gguf.quants.dequantize, every bit."""
    rng = np.random.default_rng(int(gtype))
    fmt = FORMATS[gtype]
    rows = [random_blocks(gtype, 6, 512, rng), corner_rows(gtype)]
    wild = rng.integers(0, 256, (4, fmt.row_bytes(512)), dtype=np.uint8)
    view = wild.view(fmt.block)
    for name in ("d", "dmin"):
        if name in fmt.block.fields:
            view[name] = (rng.standard_normal(view.shape) * 10.0 ** rng.uniform(-7, 4, view.shape)).clip(-6e4, 6e4)
    rows.append(wild)  # (MXFP4: every exponent byte)
    for raw in rows:
        want = gguf_values(raw, gtype)
        got = dequantize(raw, gtype, raw.shape[1] // fmt.block_bytes * fmt.block_values)
        assert got.shape == want.shape and np.array_equal(bits(got), bits(want)), \
            f"{gtype.name}: {int((bits(got) != bits(want)).sum())} values differ"


def test_random_blocks_are_realistic():
    rng = np.random.default_rng(5)
    for gtype in NEW:
        raw = random_blocks(gtype, 3, 256, rng)
        assert raw.dtype == np.uint8 and raw.shape == (3, FORMATS[gtype].row_bytes(256))
        values = dequantize(raw, gtype, 256)
        assert np.isfinite(values).all() and 1e-3 < np.abs(values).max() < 100
        for name in ("d", "dmin"):
            if name in FORMATS[gtype].block.fields:
                d = raw.view(FORMATS[gtype].block)[name].astype(np.float32)
                assert ((d >= 9e-4) & (d <= 1.01e-2)).all()


def test_mxfp4_quantize_matches_gguf_py():
    rng = np.random.default_rng(9)
    x = (rng.standard_normal((8, 256)) * 10.0 ** rng.uniform(-4, 3, (8, 1))).astype(np.float32)
    x[0, :32] = 0  # a zero block
    assert np.array_equal(quantize(x, GGMLType.MXFP4), gguf.quants.quantize(x, GQ.MXFP4))


@pytest.mark.parametrize("gtype", K_QUANTS, ids=lambda t: t.name)
def test_k_quants_refuse_to_quantise(gtype):
    with pytest.raises(UnsupportedError, match=f"{gtype.name}.*random_blocks"):
        quantize(np.zeros((1, 256), np.float32), gtype)


# ----------------------------------------------------------------- device chunk dequantisers


def chunks_kernel(dequant):
    @cuda.jit
    def chunks(w, out, n_chunks):
        buf = cuda.local.array(CHUNK, float32)
        i = cuda.grid(1)
        if i < w.shape[0] * n_chunks:
            r = i // n_chunks
            c = i % n_chunks
            dequant(w, r, c, buf)
            for j in range(CHUNK):
                out[r, c * CHUNK + j] = buf[j]

    return chunks


def device_values(dequant, raw: np.ndarray, k: int) -> np.ndarray:
    out = cuda.device_array((raw.shape[0], k), np.float32)
    n_chunks = k // CHUNK
    total = raw.shape[0] * n_chunks
    chunks_kernel(dequant)[(total + 31) // 32, 32](cuda.to_device(raw), out, n_chunks)
    return out.copy_to_host()


def assert_device_dequant(dequant, gtype: GGMLType, raw: np.ndarray) -> None:
    fmt = FORMATS[gtype]
    k = raw.shape[1] // fmt.block_bytes * fmt.block_values
    want = dequantize(raw, gtype, k)
    got = device_values(dequant, raw, k)
    bad = np.flatnonzero(bits(got) != bits(want))
    assert not bad.size, (f"{gtype.name}: {bad.size} values differ, first at {bad[0]}: "
                          f"{got.flat[bad[0]]!r} != {want.flat[bad[0]]!r}")


@pytest.mark.filterwarnings("ignore:overflow encountered")  # the simulator's MXFP4 inf (corner rows)
@pytest.mark.parametrize("gtype", NEW, ids=lambda t: t.name)
def test_device_dequant_bit_exact(gtype):
    """Every chunk of random rows (stored and in the device layout: 9 blocks, so split rows are
    padded and their scales and d follow an odd block count) and of the corner rows."""
    rng = np.random.default_rng(int(gtype) + 1)
    qt = DEVICE_TYPES[gtype]
    raw = random_blocks(gtype, 3, 512, rng)
    assert_device_dequant(qt.dequant, gtype, raw)
    assert_device_dequant(qt.dequant, gtype, corner_rows(gtype))
    stored = random_blocks(gtype, 2, 2304, rng)
    rows = qt.weight_rows(stored, 2304)
    assert rows.shape[1] % 16 == 0
    got = device_values(qt.weight_dequant, np.ascontiguousarray(rows), 2304)
    assert np.array_equal(bits(got), bits(dequantize(stored, gtype, 2304)))


# the split layouts' regions, each the named fields of every block back to back (module docstrings of
# stages.quants.q6_k, q3_k, q2_k): the quant pieces, then the rest
SPLIT_REGIONS = {GGMLType.Q6_K: (("ql", "qh", "scales"), ("d",)), GGMLType.Q3_K: (("hmask", "qs"), ("scales",), ("d",)),
                 GGMLType.Q2_K: (("scales",), ("qs",), ("d", "dmin"))}
SPLIT = list(SPLIT_REGIONS)


def split_rows(stored: np.ndarray, gtype: GGMLType) -> np.ndarray:
    """The split layout of stored rows, built from the block's field names: per region, the region's
    fields of every block, then zeros up to whole 16-byte pieces."""
    n = stored.shape[0]
    blocks = np.ascontiguousarray(stored).view(FORMATS[gtype].block)  # [row, block]
    regions = [np.concatenate([np.ascontiguousarray(blocks[f]).view(np.uint8).reshape(n, blocks.shape[1], -1)
                               for f in fields], axis=2).reshape(n, -1) for fields in SPLIT_REGIONS[gtype]]
    row = np.concatenate(regions, axis=1)
    return np.pad(row, ((0, 0), (0, -row.shape[1] % 16)))


@pytest.mark.parametrize("gtype", SPLIT, ids=lambda t: t.name)
def test_split_layout(gtype):
    """The split layout keeps every byte (its rows are the stored ones rearranged by field, under 16
    pad bytes a row, the quant pieces 16-byte aligned), and DeviceWeight.from_stored and from_ref
    upload it."""
    k = 2304  # 9 blocks: padded rows (Q6_K 14 bytes, Q3_K 2, Q2_K 4), scales and d after an odd block count
    stored = random_blocks(gtype, 3, k, np.random.default_rng(int(gtype) + 7))
    qt = DEVICE_TYPES[gtype]
    rows = qt.weight_rows(stored, k)
    assert qt.layout == "split" and np.array_equal(rows, split_rows(stored, gtype))
    assert 0 <= rows.shape[1] - stored.shape[1] < 16 and rows.shape[1] % 16 == 0
    assert sum(FORMATS[gtype].block[f].itemsize for f in SPLIT_REGIONS[gtype][0]) % 16 == 0
    via_ref = DeviceWeight.from_ref(TensorRef("w", gtype, (3, k), stored))
    for w in (DeviceWeight.from_stored("w", gtype, stored, k), via_ref):
        assert w.layout == "split" and (w.n, w.k) == (3, k) and np.array_equal(w.data.copy_to_host(), rows)


def test_q2_k_split_rows_dequantise_and_read_back():
    """Q2_K's split rows (9 blocks, padded) through the device chunk dequantiser of its layout (the
    gemm kernel's): every value bit for bit the host's; and tests/bounds.py's stored_rows, which
    the product bounds read the terms' magnitudes through, gives back the stored rows."""
    k = 2304
    stored = random_blocks(GGMLType.Q2_K, 2, k, np.random.default_rng(29))
    qt = DEVICE_TYPES[GGMLType.Q2_K]
    rows = np.ascontiguousarray(qt.weight_rows(stored, k))
    got = device_values(qt.weight_dequant, rows, k)
    assert np.array_equal(bits(got), bits(dequantize(stored, GGMLType.Q2_K, k)))
    assert np.array_equal(stored_rows(GGMLType.Q2_K, rows, k), stored)


def test_device_dequant_check_rejects_a_scale_error():
    """The bit-for-bit check fails for a dequantiser 1% off."""
    real = DEVICE_TYPES[GGMLType.Q5_K].dequant

    @device
    def scaled(w, row, chunk, out):
        real(w, row, chunk, out)
        for i in range(CHUNK):
            out[i] *= SCALE

    raw = random_blocks(GGMLType.Q5_K, 1, 256, np.random.default_rng(2))
    with pytest.raises(AssertionError, match="values differ"):
        assert_device_dequant(scaled, GGMLType.Q5_K, raw)


@pytest.mark.filterwarnings("ignore:overflow encountered")  # exponent bytes of 253 .. 255: inf
def test_mxfp4_split_layout():
    """The split layout keeps every byte: per row the blocks' codes in block order, then their
    exponent bytes, then zeros to a whole 16-byte piece (65 blocks: 15 bytes); put back into blocks
    they are the stored row, and the device layout's dequantiser reads the stored values off it."""
    k, n_blocks = 2080, 2080 // CHUNK
    fmt = FORMATS[GGMLType.MXFP4]
    stored = np.random.default_rng(12).integers(0, 256, (3, fmt.row_bytes(k)), dtype=np.uint8)
    split = DEVICE_TYPES[GGMLType.MXFP4].weight_rows(stored, k)
    blocks = stored.view(MXFP4_BLOCK)  # [row, block]
    codes, exps, pad = split[:, :16 * n_blocks], split[:, 16 * n_blocks:17 * n_blocks], split[:, 17 * n_blocks:]
    assert split.shape == (3, 16 * -(-stored.shape[1] // 16)) and pad.shape[1] == 15 and not pad.any()
    assert (codes.reshape(3, n_blocks, 16) == blocks["qs"]).all() and (exps == blocks["e"]).all()
    back = np.zeros_like(blocks)
    back["e"], back["qs"] = exps, codes.reshape(3, n_blocks, 16)
    assert np.array_equal(back.view(np.uint8).reshape(stored.shape), stored)
    got = device_values(DEVICE_TYPES[GGMLType.MXFP4].weight_dequant, np.ascontiguousarray(split), k)
    assert np.array_equal(bits(got), bits(dequantize(stored, GGMLType.MXFP4, k)))


@cuda.jit
def e2m1_words(words, out):
    i = cuda.grid(1)
    if i < words.shape[0]:
        q = e2m1_word(words[i])
        for j in range(8):
            out[i, j] = q[j]


def test_e2m1_word_decodes_every_code():
    """MXFP4's stream unit decodes a code word (byte permutes, the sign through prmt's sign mode):
    every code in every nibble, and random words, against host.quants' doubled E2M1 table; value
    b of the result is byte b's low nibble, value 4 + b its high one."""
    codes = np.arange(16, dtype=np.uint32)
    words = np.concatenate([codes * np.uint32(0x11111111), (codes * np.uint32(0x01234567)) ^ np.uint32(0x89ABCDEF),
                            np.random.default_rng(6).integers(0, 2**32, 64, dtype=np.uint32)]).astype(np.uint32)
    out = cuda.device_array((words.size, 8), np.float32)
    e2m1_words[(words.size + 31) // 32, 32](cuda.to_device(words), out)
    nibbles = (words[:, None] >> (4 * np.arange(8, dtype=np.uint32))) & np.uint32(15)  # nibble 2 b: byte b low
    want = MXFP4_DOUBLED[np.concatenate([nibbles[:, 0::2], nibbles[:, 1::2]], axis=1)]
    assert np.array_equal(bits(out.copy_to_host()), bits(want))


# ------------------------------------------------------------------------------ the products


def random_weight(gtype: GGMLType, n: int, k: int, seed: int):
    stored = random_blocks(gtype, n, k, np.random.default_rng(seed))
    return DeviceWeight.from_stored("w", gtype, stored, k), dequantize(stored, gtype, k)


@pytest.mark.parametrize("gtype", NEW, ids=lambda t: t.name)
@pytest.mark.parametrize("kernel,tokens", [("stream", 1), ("stream", 3), ("gemm", 9)])
def test_linear(gtype, kernel, tokens):
    """bf16 x and out, 24 outputs of K = 256 (Q3_K and Q6_K rows split, MXFP4 rows padded on the device)."""
    w, wq = random_weight(gtype, 24, 256, int(gtype) * 10 + tokens)
    check_linear(w, wq, tokens, kernel, seed=tokens)


@pytest.mark.parametrize("gtype", SPLIT, ids=lambda t: t.name)
@pytest.mark.parametrize("k,tokens,x_f32,out_bf16", [(1024, 1, False, True), (1024, 3, True, False),
                                                     (2304, 3, False, True), (2304, 1, True, True)])
def test_split_stream(gtype, k, tokens, x_f32, out_bf16):
    """The split units on rows of 4 and 9 blocks (d after an odd block count, a padded row), bf16 and
    fp32 x and out, 7 outputs (an odd row count)."""
    w, wq = random_weight(gtype, 7, k, int(gtype) + k + tokens)
    check_linear(w, wq, tokens, "stream", out_bf16=out_bf16, x_f32=x_f32, seed=tokens)


@pytest.mark.parametrize("gtype", SPLIT, ids=lambda t: t.name)
@pytest.mark.parametrize("kernel,tokens,x_f32", [("stream", 1, False), ("stream", 3, True), ("gemm", 9, False),
                                                 ("gemm", 9, True)])
def test_split_grouped(gtype, kernel, tokens, x_f32):
    """Two groups of 5 outputs (6 where the GEMV's unit takes two rows: Q2_K), each reading its own
    K = 1024 slice of x, through the split layout."""
    rows = 5 + (DEVICE_TYPES[gtype].gemv_unit.rows - 1)
    w, wq = random_weight(gtype, 2 * rows, 1024, int(gtype) + tokens)
    check_linear(w, wq, tokens, kernel, group_rows=rows, x_f32=x_f32, seed=tokens)


def check_stream_partials(gtype: GGMLType, k: int, tokens: int, seed: int, x_seed: int) -> None:
    """The hc mixes' product of 5 rows: `tokens` tokens of fp32 x over 3 slices of K, the slices'
    sum against the fp32 product bound (of the split terms where the unit adds a value's two parts
    apart), and the inputs' square sums."""
    w, wq = random_weight(gtype, 5, k, seed)
    slices = 3
    x = np.random.default_rng(x_seed).standard_normal((tokens, w.k)).astype(np.float32)
    partial = cuda.device_array((tokens, w.n + 1, slices), np.float32)
    stream_partials(cuda.to_device(x), w, partial, tokens)
    got = partial.copy_to_host().astype(np.float64).sum(axis=2)
    terms = weight_terms(w, "stream")
    assert_f32_product(got[:, :w.n], x, wq, f"{gtype.name} stream_partials T={tokens}", **terms)
    squares = (x.astype(np.float64) ** 2).sum(axis=1)
    assert np.allclose(got[:, w.n], squares, rtol=1e-5)


@pytest.mark.parametrize("gtype", SPLIT, ids=lambda t: t.name)
def test_stream_partials(gtype):
    """3 tokens over 3 slices of K = 1280 (5 blocks: the slices' ends inside blocks)."""
    check_stream_partials(gtype, 1280, 3, 3, 4)


# MXFP4's own stream unit (split layout): rows of odd block counts, odd row counts, fp32 x, groups,
# the hc mixes' partial sums and every exponent byte's corner


@pytest.mark.parametrize("k", [1024, 2080])
@pytest.mark.parametrize("kernel,tokens", [("stream", 1), ("stream", 3), ("gemm", 9)])
def test_mxfp4_long_rows(k, kernel, tokens):
    """7 outputs (the simulator splits K over two warps: 16 / 16 and 32 / 33 blocks) of K = 1024
    and 2080 (65 blocks: an odd count, a unit left after the walk's pairs)."""
    w, wq = random_weight(GGMLType.MXFP4, 7, k, k + tokens)
    check_linear(w, wq, tokens, kernel, seed=tokens)


@pytest.mark.parametrize("tokens,out", [(1, "bf16"), (3, "f32"), (8, "bf16")])
def test_mxfp4_stream_f32_in(tokens, out):
    """fp32 inputs (the hc mixes read the fp32 highway so), bf16 and fp32 out, up to the token cap."""
    w, wq = random_weight(GGMLType.MXFP4, 6, 544, tokens + 20)
    check_linear(w, wq, tokens, "stream", out_bf16=out == "bf16", x_f32=True, seed=tokens)


@pytest.mark.parametrize("tokens", [1, 3])
def test_mxfp4_grouped(tokens):
    """Groups of 6 outputs (the GEMV's unit takes two rows), each reading its own K-wide slice of
    the input."""
    w, wq = random_weight(GGMLType.MXFP4, 2 * 6, 1056, tokens + 30)
    check_linear(w, wq, tokens, "stream", group_rows=6, seed=tokens)


def test_mxfp4_stream_partials():
    """11 tokens (two token groups) over 3 slices of K = 2080's 65 blocks."""
    check_stream_partials(GGMLType.MXFP4, 2080, 11, 40, 41)


# Q4_K's and Q5_K's own stream units: one row of 64 values a unit for the partial sums
# (stages.quants.q4_k_q5_k.k_nibble_unit), two rows of half a block for the GEMV (k_half_unit); each
# adds a value's two parts apart (tests/bounds.py's split terms). A bf16-out check has at least 100
# outputs a group, so the 99% rule allows an output whose exact value sits at a bf16 rounding
# boundary (the fp32 sum lands either side of it).

NIBBLE = [GGMLType.Q4_K, GGMLType.Q5_K]


@pytest.mark.parametrize("gtype", NIBBLE, ids=lambda t: t.name)
@pytest.mark.parametrize("n,k,tokens", [(101, 1024, 1), (35, 2304, 3), (13, 2304, 8)])
def test_nibble_stream_long_rows(gtype, n, k, tokens):
    """Rows of 4 and 9 blocks, odd row counts (the GEMV's last row a unit's alone), token caps 1, 4
    and 8. Simulator: 100% bit-equal."""
    w, wq = random_weight(gtype, n, k, int(gtype) + k + tokens)
    check_linear(w, wq, tokens, "stream", seed=tokens)


@pytest.mark.parametrize("gtype", NIBBLE, ids=lambda t: t.name)
@pytest.mark.parametrize("n,tokens,out", [(101, 1, "bf16"), (5, 3, "f32")])
def test_nibble_stream_f32_in(gtype, n, tokens, out):
    """fp32 inputs, bf16 and fp32 out. Simulator: 100% bit-equal; fp32 out: largest error 0.1% of
    the bound."""
    w, wq = random_weight(gtype, n, 512, int(gtype) + tokens)
    check_linear(w, wq, tokens, "stream", out_bf16=out == "bf16", x_f32=True, seed=tokens)


@pytest.mark.parametrize("gtype", NIBBLE, ids=lambda t: t.name)
@pytest.mark.parametrize("rows,tokens", [(100, 1), (34, 3)])
def test_nibble_stream_grouped(gtype, rows, tokens):
    """Two groups of `rows` rows, each reading its own slice of the inputs."""
    w, wq = random_weight(gtype, 2 * rows, 256, int(gtype) + 20 + tokens)
    check_linear(w, wq, tokens, "stream", group_rows=rows, seed=tokens)


@pytest.mark.parametrize("gtype", NIBBLE, ids=lambda t: t.name)
def test_nibble_stream_partials(gtype):
    """11 tokens (two token groups) over 3 uneven slices of K = 1024, the split terms' bound."""
    check_stream_partials(gtype, 1024, 11, int(gtype) + 30, 6)


FINITE_EXPONENTS = [0, 1, 2, 3, 64, 127, 200, 240]  # Gaussian x times any codes: finite products
INF_EXPONENTS = [253, 254, 255]  # some codes' values are inf


def exponent_rows() -> np.ndarray:
    """corner_rows' MXFP4 rows (every code under the exponents 0, 1, 2, 127, 253, 254, 255), then
    random codes under each of FINITE_EXPONENTS and INF_EXPONENTS: stored rows of K = 64."""
    exps = FINITE_EXPONENTS + INF_EXPONENTS
    rows = np.random.default_rng(13).integers(0, 256, (len(exps), 2 * MXFP4_BLOCK.itemsize), dtype=np.uint8)
    rows.view(MXFP4_BLOCK)["e"] = np.array(exps)[:, None]
    return np.concatenate([corner_rows(GGMLType.MXFP4), rows])


def check_exponent_corners(kernel: str, tokens: int, out: str) -> None:
    """The product of exponent_rows (the subnormal scales 2^-128 and 2^-127, the largest ones with
    infinite values) with seeded bf16 x: the rows whose values are finite held to the product rules,
    the others (inf values) to the oracle's NaN or inf, as a product per value gives them (a scaled
    block sum alone gives an inf where the oracle has x * inf - x' * inf)."""
    stored = exponent_rows()
    wq = dequantize(stored, GGMLType.MXFP4, 64)
    w = DeviceWeight.from_stored("w", GGMLType.MXFP4, stored, 64)
    x = bf16(np.random.default_rng(tokens).standard_normal((tokens, 64)).astype(np.float32))
    y = cuda.device_array((tokens, w.n), np.uint16 if out == "bf16" else np.float32)
    linear(cuda.to_device(to_bits(x)), w, y, tokens, kernel=kernel)
    got = from_bits(y.copy_to_host()) if out == "bf16" else y.copy_to_host()
    exact = x.astype(np.float64) @ wq.astype(np.float64).T
    finite = np.isfinite(exact).all(axis=0)
    assert finite.sum() == 4 + len(FINITE_EXPONENTS)  # corner_rows' exponents 0, 1, 2 and 127, and the random rows'
    what = f"MXFP4 exponent corners {kernel} T={tokens} {out} out"
    if out == "bf16":
        assert_bf16_product(got[:, finite], oracle_linear(x, wq[finite]), x, wq[finite], what)
    else:
        assert_f32_product(got[:, finite], x, wq[finite], what)
    infinite = matmul_t(x, wq[~finite])  # x * inf and inf - inf: NaN here (every such row has both signs' infs)
    assert np.array_equal(got[:, ~finite], infinite, equal_nan=True), \
        f"{what}: rows with inf values give {got[:, ~finite]}, the oracle {infinite}"


CORNERS_FILTER = pytest.mark.filterwarnings("ignore:overflow encountered", "ignore:invalid value encountered")


@CORNERS_FILTER
@pytest.mark.parametrize("kernel,tokens,out", [("stream", 1, "bf16"), ("stream", 3, "bf16"), ("stream", 3, "f32"),
                                               ("gemm", 9, "bf16"), ("tc", 20, "bf16"), ("tc", 20, "f32"),
                                               ("imma", 1, "bf16"), ("imma", 3, "f32")])
def test_mxfp4_exponent_corners(kernel, tokens, out):
    """tc: the blocks with infinite values enter scaled (the host's values, inf included) under a
    step scale of 1; the others as doubled integers under 2^(e - 128), the subnormal ones too. imma:
    the sums times 2^(E - 29), then 2^(e - 128) (subnormal scales too), the blocks with infinite
    values value by value."""
    check_exponent_corners(kernel, tokens, out)


INF_UNSCALED = {"mxfp4_pair_unit": ("if max(ea, eb) >= MXFP4_INF_E:", "if max(ea, eb) > 255:"),
                "mxfp4_unit": ("if e >= MXFP4_INF_E:", "if e > 255:")}
NO_SUBNORMALS = {"mxfp4_pair_unit": ("da, db = e8m0_half(ea), e8m0_half(eb)",
                                     "da, db = f32_from_bits((ea - 1) << 23), f32_from_bits((eb - 1) << 23)"),
                 "mxfp4_unit": ("d = e8m0_half(e)", "d = f32_from_bits((e - 1) << 23)")}


@CORNERS_FILTER
@pytest.mark.parametrize("name", ["mxfp4_pair_unit", "mxfp4_unit"])
@pytest.mark.parametrize("kind,failure", [("inf", "rows with inf values give"), ("subnormal", BOUND_RULE)],
                         ids=["inf-values-unscaled", "no-subnormals"])
def test_mxfp4_corner_mutants(name, kind, failure):
    """Each of MXFP4's GEMV units mutated, the two-row gemv (mxfp4_pair_unit) and the one-row
    stream unit (mxfp4_unit, the product's where gemv is None): the blocks with infinite values
    left to the scaled block sums (the one-row unit scaling their sums; the two-row one skipping
    its per-value path, so that they add nothing), or the exponents 0 and 1 taken for normal ones.
    The corner check rejects each (then passes the real unit)."""
    qt = DEVICE_TYPES[GGMLType.MXFP4]
    real, field = (qt, "gemv") if name == "mxfp4_pair_unit" else (dataclasses.replace(qt, gemv=None), "stream")
    old, new = (INF_UNSCALED if kind == "inf" else NO_SUBNORMALS)[name]
    unit = dataclasses.replace(getattr(real, field), make=edited(stages.quants.mxfp4, name, old, new))
    broken = dataclasses.replace(real, **{field: unit})
    with mutant(stages.linear, DEVICE_TYPES={**DEVICE_TYPES, GGMLType.MXFP4: broken}):
        with pytest.raises(AssertionError, match=re.escape(failure)):
            check_exponent_corners("stream", 3, "bf16")
    with mutant(stages.linear, DEVICE_TYPES={**DEVICE_TYPES, GGMLType.MXFP4: real}):
        check_exponent_corners("stream", 3, "bf16")


def infinite_input_rows() -> np.ndarray:
    """exponent_rows, then four rows of K = 64 whose codes are all nonzero (no 0 * inf in the
    oracle) and positive in the first: exponents (253, 253), (127, 127), (127, 127), (254, 127), so
    that pairs of the two-row unit hold a row with infinite values beside a finite one."""
    rng = np.random.default_rng(14)
    rows = rng.integers(0, 256, (4, 2 * MXFP4_BLOCK.itemsize), dtype=np.uint8)
    blocks = rows.view(MXFP4_BLOCK)
    blocks["qs"] = blocks["qs"] & 0x77 | 0x11  # both nibbles: magnitude codes 1 .. 7
    blocks["qs"][1:] |= rng.integers(0, 256, blocks["qs"][1:].shape, dtype=np.uint8) & 0x88  # signs after row 0
    blocks["e"] = np.array([[253, 253], [127, 127], [127, 127], [254, 127]])
    return np.concatenate([exponent_rows(), rows])


@CORNERS_FILTER
def test_mxfp4_pair_unit_infinite_inputs():
    """infinite_input_rows times positive inputs with an inf (token 0) and a -inf (token 1): the
    two-row GEMV unit's outputs are inf and NaN exactly where the one-row unit's are, and the same
    there (each block's own row decides its path: no 0 * inf from a pair's other row, no 0 times
    an inf input's sum)."""
    w = DeviceWeight.from_stored("w", GGMLType.MXFP4, infinite_input_rows(), 64)
    x = bf16(np.abs(np.random.default_rng(3).standard_normal((3, 64))).astype(np.float32))
    x[0, 5], x[1, 40] = np.inf, -np.inf

    def product() -> np.ndarray:
        y = cuda.device_array((3, w.n), np.float32)
        linear(cuda.to_device(to_bits(x)), w, y, 3, kernel="stream")
        return y.copy_to_host()

    pair = product()
    qt = DEVICE_TYPES[GGMLType.MXFP4]
    with mutant(stages.linear, DEVICE_TYPES={**DEVICE_TYPES, GGMLType.MXFP4: dataclasses.replace(qt, gemv=None)}):
        one = product()
    infinite = ~np.isfinite(one)
    assert np.isinf(one).any() and np.array_equal(~np.isfinite(pair), infinite)
    assert np.array_equal(pair[infinite], one[infinite], equal_nan=True), \
        f"inf inputs: the pair unit gives {pair[infinite]}, the one-row unit {one[infinite]}"


@CORNERS_FILTER
def test_mxfp4_tc_corner_mutant():
    """The tc pieces scaling the sums of blocks with infinite values too, as they do the others'
    (each value is then the host's, so test_linear_tc's piece check cannot tell; the sum is not): the
    corner check rejects it, inf where the host has NaN (then passes the real pieces). The exponents
    0 and 1 taken for normal ones are that piece check's to reject (their values differ)."""
    qt = DEVICE_TYPES[GGMLType.MXFP4]
    put = edited(stages.quants.mxfp4, "put_mxfp4", "if e >= MXFP4_INF_E:", "if e > 255:")
    put_scales = edited(stages.quants.mxfp4, "put_scales_mxfp4", "if e < MXFP4_INF_E", "if e < 256")
    tc = dataclasses.replace(qt.tc, put=put, put_scales=put_scales)
    with mutant(stages.linear_tc, DEVICE_TYPES={**DEVICE_TYPES, GGMLType.MXFP4: dataclasses.replace(qt, tc=tc)}):
        with pytest.raises(AssertionError, match="rows with inf values give"):
            check_exponent_corners("tc", 20, "bf16")
    check_exponent_corners("tc", 20, "bf16")


# ------------------------------------------------------------------------------ mutants


def chunk_unit_types(gtype: GGMLType, dequant) -> dict:
    """The table with `gtype`'s stream units (the GEMV's and the partial sums') the generic chunk
    unit on `dequant`."""
    qt = DEVICE_TYPES[gtype]
    return {**DEVICE_TYPES, gtype: dataclasses.replace(qt, stream=chunk_stream(dequant), gemv=None)}


def test_chunk_unit_and_its_mutant():
    """The generic chunk unit (Q3_K's, Q6_K's and MXFP4's) on Q4_K rows: the stream check passes it
    on the real dequantiser and rejects it on one 1% large; then Q4_K's own units pass the same."""
    w, wq = random_weight(GGMLType.Q4_K, 24, 256, 8)
    dequant = DEVICE_TYPES[GGMLType.Q4_K].dequant  # a kernel reads a closure's functions, not a dataclass's attributes
    with mutant(stages.linear, DEVICE_TYPES=chunk_unit_types(GGMLType.Q4_K, scaled_values(dequant))):
        rejected(check_linear, w, wq, 3, "stream", seed=1)
    with mutant(stages.linear, DEVICE_TYPES=chunk_unit_types(GGMLType.Q4_K, dequant)):
        check_linear(w, wq, 3, "stream", seed=1)
    check_linear(w, wq, 3, "stream", seed=1)


# decoding mistakes in Q4_K's and Q5_K's own units (the partial sums' one-row unit, the GEMV's
# half-block one), each an edit of stages.quants.q4_k_q5_k's source
NIBBLE_MUTANTS = {
    "fifth-bits-of-the-low-nibbles": (GGMLType.Q5_K, "q5_k_levels", "h = j + U1", "h = j"),
    "gemv-fifth-bits-of-the-other-half": (GGMLType.Q5_K, "q5_k_half", "lift = (uint32(1) - h) << uint32(2)",
                                          "lift = h << uint32(2)"),
    "mins-without-top-bits": (GGMLType.Q4_K, "k_scale_words", " | ((s1 >> 2) & TOP_PAIRS)", ""),
    "stream-nibbles-swapped": (GGMLType.Q4_K, "k_nibble_unit", "la[0:4], sa[0], sa[1]", "la[8:12], sa[0], sa[1]"),
    "gemv-second-row-reads-the-first": (GGMLType.Q4_K, "k_half_unit", "min(row + 1, ww.shape[0] - 1)", "row"),
    "gemv-other-half-levels": (GGMLType.Q4_K, "q4_k_half", "(h << uint32(6))", "((h ^ uint32(1)) << uint32(6))"),
}
STREAM_ONLY = ("q5_k_levels", "k_nibble_unit")  # the one-row unit's own functions: the partial sums' check


def nibble_table(gtype: GGMLType) -> dict:
    """The table with `gtype`'s stream units rebuilt from stages.quants.q4_k_q5_k's functions as they are
    now (inside a mutant: the edited ones)."""
    qt = stages.quants.q4_k_q5_k
    if gtype == GGMLType.Q4_K:
        stream, gemv = qt.k_nibble_stream(qt.Q4_K_WORDS, qt.q4_k_levels, qt.q4_k_half, qt.Q4_K_FIELDS)
    else:
        stream, gemv = qt.k_nibble_stream(qt.Q5_K_WORDS, qt.q5_k_levels, qt.q5_k_half, qt.Q5_K_FIELDS)
    return {**DEVICE_TYPES, gtype: dataclasses.replace(DEVICE_TYPES[gtype], stream=stream, gemv=gemv)}


@pytest.mark.parametrize("name", NIBBLE_MUTANTS)
def test_nibble_decode_mutants(name):
    """Each decoding mistake rejected (the units rebuilt on the edited function inside the mutant):
    the GEMV unit's by the stream check, the one-row unit's by the partial sums' check (both for
    k_scale_words, which both units read); then both checks pass the real units on the same rows."""
    gtype, function, old, new = NIBBLE_MUTANTS[name]
    w, wq = random_weight(gtype, 24, 512, 10)
    qt = stages.quants.q4_k_q5_k
    with mutant(qt, **{function: edited(qt, function, old, new)}):
        with mutant(stages.linear, DEVICE_TYPES=nibble_table(gtype)):
            if function not in STREAM_ONLY:
                rejected(check_linear, w, wq, 3, "stream", seed=5)
            if function in STREAM_ONLY + ("k_scale_words",):
                rejected(check_stream_partials, gtype, 512, 3, int(gtype) + 40, 2)
    check_linear(w, wq, 3, "stream", seed=5)
    check_stream_partials(gtype, 512, 3, int(gtype) + 40, 2)


# decoding mistakes in Q6_K's and Q3_K's own units: the GEMV's pair units (kernel "stream": the
# decode product) and the one-row units (kernel "partials": stream_partials), each an edit of
# its module's source (stages.quants.q6_k, q3_k)
SPLIT_K_MUTANTS = {
    "q6-second-row-reads-the-first": (GGMLType.Q6_K, "stream", "q6_k_pair_unit",
                                      "row_address(ww, min(row + 1, ww.shape[0] - 1))", "row_address(ww, row)"),
    "q6-row-2-takes-row-0s-scale": (GGMLType.Q6_K, "stream", "q6_k_part", "d * int8_at(s23, j),",
                                    "d * int8_at(s01, j),"),
    "q3-second-row-reads-the-first": (GGMLType.Q3_K, "stream", "q3_k_pair_unit",
                                      "row_address(ww, min(row + 1, ww.shape[0] - 1))", "row_address(ww, row)"),
    "q3-rows-2-3-take-rows-0-1s-top-pairs": (GGMLType.Q3_K, "stream", "q3_k_part", "tops << uint32(2)",
                                             "tops << uint32(4)"),
    "q3-high-bits-of-row-0": (GGMLType.Q3_K, "stream", "q3_k_field_word", "Q3_K_HM_SHIFT[s]", "Q3_K_HM_SHIFT[0]"),
    "q3-one-row-top-pairs-of-rows-0-1": (GGMLType.Q3_K, "partials", "q3_k_scale", "2 * (s // 2)", "0"),
    "q6-high-pairs-of-row-0": (GGMLType.Q6_K, "partials", "q6_k_levels", "(qh >> (2 * s))", "qh"),
}


def split_k_units(gtype: GGMLType) -> dict:
    """The table with `gtype`'s two stream units made by its module's factories as they are
    now (inside a mutant: on the edited functions), as units of their own (a kernel per mutant)."""
    q6, q3 = stages.quants.q6_k, stages.quants.q3_k
    one_row, pair = {GGMLType.Q6_K: (q6.q6_k_unit, q6.q6_k_pair_unit),
                     GGMLType.Q3_K: (q3.q3_k_unit, q3.q3_k_pair_unit)}[gtype]
    real = DEVICE_TYPES[gtype]
    stream = dataclasses.replace(real.stream, make=lambda tokens, x_bf16: one_row(tokens, x_bf16))
    gemv = dataclasses.replace(real.gemv, make=lambda tokens, x_bf16: pair(tokens, x_bf16))
    return {**DEVICE_TYPES, gtype: dataclasses.replace(real, stream=stream, gemv=gemv)}


def check_split_k(gtype: GGMLType, kernel: str, w, wq) -> None:
    if kernel == "stream":
        check_linear(w, wq, 3, "stream", seed=5)
    else:
        check_stream_partials(gtype, w.k, 3, 3, 4)


@pytest.mark.parametrize("name", SPLIT_K_MUTANTS)
def test_split_k_decode_mutants(name):
    """The stream check (the GEMV's pair unit) or the stream_partials check (the one-row unit)
    rejects each decoding mistake, the units rebuilt on the edited function inside the mutant;
    then the real units pass the same check (7 rows: the pair unit's last is alone)."""
    gtype, kernel, function, old, new = SPLIT_K_MUTANTS[name]
    w, wq = random_weight(gtype, 7, 1280, 3)
    qt = {GGMLType.Q6_K: stages.quants.q6_k, GGMLType.Q3_K: stages.quants.q3_k}[gtype]
    with mutant(qt, **{function: edited(qt, function, old, new)}):
        with mutant(stages.linear, DEVICE_TYPES=split_k_units(gtype)):
            rejected(check_split_k, gtype, kernel, w, wq)
    check_split_k(gtype, kernel, w, wq)



@pytest.mark.parametrize("gtype", SPLIT, ids=lambda t: t.name)
@pytest.mark.parametrize("kernel,tokens,kind", [("stream", 3, "drop"), ("gemm", 9, "drop"), ("gemm", 9, "scale")])
def test_product_mutants(gtype, kernel, tokens, kind):
    """test_mutants_products' mutants (a unit or a value dropped from every row, the gemm's weight
    dequantiser 1% large) on split rows of 4 blocks (its stream mutants take rows of one)."""
    w, wq = random_weight(gtype, 24, 1024, 9)
    run_mutant(kernel, kind, check_linear, w, wq, tokens, kernel, seed=2)


@pytest.mark.parametrize("kind", MUTANTS)
@pytest.mark.parametrize("kernel,tokens,x_f32", [("stream", 4, True), ("gemm", 9, False)], ids=["stream-f32x", "gemm"])
def test_mxfp4_mutants(kernel, tokens, x_f32, kind):
    """test_mutants_products' mutants on MXFP4 rows: the stream unit's fp32-input path (its bf16 one
    is test_mutants_products') and gemm through the split layout's dequantiser."""
    w, wq = random_weight(GGMLType.MXFP4, 32, 256, 10)
    run_mutant(kernel, kind, check_linear, w, wq, tokens, kernel, x_f32=x_f32, seed=2)
