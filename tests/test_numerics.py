"""host.numerics: the quantisers at every tie and saturation boundary, worked out by hand; bf16
rounding; the RoPE tables and rotation.

Expected values are written as exact binary fractions (`2.0**-9 * 3`), each derived in a comment
from the format's definition: e4m3fn has 3 mantissa bits, exponent bias 7, subnormals m * 2^-9,
largest finite 448 = 1.75 * 2^8; E2M1 holds 0, 0.5, 1, 1.5, 2, 3, 4, 6; bf16 keeps 8 significant
bits. Random cases compare against independent formulations (a lookup table of every finite e4m3
value, Python's float arithmetic), never against the functions under test.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashv41.host.numerics import (
    act_quant,
    bf16,
    e2m1,
    e4m3,
    fp4_act_quant,
    from_bits,
    pow2_ceil_scale,
    rope_table,
    rotate,
    to_bits,
)

F32 = np.float32
PROPERTY = settings(max_examples=300, deadline=None, derandomize=True, database=None)


def f32s(*values: float) -> np.ndarray:
    return np.array(values, dtype=F32)


def assert_bits_equal(got: np.ndarray, want: np.ndarray, what: str, inputs: np.ndarray | None = None) -> None:
    """Equal as float32 bit patterns (so -0.0 != +0.0); report the first difference."""
    g = np.ascontiguousarray(got, F32)
    w = np.ascontiguousarray(want, F32)
    assert g.shape == w.shape, f"{what}: shape {g.shape} != {w.shape}"
    bad = np.flatnonzero(g.view(np.uint32).ravel() != w.view(np.uint32).ravel())
    if bad.size:
        i = int(bad[0])
        v = None if inputs is None else float(np.ravel(inputs)[i])
        x = "" if v is None else f"input {v!r} ({v.hex()}), "
        raise AssertionError(f"{what}: {bad.size} of {g.size} differ; first at flat index {i}: {x}"
                             f"got {float(g.ravel()[i])!r}, want {float(w.ravel()[i])!r}")


# --- e4m3 ---------------------------------------------------------------------------------------------


def test_e4m3_subnormals() -> None:
    q = 2.0**-9  # the subnormal step; the smallest normal 2^-6 is 8 steps
    exact = [m * q for m in range(9)]
    assert_bits_equal(e4m3(f32s(*exact)), f32s(*exact), "subnormals are exact")
    # the midpoints (2m + 1) * 2^-10 round to the even m
    mids = [(2 * m + 1) * q / 2 for m in range(8)]
    want = [0, 2 * q, 2 * q, 4 * q, 4 * q, 6 * q, 6 * q, 8 * q]
    assert_bits_equal(e4m3(f32s(*mids)), f32s(*want), "subnormal ties to even", f32s(*mids))
    # off the midpoints: to the nearest
    x = f32s(q * 0.49, q * 0.51, q * 1.49, q * 1.51, q * 7.4, q * 7.6, 2.0**-12)
    assert_bits_equal(e4m3(x), f32s(0, q, q, 2 * q, 7 * q, 8 * q, 0), "subnormal nearest", x)
    # the sign is kept, down to a negative zero
    x = f32s(-3 * q / 2, -q * 0.3, -0.0, 0.0)
    got = e4m3(x)
    assert_bits_equal(got, f32s(-2 * q, -0.0, -0.0, 0.0), "negative subnormals", x)


@pytest.mark.parametrize("e", range(-6, 9))
def test_e4m3_ties_at_every_exponent(e: int) -> None:
    """In [2^e, 2^(e+1)) the step is 2^(e-3); the midpoint between mantissas k and k+1 goes to the even
    one: down for even k, up for odd k (k = 7 up to the next power of two); above 448 it saturates."""
    base = 2.0**e
    mids, want, near = [], [], []
    for k in range(8):
        mids.append(base * (1 + (2 * k + 1) / 16))
        want.append(base * (1 + (k + k % 2) / 8))
        near.append(base * (1 + k / 8))
    want = [min(w, 448.0) for w in want]
    assert_bits_equal(e4m3(f32s(*mids)), f32s(*want), f"ties at 2^{e}", f32s(*mids))
    assert_bits_equal(e4m3(-f32s(*mids)), -f32s(*want), f"negative ties at 2^{e}", -f32s(*mids))
    representable = [v for v in near if v <= 448]
    assert_bits_equal(e4m3(f32s(*representable)), f32s(*representable), f"grid at 2^{e}")
    # one float32 step either side of a tie decides it
    below = np.nextafter(f32s(*mids), F32(0))
    above = np.nextafter(f32s(*mids), F32(np.inf))
    want_below = [min(base * (1 + k / 8), 448.0) for k in range(8)]
    want_above = [min(base * (1 + (k + 1) / 8), 448.0) for k in range(8)]
    assert_bits_equal(e4m3(below), f32s(*want_below), f"below the ties at 2^{e}", below)
    assert_bits_equal(e4m3(above), f32s(*want_above), f"above the ties at 2^{e}", above)


def test_e4m3_smallest_normal_and_saturation() -> None:
    assert float(e4m3(f32s(2.0**-6))[0]) == 2.0**-6
    assert float(e4m3(f32s(2.0**-6 * 1.0625))[0]) == 2.0**-6  # tie between mantissa 0 and 1: even
    assert float(e4m3(f32s(2.0**-6 * 1.1875))[0]) == 2.0**-6 * 1.25  # tie between 1 and 2: even (2)
    # 416 and 448 are the top two values; 432 is their midpoint (mantissa 5 / 6: up to 448)
    x = f32s(416, 430, 432, 440, 448, 449, 464, 480, 1e4, 3.4e38, np.inf, -449, -1e9, -np.inf)
    want = f32s(416, 416, 448, 448, 448, 448, 448, 448, 448, 448, 448, -448, -448, -448)
    assert_bits_equal(e4m3(x), want, "saturation", x)


def _e4m3_table() -> tuple[np.ndarray, np.ndarray]:
    """Every finite non-negative e4m3fn value by code 0..126 (0x7F is NaN), from the bit layout."""
    values = []
    for code in range(127):
        exp_field, man = code >> 3, code & 7
        values.append(man * 2.0**-9 if exp_field == 0 else (1 + man / 8) * 2.0 ** (exp_field - 7))
    return np.array(values), np.arange(127)


E4M3_VALUES, E4M3_CODES = _e4m3_table()


def e4m3_by_table(x: float) -> float:
    """Nearest table value to clamp(x, +-448), ties to the even code."""
    mag = min(abs(x), 448.0)
    i = int(np.searchsorted(E4M3_VALUES, mag))
    if i < len(E4M3_VALUES) and E4M3_VALUES[i] == mag:
        v = E4M3_VALUES[i]
    else:
        lo, hi = E4M3_VALUES[i - 1], E4M3_VALUES[i]
        if mag - lo < hi - mag:
            v = lo
        elif mag - lo > hi - mag:
            v = hi
        else:
            v = lo if E4M3_CODES[i - 1] % 2 == 0 else hi
    return math.copysign(v, x)


@PROPERTY
@given(st.floats(width=32, allow_nan=False, allow_infinity=True))
def test_e4m3_matches_the_code_table(x: float) -> None:
    got = e4m3(f32s(x))
    assert_bits_equal(got, f32s(e4m3_by_table(x)), "e4m3 vs table", f32s(x))


@PROPERTY
@given(st.integers(0, 126), st.booleans())
def test_e4m3_midpoints_of_neighbouring_codes(a: int, negative: bool) -> None:
    """The midpoint of every pair of neighbouring codes goes to the even code."""
    if a == 126:
        return
    mid = (E4M3_VALUES[a] + E4M3_VALUES[a + 1]) / 2
    want = E4M3_VALUES[a] if a % 2 == 0 else E4M3_VALUES[a + 1]
    s = -1.0 if negative else 1.0
    assert_bits_equal(e4m3(f32s(s * mid)), f32s(s * want), f"midpoint of codes {a}, {a + 1}")


# --- act_quant (fp8, power-of-two scale) --------------------------------------------------------------


def block32(*head: float, fill: float = 0.0) -> np.ndarray:
    out = np.full(32, fill, F32)
    out[: len(head)] = head
    return out


def test_pow2_ceil_scale() -> None:
    inv448 = F32(1 / 448)
    # f32(1/448) = 0x1.24924ap-9 is a little above 1/448: 448 * it = 1 + 3 * 2^-26 exactly, which
    # rounds to 1.0 in float32, so amax = 448 * 2^k gives the scale 2^k exactly (mantissa zero)
    assert float(inv448).hex() == "0x1.24924a0000000p-9"
    amax = f32s(*(448 * 2.0**k for k in range(-20, 20)))
    assert_bits_equal(pow2_ceil_scale(amax, inv448), f32s(*(2.0**k for k in range(-20, 20))), "448 * 2^k")
    # anything above it, even by one float32 step, doubles the scale; 1.0 / 448 -> 2^-8
    x = f32s(np.nextafter(F32(448), F32(np.inf)), 1.0, 2.0, 300.0, 1e-4)
    # 1e-4 / 448 = 2.23e-7, between 2^-23 and 2^-22
    assert_bits_equal(pow2_ceil_scale(x, inv448), f32s(2.0, 2.0**-8, 2.0**-7, 1.0, 2.0**-22), "scales")


def test_act_quant_by_hand() -> None:
    # block 0: amax 448 -> scale exactly 1 (see test_pow2_ceil_scale); values quantise as e4m3 itself,
    # so 3 * 2^-11 (0.75 of the smallest subnormal) -> 2^-9 and 2^-11 (a quarter) -> 0
    # block 1: amax 1 -> 1/448 rounds up to scale 2^-8: the same small values are normal there, exact;
    # 19/64 = 76 * 2^-8 is the tie between 72 and 80 (mantissas 1 and 2) -> 80 * 2^-8
    # block 2: amax 450 (the next bf16 above 448) -> scale 2: 450 / 2 = 225 -> 224 (step 16) -> 448
    x = np.concatenate([
        block32(448.0, 3 * 2.0**-11, 2.0**-11, -0.296875, 1.0),
        block32(1.0, 3 * 2.0**-11, 2.0**-11, -0.296875, -1.0),
        block32(450.0, 3.0, 1.0, -448.0),
    ])
    want = np.concatenate([
        block32(448.0, 2.0**-9, 0.0, -0.3125, 1.0),
        block32(1.0, 3 * 2.0**-11, 2.0**-11, -0.3125, -1.0),
        # 3 / 2 = 1.5 exact; 1 / 2 exact; -448 / 2 = -224 exact
        block32(448.0, 3.0, 1.0, -448.0),
    ])
    assert_bits_equal(act_quant(x), want, "act_quant blocks", x)
    # a [T, n] array quantises row by row, block by block
    assert_bits_equal(act_quant(np.stack([x, x[::-1]])), np.stack([want, act_quant(x[::-1])]), "2-D")


def test_act_quant_amax_floor() -> None:
    # amax floored at 1e-4 -> scale 2^-22: 2^-30 / 2^-22 = 2^-8 = 2 subnormal steps, exact;
    # 2^-32 -> 2^-10, half a step: the tie goes to 0; 3 * 2^-33 -> 0.75 step -> 2^-31
    x = block32(2.0**-30, 2.0**-32, 3 * 2.0**-33, -(2.0**-30))
    assert_bits_equal(act_quant(x), block32(2.0**-30, 0.0, 2.0**-31, -(2.0**-30)), "floored amax", x)
    # an all-zero block: no NaN
    assert_bits_equal(act_quant(np.zeros(64, F32)), np.zeros(64, F32), "zeros")
    # without the floor 2^-32 would have been exact: the floor is what flushes it
    x = block32(2.0**-32)
    assert_bits_equal(act_quant(x), np.zeros(32, F32), "a lone tiny value", x)


def test_act_quant_block_size() -> None:
    x = np.concatenate([block32(448.0, 2.0**-11), block32(1.0, 2.0**-11)])
    assert act_quant(x)[1] == 0.0 and act_quant(x)[33] == 2.0**-11
    # one block of 64: the 448 sets the scale for both halves
    assert act_quant(x, block=64)[33] == 0.0


# --- E2M1 ---------------------------------------------------------------------------------------------


def test_e2m1_midpoints() -> None:
    # codes 0..7 = 0, 0.5, 1, 1.5, 2, 3, 4, 6; a tie goes to the even code:
    # 0.25 -> 0 (code 0), 0.75 -> 1 (code 2), 1.25 -> 1 (2), 1.75 -> 2 (4), 2.5 -> 2 (4), 3.5 -> 4 (6),
    # 5 -> 4 (6)
    mids = f32s(0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
    assert_bits_equal(e2m1(mids), f32s(0, 1, 1, 2, 2, 4, 4), "midpoints", mids)
    assert_bits_equal(e2m1(-mids), -f32s(0, 1, 1, 2, 2, 4, 4), "negative midpoints", -mids)
    below = np.nextafter(mids, F32(0))
    above = np.nextafter(mids, F32(np.inf))
    assert_bits_equal(e2m1(below), f32s(0, 0.5, 1, 1.5, 2, 3, 4), "just below", below)
    assert_bits_equal(e2m1(above), f32s(0.5, 1, 1.5, 2, 3, 4, 6), "just above", above)
    grid = f32s(0, 0.5, 1, 1.5, 2, 3, 4, 6)
    assert_bits_equal(e2m1(grid), grid, "grid")
    assert_bits_equal(e2m1(-grid), -grid, "negative grid")


def test_e2m1_clamp_and_zero_sign() -> None:
    x = f32s(5.99, 6.0, 6.5, 100.0, -7.0, 0.0, -0.0, -0.1, -0.25, 0.1)
    want = f32s(6, 6, 6, 6, -6, 0.0, -0.0, -0.0, -0.0, 0.0)
    assert_bits_equal(e2m1(x), want, "clamp and signed zero", x)


E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def e2m1_by_grid(x: float) -> float:
    """The nearest E2M1 value to x (clamped to +-6), ties to the even code, sign kept."""
    dist = [abs(min(abs(x), 6.0) - g) for g in E2M1_VALUES]
    best = min(dist)
    codes = [c for c, d in enumerate(dist) if d == best]
    code = codes[0] if len(codes) == 1 else next(c for c in codes if c % 2 == 0)
    return math.copysign(E2M1_VALUES[code], x)


@PROPERTY
@given(st.floats(-8, 8, width=32))
def test_e2m1_nearest(x: float) -> None:
    assert_bits_equal(e2m1(f32s(x)), f32s(e2m1_by_grid(x)), "e2m1 nearest", f32s(x))


# --- fp4_act_quant ----------------------------------------------------------------------------------------


def test_fp4_e8m0_by_hand() -> None:
    # f32(1/6) = 0x1.555556p-3: 6 * it = 1 + 2^-25, which rounds to 1.0, so amax 6 * 2^k -> scale 2^k
    assert float(F32(1 / 6)).hex() == "0x1.5555560000000p-3"
    # block 0: amax 6 -> scale 1: 5 -> 4 (tie down), 1.75 -> 2 (tie up), 0.25 -> 0, -2.5 -> -2
    # block 1: amax 7 -> 7/6 -> scale 2: 7 / 2 = 3.5 -> 4 -> 8 (the max grows); 5 / 2 = 2.5 -> 2 -> 4;
    #          1.5 / 2 = 0.75 -> 1 -> 2; -0.5 / 2 = -0.25 -> -0 -> -0
    # block 2: amax 3 -> 1/2 exactly -> scale 0.5: 3 / 0.5 = 6; 0.625 / 0.5 = 1.25 -> 1 -> 0.5
    x = np.concatenate([block32(6.0, 5.0, 1.75, 0.25, -2.5), block32(7.0, 5.0, 1.5, -0.5),
                        block32(-3.0, 0.625)])
    want = np.concatenate([block32(6.0, 4.0, 2.0, 0.0, -2.0), block32(8.0, 4.0, 2.0, -0.0),
                           block32(-3.0, 0.5)])
    assert_bits_equal(fp4_act_quant(x, 32, e4m3_scale=False), want, "E8M0 blocks", x)


def test_fp4_e8m0_amax_floor() -> None:
    # amax floored at 6 * 2^-126: times f32(1/6) = 2^-126 * (1 + 2^-25) -> 2^-126, scale 2^-126
    # 2^-127 / 2^-126 = 0.5 exact; 2^-128 -> 0.25, the tie -> 0; 3 * 2^-127 -> 1.5 exact
    x = block32(2.0**-127, 2.0**-128, -3 * 2.0**-127)
    want = block32(2.0**-127, 0.0, -3 * 2.0**-127)
    assert_bits_equal(fp4_act_quant(x, 32, e4m3_scale=False), want, "E8M0 floor", x)
    z = np.zeros((2, 64), F32)
    assert_bits_equal(fp4_act_quant(z, 32, e4m3_scale=False), z, "E8M0 zeros")


def test_fp4_e4m3_scale_by_hand() -> None:
    # block 0: amax 6.5 -> 6.5 / 6 = 1.0833 -> e4m3 (step 1/8) 1.125: a scale that rounds up.
    #   6.5 / 1.125 = 5.78 -> 6 -> 6.75 (larger than the input); 1 / 1.125 = 0.89 -> 1 -> 1.125;
    #   -2.5 / 1.125 = -2.22 -> -2 -> -2.25; 0.25 / 1.125 = 0.22 -> 0
    # block 1: amax 6.25 -> 1.0417 -> e4m3 1.0 (rounds down): 6.25 clamps to 6 -> 6; 1.25 -> 1 (tie down)
    # block 2: amax 2^-4 -> 2^-4 / 6 = 0.0104 -> subnormal e4m3 (step 2^-9): 5.33 steps -> 5 * 2^-9;
    #   2^-4 / (5 * 2^-9) = 6.4 -> 6 -> 30 * 2^-9; 2^-6 / (5 * 2^-9) = 1.6 -> 1.5 -> 7.5 * 2^-9
    # block 3: amax below 6 * 2^-9 is floored there -> scale 2^-9: 3 * 2^-10 / 2^-9 = 1.5 exact;
    #   2^-11 -> 0.25 -> 0 (the tie); without the floor the scale would be e4m3(tiny) = 0
    x = np.concatenate([
        block32(6.5, 1.0, -2.5, 0.25)[:16], block32(-6.25, 1.25)[:16], block32(2.0**-4, 2.0**-6)[:16],
        block32(3 * 2.0**-10, -(2.0**-11))[:16],
    ])
    want = np.concatenate([
        block32(6.75, 1.125, -2.25, 0.0)[:16], block32(-6.0, 1.0)[:16],
        block32(30 * 2.0**-9, 7.5 * 2.0**-9)[:16], block32(3 * 2.0**-10, -0.0)[:16],
    ])
    assert_bits_equal(fp4_act_quant(x, 16, e4m3_scale=True), want, "E4M3-scaled blocks", x)
    z = np.zeros(32, F32)
    assert_bits_equal(fp4_act_quant(z, 16, e4m3_scale=True), z, "E4M3-scaled zeros")


@PROPERTY
@given(st.lists(st.floats(-1e3, 1e3, width=32), min_size=16, max_size=16), st.booleans())
def test_fp4_matches_its_definition(values: list[float], e4m3_scale: bool) -> None:
    """A scalar restatement in Python floats: scale, divide (float32), clamp, nearest grid value,
    multiply (exact: at most 3 + 4 significant bits), round to bf16."""
    x = bf16(f32s(*values))
    amax = max(abs(float(v)) for v in x)
    if e4m3_scale:
        scale = e4m3_by_table(float(F32(max(amax, 6 * 2.0**-9)) / F32(6)))
    else:
        a = float(F32(max(amax, 6 * 2.0**-126)) * F32(1 / 6))
        m, e = math.frexp(a)  # a = m * 2^e, m in [0.5, 1): 2^ceil(log2 a)
        scale = 2.0 ** (e - 1) if m == 0.5 else 2.0**e
    want = [e2m1_by_grid(float(F32(float(v) / scale))) * scale for v in x]
    got = fp4_act_quant(x, 16, e4m3_scale)
    assert_bits_equal(got, bf16(f32s(*want)), "fp4 definition", x)


# --- bf16 ------------------------------------------------------------------------------------------------


def test_bf16_ties_to_even() -> None:
    u = 2.0**-7  # the bf16 step in [1, 2)
    x = f32s(1 + u / 2, 1 + 3 * u / 2, 1 + u / 2 + 2.0**-23, 1 + 3 * u / 2 - 2.0**-23, 1 + u / 4,
             1 + u * 0.75, -(1 + u / 2), -(1 + 3 * u / 2), 2 - u / 2)
    want = f32s(1, 1 + 2 * u, 1 + u, 1 + u, 1, 1 + u, -1, -(1 + 2 * u), 2)
    assert_bits_equal(bf16(x), want, "bf16 ties", x)


def test_bf16_extremes_and_nan() -> None:
    big = (2 - 2.0**-7) * 2.0**127  # the largest bf16
    fmax = float(np.finfo(F32).max)
    x = f32s(big, fmax, -fmax, np.inf, -np.inf, 2.0**-133, 2.0**-134, 2.0**-149, -0.0)
    want = f32s(big, np.inf, -np.inf, np.inf, -np.inf, 2.0**-133, 0.0, 0.0, -0.0)
    assert_bits_equal(bf16(x), want, "bf16 extremes", x)
    # every NaN stays a NaN, including a signalling one whose payload is only in the low 16 bits
    # (truncating or rounding its bits naively gives infinity)
    nans = np.array([0x7FC00000, 0x7F800001, 0xFF800001, 0x7FFFFFFF, 0xFFC00000], np.uint32).view(F32)
    assert np.isnan(bf16(nans)).all()
    assert ((to_bits(nans) & 0x7F80) == 0x7F80).all() and ((to_bits(nans) & 0x7F) != 0).all()


def test_bf16_bits_round_trip() -> None:
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    values = from_bits(bits)
    finite = ~np.isnan(values)
    assert np.array_equal(to_bits(values)[finite], bits[finite])
    # and a bf16 value rounds to itself
    assert_bits_equal(bf16(values[finite]), values[finite], "bf16 of bf16")


@PROPERTY
@given(st.floats(width=32, allow_nan=False))
def test_bf16_nearest(x: float) -> None:
    """The nearer of the two bf16 neighbours (truncation, and one step away from zero, which is
    infinity above the largest bf16), ties to the even one; distances exact in float64."""
    t = int(f32s(x).view(np.uint32)[0]) >> 16
    lo = float(from_bits(np.array([t], np.uint16))[0])
    if not math.isfinite(lo):
        want = lo
    else:
        hi = float(from_bits(np.array([t + 1], np.uint16))[0])
        hi_distance_to = math.copysign(2.0**128, x) if math.isinf(hi) else hi
        d_lo, d_hi = abs(x - lo), abs(hi_distance_to - x)
        want = lo if d_lo < d_hi or (d_lo == d_hi and t % 2 == 0) else hi
    assert_bits_equal(bf16(f32s(x)), f32s(want), "bf16 nearest", f32s(x))


# --- RoPE --------------------------------------------------------------------------------------------------


def test_rope_table_plain() -> None:
    cos, sin = rope_table(16, 5, 10000.0, None)
    assert cos.shape == sin.shape == (5, 8) and cos.dtype == sin.dtype == F32
    assert (cos[0] == 1).all() and (sin[0] == 0).all()  # angle 0
    freqs = [10000.0 ** (-2 * i / 16) for i in range(8)]
    for p in range(5):  # float32 frequencies and angles: a few float32 steps of the angle
        for i in range(8):
            tol = 2.0**-24 + 4 * 2.0**-24 * p * freqs[i]
            assert abs(float(cos[p, i]) - math.cos(p * freqs[i])) <= tol, (p, i)
            assert abs(float(sin[p, i]) - math.sin(p * freqs[i])) <= tol, (p, i)
    assert cos[1, 0] == F32(math.cos(1.0)) and sin[1, 0] == F32(math.sin(1.0))  # correctly rounded


def test_rope_table_yarn_ramp() -> None:
    # V4.1-Flash's compressed rotation: 64 dims (32 frequencies), base 1.6e5, YaRN factor 16 over an
    # original context of 65536, beta 32 / 1. The corrected dims:
    #   low  = floor(64 * ln(65536 / (32 * 2 pi)) / (2 ln 1.6e5)) = floor(15.45) = 15
    #   high = ceil (64 * ln(65536 / (1 * 2 pi))  / (2 ln 1.6e5)) = ceil(24.71)  = 25
    # frequencies i <= 15 keep their value, i >= 25 are divided by 16, in between a linear ramp
    base, factor = 160000.0, 16.0
    low, high = 15, 25
    assert math.floor(64 * math.log(65536 / (32 * 2 * math.pi)) / (2 * math.log(base))) == low
    assert math.ceil(64 * math.log(65536 / (2 * math.pi)) / (2 * math.log(base))) == high
    cos, sin = rope_table(64, 3, base, (factor, 65536, 32.0, 1.0))
    plain_cos, plain_sin = rope_table(64, 3, base, None)
    assert (cos[0] == 1).all() and (sin[0] == 0).all()
    angle = np.arctan2(sin[1].astype(np.float64), cos[1].astype(np.float64))  # all below pi at position 1
    for i in range(32):
        f = base ** (-2 * i / 64)
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        want = f / factor * ramp + f * (1 - ramp)
        assert abs(angle[i] - want) <= 1e-6 * want + 1e-7, f"frequency {i}: {angle[i]} != {want}"
    assert np.array_equal(cos[:, : low + 1], plain_cos[:, : low + 1])
    assert np.array_equal(sin[:, : low + 1], plain_sin[:, : low + 1])
    assert not np.array_equal(sin[:, high:], plain_sin[:, high:])
    # an original length of 0 turns YaRN off
    off_cos, off_sin = rope_table(64, 3, base, (factor, 0, 32.0, 1.0))
    assert np.array_equal(off_cos, plain_cos) and np.array_equal(off_sin, plain_sin)


def test_rotate_pairs_by_hand() -> None:
    # pairs are interleaved (x[2i], x[2i+1]) and rotate as the complex number x[2i] + i x[2i+1]
    x = f32s(1.0, 0.0, 0.0, 1.0, 2.0, -3.0)
    cos = f32s(0.0, 0.0, 1.0)
    sin = f32s(1.0, -1.0, 0.0)
    # (1 + 0i) * i = i; (0 + 1i) * (-i) = 1; angle 0 leaves (2, -3)
    assert_bits_equal(rotate(x, cos, sin), f32s(0.0, 1.0, 1.0, 0.0, 2.0, -3.0), "quarter turns")
    assert_bits_equal(rotate(x, cos, sin, inverse=True), f32s(0.0, -1.0, -1.0, 0.0, 2.0, -3.0), "inverse")
    # a general angle: output rounded to bf16 once
    c, s = F32(math.cos(0.3)), F32(math.sin(0.3))
    got = rotate(f32s(1.5, 0.5), f32s(c), f32s(s))
    assert_bits_equal(got, bf16(f32s(1.5 * c - 0.5 * s, 1.5 * s + 0.5 * c)), "one pair")


def test_rotate_inverse_round_trip() -> None:
    """rotate then inverse-rotate gives x back within the two bf16 roundings: per pair, the rotation
    is orthogonal, so |z - x| <= |rounding of y| + |rounding of z| <= 2 * 2^-8 * |x| (half a bf16 step
    is at most 2^-8 relative per component, so per pair too), plus float32 noise."""
    rng = np.random.default_rng(7)
    x = bf16(rng.standard_normal((50, 4, 64)).astype(F32))
    cos, sin = rope_table(64, 50, 10000.0, None)
    y = rotate(x, cos[:, None], sin[:, None])
    z = rotate(y, cos[:, None], sin[:, None], inverse=True)
    err = np.hypot(z[..., 0::2] - x[..., 0::2], z[..., 1::2] - x[..., 1::2]).astype(np.float64)
    norm = np.hypot(x[..., 0::2], x[..., 1::2]).astype(np.float64)
    bound = 2 * 2.0**-8 * norm * (1 + 1e-5)
    worst = np.unravel_index(int(np.argmax(err - bound)), err.shape)
    assert (err <= bound).all(), f"worst pair {worst}: error {err[worst]:.3e} > bound {bound[worst]:.3e}"
    assert np.array_equal(z[0], x[0])  # position 0: angle 0, exact
    # the norm of each pair is kept within one rounding
    ny = np.hypot(y[..., 0::2], y[..., 1::2]).astype(np.float64)
    assert (np.abs(ny - norm) <= 2.0**-8 * norm * (1 + 1e-5)).all()
