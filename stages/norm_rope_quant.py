"""RMSNorm, RoPE and the two model-level quantisers on the device, alone or fused, each bit-exact
to its oracle.

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
- `norm_rope_quant(x, weight, eps, cos, sin, positions, inverse, quant, n_rows, heads, out)`: the
  chain quant(rope(rms_norm(x))) in one launch, any step left out (weight None: no norm; cos None:
  no rope; quant "none"), each step rounding to bf16 as the separate kernels do, so the result is
  their composition bit for bit (oracles: the same functions, applied in turn). x bf16 [R, heads * D]
  (or fp32 [R, >= D] with a norm, which needs heads == 1), out bf16 [R, heads * D], default x.
  quant: "act" (act_quant), "fp4_e8m0_32" (fp4_quant(x, 32, False)), "fp4_e4m3_16" (fp4_quant(x, 16,
  True)). The decode chains (one token): q_norm (1280 values), kv norm + rope + act (512), index
  keys norm + rope + fp4_e8m0_32 (128), compressed rows rope + fp4_e4m3_16 (512), index queries
  rope + fp4_e8m0_32 (32 heads x 128). The attention's q and o rope (64 heads x 512) are folded into
  stages.sparse_attention's kernels, with these roundings (`rope` still rotates q for the captures).

How the fused kernel runs: one block per (row, head); each thread holds `vals` consecutive values of
the head in registers (a rope pair and a quant block never straddle two threads, or a block spans an
aligned group of lanes), so nothing goes through shared memory but the norm's one cross-warp step:
float64 warp-shuffle sums, one barrier, and quant-block maxima by shuffles within the lane group.
On the GPU vals is the smallest fitting count that keeps a block within 128 threads (1280 -> 10 x
128, 512 -> 4 x 128, 128 -> 2 x 64). A rope-only call in place touches only each head's rope tail
(q rope: 64 blocks of 32 threads per token). On the simulator a block is one thread (barriers cost
milliseconds there); tests force the multi-thread shapes on a few rows.

Why every result here equals the oracle's bit for bit (not just within an ulp):
- RMSNorm squares in fp32 and sums the squares in float64, as the oracle does; a float64 sum of
  C <= 2^20 fp32 squares rounds to the same fp32 mean in any order (the float64 error is below
  2^-32 relative, the fp32 rounding step 2^-24), unless the exact mean sits within 2^-32 of an fp32
  rounding boundary, which no test input does. 1/sqrt is taken in float64 and rounded once, like
  the oracle's; the two products are fp32 in the oracle's order.
- RoPE (stages.device.rotate_pair): both products of each output are rounded before the add or
  subtract (`mul_rn`: NVVM would otherwise contract one of them into an FMA), then one bf16
  rounding, exactly the NumPy sequence.
- The quantisers use only exact operations: power-of-two scales from exponent bits, IEEE division
  (Numba-CUDA without fastmath divides exactly), e4m3 / E2M1 rounding on the bits, products of a
  few significant bits. A block maximum is exact in any order.
"""

from __future__ import annotations

import math
from functools import cache
from typing import NamedTuple

import numpy as np
from numba import cuda, float32, float64, int32, uint32

from flashv41.host.errors import InputError
from flashv41.stages.device import (
    SIM,
    WARP,
    DeviceArray,
    bf16_to_f32,
    check_array,
    check_rows,
    device,
    f32_bits,
    f32_from_bits,
    f32_to_bf16,
    grid_1d,
    inlined,
    jit_kernel,
    load_f32,
    mul_rn,
    rint_f32,
    rotate_pair,
)
from flashv41.stages.row_tables import u16_rows

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
NORM_THREADS = 1 if SIM else 512
ELEM_THREADS = 64 if SIM else 128
FUSED_THREADS = 128  # the most threads norm_rope_quant gives a block by default (a GPU's)

