"""Q3_K on the device: its block view, split layout, chunk dequantisers, stream units (one row a
unit; the decode GEMV's two), tensor-core pieces, and its row of the quant-type table.

Split layout: per row every block's hmask and qs (96 bytes, 6 whole 16-byte pieces), then every
block's 12 scale bytes, then every block's d, zero-padded to whole 16-byte pieces (under one
block; no padding between blocks: see Q3_K_PIECE). Stream unit u: 64 values of block u // 4 (two
16-byte loads, stages.quants.units' row_adder); the GEMV's unit the same of two rows.

Oracle: host.quants.dequantize_q3_k (tests/test_quants_more.py's device chunks, bit for bit); the
units and tc pieces through the products (tests/test_quants_more.py, test_linear_tc.py).
"""

from __future__ import annotations

import numpy as np
from numba import float32, int32, uint32, uint64

from flashv41.host.quants import Q3_K_BLOCK, GGMLType, field_offset
from flashv41.stages.device import (
    CHUNK,
    bit_select,
    device,
    f16_at,
    fp16_to_f32,
    inlined,
    load_words4,
    read_u16,
    row_address,
    word_at,
    words4_at,
)
from flashv41.stages.quants.records import ROW_ALIGN, WORD, StreamUnit, TcType, entry, padded_stored, split_blocks
from flashv41.stages.quants.units import (
    F16_BYTES,
    K_CHUNKS,
    K_VALUES,
    LOW_NIBBLES,
    SHIFT_HALF,
    U1,
    U2,
    U4,
    U8,
    bytes_less16,
    chain16,
    field_less,
    field_magic,
    put_levels,
    row_adder,
    run_inputs,
    small_int,
    unit_inputs,
)

Q3_K_BYTES = Q3_K_BLOCK.itemsize
Q3_K_HMASK, Q3_K_QS = field_offset(Q3_K_BLOCK, "hmask"), field_offset(Q3_K_BLOCK, "qs")
Q3_K_SCALES, Q3_K_D = field_offset(Q3_K_BLOCK, "scales"), field_offset(Q3_K_BLOCK, "d")
Q3_K_HALF_QS = Q3_K_BLOCK["qs"].shape[0] // 2  # 2-bit level bytes of each 128-value half
Q3_K_LOW_SCALES = 8  # scale bytes 0..7 hold the low nibbles, 8..11 the high pairs
assert Q3_K_BLOCK["hmask"].shape[0] == CHUNK and Q3_K_HALF_QS == CHUNK  # one byte per lane of a chunk


# The split layout (module docstring): a Q3_K row is every block's hmask and qs (Q3_K_PIECE bytes,
# whole 16-byte pieces), then every block's 12 scale bytes, then every block's d. Q3_K keeps no
# padding inside the row: 108-byte pieces holding the scales too would be 4-byte aligned only (word
# loads: four times the load instructions) or, padded to 112 bytes, 3.6% more bytes for every GEMV
# to read; apart, consecutive blocks' scales are consecutive words. The word constants below index
# the rows as 32-bit words.
Q3_K_PIECE = Q3_K_SCALES  # hmask, qs
Q3_K_SCALE_BYTES = Q3_K_D - Q3_K_SCALES
Q3_K_PIECE_WORDS, Q3_K_SCALE_WORDS = Q3_K_PIECE // WORD, Q3_K_SCALE_BYTES // WORD
Q3_K_HMASK_WORD, Q3_K_QS_WORD, Q3_K_HALF_QS_WORDS = Q3_K_HMASK // WORD, Q3_K_QS // WORD, Q3_K_HALF_QS // WORD
Q3_K_LEVEL_MAGIC = float32(2.0**23 + 4)  # byte_less's 2^23 + o: takes the 4 off a Q3_K level + 4
# d last; the scales after the pieces, in whole words (three a block)
assert Q3_K_D + F16_BYTES == Q3_K_BYTES and Q3_K_PIECE % ROW_ALIGN == 0 and Q3_K_SCALE_BYTES % WORD == 0
assert Q3_K_HMASK % ROW_ALIGN == 0 and Q3_K_QS % ROW_ALIGN == 0
assert Q3_K_SCALE_WORDS == 3


