"""RMSNorm, RoPE and the two model-level quantisers on the device, each bit-exact to its oracle.

Shapes and dtypes (R rows; bf16 = uint16 bit patterns on the device). Each wrapper takes its oracle
function's arguments in the oracle's order, then the device's own (output, row count, stream):
- `rms_norm(x, weight, eps, out, n_rows)`: x bf16 or fp32 [R, C], weight fp32 [C], out bf16 [R, C]
  (may be x itself). Oracle: host.numerics.rms_norm(x, weight, eps).
- `rope(x, cos, sin, positions, inverse, n_rows, heads)`: in place on bf16 [R, heads * D] (the
  oracle's [R, heads, D], heads side by side in a row), the last rope_dim values of every head
  rotated by the angle of position positions[r] (int32 [R]); cos, sin fp32 [max_seq, rope_dim / 2].
  Oracle: host.oracle.attention.rope_tail(x, cos, sin, positions, inverse).
- `act_quant(x, n_rows)`: in place on bf16 [R, C], fp8 e4m3 blocks of 32. Oracle:
  host.numerics.act_quant(x).
- `fp4_quant(x, block, e4m3_scale, n_rows)`: in place on bf16 [R, C], E2M1 blocks of 16 (E4M3
  scale) or 32 (E8M0 scale). Oracle: host.numerics.fp4_act_quant(x, block, e4m3_scale).

Why every result here equals the oracle's bit for bit (not just within an ulp):
- RMSNorm squares in fp32 and sums the squares in float64, as the oracle does; a float64 sum of
  C <= 2^20 fp32 squares rounds to the same fp32 mean in any order (the float64 error is below
  2^-32 relative, the fp32 rounding step 2^-24), unless the exact mean sits within 2^-32 of an fp32
  rounding boundary, which no test input does. 1/sqrt is taken in float64 and rounded once, like
  the oracle's; the two products are fp32 in the oracle's order.
- RoPE: both products of each output are rounded before the add or subtract (`mul_rn`: NVVM would
  otherwise contract one of them into an FMA), then one bf16 rounding, exactly the NumPy sequence.
- The quantisers use only exact operations: power-of-two scales from exponent bits, IEEE division
  (Numba-CUDA without fastmath divides exactly), e4m3 / E2M1 rounding on the bits, products of a
  few significant bits.
"""

from __future__ import annotations

import math
from functools import cache

import numpy as np
from numba import cuda, float32, float64, int32, uint32

from flashv41.host.errors import InputError
from flashv41.stages.device import (
    SIM,
    DeviceArray,
    bf16_to_f32,
    check_array,
    check_rows,
    device,
    f32_bits,
    f32_from_bits,
    f32_to_bf16,
    grid_1d,
    jit_for,
    load_f32,
    mul_rn,
    rint_f32,
)

ACT_BLOCK = 32
FP8_MAX = float32(448.0)
FP8_MAX_INV = float32(1.0 / 448.0)
FP4_MAX = float32(6.0)
FP4_MAX_INV = float32(1.0 / 6.0)
ACT_AMAX_FLOOR = float32(1e-4)
FP4_E4M3_FLOOR = float32(6 * 2.0**-9)
FP4_E8M0_FLOOR = float32(6 * 2.0**-126)
E4M3_MIN_NORMAL = float32(2.0**-6)
E4M3_SUB_STEPS = float32(512.0)  # 1 / 2^-9, the subnormal quantum
E4M3_SUB_QUANTUM = float32(2.0**-9)

# Threads per block. The simulator runs every thread as a Python thread and a barrier costs about
# 5 ms, so there reductions run one thread per block (no barrier at all); tests also run the
# multi-thread variants there on a few rows.
NORM_THREADS = 1 if SIM else 128
ELEM_THREADS = 64 if SIM else 128


@device
def pow2_ceil(amax, max_inv):
    """2^ceil(log2(amax * max_inv)) read off the fp32 bits (host.numerics.pow2_ceil_scale)."""
    bits = f32_bits(mul_rn(amax, max_inv))
    exponent = int32((bits >> 23) & 0xFF)
    log2_ceil = exponent - 127 + (1 if (bits & 0x7FFFFF) != 0 else 0)
    return f32_from_bits(uint32(log2_ceil + 127) << 23)


@device
def e4m3_round(x):
    """fp32 -> the nearest float8 e4m3fn value (ties to even), saturating at +-448; as fp32."""
    x = float32(x)
    if x > FP8_MAX:
        x = FP8_MAX
    elif x < -FP8_MAX:
        x = -FP8_MAX
    if abs(x) < E4M3_MIN_NORMAL:
        return rint_f32(x * E4M3_SUB_STEPS) * E4M3_SUB_QUANTUM  # both products exact
    u = f32_bits(x)
    # keep 3 mantissa bits: round to nearest even on the 20 dropped bits (a carry may bump the
    # exponent, which is right; 448 is representable, so nothing rounds past it)
    u = (u + uint32(0x7FFFF) + ((u >> 20) & 1)) & uint32(0xFFF00000)
    return f32_from_bits(u)


