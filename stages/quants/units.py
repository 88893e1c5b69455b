"""The device pieces that several quant families share: the exponent tricks that turn integers into
floats without conversions (`small_int`, `byte_less`, `int8_at`, `uint8_at`, `field_at`,
`field_less`), the stream units' input readers (16-byte loads of bf16 or fp32 inputs), the dot
products over sixteen values, the generic chunk unit, and the tensor-core pieces' signatures and
shared helpers. A family's own pieces are in its module (stages.quants.q8_0, ...).

Oracle: none of its own; each piece is held through the units and tc pieces that use it, against
host.quants.dequantize and the products' oracle (tests/test_linear.py, test_linear_tc.py,
tests/test_quants_more.py).
"""

from __future__ import annotations

import numpy as np
from numba import cuda, float32, int64, uint32, uint64

from flashv41.host.quants import BF16_BLOCK, F16_BLOCK, F32_BLOCK, FORMATS, GGMLType
from flashv41.stages.device import (
    CHUNK,
    SIM,
    address_at,
    and_or,
    byte_perm,
    device,
    f32_bits,
    f32_from_bits,
    load_words4,
    row_address,
    words4_at,
)
from flashv41.stages.quants.records import StreamUnit

F32_BYTES, F16_BYTES, BF16_BYTES = F32_BLOCK.itemsize, F16_BLOCK.itemsize, BF16_BLOCK.itemsize


# uint64 indices: Numba wraps negative signed indices and floors signed divisions, a few
# instructions per access that an unsigned index does not need
U1, U2, U3, U4, U8 = uint64(1), uint64(2), uint64(3), uint64(4), uint64(8)
TWO_112 = float32(2.0**112)  # fp16's exponent bias (15) against fp32's (127)
INT8_MAGIC = uint32(0x4B000000)  # 2^23: a byte in its low mantissa bits reads as 2^23 + byte
INT8_SELECT = uint32(0x7540)  # byte_perm selector: the magic's bytes above byte 0, which the caller picks


# A K-quant block (Q2_K .. Q6_K) is K_CHUNKS chunks, each two 16-value (Q2_K, Q3_K, Q6_K) or one 32-value
# (Q4_K, Q5_K) sub-blocks.
K_VALUES = FORMATS[GGMLType.Q4_K].block_values
K_CHUNKS = K_VALUES // CHUNK
assert all(FORMATS[t].block_values == K_VALUES for t in (GGMLType.Q3_K, GGMLType.Q5_K, GGMLType.Q6_K))
LOW_NIBBLES = uint32(0x0F0F0F0F)  # the low nibble of every byte


# stream-unit helpers


if SIM:
    # the simulator runs these as Python for every value the stream kernel reads: table lookups
    # and plain conversions there, the same values as the GPU's bit tricks
    from flashv41.stages.device import _BF16_VALUES

    _F16_VALUES = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)

    def bf16_pair(word):
        w = int(word)
        return _BF16_VALUES[w & 0xFFFF], _BF16_VALUES[w >> 16]

    def f16_pair(word):
        w = int(word)
        return _F16_VALUES[w & 0xFFFF], _F16_VALUES[w >> 16]

    def small_int(bits):
        return np.float32(int(bits))

    def bytes_less_table(magic):
        """byte_less's value for each of the 256 bytes: the float32 sums the GPU's trick forms, each exact."""
        return (np.arange(256, dtype=np.float32) + np.float32(8388608)) - np.float32(magic)

    _BYTES_LESS: dict = {}  # magic -> bytes_less_table(magic), worked out once a magic

    def byte_less(word, byte, magic):
        table = _BYTES_LESS.get(magic)
        if table is None:
            table = _BYTES_LESS[magic] = bytes_less_table(magic)
        return table[(int(word) >> (8 * int(byte))) & 0xFF]

    def f32x4(x32, t, o):
        """Four fp32 inputs x[t, o .. o + 3] of the 32-bit-word view (o a multiple of 4)."""
        return tuple(np.asarray(x32[t, o:o + 4]).view(np.float32))

    def bf16x4(x32, t, o):
        """Four bf16 inputs, the pairs in words o and o + 1."""
        x0, x1 = bf16_pair(x32[t, o])
        x2, x3 = bf16_pair(x32[t, o + 1])
        return x0, x1, x2, x3
