"""The device half of the quant-type table: per GGUF type, the pieces every kernel family decodes
weights with, found by type in DEVICE_TYPES (ggml-cuda's traits table). host.quants.FORMATS is
the host half: block layout (a structured dtype whose size it asserts), values a block, host
dequantiser and quantiser. Every constant below (block bytes, field offsets, words a block) is
read from those dtypes at import, never typed again; adding a type is adding its host row there
and its record here.

A record (`DeviceType`) holds, with one signature per piece:
- `dequant(w, row, chunk, out)`: the 32 values of chunk `chunk` (values chunk*32 .. chunk*32+31)
  of stored row `row` (uint8 [rows, row_bytes], the GGUF's bytes) into the local array `out`,
  exactly as host.quants.dequantize computes them (every product there is exact in float32, so the
  order of operations cannot change a bit). The engram tables and the embedding gather use it.
- the weight layout: `weight_rows(stored, k)` turns stored rows into what a DeviceWeight keeps on
  the device (uint8 [N, pitch]), `weight_dequant` is `dequant` on those rows, `layout` its name.
  Every type keeps its stored bytes, except the "split" ones, whose rows put each block's quants
  where 16-byte loads reach them aligned (a stored block starts on a 2-byte boundary, an MXFP4 one
  of 17 bytes on any): Q8_0, the row's K int8 quants first, then its K/32 fp16 scales; Q2_K, every
  block's 16 scale bytes, then every block's 64 quant bytes, then every block's d and dmin; Q6_K, every
  block's ql, qh and scales (208 bytes, 13 whole 16-byte pieces), then every block's d; Q3_K, every
  block's hmask and qs (96 bytes, 6 pieces), then every block's 12 scale bytes, then every block's
  d (no padding between blocks: see Q3_K_PIECE); MXFP4, the K/32 blocks' 16 code bytes (a block
  one 16-byte piece), then their K/32 exponent bytes. Each row is zero-padded to whole 16-byte
  pieces, under one block, so a row's K still reads off its width. Q4_K and Q5_K rows ("stored")
  are whole 16-byte pieces already (`padded_stored` would pad them: the kernels view rows as words).
- `stream`: the unit of stages.linear's stream kernels (the partial-sum products; the decode GEMV
  too where `gemv` is None). `make(tokens, x_bf16)` builds unit(ww, wf, row, x32, xo, k, n_tokens,
  acc, u), which adds the dot products of unit u of the row with the inputs to acc[t] for
  t < n_tokens (<= tokens): ww / wf the weight rows as 32-bit words / fp16, x32 the inputs as
  32-bit words [T, K_total / 2] (bf16 pairs) or [T, K_total] (fp32), this row's K-wide slice at
  word xo. A row is K >> shift units, each one 16-byte load (Q2_K: a block's 16-byte quant piece,
  64 values, with an 8-byte load of its scales and a word of d, dmin; MXFP4: a block's codes, and a word load for its
  exponent byte; Q6_K and Q3_K: 64 values of a block, three and two 16-byte loads; Q4_K and Q5_K:
  32 level bytes, two loads, with the block's first 16-byte piece and Q5_K's 32 fifth-bit bytes);
  a lane issues `in_flight` of them together. `gemv` (or None): the decode GEMV's unit where it
  differs, a unit of two rows for Q8_0, Q2_K, Q3_K, Q4_K, Q5_K and Q6_K (the inputs read and unpacked
  once for both; Q4_K's and Q5_K's half a block, k_half_unit).
  The generic `chunk_unit` (any type with a chunk dequantiser: unit u is chunk u, dequantised and
  dotted with the inputs, correct but not tuned) is left to the ds4 table format, which no matrix
  has. Integers become floats by an exponent trick (`small_int`, `int8_at`, `uint8_at`,
  `e2m1_at`, `byte_less`, `field_at`, `field_less`), not by conversions.
- `tc` (or None): the tensor-core GEMM's fetch / put of a K step (stages.linear_tc), for every
  matrix type but F32 and F16 (whose prefill takes stages.linear's gemm kernel: weight_dequant).

Oracle: host.quants.dequantize holds the dequantisers (tests/test_engram_stages.py's rows, bit for bit);
the units and tc pieces are held through the products (tests/test_linear.py, test_linear_tc.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise

import numpy as np
from numba import cuda, float32, int32, int64, uint32, uint64

from flashv41.host.quants import (
    BF16_BLOCK,
    E4M3_ROW264_BLOCK,
    F16_BLOCK,
    F32_BLOCK,
    FORMATS,
    MXFP4_BLOCK,
    MXFP4_DOUBLED,
    Q2_K_BLOCK,
    Q3_K_BLOCK,
    Q4_K_BLOCK,
    Q5_K_BLOCK,
    Q6_K_BLOCK,
    Q8_0_BLOCK,
    GGMLType,
    QuantFormat,
    RowType,
    field_offset,
)
from flashv41.stages.device import (
    CHUNK,
    SIM,
    address_at,
    and_or,
    bf16_round,
    bf16_to_f32,
    bit_select,
    byte_perm,
    device,
    f16_at,
    f16x2_f32,
    f32_bits,
    f32_from_bits,
    fp16_to_f32,
    inlined,
    load_words2,
    load_words4,
    read_u16,
    row_address,
    word_at,
    words2_at,
    words4_at,
)

ROW_ALIGN = 16  # bytes: the stream kernel reads weight rows in aligned 16-byte pieces
WORD = 4  # bytes of the 32-bit words the stream and tensor-core kernels read

F32_BYTES, F16_BYTES, BF16_BYTES = F32_BLOCK.itemsize, F16_BLOCK.itemsize, BF16_BLOCK.itemsize

Q8_0_BYTES = Q8_0_BLOCK.itemsize
Q8_0_VALUES = FORMATS[GGMLType.Q8_0].block_values
Q8_0_D = field_offset(Q8_0_BLOCK, "d")  # byte offsets in a block
Q8_0_QS = field_offset(Q8_0_BLOCK, "qs")
Q8_0_SCALE_BYTES = Q8_0_BLOCK["d"].itemsize

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

assert Q8_0_VALUES == CHUNK  # a Q8_0 block is one chunk
# Q2_K's split layout (module docstring): a block's fields in their stored order, the scale bytes
# (one a 16-value group), the quants (2 bits a value) and (d, dmin) in one word, d in the low half;
# so in a row of K values the quants start at byte K / 16 and the (d, dmin) words at K / 16 + K / 4
assert (Q2_K_SCALES, Q2_K_QS, Q2_K_D) == (0, Q2_K_GROUPS, Q2_K_GROUPS + Q2_K_QS_BYTES)
assert Q2_K_DMIN == Q2_K_D + 2 and Q2_K_BYTES == Q2_K_D + WORD
assert Q2_K_GROUPS * 16 == Q2_K_VALUES and Q2_K_QS_BYTES * 4 == Q2_K_VALUES
assert Q2_K_GROUPS % ROW_ALIGN == 0 and Q2_K_QS_BYTES % ROW_ALIGN == 0

# The K-quants Q3_K .. Q6_K and MXFP4's fields (chunk dequantisers, which read the bytes one at a
# time: the 110- and 210-byte blocks are not whole words; each type's own stream unit below). A
# K-quant block is K_CHUNKS chunks, each two 16-value (Q3_K, Q6_K) or one 32-value (Q4_K, Q5_K)
# sub-blocks.
K_VALUES = FORMATS[GGMLType.Q4_K].block_values
K_CHUNKS = K_VALUES // CHUNK
Q3_K_BYTES = Q3_K_BLOCK.itemsize
Q3_K_HMASK, Q3_K_QS = field_offset(Q3_K_BLOCK, "hmask"), field_offset(Q3_K_BLOCK, "qs")
Q3_K_SCALES, Q3_K_D = field_offset(Q3_K_BLOCK, "scales"), field_offset(Q3_K_BLOCK, "d")
Q3_K_HALF_QS = Q3_K_BLOCK["qs"].shape[0] // 2  # 2-bit level bytes of each 128-value half
Q3_K_LOW_SCALES = 8  # scale bytes 0..7 hold the low nibbles, 8..11 the high pairs
Q4_K_BYTES = Q4_K_BLOCK.itemsize
Q4_K_D, Q4_K_DMIN = field_offset(Q4_K_BLOCK, "d"), field_offset(Q4_K_BLOCK, "dmin")
Q4_K_SCALES, Q4_K_QS = field_offset(Q4_K_BLOCK, "scales"), field_offset(Q4_K_BLOCK, "qs")
Q5_K_BYTES = Q5_K_BLOCK.itemsize
Q5_K_D, Q5_K_DMIN = field_offset(Q5_K_BLOCK, "d"), field_offset(Q5_K_BLOCK, "dmin")
Q5_K_SCALES, Q5_K_QH = field_offset(Q5_K_BLOCK, "scales"), field_offset(Q5_K_BLOCK, "qh")
Q5_K_QS = field_offset(Q5_K_BLOCK, "qs")
Q6_K_BYTES = Q6_K_BLOCK.itemsize
Q6_K_QL, Q6_K_QH = field_offset(Q6_K_BLOCK, "ql"), field_offset(Q6_K_BLOCK, "qh")
Q6_K_SCALES, Q6_K_D = field_offset(Q6_K_BLOCK, "scales"), field_offset(Q6_K_BLOCK, "d")
Q6_K_HALF_QL, Q6_K_HALF_QH = Q6_K_BLOCK["ql"].shape[0] // 2, Q6_K_BLOCK["qh"].shape[0] // 2
MXFP4_BYTES = MXFP4_BLOCK.itemsize
MXFP4_E, MXFP4_QS = field_offset(MXFP4_BLOCK, "e"), field_offset(MXFP4_BLOCK, "qs")
MXFP4_PAIRS = MXFP4_BLOCK["qs"].shape[0]  # code bytes: value j low nibble, j + MXFP4_PAIRS high

assert all(FORMATS[t].block_values == K_VALUES for t in (GGMLType.Q3_K, GGMLType.Q5_K, GGMLType.Q6_K))
assert Q3_K_BLOCK["hmask"].shape[0] == CHUNK and Q3_K_HALF_QS == CHUNK  # one byte per lane of a chunk
assert Q4_K_BLOCK["qs"].shape[0] == 4 * CHUNK and Q5_K_BLOCK["qh"].shape[0] == CHUNK
assert Q6_K_HALF_QH == CHUNK and Q6_K_HALF_QL == 2 * CHUNK and Q6_K_BLOCK["scales"].shape[0] * 16 == K_VALUES
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

# The split layouts of Q6_K and Q3_K (module docstring). A Q6_K row is every block's first
# Q6_K_D bytes (ql, qh, scales: a 16-byte aligned piece), then every block's d; a Q3_K row every
# block's hmask and qs (Q3_K_PIECE bytes, whole 16-byte pieces), then every block's 12 scale bytes,
# then every block's d. Q3_K keeps no padding inside the row: 108-byte pieces holding the scales
# too would be 4-byte aligned only (word loads: four times the load instructions) or, padded to
# 112 bytes, 3.6% more bytes for every GEMV to read; apart, consecutive blocks' scales are
# consecutive words. Both stream units take 64 values of a block (a half h, 16 of its 32
# positions i) with 16-byte loads; the word constants below index the rows as 32-bit words.
Q6_K_PIECE_WORDS = Q6_K_D // WORD
Q6_K_QL_WORD, Q6_K_QH_WORD, Q6_K_SCALES_WORD = Q6_K_QL // WORD, Q6_K_QH // WORD, Q6_K_SCALES // WORD
Q6_K_HALF_QL_WORDS, Q6_K_HALF_QH_WORDS = Q6_K_HALF_QL // WORD, Q6_K_HALF_QH // WORD
Q6_K_HALF_SCALES_WORDS = Q6_K_BLOCK["scales"].shape[0] // 2 // WORD  # the int8 scales of a half
Q3_K_PIECE = Q3_K_SCALES  # hmask, qs
Q3_K_SCALE_BYTES = Q3_K_D - Q3_K_SCALES
Q3_K_PIECE_WORDS, Q3_K_SCALE_WORDS = Q3_K_PIECE // WORD, Q3_K_SCALE_BYTES // WORD
Q3_K_HMASK_WORD, Q3_K_QS_WORD, Q3_K_HALF_QS_WORDS = Q3_K_HMASK // WORD, Q3_K_QS // WORD, Q3_K_HALF_QS // WORD
Q6_K_LEVEL_MAGIC = float32(2.0**23 + 32)  # byte_less's 2^23 + o: takes the 32 off a Q6_K level
Q3_K_LEVEL_MAGIC = float32(2.0**23 + 4)  # and the 4 off a Q3_K level + 4

# d last, after 16-byte aligned pieces; Q3_K's scales after its pieces, in whole words; the units
# read two Q6_K scale words a half and three Q3_K scale words a block
assert Q6_K_D + F16_BYTES == Q6_K_BYTES and Q6_K_D % ROW_ALIGN == 0 and Q6_K_SCALES % ROW_ALIGN == 0
assert Q3_K_D + F16_BYTES == Q3_K_BYTES and Q3_K_PIECE % ROW_ALIGN == 0 and Q3_K_SCALE_BYTES % WORD == 0
assert Q3_K_HMASK % ROW_ALIGN == 0 and Q3_K_QS % ROW_ALIGN == 0
assert Q6_K_HALF_SCALES_WORDS == 2 and Q3_K_SCALE_WORDS == 3

# Q4_K / Q5_K's word readers (their stream unit): a block is whole 16-byte pieces, the first d, dmin
# and the 12 scale bytes (words 1 .. 3), the levels (and Q5_K's fifth bits) starting on pieces; the
# masks pick fields out of every byte of a word at once.
Q4_K_WORDS, Q5_K_WORDS = Q4_K_BYTES // WORD, Q5_K_BYTES // WORD
Q4_K_QS_WORD, Q5_K_QS_WORD, Q5_K_QH_WORD = Q4_K_QS // WORD, Q5_K_QS // WORD, Q5_K_QH // WORD
K_UNIT_SHIFT = 6  # a unit: 32 level bytes, 64 values
LOW_NIBBLES, LOW_SIX = uint32(0x0F0F0F0F), uint32(0x3F3F3F3F)
TOP_PAIRS, LOW_BITS = uint32(0x30303030), uint32(0x01010101)  # bits 4-5, bit 0 of every byte
assert Q4_K_BYTES % ROW_ALIGN == 0 and Q5_K_BYTES % ROW_ALIGN == 0
assert Q4_K_QS % ROW_ALIGN == 0 and Q5_K_QS % ROW_ALIGN == 0 and Q5_K_QH % ROW_ALIGN == 0
assert (Q4_K_D, Q4_K_DMIN, Q4_K_SCALES) == (Q5_K_D, Q5_K_DMIN, Q5_K_SCALES) == (0, 2, WORD)
assert Q4_K_BLOCK["scales"].shape[0] == 3 * WORD and K_VALUES >> K_UNIT_SHIFT == 4  # a unit's block: u >> 2

# E4M3_ROW264, the ds4 engram-table format (a table format, no ggml type): a block is a row of
# E4M3_CHUNKS chunks of E4M3 codes, then one E8M0 scale byte per chunk.
E4M3_BYTES = E4M3_ROW264_BLOCK.itemsize
E4M3_QS, E4M3_E = field_offset(E4M3_ROW264_BLOCK, "qs"), field_offset(E4M3_ROW264_BLOCK, "e")
E4M3_CHUNKS = FORMATS[RowType.E4M3_ROW264].block_values // CHUNK
assert E4M3_ROW264_BLOCK["e"].shape[0] == E4M3_CHUNKS  # one scale a chunk
E4M3_NAN_MAG = uint32(127)  # (code & 127) == 127: NaN (E4M3FN has no infinities)
E8M0_NAN = uint32(255)
F32_NAN = uint32(0x7FC00000)
E8M0_SUBNORMAL = uint32(0x00400000)  # 2^-127, the fp32 pattern of E8M0 scale 0
TWO_M9 = float32(2.0**-9)  # E4M3's subnormal step
E4M3_TO_F32_BIAS = uint32(127 - 7)  # fp32's exponent bias less E4M3's

# uint64 indices: Numba wraps negative signed indices and floors signed divisions, a few
# instructions per access that an unsigned index does not need
U1, U2, U3, U4, U8 = uint64(1), uint64(2), uint64(3), uint64(4), uint64(8)
TWO_112 = float32(2.0**112)  # fp16's exponent bias (15) against fp32's (127)
INT8_MAGIC = uint32(0x4B000000)  # 2^23: a byte in its low mantissa bits reads as 2^23 + byte
INT8_SELECT = uint32(0x7540)  # byte_perm selector: the magic's bytes above byte 0, which the caller picks


# weight layouts (host side)


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


def split_blocks(stored: np.ndarray, block_bytes: int, cuts: tuple[int, ...]) -> np.ndarray:
    """Rows of whole blocks (uint8 [N, row_bytes]) -> per row the bytes 0 .. cuts[0] - 1 of every block
    back to back, then bytes cuts[0] .. cuts[1] - 1 of every block, ..., then the rest of every
    block (the same bytes, the same size)."""
    n = stored.shape[0]
    blocks = np.ascontiguousarray(stored).reshape(n, -1, block_bytes)
    edges = (0, *cuts, block_bytes)
    return np.concatenate([blocks[:, :, a:b].reshape(n, -1) for a, b in pairwise(edges)], axis=1)


def padded_split_q6_k(stored: np.ndarray, k: int) -> np.ndarray:
    """GGUF Q6_K rows -> the split layout: per row every block's ql, qh and scales, then every
    block's d, zero-padded to whole ROW_ALIGN-byte pieces."""
    return padded_stored(split_blocks(stored, Q6_K_BYTES, (Q6_K_D,)), k)


