"""MXFP4 on the device: its block view, split layout, chunk dequantisers, stream units (one row a
unit; the decode GEMV's two), tensor-core pieces, and its row of the quant-type table.

Split layout: per row the K/32 blocks' 16 code bytes (a block one 16-byte piece), then their K/32
exponent bytes, zero-padded to whole 16-byte pieces (under one block). Stream unit u: block u's
codes, one 16-byte load, and a word load for its exponent byte; the GEMV's unit the same of two
rows.

Oracle: host.quants.dequantize_mxfp4 (tests/test_quants_more.py's device chunks, bit for bit);
the units and tc pieces through the products, every exponent corner included
(tests/test_quants_more.py, test_linear_tc.py).
"""

from __future__ import annotations

import numpy as np
from numba import float32, int32, uint32, uint64

from flashv41.host.quants import FORMATS, MXFP4_BLOCK, MXFP4_DOUBLED, GGMLType, field_offset
from flashv41.stages.device import CHUNK, byte_perm, device, f32_from_bits, load_words4, row_address, word_at, words4_at
from flashv41.stages.quants.records import ROW_ALIGN, WORD, StreamUnit, TcType, entry
from flashv41.stages.quants.units import (
    U1,
    U2,
    U3,
    U4,
    U8,
    bf16_pair_of,
    bf16x16,
    byte_less,
    f32x4_at,
    x4_bf16,
    x4_f32,
    x16_bf16,
    x16_f32,
)

MXFP4_BYTES = MXFP4_BLOCK.itemsize
MXFP4_E, MXFP4_QS = field_offset(MXFP4_BLOCK, "e"), field_offset(MXFP4_BLOCK, "qs")
MXFP4_PAIRS = MXFP4_BLOCK["qs"].shape[0]  # code bytes: value j low nibble, j + MXFP4_PAIRS high
assert FORMATS[GGMLType.MXFP4].block_values == CHUNK == 2 * MXFP4_PAIRS  # an MXFP4 block is one chunk


# MXFP4's stream unit (split layout: a block's codes one 16-byte piece). e2m1_offsets looks a code's
# doubled value up as the byte E2M1_BIAS + value, positive codes in E2M1_POS and negative ones in
# E2M1_NEG (two words of eight bytes each, byte c for code c & 7), every byte under 128.
MXFP4_INF_E = 253  # the smallest exponent byte with an infinite value: 8 * 2^(253 - 128) = 2^128
E2M1_BIAS = 64
E2M1_POS_LO, E2M1_POS_HI = (uint32(v) for v in (E2M1_BIAS + MXFP4_DOUBLED[:8]).astype(np.uint8).view("<u4"))
E2M1_NEG_LO, E2M1_NEG_HI = (uint32(v) for v in (E2M1_BIAS + MXFP4_DOUBLED[8:]).astype(np.uint8).view("<u4"))
E2M1_MAGIC = float32(8388608.0 + E2M1_BIAS)  # 2^23 + E2M1_BIAS: e2m1_at's byte under 2^23's exponent, less this
E2M1_TABLES = (E2M1_POS_LO, E2M1_POS_HI, E2M1_NEG_LO, E2M1_NEG_HI)  # e2m1_offsets' lookup words
assert MXFP4_PAIRS == ROW_ALIGN and 0 <= E2M1_BIAS + MXFP4_DOUBLED.min() and E2M1_BIAS + MXFP4_DOUBLED.max() < 128
assert float(MXFP4_DOUBLED.max()) * 2.0 ** (MXFP4_INF_E - 1 - 128) < 2.0**128 <= 8 * 2.0 ** (MXFP4_INF_E - 128)


# weight layout (host side)


