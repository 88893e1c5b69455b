"""GGUF tensor codecs in NumPy: the block layouts flashv41 reads, dequantisation to float32, and the
quantisers the synthetic-model writer uses.

Supported types: F32, F16, BF16, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K and MXFP4, and one table format
no ggml type id names, E4M3_ROW264 (ds4's engram rows, stored in the file as I8), each declared once in
the table `FORMATS` (its block layout a NumPy structured dtype whose size is asserted, values a
block, dequantiser and quantiser); stages.quants adds each type's device pieces.
Dequantisation agrees bit for bit with gguf-py's `gguf.quants.dequantize` (tests/test_quants.py,
tests/test_quants_more.py hold it to that).

Every product in a dequantiser is exact in float32, so the GPU kernels reproduce these results bit
for bit whatever their operation order (and with or without fused multiply-adds):
- Q8_0, Q3_K, Q6_K: the value is one exact product: an fp16 scale (11 significant bits) times
  integers of at most 8 + 2 (Q8_0's int8 level; Q3_K's 6-bit scale less 32 times a level in -4..3:
  5 + 2) or 7 + 5 bits (Q6_K's int8 scale times a level in -32..31), so at most 23 bits;
- Q2_K, Q4_K, Q5_K: y = (d * sc) * q - dmin * m, both terms exact (11 + 4 + 2, 11 + 6 + 5 bits at
  most), the value the one fp32 rounding of their difference (the same rounding wherever it runs);
- MXFP4: a power of two 2^(e - 128) (an fp32 subnormal for e < 2) times a doubled E2M1 value
  (0..12: at most 2 bits), exact, except that e >= 254 with the largest codes overflows to inf,
  as gguf-py's does.
- E4M3_ROW264: an E4M3FN value (4 significant bits, magnitudes 2^-9 .. 448) times 2^(s - 127),
  exact in fp32 (the smallest, 2^-136, is far above fp32's 2^-149) or inf past 2^128; then the one
  rounding to bf16 that ds4 applies (exact but for values under bf16's normal range, 2^-126).
K-quant scales read as fp16 may be subnormal; fp32 holds them as normal numbers.

The Q2_K quantiser follows the idea of ggml's reference quantiser: per 16-value sub-block a
weighted least-squares fit of a scale and a minimum over a small grid of trial scales, then the
sub-scales and sub-minimums quantised to 4 bits against the block's fp16 `d` and `dmin`. MXFP4's
is gguf-py's. Q3_K .. Q6_K have no quantiser (neither has gguf-py): theirs raise UnsupportedError,
and `random_blocks` makes random valid stored rows of any type for tests and synthetic files.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import numpy as np

from flashv41.host.errors import ModelFormatError, UnsupportedError


class RowType(IntEnum):
    """Table formats that no ggml type id names: the file records them under another type (ds4's
    engram rows are I8 tensors of 264 bytes a row); ids far from ggml's so the two never meet."""

    E4M3_ROW264 = 1 << 16


GGML_I8 = 24  # ggml's I8 type id: what a ds4 file records its E4M3_ROW264 tables as


class GGMLType(IntEnum):
    """The ggml type ids flashv41 knows (values as in ggml.h / gguf-py)."""

    F32 = 0
    F16 = 1
    Q8_0 = 8
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    BF16 = 30
    MXFP4 = 39


# The block layouts, each declared here once (ggml-common.h); the loader, the oracle and the device
# pieces (stages.quants) read sizes and field offsets from these dtypes, never re-type them.
F32_BLOCK = np.dtype([("v", "<f4")])
F16_BLOCK = np.dtype([("v", "<f2")])
BF16_BLOCK = np.dtype([("v", "<u2")])  # the bf16 bit pattern
# Q8_0: an fp16 scale and 32 signed 8-bit levels; value = d * qs.
Q8_0_BLOCK = np.dtype([("d", "<f2"), ("qs", "i1", (32,))])
# Q2_K: 16 bytes of (min << 4 | scale) nibbles, 64 bytes of 2-bit levels, fp16 d, dmin.
Q2_K_BLOCK = np.dtype([("scales", "u1", (16,)), ("qs", "u1", (64,)), ("d", "<f2"), ("dmin", "<f2")])
# Q3_K: 32 bytes of high bits (one per value, 8 per byte), 64 bytes of 2-bit low bits, 12 bytes of
# sixteen 6-bit scales (stored + 32), fp16 d.
Q3_K_BLOCK = np.dtype([("hmask", "u1", (32,)), ("qs", "u1", (64,)), ("scales", "u1", (12,)), ("d", "<f2")])
# Q4_K: fp16 d, dmin, 12 bytes of eight 6-bit scales and eight 6-bit mins, 128 bytes of 4-bit levels.
Q4_K_BLOCK = np.dtype([("d", "<f2"), ("dmin", "<f2"), ("scales", "u1", (12,)), ("qs", "u1", (128,))])
# Q5_K: Q4_K's fields with 32 bytes of fifth bits (one per value) before the 4-bit levels.
Q5_K_BLOCK = np.dtype([("d", "<f2"), ("dmin", "<f2"), ("scales", "u1", (12,)), ("qh", "u1", (32,)),
                       ("qs", "u1", (128,))])
