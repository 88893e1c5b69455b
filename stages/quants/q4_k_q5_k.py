"""Q4_K and Q5_K on the device (one module: Q5_K is Q4_K with a fifth bit, and every piece but
the level readers is shared): their block views, chunk dequantisers, stream units (one row a unit;
the decode GEMV's half block of two rows), tensor-core pieces, and their rows of the quant-type
table.

Layout: the stored rows (a block is whole 16-byte pieces: d, dmin and the 12 scale bytes first,
then Q5_K's 32 fifth-bit bytes, then the 128 level bytes). Stream unit u: 32 level bytes (two
16-byte loads), with the block's first 16-byte piece and Q5_K's 32 fifth-bit bytes (k_nibble_unit);
the GEMV's unit half a block of two rows (k_half_unit).

Oracle: host.quants.dequantize_q4_k / q5_k (tests/test_quants_more.py's device chunks, bit for
bit); the units and tc pieces through the products (tests/test_quants_more.py, test_linear_tc.py,
tests/bounds.py's split terms).
"""

from __future__ import annotations

from numba import float32, uint32, uint64

from flashv41.host.quants import Q4_K_BLOCK, Q5_K_BLOCK, GGMLType, field_offset
from flashv41.stages.device import (
    CHUNK,
    address_at,
    bit_select,
    device,
    f16x2_f32,
    fp16_to_f32,
    inlined,
    load_words4,
    read_u16,
    row_address,
    words4_at,
)
from flashv41.stages.quants.records import ROW_ALIGN, WORD, StreamUnit, TcType, entry, padded_stored
from flashv41.stages.quants.units import (
    K_CHUNKS,
    K_VALUES,
    LOW_NIBBLES,
    SHIFT_HALF,
    U1,
    U2,
    U3,
    U4,
    U8,
    UINT8_LESS,
    bf16_int,
    chain16,
    dot16,
    field_at,
    field_dot16,
    field_magic,
    field_values16,
    halves8,
    levels16,
    pack,
    put_levels,
    run_inputs,
    sum16,
    uint8_at,
    x16_bf16,
    x16_f32,
)

Q4_K_BYTES = Q4_K_BLOCK.itemsize
Q4_K_D, Q4_K_DMIN = field_offset(Q4_K_BLOCK, "d"), field_offset(Q4_K_BLOCK, "dmin")
Q4_K_SCALES, Q4_K_QS = field_offset(Q4_K_BLOCK, "scales"), field_offset(Q4_K_BLOCK, "qs")
Q5_K_BYTES = Q5_K_BLOCK.itemsize
Q5_K_D, Q5_K_DMIN = field_offset(Q5_K_BLOCK, "d"), field_offset(Q5_K_BLOCK, "dmin")
Q5_K_SCALES, Q5_K_QH = field_offset(Q5_K_BLOCK, "scales"), field_offset(Q5_K_BLOCK, "qh")
Q5_K_QS = field_offset(Q5_K_BLOCK, "qs")
assert Q4_K_BLOCK["qs"].shape[0] == 4 * CHUNK and Q5_K_BLOCK["qh"].shape[0] == CHUNK


# Q4_K / Q5_K's word readers (their stream unit): a block is whole 16-byte pieces, the first d, dmin
# and the 12 scale bytes (words 1 .. 3), the levels (and Q5_K's fifth bits) starting on pieces; the
# masks pick fields out of every byte of a word at once.
Q4_K_WORDS, Q5_K_WORDS = Q4_K_BYTES // WORD, Q5_K_BYTES // WORD
Q4_K_QS_WORD, Q5_K_QS_WORD, Q5_K_QH_WORD = Q4_K_QS // WORD, Q5_K_QS // WORD, Q5_K_QH // WORD
K_UNIT_SHIFT = 6  # a unit: 32 level bytes, 64 values
LOW_SIX = uint32(0x3F3F3F3F)
TOP_PAIRS, LOW_BITS = uint32(0x30303030), uint32(0x01010101)  # bits 4-5, bit 0 of every byte
assert Q4_K_BYTES % ROW_ALIGN == 0 and Q5_K_BYTES % ROW_ALIGN == 0
assert Q4_K_QS % ROW_ALIGN == 0 and Q5_K_QS % ROW_ALIGN == 0 and Q5_K_QH % ROW_ALIGN == 0
assert (Q4_K_D, Q4_K_DMIN, Q4_K_SCALES) == (Q5_K_D, Q5_K_DMIN, Q5_K_SCALES) == (0, 2, WORD)
assert Q4_K_BLOCK["scales"].shape[0] == 3 * WORD and K_VALUES >> K_UNIT_SHIFT == 4  # a unit's block: u >> 2