else:
    @device
    def bf16_pair(word):
        """The two bf16 values packed in a 32-bit word (low half first) as float32."""
        return f32_from_bits(word << 16), f32_from_bits(word & 0xFFFF0000)

    @device
    def f16_half(h):
        """An fp16 pattern (low 16 bits of h) as float32: its exponent and mantissa placed in an fp32
        pattern give the value times 2^-112 exactly (fp16 subnormals become fp32 subnormals), then
        one multiplication; infinities and NaNs get the all-ones exponent first."""
        mag = h & 0x7FFF
        bits = ((h & 0x8000) << 16) | (mag << 13) | (uint32(0x7F800000) if mag >= 0x7C00 else uint32(0))
        return f32_from_bits(bits) * TWO_112

    @device
    def f16_pair(word):
        """The two fp16 values packed in a 32-bit word (low half first) as float32."""
        return f16_half(word & 0xFFFF), f16_half(word >> 16)

    @device
    def small_int(bits):
        """An integer 0 <= bits < 2^23 as float32, exactly: placed in the mantissa of 2^23 and the 2^23
        taken away: two full-rate instructions, where integer-to-float conversion has a lower rate."""
        return f32_from_bits(0x4B000000 | bits) - float32(8388608.0)

    @device
    def byte_less(word, byte, magic):
        """Byte `byte` of a 32-bit word less an offset o, in float32, exactly, given magic = 2^23 + o:
        one byte permute puts the byte under the exponent of 2^23 (bytes 4, 5, 7 of the pair are
        0x4B000000's), one subtraction: two full-rate instructions, no int-to-float conversion."""
        return f32_from_bits(byte_perm(word, INT8_MAGIC, INT8_SELECT | byte)) - magic

    @device
    def f32x4(x32, t, o):
        """Four fp32 inputs x[t, o .. o + 3] of the 32-bit-word view, one 16-byte load (o a multiple of 4)."""
        a0, a1, a2, a3 = load_words4(x32, t, o)
        return f32_from_bits(a0), f32_from_bits(a1), f32_from_bits(a2), f32_from_bits(a3)

    @device
    def bf16x4(x32, t, o):
        """Four bf16 inputs, the pairs in words o and o + 1."""
        x0, x1 = bf16_pair(x32[t, o])
        x2, x3 = bf16_pair(x32[t, o + U1])
        return x0, x1, x2, x3


INT8_LESS = float32(8388736.0)  # 2^23 + 128: int8_at's magic
UINT8_LESS = float32(8388608.0)  # 2^23: uint8_at's


@device
def int8_at(flipped, byte):
    """Byte `byte` of a 32-bit word as a signed int8 value q, in float32, given the word with every
    byte's top bit flipped (each byte then holds q + 128): byte_less of 128."""
    return byte_less(flipped, byte, INT8_LESS)


@device
def uint8_at(word, byte):
    """Byte `byte` of a 32-bit word (0 .. 255) as float32: byte_less of nothing."""
    return byte_less(word, byte, UINT8_LESS)


if SIM:  # the simulator's int8_at: byte_less's table for its magic, without the lookup by magic
    _INT8_VALUES = bytes_less_table(INT8_LESS)

    def int8_at(flipped, byte):  # noqa: F811 (the simulator's form of the one above)
        return _INT8_VALUES[(int(flipped) >> (8 * int(byte))) & 0xFF]


# Input readers, one signature: (x32, t, xo, v) -> the inputs v, v + 1, ... of token t's slice
# starting at input word xo (v a multiple of their count): 16-byte loads where the words allow.

@device
def x8_bf16(x32, t, xo, v):
    """Eight bf16 inputs: one 16-byte load."""
    a0, a1, a2, a3 = load_words4(x32, t, xo + (v >> U1))
    x0, x1 = bf16_pair(a0)
    x2, x3 = bf16_pair(a1)
    x4, x5 = bf16_pair(a2)
    x6, x7 = bf16_pair(a3)
    return x0, x1, x2, x3, x4, x5, x6, x7


@device
def x8_f32(x32, t, xo, v):
    """Eight fp32 inputs: two 16-byte loads."""
    x0, x1, x2, x3 = f32x4(x32, t, xo + v)
    x4, x5, x6, x7 = f32x4(x32, t, xo + v + U4)
    return x0, x1, x2, x3, x4, x5, x6, x7


@device
def x4_bf16(x32, t, xo, v):
    """Four bf16 inputs: two word loads (8 bytes need not be 16-byte aligned)."""
    return bf16x4(x32, t, xo + (v >> U1))


