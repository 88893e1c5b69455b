"""GGUF tensor codecs in NumPy: the block layouts flashv41 reads, dequantisation to float32, and the
quantisers the synthetic-model writer uses.

Supported types: F32, F16, BF16, Q8_0 and Q2_K, each declared once in the table `FORMATS` (its
block layout a NumPy structured dtype whose size is asserted, values a block, dequantiser and
quantiser); stages.quant_types adds each type's device pieces. Every dequantised value is exact
in float32 (a Q2_K value is an fp16 scale times a 4-bit sub-scale times a 2-bit level, at most 17
significant bits), so the GPU kernels can reproduce these results bit for bit whatever their
operation order. Dequantisation agrees bit for bit with gguf-py's
`gguf.quants.dequantize` (tests/test_quants.py holds it to that).

The Q2_K quantiser follows the idea of ggml's reference quantiser: per 16-value sub-block a
weighted least-squares fit of a scale and a minimum over a small grid of trial scales, then the
sub-scales and sub-minimums quantised to 4 bits against the block's fp16 `d` and `dmin`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum

import numpy as np

from flashv41.host.errors import UnsupportedError


class GGMLType(IntEnum):
    """The ggml type ids flashv41 knows (values as in ggml.h / gguf-py)."""

    F32 = 0
    F16 = 1
    Q8_0 = 8
    Q2_K = 10
    BF16 = 30


# The block layouts, each declared here once (ggml-common.h); the loader, the oracle and the device
# pieces (stages.quant_types) read sizes and field offsets from these dtypes, never re-type them.
F32_BLOCK = np.dtype([("v", "<f4")])
F16_BLOCK = np.dtype([("v", "<f2")])
BF16_BLOCK = np.dtype([("v", "<u2")])  # the bf16 bit pattern
# Q8_0: an fp16 scale and 32 signed 8-bit levels; value = d * qs.
Q8_0_BLOCK = np.dtype([("d", "<f2"), ("qs", "i1", (32,))])
# Q2_K: 16 bytes of (min << 4 | scale) nibbles, 64 bytes of 2-bit levels, fp16 d, dmin.
Q2_K_BLOCK = np.dtype([("scales", "u1", (16,)), ("qs", "u1", (64,)), ("d", "<f2"), ("dmin", "<f2")])
assert (F32_BLOCK.itemsize, F16_BLOCK.itemsize, BF16_BLOCK.itemsize, Q8_0_BLOCK.itemsize, Q2_K_BLOCK.itemsize) \
    == (4, 2, 2, 34, 84)


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


def _fit_scale_min(x: np.ndarray, levels: int, n_trials: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row of x [m, n]: a scale s >= 0, a minimum mn <= 0 and levels L in 0..levels with
    x ~= s * L + mn, minimising the |x|-weighted absolute error over a grid of trial scales.
    Returns (s [m], -mn [m], L [m, n])."""
    w = np.abs(x)
    lo = np.minimum(x.min(axis=1), 0).astype(np.float32)
    hi = x.max(axis=1).astype(np.float32)
    span = hi - lo
    flat = span == 0
    span = np.where(flat, np.float32(1), span)
    sum_w = w.sum(axis=1)
    sum_x = (w * x).sum(axis=1)

    def levels_for(inv_scale: np.ndarray, offset: np.ndarray) -> np.ndarray:
        return np.clip(_round_half_even(inv_scale[:, None] * (x - offset[:, None])), 0, levels)

    inv0 = np.float32(levels) / span
    best_scale = (np.float32(1) / inv0).astype(np.float32)
    best_min = lo.copy()
    best_levels = levels_for(inv0, lo)
    best_err = (w * np.abs(best_scale[:, None] * best_levels + lo[:, None] - x)).sum(axis=1)
    for trial in range(n_trials + 1):
        inv = ((np.float32(-0.5) + np.float32(0.1) * trial + levels) / span).astype(np.float32)
        lv = levels_for(inv, lo).astype(np.float32)
        sum_l = (w * lv).sum(axis=1)
        sum_l2 = (w * lv * lv).sum(axis=1)
        sum_xl = (w * lv * x).sum(axis=1)
        det = sum_w * sum_l2 - sum_l * sum_l
        ok = det > 0
        safe_det = np.where(ok, det, 1)
        scale = (sum_w * sum_xl - sum_x * sum_l) / safe_det
        minimum = (sum_l2 * sum_x - sum_l * sum_xl) / safe_det
        positive_min = minimum > 0
        scale = np.where(positive_min, sum_xl / np.where(sum_l2 > 0, sum_l2, 1), scale)
        minimum = np.where(positive_min, 0, minimum)
        err = (w * np.abs(scale[:, None] * lv + minimum[:, None] - x)).sum(axis=1)
        better = ok & ~flat & (err < best_err)
        best_err = np.where(better, err, best_err)
        best_scale = np.where(better, scale, best_scale).astype(np.float32)
        best_min = np.where(better, minimum, best_min).astype(np.float32)
        best_levels = np.where(better[:, None], lv, best_levels)
    best_scale = np.where(flat, 0, best_scale).astype(np.float32)
    best_levels = np.where(flat[:, None], 0, best_levels)
    return best_scale, (-best_min).astype(np.float32), best_levels.astype(np.int32)


def quantize_q2_k(x: np.ndarray) -> np.ndarray:
    """float32 [rows, k] -> Q2_K bytes [rows, row_bytes] (k a multiple of 256, checked by `quantize`)."""
    rows, k = x.shape
    sub = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, 16)
    scale, minimum, _ = _fit_scale_min(sub, levels=3, n_trials=15)
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

    ggml_type: GGMLType
    block: np.dtype
    block_values: int
    dequantize: Callable[[np.ndarray], np.ndarray]
    quantize: Callable[[np.ndarray], np.ndarray]

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
# device pieces in stages.quant_types).
FORMATS: dict[GGMLType, QuantFormat] = {
    GGMLType.F32: QuantFormat(GGMLType.F32, F32_BLOCK, 1, dequantize_f32, quantize_f32),
    GGMLType.F16: QuantFormat(GGMLType.F16, F16_BLOCK, 1, dequantize_f16, quantize_f16),
    GGMLType.BF16: QuantFormat(GGMLType.BF16, BF16_BLOCK, 1, dequantize_bf16, quantize_bf16),
    GGMLType.Q8_0: QuantFormat(GGMLType.Q8_0, Q8_0_BLOCK, Q8_0_BLOCK["qs"].shape[0], dequantize_q8_0,
                               quantize_q8_0),
    GGMLType.Q2_K: QuantFormat(GGMLType.Q2_K, Q2_K_BLOCK, 256, dequantize_q2_k, quantize_q2_k),
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


def quant_format(value: int | str | GGMLType) -> QuantFormat:
    return FORMATS[ggml_type(value)]


def dequantize(data: np.ndarray, qtype: int | str | GGMLType, n_values: int | None = None) -> np.ndarray:
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


def quantize(x: np.ndarray, qtype: int | str | GGMLType) -> np.ndarray:
    """float32 [rows, k] -> the stored form of `qtype`: typed array (F32, F16) or bytes [rows, bytes]."""
    fmt = quant_format(qtype)
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim == 1:
        x = x[None, :]
    fmt.row_bytes(x.shape[1])
    return fmt.quantize(x)
