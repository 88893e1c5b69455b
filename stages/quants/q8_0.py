"""Q8_0 on the device: its block view, split layout, chunk dequantisers, stream units (one row a
unit; the decode GEMV's two), narrow tensor-core pieces, and its row of the quant-type table (no
tc pieces: its prefill products are stages.gemm_pipe's, which reads the split rows itself).

Split layout: per row the K int8 quants first, then its K/32 fp16 scales, zero-padded to whole
16-byte pieces (under one block). Stream unit u: the quants 16 u .. 16 u + 15 (half of block
u // 2), one 16-byte load, and the block's scale; the GEMV's unit the same of two rows.

Oracle: host.quants.dequantize_q8_0 (tests/test_engram_stages.py's rows, bit for bit); the units
and narrow pieces through the products (tests/test_linear.py, test_linear_narrow.py).
"""

from __future__ import annotations

import numpy as np
from numba import float32, int32, uint32, uint64

from flashv41.host.quants import FORMATS, Q8_0_BLOCK, GGMLType, field_offset
from flashv41.stages.device import (
    CHUNK,
    device,
    f16_at,
    f16x2_f32,
    fp16_to_f32,
    load_words2,
    load_words4,
    read_u16,
    row_address,
    words4_at,
)
from flashv41.stages.quants.records import ROW_ALIGN, NarrowType, StreamUnit, entry
from flashv41.stages.quants.units import (
    INT8_LESS,
    U1,
    U4,
    U8,
    bf16_pair,
    f32x4,
    int8_at,
    level_pairs,
    x16_bf16_at,
    x16_f32_at,
)

Q8_0_BYTES = Q8_0_BLOCK.itemsize
Q8_0_VALUES = FORMATS[GGMLType.Q8_0].block_values
Q8_0_D = field_offset(Q8_0_BLOCK, "d")  # byte offsets in a block
Q8_0_QS = field_offset(Q8_0_BLOCK, "qs")
Q8_0_SCALE_BYTES = Q8_0_BLOCK["d"].itemsize
assert Q8_0_VALUES == CHUNK  # a Q8_0 block is one chunk


# weight layout (host side)


def split_q8_0(stored: np.ndarray, k: int) -> np.ndarray:
    """GGUF Q8_0 rows (uint8 [N, row_bytes]: per block an fp16 scale, then 32 int8 quants) -> the
    split layout: per row the K quants, then the K/32 scales (same bytes, same size)."""
    n = stored.shape[0]
    blocks = np.ascontiguousarray(stored).reshape(-1, Q8_0_BYTES).view(Q8_0_BLOCK).reshape(n, -1)
    quants = np.ascontiguousarray(blocks["qs"]).view(np.uint8).reshape(n, k)
    scales = np.ascontiguousarray(blocks["d"]).view(np.uint8).reshape(n, -1)
    return np.concatenate([quants, scales], axis=1)


def padded_split_q8_0(stored: np.ndarray, k: int) -> np.ndarray:
    """split_q8_0's rows, zero-padded to whole ROW_ALIGN-byte pieces (under one block: see the
    module docstring)."""
    split = split_q8_0(stored, k)
    pad = -split.shape[1] % ROW_ALIGN
    return np.pad(split, ((0, 0), (0, pad))) if pad else split


# chunk dequantisers


@device
def dequant_q8_0(w, row, chunk, out):
    base = chunk * Q8_0_BYTES
    d = fp16_to_f32(read_u16(w, row, base + Q8_0_D))
    for i in range(CHUNK):
        q = int32(w[row, base + Q8_0_QS + i])
        if q >= 128:
            q -= 256
        out[i] = float32(q) * d


