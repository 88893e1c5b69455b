"""stages.linear_imma against the oracle's linear (host.numerics) through tests/bounds.py's product
rules (bf16 out: at least 99% of outputs bit-equal to the oracle, every output within half a bf16
ulp plus the sqrt(K) bound; fp32 out: the sqrt(K) bound): T = 1, 2, 8 and past a launch, rows that
are not whole tiles, slices of K ending inside a walk step, one slice and several (the workspace
and its counters), the grouped product, inputs of a wide range inside a block, zeros and negative
values; Q4_K, Q5_K and Q2_K (random valid super-blocks and corner ones, the split terms' bound), Q3_K
and Q6_K (random valid and corner super-blocks; Q3_K's extreme scales and levels besides, the int8
corner -sc q = -128 of its A registers included) and MXFP4 (its exponent corners, inf and NaN
included, are test_quants_more's) on the same paths. The
digit split is held to a host reference of its own (X and its four balanced digits,
which must add back up to X exactly). On the simulator the mma is emulated (exactly, in integers)
and the shapes small; the flash shapes run on a GPU. tests/test_mutants_products.py runs broken
imma kernels through the same checks."""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda, uint32, uint64  # noqa: E402  (after conftest chose the backend)

from flashv41.host.numerics import bf16, from_bits, to_bits
from flashv41.host.quants import FORMATS, GGMLType, dequantize
from flashv41.stages import linear_imma
from flashv41.stages.imma_digits import COLUMN_WORDS, FIELD_MIN, SLICE_STEPS_MAX, TARGET_WARPS, X_BITS, octet_digits
from flashv41.stages.linear import DeviceWeight, linear, pick_kernel
from flashv41.stages.linear_imma import IMMA_TYPES, MAX_TOKENS, plan
from tests.bounds import weight_terms
from tests.test_linear import check_groups, check_linear, weight
from tests.test_linear_tc import FLASH
from tests.test_linear_tc import weight as tc_weight

# --------------------------------------------------------------------------- the digits