@device
def x4_f32(x32, t, xo, v):
    """Four fp32 inputs: one 16-byte load."""
    return f32x4(x32, t, xo + v)


@device
def bf16x16(a0, a1, a2, a3, b0, b1, b2, b3):
    """The sixteen bf16 values of eight words (low half first) as float32."""
    x0, x1 = bf16_pair(a0)
    x2, x3 = bf16_pair(a1)
    x4, x5 = bf16_pair(a2)
    x6, x7 = bf16_pair(a3)
    x8, x9 = bf16_pair(b0)
    x10, x11 = bf16_pair(b1)
    x12, x13 = bf16_pair(b2)
    x14, x15 = bf16_pair(b3)
    return x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15


@device
def x16_bf16(x32, t, xo, u):
    """Sixteen bf16 inputs 16 u .. 16 u + 15: two 16-byte loads."""
    a0, a1, a2, a3 = load_words4(x32, t, xo + U8 * u)
    b0, b1, b2, b3 = load_words4(x32, t, xo + U8 * u + U4)
    return bf16x16(a0, a1, a2, a3, b0, b1, b2, b3)


@device
def x16_f32(x32, t, xo, u):
    """Sixteen fp32 inputs 16 u .. 16 u + 15: four 16-byte loads."""
    o = xo + uint64(16) * u
    x0, x1, x2, x3 = f32x4(x32, t, o)
    x4, x5, x6, x7 = f32x4(x32, t, o + U4)
    x8, x9, x10, x11 = f32x4(x32, t, o + U8)
    x12, x13, x14, x15 = f32x4(x32, t, o + uint64(12))
    return x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15


@device
def x16_bf16_at(x, xo, u):
    """Sixteen bf16 inputs 16 u .. 16 u + 15 of a token's row_address whose slice starts at byte
    xo: two 16-byte loads."""
    o = uint32(xo + (u << uint32(5)))
    a0, a1, a2, a3 = words4_at(x, o)
    b0, b1, b2, b3 = words4_at(x, uint32(o + uint32(16)))
    return bf16x16(a0, a1, a2, a3, b0, b1, b2, b3)


@device
def f32x4_at(x, o):
    """Four fp32 inputs at byte o of a token's row_address: one 16-byte load (f32x4's twin)."""
    a0, a1, a2, a3 = words4_at(x, o)
    return f32_from_bits(a0), f32_from_bits(a1), f32_from_bits(a2), f32_from_bits(a3)


@device
def x16_f32_at(x, xo, u):
    """Sixteen fp32 inputs 16 u .. 16 u + 15 of a token's row_address whose slice starts at byte
    xo: four 16-byte loads."""
    o = uint32(xo + (u << uint32(6)))
    x0, x1, x2, x3 = f32x4_at(x, o)
    x4, x5, x6, x7 = f32x4_at(x, uint32(o + uint32(16)))
    x8, x9, x10, x11 = f32x4_at(x, uint32(o + uint32(32)))
    x12, x13, x14, x15 = f32x4_at(x, uint32(o + uint32(48)))
    return x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15


def field_magic(p: int):
    """The fp32 bits of 2^(23 - p): a field whose lowest bit is p (its top bit under 23) or-ed into
    them reads as 2^(23 - p) + the field (field_at)."""
    return uint32((150 - p) << 23)


SHIFT_HALF = uint32(16)


@device
def field_less(word, mask, magic, less):
    """The bit field word & mask as float32 less an offset o, exactly, given magic =
    field_magic(its lowest bit) and less = 2^(23 - p) + o: one and-or, one subtraction."""
    return f32_from_bits(and_or(word, mask, magic)) - less


@device
def field_at(word, mask, magic):
    """The bit field word & mask as float32, exactly, given magic = field_magic(its lowest bit): one
    and-or, one subtraction (2^(23 - p) + field - 2^(23 - p); field_less with no offset, written
    out: through field_less ptxas schedules Q2_K's fp32-input unit worse)."""
    return f32_from_bits(and_or(word, mask, magic)) - f32_from_bits(magic)


@device
def halves8(w0, w1, w2, w3):
    """Four words, then the same shifted down 16 bits: bytes 2 and 3 where fields fit a float's
    mantissa (field_dot16's words)."""
    return (w0, w1, w2, w3, w0 >> SHIFT_HALF, w1 >> SHIFT_HALF, w2 >> SHIFT_HALF, w3 >> SHIFT_HALF)