@device
def dequant_q8_0_split(w, row, chunk, out):
    """Q8_0 in the split layout: quants at 32 * chunk, scales after the row's K quants."""
    k = (w.shape[1] // Q8_0_BYTES) * CHUNK
    d = fp16_to_f32(read_u16(w, row, k + Q8_0_SCALE_BYTES * chunk))
    for i in range(CHUNK):
        q = int32(w[row, chunk * CHUNK + i])
        if q >= 128:
            q -= 256
        out[i] = float32(q) * d


# stream units: each factory returns the unit for up to `tokens` tokens of bf16 (x_bf16) or fp32 inputs


@device
def int8_dot4(flipped, xw0, xw1):
    """The four int8 quants of a word (top bits flipped) times four bf16 values in two words."""
    x0, x1 = bf16_pair(xw0)
    x2, x3 = bf16_pair(xw1)
    return (int8_at(flipped, 0) * x0 + int8_at(flipped, 1) * x1 + int8_at(flipped, 2) * x2
            + int8_at(flipped, 3) * x3)


@device
def int8_dot4_f32(flipped, x32, t, o):
    """The four int8 quants of a word (top bits flipped) times the fp32 inputs x[t, o .. o + 3]."""
    x0, x1, x2, x3 = f32x4(x32, t, o)
    return (int8_at(flipped, 0) * x0 + int8_at(flipped, 1) * x1 + int8_at(flipped, 2) * x2
            + int8_at(flipped, 3) * x3)


def q8_0_unit(tokens: int, x_bf16: bool):
    """Split Q8_0: unit u is the quants 16 u .. 16 u + 15 (half of block u // 2); the scales follow
    the K quants."""
    if x_bf16:
        @device
        def q8_0_unit(ww, wf, row, x32, xo, k, n_tokens, acc, u):
            w0, w1, w2, w3 = load_words4(ww, row, U4 * u)
            d = float32(wf[row, uint64(k >> 1) + (u >> U1)])
            w0, w1, w2, w3 = w0 ^ 0x80808080, w1 ^ 0x80808080, w2 ^ 0x80808080, w3 ^ 0x80808080
            for t in range(tokens):
                if t < n_tokens:
                    a0, a1, a2, a3 = load_words4(x32, t, xo + U8 * u)
                    b0, b1, b2, b3 = load_words4(x32, t, xo + U8 * u + U4)
                    acc[t] += d * (int8_dot4(w0, a0, a1) + int8_dot4(w1, a2, a3) + int8_dot4(w2, b0, b1)
                                   + int8_dot4(w3, b2, b3))

        return q8_0_unit

    @device
    def q8_0_unit_f32(ww, wf, row, x32, xo, k, n_tokens, acc, u):
        w0, w1, w2, w3 = load_words4(ww, row, U4 * u)
        d = float32(wf[row, uint64(k >> 1) + (u >> U1)])
        w0, w1, w2, w3 = w0 ^ 0x80808080, w1 ^ 0x80808080, w2 ^ 0x80808080, w3 ^ 0x80808080
        for t in range(tokens):
            if t < n_tokens:
                o = xo + uint64(16) * u
                acc[t] += d * (int8_dot4_f32(w0, x32, t, o) + int8_dot4_f32(w1, x32, t, o + U4)
                               + int8_dot4_f32(w2, x32, t, o + U8) + int8_dot4_f32(w3, x32, t, o + uint64(12)))

    return q8_0_unit_f32


@device
def int8_dot16(w0, w1, w2, w3, xs):
    """The sixteen int8 quants of four words (top bits flipped) times sixteen inputs."""
    return (int8_at(w0, 0) * xs[0] + int8_at(w0, 1) * xs[1] + int8_at(w0, 2) * xs[2] + int8_at(w0, 3) * xs[3]
            + int8_at(w1, 0) * xs[4] + int8_at(w1, 1) * xs[5] + int8_at(w1, 2) * xs[6] + int8_at(w1, 3) * xs[7]
            + int8_at(w2, 0) * xs[8] + int8_at(w2, 1) * xs[9] + int8_at(w2, 2) * xs[10] + int8_at(w2, 3) * xs[11]
            + int8_at(w3, 0) * xs[12] + int8_at(w3, 1) * xs[13] + int8_at(w3, 2) * xs[14]
            + int8_at(w3, 3) * xs[15])


def q8_0_pair_unit(tokens: int, x_bf16: bool):
    """Split Q8_0, two rows at once (the stream kernel's; `rows` = 2): unit u is the quants 16 u ..
    16 u + 15 of rows `row` and `row + 1` (past the matrix, the second is the first again, its sums
    unused), their sums in acc[t] and acc[tokens + t]. The sixteen inputs are unpacked once for
    both rows, which halves the integer work per weight byte that bounds a one-row walk. Every
    load is a row address plus a 32-bit byte offset, and the token slots past n_tokens read the
    last live token's inputs (their sums are never stored) instead of branching around them, so
    all of a unit's loads are issued before any of its arithmetic."""
    x16 = x16_bf16_at if x_bf16 else x16_f32_at

    @device
    def q8_0_pair_unit(ww, wf, row, x32, xo, k, n_tokens, acc, u):
        a = row_address(ww, row)
        b = row_address(ww, row + 1 if row + 1 < ww.shape[0] else row)
        i = uint32(u)
        q = uint32(i << uint32(4))  # the unit's byte offset
        s = uint32(uint32(k) + ((i >> uint32(1)) << uint32(1)))  # its block's fp16 scale
        w0, w1, w2, w3 = words4_at(a, q)
        v0, v1, v2, v3 = words4_at(b, q)
        d0 = f16_at(a, s)
        d1 = f16_at(b, s)
        w0, w1, w2, w3 = w0 ^ 0x80808080, w1 ^ 0x80808080, w2 ^ 0x80808080, w3 ^ 0x80808080
        v0, v1, v2, v3 = v0 ^ 0x80808080, v1 ^ 0x80808080, v2 ^ 0x80808080, v3 ^ 0x80808080
        for t in range(tokens):
            xs = x16(row_address(x32, min(t, n_tokens - 1)), uint32(uint32(xo) << uint32(2)), i)
            acc[t] += d0 * int8_dot16(w0, w1, w2, w3, xs)
            acc[tokens + t] += d1 * int8_dot16(v0, v1, v2, v3, xs)

    return q8_0_pair_unit


# narrow tensor-core pieces


@device
def narrow_fetch_q8_0(w32, row, b, t):
    lo, hi = load_words2(w32, row, uint32(8) * b + uint32(2) * t)
    return lo, hi, uint32(0), uint32(0)


@device
def narrow_pairs_q8_0(w0, w1, w2, w3, s):
    return level_pairs((w1 if s else w0) ^ uint32(0x80808080), INT8_LESS)


@device
def narrow_scales_q8_0(w32, row, b, k):
    s01, s23 = load_words2(w32, row, (k >> 2) + (b >> 1))  # fp16 scale j at byte K + 2 j
    d0, d1 = f16x2_f32(s01)
    d2, d3 = f16x2_f32(s23)
    return d0, d1, d2, d3


ENTRIES = [
    entry(GGMLType.Q8_0, dequant_q8_0, StreamUnit(q8_0_unit, 4, 2), layout="split", weight_rows=padded_split_q8_0,
          weight_dequant=dequant_q8_0_split, gemv=StreamUnit(q8_0_pair_unit, 4, 2, rows=2),
          narrow=NarrowType(narrow_fetch_q8_0, narrow_pairs_q8_0, narrow_scales_q8_0, True)),
]