# weight layout (host side)


def padded_split_q3_k(stored: np.ndarray, k: int) -> np.ndarray:
    """GGUF Q3_K rows -> the split layout: per row every block's hmask and qs, then every block's
    scales, then every block's d, zero-padded to whole ROW_ALIGN-byte pieces."""
    return padded_stored(split_blocks(stored, Q3_K_BYTES, (Q3_K_PIECE, Q3_K_D)), k)


# chunk dequantisers


@device
def q3_k_values(w, row, c, out, piece, scales, d):
    """Chunk c of a Q3_K block whose hmask and qs are at byte `piece` (at their block offsets), its
    12 scale bytes at `scales`, its fp16 d at `d`: levels (qs[32 (c // 4) + i] >> 2 (c % 4)) & 3,
    less 4 where bit c of hmask[i] is clear; sub-blocks 2 c and 2 c + 1, each scale 6 bits, stored + 32."""
    scale_d = fp16_to_f32(read_u16(w, row, d))
    qs = piece + Q3_K_QS + (c // 4) * Q3_K_HALF_QS
    shift = 2 * (c % 4)
    for g in range(2):
        j = 2 * c + g
        lo = (uint32(w[row, scales + j % Q3_K_LOW_SCALES]) >> (4 * (j // Q3_K_LOW_SCALES))) & 15
        hi = (uint32(w[row, scales + Q3_K_LOW_SCALES + j % 4]) >> (2 * (j // 4))) & 3
        scale = scale_d * float32(int32(lo | (hi << 4)) - 32)
        for i in range(16 * g, 16 * g + 16):
            low = int32((uint32(w[row, qs + i]) >> shift) & 3)
            high = int32((uint32(w[row, piece + Q3_K_HMASK + i]) >> c) & 1)
            out[i] = scale * float32(low - 4 + 4 * high)


@device
def dequant_q3_k(w, row, chunk, out):
    """Q3_K chunk `chunk` of stored rows."""
    base = (chunk // K_CHUNKS) * Q3_K_BYTES
    q3_k_values(w, row, chunk % K_CHUNKS, out, base, base + Q3_K_SCALES, base + Q3_K_D)


@device
def dequant_q3_k_split(w, row, chunk, out):
    """Q3_K chunk `chunk` of split rows of n blocks: block b's hmask and qs at byte Q3_K_PIECE b,
    its scales at Q3_K_PIECE n + 12 b, its d at Q3_K_D n + 2 b (the padding is under a block: n
    reads off the width)."""
    n_blocks = w.shape[1] // Q3_K_BYTES
    b = chunk // K_CHUNKS
    q3_k_values(w, row, chunk % K_CHUNKS, out, Q3_K_PIECE * b, Q3_K_PIECE * n_blocks + Q3_K_SCALE_BYTES * b,
                Q3_K_D * n_blocks + F16_BYTES * b)


# stream units (stages.quants.units: the split Q6_K and Q3_K units)


@inlined
def q3_k_levels(qs, hmask, s):
    """Four Q3_K levels (+ 4), one a byte, of row s: pair s of a qs word as bits 0-1, bit s of the
    hmask word (shifted down to its half's bits) as bit 2."""
    return ((qs >> (2 * s)) & 0x03030303) | (((hmask >> s) & 0x01010101) << 2)


@device
def q3_k_row(qs, hmask, s):
    """The sixteen Q3_K levels of row s from the four qs words (of qs[32 h + i]) and the four hmask
    words (hmask[i] >> 4 h), less 4."""
    return bytes_less16(q3_k_levels(qs[0], hmask[0], s), q3_k_levels(qs[1], hmask[1], s),
                        q3_k_levels(qs[2], hmask[2], s), q3_k_levels(qs[3], hmask[3], s), Q3_K_LEVEL_MAGIC)


@device
def q3_k_scale(nibbles, tops, s):
    """Row s's 6-bit scale less 32, from the words of its low nibble (bits 16 (s % 2) ..) and of its
    top pair (bits 16 (s % 2) + 2 (s // 2) ..)."""
    low = (nibbles >> (16 * (s % 2))) & 15
    top = (tops >> (16 * (s % 2) + 2 * (s // 2))) & 3
    return small_int(low | (top << 4)) - float32(32)


def q3_k_unit(tokens: int, x_bf16: bool):
    """Split Q3_K: unit u (see above) is two 16-byte loads, hmask words m (hmask[i], whose bits
    4 h .. 4 h + 3 are its rows') and qs words q, the three scale words of block u // 4 and d; the
    pieces are Q3_K_PIECE_WORDS words, the scales and d follow the row's pieces. Row s's scale:
    its low nibble is scales[2 s + u % 2] >> 4 h, its top pair scales[8 + (2 s + u % 2) % 4] >>
    (4 h + 2 (s // 2)), both in the words shifted down by 8 (u % 2) + 4 h."""
    add_row = row_adder(tokens, x_bf16)

    @device
    def q3_k_unit(ww, wf, row, x32, xo, k, n_tokens, acc, u):
        blk, h, j = u >> U2, (u >> U1) & U1, u & U1
        n_blocks = uint64(k) // uint64(K_VALUES)
        piece = uint64(Q3_K_PIECE_WORDS) * blk
        m0, m1, m2, m3 = load_words4(ww, row, piece + uint64(Q3_K_HMASK_WORD) + U4 * j)
        q0, q1, q2, q3 = load_words4(ww, row, piece + uint64(Q3_K_QS_WORD) + uint64(Q3_K_HALF_QS_WORDS) * h + U4 * j)
        sc = uint64(Q3_K_PIECE_WORDS) * n_blocks + uint64(Q3_K_SCALE_WORDS) * blk
        shift = U8 * j + U4 * h
        lo01 = ww[row, sc] >> shift  # the low nibbles of rows 0, 1 in bits 0-3, 16-19
        lo23 = ww[row, sc + U1] >> shift  # rows 2, 3
        tops = ww[row, sc + U2] >> shift  # the top pairs: rows 0, 1 in bits 0-1, 16-17, rows 2, 3 two above
        d = float32(wf[row, uint64(Q3_K_D // F16_BYTES) * n_blocks + blk])
        q = (q0, q1, q2, q3)
        m = (m0 >> (U4 * h), m1 >> (U4 * h), m2 >> (U4 * h), m3 >> (U4 * h))
        v = uint64(16) * blk + U8 * h + j  # row s's inputs are x16's 16 (v + 2 s) .. + 15
        add_row(q3_k_row(q, m, 0), d * q3_k_scale(lo01, tops, 0), x32, xo, v, n_tokens, acc)
        add_row(q3_k_row(q, m, 1), d * q3_k_scale(lo01, tops, 1), x32, xo, v + U2, n_tokens, acc)
        add_row(q3_k_row(q, m, 2), d * q3_k_scale(lo23, tops, 2), x32, xo, v + U4, n_tokens, acc)
        add_row(q3_k_row(q, m, 3), d * q3_k_scale(lo23, tops, 3), x32, xo, v + uint64(6), n_tokens, acc)

    return q3_k_unit


Q3_K_SCALE_MASKS = (uint32(0x3F), uint32(0x3F << 16))  # a 6-bit scale of row s, at bit 16 (s % 2)
Q3_K_SCALE_MAGICS = (field_magic(0), field_magic(16))
Q3_K_SCALE_LESS = (float32(2.0**23 + 32), float32(2.0**7 + 32))  # 2^(23 - p) + 32: the scales less 32


# A Q3_K pair unit's levels where they lie (field_less): row s's two level bits are bits 2 s, 2 s + 1
# of each qs byte; one select puts the high bit (bit s of the hmask byte) above them, so each
# level + 4 is a 3-bit field at bit Q3_K_FIELD[s] of each byte, read in bytes 0 and 1 of the word
# and of the word shifted down 16. Row 3's bits 6, 7 are first shifted down to 4, 5 (its field at
# bit 6 would reach into the next byte, and past the word in byte 3).
Q3_K_FIELD = (0, 2, 4, 4)  # the lowest bit of row s's field in each byte
Q3_K_QS_SHIFT = tuple(uint32(2 * s - f) for s, f in enumerate(Q3_K_FIELD))  # qs down to the field
Q3_K_HM_SHIFT = tuple(uint32(f + 2 - s) for s, f in enumerate(Q3_K_FIELD))  # hmask bit s up above it
Q3_K_QS_KEEP = tuple(uint32(0x03030303 << f) for f in Q3_K_FIELD)  # the level bits of the qs word
Q3_K_LOW_LEVELS = tuple(uint32(7 << f) for f in Q3_K_FIELD)  # byte 0's field of row s
Q3_K_HIGH_LEVELS = tuple(uint32(7 << (8 + f)) for f in Q3_K_FIELD)  # byte 1's
Q3_K_LOW_LEVEL_MAGICS = tuple(field_magic(f) for f in Q3_K_FIELD)
Q3_K_HIGH_LEVEL_MAGICS = tuple(field_magic(8 + f) for f in Q3_K_FIELD)
Q3_K_LOW_LEVEL_LESS = tuple(float32(2.0 ** (23 - f) + 4) for f in Q3_K_FIELD)  # 2^(23 - p) + 4
Q3_K_HIGH_LEVEL_LESS = tuple(float32(2.0 ** (15 - f) + 4) for f in Q3_K_FIELD)


@device
def q3_k_field_word(qs, hmask, s):
    """A qs word with row s's level bits at bit Q3_K_FIELD[s] of each byte and its high bits (bit s
    of each byte of the hmask word) put above them; the other bits are the rest of the two words,
    which the field reads mask off."""
    return bit_select(hmask << Q3_K_HM_SHIFT[s], qs >> Q3_K_QS_SHIFT[s], Q3_K_QS_KEEP[s])


@device
def q3_k_fields(qs, hmask, s):
    """The sixteen Q3_K levels of row s (less 4: q3_k_row's values, entry 4 m + b of byte b of word
    m) read where they lie in q3_k_field_word's words: bytes 0 and 1 of each word, bytes 2 and 3 of
    the word shifted down 16."""
    lo, hi = Q3_K_LOW_LEVELS[s], Q3_K_HIGH_LEVELS[s]
    lo_magic, hi_magic = Q3_K_LOW_LEVEL_MAGICS[s], Q3_K_HIGH_LEVEL_MAGICS[s]
    lo_less, hi_less = Q3_K_LOW_LEVEL_LESS[s], Q3_K_HIGH_LEVEL_LESS[s]
    w0, w1 = q3_k_field_word(qs[0], hmask[0], s), q3_k_field_word(qs[1], hmask[1], s)
    w2, w3 = q3_k_field_word(qs[2], hmask[2], s), q3_k_field_word(qs[3], hmask[3], s)
    t0, t1, t2, t3 = w0 >> SHIFT_HALF, w1 >> SHIFT_HALF, w2 >> SHIFT_HALF, w3 >> SHIFT_HALF
    return (field_less(w0, lo, lo_magic, lo_less), field_less(w0, hi, hi_magic, hi_less),
            field_less(t0, lo, lo_magic, lo_less), field_less(t0, hi, hi_magic, hi_less),
            field_less(w1, lo, lo_magic, lo_less), field_less(w1, hi, hi_magic, hi_less),
            field_less(t1, lo, lo_magic, lo_less), field_less(t1, hi, hi_magic, hi_less),
            field_less(w2, lo, lo_magic, lo_less), field_less(w2, hi, hi_magic, hi_less),
            field_less(t2, lo, lo_magic, lo_less), field_less(t2, hi, hi_magic, hi_less),
            field_less(w3, lo, lo_magic, lo_less), field_less(w3, hi, hi_magic, hi_less),
            field_less(t3, lo, lo_magic, lo_less), field_less(t3, hi, hi_magic, hi_less))


@device
def q3_k_part(address, hm, qs, sc, d_at, shift, h4):
    """One row's part of a Q3_K pair unit: its qs words, its hmask words shifted down to the half's
    bits (by h4 = 4 h), and the scales d sc of rows 0 .. 3. hm, qs, sc, d_at: the byte offsets of
    the hmask and qs words, of the block's three scale words and of d; shift = 8 (u % 2) + 4 h
    (q3_k_unit's). Each scale is its low nibble with its top pair put above it by one select (the
    low nibbles' word keeps bits 0-3 of each byte, the top pairs' word, shifted up to bits 4-5, the
    rest), then read where it lies: bits 0-5 for rows 0, 2, bits 16-21 for rows 1, 3."""
    m0, m1, m2, m3 = words4_at(address, hm)
    q = words4_at(address, qs)
    lo01 = word_at(address, sc) >> shift
    lo23 = word_at(address, uint32(sc + uint32(WORD))) >> shift
    tops = word_at(address, uint32(sc + uint32(2 * WORD))) >> shift
    d = f16_at(address, d_at)
    w01 = bit_select(tops << uint32(4), lo01, LOW_NIBBLES)
    w23 = bit_select(tops << uint32(2), lo23, LOW_NIBBLES)
    m = (m0 >> h4, m1 >> h4, m2 >> h4, m3 >> h4)
    return q, m, (d * field_less(w01, Q3_K_SCALE_MASKS[0], Q3_K_SCALE_MAGICS[0], Q3_K_SCALE_LESS[0]),
                  d * field_less(w01, Q3_K_SCALE_MASKS[1], Q3_K_SCALE_MAGICS[1], Q3_K_SCALE_LESS[1]),
                  d * field_less(w23, Q3_K_SCALE_MASKS[0], Q3_K_SCALE_MAGICS[0], Q3_K_SCALE_LESS[0]),
                  d * field_less(w23, Q3_K_SCALE_MASKS[1], Q3_K_SCALE_MAGICS[1], Q3_K_SCALE_LESS[1]))


def q3_k_pair_unit(tokens: int, x_bf16: bool):
    """Split Q3_K, two rows a unit (above): u's block is u // 4, half h = (u // 2) % 2; its hmask
    and qs are in the block's piece (Q3_K_PIECE bytes), its scales and d after the row's pieces."""
    inputs, run_shift = run_inputs(x_bf16)

    @device
    def add_group(x32, xv, n_tokens, v, s, a, b, acc):
        """Row s of both rows (levels decoded once) times every token's 16 inputs of run v."""
        qa = q3_k_fields(a[0], a[1], s)
        qb = q3_k_fields(b[0], b[1], s)
        for t in range(tokens):
            xs = inputs(x32, xv, n_tokens, v, t)
            acc[t] += a[2][s] * chain16(qa, xs)
            acc[tokens + t] += b[2][s] * chain16(qb, xs)

    @device
    def q3_k_pair_unit(ww, wf, row, x32, xo, k, n_tokens, acc, u):
        i = uint32(u)
        blk, h, j = i >> uint32(2), (i >> uint32(1)) & uint32(1), i & uint32(1)
        n_blocks = uint32(uint32(k) // uint32(K_VALUES))
        piece = uint32(uint32(Q3_K_PIECE) * blk)
        hm = uint32(piece + uint32(Q3_K_HMASK) + uint32(ROW_ALIGN) * j)
        qs = uint32(piece + uint32(Q3_K_QS) + uint32(Q3_K_HALF_QS) * h + uint32(ROW_ALIGN) * j)
        sc = uint32(uint32(Q3_K_PIECE) * n_blocks + uint32(Q3_K_SCALE_BYTES) * blk)
        d_at = uint32(uint32(Q3_K_D) * n_blocks + uint32(F16_BYTES) * blk)
        shift = uint32((j << uint32(3)) | (h << uint32(2)))
        h4 = uint32(h << uint32(2))
        a = q3_k_part(row_address(ww, row), hm, qs, sc, d_at, shift, h4)
        b = q3_k_part(row_address(ww, min(row + 1, ww.shape[0] - 1)), hm, qs, sc, d_at, shift, h4)
        xv = uint32((uint32(xo) << uint32(2)) + (unit_inputs(blk, h, j) << run_shift))
        add_group(x32, xv, n_tokens, 0, 0, a, b, acc)
        add_group(x32, xv, n_tokens, 2, 1, a, b, acc)
        add_group(x32, xv, n_tokens, 4, 2, a, b, acc)
        add_group(x32, xv, n_tokens, 6, 3, a, b, acc)

    return q3_k_pair_unit


# Q3_K (split layout): levels pair j % 4 of qs[32 (j // 4) + i] and bit j of hmask[i], less 4; the
# level enters and each 16 values' d (sc - 32) is a half-step's scale (q3_k_scale: the low nibbles of
# sub-blocks 2 j, 2 j + 1 are in scale word (j % 4) // 2, their top pairs in word 2, both in bytes
# 2 (j % 2), 2 (j % 2) + 1 shifted by 4 (j // 4)).

@device
def fetch_q3_k(w32, w16, n, ks, c, k):
    b, j = ks // K_CHUNKS, ks % K_CHUNKS
    piece = Q3_K_PIECE_WORDS * b
    return (w32[n, piece + Q3_K_QS_WORD + Q3_K_HALF_QS_WORDS * (j // 4) + c], w32[n, piece + Q3_K_HMASK_WORD + c])


@device
def put_q3_k(b_s, r, c, word, aux, ks):
    j = ks % K_CHUNKS
    put_levels(b_s, r, c, q3_k_levels(word, aux >> (4 * (j // 4)), j % 4), Q3_K_LEVEL_MAGIC)


@device
def fetch_scales_q3_k(w32, w16, n, ks, k):
    """Two of the block's three scale words and d (the scales after the row's pieces, d after them)."""
    b, j = ks // K_CHUNKS, ks % K_CHUNKS
    n_blocks = k // K_VALUES
    sc = Q3_K_PIECE_WORDS * n_blocks + Q3_K_SCALE_WORDS * b
    return w32[n, sc + (j % 4) // 2], w32[n, sc + 2], uint32(w16[n, (Q3_K_D // 2) * n_blocks + b]), uint32(0)


@device
def put_scales_q3_k(d_s, m_s, mins_s, r, ks, s0, s1, s2, s3):
    j = ks % K_CHUNKS
    shift = 4 * (j // 4)
    d = fp16_to_f32(s2)
    d_s[0, r] = d * q3_k_scale(s0 >> shift, s1 >> shift, j % 4)
    d_s[1, r] = d * q3_k_scale(s0 >> (8 + shift), s1 >> (8 + shift), j % 4)


ENTRIES = [
    entry(GGMLType.Q3_K, dequant_q3_k, StreamUnit(q3_k_unit, 6, 2),
          TcType(fetch_q3_k, put_q3_k, fetch_scales_q3_k, put_scales_q3_k, CHUNK // WORD, False, halves=True),
          "split", padded_split_q3_k, dequant_q3_k_split, StreamUnit(q3_k_pair_unit, 6, 2, rows=2)),
]