@device
def field_values16(words, fields):
    """Sixteen levels as float32, bit fields of eight words (entry 4 m + c: byte c of word m, bytes
    0 and 1 in word m, bytes 2 and 3 in word m + 4, the same word shifted down 16 bits). fields:
    the masks of byte 0's and byte 1's field and their field_magic's."""
    lo, hi, lo_magic, hi_magic = fields
    w0, w1, w2, w3, t0, t1, t2, t3 = words
    return (field_at(w0, lo, lo_magic), field_at(w0, hi, hi_magic), field_at(t0, lo, lo_magic),
            field_at(t0, hi, hi_magic), field_at(w1, lo, lo_magic), field_at(w1, hi, hi_magic),
            field_at(t1, lo, lo_magic), field_at(t1, hi, hi_magic), field_at(w2, lo, lo_magic),
            field_at(w2, hi, hi_magic), field_at(t2, lo, lo_magic), field_at(t2, hi, hi_magic),
            field_at(w3, lo, lo_magic), field_at(w3, hi, hi_magic), field_at(t3, lo, lo_magic),
            field_at(t3, hi, hi_magic))


@device
def chain16(vs, xs):
    """Sixteen values times sixteen inputs in one chain (one multiplication, fifteen FMAs)."""
    return (vs[0] * xs[0] + vs[1] * xs[1] + vs[2] * xs[2] + vs[3] * xs[3] + vs[4] * xs[4] + vs[5] * xs[5]
            + vs[6] * xs[6] + vs[7] * xs[7] + vs[8] * xs[8] + vs[9] * xs[9] + vs[10] * xs[10] + vs[11] * xs[11]
            + vs[12] * xs[12] + vs[13] * xs[13] + vs[14] * xs[14] + vs[15] * xs[15])


@device
def field_dot16(words, fields, xs):
    """chain16 of field_values16 and sixteen inputs, every product exact, each level made as the
    chain takes it (so at most a few are live at once)."""
    lo, hi, lo_magic, hi_magic = fields
    w0, w1, w2, w3, t0, t1, t2, t3 = words
    return (field_at(w0, lo, lo_magic) * xs[0] + field_at(w0, hi, hi_magic) * xs[1]
            + field_at(t0, lo, lo_magic) * xs[2] + field_at(t0, hi, hi_magic) * xs[3]
            + field_at(w1, lo, lo_magic) * xs[4] + field_at(w1, hi, hi_magic) * xs[5]
            + field_at(t1, lo, lo_magic) * xs[6] + field_at(t1, hi, hi_magic) * xs[7]
            + field_at(w2, lo, lo_magic) * xs[8] + field_at(w2, hi, hi_magic) * xs[9]
            + field_at(t2, lo, lo_magic) * xs[10] + field_at(t2, hi, hi_magic) * xs[11]
            + field_at(w3, lo, lo_magic) * xs[12] + field_at(w3, hi, hi_magic) * xs[13]
            + field_at(t3, lo, lo_magic) * xs[14] + field_at(t3, hi, hi_magic) * xs[15])


# The split Q6_K and Q3_K units. Unit u is 64 values of block u // 4: in half h = (u // 2) % 2,
# positions i = 16 (u % 2) .. + 15 of its 32, the values 128 h + 32 s + i of rows s < 4 (sub-block
# 8 h + 2 s + u % 2). Byte b of word m of a 16-byte load is position 16 (u % 2) + 4 m + b: a row's
# levels are built four at a time on whole words, each level enters as one exact small integer
# (byte_less), and each row's scale is decoded once. The rows are four calls with s a literal (a
# loop over s stays a loop in the PTX, its shifts and word choices decided at run time).


@device
def bytes_less16(w0, w1, w2, w3, magic):
    """The sixteen bytes of four words (entry 4 m + b: byte b of word m), each less o (byte_less)."""
    return (byte_less(w0, 0, magic), byte_less(w0, 1, magic), byte_less(w0, 2, magic), byte_less(w0, 3, magic),
            byte_less(w1, 0, magic), byte_less(w1, 1, magic), byte_less(w1, 2, magic), byte_less(w1, 3, magic),
            byte_less(w2, 0, magic), byte_less(w2, 1, magic), byte_less(w2, 2, magic), byte_less(w2, 3, magic),
            byte_less(w3, 0, magic), byte_less(w3, 1, magic), byte_less(w3, 2, magic), byte_less(w3, 3, magic))


