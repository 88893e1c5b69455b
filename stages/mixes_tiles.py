"""The hyper-connection mixes' product for a prefill chunk, as tiles of tokens: what stages.hyper's
mixes read from MIXES_TILES_MIN_TOKENS tokens on (stages.linear.stream_partials below them).

partial[t, n, s] = the sum over slice s of K of x[t, k] * w[n, k] for the N mix rows, and
partial[t, N, s] the slice's sum of x[t, k]^2 (the square sum): x the flattened highway float32
[T, K = hc C], w a sublayer's hc_{kind}_fn, F32 / F16 / BF16 [N = M, K], partial float32
[>= T, N + 1, >= S], S = mixes_slices(K) slices of SLICE_CHUNKS 32-value chunks (16 of 1280 at
flash size, hc 4 x 5120). stream_partials cuts K into 80 slices there, and stages.hyper's partial is
sized for those: the mixes kernels after either sum the S slices they are given.

Grid (ceil(T / (WARPS TOKENS_A_WARP)), S), block (LANES, WARPS): warp w of block (i, s) takes
tokens (i WARPS + w) TOKENS_A_WARP .. + TOKENS_A_WARP - 1 and slice s. Each lane walks the slice's
columns LANES apart: it loads the column's weight of every mix row once (the block's warps share
them through L1), then adds x * w for each of its tokens and rows, and x * x for the square sum, in
registers; the lanes' sums then meet by shuffles. The chunk's highway is read once. stream_partials
(the decode GEMV's walk: a warp a (row, slice) and eight tokens) reads it again for each of the 25
rows of a slice.

Summation: each lane adds its ceil(slice / LANES) columns of a slice in order (fp32, the product
rounded or fused into the add), then log2(LANES) shuffle adds; the oracle (host.oracle.hc.hc_mixes)
sums in float64. tests/test_mixes_tiles.py holds every partial to the worst-case bound of that chain,
(ceil(slice / LANES) + log2(LANES) + 2) u sum |terms|, and the stage's mixes from them to
tests/test_hyper.py's bounds of the oracle's.

H100, 2026-12-07, T = 512 at flash size: 179 / 169 / 180 us for F32 / F16 / BF16 mix weights,
where stream_partials took 313 / 340 / 300 us (the chunk's highway, 42 MB, read once at 3.0 TB/s:
14 us). Registers (ptxas, sm_90): 156-159 a thread, no stack; one block of eight warps an SM.
tools/time_mixes.py times the two for T = 16 .. 512.
"""

from __future__ import annotations

from functools import cache

import numpy as np
from numba import cuda, float32

from flashv41.host.quants import GGMLType
from flashv41.stages.device import CHUNK, SIM, WARP, bf16_to_f32, jit_kernel, warp_sum
from flashv41.stages.linear import DeviceWeight

WARPS = 8  # warps a block
TOKENS_A_WARP = 4  # tokens each warp sums, each in (N + 1) registers a lane (the kernel names four)
SLICE_CHUNKS = 16 if SIM else 40  # 32-value chunks a slice: 1280 values, 16 slices of the flash highway
# (4 x 5120); on the simulator two of the small preset's (stages.hyper cuts it into four: fewer here too,
# so the tests see the mixes kernels read the count mixes_tiles returns)
LANES = 1 if SIM else WARP  # the simulator's warps are one lane (as stages.hyper's)
FN_TYPES = (GGMLType.F32, GGMLType.F16, GGMLType.BF16)  # the mix weight types it reads


