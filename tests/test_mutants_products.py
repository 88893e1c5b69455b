"""Broken product kernels that the product tests must reject: the decode GEMV (the
`stream` kernel), the prefill GEMM (`gemm`, and on a GPU the tensor-core `tc`), each with three
mutants built by tests/mutants.py:

- truncate: the bf16 output rounding truncates (f32_to_bf16 drops the low half of the bits);
- drop: one term of each output's dot product is lost (gemm: the first value of every row, as a
  weight dequantiser that zeroes it; stream: the first unit of every row, 16 Q8_0 / Q2_K values,
  64 Q6_K / Q3_K / Q4_K / Q5_K ones, 8 BF16 ones or an MXFP4 block's 32, taken back out of the sum;
  tc: the first weight of every row in the staged tile, for Q2_K, Q4_K and Q5_K its d sc q part,
  the dmin m part staying);
- scale: a 1% scale error (gemm: every block's values 1.01x, as a wrong block scale; stream: every
  row's walked sums 1.01x; tc: every tensor-core step's contribution 1.01x).

The integer tensor-core decode product (`imma`, stages.linear_imma) has its own: truncate; digit (a
digit weighs 255 times the one below it, not 256); drop_digit (each input's digit 2 left out);
scale (every block's scale back 1% large); exponent (the scale back of every block twice what its
digits were made for: the block exponent off by one). On the simulator (K = 256 in two slices,
T = 4) each bf16 mutant is caught by both rules (truncate 49% bit-equal, digit 27%, drop_digit 10%,
scale and exponent 0%); fp32 out, digit and scale by the sqrt(K) bound (99 and 250 times it). Its
Q4_K pieces: sub_scale (every sub-block's d sc 1% large), no_minimum and minimum_sign (the dmin m
term left out, or added), nibble (each sub-block's levels from the other nibble of its bytes); its
MXFP4 ones: table (the magnitude table read one entry up), no_negatives (the negative codes left
out), e_scale (every 2^(e - 128) 1% large); Q5_K is held to Q4_K's truncate, sub_scale and
no_minimum and to fifth (sub-block j's fifth bit taken from bit j + 1 of its bytes). On the
simulator (random valid blocks, K = 256, T = 4) each is caught by both rules: Q4_K truncate 52%
bit-equal, sub_scale 6%, no_minimum 6%, minimum_sign 3%, nibble 0%; Q5_K truncate 51%, sub_scale
2%, no_minimum 7%, fifth 0%; MXFP4 truncate 51%, table 0%, no_negatives 0.8%, e_scale 0%. Q3_K's
(stages.imma_q3_k's pieces, IMMA_Q3_K_MUTANTS): q3_scale (a group's stored scale with its low bit
flipped), q3_group (each chunk's scales from the other group of the lane's pair), q3_top (the
scales' top pairs from other groups' bits), q3_hmask (each chunk's third level bit from the next
chunk's hmask bit), q3_offset and q3_flip (the A registers' multiply-add without its constant 4 c,
or without the xor that takes its 128 off), q3_sign (acc += d (the step's sum) on one row half),
q3_wrap (sc q in place of -sc q, each byte wrapped to int8: wrong only where sc q = 128, the
product the negation keeps inside int8); on the simulator each is caught by both rules: truncate
50% bit-equal, q3_scale 4%, q3_group 0%, q3_top 0%, q3_hmask 0.8%, q3_offset 0%, q3_flip 0%,
q3_sign 50%, q3_wrap 66%.

The warpgroup prefill GEMM (`wgmma`, stages.gemm_wgmma, BF16) has its own, each one edit of its
kernel factory's source (tests/mutants.edited, WGMMA_MUTANTS): dropped_step (the last K step never
multiplied), dropped_k16 (each step's last k16 wgmma left out), b_row (each weight tile row copied
from its neighbour's), stage (the ring of stages read off by one), scale (the outputs 1% large). On
the simulator (K = 256, four steps through three stages, T = 4) each is caught by both rules:
dropped_step, dropped_k16, b_row and scale 0% bit-equal, stage 0.8%, 127-128 of the 128 outputs
out of the sqrt(K) bound; fp32 out, dropped_k16 and scale by the bound (all 128 out).

The mutated pieces are the quant-type table's (stages.quants.table.DEVICE_TYPES, swapped in the
kernel's module: a record with a broken weight dequantiser or tc put) or the kernel module's own
(stream_walker, mma, f32_to_bf16; imma's DIGIT, quad_digits and block_scales, and its types' pieces
and walk steps, swapped in each of the imma modules that holds them: IMMA_MODULES).

Each test runs its mutant through the very check the product tests use (test_linear.check_linear,
test_linear_tc.check_tc) and requires it to fail on one of tests/bounds.py's rules (the message
says which: the 99% rule, the sqrt(K) bound or both; -s prints it), then runs the unmutated kernel
through the same check, which must pass, so that a broken setup cannot pass for a caught mutant.
Simulator sizes in CI; flash sizes on the GPU (`-m gpu`), where each mutant recompiles its kernel.

Caught on the simulator (K = 256, 128-288 outputs a check), every bf16 mutant by both rules:
truncate 42-59% bit-equal and 27-51% of the outputs out of the sqrt(K) bound; drop 0-8% bit-equal,
92-100% out; scale 0% bit-equal, 95-100% out. The fp32-out drop and scale: by the sqrt(K) bound
(the only rule there). At flash sizes on the H200 (2026-12-01), every mutant by both rules:
truncate 49-51% bit-equal (stream, gemv, gemm, tc; 2-33% of the outputs out of the bound), drop
3-46% bit-equal (stream's 16-byte unit 3-7%, gemv's one term 3.5%, tc's one term 13-46%; 33-96%
out), scale 0-0.01% bit-equal (52-95% out); the unmutated kernels 99.57-100% bit-equal on the
same shapes (gemv, since removed, was the decode kernel of the stored Q8_0 rows that `stream-wo_b`
now covers; tc's figures are of its Q2_K shape and of its BF16 and Q8_0 ones, whose types tc no
longer takes: TC_SHAPES now holds every type tc takes).
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache

import numpy as np
import pytest
from numba import float32, int32, uint16, uint32

from flashv41 import stages
from flashv41.host.quants import MXFP4_DOUBLED, GGMLType, dequantize, random_blocks
from flashv41.host.synth import DRAWN_ONLY
from flashv41.stages.device import CHUNK, device, f32_bits
from flashv41.stages.linear import DeviceWeight
from flashv41.stages.quants.table import DEVICE_TYPES
from tests.bounds import BIT_EQUAL_RULE, BOUND_RULE
from tests.mutants import edited, mutant_across
from tests.test_linear import check_linear, weight
from tests.test_linear_tc import FLASH, check_tc, stored_rows

MUTANTS = ["truncate", "drop", "scale"]
SCALE = float32(1.01)
STREAM_TYPES = [GGMLType.Q8_0, GGMLType.BF16, GGMLType.Q2_K, GGMLType.MXFP4, GGMLType.Q6_K, GGMLType.Q3_K,
                GGMLType.Q4_K, GGMLType.Q5_K]


@device
def truncating_bf16(x):
    """f32_to_bf16 that truncates: the high half of the bits, rounding toward zero."""
    return uint16(f32_bits(x) >> 16)


def dropping_first_value(dequant):
    """A dequantiser that loses value 0 of every row: each output's dot product misses one term."""
    @device
    def dequant_dropping(w, row, chunk, out):
        dequant(w, row, chunk, out)
        if chunk == 0:
            out[0] = float32(0)

    return dequant_dropping