# norm_rope_quant's quantisers: name -> (code, values per block); the codes are the kernels' constants
QUANT_NONE, QUANT_ACT, QUANT_FP4_E8M0, QUANT_FP4_E4M3 = 0, 1, 2, 3
QUANTS = {"none": (QUANT_NONE, 0), "act": (QUANT_ACT, ACT_BLOCK), "fp4_e8m0_32": (QUANT_FP4_E8M0, 32),
          "fp4_e4m3_16": (QUANT_FP4_E4M3, 16)}
QUANT_BLOCK = dict(QUANTS.values())  # code -> values per block (0: none)
# where a chain also writes its rows (Chain.ring): nowhere, a ring, or each row's own ring (an address table)
MIRROR_NONE, MIRROR_RING, MIRROR_TABLE = 0, 1, 2
THREADS_AT = 5  # where a chain's compile-time spec (fused_body's arguments) holds its block size


def lane_mask(threads: int) -> int:
    """The shuffle mask of a block of `threads` threads: every lane of a full warp, else the ones there are."""
    return 0xFFFFFFFF if threads >= WARP else (1 << threads) - 1


if SIM:
    @cuda.jit(device=True)
    def block_sum(v, mask, scratch):
        """Sum of the float64 v over the block's threads, the same value to every thread (the
        simulator has no shuffles: through `scratch`, shared float64 [threads]). Every thread must call."""
        tid = cuda.threadIdx.x
        scratch[tid] = v
        cuda.syncthreads()
        total = float64(0)
        for i in range(cuda.blockDim.x):
            total += scratch[i]
        cuda.syncthreads()
        return total

    @cuda.jit(device=True)
    def group_max(v, lanes, mask, scratch):
        """max of the float32 v over each aligned group of `lanes` threads (a power of two up to 32),
        to every thread of the group; through `scratch` as block_sum. Every thread must call."""
        tid = cuda.threadIdx.x
        scratch[tid] = v
        cuda.syncthreads()
        first = tid - tid % lanes
        m = float32(scratch[first])
        for i in range(1, lanes):
            m = max(m, float32(scratch[first + i]))
        cuda.syncthreads()
        return m