def padded_split_q2_k(stored: np.ndarray, k: int) -> np.ndarray:
    """GGUF Q2_K rows -> the split layout: per row every block's scales, then every block's qs,
    then every block's d and dmin, zero-padded to whole ROW_ALIGN-byte pieces."""
    return padded_stored(split_blocks(stored, Q2_K_BYTES, (Q2_K_QS, Q2_K_D)), k)


def padded_split_q3_k(stored: np.ndarray, k: int) -> np.ndarray:
    """GGUF Q3_K rows -> the split layout: per row every block's hmask and qs, then every block's
    scales, then every block's d, zero-padded to whole ROW_ALIGN-byte pieces."""
    return padded_stored(split_blocks(stored, Q3_K_BYTES, (Q3_K_PIECE, Q3_K_D)), k)


def stored_rows(stored: np.ndarray, k: int) -> np.ndarray:
    return stored


def padded_stored(stored: np.ndarray, k: int) -> np.ndarray:
    """Rows, zero-padded to whole ROW_ALIGN-byte pieces where they are not (the Q3_K and Q6_K split
    rows of some K): the stream kernels view a row as 32-bit words and fp16 halves. The bytes keep
    their offsets, so the chunk dequantisers read these rows as unpadded ones."""
    pad = -stored.shape[1] % ROW_ALIGN
    return np.pad(stored, ((0, 0), (0, pad))) if pad else stored


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


