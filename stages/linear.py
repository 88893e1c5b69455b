"""Linear layers on the device: y[t, n] = sum_k x[t, k] * dequant(w)[n, k], fp32 accumulation.

Shapes: x [T, K_total] (bf16 bits uint16, or float32), w the stored bytes of [N, K] (any type in
stages.device.DEQUANT), y [T, N] (bf16 bits, rounded to nearest even, or float32). A grouped
product (the attention's `wo_a`: G groups of `group_rows` outputs, each reading its own K-wide
slice of x) is the same kernel with the input offset `(n // group_rows) * K`.

Two kernels, chosen by the token count:
- `gemv` (T <= GEMV_MAX_TOKENS): one warp per output row streams that row's stored blocks once,
  dequantising 32 values at a time, and reuses them for every token of the step.
- `gemm` (more tokens): a shared-memory tile of tokens x outputs, K in steps of 32, the weight
  chunk dequantised once per tile; a grouped product is one launch per group.

Oracle: host.numerics.linear (bf16 out) / host.numerics.matmul_t (fp32 out). The GPU sums in fp32
in its own order, so a result may differ from the oracle's (float64-accumulated) by the fp32
summation error, |err| <= K * 2^-24 * sum_k |x_k w_k|, plus one bf16 rounding step.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import numpy as np
from numba import cuda, float32

from host.gguf_model import TensorRef
from host.quants import FORMATS, GGMLType, quantize
from stages.device import CHUNK, DEQUANT, SIM, WARP, bf16_to_f32, device, f32_to_bf16, warp_sum

if SIM:
    from stages.device import _BF16_VALUES

GEMV_MAX_TOKENS = 8
# The simulator runs every thread as a Python thread and a barrier costs about a millisecond, so
# there a "warp" is one lane (warp_sum is then the identity) and gemm tiles have few threads. The
# kernels' logic is the same; only these sizes change.
if SIM:
    LANES, GEMV_ROWS = 1, 32
    TM, TN, WM, WN = 16, 32, 16, 32
else:
    LANES, GEMV_ROWS = WARP, 4  # GEMV_ROWS warps (output rows) per block
    TM, TN, WM, WN = 32, 64, 2, 4
# gemm tile: TM tokens x TN outputs, threads (TN / WN) x (TM / WM), each WM x WN outputs
THREADS_X, THREADS_Y = TN // WN, TM // WM
# shared and local array shapes must be compile-time constants: module globals, computed once
GEMV_SCRATCH = LANES * GEMV_ROWS
X_TILE = (TM, CHUNK + 1)  # +1 column: no shared-memory bank conflicts on the k walk
W_TILE = (TN, CHUNK + 1)
ACC_TILE = (WM, WN)


@dataclass
class DeviceWeight:
    """A weight matrix on the device in its stored form: `data` uint8 [N, row_bytes]."""

    name: str
    gtype: GGMLType
    n: int  # rows (outputs)
    k: int  # values per row (inputs)
    data: object

    @classmethod
    def from_ref(cls, ref: TensorRef, stream=0) -> DeviceWeight:
        n = int(np.prod(ref.shape[:-1])) if len(ref.shape) > 1 else 1
        return cls(ref.name, ref.ggml_type, n, ref.shape[-1], cuda.to_device(ref.raw(), stream=stream))

    @classmethod
    def from_values(cls, name: str, values: np.ndarray, gtype: GGMLType | str) -> DeviceWeight:
        """Quantise float32 [N, K] values to `gtype` and upload (tests and synthetic weights)."""
        stored = quantize(values, gtype)
        raw = np.ascontiguousarray(stored).view(np.uint8).reshape(values.shape[0], -1)
        t = GGMLType[gtype] if isinstance(gtype, str) else gtype
        return cls(name, t, values.shape[0], values.shape[1], cuda.to_device(raw))

    @property
    def nbytes(self) -> int:
        return self.n * FORMATS[self.gtype].row_bytes(self.k)


@device
def _load_x(x, t, k, x_bf16):
    if x_bf16:
        return bf16_to_f32(x[t, k])
    return float32(x[t, k])


if SIM:
    # The simulator executes kernels as Python: these two inner loops, the bulk of every product,
    # run as NumPy float32 operations there (same values, another fp32 summation order).
    def _chunk_dot(buf, x, t, base, x_bf16):
        row = x[t, base:base + CHUNK]
        vals = _BF16_VALUES[row] if x_bf16 else row
        return np.float32(np.dot(buf, vals))

    def _tile_fma(acc, xs, ws, ty, tx):
        acc += xs[ty * WM:(ty + 1) * WM, :CHUNK] @ ws[tx * WN:(tx + 1) * WN, :CHUNK].T
else:
    @cuda.jit(device=True)
    def _chunk_dot(buf, x, t, base, x_bf16):
        s = float32(0)
        for i in range(CHUNK):
            s += buf[i] * _load_x(x, t, base + i, x_bf16)
        return s

    @cuda.jit(device=True)
    def _tile_fma(acc, xs, ws, ty, tx):
        for kk in range(CHUNK):
            for i in range(WM):
                a = xs[ty * WM + i, kk]
                for j in range(WN):
                    acc[i, j] += a * ws[tx * WN + j, kk]


@cache
def gemv_kernel(gtype: GGMLType, x_bf16: bool, out_bf16: bool):
    """One warp per output row; block = (LANES, GEMV_ROWS rows)."""
    dequant = DEQUANT[gtype]

    @cuda.jit
    def gemv(x, w, y, n_tokens, n_rows, k, group_rows):
        scratch = cuda.shared.array(GEMV_SCRATCH, float32)
        lane = cuda.threadIdx.x
        row = cuda.blockIdx.x * GEMV_ROWS + cuda.threadIdx.y
        acc = cuda.local.array(GEMV_MAX_TOKENS, float32)
        buf = cuda.local.array(CHUNK, float32)
        for t in range(GEMV_MAX_TOKENS):
            acc[t] = float32(0)
        live = row < n_rows
        if live:
            x_off = (row // group_rows) * k
            for c in range(lane, k // CHUNK, LANES):
                dequant(w, row, c, buf)
                base = x_off + c * CHUNK
                for t in range(n_tokens):
                    acc[t] += _chunk_dot(buf, x, t, base, x_bf16)
        for t in range(GEMV_MAX_TOKENS):
            if t < n_tokens:
                total = warp_sum(acc[t], scratch) if LANES > 1 else acc[t]
                if live and lane == 0:
                    if out_bf16:
                        y[t, row] = f32_to_bf16(total)
                    else:
                        y[t, row] = total

    return gemv


@cache
def gemm_kernel(gtype: GGMLType, x_bf16: bool, out_bf16: bool):
    """Tiles of TM tokens x TN outputs; block = (THREADS_X, THREADS_Y)."""
    dequant = DEQUANT[gtype]

    @cuda.jit
    def gemm(x, w, y, n_tokens, n_rows, k, row0, x_off):
        xs = cuda.shared.array(X_TILE, float32)
        ws = cuda.shared.array(W_TILE, float32)
        tx = cuda.threadIdx.x
        ty = cuda.threadIdx.y
        tid = ty * THREADS_X + tx
        t0 = cuda.blockIdx.y * TM
        n0 = cuda.blockIdx.x * TN
        acc = cuda.local.array(ACC_TILE, float32)
        buf = cuda.local.array(CHUNK, float32)
        for i in range(WM):
            for j in range(WN):
                acc[i, j] = float32(0)
        for c in range(k // CHUNK):
            for idx in range(tid, TM * CHUNK, THREADS_X * THREADS_Y):
                r = idx // CHUNK
                kk = idx % CHUNK
                t = t0 + r
                xs[r, kk] = _load_x(x, t, x_off + c * CHUNK + kk, x_bf16) if t < n_tokens else float32(0)
            for r in range(tid, TN, THREADS_X * THREADS_Y):
                n = n0 + r
                if n < n_rows:
                    dequant(w, row0 + n, c, buf)
                    for kk in range(CHUNK):
                        ws[r, kk] = buf[kk]
                else:
                    for kk in range(CHUNK):
                        ws[r, kk] = float32(0)
            cuda.syncthreads()
            _tile_fma(acc, xs, ws, ty, tx)
            cuda.syncthreads()
        for i in range(WM):
            t = t0 + ty * WM + i
            if t < n_tokens:
                for j in range(WN):
                    n = n0 + tx * WN + j
                    if n < n_rows:
                        if out_bf16:
                            y[t, row0 + n] = f32_to_bf16(acc[i, j])
                        else:
                            y[t, row0 + n] = acc[i, j]

    return gemm


def linear(x, w: DeviceWeight, y, n_tokens: int, group_rows: int = 0, stream=0, kernel: str = "") -> None:
    """y[:n_tokens] = x[:n_tokens] @ w^T on the device (dtypes of x and y pick the variant).

    group_rows > 0: grouped product, output row n reads x[:, (n // group_rows) * K : ... + K].
    kernel: "gemv" or "gemm" to force one (tests); by default the token count decides.
    """
    x_bf16 = x.dtype == np.uint16
    out_bf16 = y.dtype == np.uint16
    groups = w.n // group_rows if group_rows else 1
    if not group_rows:
        group_rows = w.n
    if w.k % CHUNK or x.shape[1] < groups * w.k or y.shape[1] < w.n or n_tokens > min(x.shape[0], y.shape[0]):
        raise ValueError(f"linear {w.name}: x {x.shape}, y {y.shape}, weight [{w.n}, {w.k}], {n_tokens} tokens")
    use_gemv = kernel == "gemv" or (not kernel and n_tokens <= GEMV_MAX_TOKENS)
    if use_gemv:
        if n_tokens > GEMV_MAX_TOKENS:
            raise ValueError(f"linear {w.name}: gemv takes at most {GEMV_MAX_TOKENS} tokens, got {n_tokens}")
        grid = (w.n + GEMV_ROWS - 1) // GEMV_ROWS
        gemv_kernel(w.gtype, x_bf16, out_bf16)[grid, (LANES, GEMV_ROWS), stream](
            x, w.data, y, n_tokens, w.n, w.k, group_rows)
    else:
        gemm = gemm_kernel(w.gtype, x_bf16, out_bf16)
        grid = ((group_rows + TN - 1) // TN, (n_tokens + TM - 1) // TM)
        for g in range(groups):  # one launch per group (prefill: launch cost is noise here)
            gemm[grid, (THREADS_X, THREADS_Y), stream](x, w.data, y, n_tokens, group_rows, w.k,
                                                       g * group_rows, g * w.k)