@device
def dot16(vs, xs):
    """Sixteen values times sixteen inputs, summed in four runs of four."""
    return ((vs[0] * xs[0] + vs[1] * xs[1] + vs[2] * xs[2] + vs[3] * xs[3])
            + (vs[4] * xs[4] + vs[5] * xs[5] + vs[6] * xs[6] + vs[7] * xs[7])
            + (vs[8] * xs[8] + vs[9] * xs[9] + vs[10] * xs[10] + vs[11] * xs[11])
            + (vs[12] * xs[12] + vs[13] * xs[13] + vs[14] * xs[14] + vs[15] * xs[15]))


def row_adder(tokens: int, x_bf16: bool):
    """acc[t] += scale * (sixteen levels . inputs 16 v .. 16 v + 15 of token t), for t < n_tokens:
    one row of a split Q6_K / Q3_K unit."""
    x16 = x16_bf16 if x_bf16 else x16_f32

    @device
    def add_row(levels, scale, x32, xo, v, n_tokens, acc):
        for t in range(tokens):
            if t < n_tokens:
                acc[t] += scale * dot16(levels, x16(x32, t, xo, v))

    return add_row


# The GEMV's split Q6_K and Q3_K units: the 64 values of q6_k_unit's / q3_k_unit's unit u, of rows
# `row` and `row + 1` (past the matrix the second is the first again, its sums unused), their sums
# in acc[t] and acc[tokens + t]. Each row's loads are its row address plus 32-bit byte offsets that
# both rows share, and its four scales d sc are decoded once for every token; each token's sixteen
# inputs of a row s (16-value group) are read and unpacked once for both rows, and the token slots
# past n_tokens read the last live token's (their sums are never stored): no branch, so every load
# is issued before the arithmetic. The groups are the outer loop, the tokens the inner one: a group's
# levels become floats once for all the tokens from the words the unit keeps (a unit's 64 floats a
# row, all live across a token loop, took Q6_K to 161 registers at two tokens).


def run_inputs(x_bf16: bool):
    """The pair units' input reader and the size of a run: inputs(x32, xb, n_tokens, r, t) is
    token t's sixteen inputs of run r after byte xb of a token's row (token slots past n_tokens
    read the last live token's), one address computation and loads at constant offsets from it;
    and log2 of a run's bytes."""
    x16 = x16_bf16_at if x_bf16 else x16_f32_at

    @device
    def inputs(x32, xb, n_tokens, r, t):
        return x16(address_at(row_address(x32, min(t, n_tokens - 1)), xb), uint32(0), uint32(r))

    return inputs, uint32(5 if x_bf16 else 6)


@device
def unit_inputs(blk, h, j):
    """The first run of 16 inputs of a split Q6_K / Q3_K unit (block blk, half h, j = u % 2): row s's
    inputs are the run 2 s after it."""
    return uint32((blk << uint32(4)) | (h << uint32(3)) | j)


@device
def levels16(words):
    """The sixteen levels of four words, one a byte, as float32 (bytes_less16 of nothing)."""
    w0, w1, w2, w3 = words
    return bytes_less16(w0, w1, w2, w3, UINT8_LESS)


@device
def sum16(a):
    """The sum of a 16-tuple, pairwise."""
    return ((((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7])))
            + (((a[8] + a[9]) + (a[10] + a[11])) + ((a[12] + a[13]) + (a[14] + a[15]))))


