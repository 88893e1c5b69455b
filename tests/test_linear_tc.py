"""stages.linear_tc against the oracle's linear (host.numerics): Q2_K, the K-quants Q3_K .. Q6_K
and MXFP4 weights (tc's types: BF16 and Q8_0 are stages.gemm_pipe's, and tc refuses them), bf16 and
fp32 outputs, the grouped product, partial tiles, corner blocks, through `check_tc` and
tests/bounds.py's product rules (bf16 out: at least 99% of outputs bit-equal to the oracle, the rest
within the sqrt(K) bound; fp32 out: the sqrt(K) bound; for Q2_K, Q4_K and Q5_K the bound counts the
two parts of each value, which the kernel adds apart).
Each type's tensor-core pieces are held besides to the host's dequantiser bit for bit, on rows of
many blocks (`pieces_kernel`: what they stage, level times scale less min, is every value). On the
simulator the mma is emulated and the shapes tiny (a few tiles, a block of a K-quant); the flash
shapes run on a GPU. tests/test_mutants_products.py runs broken kernels through the same
`check_tc`; MXFP4's exponent corners are test_quants_more's. Run with -s to see each check's
bit-equal fraction. `stored_rows` and `weight` make BF16 and Q8_0 weights as well, for the other
products' tests (test_gemm_pipe, test_linear_narrow, test_linear_imma)."""

from __future__ import annotations

import dataclasses
from functools import cache, lru_cache

import numpy as np
import pytest
from numba import cuda, float32, uint32  # noqa: E402  (after conftest chose the backend)

from flashv41.host.numerics import bf16, from_bits, to_bits
from flashv41.host.quants import FORMATS, MXFP4_DOUBLED, GGMLType, dequantize
from flashv41.stages.device import CHUNK, SIM, bf16_to_f32
from flashv41.stages.linear import DeviceWeight, linear
from flashv41.stages.linear_tc import BM, BN, linear_tc, supports
from flashv41.stages.quants.table import DEVICE_TYPES
from flashv41.stages.quants.units import TC_BLOCK_STEPS, TC_STEP_WORDS
from tests.blocks import corner_rows
from tests.bounds import split_terms
from tests.test_linear import check_groups

NEW = [GGMLType.Q3_K, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K, GGMLType.MXFP4]  # stored_rows: random bytes
ALL = [GGMLType.Q2_K, *NEW]  # the types with tc pieces
# the typical magnitude of a K-quant's value over its d (the levels and scales uniform over their
# ranges: (sc - 32) q, sc q - m, sc q - m, sc (q - 32)), and of MXFP4's doubled E2M1 levels
LEVEL_RMS = {GGMLType.Q3_K: 43, GGMLType.Q4_K: 300, GGMLType.Q5_K: 600, GGMLType.Q6_K: 1400,
             GGMLType.MXFP4: float(np.sqrt(np.mean(MXFP4_DOUBLED**2)))}


