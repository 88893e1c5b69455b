"""The number formats and elementary operations of the V4.1 math, in NumPy, as the oracle and the
tests use them.

Conventions (they define what "exact" means everywhere in flashv41):

- A bf16 tensor is held as float32 values that are bf16-representable; `bf16()` rounds to nearest
  even. Bit patterns (uint16), as the GPU stores them, convert with `to_bits` / `from_bits`.
- Elementwise arithmetic runs in float32, in the reference's operation order.
- Every reduction (dot products, sums of squares, softmax sums) is accumulated in float64 and
  rounded once to the dtype the reference holds there, so a result never depends on how many
  rows are computed together (chunked prefill == one-shot prefill, exactly).
- Transcendentals (exp, sqrt, rsqrt, sigmoid, cos, sin) are evaluated in float64 and rounded once
  to float32: correctly rounded for all practical purposes.
- The model-level quantisers (`act_quant`, `fp4_act_quant`) reproduce the reference kernels bit for
  bit: power-of-two scales from the exponent bits, saturating round-to-nearest-even casts, the
  E2M1 tie rule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from flashv41.host.config import ModelConfig
from flashv41.host.quants import bf16_bits_to_f32, f32_to_bf16_bits

F32 = np.float32
FP8_MAX = 448.0
FP4_MAX = 6.0
FP8_MAX_INV = F32(1.0 / FP8_MAX)
FP4_MAX_INV = F32(1.0 / FP4_MAX)
# E2M1 magnitudes by code, the midpoints between neighbours, and which midpoints round up (the upper
# code is even there: 0.75 -> 1.0, 1.75 -> 2.0, 3.5 -> 4.0).
E2M1_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=F32)
E2M1_MIDS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=F32)
E2M1_TIE_UP = np.array([False, True, False, True, False, True, False])


def f32(x) -> np.ndarray:
    """Round a float64 (or any) array to float32 once."""
    return np.asarray(x).astype(F32)


def bf16(x) -> np.ndarray:
    """Round float32 values to the nearest bf16 (ties to even); result still float32."""
    return from_bits(to_bits(x))


def to_bits(x) -> np.ndarray:
    """float32 values -> bf16 bit patterns (uint16), round to nearest even."""
    return f32_to_bf16_bits(np.asarray(x, dtype=F32))


def from_bits(bits) -> np.ndarray:
    """bf16 bit patterns (uint16) -> float32 values."""
    return bf16_bits_to_f32(bits)


def exp(x) -> np.ndarray:
    return f32(np.exp(np.asarray(x, dtype=np.float64)))


def sqrt(x) -> np.ndarray:
    return f32(np.sqrt(np.asarray(x, dtype=np.float64)))


def rsqrt(x) -> np.ndarray:
    return f32(1.0 / np.sqrt(np.asarray(x, dtype=np.float64)))


def sigmoid(x) -> np.ndarray:
    return f32(1.0 / (1.0 + np.exp(-np.asarray(x, dtype=np.float64))))


def dot_last(a, b) -> np.ndarray:
    """sum over the last axis of a * b, float64 accumulation, rounded to float32."""
    return f32(np.einsum("...k,...k->...", np.asarray(a, np.float64), np.asarray(b, np.float64)))


def sum_last(a) -> np.ndarray:
    return f32(np.asarray(a, np.float64).sum(axis=-1))


def mean_square(x) -> np.ndarray:
    """mean(x^2) over the last axis: float64 accumulation of the float32 squares, one rounding."""
    x64 = np.asarray(x, np.float64)
    sq = f32(x64 * x64).astype(np.float64)
    return f32(sq.sum(axis=-1) / x64.shape[-1])


def matmul_t(x, w) -> np.ndarray:
    """x [..., K] @ w[N, K]^T with float64 accumulation, rounded to float32 -> [..., N]."""
    x64 = np.asarray(x, np.float64)
    w64 = np.asarray(w, np.float64)
    return f32(x64 @ w64.T)


def linear(x, w) -> np.ndarray:
    """A GGUF linear layer: bf16(sum_k x[k] * w[n, k]), fp32 accumulation.

    x: bf16 values [..., K]; w: dequantised float32 [N, K]; result bf16 values [..., N].
    """
    return bf16(matmul_t(x, w))


def rms_norm(x, weight, eps: float, out_bf16: bool = True) -> np.ndarray:
    """RMSNorm as the reference's: weight * (x * rsqrt(mean(x^2) + eps)), fp32 math, bf16 out."""
    x = np.asarray(x, F32)
    r = rsqrt(mean_square(x) + F32(eps))
    y = np.asarray(weight, F32) * (x * r[..., None])
    return bf16(y) if out_bf16 else y


def pow2_ceil_scale(amax, max_inv: np.float32) -> np.ndarray:
    """2^ceil(log2(amax * max_inv)) from the float32 bits (the kernels' fast_round_scale)."""
    x = np.ascontiguousarray(np.asarray(amax, F32) * max_inv, dtype=F32)
    bits = x.view(np.int32)
    exponent = (bits >> 23) & 0xFF
    mantissa = bits & ((1 << 23) - 1)
    log2_ceil = exponent - 127 + (mantissa != 0).astype(np.int32)
    return ((log2_ceil + 127) << 23).astype(np.int32).view(F32)


def e4m3(x) -> np.ndarray:
    """float32 -> nearest float8 e4m3fn value (ties to even), saturating at +-448; as float32."""
    x = np.clip(np.asarray(x, F32), -FP8_MAX, FP8_MAX).astype(np.float64)
    mag = np.abs(x)
    # quantum: 2^-9 below the smallest normal 2^-6, else 2^(exponent - 3)
    exponent = np.floor(np.log2(np.where(mag > 0, mag, 1.0)))
    quantum = np.where(mag < 2.0**-6, 2.0**-9, np.exp2(exponent - 3))
    return f32(np.rint(x / quantum) * quantum)


