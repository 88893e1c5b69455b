"""Q2_K on the device: its block view, split layout, chunk dequantisers, stream units (one row a
unit; the decode GEMV's two), tensor-core pieces, and its row of the quant-type table.

Split layout: per row every block's 16 scale bytes, then every block's 64 quant bytes, then every
block's d and dmin, zero-padded to whole 16-byte pieces (under one block). Stream unit u: a
block's 16-byte quant piece (64 values), with an 8-byte load of its scales and a word of d, dmin;
the GEMV's unit the same of two rows (the inputs read, unpacked and summed once for both).

Oracle: host.quants.dequantize_q2_k (tests/test_engram_stages.py's rows, bit for bit); the units
and tc pieces through the products (tests/test_linear.py, test_linear_tc.py, tests/bounds.py's
split terms).
"""

from __future__ import annotations

import numpy as np
from numba import float32, uint32

from flashv41.host.quants import FORMATS, Q2_K_BLOCK, GGMLType, field_offset
from flashv41.stages.device import (
    CHUNK,
    device,
    f16x2_f32,
    fp16_to_f32,
    read_u16,
    row_address,
    word_at,
    words2_at,
    words4_at,
)
from flashv41.stages.quants.records import ROW_ALIGN, WORD, StreamUnit, TcType, entry, padded_stored, split_blocks
from flashv41.stages.quants.units import (
    SHIFT_HALF,
    TC_BLOCK_GROUPS,
    TC_BLOCK_STEPS,
    bf16_int,
    field_at,
    field_dot16,
    field_magic,
    halves8,
    pack,
    sum16,
    x16_bf16_at,
    x16_f32_at,
)

Q2_K_BYTES = Q2_K_BLOCK.itemsize
Q2_K_VALUES = FORMATS[GGMLType.Q2_K].block_values
Q2_K_SCALES = field_offset(Q2_K_BLOCK, "scales")  # byte offsets in a block
Q2_K_QS = field_offset(Q2_K_BLOCK, "qs")
Q2_K_D = field_offset(Q2_K_BLOCK, "d")
Q2_K_DMIN = field_offset(Q2_K_BLOCK, "dmin")
Q2_K_GROUPS = Q2_K_BLOCK["scales"].shape[0]  # 16-value groups, one scale byte each
Q2_K_CHUNKS = Q2_K_VALUES // CHUNK  # chunks (tensor-core K steps) a block
Q2_K_QS_BYTES = Q2_K_BLOCK["qs"].shape[0]  # a byte holds 4 levels, 2 bits each
Q2_K_HALF_QS = Q2_K_QS_BYTES // 2  # quant bytes of each 128-value half of a block
Q2_K_SCALE_HALVES = Q2_K_GROUPS // 2  # 16-bit halves of a block's scale bytes (the tensor-core fetch's)
# Q2_K's split layout (module docstring): a block's fields in their stored order, the scale bytes
# (one a 16-value group), the quants (2 bits a value) and (d, dmin) in one word, d in the low half;
# so in a row of K values the quants start at byte K / 16 and the (d, dmin) words at K / 16 + K / 4
assert (Q2_K_SCALES, Q2_K_QS, Q2_K_D) == (0, Q2_K_GROUPS, Q2_K_GROUPS + Q2_K_QS_BYTES)
assert Q2_K_DMIN == Q2_K_D + 2 and Q2_K_BYTES == Q2_K_D + WORD
assert Q2_K_GROUPS * 16 == Q2_K_VALUES and Q2_K_QS_BYTES * 4 == Q2_K_VALUES
assert Q2_K_GROUPS % ROW_ALIGN == 0 and Q2_K_QS_BYTES % ROW_ALIGN == 0
assert Q2_K_CHUNKS == TC_BLOCK_STEPS and Q2_K_GROUPS == TC_BLOCK_GROUPS


# weight layout (host side)


def padded_split_q2_k(stored: np.ndarray, k: int) -> np.ndarray:
    """GGUF Q2_K rows -> the split layout: per row every block's scales, then every block's qs,
    then every block's d and dmin, zero-padded to whole ROW_ALIGN-byte pieces."""
    return padded_stored(split_blocks(stored, Q2_K_BYTES, (Q2_K_QS, Q2_K_D)), k)


# chunk dequantisers