def split_mxfp4(stored: np.ndarray, k: int) -> np.ndarray:
    """GGUF MXFP4 rows (uint8 [N, row_bytes]: per block an E8M0 exponent byte, then 16 code bytes)
    -> the split layout: per row the K/32 blocks' code bytes, 16 a block, then their K/32 exponent
    bytes (same bytes, same size)."""
    n = stored.shape[0]
    blocks = np.ascontiguousarray(stored).reshape(-1, MXFP4_BYTES).view(MXFP4_BLOCK).reshape(n, -1)
    return np.concatenate([np.ascontiguousarray(blocks["qs"]).reshape(n, -1), blocks["e"]], axis=1)


def padded_split_mxfp4(stored: np.ndarray, k: int) -> np.ndarray:
    """split_mxfp4's rows, zero-padded to whole ROW_ALIGN-byte pieces (under one block: see the
    module docstring)."""
    split = split_mxfp4(stored, k)
    pad = -split.shape[1] % ROW_ALIGN
    return np.pad(split, ((0, 0), (0, pad))) if pad else split


# chunk dequantisers


@device
def e2m1_doubled(code):
    """Twice the value of E2M1 code (4 bits): magnitudes 0, 1, 2, 3, 4, 6, 8, 12, the sign bit 8
    (code 8 is +0, as ggml's table has it)."""
    m = int32(code & 7)
    mag = m if m < 4 else (2 + (m & 1)) << ((m >> 1) - 1)
    return float32(-mag) if code & 8 else float32(mag)


@device
def e8m0_half(e):
    """An E8M0 exponent byte's 2^(e - 128) as float32 (host.quants.e8m0_half: subnormal for e < 2);
    both patterns uint32 (an int64 and a uint64 would meet as float64)."""
    return f32_from_bits(uint32(0x00200000 << e) if e < 2 else uint32((e - 1) << 23))


@device
def mxfp4_block(w, row, qs, e, out):
    """The 32 values of an MXFP4 block whose 16 code bytes start at byte qs of the row, its exponent
    byte e: 2^(e - 128) times the doubled E2M1 values, value j of byte j's low nibble, value j + 16
    of its high one."""
    d = e8m0_half(e)
    for j in range(MXFP4_PAIRS):
        b = uint32(w[row, qs + j])
        out[j] = d * e2m1_doubled(b & 15)
        out[j + MXFP4_PAIRS] = d * e2m1_doubled(b >> 4)


@device
def dequant_mxfp4(w, row, chunk, out):
    """MXFP4 block `chunk` of a stored row."""
    base = chunk * MXFP4_BYTES
    mxfp4_block(w, row, base + MXFP4_QS, uint32(w[row, base + MXFP4_E]), out)