def scaled_values(dequant):
    """A dequantiser whose values are all 1% large: every block's scale off by 1%."""
    @device
    def dequant_scaled(w, row, chunk, out):
        dequant(w, row, chunk, out)
        for i in range(CHUNK):
            out[i] *= SCALE

    return dequant_scaled


def stream_walker_mutant(kind: str):
    """A stages.linear.stream_walker whose walkers drop their rows' unit 0 ("drop") or scale their
    sums by 1.01 ("scale"), around the real walkers (every accumulator of a unit of several rows)."""
    real = stages.linear.stream_walker

    def dropping(walk, shift, tokens):
        @device
        def walk_dropping(ww, wf, row, x32, xo, k, n_tokens, acc, part, parts, lane, lanes):
            walk(ww, wf, row, x32, xo, k, n_tokens, acc, part, parts, lane, lanes)
            if part == 0 and lane == 0:  # unit 0 is this lane's: walk it alone into -acc, then negate back
                for t in range(tokens):
                    acc[t] = -acc[t]
                walk(ww, wf, row, x32, xo, k, n_tokens, acc, 0, k >> shift, 0, 1)
                for t in range(tokens):
                    acc[t] = -acc[t]

        return walk_dropping

    def scaling(walk, shift, tokens):
        @device
        def walk_scaled(ww, wf, row, x32, xo, k, n_tokens, acc, part, parts, lane, lanes):
            walk(ww, wf, row, x32, xo, k, n_tokens, acc, part, parts, lane, lanes)  # acc was zeroed for the row
            for t in range(tokens):
                acc[t] *= SCALE

        return walk_scaled

    wrap = dropping if kind == "drop" else scaling

    def walker(unit, x_bf16: bool, tokens: int):
        # a unit of several rows keeps each row's sums in its own run of `tokens` accumulators
        return wrap(real(unit, x_bf16, tokens), unit.shift, unit.rows * tokens)

    return walker