@device
def e2m1_round(v):
    """fp32 in [-6, 6] -> the nearest E2M1 value with the reference's tie rule (ties go to the
    even code: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4); the sign
    of v is kept, zero included."""
    m = abs(float32(v))
    if m <= 0.25:
        r = float32(0.0)
    elif m < 0.75:
        r = float32(0.5)
    elif m <= 1.25:
        r = float32(1.0)
    elif m < 1.75:
        r = float32(1.5)
    elif m <= 2.5:
        r = float32(2.0)
    elif m < 3.5:
        r = float32(3.0)
    elif m <= 5.0:
        r = float32(4.0)
    else:
        r = float32(6.0)
    return -r if (f32_bits(v) >> 31) != 0 else r


@device
def block_amax(x, r, c0, n):
    """max |x[r, c0:c0 + n]| of a row of bf16 bits, as float32 (exact: a max takes no rounding)."""
    amax = float32(0)
    for c in range(c0, c0 + n):
        amax = max(amax, abs(bf16_to_f32(x[r, c])))
    return amax


@cache
def rms_norm_kernel(x_bf16: bool, threads: int):
    """One block of `threads` threads per row: float64 partial sums, a tree in shared memory.
    x bf16 bits (x_bf16) or fp32 [R, width], weight fp32 [width], out bf16 [R, width]."""
    sync = threads > 1

    @jit_for(threads)
    def kernel(x, weight, out, n_rows, width, eps):
        partial = cuda.shared.array(threads, float64)  # [threads]: each thread's sum of squares
        r = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        acc = float64(0)
        for c in range(tid, width, threads):
            v = load_f32(x, r, c, x_bf16)
            acc += float64(mul_rn(v, v))
        partial[tid] = acc
        step = threads // 2
        while step > 0:
            if sync:
                cuda.syncthreads()
            if tid < step:
                partial[tid] += partial[tid + step]
            step //= 2
        if sync:
            cuda.syncthreads()
        mean = float32(partial[0] / float64(width))
        rs = float32(1.0 / math.sqrt(float64(mean + eps)))
        # a thread rewrites only the values it read itself, so out may be x
        for c in range(tid, width, threads):
            out[r, c] = f32_to_bf16(mul_rn(weight[c], mul_rn(load_f32(x, r, c, x_bf16), rs)))

    return kernel