def stored_rows(rng, n, k, gtype) -> np.ndarray:
    """Random stored rows (uint8 [n, row_bytes]) of weights of RMS about k**-0.5. The quantised
    types' levels, sub-scales, mins and high bits are drawn over their whole range (Q2_K's sc * q
    up to 45, the largest integer the kernel puts in bf16 for it), and flash-sized weights take no
    quantiser time."""
    if gtype == GGMLType.BF16:
        return to_bits(rng.standard_normal((n, k)).astype(np.float32) * np.float32(k**-0.5)).view(np.uint8)
    fmt = FORMATS[gtype]
    if gtype in NEW:  # every byte random, then the scales d, dmin (or MXFP4's exponent) for the RMS
        raw = rng.integers(0, 256, (n, fmt.row_bytes(k)), dtype=np.uint8)
        blocks = raw.view(fmt.block)
        if gtype == GGMLType.MXFP4:
            e = 128 + np.log2(k**-0.5 / LEVEL_RMS[gtype])
            blocks["e"] = np.rint(e) + rng.integers(-1, 2, blocks.shape)
        for name in ("d", "dmin"):
            if name in fmt.block.fields:
                blocks[name] = rng.uniform(0.5, 1.5, blocks.shape) * k**-0.5 / LEVEL_RMS[gtype]
        return raw
    blocks = np.zeros((n, k // fmt.block_values), fmt.block)
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
def weight(n, k, gtype, corners=False):
    """A random weight [n, k] in its device layout (corners: its first rows a K-quant's corner
    blocks, tests/blocks.py's, each repeated along the row), its dequantised values (the
    oracle's) and the magnitudes of the terms the kernel adds for it (split_terms: Q2_K's, Q4_K's
    and Q5_K's two parts)."""
    stored = stored_rows(np.random.default_rng(int(gtype) + n + k), n, k, gtype)
    if corners:
        blocks = corner_rows(gtype)
        stored[:blocks.shape[0]] = np.tile(blocks, (1, k // FORMATS[gtype].block_values))
    w = DeviceWeight.from_stored("w", gtype, stored, k)
    return w, dequantize(stored, gtype, k), split_terms(gtype, stored, k, "tc")


def check_tc(gtype, tokens, groups, rows, width, out_bf16, seed, corners=False) -> float:
    """linear_tc on seeded bf16 inputs [tokens, groups * width] and a random weight
    [groups * rows, width] (corners: see `weight`), every group's outputs held to the oracle
    (check_groups). Returns the smallest bit-equal fraction (bf16 out) or the largest error as a
    fraction of the bound (fp32)."""
    w, wq, terms = weight(groups * rows, width, gtype, corners)
    x = bf16(np.random.default_rng(seed).standard_normal((tokens, groups * width)).astype(np.float32))
    y = cuda.device_array((tokens, groups * rows), np.uint16 if out_bf16 else np.float32)
    linear_tc(cuda.to_device(to_bits(x)), w, y, tokens, group_rows=rows if groups > 1 else 0)
    got = from_bits(y.copy_to_host()) if out_bf16 else y.copy_to_host()
    what = f"tc {gtype.name} [{groups * rows}, {width}] T={tokens} {'bf16' if out_bf16 else 'f32'} out"
    return check_groups(got, x, wq, rows, out_bf16, what, terms)


@pytest.mark.parametrize("gtype", [GGMLType.Q2_K, GGMLType.MXFP4], ids=lambda t: t.name)
@pytest.mark.parametrize("out_bf16", [True, False], ids=["bf16", "f32"])
def test_partial_tile(gtype, out_bf16):
    """Fewer tokens and outputs than one block tile; K is two blocks (MXFP4: two K steps).
    Simulator: 100% bit-equal (bf16 out); fp32 out: largest error 0.3-0.4% of the bound."""
    check_tc(gtype, 20, 1, 24, 512 if gtype == GGMLType.Q2_K else 64, out_bf16, int(gtype))


@pytest.mark.parametrize("gtype,width", [(GGMLType.MXFP4, 64), (GGMLType.Q6_K, 256)], ids=["MXFP4", "Q6_K"])
def test_several_tiles_f32_out(gtype, width):
    """Two block tiles along both tokens and outputs, each with a partial edge; fp32 out, a type
    scaled a step (MXFP4) and one scaled a half-step (Q6_K). Simulator: largest error 0.6-0.8% of
    the bound."""
    check_tc(gtype, BM + 6, 1, BN + 8, width, False, 3 + int(gtype))


def test_grouped():
    """The attention's wo_a: groups of outputs, each reading its own slice of the inputs (grid z),
    with a block's mins taken away in each. Simulator: 100% bit-equal in every group."""
    check_tc(GGMLType.Q4_K, 20, 3, 24, 256, True, 5)


def test_mxfp4_odd_block_count():
    """MXFP4 rows of 3 blocks: the split layout pads them to whole 16-byte pieces, so the kernel
    takes them (the exponents start at byte K / 2, whatever the count). Simulator: 100% bit-equal."""
    check_tc(GGMLType.MXFP4, 20, 1, 24, 96, True, 6)


# The K-quants and MXFP4 on the simulator (its emulated mma: a few tenths of a second a K step): one block
# of 256 values (K-quants: 8 K steps, the mins taken away at the block's end), corner blocks in the
# first rows, a partial token tile, bf16 and fp32 out by turns; MXFP4 (a block a step) in groups.
# Their rows of many blocks are test_pieces_are_the_dequantiser's, MXFP4's exponent corners
# test_quants_more's.
NEW_CASES = [(GGMLType.Q3_K, 1, 256, False), (GGMLType.Q4_K, 1, 256, True), (GGMLType.Q5_K, 1, 256, False),
             (GGMLType.Q6_K, 1, 256, True), (GGMLType.MXFP4, 2, 64, True)]


@pytest.mark.parametrize("gtype,groups,width,out_bf16", NEW_CASES, ids=lambda v: getattr(v, "name", v))
def test_new_types(gtype, groups, width, out_bf16):
    """Simulator: 100% bit-equal (bf16 out), corner rows and all; fp32 out: largest error 0.005 of
    the bound."""
    check_tc(gtype, 20, groups, 24, width, out_bf16, int(gtype), corners=gtype != GGMLType.MXFP4)


@cache
def pieces_kernel(gtype: GGMLType):
    """A thread a row: every K step of the row through the type's tc pieces (the fetches, the puts
    into one-row stand-ins for the kernel's shared tiles), then what they staged written out as the
    values it stands for: level times the scale of its half-step (the step's, but for `halves`
    types), less dmin times the min of its 16-value group for types with mins. Each of those
    products is exact, so these are the host dequantiser's values, not just near them."""
    tc = DEVICE_TYPES[gtype].tc
    assert tc is not None
    fetch, put, fetch_scales, put_scales = tc.fetch, tc.put, tc.fetch_scales, tc.put_scales
    words, mins, halves = tc.words, tc.mins, tc.halves

    @cuda.jit
    def staged_values(w, out, k):
        n = cuda.grid(1)
        if n < w.shape[0]:
            w32 = w.view(np.uint32)
            w16 = w.view(np.uint16)
            b_s = cuda.local.array((1, TC_STEP_WORDS), uint32)  # [row, word] a step's bf16 pairs
            d_s = cuda.local.array((2, 1), float32)  # [half-step, row]
            m_s = cuda.local.array(1, float32)
            mins_s = cuda.local.array((1, TC_BLOCK_STEPS), uint32)
            for ks in range(k // CHUNK):
                for c in range(words):
                    word, aux = fetch(w32, w16, n, ks, c, k)
                    put(b_s, 0, c, word, aux, ks)
                s0, s1, s2, s3 = fetch_scales(w32, w16, n, ks, k)
                put_scales(d_s, m_s, mins_s, 0, ks, s0, s1, s2, s3)
                for i in range(CHUNK):
                    v = bf16_to_f32((b_s[0, i // 2] >> (16 * (i % 2))) & 0xFFFF)
                    v = v * d_s[i // 16 if halves else 0, 0]
                    if mins:
                        v = v - m_s[0] * bf16_to_f32((mins_s[0, ks % TC_BLOCK_STEPS] >> (16 * (i // 16))) & 0xFFFF)
                    out[n, ks * CHUNK + i] = v

    return staged_values


# rows of an odd block count each (the split layouts padded, their scales and d after the blocks)
PIECE_WIDTHS = {GGMLType.Q2_K: 768, GGMLType.MXFP4: 2080}


@pytest.mark.filterwarnings("ignore:overflow encountered")  # MXFP4's corner rows: inf, as the host's
@pytest.mark.parametrize("gtype", ALL, ids=lambda t: t.name)
def test_pieces_are_the_dequantiser(gtype):
    """The tc pieces stage every value of random rows of many blocks (K-quants 9, MXFP4 65) and of
    the corner rows (MXFP4: every exponent corner, and rows of wholly random bytes: every exponent
    byte in any block, inf values included) as host.quants.dequantize has it."""
    k = PIECE_WIDTHS.get(gtype, 2304)
    rng = np.random.default_rng(int(gtype) + 50)
    rows = [stored_rows(rng, 5, k, gtype)]
    if gtype in NEW:
        rows.append(corner_rows(gtype))
    if gtype == GGMLType.MXFP4:
        rows.append(rng.integers(0, 256, (5, FORMATS[gtype].row_bytes(k)), dtype=np.uint8))
    for stored in rows:
        width = stored.shape[1] // FORMATS[gtype].block_bytes * FORMATS[gtype].block_values
        w = DeviceWeight.from_stored("w", gtype, stored, width)
        out = cuda.device_array((w.n, width), np.float32)
        pieces_kernel(gtype)[1, w.n](w.data, out, width)
        got, want = out.copy_to_host(), dequantize(stored, gtype, width)
        bad = np.flatnonzero(got != want)
        assert not bad.size, (f"{gtype.name} [{w.n}, {width}]: {bad.size} values differ, first at "
                              f"{np.unravel_index(bad[0], got.shape)}: {got.flat[bad[0]]!r} != {want.flat[bad[0]]!r}")


def test_refuses_what_it_does_not_take():
    w, _, _ = weight(8, 64, GGMLType.MXFP4)
    assert supports(w, np.uint16) == (not SIM)
    assert not supports(w, np.float32)
    with pytest.raises(ValueError, match="not supported"):
        linear_tc(cuda.to_device(np.zeros((2, 64), np.float32)), w, cuda.device_array((2, 8), np.float32), 2)
    for gtype in ALL:
        assert supports(weight(8, 256, gtype)[0], np.uint16) == (not SIM)
    short = dataclasses.replace(weight(8, 512, GGMLType.Q4_K)[0], k=384)  # K not a multiple of the block
    assert not supports(short, np.uint16)
    f16 = DeviceWeight.from_values("w", np.zeros((8, 64), np.float32), GGMLType.F16)  # no tc pieces
    assert not supports(f16, np.uint16)
    with pytest.raises(ValueError, match="linear_tc w"):
        linear_tc(cuda.to_device(np.zeros((2, 32), np.uint16)), w, cuda.device_array((2, 8), np.uint16), 2)


def test_all_is_every_type_with_tc_pieces():
    """ALL, the types these tests hold tc to, is every type with tc pieces."""
    assert ALL == [gtype for gtype, qt in DEVICE_TYPES.items() if qt.tc is not None]


@pytest.mark.parametrize("gtype", [GGMLType.BF16, GGMLType.Q8_0], ids=lambda t: t.name)
def test_forced_tc_refuses_bf16_and_q8_0(gtype):
    """BF16 and Q8_0 are stages.gemm_wgmma's and gemm_pipe's (stages.linear picks them): linear(kernel="tc")
    refuses them as any weight tc does not take, naming the weight and the types it takes."""
    w, _, _ = weight(24, 64, gtype)
    assert not supports(w, np.uint16)
    x = cuda.to_device(np.zeros((20, 64), np.uint16))
    with pytest.raises(ValueError, match=rf"linear_tc w: {gtype.name} weight \[24, 64\] with uint16 inputs is not "
                                         r"supported \(bf16 inputs; Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, MXFP4 weights"):
        linear(x, w, cuda.device_array((20, 24), np.uint16), 20, kernel="tc")


# Flash shapes: (N, K) of each projection that prefill runs through a GEMM (wo_a grouped 8 x 1024).
FLASH = {"wq_a": (1280, 5120), "wq_b": (32768, 1280), "wkv": (512, 5120), "wo_b": (5120, 8192),
         "idx_wq_b": (4096, 1280), "idx_proj": (32, 5120), "wk": (128, 512), "engram_wkv": (25600, 6144)}


# the token counts vary fastest (the outermost parametrize), so the weight is made once for them
@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [9, 64, 300])
@pytest.mark.parametrize("name", list(FLASH))
@pytest.mark.parametrize("gtype", ALL, ids=lambda t: t.name)
def test_flash_shapes(tokens, name, gtype):
    """Bit-equal fractions on the H200 (2026-12-01): Q2_K 99.91-100%; the K-quants and MXFP4 (wq_b,
    wo_b, idx_wq_b at T = 64 only, so far) 99.967-99.997%; nothing out of the sqrt(K) bound (-s
    prints each)."""
    n, k = FLASH[name]
    check_tc(gtype, tokens, 1, n, k, True, tokens)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [64, 300])
@pytest.mark.parametrize("out_bf16", [True, False], ids=["bf16", "f32"])
@pytest.mark.parametrize("gtype", ALL, ids=lambda t: t.name)
def test_flash_grouped_wo_a(tokens, out_bf16, gtype):
    """Bit-equal fractions (bf16 out) and errors as fractions of the bound (fp32 out): on the H200
    (2026-12-01) Q2_K's groups above 99.9% bit-equal, its fp32 errors a few hundredths of the bound
    at most (-s prints each). The K-quants and MXFP4 at T = 64, bf16 out: 99.969-99.999% bit-equal
    (the other cases not run on a GPU yet)."""
    check_tc(gtype, tokens, 8, 1024, 4096, out_bf16, tokens)


@pytest.mark.gpu
@pytest.mark.parametrize("gtype", ALL, ids=lambda t: t.name)
def test_flash_long_prefill(gtype):
    """A 4096-token prefill's wq_a (plus a partial token tile), fp32 out: the largest error on the
    H200 (2026-12-01) 0.001 of the bound for Q2_K (the K-quants and MXFP4: not yet run on a GPU)."""
    check_tc(gtype, 4096 + 37, 1, 1280, 5120, False, 1)