# Q6_K: 128 bytes of low nibbles, 64 bytes of high 2-bit pairs, sixteen int8 scales, fp16 d.
Q6_K_BLOCK = np.dtype([("ql", "u1", (128,)), ("qh", "u1", (64,)), ("scales", "i1", (16,)), ("d", "<f2")])
# MXFP4: an E8M0 exponent byte and 32 E2M1 codes, two a byte (value j low nibble of qs[j], j + 16 high).
MXFP4_BLOCK = np.dtype([("e", "u1"), ("qs", "u1", (16,))])
# E4M3_ROW264 (ds4's engram rows): 256 E4M3FN codes (bias 7, exponent 0 subnormal m * 2^-9, codes
# with (code & 127) == 127 NaN), then 8 E8M0 scales, scale k for values 32 k .. 32 k + 31.
E4M3_ROW264_BLOCK = np.dtype([("qs", "u1", (256,)), ("e", "u1", (8,))])
assert E4M3_ROW264_BLOCK.itemsize == 264
assert (F32_BLOCK.itemsize, F16_BLOCK.itemsize, BF16_BLOCK.itemsize, Q8_0_BLOCK.itemsize, Q2_K_BLOCK.itemsize) \
    == (4, 2, 2, 34, 84)
assert (Q3_K_BLOCK.itemsize, Q4_K_BLOCK.itemsize, Q5_K_BLOCK.itemsize, Q6_K_BLOCK.itemsize, MXFP4_BLOCK.itemsize) \
    == (110, 144, 176, 210, 17)


def field_offset(block: np.dtype, name: str) -> int:
    """Byte offset of field `name` in a block dtype (what the device pieces index with)."""
    fields = block.fields
    if fields is None or name not in fields:
        raise KeyError(f"{block} has no field {name!r}")
    return int(fields[name][1])


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """bf16 bit patterns (uint16) -> float32, exactly."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bit patterns, round to nearest even; NaN stays a (quiet) NaN."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    is_nan = (u & 0x7FFFFFFF) > 0x7F800000
    rounded = (u.astype(np.uint64) + 0x7FFF + ((u >> 16) & 1)) >> 16
    quiet_nan = (u >> 16) | 0x0040
    return np.where(is_nan, quiet_nan, rounded).astype(np.uint16)


def _blocks(raw: np.ndarray, block: np.dtype) -> np.ndarray:
    """Stored bytes [..., whole blocks] as a flat array of `block` records."""
    return np.ascontiguousarray(raw).reshape(-1, block.itemsize).view(block).reshape(-1)


def dequantize_f32(raw: np.ndarray) -> np.ndarray:
    return _blocks(raw, F32_BLOCK)["v"].astype(np.float32).reshape(*raw.shape[:-1], -1)


def dequantize_f16(raw: np.ndarray) -> np.ndarray:
    return _blocks(raw, F16_BLOCK)["v"].astype(np.float32).reshape(*raw.shape[:-1], -1)


def dequantize_bf16(raw: np.ndarray) -> np.ndarray:
    return bf16_bits_to_f32(_blocks(raw, BF16_BLOCK)["v"]).reshape(*raw.shape[:-1], -1)


def dequantize_q8_0(raw: np.ndarray) -> np.ndarray:
    """Q8_0 bytes [..., whole blocks] -> float32 [..., 32 a block]."""
    blocks = _blocks(raw, Q8_0_BLOCK)
    d = blocks["d"].astype(np.float32)[:, None]
    return (blocks["qs"].astype(np.float32) * d).reshape(*raw.shape[:-1], -1)


def q2_k_terms(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q2_K bytes [..., whole blocks] -> the two parts of every value, float32 [..., 256 a block]
    each: d * (sc & 15) * level and dmin * (sc >> 4), the value being the first minus the second.

    Value e of a block: level (qs[(e // 128) * 32 + e % 32] >> 2 * ((e % 128) // 32)) & 3, in
    sub-block e // 16, whose scale byte sc holds the sub-scale (low nibble) and sub-minimum. Each
    part is exact in float32 (an fp16 scale times 4- and 2-bit integers).
    """
    blocks = _blocks(raw, Q2_K_BLOCK)
    nb = blocks.shape[0]
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8)
    # [nb, half, shift, 32] -> element order e = half * 128 + shift_index * 32 + lane
    levels = (blocks["qs"].reshape(nb, 2, 1, 32) >> shifts.reshape(1, 1, 4, 1)) & np.uint8(3)
    levels = levels.reshape(nb, 16, 16).astype(np.float32)
    d = blocks["d"].astype(np.float32)[:, None]
    dmin = blocks["dmin"].astype(np.float32)[:, None]
    scale = (d * (blocks["scales"] & 0xF).astype(np.float32))[:, :, None]
    minimum = (dmin * (blocks["scales"] >> 4).astype(np.float32))[:, :, None]
    shape = (*raw.shape[:-1], -1)
    return (scale * levels).reshape(shape), np.broadcast_to(minimum, levels.shape).reshape(shape)


