"""Q6_K on the device: its block view, split layout, chunk dequantisers, stream units (one row a
unit; the decode GEMV's two), tensor-core pieces, and its row of the quant-type table.

Split layout: per row every block's ql, qh and scales (208 bytes, 13 whole 16-byte pieces), then
every block's d, zero-padded to whole 16-byte pieces (under one block). Stream unit u: 64 values of
block u // 4 (three 16-byte loads, stages.quants.units' row_adder); the GEMV's unit the same of
two rows.

Oracle: host.quants.dequantize_q6_k (tests/test_quants_more.py's device chunks, bit for bit); the
units and tc pieces through the products (tests/test_quants_more.py, test_linear_tc.py).
"""

from __future__ import annotations

import numpy as np
from numba import float32, int32, uint32, uint64

from flashv41.host.quants import Q6_K_BLOCK, GGMLType, field_offset
from flashv41.stages.device import (
    CHUNK,
    device,
    f16_at,
    fp16_to_f32,
    inlined,
    load_words4,
    read_u16,
    row_address,
    words2_at,
    words4_at,
)
from flashv41.stages.quants.records import ROW_ALIGN, WORD, StreamUnit, TcType, entry, padded_stored, split_blocks
from flashv41.stages.quants.units import (
    F16_BYTES,
    K_CHUNKS,
    K_VALUES,
    U1,
    U2,
    U4,
    U8,
    bytes_less16,
    chain16,
    int8_at,
    put_levels,
    row_adder,
    run_inputs,
    unit_inputs,
)

Q6_K_BYTES = Q6_K_BLOCK.itemsize
Q6_K_QL, Q6_K_QH = field_offset(Q6_K_BLOCK, "ql"), field_offset(Q6_K_BLOCK, "qh")
Q6_K_SCALES, Q6_K_D = field_offset(Q6_K_BLOCK, "scales"), field_offset(Q6_K_BLOCK, "d")
Q6_K_HALF_QL, Q6_K_HALF_QH = Q6_K_BLOCK["ql"].shape[0] // 2, Q6_K_BLOCK["qh"].shape[0] // 2
assert Q6_K_HALF_QH == CHUNK and Q6_K_HALF_QL == 2 * CHUNK and Q6_K_BLOCK["scales"].shape[0] * 16 == K_VALUES


# The split layout (module docstring): a Q6_K row is every block's first Q6_K_D bytes (ql, qh,
# scales: a 16-byte aligned piece), then every block's d. The word constants below index the rows
# as 32-bit words.
Q6_K_PIECE_WORDS = Q6_K_D // WORD
Q6_K_QL_WORD, Q6_K_QH_WORD, Q6_K_SCALES_WORD = Q6_K_QL // WORD, Q6_K_QH // WORD, Q6_K_SCALES // WORD
Q6_K_HALF_QL_WORDS, Q6_K_HALF_QH_WORDS = Q6_K_HALF_QL // WORD, Q6_K_HALF_QH // WORD
Q6_K_HALF_SCALES_WORDS = Q6_K_BLOCK["scales"].shape[0] // 2 // WORD  # the int8 scales of a half
Q6_K_LEVEL_MAGIC = float32(2.0**23 + 32)  # byte_less's 2^23 + o: takes the 32 off a Q6_K level
# d last, after 16-byte aligned pieces; the units read two scale words a half
assert Q6_K_D + F16_BYTES == Q6_K_BYTES and Q6_K_D % ROW_ALIGN == 0 and Q6_K_SCALES % ROW_ALIGN == 0
assert Q6_K_HALF_SCALES_WORDS == 2


# weight layout (host side)


def padded_split_q6_k(stored: np.ndarray, k: int) -> np.ndarray:
    """GGUF Q6_K rows -> the split layout: per row every block's ql, qh and scales, then every
    block's d, zero-padded to whole ROW_ALIGN-byte pieces."""
    return padded_stored(split_blocks(stored, Q6_K_BYTES, (Q6_K_D,)), k)