else:
    @cuda.jit(device=True)
    def block_sum(v, mask, scratch):
        """Sum of the float64 v over the block's threads (a power of two up to 32, or whole warps),
        the same value to every thread: butterfly shuffles within each warp (the two halves of
        each step add the same two numbers, so every lane holds the same sum), then one barrier and
        the warps' sums added in warp order by every thread. scratch: shared float64 [>= warps].
        Every thread must call."""
        threads = cuda.blockDim.x
        for offset in (16, 8, 4, 2, 1):
            if offset < threads:
                v += cuda.shfl_xor_sync(mask, v, offset)
        if threads > WARP:
            tid = cuda.threadIdx.x
            if tid % WARP == 0:
                scratch[tid // WARP] = v
            cuda.syncthreads()
            v = scratch[0]
            for w in range(1, threads // WARP):
                v += scratch[w]
        return v

    @cuda.jit(device=True)
    def group_max(v, lanes, mask, scratch):
        """max of the float32 v over each aligned group of `lanes` lanes (a power of two up to 32),
        to every lane of the group, by xor shuffles within the group. Every thread must call."""
        for offset in (16, 8, 4, 2, 1):
            if offset < lanes:
                v = max(v, cuda.shfl_xor_sync(mask, v, offset))
        return v


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


@device
def round_bf16(v):
    """v rounded to the nearest bf16 value, as float32 (this module's f32_to_bf16, so that a mutant of
    it shows in the fused kernel too)."""
    return bf16_to_f32(f32_to_bf16(v))


@device
def quant_scale(amax, quant):
    """The scale of a block of max |x| = amax under quantiser `quant` (QUANT_ACT, QUANT_FP4_...):
    the fused kernel's and the one-quantiser kernels'."""
    if quant == QUANT_ACT:
        return pow2_ceil(max(amax, ACT_AMAX_FLOOR), FP8_MAX_INV)
    if quant == QUANT_FP4_E4M3:
        return e4m3_round(max(amax, FP4_E4M3_FLOOR) / FP4_MAX)
    return pow2_ceil(max(amax, FP4_E8M0_FLOOR), FP4_MAX_INV)


@device
def quant_value(v, s, quant):
    """v quantised and dequantised with the block scale s, in fp32 (not yet rounded to bf16)."""
    if quant == QUANT_ACT:
        return mul_rn(e4m3_round(v / s), s)
    q = min(max(v / s, -FP4_MAX), FP4_MAX)
    return mul_rn(e2m1_round(q), s)


@cache
def rms_norm_kernel(x_bf16: bool, threads: int, per_thread: int):
    """One block of `threads` threads per row (a power of two up to 32, or whole warps), each
    `per_thread` values of it, loaded together and kept for the second pass (a walk that loads,
    adds and loads again waits on each load in turn: 10 us for a 1280-wide row at 128 threads):
    float64 partial sums, added by block_sum. x bf16 bits (x_bf16) or fp32 [R, width], weight fp32
    [width], out bf16 [R, width]."""
    many = threads > 1
    mask = lane_mask(threads)

    @jit_kernel(threads)
    def kernel(x, weight, out, n_rows, width, eps):
        scratch = cuda.shared.array(threads, float64)  # [threads]: block_sum's
        vals = cuda.local.array(per_thread, float32)  # [per_thread]: this thread's values of the row
        r = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        acc = float64(0)
        for i in range(per_thread):
            c = tid + i * threads
            v = load_f32(x, r, c, x_bf16) if c < width else float32(0)
            vals[i] = v
            acc += float64(mul_rn(v, v))
        if many:
            acc = block_sum(acc, mask, scratch)
        mean = float32(acc / float64(width))
        rs = float32(1.0 / math.sqrt(float64(mean + eps)))
        # a thread rewrites only the values it read itself, so out may be x
        for i in range(per_thread):
            c = tid + i * threads
            if c < width:
                out[r, c] = f32_to_bf16(mul_rn(weight[c], mul_rn(vals[i], rs)))

    return kernel


@jit_kernel()
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
    u, v = rotate_pair(bf16_to_f32(x[r, col]), bf16_to_f32(x[r, col + 1]), c, s)
    x[r, col] = f32_to_bf16(u)
    x[r, col + 1] = f32_to_bf16(v)


@jit_kernel()
def _act_quant_kernel(x, n_rows, width):
    """One thread per block of 32 values: fp8 e4m3 quantise-dequantise with a power-of-two scale.
    x bf16 [R, width] in place."""
    i = cuda.grid(1)
    per_row = width // ACT_BLOCK
    if i >= n_rows * per_row:
        return
    r = i // per_row
    c0 = (i % per_row) * ACT_BLOCK
    s = quant_scale(block_amax(x, r, c0, ACT_BLOCK), QUANT_ACT)
    for c in range(c0, c0 + ACT_BLOCK):
        x[r, c] = f32_to_bf16(quant_value(bf16_to_f32(x[r, c]), s, QUANT_ACT))


@jit_kernel()
def _fp4_quant_kernel(x, n_rows, width, block, e4m3_scale):
    """One thread per block: E2M1 quantise-dequantise, E4M3 or E8M0 (power-of-two) scale.
    x bf16 [R, width] in place."""
    i = cuda.grid(1)
    per_row = width // block
    if i >= n_rows * per_row:
        return
    r = i // per_row
    c0 = (i % per_row) * block
    quant = QUANT_FP4_E4M3 if e4m3_scale else QUANT_FP4_E8M0
    s = quant_scale(block_amax(x, r, c0, block), quant)
    for c in range(c0, c0 + block):
        x[r, c] = f32_to_bf16(quant_value(bf16_to_f32(x[r, c]), s, quant))


@cache
def fused_body(x_bf16: bool, norm: bool, rope: bool, quant: int, vals: int, threads: int, mirror: int = MIRROR_NONE):
    """quant(rope(rms_norm(x))), each step optional, for block `item` = (row, head) of `threads`
    threads, `vals` consecutive values of the head in each thread's registers, from column c_lo of
    the head on (0, or the rope tail when nothing else changes). x bf16 bits (x_bf16) or fp32
    [R, heads * D], weight fp32 [D], out bf16 [R, heads * D] (may be x: a thread rewrites only what
    it read), cos, sin fp32 [max_seq, rope_dim / 2], positions int32 [R]. Every step rounds to bf16.
    mirror: row r also goes to slot positions[r] % W of `ring` (bf16 [W, heads * D]; MIRROR_TABLE:
    an address table [R, 2] of each row's own ring). Inlined into its kernels (fused_kernel,
    fused_pair_kernel)."""
    block = QUANT_BLOCK[quant]
    per_block = min(vals, block)  # the values of one quant block in one thread
    blocks = vals // per_block if block else 0  # quant blocks per thread
    lanes = block // per_block if block else 1  # threads sharing a quant block: a power of two
    many = threads > 1
    mask = lane_mask(threads)

    @inlined
    def body(x, weight, out, cos, sin, positions, heads, head_dim, c_lo, rope_dim, eps, inverse, ring, item):
        v = cuda.local.array(vals, float32)  # [vals]: columns c0 .. c0 + vals - 1 of the head
        scratch = cuda.shared.array(threads, float64)  # [threads]: block_sum's (and group_max's, simulated)
        r = item // heads
        col = (item % heads) * head_dim  # the head's first column in the row
        c0 = c_lo + cuda.threadIdx.x * vals
        active = c0 < head_dim  # a block's padding threads only join the reductions, with zeros
        for k in range(vals):
            v[k] = load_f32(x, r, col + c0 + k, x_bf16) if active else float32(0)
        if norm:
            acc = float64(0)
            for k in range(vals):
                acc += float64(mul_rn(v[k], v[k]))
            if many:
                acc = block_sum(acc, mask, scratch)
            mean = float32(acc / float64(head_dim))
            rs = float32(1.0 / math.sqrt(float64(mean + eps)))
            if active:
                for k in range(vals):
                    v[k] = round_bf16(mul_rn(weight[c0 + k], mul_rn(v[k], rs)))
        if rope and active:
            pos = positions[r]
            tail = head_dim - rope_dim
            for k in range(0, vals, 2):
                if c0 + k >= tail:  # pairs start at even offsets from tail, and so do the threads' values
                    pair = (c0 + k - tail) // 2
                    cs = cos[pos, pair]
                    sn = -sin[pos, pair] if inverse else sin[pos, pair]
                    a, b = rotate_pair(v[k], v[k + 1], cs, sn)
                    v[k] = round_bf16(a)
                    v[k + 1] = round_bf16(b)
        for j in range(blocks):
            amax = float32(0)
            for k in range(j * per_block, (j + 1) * per_block):
                amax = max(amax, abs(v[k]))
            if lanes > 1:
                amax = group_max(amax, lanes, mask, scratch)
            s = quant_scale(amax, quant)
            for k in range(j * per_block, (j + 1) * per_block):
                v[k] = round_bf16(quant_value(v[k], s, quant))
        if active:
            for k in range(vals):
                out[r, col + c0 + k] = f32_to_bf16(v[k])
            if mirror == MIRROR_RING:
                for k in range(vals):
                    ring[positions[r] % ring.shape[0], col + c0 + k] = f32_to_bf16(v[k])
            elif mirror == MIRROR_TABLE:
                own = u16_rows(ring, r, heads * head_dim)
                for k in range(vals):
                    own[positions[r] % own.shape[0], col + c0 + k] = f32_to_bf16(v[k])

    return body


@cache
def fused_kernel(x_bf16: bool, norm: bool, rope: bool, quant: int, vals: int, threads: int, mirror: int):
    """fused_body's chain, one block of `threads` threads per (row, head)."""
    body = fused_body(x_bf16, norm, rope, quant, vals, threads, mirror)

    @jit_kernel(threads)
    def kernel(x, weight, out, cos, sin, positions, heads, head_dim, c_lo, rope_dim, eps, inverse, ring):
        body(x, weight, out, cos, sin, positions, heads, head_dim, c_lo, rope_dim, eps, inverse, ring,
             cuda.blockIdx.x)

    return kernel


@cache
def fused_pair_kernel(first: tuple, second: tuple):
    """Two chains of fused_body (their compile-time specs `first`, `second`: (x_bf16, norm, rope,
    quant, vals, threads, mirror)) in one launch of blocks of the larger one's threads: the first `items`
    blocks run the first chain's (row, head) items, the rest the second's. A chain of fewer threads
    than the block leaves the rest inactive: they load nothing and add zeros to its norm's sum
    (exact), so its result is its own launch's; its threads must be whole warps (the shuffles'
    mask covers the warp)."""
    body_a, body_b = fused_body(*first), fused_body(*second)

    @jit_kernel(max(first[THREADS_AT], second[THREADS_AT]))
    def kernel(xa, wa, oa, ca, sa, pa, heads_a, dim_a, lo_a, rope_a, eps_a, inv_a, ring_a, items,
               xb, wb, ob, cb, sb, pb, heads_b, dim_b, lo_b, rope_b, eps_b, inv_b, ring_b):
        item = cuda.blockIdx.x
        if item < items:
            body_a(xa, wa, oa, ca, sa, pa, heads_a, dim_a, lo_a, rope_a, eps_a, inv_a, ring_a, item)
        else:
            body_b(xb, wb, ob, cb, sb, pb, heads_b, dim_b, lo_b, rope_b, eps_b, inv_b, ring_b, item - items)

    return kernel


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
    if nt & (nt - 1) and nt % WARP:
        raise InputError(f"rms_norm: {nt} threads a block: a power of two or whole warps")
    rms_norm_kernel(bool(x.dtype == np.uint16), nt, -(-width // nt))[n_rows, nt, stream](
        x, weight, out, n_rows, width, np.float32(eps))


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


def fused_shape(width: int, rope: bool, block: int, threads: int = 0) -> tuple[int, int]:
    """(values per thread, threads per block) of norm_rope_quant over `width` values of a head: the
    values split into equal runs of consecutive ones, even with rope (a pair stays in one thread),
    dividing or multiple of the quant block (0: none). Default: the shortest run that needs no
    more than FUSED_THREADS runs, their count padded to a power of two up to 32 or to whole warps
    (the shuffles' shapes); on the simulator one thread. threads: forced (tests), one run each."""
    def fits(vals: int) -> bool:
        return width % vals == 0 and (not rope or vals % 2 == 0) and (not block or block % vals == 0
                                                                      or vals % block == 0)

    if threads:
        shaped = threads > 0 and not (threads & (threads - 1) and threads % WARP)
        if not shaped or width % threads or not fits(width // threads):
            raise InputError(f"norm_rope_quant: {width} values do not split over {threads} threads (a power "
                             f"of two or whole warps, runs {'even and ' if rope else ''}fitting blocks of {block})")
        return width // threads, threads
    if SIM:
        return width, 1
    vals = next(v for v in range(max(1, -(-width // FUSED_THREADS)), width + 1) if fits(v))
    runs = width // vals
    return vals, (1 << (runs - 1).bit_length() if runs <= WARP else -(-runs // WARP) * WARP)


@cache
def _placeholders() -> tuple[DeviceArray, DeviceArray, DeviceArray, DeviceArray]:
    """Typed stand-ins (weight fp32 [1], table fp32 [1, 1], positions int32 [1], ring bf16 [1, 1])
    for the arrays of a step left out, which the kernel never reads; allocated once."""
    return (cuda.to_device(np.zeros(1, np.float32)), cuda.to_device(np.zeros((1, 1), np.float32)),
            cuda.to_device(np.zeros(1, np.int32)), cuda.to_device(np.zeros((1, 1), np.uint16)))


class Chain(NamedTuple):
    """One norm_rope_quant call's arguments, as norm_rope_quant takes them (norm_rope_quant_pair)."""

    x: DeviceArray
    weight: DeviceArray
    eps: float | None
    cos: DeviceArray
    sin: DeviceArray
    positions: DeviceArray
    inverse: bool
    quant: str
    heads: int = 1
    out: DeviceArray = None
    ring: DeviceArray = None  # also write row r to slot positions[r] % W of this bf16 [W, heads * D] ring
    ring_table: bool = False  # ring is an address table [R, 2] of each row's own ring (stages.row_tables)


def norm_rope_quant(x: DeviceArray, weight: DeviceArray, eps: float | None, cos: DeviceArray, sin: DeviceArray,
                    positions: DeviceArray, inverse: bool, quant: str, n_rows: int, heads: int = 1,
                    out: DeviceArray = None, stream=0, threads: int = 0) -> None:
    """out[:n_rows] = quant(rope(rms_norm(x))) in one launch, bit for bit the separate kernels'
    chain. weight None: no norm (x must then be bf16); cos None: no rope; quant one of QUANTS.
    x bf16 [R, heads * D] (or fp32 [R, >= D] with a norm, heads 1), weight fp32 [D], cos, sin fp32
    [max_seq, rope_dim / 2], positions int32 [R], out bf16 [R, heads * D] (None: x, in place).
    threads: block size (0 = the default; tests force others)."""
    spec, args = _fused_launch(Chain(x, weight, eps, cos, sin, positions, inverse, quant, heads, out), n_rows,
                               threads)
    if n_rows:
        _launch_chain(spec, args, n_rows * heads, stream)


def norm_rope_quant_pair(first: Chain, second: Chain, n_rows: int, stream=0) -> None:
    """norm_rope_quant of two chains over the same n_rows rows in one launch where their default
    block sizes agree or are both whole warps (each block runs one chain's item, so each result is
    bit for bit its call alone: fused_pair_kernel), else two launches: a decode step's two chains
    that read one product launch, or the kv sources' keys and rows."""
    spec_a, args_a = _fused_launch(first, n_rows, 0)
    spec_b, args_b = _fused_launch(second, n_rows, 0)
    if not n_rows:
        return
    threads_a, threads_b = spec_a[THREADS_AT], spec_b[THREADS_AT]
    if threads_a != threads_b and (threads_a % WARP or threads_b % WARP):
        _launch_chain(spec_a, args_a, n_rows * first.heads, stream)
        _launch_chain(spec_b, args_b, n_rows * second.heads, stream)
        return
    items = n_rows * first.heads
    fused_pair_kernel(spec_a, spec_b)[items + n_rows * second.heads, max(threads_a, threads_b), stream](
        *args_a, items, *args_b)


def _launch_chain(spec: tuple, args: tuple, items: int, stream) -> None:
    """fused_kernel of `spec` over `items` (row, head) blocks of its threads."""
    fused_kernel(*spec)[items, spec[THREADS_AT], stream](*args)


def _fused_launch(chain: Chain, n_rows: int, threads: int) -> tuple[tuple, tuple]:
    """A chain's checked arguments: (fused_body's spec, the kernel's arguments)."""
    x, weight, eps, cos, sin, positions, inverse, quant, heads, out, ring, ring_table = chain
    what = "norm_rope_quant"
    check_array(x, (np.uint16, np.float32), 2, f"{what} x")
    if quant not in QUANTS:
        raise InputError(f"{what}: unknown quant {quant!r} (known: {', '.join(QUANTS)})")
    norm, rope_on = weight is not None, cos is not None
    x_bf16 = np.dtype(x.dtype) == np.uint16
    if out is None:
        if not x_bf16:
            raise InputError(f"{what}: fp32 x cannot take the bf16 result in place; pass out")
        out = x
    check_array(out, (np.uint16,), 2, f"{what} out")
    if not isinstance(heads, (int, np.integer)) or heads <= 0:
        raise InputError(f"{what}: heads must be a positive integer, got {heads!r}")
    if norm:
        check_array(weight, (np.float32,), 1, f"{what} weight")
        if heads != 1:
            raise InputError(f"{what}: the norm spans the row, so heads must be 1 with a weight (got {heads})")
        if eps is None:
            raise InputError(f"{what}: a norm needs eps")
        head_dim = weight.shape[0]
        if x.shape[1] < head_dim:
            raise InputError(f"{what}: weight of {head_dim} values, x rows of {x.shape[1]}")
    else:
        if not x_bf16:
            raise InputError(f"{what}: fp32 x only with a norm (rope and the quantisers read bf16 values)")
        if x.shape[1] % heads:
            raise InputError(f"{what}: rows of {x.shape[1]} values do not split into {heads} heads")
        head_dim = x.shape[1] // heads
    if out.shape[1] < heads * head_dim:
        raise InputError(f"{what}: out rows of {out.shape[1]} values, {heads} heads of {head_dim} to write")
    check_rows(x, n_rows, f"{what} x")
    check_rows(out, n_rows, f"{what} out")
    rope_dim = 0
    if rope_on:
        check_array(cos, (np.float32,), 2, f"{what} cos")
        check_array(sin, (np.float32,), 2, f"{what} sin")
        check_array(positions, (np.int32,), 1, f"{what} positions")
        check_rows(positions, n_rows, f"{what} positions")
        if tuple(sin.shape) != tuple(cos.shape):
            raise InputError(f"{what}: cos {cos.shape} and sin {sin.shape} differ")
        rope_dim = 2 * cos.shape[1]
        if not 0 < rope_dim <= head_dim:
            raise InputError(f"{what}: rope over {rope_dim} values of heads of {head_dim}")
    elif sin is not None or (positions is not None and ring is None):
        raise InputError(f"{what}: sin or positions given without cos")
    mirror = _check_ring(ring, ring_table, positions, n_rows, heads * head_dim, what)
    code, block = QUANTS[quant]
    # rope alone, in place: only each head's tail changes, so only the tail is read and written
    c_lo = head_dim - rope_dim if rope_on and not norm and code == QUANT_NONE and out is x and not mirror else 0
    width = head_dim - c_lo
    if rope_on and width % 2:
        raise InputError(f"{what}: heads of {head_dim} values (odd) with rope over the last {rope_dim}")
    if block and width % block:
        raise InputError(f"{what}: heads of {width} values are not blocks of {block} ({quant})")
    vals, nt = fused_shape(width, rope_on, block, threads)
    spare_weight, spare_table, spare_positions, spare_ring = _placeholders()
    return (bool(x_bf16), norm, rope_on, code, vals, nt, mirror), (
        x, weight if norm else spare_weight, out, cos if rope_on else spare_table,
        sin if rope_on else spare_table, spare_positions if positions is None else positions, heads, head_dim, c_lo,
        rope_dim, np.float32(eps if norm else 0.0), bool(inverse), spare_ring if ring is None else ring)


def _check_ring(ring, ring_table: bool, positions, n_rows: int, width: int, what: str) -> int:
    """A chain's ring (Chain.ring) checked: its mirror code (MIRROR_NONE without one)."""
    if ring is None:
        return MIRROR_NONE
    check_array(positions, (np.int32,), 1, f"{what} positions")
    check_rows(positions, n_rows, f"{what} positions")
    if ring_table:
        check_array(ring, (np.uint64,), 2, f"{what} ring table")
        check_rows(ring, n_rows, f"{what} ring table")
        return MIRROR_TABLE
    check_array(ring, (np.uint16,), 2, f"{what} ring")
    if ring.shape[1] != width or ring.shape[0] < 1:
        raise InputError(f"{what}: ring {ring.shape} for rows of {width} values")
    return MIRROR_RING