@cuda.jit
def _rope_kernel(x, cos, sin, positions, n_rows, heads, head_dim, rope_dim, inverse):
    """One thread per (row, head, pair); pairs (2i, 2i+1) of each head's last rope_dim values.
    x bf16 [R, heads * head_dim] in place; cos, sin fp32 [max_seq, rope_dim / 2]; positions int32 [R]."""
    half = rope_dim // 2
    i = cuda.grid(1)
    if i >= n_rows * heads * half:
        return
    pair = i % half
    h = (i // half) % heads
    r = i // (half * heads)
    pos = positions[r]
    c = cos[pos, pair]
    s = -sin[pos, pair] if inverse else sin[pos, pair]
    col = h * head_dim + head_dim - rope_dim + 2 * pair
    a = bf16_to_f32(x[r, col])
    b = bf16_to_f32(x[r, col + 1])
    x[r, col] = f32_to_bf16(mul_rn(a, c) - mul_rn(b, s))
    x[r, col + 1] = f32_to_bf16(mul_rn(a, s) + mul_rn(b, c))


@cuda.jit
def _act_quant_kernel(x, n_rows, width):
    """One thread per block of 32 values: fp8 e4m3 quantise-dequantise with a power-of-two scale.
    x bf16 [R, width] in place."""
    i = cuda.grid(1)
    per_row = width // ACT_BLOCK
    if i >= n_rows * per_row:
        return
    r = i // per_row
    c0 = (i % per_row) * ACT_BLOCK
    s = pow2_ceil(max(block_amax(x, r, c0, ACT_BLOCK), ACT_AMAX_FLOOR), FP8_MAX_INV)
    for c in range(c0, c0 + ACT_BLOCK):
        x[r, c] = f32_to_bf16(mul_rn(e4m3_round(bf16_to_f32(x[r, c]) / s), s))


@cuda.jit
def _fp4_quant_kernel(x, n_rows, width, block, e4m3_scale):
    """One thread per block: E2M1 quantise-dequantise, E4M3 or E8M0 (power-of-two) scale.
    x bf16 [R, width] in place."""
    i = cuda.grid(1)
    per_row = width // block
    if i >= n_rows * per_row:
        return
    r = i // per_row
    c0 = (i % per_row) * block
    amax = block_amax(x, r, c0, block)
    if e4m3_scale:
        s = e4m3_round(max(amax, FP4_E4M3_FLOOR) / FP4_MAX)
    else:
        s = pow2_ceil(max(amax, FP4_E8M0_FLOOR), FP4_MAX_INV)
    for c in range(c0, c0 + block):
        v = bf16_to_f32(x[r, c]) / s
        v = min(max(v, -FP4_MAX), FP4_MAX)
        x[r, c] = f32_to_bf16(mul_rn(e2m1_round(v), s))


def rms_norm(x: DeviceArray, weight: DeviceArray, eps: float, out: DeviceArray, n_rows: int, stream=0,
             threads: int = 0) -> None:
    """out[:n_rows] = bf16(weight * (x * rsqrt(mean(x^2) + eps))) row by row (x may be out).
    threads: block size (0 = the default; tests force others)."""
    check_array(x, (np.uint16, np.float32), 2, "rms_norm x")
    check_array(out, (np.uint16,), 2, "rms_norm out")
    check_array(weight, (np.float32,), 1, "rms_norm weight")
    check_rows(x, n_rows, "rms_norm x")
    check_rows(out, n_rows, "rms_norm out")
    width = weight.shape[0]
    if x.shape[1] < width or out.shape[1] < width:
        raise InputError(f"rms_norm: weight of {width} values, x {x.shape}, out {out.shape}")
    if n_rows == 0:
        return
    nt = threads or NORM_THREADS
    rms_norm_kernel(bool(x.dtype == np.uint16), nt)[n_rows, nt, stream](x, weight, out, n_rows, width, np.float32(eps))


def rope(x: DeviceArray, cos: DeviceArray, sin: DeviceArray, positions: DeviceArray, inverse: bool, n_rows: int,
         heads: int = 1, stream=0) -> None:
    """Rotate, in place, the last rope_dim values of each of `heads` heads of x[:n_rows] (bf16
    [R, heads * D]) by the angle of positions[r]; `inverse` rotates back (the conjugate). heads is
    what the oracle reads off its [R, heads, D] shape."""
    check_array(x, (np.uint16,), 2, "rope x")
    check_array(cos, (np.float32,), 2, "rope cos")
    check_array(sin, (np.float32,), 2, "rope sin")
    check_array(positions, (np.int32,), 1, "rope positions")
    check_rows(x, n_rows, "rope x")
    check_rows(positions, n_rows, "rope positions")
    rope_dim = 2 * cos.shape[1]
    if heads <= 0 or x.shape[1] % heads or x.shape[1] // heads < rope_dim:
        raise InputError(f"rope: rows of {x.shape[1]} values do not split into {heads} heads of >= {rope_dim}")
    total = n_rows * heads * (rope_dim // 2)
    if total == 0:
        return
    _rope_kernel[grid_1d(total, ELEM_THREADS), ELEM_THREADS, stream](
        x, cos, sin, positions, n_rows, heads, x.shape[1] // heads, rope_dim, bool(inverse))


def act_quant(x: DeviceArray, n_rows: int, stream=0) -> None:
    """fp8 (e4m3, blocks of 32, power-of-two scales) quantise-dequantise x[:n_rows] in place."""
    check_array(x, (np.uint16,), 2, "act_quant x")
    check_rows(x, n_rows, "act_quant x")
    if x.shape[1] % ACT_BLOCK:
        raise InputError(f"act_quant: rows of {x.shape[1]} values are not blocks of {ACT_BLOCK}")
    total = n_rows * (x.shape[1] // ACT_BLOCK)
    if total:
        _act_quant_kernel[grid_1d(total, ELEM_THREADS), ELEM_THREADS, stream](x, n_rows, x.shape[1])


def fp4_quant(x: DeviceArray, block: int, e4m3_scale: bool, n_rows: int, stream=0) -> None:
    """fp4 (E2M1) quantise-dequantise x[:n_rows] in place, blocks of `block` values along the row;
    e4m3_scale: scale e4m3(amax / 6) (compressed kv), else 2^ceil(log2(amax / 6)) (index q / k)."""
    check_array(x, (np.uint16,), 2, "fp4_quant x")
    check_rows(x, n_rows, "fp4_quant x")
    if block <= 0 or x.shape[1] % block:
        raise InputError(f"fp4_quant: rows of {x.shape[1]} values are not blocks of {block}")
    total = n_rows * (x.shape[1] // block)
    if total:
        _fp4_quant_kernel[grid_1d(total, ELEM_THREADS), ELEM_THREADS, stream](
            x, n_rows, x.shape[1], block, bool(e4m3_scale))