def chunk_unit(dequant):
    """The generic stream unit of a type with a chunk dequantiser (StreamUnit shift 5, one in
    flight): unit u is chunk u of the row, dequantised into a local array, then dotted with each
    token's 32 inputs (8 at a time: one 16-byte load of bf16, two of fp32). Correct for any type;
    every weight type has its own unit now, which is what makes it fast, so only the ds4 table
    format (never a matrix) takes this one."""
    def make(tokens: int, x_bf16: bool):
        x8 = x8_bf16 if x_bf16 else x8_f32

        @device
        def dot_chunk(vals, x32, xo, v, n_tokens, acc):
            for t in range(tokens):
                if t < n_tokens:
                    total = float32(0)
                    for j in range(CHUNK // 8):
                        x0, x1, x2, x3, x4, x5, x6, x7 = x8(x32, t, xo, v + uint64(8 * j))
                        o = 8 * j
                        total += (vals[o] * x0 + vals[o + 1] * x1 + vals[o + 2] * x2 + vals[o + 3] * x3
                                  + vals[o + 4] * x4 + vals[o + 5] * x5 + vals[o + 6] * x6 + vals[o + 7] * x7)
                    acc[t] += total

        if SIM:  # (the simulator's local arrays exist in kernels' own modules only)
            def chunk_unit(ww, wf, row, x32, xo, k, n_tokens, acc, u):
                vals = np.empty(CHUNK, np.float32)
                dequant(ww.view(np.uint8), row, int64(u), vals)
                dot_chunk(vals, x32, xo, u * uint64(CHUNK), n_tokens, acc)
        else:
            @device
            def chunk_unit(ww, wf, row, x32, xo, k, n_tokens, acc, u):
                vals = cuda.local.array(CHUNK, float32)  # (32,) chunk u's values
                dequant(ww.view(np.uint8), row, int64(u), vals)
                dot_chunk(vals, x32, xo, u * uint64(CHUNK), n_tokens, acc)

        return chunk_unit

    return make


def chunk_stream(dequant) -> StreamUnit:
    return StreamUnit(chunk_unit(dequant), CHUNK.bit_length() - 1, 1)


# tensor-core pieces
# Per weight type two pairs of helpers with one signature each; `ks` is the K step (CHUNK
# values), w32 / w16 the weight rows viewed as 32- / 16-bit words [N, row words]:
# - fetch(w32, w16, n, ks, c, k) -> (word, aux): word c of row n's stored words for the step;
#   put(b_s, r, c, word, aux, ks) writes them to b_s row r as bf16 pairs.
# - fetch_scales(w32, w16, n, ks, k) -> four words: row n's scale words for the step (0 where a
#   type needs fewer); put_scales(d_s, m_s, mins_s, r, ks, words) writes them to the block's scale
#   arrays: d_s[h, r] the step's scale (h = 0; a type with `halves`, one for each k16 half-step h),
#   and for a type with mins the block's dmin m_s[r] and its mins mins_s[r, ks % TC_BLOCK_STEPS].
# The fetches only load: what a word holds is worked out in the puts, after the loads have had the
# previous step's mma to arrive in.

TC_STEP_WORDS = CHUNK // 2  # bf16 pairs a tile row holds per step
TC_BLOCK_STEPS = K_CHUNKS  # K steps of a 256-value block (the types with mins)
TC_BLOCK_GROUPS = 16  # its 16-value groups, one min each: the k of the mins' mma
NO_SCALES = (uint32(0), uint32(0), uint32(0), uint32(0))


@device
def bf16_int(v):
    """The bf16 bits of a small integer (exact: |v| < 256)."""
    return f32_bits(float32(v)) >> 16


@device
def pack(lo, hi):
    """Two bf16 bit patterns in one word, the lower k in the low half (as mma reads them)."""
    return uint32(lo) | (uint32(hi) << 16)


# The K-quants and MXFP4. Their levels become bf16 by the exponent trick (byte_less: each level a
# small integer, exact in float32, whose top 16 bits are then its bf16), two a word by one byte
# permute. Step ks of a K-quant row is chunk j = ks % 8 of block ks // 8; MXFP4's is block ks.

BF16_HIGH_HALVES = uint32(0x7632)  # byte_perm selector: a's high half, then b's


@device
def bf16_pair_of(a, b):
    """Two float32 values that bf16 holds exactly as one word of bf16 pairs, a in the low half."""
    return byte_perm(f32_bits(a), f32_bits(b), BF16_HIGH_HALVES)


@device
def level_pairs(levels, magic):
    """A word's four levels (one a byte, each less o: byte_less's magic = 2^23 + o) as two words of
    bf16 pairs, bytes 0 and 1 in the first (exact: every level here is under 2^8 in magnitude)."""
    return (bf16_pair_of(byte_less(levels, 0, magic), byte_less(levels, 1, magic)),
            bf16_pair_of(byte_less(levels, 2, magic), byte_less(levels, 3, magic)))


@device
def put_levels(b_s, r, c, levels, magic):
    """Word c of a step's levels (one a byte, less o) into b_s row r, words 2 c and 2 c + 1."""
    lo, hi = level_pairs(levels, magic)
    b_s[r, 2 * c] = lo
    b_s[r, 2 * c + 1] = hi