@device
def e4m3_value(code):
    """An E4M3FN code (8 bits) as float32, exactly (host.quants.e4m3_value): (8 + m) 2^(e - 10) placed
    as an fp32 pattern for exponent e >= 1, m * 2^-9 for e = 0 (an exact product), NaN for
    (code & 127) == 127, the sign bit 128."""
    if (code & E4M3_NAN_MAG) == E4M3_NAN_MAG:
        return f32_from_bits(F32_NAN)
    e = (code >> 3) & 15
    m = code & 7
    if e == 0:
        mag = float32(m) * TWO_M9
    else:
        mag = f32_from_bits(((e + E4M3_TO_F32_BIAS) << 23) | (m << 20))
    return -mag if code & 128 else mag


@device
def dequant_e4m3_row264(w, row, chunk, out):
    """E4M3_ROW264 chunk c of a row: e4m3(code) * 2^(scale c - 127) (an exact fp32 product, or inf past
    2^128), rounded to bf16 as host.quants.dequantize_e4m3_row264. The host refuses NaN codes and
    scales of 255; here they give NaN (a kernel cannot raise)."""
    base = (chunk // E4M3_CHUNKS) * E4M3_BYTES
    c = chunk % E4M3_CHUNKS
    s = uint32(w[row, base + E4M3_E + c])
    if s == E8M0_NAN:
        scale = f32_from_bits(F32_NAN)
    elif s == 0:
        scale = f32_from_bits(E8M0_SUBNORMAL)
    else:
        scale = f32_from_bits(s << 23)
    q0 = base + E4M3_QS + c * CHUNK
    for i in range(CHUNK):
        out[i] = bf16_round(e4m3_value(uint32(w[row, q0 + i])) * scale)


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

    def byte_less(word, byte, magic):
        return np.float32(((int(word) >> (8 * int(byte))) & 0xFF) + 8388608) - magic

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


# stream units
# Each factory returns the unit for up to `tokens` tokens of bf16 (x_bf16) or fp32 inputs. xo is
# in input words, so an input value v of the row's slice is word xo + v / 2 (bf16) or xo + v.


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


# Q2_K (split layout). Unit u is quant piece u of the row (16 bytes): block u >> 2, half h = (u >> 1) & 1,
# p = u & 1, its byte 4 m + c (word m, byte c) holding in bits 2 s, 2 s + 1 the level of value
# 128 h + 32 s + 16 p + 4 m + c, whose scale byte is 8 h + 2 s + p of the block: for each s a
# 16-value group with one (sc, m), its inputs one run of 16. Levels and scale nibbles become float32
# where they lie (field_at), never shifted down to bit 0: a word's bytes 0 and 1 in place, bytes 2
# and 3 from the word shifted down 16 bits once.
Q2_K_UNIT_SHIFT = 6  # a unit: 64 values


def field_magic(p: int):
    """The fp32 bits of 2^(23 - p): a field whose lowest bit is p (its top bit under 23) or-ed into
    them reads as 2^(23 - p) + the field (field_at)."""
    return uint32((150 - p) << 23)


Q2_K_LOW_MASKS = tuple(uint32(3 << (2 * s)) for s in range(4))  # byte 0's level at shift s
Q2_K_HIGH_MASKS = tuple(uint32(3 << (8 + 2 * s)) for s in range(4))  # byte 1's
Q2_K_LOW_MAGICS = tuple(field_magic(2 * s) for s in range(4))
Q2_K_HIGH_MAGICS = tuple(field_magic(8 + 2 * s) for s in range(4))
LOW_NIBBLE, HIGH_NIBBLE = uint32(0x0F), uint32(0xF0)  # a scale byte's sc, m
LOW_NIBBLE_MAGIC, HIGH_NIBBLE_MAGIC = field_magic(0), field_magic(4)
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


# The split Q6_K and Q3_K units. Unit u is 64 values of block u // 4: in half h = (u // 2) % 2,
# positions i = 16 (u % 2) .. + 15 of its 32, the values 128 h + 32 s + i of rows s < 4 (sub-block
# 8 h + 2 s + u % 2). Byte b of word m of a 16-byte load is position 16 (u % 2) + 4 m + b: a row's
# levels are built four at a time on whole words, each level enters as one exact small integer
# (byte_less), and each row's scale is decoded once. The rows are four calls with s a literal (a
# loop over s stays a loop in the PTX, its shifts and word choices decided at run time).

INT8_FLIP = uint32(0x80808080)  # every byte's top bit: a signed byte q flipped reads as q + 128


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


# The GEMV's split Q6_K and Q3_K units: the 64 values of q6_k_unit's / q3_k_unit's unit u, of rows
# `row` and `row + 1` (past the matrix the second is the first again, its sums unused), their sums
# in acc[t] and acc[tokens + t]. Each row's loads are its row address plus 32-bit byte offsets that
# both rows share, and its four scales d sc are decoded once for every token; each token's sixteen
# inputs of a row s (16-value group) are read and unpacked once for both rows, and the token slots
# past n_tokens read the last live token's (their sums are never stored): no branch, so every load
# is issued before the arithmetic. The groups are the outer loop, the tokens the inner one: a group's
# levels become floats once for all the tokens from the words the unit keeps (a unit's 64 floats a
# row, all live across a token loop, took Q6_K to 161 registers at two tokens).
Q3_K_SCALE_MASKS = (uint32(0x3F), uint32(0x3F << 16))  # a 6-bit scale of row s, at bit 16 (s % 2)
Q3_K_SCALE_MAGICS = (field_magic(0), field_magic(16))
Q3_K_SCALE_LESS = (float32(2.0**23 + 32), float32(2.0**7 + 32))  # 2^(23 - p) + 32: the scales less 32


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
assert Q2_K_CHUNKS == TC_BLOCK_STEPS and Q2_K_GROUPS == TC_BLOCK_GROUPS


@device
def bf16_int(v):
    """The bf16 bits of a small integer (exact: |v| < 256)."""
    return f32_bits(float32(v)) >> 16


@device
def pack(lo, hi):
    """Two bf16 bit patterns in one word, the lower k in the low half (as mma reads them)."""
    return uint32(lo) | (uint32(hi) << 16)


@device
def fetch_bf16(w32, w16, n, ks, c, k):
    return w32[n, ks * TC_STEP_WORDS + c], uint32(0)


@device
def put_bf16(b_s, r, c, word, aux, ks):
    b_s[r, c] = word


@device
def fetch_scales_none(w32, w16, n, ks, k):
    return NO_SCALES


@device
def put_scales_none(d_s, m_s, mins_s, r, ks, s0, s1, s2, s3):
    return


@device
def fetch_q8_0(w32, w16, n, ks, c, k):
    return w32[n, ks * (CHUNK // WORD) + c], uint32(0)  # levels: one byte each, a chunk a step


@device
def i8_bf16(word, byte):
    """The bf16 bits of signed byte `byte` of word."""
    return bf16_int(int32(word << (24 - 8 * byte)) >> 24)


@device
def put_q8_0(b_s, r, c, word, aux, ks):
    b_s[r, 2 * c] = pack(i8_bf16(word, 0), i8_bf16(word, 1))
    b_s[r, 2 * c + 1] = pack(i8_bf16(word, 2), i8_bf16(word, 3))


@device
def fetch_scales_q8_0(w32, w16, n, ks, k):
    return uint32(w16[n, k // 2 + ks]), uint32(0), uint32(0), uint32(0)  # the scales follow the row's K levels


@device
def put_scales_q8_0(d_s, m_s, mins_s, r, ks, s0, s1, s2, s3):
    d_s[0, r] = fp16_to_f32(s0)


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

    return TcType(fetch, put, fetch_scales_k_nibble, put_scales_k_nibble, CHUNK // WORD, True, True)


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


# The narrow tensor-core product's pieces (stages.linear_narrow). Lane (g, t) of a warp takes,
# from each 32-value block of a row, the values 8 t .. 8 t + 7; they enter the block's two k16
# mma steps s as its values 8 t + 4 s .. 8 t + 4 s + 3 (the inputs are permuted alike):
# - fetch(w32, row, b, t) -> four words: what the row stores of those values in block b (Q8_0:
#   two words of int8 levels, then two zeros; BF16: four words of bf16 pairs), one load;
# - pairs(w0, w1, w2, w3, s) -> the A fragment's two words for step s: bf16 pairs of values
#   8 t + 4 s, + 1 and 8 t + 4 s + 2, + 3 (Q8_0: the levels, exact in bf16);
# - scales(w32, row, b, k) -> the scales of blocks b .. b + 3 (b a multiple of 4) as float32, one
#   load (Q8_0's fp16 d, after the row's K levels; 1 for BF16).


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


@device
def narrow_fetch_bf16(w32, row, b, t):
    return load_words4(w32, row, uint32(16) * b + uint32(4) * t)


@device
def narrow_pairs_bf16(w0, w1, w2, w3, s):
    return (w2, w3) if s else (w0, w1)


@device
def narrow_scales_none(w32, row, b, k):
    return float32(1), float32(1), float32(1), float32(1)


# the table


@dataclass(frozen=True)
class StreamUnit:
    """The stream kernel's piece of a type: `make(tokens, x_bf16)` -> unit; a row of K values is
    K >> shift units, a lane issuing `in_flight` of them together; a unit covers `rows`
    consecutive rows (their sums in acc[i * tokens + t])."""

    make: Callable
    shift: int
    in_flight: int
    rows: int = 1


@dataclass(frozen=True)
class TcType:
    """How a weight type enters the tensor-core GEMM: its helpers, the stored words a row reads per
    step, whether the values are scaled (per step: a Q8_0 or MXFP4 block, a K-quant block's
    eighth), whether a block's mins are taken away at its end (Q2_K, Q4_K, Q5_K) and whether the
    scales change every k16 half-step (`halves`: one scale per 16 values, Q3_K and Q6_K) rather
    than every step."""

    fetch: Callable
    put: Callable
    fetch_scales: Callable
    put_scales: Callable
    words: int
    scaled: bool
    mins: bool
    halves: bool = False


@dataclass(frozen=True)
class NarrowType:
    """How a weight type enters the narrow tensor-core product (stages.linear_narrow): its fetch,
    pairs and scales pieces, and whether its blocks are scaled."""

    fetch: Callable
    pairs: Callable
    scales: Callable
    scaled: bool


@dataclass(frozen=True)
class DeviceType:
    """One GGUF type's device pieces (module docstring); `host` is its host.quants.FORMATS row."""

    host: QuantFormat
    dequant: Callable
    layout: str
    weight_rows: Callable[[np.ndarray, int], np.ndarray]
    weight_dequant: Callable
    stream: StreamUnit  # one row a unit: the partial-sum products (stages.hyper's mixes)
    tc: TcType | None
    gemv: StreamUnit | None = None  # the decode GEMV's unit where it differs from `stream`
    narrow: NarrowType | None = None  # the narrow tensor-core product's pieces (BF16, Q8_0)

    @property
    def gemv_unit(self) -> StreamUnit:
        return self.gemv or self.stream

    @property
    def gtype(self) -> GGMLType | RowType:
        return self.host.ggml_type


def _entry(gtype: GGMLType | RowType, dequant, stream: StreamUnit, tc: TcType | None = None, layout: str = "stored",
           weight_rows=stored_rows, weight_dequant=None, gemv: StreamUnit | None = None,
           narrow: NarrowType | None = None) -> tuple[GGMLType | RowType, DeviceType]:
    return gtype, DeviceType(FORMATS[gtype], dequant, layout, weight_rows, weight_dequant or dequant, stream, tc,
                             gemv, narrow)


Q4_K_STREAM, Q4_K_GEMV = k_nibble_stream(Q4_K_WORDS, q4_k_levels, q4_k_half, Q4_K_FIELDS)
Q5_K_STREAM, Q5_K_GEMV = k_nibble_stream(Q5_K_WORDS, q5_k_levels, q5_k_half, Q5_K_FIELDS)
DEVICE_TYPES: dict[GGMLType | RowType, DeviceType] = dict([
    _entry(GGMLType.F32, dequant_f32, StreamUnit(f32_unit, 2, 2)),
    _entry(GGMLType.F16, dequant_f16, StreamUnit(f16_unit, 3, 2)),
    _entry(GGMLType.BF16, dequant_bf16, StreamUnit(bf16_unit, 3, 2),
           TcType(fetch_bf16, put_bf16, fetch_scales_none, put_scales_none, TC_STEP_WORDS, False, False),
           narrow=NarrowType(narrow_fetch_bf16, narrow_pairs_bf16, narrow_scales_none, False)),
    _entry(GGMLType.Q8_0, dequant_q8_0, StreamUnit(q8_0_unit, 4, 2),
           TcType(fetch_q8_0, put_q8_0, fetch_scales_q8_0, put_scales_q8_0, CHUNK // WORD, True, False),
           "split", padded_split_q8_0, dequant_q8_0_split, StreamUnit(q8_0_pair_unit, 4, 2, rows=2),
           NarrowType(narrow_fetch_q8_0, narrow_pairs_q8_0, narrow_scales_q8_0, True)),
    _entry(GGMLType.Q2_K, dequant_q2_k, StreamUnit(q2_k_unit(1), Q2_K_UNIT_SHIFT, 2),
           TcType(fetch_q2_k, put_q2_k, fetch_scales_q2_k, put_scales_q2_k, CHUNK // WORD, True, True),
           "split", padded_split_q2_k, dequant_q2_k_split, StreamUnit(q2_k_unit(2), Q2_K_UNIT_SHIFT, 2, rows=2)),
    _entry(GGMLType.Q3_K, dequant_q3_k, StreamUnit(q3_k_unit, 6, 2),
           TcType(fetch_q3_k, put_q3_k, fetch_scales_q3_k, put_scales_q3_k, CHUNK // WORD, True, False, halves=True),
           "split", padded_split_q3_k, dequant_q3_k_split, StreamUnit(q3_k_pair_unit, 6, 2, rows=2)),
    _entry(GGMLType.Q4_K, dequant_q4_k, Q4_K_STREAM, k_nibble_tc(Q4_K_WORDS, fetch_q4_k, put_q4_k),
           weight_rows=padded_stored, gemv=Q4_K_GEMV),
    _entry(GGMLType.Q5_K, dequant_q5_k, Q5_K_STREAM, k_nibble_tc(Q5_K_WORDS, fetch_q5_k, put_q5_k),
           weight_rows=padded_stored, gemv=Q5_K_GEMV),
    _entry(GGMLType.Q6_K, dequant_q6_k, StreamUnit(q6_k_unit, 6, 2),
           TcType(fetch_q6_k, put_q6_k, fetch_scales_q6_k, put_scales_q6_k, CHUNK // WORD, True, False, halves=True),
           "split", padded_split_q6_k, dequant_q6_k_split, StreamUnit(q6_k_pair_unit, 6, 2, rows=2)),
    _entry(GGMLType.MXFP4, dequant_mxfp4, StreamUnit(mxfp4_unit, 5, 2),
           TcType(fetch_mxfp4, put_mxfp4, fetch_scales_mxfp4, put_scales_mxfp4, MXFP4_PAIRS // WORD, True, False),
           "split", padded_split_mxfp4, dequant_mxfp4_split, StreamUnit(mxfp4_pair_unit, 5, 2, rows=2)),
    # a table format: the engram row gather reads it (dequant); the loader refuses it for matrices,
    # the generic chunk unit being there for completeness
    _entry(RowType.E4M3_ROW264, dequant_e4m3_row264, chunk_stream(dequant_e4m3_row264), weight_rows=padded_stored),
])
assert set(DEVICE_TYPES) == set(FORMATS)