def e2m1(x) -> np.ndarray:
    """float32 in [-6, 6] -> nearest E2M1 value, the even-code tie rule, sign of zero kept."""
    x = np.asarray(x, F32)
    mag = np.abs(x)[..., None]
    code = (mag > E2M1_MIDS).sum(-1) + ((mag == E2M1_MIDS) & E2M1_TIE_UP).sum(-1)
    return np.where(np.signbit(x), -E2M1_GRID[code], E2M1_GRID[code]).astype(F32)


def act_quant(x, block: int = 32) -> np.ndarray:
    """fp8 quantise-dequantise of bf16 values in blocks along the last axis (the window kv).

    scale = 2^ceil(log2(max(amax, 1e-4) / 448)); q = e4m3(x / scale); y = bf16(q * scale).
    """
    x = np.asarray(x, F32)
    g = x.reshape(*x.shape[:-1], -1, block)
    amax = np.maximum(np.abs(g).max(axis=-1), F32(1e-4))
    s = pow2_ceil_scale(amax, FP8_MAX_INV)[..., None]
    return bf16(e4m3(g / s) * s).reshape(x.shape)


def fp4_act_quant(x, block: int, e4m3_scale: bool) -> np.ndarray:
    """fp4 (E2M1) quantise-dequantise of bf16 values in blocks along the last axis.

    e4m3_scale (compressed kv, block 16): scale = e4m3(max(amax, 6 * 2^-9) / 6).
    otherwise (index q / k, block 32): scale = 2^ceil(log2(max(amax, 6 * 2^-126) / 6)).
    y = bf16(e2m1(clamp(x / scale, -6, 6)) * scale).
    """
    x = np.asarray(x, F32)
    g = x.reshape(*x.shape[:-1], -1, block)
    amax = np.abs(g).max(axis=-1)
    if e4m3_scale:
        s = e4m3(np.maximum(amax, F32(6 * 2.0**-9)) / F32(FP4_MAX))
    else:
        s = pow2_ceil_scale(np.maximum(amax, F32(6 * 2.0**-126)), FP4_MAX_INV)
    s = s[..., None]
    v = np.clip(g / s, F32(-FP4_MAX), F32(FP4_MAX))
    return bf16(e2m1(v) * s).reshape(x.shape)


def rope_table(rope_dim: int, n_pos: int, base: float, yarn: tuple[float, int, float, float] | None):
    """(cos, sin) float32 [n_pos, rope_dim / 2] of the rotary angles pos * freq_i.

    yarn = (factor, original_len, beta_fast, beta_slow) or None. With YaRN, frequencies whose
    wavelength exceeds the original context are divided by `factor`, with a linear ramp between the
    corrected dims of beta_fast and beta_slow (no attention-scale correction).
    """
    idx = np.arange(0, rope_dim, 2, dtype=F32) / F32(rope_dim)
    freqs = F32(1.0) / f32(np.power(np.float64(base), idx.astype(np.float64)))
    if yarn is not None and yarn[1] > 0:
        factor, original, beta_fast, beta_slow = yarn

        def corrected_dim(rotations: float) -> float:
            return rope_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(corrected_dim(beta_fast)), 0)
        high = min(math.ceil(corrected_dim(beta_slow)), rope_dim - 1)
        ramp = np.clip((np.arange(rope_dim // 2, dtype=F32) - F32(low)) / F32(max(high - low, 1e-3)), 0, 1)
        smooth = F32(1) - ramp
        freqs = (freqs / F32(factor) * (F32(1) - smooth) + freqs * smooth).astype(F32)
    angles = np.arange(n_pos, dtype=F32)[:, None] * freqs[None, :]
    a64 = angles.astype(np.float64)
    return f32(np.cos(a64)), f32(np.sin(a64))


@dataclass
class RopeTables:
    """cos / sin float32 [max_seq, R/2] of the two rotations: plain (ratio 0) and compressed (YaRN)."""

    plain: tuple[np.ndarray, np.ndarray]
    compressed: tuple[np.ndarray, np.ndarray]

    def for_ratio(self, ratio: int) -> tuple[np.ndarray, np.ndarray]:
        return self.compressed if ratio > 0 else self.plain


def rope_tables(cfg: ModelConfig, max_seq: int) -> RopeTables:
    """The two rotation tables of a model, for positions 0..max_seq-1."""
    yarn = (cfg.rope_factor, cfg.rope_original_ctx, cfg.beta_fast, cfg.beta_slow)
    return RopeTables(
        plain=rope_table(cfg.rope_dim, max_seq, cfg.rope_theta, None),
        compressed=rope_table(cfg.rope_dim, max_seq, cfg.compress_rope_theta, yarn),
    )


def rotate(x, cos, sin, inverse: bool = False) -> np.ndarray:
    """Rotate interleaved pairs (x[2i], x[2i+1]) of the last axis by the angle whose (cos, sin) is
    given (broadcast against x[..., ::2]); fp32 complex product, bf16 out. `inverse` conjugates."""
    x = np.asarray(x, F32)
    a, b = x[..., 0::2], x[..., 1::2]
    c = np.asarray(cos, F32)
    d = -np.asarray(sin, F32) if inverse else np.asarray(sin, F32)
    out = np.empty_like(x)
    out[..., 0::2] = a * c - b * d
    out[..., 1::2] = a * d + b * c
    return bf16(out)
