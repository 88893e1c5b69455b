"""Linear layers on the device: y[t, n] = sum_k x[t, k] * dequant(w)[n, k], fp32 accumulation.

Shapes: x [T, K_total] (bf16 bits uint16, or float32), w the stored bytes of [N, K] (any type in
stages.device.DEQUANT), y [T, N] (bf16 bits, rounded to nearest even, or float32). A grouped
product (the attention's `wo_a`: G groups of `group_rows` outputs, each reading its own K-wide
slice of x) is the same kernel with the input offset `(n // group_rows) * K`.

Two kernels, chosen by the token count:
- `gemv` (T <= GEMV_MAX_TOKENS): one warp per output row streams that row's stored blocks once and
  reuses them for every token of the step. K goes in segments of SEG_CHUNKS 32-value chunks: the
  block stages the segment's inputs in shared memory (fp32, once for all its rows), each warp
  copies its row's stored bytes of the segment into shared memory with coalesced 32-bit loads
  (16-bit where rows are not a whole number of 32-bit words), then each lane dequantises one chunk
  from there. (Dequantising straight from global memory
  would have the lanes of a warp read bytes 34 or 84 bytes apart: a dozen cache-line requests per
  load instruction, and the kernel bound by L1 traffic instead of DRAM bandwidth.) A block's rows
  belong to one group, so a grouped product is one launch.
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
from stages.device import CHUNK, DEQUANT, SIM, WARP, f32_to_bf16, load_f32, warp_sum

if SIM:
    from stages.device import _BF16_VALUES

GEMV_MAX_TOKENS = 8
GEMV_TOKEN_CAPS = (1, 2, 4, 8)  # gemv is compiled per cap: its shared inputs and accumulators fit T
SEG_CHUNKS = 32  # chunks per gemv segment (a whole number of Q2_K blocks): one per lane of a warp
SEG_VALUES = SEG_CHUNKS * CHUNK
GEMV_SHARED_BYTES = 46 * 1024  # under the 48 KiB of static shared memory a block may have
# The simulator runs every thread as a Python thread and a barrier costs about a millisecond, so
# there a "warp" is one lane (warp_sum is then the identity) and blocks have few threads. The
# kernels' logic is the same; only these sizes change.
if SIM:
    LANES, GEMV_ROWS = 1, 1  # one thread per block, walking all of its group's rows
    TM, TN, WM, WN = 16, 32, 16, 32
else:
    LANES, GEMV_ROWS = WARP, 8  # at most GEMV_ROWS warps (output rows) per block
    TM, TN, WM, WN = 32, 64, 2, 4
# gemm tile: TM tokens x TN outputs, threads (TN / WN) x (TM / WM), each WM x WN outputs
THREADS_X, THREADS_Y = TN // WN, TM // WM
# shared and local array shapes must be compile-time constants: module globals, computed once
# (the gemv's, which depend on the weight type and the token cap, are closure constants of its factory)
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


if SIM:
    # The simulator executes kernels as Python: the inner loops, the bulk of every product, and the
    # gemv's staging copies run as NumPy operations there (same values, another fp32 summation
    # order; the copies by the block's first thread, the one lane of its warp).
    def _chunk_dot(buf, xs, t, c):
        return np.float32(np.dot(buf, xs[t, c, :CHUNK]))

    def _stage_x(xs, x, n_tokens, x0, n_chunks, tid, x_bf16):
        if tid == 0:
            vals = np.asarray(x[:n_tokens, x0:x0 + n_chunks * CHUNK])
            vals = _BF16_VALUES[vals] if x_bf16 else vals
            xs[:n_tokens, :n_chunks, :CHUNK] = vals.reshape(n_tokens, n_chunks, CHUNK)

    def _stage_w(ws, ww, slot, row, w0, n_words, lane):
        ws[slot, :n_words] = np.asarray(ww[row, w0:w0 + n_words])

    def _tile_fma(acc, xs, ws, ty, tx):
        acc += xs[ty * WM:(ty + 1) * WM, :CHUNK] @ ws[tx * WN:(tx + 1) * WN, :CHUNK].T
else:
    @cuda.jit(device=True)
    def _chunk_dot(buf, xs, t, c):
        s = float32(0)
        for i in range(CHUNK):
            s += buf[i] * xs[t, c, i]
        return s

    @cuda.jit(device=True)
    def _stage_x(xs, x, n_tokens, x0, n_chunks, tid, x_bf16):
        """xs[t, c, i] = x[t, x0 + c * CHUNK + i]: consecutive threads read consecutive inputs, and
        the 33-wide rows of xs keep the writes (and the lanes' later reads) free of bank conflicts."""
        for t in range(n_tokens):
            for v in range(tid, n_chunks * CHUNK, LANES * cuda.blockDim.y):
                xs[t, v // CHUNK, v % CHUNK] = load_f32(x, t, x0 + v, x_bf16)

    @cuda.jit(device=True)
    def _stage_w(ws, ww, slot, row, w0, n_words, lane):
        for i in range(lane, n_words, LANES):
            ws[slot, i] = ww[row, w0 + i]

    @cuda.jit(device=True)
    def _tile_fma(acc, xs, ws, ty, tx):
        for kk in range(CHUNK):
            for i in range(WM):
                a = xs[ty * WM + i, kk]
                for j in range(WN):
                    acc[i, j] += a * ws[tx * WN + j, kk]


def gemv_token_cap(n_tokens: int) -> int:
    """The smallest compiled token cap that holds n_tokens (<= GEMV_MAX_TOKENS)."""
    return next(cap for cap in GEMV_TOKEN_CAPS if cap >= n_tokens)


def gemv_rows(gtype: GGMLType, tokens: int) -> int:
    """Output rows (warps) per gemv block: GEMV_ROWS, fewer where the staged segments of wide
    types would not fit the shared memory beside the staged inputs."""
    inputs = tokens * SEG_CHUNKS * (CHUNK + 1) * 4
    return max(1, min(GEMV_ROWS, (GEMV_SHARED_BYTES - inputs) // FORMATS[gtype].row_bytes(SEG_VALUES)))


@cache
def gemv_kernel(gtype: GGMLType, x_bf16: bool, out_bf16: bool, tokens: int = GEMV_MAX_TOKENS,
                wide: bool = False):
    """One warp per output row, for up to `tokens` tokens; block = (LANES, gemv_rows(gtype, tokens))
    rows of one group; grid = groups * blocks_per_group. wide: the rows are whole 32-bit words
    (copied as such); otherwise 16-bit words, which every type's rows are."""
    dequant = DEQUANT[gtype]
    rows = gemv_rows(gtype, tokens)
    word = np.uint32 if wide else np.uint16
    seg_words = FORMATS[gtype].row_bytes(SEG_VALUES) // np.dtype(word).itemsize
    xs_shape = (tokens, SEG_CHUNKS, CHUNK + 1)
    ws_shape = (rows, seg_words)
    scratch_size = LANES * rows
    block_threads = LANES * rows

    @cuda.jit
    def gemv(x, w, y, n_tokens, k, group_rows, blocks_per_group):
        xs = cuda.shared.array(xs_shape, float32)  # [T, chunk, value] this segment's inputs
        ws = cuda.shared.array(ws_shape, word)  # [row of the block, word] this segment's stored bytes
        scratch = cuda.shared.array(scratch_size, float32)
        wb = ws.view(np.uint8)  # the dequantisers read bytes
        ww = w.view(word)  # [N, row words]
        lane = cuda.threadIdx.x
        slot = cuda.threadIdx.y
        tid = slot * LANES + lane
        group = cuda.blockIdx.x // blocks_per_group
        acc = cuda.local.array(tokens, float32)
        buf = cuda.local.array(CHUNK, float32)
        n_chunks = k // CHUNK
        # a block-uniform walk over its rows (once on a GPU, whose grid covers the group; the whole
        # group in the simulator's one-thread blocks), so every thread meets the same barriers
        first = (cuda.blockIdx.x - group * blocks_per_group) * rows
        for base in range(first, group_rows, blocks_per_group * rows):
            local = base + slot
            row = group * group_rows + local
            live = local < group_rows
            for t in range(tokens):
                acc[t] = float32(0)
            for seg in range(0, n_chunks, SEG_CHUNKS):
                here = min(SEG_CHUNKS, n_chunks - seg)
                _stage_x(xs, x, n_tokens, group * k + seg * CHUNK, here, tid, x_bf16)
                if live:
                    # segments start on block boundaries, at a whole word; the last one ends with the row
                    start = (seg // SEG_CHUNKS) * seg_words
                    _stage_w(ws, ww, slot, row, start, min(seg_words, ww.shape[1] - start), lane)
                if block_threads > 1:  # a barrier in a one-thread block is a no-op, but not a free one
                    cuda.syncthreads()
                if live:
                    for c in range(lane, here, LANES):
                        dequant(wb, slot, c, buf)
                        for t in range(tokens):
                            if t < n_tokens:
                                acc[t] += _chunk_dot(buf, xs, t, c)
                if block_threads > 1:
                    cuda.syncthreads()
            for t in range(tokens):
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
                xs[r, kk] = load_f32(x, t, x_off + c * CHUNK + kk, x_bf16) if t < n_tokens else float32(0)
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
        cap = gemv_token_cap(n_tokens)
        rows = gemv_rows(w.gtype, cap)
        per_group = 1 if SIM else (group_rows + rows - 1) // rows
        wide = FORMATS[w.gtype].row_bytes(w.k) % 4 == 0
        gemv_kernel(w.gtype, x_bf16, out_bf16, cap, wide)[groups * per_group, (LANES, rows), stream](
            x, w.data, y, n_tokens, w.k, group_rows, per_group)
    else:
        gemm = gemm_kernel(w.gtype, x_bf16, out_bf16)
        grid = ((group_rows + TN - 1) // TN, (n_tokens + TM - 1) // TM)
        for g in range(groups):  # one launch per group (prefill: launch cost is noise here)
            gemm[grid, (THREADS_X, THREADS_Y), stream](x, w.data, y, n_tokens, group_rows, w.k,
                                                       g * group_rows, g * w.k)