def host_digits(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The host's reference of a block's split: bf16 values x [32] (float32) -> (X int64 [32], the
    balanced digits int64 [4, 32], the block's scale back 2^(E - X_BITS)), E the largest magnitude's
    binary exponent, at least FIELD_MIN - 127."""
    field = max(int((to_bits(x).astype(np.int64) >> 7 & 0xFF).max()), FIELD_MIN)
    e = field - 127
    big = np.rint(x.astype(np.float64) * 2.0 ** (X_BITS - e)).astype(np.int64)
    digits = np.empty((4, x.size), np.int64)
    rest = big.copy()
    for p in range(4):
        digits[p] = (rest + 128) % 256 - 128  # the balanced digit: rest minus it is a multiple of 256
        rest = (rest - digits[p]) // 256
    assert (rest == 0).all()
    return big, digits, 2.0 ** (e - X_BITS)


@cuda.jit
def digits_kernel(x32, digits, scales):
    q = uint32(cuda.threadIdx.x)
    octet_digits(x32, uint32(0), uint32(0), q, digits, uint64(q), scales, uint64(0))


def device_digits(x: np.ndarray) -> tuple[np.ndarray, float]:
    """octet_digits (the kernel's prologue piece, four lanes a block, in a kernel of four threads) on
    one block of 32 bf16 -> (digits int64 [4, 32], scale)."""
    digits = cuda.to_device(np.zeros(4 * COLUMN_WORDS, np.uint64))
    scales = cuda.to_device(np.zeros(1, np.float32))
    digits_kernel[1, 4](cuda.to_device(to_bits(x).view(np.uint32).reshape(1, 16)), digits, scales)
    host = digits.copy_to_host()
    words = np.stack([host[p * COLUMN_WORDS:p * COLUMN_WORDS + 4] for p in range(4)])  # [digit, 8 values]
    return words.view(np.int8).reshape(4, 32).astype(np.int64), float(scales.copy_to_host()[0])


def blocks_of_every_kind(rng) -> list[np.ndarray]:
    """Blocks of 32 bf16: Gaussian; a range of 2^-20 .. 2^4 with zeros and both signs; all zeros;
    one value and the rest far below it (2^-40: rounded); the largest bf16 magnitudes; tiny blocks
    (below 2^-97, scaled as if 2^-97) and subnormals."""
    wide = rng.choice([-1, 1], 32) * 2.0 ** rng.uniform(-20, 4, 32)
    wide[::7] = 0
    lone = np.full(32, 2.0**-40) * rng.choice([-1, 1], 32)
    lone[5] = -3.0
    return [bf16(v.astype(np.float32)) for v in (
        rng.standard_normal(32), wide, np.zeros(32), lone, rng.choice([-1, 1], 32) * 3.3e38,
        rng.standard_normal(32) * 2.0**-110, rng.standard_normal(32) * 2.0**-130)]


def test_digits_add_back_up_to_x():
    """For each kind of block: the device's digits are the host's, they add back up to X exactly,
    and X * 2^(E - X_BITS) is x exactly for every |x| >= 2^(E - 22), within 2^(E - X_BITS - 1) below."""
    rng = np.random.default_rng(11)
    for x in blocks_of_every_kind(rng):
        big, digits, back = host_digits(x)
        got, got_back = device_digits(x)
        assert np.array_equal(got, digits), f"digits differ for {x[:4]}..."
        assert got_back == back
        assert (np.abs(digits) <= 128).all() and (digits <= 127).all()
        assert np.array_equal(sum(digits[p] << (8 * p) for p in range(4)), big)
        e = np.log2(back) + X_BITS
        err = np.abs(big * back - x.astype(np.float64))
        exact = np.abs(x) >= 2.0 ** (e - 22)
        assert (err[exact] == 0).all() and (err <= 2.0 ** (e - X_BITS - 1)).all()


# ------------------------------------------------------------------- the products (simulator)


@pytest.mark.parametrize("n,k,tokens,out", [(40, 352, 1, "bf16"), (40, 256, 2, "f32"), (24, 256, 8, "bf16"),
                                            (20, 96, 11, "bf16")])
def test_imma(n, k, tokens, out):
    """40 outputs (two tiles and a partial one) of K = 352 (11 blocks: three slices, the last a
    partial walk step) and K = 256 (two slices); T = 8 (four token pairs), T = 11 (two launches) on
    a K of one partial step. Simulator: 100% bit-equal (bf16 out); fp32 out within a few
    thousandths of the bound."""
    w, wq = weight(np.random.default_rng(n + k + tokens), n, k, GGMLType.Q8_0)
    check_linear(w, wq, tokens, "imma", out_bf16=out == "bf16", seed=tokens)


@pytest.mark.parametrize("tokens", [1, 2])
def test_imma_grouped(tokens):
    """The attention's wo_a: three groups of 32 outputs, each reading its own slice of x (one slice
    of K: the outputs written straight from the block)."""
    w, wq = weight(np.random.default_rng(3), 96, 128, GGMLType.Q8_0)
    check_linear(w, wq, tokens, "imma", group_rows=32, seed=5)


def run_imma(w: DeviceWeight, x: np.ndarray, out_bf16: bool = True, group_rows: int = 0) -> np.ndarray:
    """linear(kernel="imma") on the bf16 inputs x [T, K_total] -> the outputs (float32 values)."""
    y = cuda.device_array((x.shape[0], w.n), np.uint16 if out_bf16 else np.float32)
    linear(cuda.to_device(to_bits(x)), w, y, x.shape[0], group_rows=group_rows, kernel="imma")
    return from_bits(y.copy_to_host()) if out_bf16 else y.copy_to_host()


@pytest.mark.parametrize("out", ["bf16", "f32"])
def test_wide_range_inside_a_block(out):
    """Inputs whose magnitudes span 2^-20 .. 2^4 inside every block, with zeros and both signs, and a
    token of zeros: the small values are exact (X keeps 22 binades below the block's largest) or
    rounded far below the bound."""
    rng = np.random.default_rng(5)
    w, wq = weight(rng, 40, 256, GGMLType.Q8_0)
    x = rng.choice([-1.0, 1.0], (3, 256)) * 2.0 ** rng.uniform(-20, 4, (3, 256))
    x[:, ::5] = 0
    x[1] = 0
    x = bf16(x.astype(np.float32))
    got = run_imma(w, x, out == "bf16")
    check_groups(got, x, wq, w.n, out == "bf16", f"imma wide range {out} out", {})
    assert (got[1] == 0).all()


def test_a_token_is_the_same_in_any_batch():
    """Tokens 0 and 7 of a batch of 8 (another compiled cap than one token's) give the same bits
    alone; the product has two slices, so its workspace and counters serve each launch in turn."""
    w, _ = weight(np.random.default_rng(7), 40, 256, GGMLType.Q8_0)
    assert plan(40, 256, 1).slices > 1
    x = bf16(np.random.default_rng(8).standard_normal((8, 256)).astype(np.float32))
    batch = run_imma(w, x)
    for t in (0, 7):
        assert np.array_equal(run_imma(w, x[t:t + 1])[0], batch[t]), f"token {t} alone differs"


# ------------------------------------------------------- K-quant and MXFP4 weights (simulator)


NEW_TYPES = [GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.MXFP4, GGMLType.Q2_K, GGMLType.Q6_K, GGMLType.Q3_K]
# (outputs, K, tokens, out, group rows); MXFP4 (steps of four blocks) swaps K = 512 for 352: three
# slices, the last a partial step
TYPE_CASES = [(40, 512, 1, "bf16", 0), (40, 256, 2, "f32", 0), (24, 512, 8, "bf16", 0), (64, 256, 2, "bf16", 32)]


@pytest.mark.parametrize("gtype", NEW_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n,k,tokens,out,group_rows", TYPE_CASES)
def test_imma_types(gtype, n, k, tokens, out, group_rows):
    """Random valid blocks (the K-quants: the first rows their corner blocks, extreme scales, mins
    and levels, tests/blocks.py; MXFP4's exponent corners are test_quants_more's), against the
    oracle with the split terms' bound for the K-quants (d sc q and dmin m added apart): K = 512 in two slices (one
    super-block each on the simulator; MXFP4: K = 352, three slices, the last a partial step) and
    K = 256 in one, T = 1, 2, 8, grouped and not. Simulator: 100% bit-equal (bf16 out); fp32 out far
    inside the bound. Q2_K's grouped case is twice as wide: on 32 rows of this seed one output of
    the 64 a group sits 2^-22 (relative) from a bf16 midpoint, where the oracle's float64 sum and the
    kernel's exact block sums round to its two sides (both within the bound), and the 99% rule on
    64 outputs allows none."""
    k = 352 if gtype == GGMLType.MXFP4 and k == 512 else k
    if gtype == GGMLType.Q2_K and group_rows:  # groups of 64 rows: 128 outputs a group (see below)
        n, group_rows = 2 * n, 2 * group_rows
    w, wq, _ = tc_weight(n, k, gtype, corners=gtype != GGMLType.MXFP4)
    check_linear(w, wq, tokens, "imma", group_rows=group_rows, out_bf16=out == "bf16", seed=tokens)


@pytest.mark.parametrize("gtype", NEW_TYPES, ids=lambda t: t.name)
def test_imma_types_wide_range_inside_a_block(gtype):
    """test_wide_range_inside_a_block's inputs (2^-20 .. 2^4 in every block, zeros, a token of zeros):
    Q4_K's minimum term's block sums are taken from the same digits, exactly; MXFP4's digits are in
    its own order."""
    rng = np.random.default_rng(6)
    w, wq, _ = tc_weight(40, 512, gtype)
    x = rng.choice([-1.0, 1.0], (3, 512)) * 2.0 ** rng.uniform(-20, 4, (3, 512))
    x[:, ::5] = 0
    x[1] = 0
    x = bf16(x.astype(np.float32))
    got = run_imma(w, x)
    check_groups(got, x, wq, w.n, True, f"imma {gtype.name} wide range", weight_terms(w, "imma"))
    assert (got[1] == 0).all()


def q3_k_rows(c: np.ndarray, raw: np.ndarray, d: np.ndarray) -> np.ndarray:
    """Stored Q3_K rows (uint8 [n, row_bytes]) of stored 6-bit scales c [n, blocks, 16], raw levels
    raw [n, blocks, 256] (q + 4, 0..7) and fp16 d [n, blocks]: value i of group j is
    d (c_j - 32) (raw_i - 4), packed as host.quants.dequantize_q3_k reads it."""
    n, blocks = d.shape
    packed = np.zeros((n, blocks), FORMATS[GGMLType.Q3_K].block)
    qs = np.zeros((n, blocks, 64), np.uint8)
    hmask = np.zeros((n, blocks, 32), np.uint8)
    for chunk in range(8):
        levels = raw[:, :, 32 * chunk:32 * chunk + 32].astype(np.uint8)
        qs[:, :, 32 * (chunk // 4):32 * (chunk // 4) + 32] |= (levels & 3) << (2 * (chunk % 4))
        hmask |= (levels >> 2) << chunk
    scales = np.zeros((n, blocks, 12), np.uint8)
    for j in range(16):
        scales[:, :, j % 8] |= (c[:, :, j].astype(np.uint8) & 15) << (4 * (j // 8))
        scales[:, :, 8 + j % 4] |= (c[:, :, j].astype(np.uint8) >> 4) << (2 * (j // 4))
    packed["hmask"], packed["qs"], packed["scales"], packed["d"] = hmask, qs, scales, d
    return packed.view(np.uint8).reshape(n, -1)


def q3_k_extremes(rng, n: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q3_K rows at the ends of the A registers' int8 range (-sc q = (32 - c) (4 - raw)): rows 0-3
    every value sc = -32, q = -4 (-sc q = -128, the one product sc q = 128 outside int8); then
    sc = 31, q = -4 (124); sc = -32, q = 3 (96); sc = 31, q = 3 (-93); sc = 0 (a zero row); the rest
    sc = -32 or 31 by group at random (so a lane reading the other group's scale is far off), with
    levels 0..7 at random; half of them rows of sc = -32 or -31 and q = -4 or -3 alone (-sc q from
    -128 to -93: P past 2^24 on inputs of one sign near their blocks' largest, with more than 24
    significant bits where its terms share no power of two). -> (stored rows, c, raw)."""
    blocks = k // 256
    c = np.where(rng.integers(0, 2, (n, blocks, 16)) == 1, 63, 0)
    raw = rng.integers(0, 8, (n, blocks, 256))
    half = n // 2
    c[half:] = rng.integers(0, 2, (n - half, blocks, 16))
    raw[half:] = rng.integers(0, 2, (n - half, blocks, 256))
    for row, (scale, level) in enumerate([(0, 0)] * 4 + [(63, 0), (0, 7), (63, 7), (32, 3)]):
        c[row], raw[row] = scale, level
    d = (rng.uniform(0.5, 1.5, (n, blocks)) * k**-0.5 / 43).astype(np.float16)
    return q3_k_rows(c, raw, d), c, raw


@pytest.mark.parametrize("tokens,out", [(1, "bf16"), (2, "f32")])
def test_imma_q3_k_extremes(tokens, out):
    """q3_k_extremes' rows (K = 512: two slices on the simulator) against the oracle, on Gaussian
    inputs and (T = 2) a token of inputs in [1, 2), every fourth 2^-6 of that (2^-6 below its block's
    largest: its bf16 bits reach the top digit pair's lowest, which the others' do not): the rows
    of sc = -32, -31 and q = -4, -3 then give chunks whose P passes 2^24 with more than 24
    significant bits (checked on the host, from the digits), so its conversion rounds. The packing
    is held to the host's dequantiser first."""
    n, k = 32, 512
    rng = np.random.default_rng(tokens)
    stored, c, raw = q3_k_extremes(rng, n, k)
    wq = dequantize(stored, GGMLType.Q3_K, k)
    d = stored.reshape(n, k // 256, -1)[:, :, -2:].copy().view(np.float16)[:, :, 0].astype(np.float32)
    expect = (d[:, :, None] * (c - 32).astype(np.float32))[:, :, :, None] * (raw - 4).reshape(n, k // 256, 16, 16)
    assert np.array_equal(wq, expect.reshape(n, k)), "q3_k_rows packs what dequantize_q3_k reads"
    x = rng.standard_normal((tokens, k))
    x[1:] = rng.uniform(1, 2, (tokens - 1, k))
    x[1:, ::4] *= 2.0**-6
    x = bf16(x.astype(np.float32))
    if tokens > 1:  # the top digit pair's P of each row and chunk of the token of one sign
        digits = np.stack([host_digits(x[1, b:b + 32])[1] for b in range(0, k, 32)], axis=1)  # [digit, chunk, 32]
        a = (32 - c).repeat(16, axis=2) * (raw - 4)  # [row, block, 256] -sc q
        p = np.einsum("rcv,cv->rc", a.reshape(n, k // 32, 32), digits[2] + 256 * digits[3])
        assert (np.abs(a) == 128).any() and (np.abs(p) >= 2**24).any()
        assert (p.astype(np.float32).astype(np.int64) != p).any(), "some P rounds in its conversion"
    w = DeviceWeight.from_stored("w", GGMLType.Q3_K, stored, k)
    got = run_imma(w, x, out == "bf16")
    check_groups(got, x, wq, n, out == "bf16", f"imma Q3_K extremes T={tokens} {out} out", {})


# The flash decode shapes [N, K] and the types imma is picked for on each (measured on an H100,
# docs/performance-log.md "imma, pipe and the picks" and later sections): Q4_K and Q5_K on every
# shape of 16M values or more, Q2_K, MXFP4 and Q3_K on those with N >= K too (not the wide wo_b),
# Q8_0 and Q6_K on the tall wq_b alone.
PICKED = {"wq_a": (1280, 5120, ""), "wkv": (512, 5120, ""), "index_wq_b": (4096, 1280, ""),
          "wq_b": (32768, 1280, "Q2_K Q3_K Q4_K Q5_K MXFP4 Q8_0 Q6_K"),
          "wo_a": (8192, 4096, "Q2_K Q3_K Q4_K Q5_K MXFP4"), "wo_b": (5120, 8192, "Q4_K Q5_K"),
          "engram_wkv": (25600, 6144, "Q2_K Q3_K Q4_K Q5_K MXFP4")}


@pytest.mark.parametrize("name", list(PICKED))
def test_decode_pick_is_the_measured_table(name):
    n, k, types = PICKED[name]
    for gtype in [*IMMA_TYPES, GGMLType.BF16]:
        assert linear_imma.decode_pick(gtype, n, k) == (gtype.name in types.split()), (name, gtype.name)


def test_refuses_what_it_does_not_take():
    w, _ = weight(np.random.default_rng(1), 32, 64, GGMLType.Q8_0)
    assert pick_kernel(w, True, 1) == "stream"  # a small Q8_0 weight: imma is not picked for it
    bf, _ = weight(np.random.default_rng(2), 8, 256, GGMLType.BF16)
    y = cuda.device_array((2, 32), np.uint16)
    with pytest.raises(ValueError, match="linear_imma w: BF16"):
        linear(cuda.to_device(np.zeros((2, 256), np.uint16)), bf, cuda.device_array((2, 8), np.uint16), 2,
               kernel="imma")
    with pytest.raises(ValueError, match="linear_imma w: Q8_0 .* float32 inputs"):
        linear(cuda.to_device(np.zeros((2, 64), np.float32)), w, y, 2, kernel="imma")
    with pytest.raises(ValueError, match="groups of 8 rows"):
        linear_imma.linear_imma(cuda.to_device(np.zeros((2, 256), np.uint16)), w, y, 2, group_rows=8)


@pytest.mark.parametrize("name", list(FLASH) + ["wo_a"])
def test_plan_fills_the_gpu(name):
    """Every flash decode shape gets half of TARGET_WARPS warps at least (slices rounded to whole walk
    steps) or slices of one step, slices of at most SLICE_STEPS_MAX steps, and every slice some of K."""
    n, k, groups = (1024, 4096, 8) if name == "wo_a" else (*FLASH[name], 1)
    p = plan(n, k, groups)
    steps = -(-k // 32 // 4)
    assert p.slice_blocks // 4 <= SLICE_STEPS_MAX and (p.slices - 1) * p.slice_blocks < k // 32
    assert 2 * p.tile_groups * p.slices * p.warps >= TARGET_WARPS or p.slices == steps


# ------------------------------------------------------------------------ flash sizes (GPU)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 2, 8])
@pytest.mark.parametrize("name", list(FLASH))
@pytest.mark.parametrize("gtype", [GGMLType.Q8_0, *NEW_TYPES], ids=lambda t: t.name)
def test_flash_shapes(gtype, tokens, name):
    """Every decode shape at one, two and eight tokens (-s prints each check's bit-equal fraction)."""
    n, k = FLASH[name]
    w, wq, _ = tc_weight(n, k, gtype, corners=gtype != GGMLType.MXFP4)
    check_linear(w, wq, tokens, "imma", seed=tokens)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens,out", [(1, "bf16"), (8, "f32")])
@pytest.mark.parametrize("gtype", [GGMLType.Q8_0, *NEW_TYPES], ids=lambda t: t.name)
def test_flash_grouped_wo_a(gtype, tokens, out):
    w, wq, _ = tc_weight(8 * 1024, 4096, gtype)
    check_linear(w, wq, tokens, "imma", group_rows=1024, out_bf16=out == "bf16", seed=tokens)


@pytest.mark.gpu
def test_flash_a_token_is_the_same_in_any_batch():
    """wo_b (seven slices): tokens of a batch of MAX_TOKENS alone, twice (the counters reset)."""
    w, _, _ = tc_weight(*FLASH["wo_b"], GGMLType.Q8_0)
    x = bf16(np.random.default_rng(9).standard_normal((MAX_TOKENS, w.k)).astype(np.float32))
    batch = run_imma(w, x)
    for t in (0, MAX_TOKENS - 1, 0):
        assert np.array_equal(run_imma(w, x[t:t + 1])[0], batch[t]), f"token {t} alone differs"