def dequantize_q2_k(raw: np.ndarray) -> np.ndarray:
    """Q2_K bytes [..., whole blocks] -> float32 [..., 256 a block] (q2_k_terms: y = d sc q - dmin m)."""
    scaled, minimum = q2_k_terms(raw)
    return scaled - minimum



def _bits(raw_bytes: np.ndarray, count: int, width: int) -> np.ndarray:
    """Fields `width` bits wide of every byte, low first: uint8 [..., n] -> [..., count, n], field j
    of byte i at [..., j, i] (count * width <= 8)."""
    shifts = (np.arange(count, dtype=np.uint8) * np.uint8(width)).reshape(count, 1)
    return (raw_bytes[..., None, :] >> shifts) & np.uint8((1 << width) - 1)


def dequantize_q3_k(raw: np.ndarray) -> np.ndarray:
    """Q3_K bytes [..., whole blocks] -> float32 [..., 256 a block]: y = (d * (sc - 32)) * q.

    Value e = 32 c + i (c < 8, i < 32): low bits (qs[32 (c // 4) + i] >> 2 (c % 4)) & 3, high bit
    (hmask[i] >> c) & 1, level q = low - 4 (1 - high) in -4..3. Sub-block j = e // 16: its 6-bit
    scale is (scales[j % 8] >> 4 (j // 8)) & 15 with bits 4-5 (scales[8 + j % 4] >> 2 (j // 4)) & 3.
    """
    blocks = _blocks(raw, Q3_K_BLOCK)
    nb = blocks.shape[0]
    s = blocks["scales"]
    low_sc = _bits(s[:, :8], 2, 4).reshape(nb, 16)
    high_sc = _bits(s[:, 8:], 4, 2).reshape(nb, 16)
    sc = ((low_sc | (high_sc << np.uint8(4))).astype(np.int32) - 32).astype(np.float32)
    low = _bits(blocks["qs"].reshape(nb, 2, 32), 4, 2).reshape(nb, 16, 16).astype(np.int32)
    high = _bits(blocks["hmask"], 8, 1).reshape(nb, 16, 16).astype(np.int32)
    q = (low - 4 * (1 - high)).astype(np.float32)
    scale = (blocks["d"].astype(np.float32)[:, None] * sc)[:, :, None]
    return (scale * q).reshape(*raw.shape[:-1], -1)


def k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: the 12 scale bytes [nb, 12] -> the 6-bit scales and mins, uint8 [nb, 8] each.
    Sub-block j < 4: scales[j] & 63, scales[j + 4] & 63; j >= 4: the low nibble (scale) and high
    nibble (min) of scales[j + 4], their top two bits the top bits of scales[j - 4] and scales[j]."""
    s = scales
    sc = np.concatenate([s[:, 0:4] & 63, (s[:, 8:12] & 15) | ((s[:, 0:4] >> 2) & 48)], axis=1)
    mn = np.concatenate([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 2) & 48)], axis=1)
    return sc, mn


def _k_terms(blocks: np.ndarray, q: np.ndarray, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: the two parts (d * sc) * q and dmin * m of every value, for levels q [nb, 8, 32]
    of 32-value sub-blocks (k_scale_min), float32 `shape` each; the value is the first less the
    second. Each part is exact in float32 (an fp16 scale times 6- and 5-bit integers)."""
    sc, mn = k_scale_min(blocks["scales"])
    d = blocks["d"].astype(np.float32)[:, None]
    dmin = blocks["dmin"].astype(np.float32)[:, None]
    scaled = (d * sc.astype(np.float32))[:, :, None] * q.astype(np.float32)
    minimum = (dmin * mn.astype(np.float32))[:, :, None]
    return scaled.reshape(shape), np.broadcast_to(minimum, scaled.shape).reshape(shape)