@device
def q2_k_values(w, row, chunk, out, scales, qs, d_at):
    """Chunk `chunk` of a Q2_K row (uint8 [rows, bytes]) whose block holds it has its scale bytes,
    its quants and its d (dmin after it) at byte offsets scales, qs and d_at of the row."""
    sub = chunk % Q2_K_CHUNKS
    shift = 2 * (sub % 4)
    first = qs + (sub // 4) * Q2_K_HALF_QS
    d = fp16_to_f32(read_u16(w, row, d_at))
    dmin = fp16_to_f32(read_u16(w, row, d_at + (Q2_K_DMIN - Q2_K_D)))
    for i in range(CHUNK):
        sc = uint32(w[row, scales + (sub * CHUNK + i) // 16])
        scale = d * float32(sc & 15)
        minimum = dmin * float32(sc >> 4)
        q = (uint32(w[row, first + i]) >> shift) & 3
        out[i] = scale * float32(q) - minimum


@device
def dequant_q2_k(w, row, chunk, out):
    base = (chunk // Q2_K_CHUNKS) * Q2_K_BYTES
    q2_k_values(w, row, chunk, out, base + Q2_K_SCALES, base + Q2_K_QS, base + Q2_K_D)


@device
def dequant_q2_k_split(w, row, chunk, out):
    """Q2_K in the split layout: every block's scales, then every block's quants, then every
    block's d and dmin (rows padded under one block, so the block count reads off the width)."""
    k = (w.shape[1] // Q2_K_BYTES) * Q2_K_VALUES
    b = chunk // Q2_K_CHUNKS
    q2_k_values(w, row, chunk, out, Q2_K_GROUPS * b, k // 16 + Q2_K_QS_BYTES * b, k // 16 + k // 4 + WORD * b)


# Q2_K (split layout). Unit u is quant piece u of the row (16 bytes): block u >> 2, half h = (u >> 1) & 1,
# p = u & 1, its byte 4 m + c (word m, byte c) holding in bits 2 s, 2 s + 1 the level of value
# 128 h + 32 s + 16 p + 4 m + c, whose scale byte is 8 h + 2 s + p of the block: for each s a
# 16-value group with one (sc, m), its inputs one run of 16. Levels and scale nibbles become float32
# where they lie (field_at), never shifted down to bit 0: a word's bytes 0 and 1 in place, bytes 2
# and 3 from the word shifted down 16 bits once.
Q2_K_UNIT_SHIFT = 6  # a unit: 64 values
Q2_K_LOW_MASKS = tuple(uint32(3 << (2 * s)) for s in range(4))  # byte 0's level at shift s
Q2_K_HIGH_MASKS = tuple(uint32(3 << (8 + 2 * s)) for s in range(4))  # byte 1's
Q2_K_LOW_MAGICS = tuple(field_magic(2 * s) for s in range(4))
Q2_K_HIGH_MAGICS = tuple(field_magic(8 + 2 * s) for s in range(4))
LOW_NIBBLE, HIGH_NIBBLE = uint32(0x0F), uint32(0xF0)  # a scale byte's sc, m
LOW_NIBBLE_MAGIC, HIGH_NIBBLE_MAGIC = field_magic(0), field_magic(4)


@device
def q2_k_row(address, qs, scales, d_at, p8):
    """One row's part of a Q2_K unit (loads only, and what every token shares): its quant piece's
    four words and the same shifted down 16 bits, and per shift s the group's d sc and dmin m (each
    exact in float32: an fp16 times 4 bits). qs, scales, d_at: the byte offsets of the piece, of its
    half-block's eight scale bytes and of (d, dmin); p8 = 8 p (scale byte 2 s + p of the eight)."""
    w0, w1, w2, w3 = words4_at(address, qs)
    s0, s1 = words2_at(address, scales)
    d, dmin = f16x2_f32(word_at(address, d_at))
    e0 = s0 >> p8  # byte 0: the scale byte of s = 0, byte 2: of s = 1
    e1 = s1 >> p8  # s = 2 and 3
    f0 = e0 >> SHIFT_HALF
    f1 = e1 >> SHIFT_HALF
    words = halves8(w0, w1, w2, w3)
    scaled = (d * field_at(e0, LOW_NIBBLE, LOW_NIBBLE_MAGIC), d * field_at(f0, LOW_NIBBLE, LOW_NIBBLE_MAGIC),
              d * field_at(e1, LOW_NIBBLE, LOW_NIBBLE_MAGIC), d * field_at(f1, LOW_NIBBLE, LOW_NIBBLE_MAGIC))
    mins = (dmin * field_at(e0, HIGH_NIBBLE, HIGH_NIBBLE_MAGIC), dmin * field_at(f0, HIGH_NIBBLE, HIGH_NIBBLE_MAGIC),
            dmin * field_at(e1, HIGH_NIBBLE, HIGH_NIBBLE_MAGIC), dmin * field_at(f1, HIGH_NIBBLE, HIGH_NIBBLE_MAGIC))
    return words, scaled, mins


@device
def q2_k_dot16(words, s, xs):
    """The sixteen levels at shift s of q2_k_row's words times sixteen inputs (field_dot16)."""
    return field_dot16(words, (Q2_K_LOW_MASKS[s], Q2_K_HIGH_MASKS[s], Q2_K_LOW_MAGICS[s], Q2_K_HIGH_MAGICS[s]), xs)


def q2_k_unit(rows: int):
    """The Q2_K stream unit of `rows` rows (1, or 2 for the GEMV: the inputs read, unpacked and
    summed once for both rows). Per row and 16-value group, d sc (sum of level x input) - dmin m
    (sum of inputs): the sum of the values' two parts d sc q and dmin m (tests/bounds.py's
    SPLIT_KERNELS). Every load is a row address plus a 32-bit byte offset, and the token slots past
    n_tokens read the last live token's inputs (their sums are never stored): no branch, so all of
    a unit's loads are issued before its arithmetic. The four groups are four calls with s a
    literal (a loop over s would stay one in the PTX, its masks picked at run time)."""
    assert rows in (1, 2)

    def make(tokens: int, x_bf16: bool):
        x16 = x16_bf16_at if x_bf16 else x16_f32_at

        @device
        def add_group(x, xo, v, s, a, b, acc, t):
            xs = x16(x, xo, v)
            sx = sum16(xs)
            acc[t] += a[1][s] * q2_k_dot16(a[0], s, xs)
            acc[t] -= a[2][s] * sx
            if rows == 2:
                acc[tokens + t] += b[1][s] * q2_k_dot16(b[0], s, xs)
                acc[tokens + t] -= b[2][s] * sx

        @device
        def q2_k_unit(ww, wf, row, x32, xo, k, n_tokens, acc, u):
            i = uint32(u)
            width = uint32(k)
            qs = uint32((width >> uint32(4)) + (i << uint32(4)))  # the quants follow the K / 16 scale bytes
            scales = uint32((i >> uint32(1)) << uint32(3))
            d_at = uint32((width >> uint32(4)) + (width >> uint32(2)) + ((i >> uint32(2)) << uint32(2)))
            p8 = uint32((i & uint32(1)) << uint32(3))
            v = uint32(((i >> uint32(1)) << uint32(3)) | (i & uint32(1)))  # the 16-input run of s = 0
            a = q2_k_row(row_address(ww, row), qs, scales, d_at, p8)
            b = a if rows == 1 else q2_k_row(row_address(ww, min(row + 1, ww.shape[0] - 1)), qs, scales, d_at, p8)
            xb = uint32(uint32(xo) << uint32(2))
            for t in range(tokens):
                x = row_address(x32, min(t, n_tokens - 1))
                add_group(x, xb, v, 0, a, b, acc, t)
                add_group(x, xb, uint32(v + uint32(2)), 1, a, b, acc, t)
                add_group(x, xb, uint32(v + uint32(4)), 2, a, b, acc, t)
                add_group(x, xb, uint32(v + uint32(6)), 3, a, b, acc, t)

        return q2_k_unit

    return make


# Q2_K (split layout: every block's scales, then its quants, then its d and dmin, the quants at word
# K / 64 and the (d, dmin) words at K / 64 + K / 16): step ks is sub-block sub = ks % 8 of block
# ks // 8: levels (qs[32 * (sub // 4) + i] >> 2 * (sub % 4)) & 3 for i < 32, in groups 2 * sub
# (i < 16) and 2 * sub + 1, whose scale bytes are one 16-bit half; d and dmin are one word.

@device
def fetch_q2_k(w32, w16, n, ks, c, k):
    b, sub = ks // Q2_K_CHUNKS, ks % Q2_K_CHUNKS
    return (w32[n, k // 64 + (Q2_K_QS_BYTES // WORD) * b + (Q2_K_HALF_QS // WORD) * (sub // 4) + c],
            uint32(w16[n, Q2_K_SCALE_HALVES * b + sub]))


@device
def put_q2_k(b_s, r, c, word, aux, ks):
    shift = 2 * (ks % 4)
    sc = (aux >> (8 * (c // 4))) & 15  # levels 4c..4c+3 are in group c // 4 of the step
    v0 = bf16_int(sc * ((word >> shift) & 3))
    v1 = bf16_int(sc * ((word >> (8 + shift)) & 3))
    v2 = bf16_int(sc * ((word >> (16 + shift)) & 3))
    v3 = bf16_int(sc * ((word >> (24 + shift)) & 3))
    b_s[r, 2 * c] = pack(v0, v1)
    b_s[r, 2 * c + 1] = pack(v2, v3)


@device
def fetch_scales_q2_k(w32, w16, n, ks, k):
    b, sub = ks // Q2_K_CHUNKS, ks % Q2_K_CHUNKS
    return uint32(w16[n, Q2_K_SCALE_HALVES * b + sub]), w32[n, k // 64 + k // 16 + b], uint32(0), uint32(0)


@device
def put_scales_q2_k(d_s, m_s, mins_s, r, ks, s0, s1, s2, s3):
    d_s[0, r] = fp16_to_f32(s1 & 0xFFFF)
    m_s[r] = fp16_to_f32(s1 >> 16)
    mins_s[r, ks % Q2_K_CHUNKS] = pack(bf16_int((s0 >> 4) & 15), bf16_int(s0 >> 12))


ENTRIES = [
    entry(GGMLType.Q2_K, dequant_q2_k, StreamUnit(q2_k_unit(1), Q2_K_UNIT_SHIFT, 2),
          TcType(fetch_q2_k, put_q2_k, fetch_scales_q2_k, put_scales_q2_k, CHUNK // WORD, True),
          "split", padded_split_q2_k, dequant_q2_k_split, StreamUnit(q2_k_unit(2), Q2_K_UNIT_SHIFT, 2, rows=2)),
]