@cache
def mixes_tiles_kernel(gtype: GGMLType, n_rows: int):
    """partial[t, n, s] for n < n_rows (x[t] . w[n] over slice s) and n = n_rows (x[t] . x[t]);
    grid (token tiles, slices), block (LANES, WARPS)."""
    f16 = gtype == GGMLType.F16
    bf16 = gtype == GGMLType.BF16
    rows = n_rows + 1

    @jit_kernel((LANES * WARPS, 1))
    def mixes_tiles(x, w, partial, n_tokens, k, slice_len):
        lane = cuda.threadIdx.x
        t0 = (cuda.blockIdx.x * WARPS + cuda.threadIdx.y) * TOKENS_A_WARP
        s = cuda.blockIdx.y
        # a warp's four tokens each in an array of its own: loops over the rows alone unroll, so
        # the accumulators stay in registers (one array [4, rows] went to the stack)
        acc0 = cuda.local.array(rows, float32)
        acc1 = cuda.local.array(rows, float32)
        acc2 = cuda.local.array(rows, float32)
        acc3 = cuda.local.array(rows, float32)
        wv = cuda.local.array(rows, float32)
        for n in range(rows):
            acc0[n] = float32(0)
            acc1[n] = float32(0)
            acc2[n] = float32(0)
            acc3[n] = float32(0)
        wf32 = w.view(np.float32)
        wf16 = w.view(np.float16)
        wb16 = w.view(np.uint16)
        last = n_tokens - 1  # a token past it adds nothing (x = 0, its row not read)
        k0 = s * slice_len
        k1 = min(k0 + slice_len, k)
        c = k0 + lane
        while c < k1:
            for n in range(n_rows):
                if f16:
                    wv[n] = float32(wf16[n, c])
                elif bf16:
                    wv[n] = bf16_to_f32(wb16[n, c])
                else:
                    wv[n] = wf32[n, c]
            x0 = x[t0, c] if t0 <= last else float32(0)
            x1 = x[t0 + 1, c] if t0 + 1 <= last else float32(0)
            x2 = x[t0 + 2, c] if t0 + 2 <= last else float32(0)
            x3 = x[t0 + 3, c] if t0 + 3 <= last else float32(0)
            for n in range(n_rows):
                acc0[n] += x0 * wv[n]
                acc1[n] += x1 * wv[n]
                acc2[n] += x2 * wv[n]
                acc3[n] += x3 * wv[n]
            acc0[n_rows] += x0 * x0
            acc1[n_rows] += x1 * x1
            acc2[n_rows] += x2 * x2
            acc3[n_rows] += x3 * x3
            c += LANES
        # the lanes' sums, a loop a token (one loop of all four did not unroll)
        for n in range(rows):
            total = warp_sum(acc0[n], wv) if LANES > 1 else acc0[n]  # (shuffles: no scratch)
            if lane == 0 and t0 <= last:
                partial[t0, n, s] = total
        for n in range(rows):
            total = warp_sum(acc1[n], wv) if LANES > 1 else acc1[n]
            if lane == 0 and t0 + 1 <= last:
                partial[t0 + 1, n, s] = total
        for n in range(rows):
            total = warp_sum(acc2[n], wv) if LANES > 1 else acc2[n]
            if lane == 0 and t0 + 2 <= last:
                partial[t0 + 2, n, s] = total
        for n in range(rows):
            total = warp_sum(acc3[n], wv) if LANES > 1 else acc3[n]
            if lane == 0 and t0 + 3 <= last:
                partial[t0 + 3, n, s] = total

    return mixes_tiles


def mixes_slices(k: int) -> int:
    """The slices mixes_tiles cuts K into: runs of SLICE_CHUNKS 32-value chunks."""
    return -(-k // (SLICE_CHUNKS * CHUNK))


def mixes_tiles(x, w: DeviceWeight, partial, n_tokens: int, stream=0) -> int:
    """partial[t, n, s] = sum over slice s of x[t, k] * w[n, k] for the N rows, and partial[t, N, s]
    the slice's sum of x[t, k]^2, for mixes_slices(K) slices; x float32 [T, K], w F32 / F16 / BF16
    [N, K], partial float32 [>= T, N + 1, >= S]. Returns S (the mixes kernels' n_slices)."""
    slices = mixes_slices(w.k)
    if (w.gtype not in FN_TYPES or x.dtype != np.float32 or x.shape[1] < w.k or n_tokens > x.shape[0]
            or partial.dtype != np.float32 or partial.shape[0] < n_tokens or partial.shape[1] != w.n + 1
            or partial.shape[2] < slices):
        raise ValueError(f"mixes_tiles {w.name}: {w.gtype.name} [{w.n}, {w.k}], x {x.shape} {x.dtype}, "
                         f"partial {partial.shape} {partial.dtype}, {n_tokens} tokens")
    if n_tokens == 0:
        return slices
    tiles = -(-n_tokens // (WARPS * TOKENS_A_WARP))
    mixes_tiles_kernel(w.gtype, w.n)[(tiles, slices), (LANES, WARPS), stream](
        x, w.data, partial, n_tokens, w.k, SLICE_CHUNKS * CHUNK)
    return slices
