"""F32, F16 and BF16 on the device (stored rows: a value a 4- or 2-byte word): chunk dequantisers,
stream units (the decode GEMV's too), BF16's narrow tensor-core pieces, and their rows of the
quant-type table (no tc pieces: BF16's prefill products are stages.gemm_wgmma's on Hopper and
stages.gemm_pipe's elsewhere, which read the stored rows as they are; F32's and F16's
stages.linear's gemm).

Oracle: host.quants.dequantize_f32 / f16 / bf16 (tests/test_engram_stages.py's rows, bit for bit);
the units and narrow pieces through the products (tests/test_linear.py, test_linear_narrow.py).
"""

from __future__ import annotations

from numba import float32, uint32

from flashv41.host.quants import GGMLType
from flashv41.stages.device import (
    CHUNK,
    bf16_to_f32,
    device,
    f32_from_bits,
    fp16_to_f32,
    load_words4,
    read_u16,
    row_address,
    words4_at,
)
from flashv41.stages.quants.records import NarrowType, StreamUnit, entry
from flashv41.stages.quants.units import (
    BF16_BYTES,
    F16_BYTES,
    F32_BYTES,
    U4,
    U8,
    bf16_pair,
    f16_pair,
    f32x4,
    x4_bf16,
    x4_f32,
    x8_bf16,
    x8_f32,
)

# chunk dequantisers


@device
def dequant_bf16(w, row, chunk, out):
    base = chunk * CHUNK * BF16_BYTES
    for i in range(CHUNK):
        out[i] = bf16_to_f32(read_u16(w, row, base + BF16_BYTES * i))


@device
def dequant_f16(w, row, chunk, out):
    base = chunk * CHUNK * F16_BYTES
    for i in range(CHUNK):
        out[i] = fp16_to_f32(read_u16(w, row, base + F16_BYTES * i))


@device
def dequant_f32(w, row, chunk, out):
    base = chunk * CHUNK * F32_BYTES
    for i in range(CHUNK):
        o = base + F32_BYTES * i
        u = read_u16(w, row, o) | (read_u16(w, row, o + 2) << 16)
        out[i] = f32_from_bits(u)


# stream units


def halves_unit(tokens: int, x_bf16: bool, pair):
    """Rows of 16-bit values (BF16 with fp32 inputs, F16): unit u is the weights 8 u .. 8 u + 7,
    `pair` decoding two of them from a word."""
    x8 = x8_bf16 if x_bf16 else x8_f32

    @device
    def halves_unit(ww, wf, row, x32, xo, k, n_tokens, acc, u):
        w0, w1, w2, w3 = load_words4(ww, row, U4 * u)
        v0, v1 = pair(w0)
        v2, v3 = pair(w1)
        v4, v5 = pair(w2)
        v6, v7 = pair(w3)
        for t in range(tokens):
            if t < n_tokens:
                x0, x1, x2, x3, x4, x5, x6, x7 = x8(x32, t, xo, U8 * u)
                acc[t] += v0 * x0 + v1 * x1 + v2 * x2 + v3 * x3 + v4 * x4 + v5 * x5 + v6 * x6 + v7 * x7

    return halves_unit


def bf16_unit(tokens: int, x_bf16: bool):
    """BF16: unit u is the weights 8 u .. 8 u + 7; loads and token slots as q8_0_pair_unit's."""
    if not x_bf16:
        return halves_unit(tokens, x_bf16, bf16_pair)

    @device
    def bf16_unit(ww, wf, row, x32, xo, k, n_tokens, acc, u):
        i = uint32(u)
        w0, w1, w2, w3 = words4_at(row_address(ww, row), uint32(i << uint32(4)))
        v0, v1 = bf16_pair(w0)
        v2, v3 = bf16_pair(w1)
        v4, v5 = bf16_pair(w2)
        v6, v7 = bf16_pair(w3)
        for t in range(tokens):
            x = row_address(x32, min(t, n_tokens - 1))
            a0, a1, a2, a3 = words4_at(x, uint32((uint32(xo) << uint32(2)) + (i << uint32(4))))
            x0, x1 = bf16_pair(a0)
            x2, x3 = bf16_pair(a1)
            x4, x5 = bf16_pair(a2)
            x6, x7 = bf16_pair(a3)
            acc[t] += v0 * x0 + v1 * x1 + v2 * x2 + v3 * x3 + v4 * x4 + v5 * x5 + v6 * x6 + v7 * x7

    return bf16_unit


def f16_unit(tokens: int, x_bf16: bool):
    """F16: unit u is the weights 8 u .. 8 u + 7."""
    return halves_unit(tokens, x_bf16, f16_pair)


def f32_unit(tokens: int, x_bf16: bool):
    """F32: unit u is the weights 4 u .. 4 u + 3."""
    x4 = x4_bf16 if x_bf16 else x4_f32

    @device
    def f32_unit(ww, wf, row, x32, xo, k, n_tokens, acc, u):
        v0, v1, v2, v3 = f32x4(ww, row, U4 * u)
        for t in range(tokens):
            if t < n_tokens:
                x0, x1, x2, x3 = x4(x32, t, xo, U4 * u)
                acc[t] += v0 * x0 + v1 * x1 + v2 * x2 + v3 * x3

    return f32_unit


# narrow tensor-core pieces


@device
def narrow_fetch_bf16(w32, row, b, t):
    return load_words4(w32, row, uint32(16) * b + uint32(4) * t)


@device
def narrow_pairs_bf16(w0, w1, w2, w3, s):
    return (w2, w3) if s else (w0, w1)


@device
def narrow_scales_none(w32, row, b, k):
    return float32(1), float32(1), float32(1), float32(1)


ENTRIES = [
    entry(GGMLType.F32, dequant_f32, StreamUnit(f32_unit, 2, 2)),
    entry(GGMLType.F16, dequant_f16, StreamUnit(f16_unit, 3, 2)),
    entry(GGMLType.BF16, dequant_bf16, StreamUnit(bf16_unit, 3, 2),
          narrow=NarrowType(narrow_fetch_bf16, narrow_pairs_bf16, narrow_scales_none, False)),
]