def tc_dropping_types():
    """The quant-type table with tc pieces whose `put` zeroes the first staged weight of every row
    (the low half of its first word at step 0)."""
    def dropping(put):
        @device
        def put_dropping(b_s, r, c, word, aux, ks):
            put(b_s, r, c, word, aux, ks)
            if ks == 0 and c == 0:
                b_s[r, 0] = b_s[r, 0] & uint32(0xFFFF0000)

        return put_dropping

    return {t: dataclasses.replace(qt, tc=dataclasses.replace(qt.tc, put=dropping(qt.tc.put)) if qt.tc else None)
            for t, qt in DEVICE_TYPES.items()}


def scaled_mma(real):
    """An mma (linear_tc's, or linear_narrow's) with every step's contribution (D - C) 1% large."""
    @device
    def mma_scaled(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        d0, d1, d2, d3 = real(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)
        return (c0 + (d0 - c0) * SCALE, c1 + (d1 - c1) * SCALE, c2 + (d2 - c2) * SCALE,
                c3 + (d3 - c3) * SCALE)

    return mma_scaled


# the first value of every row that narrow_dropping_types' fetch zeroes: a Q8_0 level byte, a bf16 half
NARROW_FIRST = {GGMLType.Q8_0: uint32(0xFFFFFF00), GGMLType.BF16: uint32(0xFFFF0000)}


def narrow_dropping_types():
    """The quant-type table with narrow pieces whose `fetch` zeroes value 0 of every row (lane t = 0,
    block 0, the low byte or half of its first word)."""
    def dropping(fetch, keep):
        @device
        def fetch_dropping(w32, row, b, t):
            w0, w1, w2, w3 = fetch(w32, row, b, t)
            if b == 0 and t == 0:
                w0 = w0 & keep
            return w0, w1, w2, w3

        return fetch_dropping

    return {t: dataclasses.replace(qt, narrow=dataclasses.replace(qt.narrow, fetch=dropping(qt.narrow.fetch,
                                                                                            NARROW_FIRST[t])))
            if qt.narrow else qt for t, qt in DEVICE_TYPES.items()}


def digit_dropping(quad_digits):
    """stages.imma_digits' quad_digits with digit 2 (the inputs' bits 16..23 of 2^29) left out."""
    @device
    def quad_digits_dropping(wa, wb, scale):
        d0, d1, d2, d3 = quad_digits(wa, wb, scale)
        return d0, d1, uint32(0), d3

    return quad_digits_dropping


def scaled_back(block_scales, factor):
    """stages.imma_digits' block_scales whose scale back (2^(E - 29)) is `factor` times too large
    while the digits keep their own: a 1% scale (1.01), the block exponent off by one (2)."""
    @device
    def block_scales_off(field):
        scale, back = block_scales(field)
        return scale, back * factor

    return block_scales_off


IMMA_MUTANTS = ["truncate", "digit", "drop_digit", "scale", "exponent"]
# the K-quant pieces: every sub-block's d sc 1% large; the minimum term left out or added; each
# sub-block's levels from the other nibble of its bytes
IMMA_K_MUTANTS = ["sub_scale", "no_minimum", "minimum_sign", "nibble"]
IMMA_Q5_K_MUTANTS = ["fifth"]  # Q5_K's fifth bit of sub-block j taken from bit j + 1 of its bytes
# Q2_K's: a group's scale one larger (mod 16); each chunk's scales and mins from the other group of its
# lane's pair of groups; each chunk's levels from the next chunk's bits of its bytes
IMMA_Q2_K_MUTANTS = ["q2_scale", "q2_group", "q2_level"]
# Q6_K's: a group's scale one larger; each chunk's groups' scales swapped; the levels without their 32 off
IMMA_Q6_K_MUTANTS = ["q6_scale", "q6_group", "q6_offset"]
# MXFP4's: the magnitude table read one entry up; the negative codes left out; every block's 2^(e - 128)
# 1% large
IMMA_MXFP4_MUTANTS = ["table", "no_negatives", "e_scale"]
# Q3_K's: a group's stored scale one larger; each chunk's scales from the other group of its lane's pair
# of groups; the scales' top pairs from the bits of other groups; each chunk's third level bit from the
# next chunk's hmask bit; the A registers without their 4 c (the multiply-add's constant: bytes borrow
# from their neighbours) or with their 128 left in (no xor); acc += d (the sum) on the first row half;
# sc q in place of -sc q (and acc += d (the sum)), each byte wrapped to int8: right but where sc q = 128
IMMA_Q3_K_MUTANTS = ["q3_scale", "q3_group", "q3_top", "q3_hmask", "q3_offset", "q3_flip", "q3_sign", "q3_wrap"]
# the warpgroup GEMM's (stages.gemm_wgmma), each one edit of wgmma_kernel's source: the last K step
# never multiplied; each step's last k16 left out; every weight tile row copied from its neighbour's
# row (rows 2 i and 2 i + 1 swapped); the ring of stages read off by one; the outputs 1% large
WGMMA_MUTANTS = {
    "dropped_step": ("for it in range(n_steps + PREFETCH):", "for it in range(n_steps + PREFETCH - 1):"),
    "dropped_k16": ("for s in range(BK // 16):", "for s in range(BK // 16 - 1):"),
    "b_row": ("row0 + n0 + row, chunk * 4", "row0 + n0 + (row ^ 1), chunk * 4"),
    "stage": ("read = uint32(read + 1) if read < STAGES - 1 else uint32(0)",
              "read = uint32(read + 1) if read < STAGES - 2 else uint32(0)"),
    "scale": ("out_s[i * THREADS + tid] = acc[i]", "out_s[i * THREADS + tid] = acc[i] * float32(1.01)"),
}


@device
def wrapped_products(raw, c):
    """stages.imma_q3_k.q3_k_negated with sc q = (c - 32) (raw - 4) in place of -sc q in each byte,
    wrapped to int8: the same products but for sc q = 128 (sc = -32, q = -4), which reads -128."""
    out = uint32(0)
    for i in range(4):
        q = int32((raw >> uint32(8 * i)) & uint32(0xFF)) - int32(4)
        out |= uint32(((int32(c) - int32(32)) * q) & int32(0xFF)) << uint32(8 * i)
    return out


def imma_q3_k_replacements(kind: str) -> dict:
    """The globals an imma Q3_K mutant swaps (its pieces: stages.imma_q3_k; its walk step: stages.imma_walks)."""
    q3 = stages.imma_q3_k
    if kind == "q3_scale":
        off = "return uint32(1) ^ byte_perm("
        return {"q3_k_chunk_scale": edited(q3, "q3_k_chunk_scale", "return byte_perm(", off)}
    if kind == "q3_group":
        right = "lane_half * uint32(0x1111)"
        return {"q3_k_lane_scales": edited(q3, "q3_k_lane_scales", right, "(lane_half ^ uint32(1)) * uint32(0x1111)")}
    if kind == "q3_top":
        right = "byte_perm(w2, w2 >> uint32(2), select)"
        return {"q3_k_lane_scales": edited(q3, "q3_k_lane_scales", right, right.replace("uint32(2)", "uint32(4)"))}
    if kind == "q3_hmask":
        right = "hm << uint32(2 - j) if j < 2 else hm >> uint32(j - 2)"
        return {"q3_k_raw": edited(q3, "q3_k_raw", right, "hm << uint32(1 - j) if j < 1 else hm >> uint32(j - 1)")}
    if kind == "q3_offset":
        return {"q3_k_negated": edited(q3, "q3_k_negated", " + int64(c * Q3_K_OFFSET)", "")}
    if kind == "q3_flip":
        right = "return uint32(biased) ^ DIGIT_FLIP"
        return {"q3_k_negated": edited(q3, "q3_k_negated", right, "return uint32(biased)")}
    if kind == "q3_wrap":  # both row halves' acc += d (the sum): the products' sign is the sum's
        old = "acc[p, 0] -= d_lo * part[p, 0]\n            acc[p, 1] -= d_hi * part[p, 1]"
        return {"q3_k_negated": wrapped_products,
                "walk_steps": edited(stages.imma_walks, "walk_steps", old, old.replace("-=", "+="))}
    old = "acc[p, 0] -= d_lo * part[p, 0]"
    return {"walk_steps": edited(stages.imma_walks, "walk_steps", old, old.replace("-=", "+="))}


def imma_k_replacements(kind: str) -> dict:
    """The globals an imma K-quant or MXFP4 mutant swaps (their pieces and walk steps: stages.imma_walks)."""
    imma = stages.imma_walks
    if kind == "table":  # byte c of the table is code c + 1's magnitude (code 7's: 16)
        up = np.append(MXFP4_DOUBLED[1:8], 16).astype(np.uint8).view("<u4")
        return {"E2M1_MAG_LO": uint32(up[0]), "E2M1_MAG_HI": uint32(up[1])}
    if kind == "fifth":
        right = "qh << uint32(4 - j) if j < 4 else qh >> uint32(j - 4)"
        wrong = "qh << uint32(3 - j) if j < 3 else qh >> uint32(j - 3)"
        return {"fifth_bits": edited(imma, "fifth_bits", right, wrong)}
    if kind == "q2_scale":
        return {"q2_k_group": edited(imma, "q2_k_group", "return (byte_perm(", "return (uint32(1) + byte_perm(")}
    if kind == "q2_group":
        old = "b = uint32(2 * (j & 1)) + lane_half"
        return {"walk_steps": edited(imma, "walk_steps", old, old.replace("(j & 1)", "(~j & 1)"))}
    if kind == "q2_level":
        return {"q2_k_levels": edited(imma, "q2_k_levels", "uint32(2 * (j & 3))", "uint32(2 * ((j + 1) & 3))")}
    if kind == "q6_scale":
        return {"q6_k_scale": edited(imma, "q6_k_scale", "return float32(int32(", "return float32(1 + int32(")}
    if kind == "q6_group":
        old = "keep = (lane_half ^ uint32(1)) * uint32(0xFFFFFFFF)"
        return {"walk_steps": edited(imma, "walk_steps", old, "keep = lane_half * uint32(0xFFFFFFFF)")}
    if kind == "q6_offset":
        right = "return x + (x & Q6_K_SIGN) * uint32(6)"
        return {"q6_k_levels": edited(imma, "q6_k_levels", right, "return x ^ Q6_K_SIGN")}
    if kind == "no_negatives":
        return {"mxfp4_levels": edited(imma, "mxfp4_levels", "word ^ E2M1_SIGN_FLIP", "word | E2M1_SIGN_FLIP")}
    if kind == "e_scale":
        off = "return float32(1.01) * f32_from_bits("
        return {"mxfp4_scale": edited(imma, "mxfp4_scale", "return f32_from_bits(", off)}
    if kind == "sub_scale":
        old = "scale_lo, scale_hi = k_sub_scale(d_lo, sc_lo, i), k_sub_scale(d_hi, sc_hi, i)"
        off = old.replace("k_sub_scale(", "float32(1.01) * k_sub_scale(")
        return {"walk_steps": edited(imma, "walk_steps", old, off)}
    if kind == "no_minimum":
        return {"less_minimum": edited(imma, "less_minimum", "return acc - dmin_m * block_sum", "return acc")}
    if kind == "minimum_sign":
        return {"less_minimum": edited(imma, "less_minimum", "acc - dmin_m", "acc + dmin_m")}
    return {"q4_k_levels": edited(imma, "q4_k_levels", "if high else", "if not high else")}


def replacements(kernel: str, kind: str) -> dict:
    """The globals a mutant of `kernel` ("stream", "gemm", "tc", "narrow", "imma", "wgmma") swaps
    (tests/mutants.py)."""
    if kernel == "wgmma":
        old, new = WGMMA_MUTANTS[kind]
        return {"wgmma_kernel": edited(stages.gemm_wgmma, "wgmma_kernel", old, new)}
    if kind == "truncate":
        return {"f32_to_bf16": truncating_bf16}
    if kind in IMMA_K_MUTANTS + IMMA_Q5_K_MUTANTS + IMMA_Q2_K_MUTANTS + IMMA_Q6_K_MUTANTS + IMMA_MXFP4_MUTANTS:
        return imma_k_replacements(kind)
    if kind in IMMA_Q3_K_MUTANTS:
        return imma_q3_k_replacements(kind)
    if kernel == "imma":
        imma = stages.imma_digits
        if kind == "digit":  # a digit weighs 255 times the one below it, not 256
            return {"DIGIT": int32(255)}
        if kind == "drop_digit":
            return {"quad_digits": digit_dropping(imma.quad_digits)}
        return {"block_scales": scaled_back(imma.block_scales, SCALE if kind == "scale" else float32(2))}
    if kernel == "narrow":
        if kind == "drop":
            return {"DEVICE_TYPES": narrow_dropping_types()}
        return {"mma": scaled_mma(stages.linear_narrow.mma)}
    if kernel == "stream":
        return {"stream_walker": stream_walker_mutant(kind)}
    if kernel == "tc":
        return {"DEVICE_TYPES": tc_dropping_types()} if kind == "drop" else {"mma": scaled_mma(stages.linear_tc.mma)}
    wrap = dropping_first_value if kind == "drop" else scaled_values
    return {"DEVICE_TYPES": {t: dataclasses.replace(qt, weight_dequant=wrap(qt.weight_dequant))
                             for t, qt in DEVICE_TYPES.items()}}


def rejected(check, *args, **kwargs) -> str:
    """Runs a product check that must fail on a product rule; returns the rules its message names."""
    with pytest.raises(AssertionError) as caught:
        check(*args, **kwargs)
    rules = [rule for rule in (BIT_EQUAL_RULE, BOUND_RULE) if rule in str(caught.value)]
    assert rules, f"the check failed, but on no product rule: {caught.value}"
    return " and ".join(rules)


# the integer tensor-core GEMV's modules: a swap is made in each that holds the name (mutant_across)
IMMA_MODULES = (stages.linear_imma, stages.imma_digits, stages.imma_walks, stages.imma_q3_k)


def run_mutant(kernel: str, kind: str, check, *args, **kwargs) -> None:
    """The mutant through `check` (rejected), then the real kernel through it (passes)."""
    modules = {"tc": (stages.linear_tc,), "narrow": (stages.linear_narrow,), "imma": IMMA_MODULES,
               "wgmma": (stages.gemm_wgmma,)}.get(kernel, (stages.linear,))
    with mutant_across(modules, **replacements(kernel, kind)):
        rules = rejected(check, *args, **kwargs)
    print(f"mutant {kernel} {kind}: rejected by the {rules}")
    check(*args, **kwargs)


# ------------------------------------------------------------------- simulator sizes (CI)

T, N, K = 4, 32, 256  # 128 outputs a check: enough for the 99% rule to mean something


@lru_cache(maxsize=8)
def small_weight(gtype: GGMLType):
    """[N, K] as a DeviceWeight and its values: quantised Gaussians (test_linear.weight), or random
    valid blocks for the types without a quantiser (host.synth.DRAWN_ONLY)."""
    rng = np.random.default_rng(int(gtype))
    if gtype in DRAWN_ONLY:
        stored = random_blocks(gtype, N, K, rng)
        return DeviceWeight.from_stored("w", gtype, stored, K), dequantize(stored, gtype, K)
    return weight(rng, N, K, gtype)


@pytest.mark.parametrize("kind", MUTANTS)
@pytest.mark.parametrize("gtype", STREAM_TYPES, ids=lambda t: t.name)
def test_stream_mutants(gtype, kind):
    w, wq = small_weight(gtype)
    run_mutant("stream", kind, check_linear, w, wq, T, "stream", seed=1)


@pytest.mark.parametrize("kind", MUTANTS)
@pytest.mark.parametrize("gtype", [GGMLType.Q8_0, GGMLType.BF16], ids=lambda t: t.name)
def test_narrow_mutants(gtype, kind):
    """The narrow tensor-core product at T = 9 (batched decode's first token count past stream's)."""
    w, wq = small_weight(gtype)
    run_mutant("narrow", kind, check_linear, w, wq, 9, "narrow", seed=4)


@pytest.mark.parametrize("kind", IMMA_MUTANTS)
def test_imma_mutants(kind):
    """The integer tensor-core decode product at T = 4 (two token pairs), K in two slices."""
    w, wq = small_weight(GGMLType.Q8_0)
    run_mutant("imma", kind, check_linear, w, wq, T, "imma", seed=6)


IMMA_TYPE_MUTANTS = ([(GGMLType.Q4_K, kind) for kind in ["truncate", *IMMA_K_MUTANTS]]
                     + [(GGMLType.Q5_K, kind) for kind in ["truncate", "sub_scale", "no_minimum", "fifth"]]
                     + [(GGMLType.MXFP4, kind) for kind in ["truncate", *IMMA_MXFP4_MUTANTS]]
                     + [(GGMLType.Q2_K, kind) for kind in ["truncate", "no_minimum", "minimum_sign",
                                                           *IMMA_Q2_K_MUTANTS]]
                     + [(GGMLType.Q6_K, kind) for kind in ["truncate", *IMMA_Q6_K_MUTANTS]]
                     + [(GGMLType.Q3_K, kind) for kind in ["truncate", *IMMA_Q3_K_MUTANTS]])


@pytest.mark.parametrize("gtype,kind", IMMA_TYPE_MUTANTS, ids=lambda v: getattr(v, "name", v))
def test_imma_type_mutants(gtype, kind):
    """The integer tensor-core decode product of a K-quant or MXFP4 at T = 4, K in one slice (Q4_K)
    or two (MXFP4)."""
    w, wq = small_weight(gtype)
    run_mutant("imma", kind, check_linear, w, wq, T, "imma", seed=6)


@pytest.mark.parametrize("kind", ["digit", "scale"])
def test_imma_f32_out_mutants(kind):
    """fp32 out: the sqrt(K) bound alone must catch these."""
    w, wq = small_weight(GGMLType.Q8_0)
    run_mutant("imma", kind, check_linear, w, wq, 1, "imma", out_bf16=False, seed=7)


@pytest.mark.parametrize("kind", MUTANTS)
@pytest.mark.parametrize("kernel,tokens,x_f32", [("stream", T, True), ("gemm", 9, False)], ids=["stream-f32x", "gemm"])
def test_f32_in_and_gemm_mutants(kernel, tokens, x_f32, kind):
    """The stream kernel's fp32-input units (test_stream_mutants holds the bf16-input ones), and gemm."""
    w, wq = small_weight(GGMLType.Q8_0)
    run_mutant(kernel, kind, check_linear, w, wq, tokens, kernel, x_f32=x_f32, seed=2)


@pytest.mark.parametrize("kind", list(WGMMA_MUTANTS))
def test_wgmma_mutants(kind):
    """The warpgroup GEMM at T = 4 (one token tile), K of four steps (the ring of three stages wraps),
    N = 32 (the simulator's one output tile); BF16, the one type it takes."""
    w, wq = small_weight(GGMLType.BF16)
    run_mutant("wgmma", kind, check_linear, w, wq, T, "wgmma", seed=10)


@pytest.mark.parametrize("kind", ["dropped_k16", "scale"])
def test_wgmma_f32_out_mutants(kind):
    """fp32 out: the sqrt(K) bound alone must catch these."""
    w, wq = small_weight(GGMLType.BF16)
    run_mutant("wgmma", kind, check_linear, w, wq, T, "wgmma", out_bf16=False, seed=11)


@pytest.mark.parametrize("kind", ["drop", "scale"])
@pytest.mark.parametrize("kernel,gtype", [("stream", GGMLType.Q2_K), ("gemm", GGMLType.Q2_K),
                                          ("stream", GGMLType.Q4_K)], ids=["stream-Q2_K", "gemm-Q2_K", "stream-Q4_K"])
def test_f32_out_mutants(kernel, gtype, kind):
    """fp32 out: no bit-equality to check, so the sqrt(K) bound alone must catch these."""
    w, wq = small_weight(gtype)
    run_mutant(kernel, kind, check_linear, w, wq, T, kernel, out_bf16=False, seed=3)


# ------------------------------------------------------------------------ flash sizes (GPU)


@lru_cache(maxsize=1)
def flash_weight(n: int, k: int, gtype: GGMLType):
    """Random stored rows [n, k] (test_linear_tc.stored_rows) as a DeviceWeight, and their values."""
    stored = stored_rows(np.random.default_rng(int(gtype) + n + k), n, k, gtype)
    return DeviceWeight.from_stored("w", gtype, stored, k), dequantize(stored, gtype, k)


STREAM_SHAPES = [(GGMLType.Q8_0, "wo_b"), (GGMLType.BF16, "wq_b"), (GGMLType.Q2_K, "engram_wkv"),
                 (GGMLType.Q3_K, "idx_wq_b"), (GGMLType.Q4_K, "wo_b"), (GGMLType.Q5_K, "wq_b"),
                 (GGMLType.Q6_K, "wkv"), (GGMLType.MXFP4, "engram_wkv")]


# the mutants vary fastest (the outermost parametrize), so each weight is made once for them
@pytest.mark.gpu
@pytest.mark.parametrize("kind", MUTANTS)
@pytest.mark.parametrize("gtype,name", STREAM_SHAPES, ids=lambda v: getattr(v, "name", v))
def test_flash_stream_mutants(gtype, name, kind):
    """The decode kernel at T = 1 on a flash shape per type."""
    n, k = FLASH[name]
    w, wq = flash_weight(n, k, gtype)
    run_mutant("stream", kind, check_linear, w, wq, 1, "stream", seed=1)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", MUTANTS)
def test_flash_gemm_mutants(kind):
    """gemm (prefill with an fp32 input or a weight the tensor cores do not take) on a Q8_0 flash
    shape; the stream kernel's Q8_0 wo_b case is test_flash_stream_mutants'."""
    n, k = FLASH["wq_a"]
    w, wq = flash_weight(n, k, GGMLType.Q8_0)
    run_mutant("gemm", kind, check_linear, w, wq, 64, "gemm", seed=2)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", MUTANTS)
@pytest.mark.parametrize("gtype,name,tokens", [(GGMLType.Q8_0, "wq_b", 1), (GGMLType.BF16, "wo_b", 32)],
                         ids=lambda v: getattr(v, "name", v))
def test_flash_narrow_mutants(gtype, name, tokens, kind):
    """The narrow tensor-core product on a flash shape per type."""
    n, k = FLASH[name]
    w, wq = flash_weight(n, k, gtype)
    run_mutant("narrow", kind, check_linear, w, wq, tokens, "narrow", seed=5)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", IMMA_MUTANTS)
@pytest.mark.parametrize("name,tokens", [("wq_b", 1), ("wo_b", 8)])
def test_flash_imma_mutants(name, tokens, kind):
    """The integer tensor-core decode product on a flash shape of one slice (wq_b) and of seven (wo_b)."""
    n, k = FLASH[name]
    w, wq = flash_weight(n, k, GGMLType.Q8_0)
    run_mutant("imma", kind, check_linear, w, wq, tokens, "imma", seed=8)


@pytest.mark.gpu
@pytest.mark.parametrize("gtype,kind", IMMA_TYPE_MUTANTS, ids=lambda v: getattr(v, "name", v))
@pytest.mark.parametrize("name,tokens", [("wq_b", 1), ("wo_b", 8)])
def test_flash_imma_type_mutants(gtype, kind, name, tokens):
    """The integer tensor-core decode product of a K-quant or MXFP4 on a flash shape of one slice and
    of several."""
    n, k = FLASH[name]
    w, wq = flash_weight(n, k, gtype)
    run_mutant("imma", kind, check_linear, w, wq, tokens, "imma", seed=8)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", list(WGMMA_MUTANTS))
def test_flash_wgmma_mutants(kind):
    """The warpgroup GEMM at T = 256 (two token tiles) on wo_b's BF16 shape (K of 128 steps), on a
    GPU of compute capability 9.0 (the one with wgmma)."""
    if stages.gemm_wgmma.device_capability() != stages.gemm_wgmma.WGMMA_CAPABILITY:
        pytest.skip("wgmma needs compute capability 9.0")
    n, k = FLASH["wo_b"]
    w, wq = flash_weight(n, k, GGMLType.BF16)
    run_mutant("wgmma", kind, check_linear, w, wq, 256, "wgmma", seed=9)


TC_SHAPES = [(GGMLType.Q2_K, "engram_wkv"), (GGMLType.Q3_K, "wo_b"), (GGMLType.Q4_K, "wq_a"),
             (GGMLType.Q5_K, "idx_wq_b"), (GGMLType.Q6_K, "wq_b"), (GGMLType.MXFP4, "wkv")]


@pytest.mark.gpu
@pytest.mark.parametrize("kind", MUTANTS)
@pytest.mark.parametrize("gtype,name", TC_SHAPES, ids=lambda v: getattr(v, "name", v))
def test_flash_tc_mutants(gtype, name, kind):
    """The tensor-core GEMM at T = 64 on a flash shape per type (Q2_K, Q4_K, Q5_K: mins; Q3_K, Q6_K:
    a scale every 16 values, Q3_K on the longest K; MXFP4: a block a step; all but Q2_K not yet run
    on a GPU)."""
    n, k = FLASH[name]
    run_mutant("tc", kind, check_tc, gtype, 64, 1, n, k, True, 4)