# chunk dequantisers


@device
def k_scale_min(w, row, s, j):
    """Q4_K / Q5_K: the 6-bit scale and min of sub-block j from the 12 scale bytes at s
    (host.quants.k_scale_min)."""
    if j < 4:
        return uint32(w[row, s + j]) & 63, uint32(w[row, s + j + 4]) & 63
    packed = uint32(w[row, s + j + 4])
    return ((packed & 15) | ((uint32(w[row, s + j - 4]) >> 2) & 48),
            (packed >> 4) | ((uint32(w[row, s + j]) >> 2) & 48))


@device
def k_scaled_nibbles(w, row, chunk, out, block_bytes, d, dmin, scales, qs, qh):
    """Q4_K / Q5_K chunk j of a block (one sub-block): levels (qs[32 (j // 2) + i] >> 4 (j % 2)) & 15,
    with Q5_K's fifth bit (qh[i] >> j) & 1 (qh < 0: none), times the sub-block's scale, less its min."""
    base = (chunk // K_CHUNKS) * block_bytes
    j = chunk % K_CHUNKS
    sc, mn = k_scale_min(w, row, base + scales, j)
    scale = fp16_to_f32(read_u16(w, row, base + d)) * float32(sc)
    minimum = fp16_to_f32(read_u16(w, row, base + dmin)) * float32(mn)
    q0 = base + qs + (j // 2) * CHUNK
    shift = 4 * (j % 2)
    for i in range(CHUNK):
        q = (uint32(w[row, q0 + i]) >> shift) & 15
        if qh >= 0:
            q |= ((uint32(w[row, base + qh + i]) >> j) & 1) << 4
        out[i] = scale * float32(q) - minimum


@device
def dequant_q4_k(w, row, chunk, out):
    """Q4_K chunk `chunk` of a row: 4-bit levels."""
    k_scaled_nibbles(w, row, chunk, out, Q4_K_BYTES, Q4_K_D, Q4_K_DMIN, Q4_K_SCALES, Q4_K_QS, -1)


@device
def dequant_q5_k(w, row, chunk, out):
    """Q5_K chunk `chunk` of a row: Q4_K's levels with a fifth bit."""
    k_scaled_nibbles(w, row, chunk, out, Q5_K_BYTES, Q5_K_D, Q5_K_DMIN, Q5_K_SCALES, Q5_K_QS, Q5_K_QH)


# stream units


@inlined
def k_scale_words(s0, s1, s2, high):
    """Q4_K / Q5_K: the 6-bit scales and the 6-bit mins of sub-blocks 0 .. 3 (high false) or 4 .. 7,
    one a byte of two words, from the 12 scale bytes as words s0, s1, s2 (host.quants.k_scale_min a
    word at a time): those of 0 .. 3 are the low bits of s0's and s1's bytes; those of 4 .. 7 are
    s2's low and high nibbles, topped by the top pairs of s0's and s1's."""
    if high:
        return (s2 & LOW_NIBBLES) | ((s0 >> 2) & TOP_PAIRS), ((s2 >> 4) & LOW_NIBBLES) | ((s1 >> 2) & TOP_PAIRS)
    return s0 & LOW_SIX, s1 & LOW_SIX


@device
def k_unit_scales(ww, row, first, u):
    """Q4_K / Q5_K: the scales d sc and mins dmin m (float32) of unit u's sub-blocks 2 p and 2 p + 1
    (p = u % 4: k_nibble_unit) from the block at word `first`. Its first 16-byte piece is d and
    dmin (fp16, in word dw) and the scale words s0, s1, s2 (k_scale_words)."""
    dw, s0, s1, s2 = load_words4(ww, row, first)
    d, dmin = f16x2_f32(dw)
    sc, mn = k_scale_words(s0, s1, s2, u & U2)  # p >= 2: sub-blocks 4 .. 7
    b = (u & U1) << U1  # sub-block 2 p's byte of those words
    return d * uint8_at(sc, b), dmin * uint8_at(mn, b), d * uint8_at(sc, b + U1), dmin * uint8_at(mn, b + U1)


@device
def q4_k_levels(ww, row, first, u):
    """Q4_K unit u's levels, one a byte in 32-bit words: the low nibbles of its 32 level bytes
    qs[32 p ..] (two 16-byte loads) in eight words, then their high nibbles in eight."""
    o = first + uint64(Q4_K_QS_WORD) + U8 * (u & U3)
    w0, w1, w2, w3 = load_words4(ww, row, o)
    w4, w5, w6, w7 = load_words4(ww, row, o + U4)
    return (w0 & LOW_NIBBLES, w1 & LOW_NIBBLES, w2 & LOW_NIBBLES, w3 & LOW_NIBBLES,
            w4 & LOW_NIBBLES, w5 & LOW_NIBBLES, w6 & LOW_NIBBLES, w7 & LOW_NIBBLES,
            (w0 >> 4) & LOW_NIBBLES, (w1 >> 4) & LOW_NIBBLES, (w2 >> 4) & LOW_NIBBLES, (w3 >> 4) & LOW_NIBBLES,
            (w4 >> 4) & LOW_NIBBLES, (w5 >> 4) & LOW_NIBBLES, (w6 >> 4) & LOW_NIBBLES, (w7 >> 4) & LOW_NIBBLES)


@device
def fifth_bits(levels, qh, j):
    """Four levels, one a byte, with bit j of the four bytes of qh as their bit 4."""
    return levels | (((qh >> j) & LOW_BITS) << 4)


@device
def q5_k_levels(ww, row, first, u):
    """Q5_K unit u's levels: Q4_K's nibbles with their fifth bits, bit 2 p (low nibbles) and 2 p + 1
    (high) of the block's 32 qh bytes (bit j of qh[i] is value 32 j + i's; two more 16-byte loads)."""
    o = first + uint64(Q5_K_QS_WORD) + U8 * (u & U3)
    w0, w1, w2, w3 = load_words4(ww, row, o)
    w4, w5, w6, w7 = load_words4(ww, row, o + U4)
    q0, q1, q2, q3 = load_words4(ww, row, first + uint64(Q5_K_QH_WORD))
    q4, q5, q6, q7 = load_words4(ww, row, first + uint64(Q5_K_QH_WORD) + U4)
    j = (u & U3) << U1  # 2 p
    h = j + U1
    return (fifth_bits(w0 & LOW_NIBBLES, q0, j), fifth_bits(w1 & LOW_NIBBLES, q1, j),
            fifth_bits(w2 & LOW_NIBBLES, q2, j), fifth_bits(w3 & LOW_NIBBLES, q3, j),
            fifth_bits(w4 & LOW_NIBBLES, q4, j), fifth_bits(w5 & LOW_NIBBLES, q5, j),
            fifth_bits(w6 & LOW_NIBBLES, q6, j), fifth_bits(w7 & LOW_NIBBLES, q7, j),
            fifth_bits((w0 >> 4) & LOW_NIBBLES, q0, h), fifth_bits((w1 >> 4) & LOW_NIBBLES, q1, h),
            fifth_bits((w2 >> 4) & LOW_NIBBLES, q2, h), fifth_bits((w3 >> 4) & LOW_NIBBLES, q3, h),
            fifth_bits((w4 >> 4) & LOW_NIBBLES, q4, h), fifth_bits((w5 >> 4) & LOW_NIBBLES, q5, h),
            fifth_bits((w6 >> 4) & LOW_NIBBLES, q6, h), fifth_bits((w7 >> 4) & LOW_NIBBLES, q7, h))


def k_nibble_unit(block_words: int, levels):
    """The Q4_K / Q5_K stream unit of one row (the partial-sum products), blocks of `block_words`
    words whose levels `levels` reads (q4_k_levels, q5_k_levels). Unit u (StreamUnit shift
    K_UNIT_SHIFT) is the 32 level bytes qs[32 p .. 32 p + 31] of block u // 4 (p = u % 4): their
    low nibbles are the block's values 64 p .. 64 p + 31 (sub-block 2 p), their high nibbles the 32
    after (2 p + 1). The mins are folded in as in q2_k_unit, d sc * sum(q x) - dmin m * sum(x) per
    16 values, so a value enters as its two parts (tests/bounds.py's split terms); levels become
    floats by the exponent trick (uint8_at), once for all the tokens."""
    def make(tokens: int, x_bf16: bool):
        x16 = x16_bf16 if x_bf16 else x16_f32

        @device
        def group(x32, xo, g, n_tokens, acc, a, scale, minimum):
            """Sixteen values of the row, levels a in four words, times every token's inputs
            16 g .. 16 g + 15, into acc[t]."""
            q = levels16(a)
            for t in range(tokens):
                if t < n_tokens:
                    xs = x16(x32, t, xo, g)
                    acc[t] += scale * dot16(q, xs) - minimum * sum16(xs)

        @device
        def k_nibble_unit(ww, wf, row, x32, xo, k, n_tokens, acc, u):
            first = uint64(block_words) * (u >> U2)
            la = levels(ww, row, first, u)
            sa = k_unit_scales(ww, row, first, u)
            g = U4 * u  # the inputs of sub-block 2 p are 16 g .. 16 g + 31, those of 2 p + 1 the 32 after
            group(x32, xo, g, n_tokens, acc, la[0:4], sa[0], sa[1])
            group(x32, xo, g + U1, n_tokens, acc, la[4:8], sa[0], sa[1])
            group(x32, xo, g + U2, n_tokens, acc, la[8:12], sa[2], sa[3])
            group(x32, xo, g + U3, n_tokens, acc, la[12:], sa[2], sa[3])

        return k_nibble_unit

    return make


# Q4_K / Q5_K's GEMV unit: half a block (128 values, sub-blocks 4 h .. 4 h + 3 of block i // 2,
# h = i % 2) of two rows. A level is a bit field of a word as loaded (field_at), never shifted to
# bit 0 first: the nibble of sub-block 4 h + s, in Q4_K the low (s even) or high (s odd) nibble
# of the level bytes 64 h + 32 (s // 2) ..; Q5_K moves its nibble to bits s .. s + 3 of each byte
# (one shift, none for s = 0) and merges the fifth bit in above it, at bit s + 4, from the qh word
# shifted so that its bits 4 h .. 4 h + 3 are 4 .. 7 (bit 4 h + s at 4 + s: in place). Bytes 0
# and 1 are fields of the word, bytes 2 and 3 of it shifted down 16 bits (halves8).
K_HALF_SHIFT = 7  # a unit: 128 values
Q4_K_LOW_FIELDS = (uint32(0x0F), uint32(0x0F00), field_magic(0), field_magic(8))  # bytes 0, 1's low nibbles
Q4_K_HIGH_FIELDS = (uint32(0xF0), uint32(0xF000), field_magic(4), field_magic(12))
Q4_K_FIELDS = (Q4_K_LOW_FIELDS, Q4_K_HIGH_FIELDS, Q4_K_LOW_FIELDS, Q4_K_HIGH_FIELDS)  # of sub-block 4 h + s
Q5_K_FIELDS = tuple((uint32(0x1F << s), uint32(0x1F << (8 + s)), field_magic(s), field_magic(8 + s)) for s in range(4))
Q5_K_FIFTHS = tuple(uint32(0x10101010 << s) for s in range(4))  # bit s + 4
Q5_K_DOWN, Q5_K_UP = (0, 3, 0, 1), (0, 0, 2, 0)  # the shifts taking sub-block s's nibble to bit s
SIX_FIELDS = (uint32(0x3F), uint32(0x3F00), field_magic(0), field_magic(8))  # bytes 0, 1's 6-bit scales
assert all(4 * (s % 2) - Q5_K_DOWN[s] + Q5_K_UP[s] == s for s in range(4))


@device
def k_half_scales(dw, s0, s1, s2, h):
    """Half h's d sc and dmin m of its four sub-blocks (float32, exact: an fp16 times 6 bits),
    from the block's first 16-byte piece (d, dmin in dw, the scale words: k_scale_words), the two
    halves' scale words picked without a branch."""
    d, dmin = f16x2_f32(dw)
    sc, mn = k_scale_words(s0, s1, s2, False)
    sc1, mn1 = k_scale_words(s0, s1, s2, True)
    pick = h * uint32(0xFFFFFFFF)  # every bit set for h = 1
    sc, mn = bit_select(sc, sc1, pick), bit_select(mn, mn1, pick)
    lo, hi, lo_magic, hi_magic = SIX_FIELDS
    sc2, mn2 = sc >> SHIFT_HALF, mn >> SHIFT_HALF
    scaled = (d * field_at(sc, lo, lo_magic), d * field_at(sc, hi, hi_magic),
              d * field_at(sc2, lo, lo_magic), d * field_at(sc2, hi, hi_magic))
    mins = (dmin * field_at(mn, lo, lo_magic), dmin * field_at(mn, hi, hi_magic),
            dmin * field_at(mn2, lo, lo_magic), dmin * field_at(mn2, hi, hi_magic))
    return scaled, mins


@device
def q4_k_half(address, i):
    """One row's part of Q4_K GEMV unit i (loads, and what every token shares): per sub-block s of
    the half and 16-value group g, entry 2 s + g, the words of its nibbles (halves8); the d sc and
    dmin m (k_half_scales). The level bytes of sub-blocks 4 h, 4 h + 1 are qs[64 h .. 64 h + 31],
    those of 4 h + 2, 4 h + 3 the 32 after."""
    block = address_at(address, (i >> uint32(1)) * uint32(Q4_K_BYTES))
    h = i & uint32(1)
    dw, s0, s1, s2 = words4_at(block, uint32(0))
    qs = address_at(block, uint32(Q4_K_QS) + (h << uint32(6)))
    a0, a1, a2, a3 = words4_at(qs, uint32(0))
    a4, a5, a6, a7 = words4_at(qs, uint32(16))
    b0, b1, b2, b3 = words4_at(qs, uint32(32))
    b4, b5, b6, b7 = words4_at(qs, uint32(48))
    c0, c1 = halves8(a0, a1, a2, a3), halves8(a4, a5, a6, a7)
    e0, e1 = halves8(b0, b1, b2, b3), halves8(b4, b5, b6, b7)
    scaled, mins = k_half_scales(dw, s0, s1, s2, h)
    return (c0, c1, c0, c1, e0, e1, e0, e1), scaled, mins


@device
def q5_k_fifth(w0, w1, w2, w3, q0, q1, q2, q3, s):
    """Sub-block 4 h + s's 5-bit levels in four words (halves8): level words w shifted to put the
    nibble at bits s .. s + 3 of each byte, bit s + 4 taken from the aligned qh words q (one
    bit_select each; the bits around the field are field_at's to drop)."""
    down, up, fifths = uint32(Q5_K_DOWN[s]), uint32(Q5_K_UP[s]), Q5_K_FIFTHS[s]
    w0, w1, w2, w3 = (w0 >> down) << up, (w1 >> down) << up, (w2 >> down) << up, (w3 >> down) << up
    return halves8(bit_select(w0, q0, fifths), bit_select(w1, q1, fifths), bit_select(w2, q2, fifths),
                   bit_select(w3, q3, fifths))


@device
def q5_k_half(address, i):
    """q4_k_half for Q5_K: the levels' fifth bits are bit 4 h + s of the block's 32 qh bytes (two
    more 16-byte loads, qh[j] the fifth bits of the level bytes j of both sub-block pairs)."""
    block = address_at(address, (i >> uint32(1)) * uint32(Q5_K_BYTES))
    h = i & uint32(1)
    dw, s0, s1, s2 = words4_at(block, uint32(0))
    q0, q1, q2, q3 = words4_at(block, uint32(Q5_K_QH))
    q4, q5, q6, q7 = words4_at(block, uint32(Q5_K_QH + 16))
    qs = address_at(block, uint32(Q5_K_QS) + (h << uint32(6)))
    a0, a1, a2, a3 = words4_at(qs, uint32(0))
    a4, a5, a6, a7 = words4_at(qs, uint32(16))
    b0, b1, b2, b3 = words4_at(qs, uint32(32))
    b4, b5, b6, b7 = words4_at(qs, uint32(48))
    lift = (uint32(1) - h) << uint32(2)  # bits 4 h .. 4 h + 3 of each qh byte to 4 .. 7
    q0, q1, q2, q3, q4, q5, q6, q7 = q0 << lift, q1 << lift, q2 << lift, q3 << lift, q4 << lift, q5 << lift, \
        q6 << lift, q7 << lift
    levels = (q5_k_fifth(a0, a1, a2, a3, q0, q1, q2, q3, 0), q5_k_fifth(a4, a5, a6, a7, q4, q5, q6, q7, 0),
              q5_k_fifth(a0, a1, a2, a3, q0, q1, q2, q3, 1), q5_k_fifth(a4, a5, a6, a7, q4, q5, q6, q7, 1),
              q5_k_fifth(b0, b1, b2, b3, q0, q1, q2, q3, 2), q5_k_fifth(b4, b5, b6, b7, q4, q5, q6, q7, 2),
              q5_k_fifth(b0, b1, b2, b3, q0, q1, q2, q3, 3), q5_k_fifth(b4, b5, b6, b7, q4, q5, q6, q7, 3))
    scaled, mins = k_half_scales(dw, s0, s1, s2, h)
    return levels, scaled, mins


def k_half_unit(half, fields):
    """The Q4_K / Q5_K GEMV unit: half a block of two rows (StreamUnit shift K_HALF_SHIFT), each
    row's part read by `half` (q4_k_half, q5_k_half), its sub-block s's levels the fields
    fields[s] (Q4_K_FIELDS, Q5_K_FIELDS); the inputs read, unpacked and summed once for both rows.
    Per row and 16-value group, d sc (sum of level x input) - dmin m (sum of inputs): a value's two
    parts, as in q2_k_unit (tests/bounds.py's split terms). Every load is at a constant offset from
    a block's, a quant half's or a token's inputs' address (address_at); no branch (the second row
    of the last group is a real one, clamped; token slots past n_tokens read the last live token's
    inputs; the kernel stores neither's sums)."""
    def make(tokens: int, x_bf16: bool):
        inputs, run_shift = run_inputs(x_bf16)

        @device
        def add_token(xs, s, dot_a, dot_b, a, b, acc, t):
            """Token t's sums of sub-block s's group (the groups' dots given: inputs xs)."""
            sx = sum16(xs)
            acc[t] += a[1][s] * dot_a
            acc[t] -= a[2][s] * sx
            acc[tokens + t] += b[1][s] * dot_b
            acc[tokens + t] -= b[2][s] * sx

        @device
        def add_group(x32, xb, n_tokens, s, g, a, b, acc):
            """Group g of sub-block s: its levels made floats once for all the tokens, token 0's
            dots taking them as they are made (so at one token each dies at once)."""
            f = fields[s]
            wa, wb = a[0][2 * s + g], b[0][2 * s + g]
            xs = inputs(x32, xb, n_tokens, 2 * s + g, 0)
            add_token(xs, s, field_dot16(wa, f, xs), field_dot16(wb, f, xs), a, b, acc, 0)
            qa, qb = field_values16(wa, f), field_values16(wb, f)  # (on a GPU, the same values: computed once)
            for t in range(1, tokens):
                xs = inputs(x32, xb, n_tokens, 2 * s + g, t)
                add_token(xs, s, chain16(qa, xs), chain16(qb, xs), a, b, acc, t)

        @device
        def k_half_unit(ww, wf, row, x32, xo, k, n_tokens, acc, u):
            i = uint32(u)
            a = half(row_address(ww, row), i)
            b = half(row_address(ww, min(row + 1, ww.shape[0] - 1)), i)
            xb = uint32((uint32(xo) << uint32(2)) + (i << (run_shift + uint32(3))))  # its inputs: 8 runs of 16
            add_group(x32, xb, n_tokens, 0, 0, a, b, acc)
            add_group(x32, xb, n_tokens, 0, 1, a, b, acc)
            add_group(x32, xb, n_tokens, 1, 0, a, b, acc)
            add_group(x32, xb, n_tokens, 1, 1, a, b, acc)
            add_group(x32, xb, n_tokens, 2, 0, a, b, acc)
            add_group(x32, xb, n_tokens, 2, 1, a, b, acc)
            add_group(x32, xb, n_tokens, 3, 0, a, b, acc)
            add_group(x32, xb, n_tokens, 3, 1, a, b, acc)

        return k_half_unit

    return make


def k_nibble_stream(block_words: int, levels, half, fields) -> tuple[StreamUnit, StreamUnit]:
    """Q4_K / Q5_K's stream units: one row a unit, two in flight (the partial-sum products,
    k_nibble_unit), and the GEMV's half block of two rows, one in flight (k_half_unit)."""
    return (StreamUnit(k_nibble_unit(block_words, levels), K_UNIT_SHIFT, 2),
            StreamUnit(k_half_unit(half, fields), K_HALF_SHIFT, 1, rows=2))


# Q4_K / Q5_K: a step is one 32-value sub-block j, its levels nibble j % 2 of qs[32 (j // 2) + i]
# (Q5_K: bit j of qh[i] above it). The integer level enters; d sc_j is the step's scale and dmin the
# block's, its mins m_j taken away at its end as Q2_K's are (both 16-value groups of sub-block j
# with m_j): the fetch of the scales is the block's first 16-byte piece, d and dmin and the 12
# scale bytes (k_scale_words).

@device
def fetch_q4_k(w32, w16, n, ks, c, k):
    b, j = ks // K_CHUNKS, ks % K_CHUNKS
    return w32[n, Q4_K_WORDS * b + Q4_K_QS_WORD + (CHUNK // WORD) * (j // 2) + c], uint32(0)


@device
def put_q4_k(b_s, r, c, word, aux, ks):
    put_levels(b_s, r, c, (word >> (4 * (ks % 2))) & LOW_NIBBLES, UINT8_LESS)


@device
def fetch_q5_k(w32, w16, n, ks, c, k):
    b, j = ks // K_CHUNKS, ks % K_CHUNKS
    return (w32[n, Q5_K_WORDS * b + Q5_K_QS_WORD + (CHUNK // WORD) * (j // 2) + c],
            w32[n, Q5_K_WORDS * b + Q5_K_QH_WORD + c])


@device
def put_q5_k(b_s, r, c, word, aux, ks):
    j = ks % K_CHUNKS
    put_levels(b_s, r, c, fifth_bits((word >> (4 * (j % 2))) & LOW_NIBBLES, aux, j), UINT8_LESS)


@device
def put_scales_k_nibble(d_s, m_s, mins_s, r, ks, s0, s1, s2, s3):
    """d sc_j, dmin and m_j (twice: the mins' mma takes one a 16-value group) from d and dmin in s0,
    the scale words in s1 .. s3."""
    j = ks % K_CHUNKS
    sc, mn = k_scale_words(s1, s2, s3, j >= 4)
    d, dmin = f16x2_f32(s0)
    d_s[0, r] = d * uint8_at(sc, j % 4)
    m_s[r] = dmin
    m = bf16_int(uint8_at(mn, j % 4))
    mins_s[r, j] = pack(m, m)


def k_nibble_tc(block_words: int, fetch, put) -> TcType:
    """Q4_K's / Q5_K's tc pieces, for blocks of `block_words` words whose levels fetch and put read."""
    @device
    def fetch_scales_k_nibble(w32, w16, n, ks, k):
        return load_words4(w32, n, block_words * (ks // K_CHUNKS))

    return TcType(fetch, put, fetch_scales_k_nibble, put_scales_k_nibble, CHUNK // WORD, True)


Q4_K_STREAM, Q4_K_GEMV = k_nibble_stream(Q4_K_WORDS, q4_k_levels, q4_k_half, Q4_K_FIELDS)
Q5_K_STREAM, Q5_K_GEMV = k_nibble_stream(Q5_K_WORDS, q5_k_levels, q5_k_half, Q5_K_FIELDS)
ENTRIES = [
    entry(GGMLType.Q4_K, dequant_q4_k, Q4_K_STREAM, k_nibble_tc(Q4_K_WORDS, fetch_q4_k, put_q4_k),
          weight_rows=padded_stored, gemv=Q4_K_GEMV),
    entry(GGMLType.Q5_K, dequant_q5_k, Q5_K_STREAM, k_nibble_tc(Q5_K_WORDS, fetch_q5_k, put_q5_k),
          weight_rows=padded_stored, gemv=Q5_K_GEMV),
]