def q4_k_terms(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K bytes [..., whole blocks] -> the two parts of every value (_k_terms), float32 [..., 256
    a block] each. Value e = 32 j + i: level (qs[32 (j // 2) + i] >> 4 (j % 2)) & 15, sub-block j."""
    blocks = _blocks(raw, Q4_K_BLOCK)
    nb = blocks.shape[0]
    q = _bits(blocks["qs"].reshape(nb, 4, 32), 2, 4).reshape(nb, 8, 32)
    return _k_terms(blocks, q, (*raw.shape[:-1], -1))


def dequantize_q4_k(raw: np.ndarray) -> np.ndarray:
    """Q4_K bytes [..., whole blocks] -> float32 [..., 256 a block]: y = (d * sc) * q - dmin * m
    (q4_k_terms)."""
    scaled, minimum = q4_k_terms(raw)
    return scaled - minimum


def q5_k_terms(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q5_K bytes [..., whole blocks] -> the two parts of every value (_k_terms): Q4_K's levels, the
    fifth bit being (qh[i] >> j) & 1 for value e = 32 j + i."""
    blocks = _blocks(raw, Q5_K_BLOCK)
    nb = blocks.shape[0]
    low = _bits(blocks["qs"].reshape(nb, 4, 32), 2, 4).reshape(nb, 8, 32)
    high = _bits(blocks["qh"], 8, 1)
    return _k_terms(blocks, low | (high << np.uint8(4)), (*raw.shape[:-1], -1))


def dequantize_q5_k(raw: np.ndarray) -> np.ndarray:
    """Q5_K bytes [..., whole blocks] -> float32 [..., 256 a block]: Q4_K's y (q5_k_terms)."""
    scaled, minimum = q5_k_terms(raw)
    return scaled - minimum


def dequantize_q6_k(raw: np.ndarray) -> np.ndarray:
    """Q6_K bytes [..., whole blocks] -> float32 [..., 256 a block]: y = (d * sc) * (q - 32).

    Value e = 32 c + i (c < 8): low nibble (ql[64 (c // 4) + 32 (c % 2) + i] >> 4 ((c % 4) // 2))
    & 15, high pair (qh[32 (c // 4) + i] >> 2 (c % 4)) & 3, q their 6-bit join; scale sc =
    scales[e // 16] (int8).
    """
    blocks = _blocks(raw, Q6_K_BLOCK)
    nb = blocks.shape[0]
    low = _bits(blocks["ql"].reshape(nb, 2, 64), 2, 4).reshape(nb, 8, 32)
    high = _bits(blocks["qh"].reshape(nb, 2, 32), 4, 2).reshape(nb, 8, 32)
    q = ((low | (high << np.uint8(4))).astype(np.int32) - 32).astype(np.float32).reshape(nb, 16, 16)
    scale = (blocks["d"].astype(np.float32)[:, None] * blocks["scales"].astype(np.float32))[:, :, None]
    return (scale * q).reshape(*raw.shape[:-1], -1)


# E2M1 codes as twice their value (ggml's kvalues_mxfp4): the E8M0 scale is taken at half its value
MXFP4_DOUBLED = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.float32)


def e8m0_half(e: np.ndarray) -> np.ndarray:
    """E8M0 exponent bytes -> 2^(e - 128) as float32 (ggml_e8m0_to_fp32_half): fp32 subnormals for
    e = 0, 1, never inf or NaN (e = 255 gives 2^127)."""
    e = np.asarray(e, dtype=np.uint32)
    bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - np.uint32(1)) << np.uint32(23))
    return bits.astype(np.uint32).view(np.float32)


def dequantize_mxfp4(raw: np.ndarray) -> np.ndarray:
    """MXFP4 bytes [..., whole blocks] -> float32 [..., 32 a block]: y = 2^(e - 128) * (2 * E2M1
    value); value j < 16 has code qs[j] & 15, value j + 16 code qs[j] >> 4."""
    blocks = _blocks(raw, MXFP4_BLOCK)
    codes = np.concatenate([blocks["qs"] & 15, blocks["qs"] >> 4], axis=1)
    with np.errstate(over="ignore"):  # e >= 254 with the largest codes: inf, as in gguf-py and on the GPU
        return (e8m0_half(blocks["e"])[:, None] * MXFP4_DOUBLED[codes]).reshape(*raw.shape[:-1], -1)


def e4m3_value(code: np.ndarray) -> np.ndarray:
    """E4M3FN codes (uint8) -> float32, exactly: (8 + m) * 2^(e - 10) for exponent e >= 1, m * 2^-9
    for e = 0, the sign bit 128; NaN where (code & 127) == 127."""
    c = np.asarray(code, dtype=np.uint32)
    e, m = (c >> 3) & 15, c & 7
    normal = ((e + np.uint32(120)) << np.uint32(23)) | (m << np.uint32(20))
    mag = np.where(e == 0, m.astype(np.float32) * np.float32(2.0**-9), normal.astype(np.uint32).view(np.float32))
    mag = np.where((c & 127) == 127, np.float32(np.nan), mag).astype(np.float32)
    return np.where(c & 128, -mag, mag).astype(np.float32)


E4M3_VALUES = e4m3_value(np.arange(256, dtype=np.uint8))  # float32 [256], by code
E4M3_NAN = 127  # (code & 127) == 127: NaN
E8M0_NAN = 255


def e8m0_value(e: np.ndarray) -> np.ndarray:
    """E8M0 scale bytes -> 2^(e - 127) as float32 (e = 0: the fp32 subnormal 2^-127; 255 is NaN
    and refused before this is asked)."""
    e = np.asarray(e, dtype=np.uint32)
    return np.where(e == 0, np.uint32(0x00400000), e << np.uint32(23)).astype(np.uint32).view(np.float32)


def check_e4m3_row264(raw: np.ndarray, first_row: int = 0, rows: np.ndarray | None = None) -> None:
    """ModelFormatError naming the first bad row of E4M3_ROW264 bytes [..., whole rows] (a NaN code,
    (code & 127) == 127, or a NaN scale, 255: ds4 refuses both). Row numbers are `rows[i]` when
    given (the rows a sample took), else first_row + i."""
    blocks = _blocks(raw, E4M3_ROW264_BLOCK)
    for field, bad_of, what in (("qs", lambda b: (b & 127) == E4M3_NAN, "an E4M3 NaN code"),
                                ("e", lambda b: b == E8M0_NAN, "an E8M0 NaN scale")):
        bad = np.argwhere(bad_of(blocks[field]))
        if bad.size:
            i, j = (int(v) for v in bad[0])
            row = int(rows[i]) if rows is not None else first_row + i
            byte = j + field_offset(E4M3_ROW264_BLOCK, field)
            raise ModelFormatError(
                f"E4M3_ROW264 row {row}: byte {byte} = {int(blocks[field][i, j])} is {what} "
                "(ds4 refuses codes with (code & 127) == 127 and scales of 255)")


def dequantize_e4m3_row264(raw: np.ndarray) -> np.ndarray:
    """E4M3_ROW264 bytes [..., whole rows] -> float32 [..., 256 a row]: e4m3(code) * 2^(scale - 127),
    rounded to bf16 as ds4 does. A NaN code or scale raises ModelFormatError (check_e4m3_row264)."""
    check_e4m3_row264(raw)
    blocks = _blocks(raw, E4M3_ROW264_BLOCK)
    groups = blocks["e"].shape[1]
    codes = blocks["qs"].reshape(blocks.shape[0], groups, -1)
    with np.errstate(over="ignore"):  # scales near 254 with the largest codes: inf, as on the GPU
        v = E4M3_VALUES[codes] * e8m0_value(blocks["e"])[:, :, None]
    return bf16_bits_to_f32(f32_to_bf16_bits(v)).reshape(*raw.shape[:-1], -1)


def quantize_e4m3_row264(x: np.ndarray) -> np.ndarray:
    """float32 [rows, k] -> E4M3_ROW264 bytes [rows, k / 256 * 264] (synthetic ds4 tables): per 32
    values the smallest E8M0 scale s with amax / 2^(s - 127) <= 448 (127 for an all-zero group),
    each code the nearest E4M3 value of x / 2^(s - 127), ties to even, clipped at +-448."""
    rows, k = x.shape
    per = E4M3_ROW264_BLOCK["qs"].shape[0] // E4M3_ROW264_BLOCK["e"].shape[0]
    g = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, per).astype(np.float64)
    amax = np.abs(g).max(axis=1)
    with np.errstate(divide="ignore"):
        s = np.where(amax > 0, np.ceil(np.log2(amax / 448.0)) + 127, 127)
    s = np.clip(s, 0, 254).astype(np.int64)
    v = np.abs(g) / np.exp2(s - 127.0)[:, None]
    _, ex = np.frexp(np.where(v > 0, v, 1.0))
    step = np.exp2(np.maximum(ex - 1, -6) - 3.0)  # the spacing of E4M3 values at v's binade
    q = np.minimum(np.rint(v / step) * step, 448.0)
    positive = E4M3_VALUES[:E4M3_NAN].astype(np.float64)  # codes 0..126, increasing
    codes = np.searchsorted(positive, q).astype(np.uint8)
    codes |= np.where((g < 0) & (codes > 0), np.uint8(128), np.uint8(0))
    blocks = np.zeros(rows * k // E4M3_ROW264_BLOCK["qs"].shape[0], dtype=E4M3_ROW264_BLOCK)
    blocks["qs"] = codes.reshape(blocks.shape[0], -1)
    blocks["e"] = s.astype(np.uint8).reshape(blocks.shape[0], -1)
    return blocks.view(np.uint8).reshape(rows, -1)


def _round_half_even(x: np.ndarray) -> np.ndarray:
    return np.rint(x).astype(np.int32)


def _round_half_away(x: np.ndarray) -> np.ndarray:
    """roundf: halves away from zero. floor(|x| + 0.5) would round 0.49999997 up in float32."""
    mag = np.abs(x)
    whole = np.floor(mag)
    return (np.sign(x) * (whole + np.floor(2 * (mag - whole)))).astype(np.float32)


def quantize_q8_0(x: np.ndarray) -> np.ndarray:
    """float32 [rows, k] -> Q8_0 bytes [rows, row_bytes]: d = amax / 127, levels round half away."""
    rows, k = x.shape
    groups = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, Q8_0_BLOCK["qs"].shape[0])
    d = np.abs(groups).max(axis=1, keepdims=True) / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
    blocks = np.zeros(groups.shape[0], dtype=Q8_0_BLOCK)
    blocks["d"] = d[:, 0].astype(np.float16)
    blocks["qs"] = _round_half_away(groups * inv).astype(np.int8)
    return blocks.view(np.uint8).reshape(rows, -1)


Q2_K_CHUNK_VALUES = 1 << 17  # the values quantize_q2_k fits at once (fastest of 2^14..2^20 here)


def _sum16(a: np.ndarray) -> np.ndarray:
    """The sums over axis 0 of a [16, m], added in the order NumPy's pairwise summation adds a row
    of 16 contiguous float32 (eight running sums a[j] + a[j + 8], then a tree), so each sum has the
    bits a.T.sum(axis=1) gives, at the speed of whole-vector adds."""
    s = a[:8] + a[8:]
    u = s[0::2] + s[1::2]
    v = u[0::2] + u[1::2]
    return v[0] + v[1]


def _fit_scale_min(x: np.ndarray, levels: int, n_trials: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row of x [m, 16]: a scale s >= 0, a minimum mn <= 0 and levels L in 0..levels with
    x ~= s * L + mn, minimising the |x|-weighted absolute error over a grid of trial scales.
    Returns (s [m], -mn [m]). Worked on x transposed ([16, m]: each of the 16 positions one
    contiguous vector), with each row's sums in NumPy's order (_sum16)."""
    assert x.shape[1] == 16, x.shape
    xt = np.ascontiguousarray(x.T, dtype=np.float32)
    w = np.abs(xt)
    lo = np.minimum(xt.min(axis=0), 0).astype(np.float32)
    hi = xt.max(axis=0).astype(np.float32)
    span = hi - lo
    flat = span == 0
    span = np.where(flat, np.float32(1), span)
    sum_w = _sum16(w)
    sum_x = _sum16(w * xt)
    above = xt - lo  # every trial's levels count from the row's minimum

    def levels_for(inv_scale: np.ndarray) -> np.ndarray:
        lv = inv_scale * above
        np.rint(lv, out=lv)
        return np.clip(lv, 0, levels, out=lv)

    inv0 = np.float32(levels) / span
    best_scale = (np.float32(1) / inv0).astype(np.float32)
    best_min = lo.copy()
    # the first error in float64, as int32 levels made it when the levels were integers (a float32
    # sum rounds differently, and a later trial's float32 error is compared with it)
    best_err = _sum16(w * np.abs(best_scale * levels_for(inv0).astype(np.int32) + lo - xt))
    for trial in range(n_trials + 1):
        inv = ((np.float32(-0.5) + np.float32(0.1) * trial + levels) / span).astype(np.float32)
        lv = levels_for(inv)
        wl = w * lv
        sum_l = _sum16(wl)
        sum_l2 = _sum16(wl * lv)
        sum_xl = _sum16(wl * xt)
        det = sum_w * sum_l2 - sum_l * sum_l
        ok = det > 0
        safe_det = np.where(ok, det, 1)
        scale = (sum_w * sum_xl - sum_x * sum_l) / safe_det
        minimum = (sum_l2 * sum_x - sum_l * sum_xl) / safe_det
        positive_min = minimum > 0
        scale = np.where(positive_min, sum_xl / np.where(sum_l2 > 0, sum_l2, 1), scale)
        minimum = np.where(positive_min, 0, minimum)
        err = _sum16(w * np.abs(scale * lv + minimum - xt))
        better = ok & ~flat & (err < best_err)
        best_err = np.where(better, err, best_err)
        best_scale = np.where(better, scale, best_scale).astype(np.float32)
        best_min = np.where(better, minimum, best_min).astype(np.float32)
    best_scale = np.where(flat, 0, best_scale).astype(np.float32)
    return best_scale, (-best_min).astype(np.float32)


def quantize_q2_k(x: np.ndarray) -> np.ndarray:
    """float32 [rows, k] -> Q2_K bytes [rows, row_bytes] (k a multiple of 256, checked by `quantize`),
    a few hundred rows at a time: each row's blocks are fitted alone, and the trials' temporaries
    stay in the CPU's caches. With _fit_scale_min's transposed layout a flash-sized model's Q2_K
    weights quantise 4.6x as fast as in one piece row-major (290 s -> 63 s), to the same bytes."""
    rows, k = x.shape
    step = max(1, Q2_K_CHUNK_VALUES // k)
    if rows > step:
        return np.concatenate([_quantize_q2_k_rows(x[r:r + step]) for r in range(0, rows, step)])
    return _quantize_q2_k_rows(x)


def _quantize_q2_k_rows(x: np.ndarray) -> np.ndarray:
    rows, k = x.shape
    sub = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, 16)
    scale, minimum = _fit_scale_min(sub, levels=3, n_trials=15)
    nb = sub.shape[0] // 16
    scale = scale.reshape(nb, 16)
    minimum = minimum.reshape(nb, 16)
    max_scale = scale.max(axis=1)
    max_min = minimum.max(axis=1)

    def nibbles(values: np.ndarray, top: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        with np.errstate(divide="ignore", invalid="ignore"):
            inv = np.where(top > 0, np.float32(15) / top, 0).astype(np.float32)
        q = np.clip(_round_half_even(inv[:, None] * values), 0, 15)
        return q.astype(np.uint8), (top / np.float32(15)).astype(np.float16)

    sc, d = nibbles(scale, max_scale)
    mn, dmin = nibbles(minimum, max_min)
    blocks = np.zeros(nb, dtype=Q2_K_BLOCK)
    blocks["scales"] = sc | (mn << 4)
    blocks["d"] = d
    blocks["dmin"] = dmin
    # final levels against the stored (rounded) scales
    step = d.astype(np.float32)[:, None] * sc.astype(np.float32)
    offset = dmin.astype(np.float32)[:, None] * mn.astype(np.float32)
    vals = sub.reshape(nb, 16, 16)
    with np.errstate(divide="ignore", invalid="ignore"):
        lv = _round_half_even((vals + offset[:, :, None]) / step[:, :, None])
    lv = np.where(step[:, :, None] > 0, np.clip(lv, 0, 3), 0).astype(np.uint8).reshape(nb, 2, 4, 32)
    packed = lv[:, :, 0] | (lv[:, :, 1] << 2) | (lv[:, :, 2] << 4) | (lv[:, :, 3] << 6)
    blocks["qs"] = packed.reshape(nb, 64)
    return blocks.view(np.uint8).reshape(rows, -1)



def quantize_mxfp4(x: np.ndarray) -> np.ndarray:
    """float32 [rows, k] -> MXFP4 bytes [rows, row_bytes], as gguf-py's quantiser: e =
    floor(log2(amax)) + 125 (0 for a zero block; clipped to a byte), each code the nearest of the
    doubled E2M1 values times 2^(e - 128), the first on a tie."""
    rows, k = x.shape
    groups = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, MXFP4_BLOCK["qs"].shape[0] * 2)
    amax = np.abs(groups).max(axis=1)
    with np.errstate(divide="ignore"):
        e = np.where(amax > 0, np.floor(np.log2(amax)) - 2 + 127, 0)
    e = np.clip(e, 0, 255).astype(np.uint8)
    errs = np.abs(e8m0_half(e)[:, None, None] * MXFP4_DOUBLED - groups[:, :, None])
    codes = np.argmin(errs, axis=-1).astype(np.uint8)
    half = codes.shape[1] // 2
    blocks = np.zeros(groups.shape[0], dtype=MXFP4_BLOCK)
    blocks["e"] = e
    blocks["qs"] = codes[:, :half] | (codes[:, half:] << np.uint8(4))
    return blocks.view(np.uint8).reshape(rows, -1)


def no_quantizer(gtype_name: str) -> Callable[[np.ndarray], np.ndarray]:
    """The quantiser of a type flashv41 only reads: it raises UnsupportedError."""
    def quantize_unsupported(x: np.ndarray) -> np.ndarray:
        raise UnsupportedError(
            f"flashv41 does not quantise to {gtype_name} (it reads {gtype_name} weights; gguf-py has no "
            f"{gtype_name} quantiser either): take stored rows from a GGUF file, or random valid ones "
            f"from host.quants.random_blocks")

    return quantize_unsupported


def quantize_f32(x: np.ndarray) -> np.ndarray:
    return x.copy()


def quantize_f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def quantize_bf16(x: np.ndarray) -> np.ndarray:
    return f32_to_bf16_bits(x).view(np.uint8).reshape(x.shape[0], -1)


@dataclass(frozen=True)
class QuantFormat:
    """One ggml type as the host handles it: `block_values` values in a `block` record, the
    dequantiser of stored bytes [..., whole blocks] -> float32 [..., values] and the quantiser of
    float32 [rows, k] -> the stored form (typed rows for F32 / F16, else bytes [rows, row_bytes])."""

    ggml_type: GGMLType | RowType
    block: np.dtype
    block_values: int
    dequantize: Callable[[np.ndarray], np.ndarray]
    quantize: Callable[[np.ndarray], np.ndarray]
    table_only: bool = False  # a table format (RowType): engram tables may use it, matrices not

    @property
    def block_bytes(self) -> int:
        return self.block.itemsize

    def row_bytes(self, n_values: int) -> int:
        """Bytes of a row of `n_values` values; the row must hold whole blocks."""
        if n_values % self.block_values:
            raise UnsupportedError(
                f"{self.ggml_type.name} packs {self.block_values} values a block; "
                f"a row of {n_values} values does not split into whole blocks"
            )
        return n_values // self.block_values * self.block_bytes


# The table of quant types: adding a type is adding its block dtype above and a row here (and its
# device pieces in its family's module of stages.quants: see its package docstring).
FORMATS: dict[GGMLType | RowType, QuantFormat] = {
    GGMLType.F32: QuantFormat(GGMLType.F32, F32_BLOCK, 1, dequantize_f32, quantize_f32),
    GGMLType.F16: QuantFormat(GGMLType.F16, F16_BLOCK, 1, dequantize_f16, quantize_f16),
    GGMLType.BF16: QuantFormat(GGMLType.BF16, BF16_BLOCK, 1, dequantize_bf16, quantize_bf16),
    GGMLType.Q8_0: QuantFormat(GGMLType.Q8_0, Q8_0_BLOCK, Q8_0_BLOCK["qs"].shape[0], dequantize_q8_0,
                               quantize_q8_0),
    GGMLType.Q2_K: QuantFormat(GGMLType.Q2_K, Q2_K_BLOCK, 256, dequantize_q2_k, quantize_q2_k),
    GGMLType.Q3_K: QuantFormat(GGMLType.Q3_K, Q3_K_BLOCK, 256, dequantize_q3_k, no_quantizer("Q3_K")),
    GGMLType.Q4_K: QuantFormat(GGMLType.Q4_K, Q4_K_BLOCK, 256, dequantize_q4_k, no_quantizer("Q4_K")),
    GGMLType.Q5_K: QuantFormat(GGMLType.Q5_K, Q5_K_BLOCK, 256, dequantize_q5_k, no_quantizer("Q5_K")),
    GGMLType.Q6_K: QuantFormat(GGMLType.Q6_K, Q6_K_BLOCK, 256, dequantize_q6_k, no_quantizer("Q6_K")),
    GGMLType.MXFP4: QuantFormat(GGMLType.MXFP4, MXFP4_BLOCK, MXFP4_BLOCK["qs"].shape[0] * 2, dequantize_mxfp4,
                                quantize_mxfp4),
    RowType.E4M3_ROW264: QuantFormat(RowType.E4M3_ROW264, E4M3_ROW264_BLOCK, E4M3_ROW264_BLOCK["qs"].shape[0],
                                     dequantize_e4m3_row264, quantize_e4m3_row264, table_only=True),
}


def ggml_type(value: int | str | GGMLType) -> GGMLType:
    """The GGMLType for an id or a name ("Q8_0", "bf16"); an unsupported one raises UnsupportedError."""
    try:
        if isinstance(value, str):
            return GGMLType[value.upper()]
        return GGMLType(int(value))
    except (KeyError, ValueError):
        names = ", ".join(t.name for t in GGMLType)
        raise UnsupportedError(f"ggml type {value!r} is not supported (supported: {names})") from None


def quant_format(value: int | str | GGMLType | RowType) -> QuantFormat:
    """The table row of a ggml type (id, name or GGMLType) or of a table format (a RowType or its name)."""
    if isinstance(value, RowType):
        return FORMATS[value]
    if isinstance(value, str) and value.upper() in RowType.__members__:
        return FORMATS[RowType[value.upper()]]
    return FORMATS[ggml_type(value)]


def dequantize(data: np.ndarray, qtype: int | str | GGMLType | RowType, n_values: int | None = None) -> np.ndarray:
    """Any supported tensor's stored form -> float32.

    `data` is what the file holds: raw bytes (uint8, the last axis one or more whole rows) or a
    typed array (F32 / F16 values). Raw bytes give [..., n_values] when the last axis is exactly
    one row, else [rows, n_values]; `n_values` (values per row) defaults to the last axis' worth.
    """
    fmt = quant_format(qtype)
    data = np.asarray(data)
    if data.dtype != np.uint8:
        if fmt.ggml_type not in (GGMLType.F32, GGMLType.F16):
            raise ValueError(f"{fmt.ggml_type.name} data must be raw bytes (uint8), got {data.dtype}")
        return data.astype(np.float32)
    if n_values is None:
        n_values = data.shape[-1] // fmt.block_bytes * fmt.block_values if data.ndim else 0
    row_bytes = fmt.row_bytes(n_values)
    if data.size % row_bytes:
        raise ValueError(f"{data.size} bytes do not make rows of {row_bytes} bytes "
                         f"({n_values} {fmt.ggml_type.name} values)")
    one_row_per_line = data.ndim and data.shape[-1] == row_bytes
    shape = (*data.shape[:-1], n_values) if one_row_per_line else (data.size // row_bytes, n_values)
    raw = np.ascontiguousarray(data).reshape(-1, row_bytes)
    if raw.shape[0] == 0:
        return np.zeros(shape, np.float32)
    return fmt.dequantize(raw).reshape(shape)


def quantize(x: np.ndarray, qtype: int | str | GGMLType | RowType) -> np.ndarray:
    """float32 [rows, k] -> the stored form of `qtype`: typed array (F32, F16) or bytes [rows, bytes]."""
    fmt = quant_format(qtype)
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim == 1:
        x = x[None, :]
    fmt.row_bytes(x.shape[1])
    return fmt.quantize(x)


def random_blocks(qtype: int | str | GGMLType, n_rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random valid stored rows of `qtype`, uint8 [n_rows, row_bytes] (tests, synthetic files).

    Block types: every level, sub-scale, min and high-bit byte uniformly random over its whole
    range; the fp16 scales d and dmin positive with magnitudes log-uniform in 1e-3 .. 1e-2; an
    MXFP4 exponent in 116 .. 123 (values up to 12 * 2^-5 = 0.375). F32 / F16 / BF16: Gaussian values
    of RMS k**-0.5, stored.
    """
    fmt = quant_format(qtype)
    row_bytes = fmt.row_bytes(k)
    fields: Mapping[str, Any] = fmt.block.fields or {}
    if "v" in fields:
        values = (rng.standard_normal((n_rows, k)) * k**-0.5).astype(np.float32)
        return np.ascontiguousarray(fmt.quantize(values)).view(np.uint8).reshape(n_rows, row_bytes)
    raw = rng.integers(0, 256, (n_rows, row_bytes), dtype=np.uint8)
    blocks = raw.view(fmt.block)  # [n_rows, blocks a row]
    for name in ("d", "dmin"):
        if name in fields:
            blocks[name] = (10.0 ** rng.uniform(-3, -2, blocks.shape)).astype(np.float16)
    if "e" in fields:
        blocks["e"] = rng.integers(116, 124, blocks["e"].shape)
    if fmt.ggml_type == RowType.E4M3_ROW264:  # no NaN codes (code & 127 == 127): 126 instead
        blocks["qs"] = np.where((blocks["qs"] & 127) == E4M3_NAN, blocks["qs"] ^ 1, blocks["qs"])
    return raw