@device
def dequant_mxfp4_split(w, row, chunk, out):
    """MXFP4 in the split layout: codes at 16 * chunk, exponent bytes after the row's K / 2 code bytes."""
    codes = (w.shape[1] // MXFP4_BYTES) * MXFP4_PAIRS
    mxfp4_block(w, row, chunk * MXFP4_PAIRS, uint32(w[row, codes + chunk]), out)


# stream units


@device
def e2m1_at(offsets, byte):
    """Byte `byte` of an e2m1_offsets word as the doubled E2M1 value it holds, in float32 (byte_less)."""
    return byte_less(offsets, byte, E2M1_MAGIC)


@device
def e2m1_offsets(codes, tables):
    """The four E2M1 codes in the low 16 bits of `codes` (code i in bits 4 i .. 4 i + 3) as the bytes
    E2M1_BIAS + doubled value (byte i for code i), without branches: byte_perm looks the positive
    codes up in E2M1_POS, and where a code's sign bit (bit 3 of its nibble) is set gives its table
    byte's top bit in all eight instead, 0; a second looks the negative codes up in E2M1_NEG
    through the codes with their sign bits flipped; an or joins the two. `tables`: E2M1_TABLES, or
    the same words as values of the caller's (e2m1_tables)."""
    pos_lo, pos_hi, neg_lo, neg_hi = tables
    return byte_perm(pos_lo, pos_hi, codes) | byte_perm(neg_lo, neg_hi, codes ^ 0x8888)


@device
def e2m1_tables(row):
    """E2M1_TABLES as values of a row index (or-ed with row >> 48: 0 for any row there is). A
    byte permute takes its two table words in registers; as constants ptxas keeps them in uniform
    registers and moves them over before every permute (two moves each, 32 a block of two rows),
    as values it holds them in registers (sm_90: rebuilt once a unit at most, five instructions)."""
    z = uint32(uint64(row) >> uint64(48))
    return E2M1_POS_LO | z, E2M1_POS_HI | z, E2M1_NEG_LO | z, E2M1_NEG_HI | z


@device
def e2m1_word_with(w, tables):
    """The doubled values of the eight codes of code word i of an MXFP4 block (its code bytes 4 i ..
    4 i + 3) in float32: values 4 i .. 4 i + 3 (the low nibbles), then 16 + 4 i .. 19 + 4 i (high)."""
    lo = e2m1_offsets(w, tables)  # values 4 i, 16 + 4 i, 4 i + 1, 17 + 4 i
    hi = e2m1_offsets(w >> 16, tables)  # values 4 i + 2, 18 + 4 i, 4 i + 3, 19 + 4 i
    return (e2m1_at(lo, 0), e2m1_at(lo, 2), e2m1_at(hi, 0), e2m1_at(hi, 2),
            e2m1_at(lo, 1), e2m1_at(lo, 3), e2m1_at(hi, 1), e2m1_at(hi, 3))


@device
def e2m1_word(w):
    """e2m1_word_with the constant tables."""
    return e2m1_word_with(w, E2M1_TABLES)


@device
def e2m1_scaled(q, d):
    """e2m1_word's eight values times d."""
    return q[0] * d, q[1] * d, q[2] * d, q[3] * d, q[4] * d, q[5] * d, q[6] * d, q[7] * d


@device
def e2m1_dot8(q, x0, x1, x2, x3, y0, y1, y2, y3):
    """e2m1_word's eight values times their inputs: the first four with x0 .. x3, the last with y0 .. y3."""
    return q[0] * x0 + q[1] * x1 + q[2] * x2 + q[3] * x3 + q[4] * y0 + q[5] * y1 + q[6] * y2 + q[7] * y3


@device
def mxfp4_dot(q0, q1, q2, q3, xs, ys):
    """A block's 32 values (q_i: e2m1_word of code word i) times its inputs, xs the first sixteen
    and ys the last."""
    return (e2m1_dot8(q0, xs[0], xs[1], xs[2], xs[3], ys[0], ys[1], ys[2], ys[3])
            + e2m1_dot8(q1, xs[4], xs[5], xs[6], xs[7], ys[4], ys[5], ys[6], ys[7])
            + e2m1_dot8(q2, xs[8], xs[9], xs[10], xs[11], ys[8], ys[9], ys[10], ys[11])
            + e2m1_dot8(q3, xs[12], xs[13], xs[14], xs[15], ys[12], ys[13], ys[14], ys[15]))


def mxfp4_unit(tokens: int, x_bf16: bool):
    """Split MXFP4: unit u is block u, its 16 code bytes one 16-byte load, its exponent byte (byte
    u after the row's K / 2 code bytes) one word load. The codes become doubled E2M1 integers
    (e2m1_word: byte permutes, no branches), summed times the inputs in fp32. Where the scale goes:
    - exponent bytes under MXFP4_INF_E (every value finite): the block's sum is multiplied once by
      2^(e - 128). A power of two scales every term and partial sum exactly, so this is the sum a
      product per value would give, except where the result is an fp32 subnormal (under 2^-126:
      the smallest exponents): rounded once there, at most 2^-150 off, far inside the product
      bounds (half a bf16 ulp is at least 2^-134, the fp32 bound at least 2^-149), where each
      value's product would round too;
    - from MXFP4_INF_E (8 * 2^125 = 2^128) on a value can be inf, and the oracle's product holds
      inf or NaN (x * inf, inf - inf) where a scaled sum would be finite or one plain inf: each
      value is scaled first (as dequant_mxfp4, inf where it is) and multiplied by its input. No
      real weight has such exponents; they cost a compare a block.
    As in any fp32 kernel, a sum can also overflow where the oracle's float64 one does not."""
    x16 = x16_bf16 if x_bf16 else x16_f32

    @device
    def mxfp4_unit(ww, wf, row, x32, xo, k, n_tokens, acc, u):
        w0, w1, w2, w3 = load_words4(ww, row, U4 * u)
        e = (ww[row, uint64(k >> 3) + (u >> U2)] >> uint32(8 * (u & U3))) & uint32(0xFF)
        d = e8m0_half(e)
        q0, q1, q2, q3 = e2m1_word(w0), e2m1_word(w1), e2m1_word(w2), e2m1_word(w3)
        if e >= MXFP4_INF_E:
            q0, q1, q2, q3 = e2m1_scaled(q0, d), e2m1_scaled(q1, d), e2m1_scaled(q2, d), e2m1_scaled(q3, d)
            d = float32(1)
        for t in range(tokens):
            if t < n_tokens:
                acc[t] += d * mxfp4_dot(q0, q1, q2, q3, x16(x32, t, xo, U2 * u), x16(x32, t, xo, U2 * u + U1))

    return mxfp4_unit


MXFP4_E_SELECT = uint32(0x4440)  # byte_perm selector: byte s (or-ed in, s < 4) of a word, zeros above


@device
def mxfp4_exponent_at(address, e_at, select):
    """The exponent byte of a block: byte `select & 3` of the word at byte e_at of a row_address
    (one load, one byte permute)."""
    return byte_perm(word_at(address, e_at), uint32(0), select)


@device
def block_bf16_at(x, o):
    """The 32 bf16 inputs of a block at byte o of a token's row_address, as two runs of sixteen:
    four 16-byte loads at o + 16 j, the constant parts added in 64 bits (so that they land in the
    loads' immediate offsets: one address computation for the four)."""
    base = uint64(o)
    a0, a1, a2, a3 = words4_at(x, base)
    a4, a5, a6, a7 = words4_at(x, base + uint64(16))
    b0, b1, b2, b3 = words4_at(x, base + uint64(32))
    b4, b5, b6, b7 = words4_at(x, base + uint64(48))
    return bf16x16(a0, a1, a2, a3, a4, a5, a6, a7), bf16x16(b0, b1, b2, b3, b4, b5, b6, b7)


@device
def block_f32_at(x, o):
    """The 32 fp32 inputs of a block at byte o of a token's row_address, as two runs of sixteen:
    eight 16-byte loads, their addresses as block_bf16_at's."""
    base = uint64(o)
    step = uint64(ROW_ALIGN)  # four fp32 inputs a load
    x0, x1, x2, x3 = f32x4_at(x, base)
    x4, x5, x6, x7 = f32x4_at(x, base + step)
    x8, x9, x10, x11 = f32x4_at(x, base + uint64(2) * step)
    x12, x13, x14, x15 = f32x4_at(x, base + uint64(3) * step)
    y0, y1, y2, y3 = f32x4_at(x, base + uint64(4) * step)
    y4, y5, y6, y7 = f32x4_at(x, base + uint64(5) * step)
    y8, y9, y10, y11 = f32x4_at(x, base + uint64(6) * step)
    y12, y13, y14, y15 = f32x4_at(x, base + uint64(7) * step)
    return ((x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15),
            (y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15))


def mxfp4_pair_unit(tokens: int, x_bf16: bool):
    """Split MXFP4, two rows at once (the decode GEMV's; `rows` = 2): unit u is block u of rows
    `row` and `row + 1` (past the matrix, a clamped real row whose sums the kernel drops), their
    sums in acc[t] and acc[tokens + t]. Per row a 16-byte load of the block's codes at byte 16 u
    and a word load of its exponent byte (byte u after the K / 2 code bytes); the 32 inputs are
    read and unpacked once for both rows (the second row's token loop reads what the first's did,
    and the compiler shares the loads and conversions: sm_90, the same ones as one loop over both
    rows, which at eight tokens held 168 registers against 128). The scales are mxfp4_unit's,
    without its branch:
    - main path: each row adds d * (sum of doubled E2M1 integer times input), d = 2^(e - 128),
      where e is under MXFP4_INF_E, and 0 from there on (a select of the sum, so that not even an
      inf input turns it into NaN); every load a row address plus a 32-bit byte offset, the token
      slots past n_tokens reading the last live token's inputs (their sums never stored), so the
      unit's loads all go out before its arithmetic;
    - a block of either row with an exponent from MXFP4_INF_E on (no real weight has one) adds,
      after the main sums, its values scaled one by one (inf where the host's are) times their
      inputs: the oracle's inf and NaN. The other row adds 0 there (a select: it was summed above).
    So each row gets what mxfp4_unit gives it, inf and NaN included, whatever its pair's row."""
    block_at = block_bf16_at if x_bf16 else block_f32_at
    shift = uint32(6 if x_bf16 else 7)  # log2 of a block's input bytes
    x4 = x4_bf16 if x_bf16 else x4_f32

    @device
    def main_add(total, d, e, dot):
        """total plus the main path's part of a block, its scaled sum (total as it is from
        MXFP4_INF_E on): one FMA and one select."""
        return total + d * dot if e < MXFP4_INF_E else total

    @device
    def scaled_dot8(x32, xo, v, wa, wb, fa, fb, t):
        """Code word wa of the first row and wb of the second (the same eight positions), each
        value scaled first (fa, fb), times token t's inputs v .. v + 3 and v + 16 .. v + 19."""
        x0, x1, x2, x3 = x4(x32, t, xo, v)
        y0, y1, y2, y3 = x4(x32, t, xo, v + uint64(MXFP4_PAIRS))
        return (e2m1_dot8(e2m1_scaled(e2m1_word(wa), fa), x0, x1, x2, x3, y0, y1, y2, y3),
                e2m1_dot8(e2m1_scaled(e2m1_word(wb), fb), x0, x1, x2, x3, y0, y1, y2, y3))

    @device
    def add_inf_blocks(x32, xo, u, wa, wb, ea, eb, n_tokens, acc):
        """The rare path: each row's block u with its values scaled first, dotted with every
        token's inputs in mxfp4_dot's order, added where its exponent is from MXFP4_INF_E on (the
        other row's was summed above). A code word at a time, its codes decoded again and its inputs
        read again with the plain loads, so that little stays live for this path."""
        fa, fb = e8m0_half(ea), e8m0_half(eb)
        v = uint64(u) << uint64(5)
        for t in range(tokens):
            tt = min(t, n_tokens - 1)
            a0, b0 = scaled_dot8(x32, xo, v, wa[0], wb[0], fa, fb, tt)
            a1, b1 = scaled_dot8(x32, xo, v + U4, wa[1], wb[1], fa, fb, tt)
            a2, b2 = scaled_dot8(x32, xo, v + U8, wa[2], wb[2], fa, fb, tt)
            a3, b3 = scaled_dot8(x32, xo, v + uint64(12), wa[3], wb[3], fa, fb, tt)
            sa = a0 + a1 + a2 + a3
            sb = b0 + b1 + b2 + b3
            acc[t] += sa if ea >= MXFP4_INF_E else float32(0)
            acc[tokens + t] += sb if eb >= MXFP4_INF_E else float32(0)

    @device
    def mxfp4_pair_unit(ww, wf, row, x32, xo, k, n_tokens, acc, u):
        i = uint32(u)
        qs = uint32(i << uint32(4))
        e_at = uint32((uint32(k) >> uint32(1)) + (i & uint32(0xFFFFFFFC)))
        select = uint32(MXFP4_E_SELECT | (i & uint32(3)))
        a = row_address(ww, row)
        b = row_address(ww, min(row + 1, ww.shape[0] - 1))
        wa = words4_at(a, qs)
        wb = words4_at(b, qs)
        ea = mxfp4_exponent_at(a, e_at, select)
        eb = mxfp4_exponent_at(b, e_at, select)
        da, db = e8m0_half(ea), e8m0_half(eb)
        tables = e2m1_tables(row)
        a0, a1 = e2m1_word_with(wa[0], tables), e2m1_word_with(wa[1], tables)
        a2, a3 = e2m1_word_with(wa[2], tables), e2m1_word_with(wa[3], tables)
        b0, b1 = e2m1_word_with(wb[0], tables), e2m1_word_with(wb[1], tables)
        b2, b3 = e2m1_word_with(wb[2], tables), e2m1_word_with(wb[3], tables)
        xb = uint32((uint32(xo) << uint32(2)) + (i << shift))  # the block's inputs, a byte offset
        for t in range(tokens):
            xs, ys = block_at(row_address(x32, min(t, n_tokens - 1)), xb)
            acc[t] = main_add(acc[t], da, ea, mxfp4_dot(a0, a1, a2, a3, xs, ys))
        for t in range(tokens):
            xs, ys = block_at(row_address(x32, min(t, n_tokens - 1)), xb)
            acc[tokens + t] = main_add(acc[tokens + t], db, eb, mxfp4_dot(b0, b1, b2, b3, xs, ys))
        if max(ea, eb) >= MXFP4_INF_E:
            add_inf_blocks(x32, xo, u, wa, wb, ea, eb, n_tokens, acc)

    return mxfp4_pair_unit


# MXFP4 (split layout): a step is a block, its doubled E2M1 levels (integers -12 .. 12) entering and
# 2^(e - 128) its scale. From MXFP4_INF_E on a value can be inf: then each value is scaled in the put
# instead, to what the host's dequantiser makes of it (exact in bf16 as in float32: two significant
# bits, or inf), and the step's scale is 1, so that inf and NaN come out where the host's do.

@device
def fetch_mxfp4(w32, w16, n, ks, c, k):
    """Code word c of block ks and the word of its exponent byte (byte ks % 4 of word K / 8 + ks // 4)."""
    return w32[n, (MXFP4_PAIRS // WORD) * ks + c], w32[n, k // 8 + ks // 4]


@device
def mxfp4_exponent(word, ks):
    return (word >> (8 * (ks % 4))) & 0xFF


@device
def put_mxfp4(b_s, r, c, word, aux, ks):
    """Values 4 c .. 4 c + 3 (the word's low nibbles) into b_s words 2 c, 2 c + 1, values 16 + 4 c ..
    (its high nibbles) into 8 + 2 c, 9 + 2 c."""
    e = mxfp4_exponent(aux, ks)
    q = e2m1_word(word)
    if e >= MXFP4_INF_E:
        q = e2m1_scaled(q, e8m0_half(e))
    b_s[r, 2 * c] = bf16_pair_of(q[0], q[1])
    b_s[r, 2 * c + 1] = bf16_pair_of(q[2], q[3])
    b_s[r, 8 + 2 * c] = bf16_pair_of(q[4], q[5])
    b_s[r, 9 + 2 * c] = bf16_pair_of(q[6], q[7])


@device
def fetch_scales_mxfp4(w32, w16, n, ks, k):
    return w32[n, k // 8 + ks // 4], uint32(0), uint32(0), uint32(0)


@device
def put_scales_mxfp4(d_s, m_s, mins_s, r, ks, s0, s1, s2, s3):
    e = mxfp4_exponent(s0, ks)
    d_s[0, r] = e8m0_half(e) if e < MXFP4_INF_E else float32(1)


ENTRIES = [
    entry(GGMLType.MXFP4, dequant_mxfp4, StreamUnit(mxfp4_unit, 5, 2),
          TcType(fetch_mxfp4, put_mxfp4, fetch_scales_mxfp4, put_scales_mxfp4, MXFP4_PAIRS // WORD, False),
          "split", padded_split_mxfp4, dequant_mxfp4_split, StreamUnit(mxfp4_pair_unit, 5, 2, rows=2)),
]