# chunk dequantisers


@device
def q6_k_values(w, row, c, out, piece, d):
    """Chunk c of a Q6_K block whose ql, qh and scales are at byte `piece` (at their block offsets),
    its fp16 d at `d`: low nibbles (ql[64 (c // 4) + 32 (c % 2) + i] >> 4 ((c % 4) // 2)), high
    pairs (qh[32 (c // 4) + i] >> 2 (c % 4)) & 3, less 32; int8 scales 2 c and 2 c + 1."""
    scale_d = fp16_to_f32(read_u16(w, row, d))
    ql = piece + Q6_K_QL + (c // 4) * Q6_K_HALF_QL + (c % 2) * CHUNK
    qh = piece + Q6_K_QH + (c // 4) * Q6_K_HALF_QH
    shift_l = 4 * ((c % 4) // 2)
    shift_h = 2 * (c % 4)
    for g in range(2):
        sc = int32(w[row, piece + Q6_K_SCALES + 2 * c + g])
        if sc >= 128:
            sc -= 256
        scale = scale_d * float32(sc)
        for i in range(16 * g, 16 * g + 16):
            q = ((uint32(w[row, ql + i]) >> shift_l) & 15) | (((uint32(w[row, qh + i]) >> shift_h) & 3) << 4)
            out[i] = scale * float32(int32(q) - 32)


@device
def dequant_q6_k(w, row, chunk, out):
    """Q6_K chunk `chunk` of stored rows."""
    base = (chunk // K_CHUNKS) * Q6_K_BYTES
    q6_k_values(w, row, chunk % K_CHUNKS, out, base, base + Q6_K_D)


@device
def dequant_q6_k_split(w, row, chunk, out):
    """Q6_K chunk `chunk` of split rows of n blocks: block b's ql, qh and scales at byte Q6_K_D b,
    its d at Q6_K_D n + 2 b (the padding is under a block: n reads off the width)."""
    n_blocks = w.shape[1] // Q6_K_BYTES
    b = chunk // K_CHUNKS
    q6_k_values(w, row, chunk % K_CHUNKS, out, Q6_K_D * b, Q6_K_D * n_blocks + F16_BYTES * b)


# stream units (stages.quants.units: the split Q6_K and Q3_K units)


INT8_FLIP = uint32(0x80808080)  # every byte's top bit: a signed byte q flipped reads as q + 128


@inlined
def q6_k_levels(ql, qh, s):
    """Four Q6_K levels (+ 32), one a byte, of row s: nibble s // 2 of a ql word, below pair s of
    the qh word."""
    return ((ql >> (4 * (s // 2))) & 0x0F0F0F0F) | (((qh >> (2 * s)) & 0x03030303) << 4)


@device
def q6_k_row(ql, qh, s):
    """The sixteen Q6_K levels (less 32) of row s from its four ql words (of ql[64 h + 32 (s % 2) +
    i]) and the four qh words (qh[32 h + i])."""
    return bytes_less16(q6_k_levels(ql[0], qh[0], s), q6_k_levels(ql[1], qh[1], s), q6_k_levels(ql[2], qh[2], s),
                        q6_k_levels(ql[3], qh[3], s), Q6_K_LEVEL_MAGIC)


def q6_k_unit(tokens: int, x_bf16: bool):
    """Split Q6_K: unit u (see above) is three 16-byte loads, ql words a (rows 0, 2), b (rows 1,
    3) and qh words c, the eight int8 scales of its half (two words, top bits flipped: int8_at)
    and d; the ql, qh and scales of block u // 4 start at its word Q6_K_PIECE_WORDS (u // 4), the
    d after the row's blocks."""
    add_row = row_adder(tokens, x_bf16)

    @device
    def q6_k_unit(ww, wf, row, x32, xo, k, n_tokens, acc, u):
        blk, h, j = u >> U2, (u >> U1) & U1, u & U1
        piece = uint64(Q6_K_PIECE_WORDS) * blk
        ql = piece + uint64(Q6_K_QL_WORD) + uint64(Q6_K_HALF_QL_WORDS) * h + U4 * j
        a = load_words4(ww, row, ql)
        b = load_words4(ww, row, ql + uint64(CHUNK // WORD))
        c = load_words4(ww, row, piece + uint64(Q6_K_QH_WORD) + uint64(Q6_K_HALF_QH_WORDS) * h + U4 * j)
        sc = piece + uint64(Q6_K_SCALES_WORD) + uint64(Q6_K_HALF_SCALES_WORDS) * h
        s01 = (ww[row, sc] >> (U8 * j)) ^ INT8_FLIP  # the scales of rows 0, 1 in bytes 0, 2
        s23 = (ww[row, sc + U1] >> (U8 * j)) ^ INT8_FLIP  # rows 2, 3
        d = float32(wf[row, uint64(Q6_K_D // F16_BYTES) * (uint64(k) // uint64(K_VALUES)) + blk])
        v = uint64(16) * blk + U8 * h + j  # row s's inputs are x16's 16 (v + 2 s) .. + 15
        add_row(q6_k_row(a, c, 0), d * int8_at(s01, 0), x32, xo, v, n_tokens, acc)
        add_row(q6_k_row(b, c, 1), d * int8_at(s01, 2), x32, xo, v + U2, n_tokens, acc)
        add_row(q6_k_row(a, c, 2), d * int8_at(s23, 0), x32, xo, v + U4, n_tokens, acc)
        add_row(q6_k_row(b, c, 3), d * int8_at(s23, 2), x32, xo, v + uint64(6), n_tokens, acc)

    return q6_k_unit


@device
def q6_k_part(address, ql, qh, sc, d_at, j):
    """One row's part of a Q6_K pair unit: its ql words a (rows 0, 2) and b (rows 1, 3), its qh
    words, and the scales d sc of rows 0 .. 3 (each exact: an fp16 times an int8). ql, qh, sc, d_at:
    the byte offsets of a, of the qh words, of the half's eight scale bytes (two words: row s's is
    byte 2 (s % 2) + j of word s // 2, j = u % 2) and of d."""
    a = words4_at(address, ql)
    b = words4_at(address, uint32(ql + uint32(CHUNK)))
    c = words4_at(address, qh)
    s01, s23 = words2_at(address, sc)
    d = f16_at(address, d_at)
    s01, s23 = s01 ^ INT8_FLIP, s23 ^ INT8_FLIP
    j2 = uint32(j + uint32(2))
    return a, b, c, (d * int8_at(s01, j), d * int8_at(s01, j2), d * int8_at(s23, j), d * int8_at(s23, j2))


def q6_k_pair_unit(tokens: int, x_bf16: bool):
    """Split Q6_K, two rows a unit (above): u's block is u // 4, half h = (u // 2) % 2, j = u % 2;
    its ql, qh and scales are in the block's piece (Q6_K_D bytes), d after the row's pieces."""
    inputs, run_shift = run_inputs(x_bf16)

    @device
    def add_group(x32, xv, n_tokens, v, s, ql_a, qh_a, scale_a, ql_b, qh_b, scale_b, acc):
        """Row s of both rows (levels decoded once) times every token's 16 inputs of run v."""
        qa = q6_k_row(ql_a, qh_a, s)
        qb = q6_k_row(ql_b, qh_b, s)
        for t in range(tokens):
            xs = inputs(x32, xv, n_tokens, v, t)
            acc[t] += scale_a * chain16(qa, xs)
            acc[tokens + t] += scale_b * chain16(qb, xs)

    @device
    def q6_k_pair_unit(ww, wf, row, x32, xo, k, n_tokens, acc, u):
        i = uint32(u)
        blk, h, j = i >> uint32(2), (i >> uint32(1)) & uint32(1), i & uint32(1)
        piece = uint32(uint32(Q6_K_D) * blk)
        ql = uint32(piece + uint32(Q6_K_QL) + uint32(Q6_K_HALF_QL) * h + uint32(ROW_ALIGN) * j)
        qh = uint32(piece + uint32(Q6_K_QH) + uint32(Q6_K_HALF_QH) * h + uint32(ROW_ALIGN) * j)
        sc = uint32(piece + uint32(Q6_K_SCALES) + uint32(Q6_K_HALF_SCALES_WORDS * WORD) * h)
        d_at = uint32(uint32(Q6_K_D) * (uint32(k) // uint32(K_VALUES)) + uint32(F16_BYTES) * blk)
        a = q6_k_part(row_address(ww, row), ql, qh, sc, d_at, j)
        b = q6_k_part(row_address(ww, min(row + 1, ww.shape[0] - 1)), ql, qh, sc, d_at, j)
        xv = uint32((uint32(xo) << uint32(2)) + (unit_inputs(blk, h, j) << run_shift))
        add_group(x32, xv, n_tokens, 0, 0, a[0], a[2], a[3][0], b[0], b[2], b[3][0], acc)
        add_group(x32, xv, n_tokens, 2, 1, a[1], a[2], a[3][1], b[1], b[2], b[3][1], acc)
        add_group(x32, xv, n_tokens, 4, 2, a[0], a[2], a[3][2], b[0], b[2], b[3][2], acc)
        add_group(x32, xv, n_tokens, 6, 3, a[1], a[2], a[3][3], b[1], b[2], b[3][3], acc)

    return q6_k_pair_unit


# Q6_K (split layout): levels nibble (j % 4) // 2 of ql[64 (j // 4) + 32 (j % 2) + i] below pair
# j % 4 of qh[32 (j // 4) + i], less 32: the level - 32 enters (its int8 scale times it would not be
# exact in bf16), and each 16 values' d sc is a half-step's scale.

@device
def fetch_q6_k(w32, w16, n, ks, c, k):
    b, j = ks // K_CHUNKS, ks % K_CHUNKS
    piece = Q6_K_PIECE_WORDS * b
    return (w32[n, piece + Q6_K_QL_WORD + Q6_K_HALF_QL_WORDS * (j // 4) + (CHUNK // WORD) * (j % 2) + c],
            w32[n, piece + Q6_K_QH_WORD + Q6_K_HALF_QH_WORDS * (j // 4) + c])


@device
def put_q6_k(b_s, r, c, word, aux, ks):
    put_levels(b_s, r, c, q6_k_levels(word, aux, ks % 4), Q6_K_LEVEL_MAGIC)


@device
def fetch_scales_q6_k(w32, w16, n, ks, k):
    """The int8 scales 2 j, 2 j + 1 (one 16-bit half of the block's scales) and d (after the row's blocks)."""
    b, j = ks // K_CHUNKS, ks % K_CHUNKS
    piece_halves = Q6_K_D // 2  # a block's ql, qh and scales; the row's d's start at its blocks' end
    return (uint32(w16[n, piece_halves * b + Q6_K_SCALES // 2 + j]), uint32(w16[n, piece_halves * (k // K_VALUES) + b]),
            uint32(0), uint32(0))


@device
def put_scales_q6_k(d_s, m_s, mins_s, r, ks, s0, s1, s2, s3):
    d = fp16_to_f32(s1)
    flipped = s0 ^ 0x8080  # int8_at's bytes: the top bits flipped
    d_s[0, r] = d * int8_at(flipped, 0)
    d_s[1, r] = d * int8_at(flipped, 1)


ENTRIES = [
    entry(GGMLType.Q6_K, dequant_q6_k, StreamUnit(q6_k_unit, 6, 2),
          TcType(fetch_q6_k, put_q6_k, fetch_scales_q6_k, put_scales_q6_k, CHUNK // WORD, False, halves=True),
          "split", padded_split_q6_k, dequant_q6_k_split, StreamUnit(q6_k_pair_unit, 6, 2, rows=2)),
]
