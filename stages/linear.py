"""Linear layers on the device: y[t, n] = sum_k x[t, k] * dequant(w)[n, k], fp32 accumulation.

Shapes: x [T, K_total] (bf16 bits uint16, or float32), w the stored bytes of [N, K] (any type in
stages.device.DEQUANT), y [T, N] (bf16 bits, rounded to nearest even, or float32). A grouped
product (the attention's `wo_a`: G groups of `group_rows` outputs, each reading its own K-wide
slice of x) is the same kernel with the input offset `(n // group_rows) * K`.

Weights keep their GGUF bytes, with one rearrangement inside each row for Q8_0 on a GPU (the
"split" layout, DeviceWeight.layout): the row's K int8 quants first, then its K/32 fp16 scales. Same bytes,
same values; the quants of consecutive blocks become contiguous, so a warp reads them with
aligned, coalesced 16-byte loads (34-byte blocks start on 2-byte boundaries).

Kernels, chosen by the token count and the weight type (`pick_kernel`):
- `stream` (T <= GEMV_MAX_TOKENS, bf16 x; Q8_0, BF16 rows on 16-byte boundaries, Q2_K; GPU by
  default): warps over output rows, and for short matrices several warps a row, each a slice of K
  (`stream_split`: enough warps in all to keep the memory busy; slices summed in shared memory).
  The lanes of a warp read consecutive 16-byte pieces of the row (Q2_K: 32-bit quant words, its
  84-byte blocks are not 16-byte aligned), two or four in flight, each used for every token of the
  step; x (a few KiB) is read through L1. How a piece decodes is the type's (`stream_dots`): Q8_0
  sixteen int8 quants and their block's scale; Q2_K sixteen 2-bit quants, four (scale, min) pairs
  and the block's d and dmin, the min folded in as dmin * m * sum(x) per 4 values; BF16 eight
  weights. Integers become floats by an exponent trick (`small_int`), not by conversions.
- `gemv` (T <= GEMV_MAX_TOKENS, the other types or an fp32 x): one warp per output row; K in
  segments of SEG_CHUNKS 32-value chunks staged in shared memory (the inputs once per block, each
  warp its row's stored bytes), then each lane dequantises one chunk from there.
- `tc` (more tokens, bf16 x; BF16, Q8_0, Q2_K weights; GPU only): stages.linear_tc, bf16 tensor
  cores with exact integer weights and fp32 scales.
- `gemm` (more tokens, the rest): a shared-memory tile of tokens x outputs, K in steps of 32, the
  weight chunk dequantised once per tile; a grouped product is one launch per group.

Oracle: host.numerics.linear (bf16 out) / host.numerics.matmul_t (fp32 out). The GPU sums in fp32
in its own order, so a result may differ from the oracle's (float64-accumulated) by the fp32
summation error; tests/bounds.py holds a bf16 result to >= 99% of outputs bit-equal to the
oracle's and every output within half a bf16 ulp plus a sqrt(K)-scaled bound of the exact product.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import numpy as np
from numba import cuda, float32, uint64

from flashv41.host.gguf_model import TensorRef
from flashv41.host.quants import FORMATS, GGMLType, quantize
from flashv41.stages import linear_tc
from flashv41.stages.device import (
    CHUNK,
    DEQUANT,
    SIM,
    WARP,
    dequant_q8_0_split,
    device,
    f32_from_bits,
    f32_to_bf16,
    load_f32,
    load_words4,
    warp_sum,
)

if SIM:
    from flashv41.stages.device import _BF16_VALUES

GEMV_MAX_TOKENS = 8
GEMV_TOKEN_CAPS = (1, 2, 4, 8)  # gemv is compiled per cap: its shared inputs and accumulators fit T
SEG_CHUNKS = 32  # chunks per gemv segment (a whole number of Q2_K blocks): one per lane of a warp
SEG_VALUES = SEG_CHUNKS * CHUNK
GEMV_SHARED_BYTES = 46 * 1024  # under the 48 KiB of static shared memory a block may have
STREAM_TYPES = (GGMLType.Q8_0, GGMLType.Q2_K, GGMLType.BF16)
STREAM_TARGET_WARPS = 8192  # about what an H200 holds resident (132 SMs x 64 warps)
# The simulator runs every thread as a Python thread and a barrier costs about a millisecond, so
# there a "warp" is one lane (warp_sum is then the identity) and blocks have few threads. The
# kernels' logic is the same; only these sizes change.
if SIM:
    LANES, GEMV_ROWS, STREAM_WARPS = 1, 1, 2  # one-thread warps; a block walks all of its group's rows
    TM, TN, WM, WN = 16, 32, 16, 32
else:
    LANES, GEMV_ROWS, STREAM_WARPS = WARP, 8, 8  # at most GEMV_ROWS / STREAM_WARPS warps (rows) per block
    TM, TN, WM, WN = 32, 64, 2, 4
# gemm tile: TM tokens x TN outputs, threads (TN / WN) x (TM / WM), each WM x WN outputs
THREADS_X, THREADS_Y = TN // WN, TM // WM
# shared and local array shapes must be compile-time constants: module globals, computed once
# (the gemv's, which depend on the weight type and the token cap, are closure constants of its factory)
X_TILE = (TM, CHUNK + 1)  # +1 column: no shared-memory bank conflicts on the k walk
W_TILE = (TN, CHUNK + 1)
ACC_TILE = (WM, WN)


def split_q8_0(stored: np.ndarray, k: int) -> np.ndarray:
    """GGUF Q8_0 rows (uint8 [N, K/32 * 34]: per block an fp16 scale, then 32 int8 quants) -> the
    split layout: per row the K quants, then the K/32 scales."""
    blocks = stored.reshape(stored.shape[0], k // CHUNK, CHUNK + 2)
    return np.concatenate([blocks[:, :, 2:].reshape(-1, k), blocks[:, :, :2].reshape(-1, k // CHUNK * 2)], axis=1)


@dataclass
class DeviceWeight:
    """A weight matrix on the device: `data` uint8 [N, row_bytes], the stored bytes of each row,
    Q8_0 rows in the split layout (quants, then scales; `layout` "split")."""

    name: str
    gtype: GGMLType
    n: int  # rows (outputs)
    k: int  # values per row (inputs)
    data: object
    layout: str = "stored"

    @classmethod
    def from_stored(cls, name: str, gtype: GGMLType, stored: np.ndarray, k: int, stream=0,
                    layout: str | None = None) -> DeviceWeight:
        """Upload stored rows (uint8 [N, row_bytes] as the GGUF has them) in `layout`: by default
        Q8_0 split on a GPU (for the stream and tensor-core kernels) and kept as stored on the
        simulator, which runs neither by default and whose gemv reads stored rows fastest."""
        rows = stored.reshape(stored.shape[0], -1)
        if layout is None:
            layout = "split" if gtype == GGMLType.Q8_0 and not SIM else "stored"
        if layout == "split":
            if gtype != GGMLType.Q8_0:
                raise ValueError(f"{name}: only Q8_0 has a split layout, not {gtype.name}")
            rows = split_q8_0(rows, k)
        return cls(name, gtype, rows.shape[0], k, cuda.to_device(np.ascontiguousarray(rows), stream=stream), layout)

    @classmethod
    def from_ref(cls, ref: TensorRef, stream=0) -> DeviceWeight:
        n = int(np.prod(ref.shape[:-1])) if len(ref.shape) > 1 else 1
        return cls.from_stored(ref.name, ref.ggml_type, ref.raw().reshape(n, -1), ref.shape[-1], stream)

    @classmethod
    def from_values(cls, name: str, values: np.ndarray, gtype: GGMLType | str,
                    layout: str | None = None) -> DeviceWeight:
        """Quantise float32 [N, K] values to `gtype` and upload (tests and synthetic weights)."""
        t = GGMLType[gtype] if isinstance(gtype, str) else gtype
        stored = np.ascontiguousarray(quantize(values, t)).view(np.uint8).reshape(values.shape[0], -1)
        return cls.from_stored(name, t, stored, values.shape[1], layout=layout)

    @property
    def nbytes(self) -> int:
        return self.n * FORMATS[self.gtype].row_bytes(self.k)

    @property
    def dequant(self):
        """The device dequantiser of this weight's rows (stages.device.DEQUANT's signature)."""
        return dequant_q8_0_split if self.layout == "split" else DEQUANT[self.gtype]


if SIM:
    # The simulator executes kernels as Python: the inner loops, the bulk of every product, and the
    # gemv's and gemm's input staging copies run as NumPy operations there (same values, another
    # fp32 summation order; the copies by the block's first thread, the one lane of its warp).
    def chunk_dot(buf, xs, t, c):
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

    def _stage_x_tile(xs, x, t0, n_tokens, x0, tid, x_bf16):
        if tid == 0:
            vals = np.asarray(x[t0:min(n_tokens, t0 + TM), x0:x0 + CHUNK])
            xs[:, :CHUNK] = 0
            xs[:vals.shape[0], :CHUNK] = _BF16_VALUES[vals] if x_bf16 else vals
else:
    @cuda.jit(device=True)
    def chunk_dot(buf, xs, t, c):
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
    def _stage_x_tile(xs, x, t0, n_tokens, x0, tid, x_bf16):
        """xs[r, kk] = x[t0 + r, x0 + kk] for the tile's TM tokens (0 past n_tokens)."""
        for idx in range(tid, TM * CHUNK, THREADS_X * THREADS_Y):
            r = idx // CHUNK
            kk = idx % CHUNK
            t = t0 + r
            xs[r, kk] = load_f32(x, t, x0 + kk, x_bf16) if t < n_tokens else float32(0)

    @cuda.jit(device=True)
    def _tile_fma(acc, xs, ws, ty, tx):
        for kk in range(CHUNK):
            for i in range(WM):
                a = xs[ty * WM + i, kk]
                for j in range(WN):
                    acc[i, j] += a * ws[tx * WN + j, kk]


# The stream kernel indexes with uint64: Numba wraps negative signed indices and floors signed
# divisions, a few instructions per access that an unsigned index does not need.
U1, U2, U3, U4, U8 = uint64(1), uint64(2), uint64(3), uint64(4), uint64(8)


@device
def bf16_pair(word):
    """The two bf16 values packed in a 32-bit word (low half first) as float32."""
    return f32_from_bits(word << 16), f32_from_bits(word & 0xFFFF0000)


@device
def small_int(bits):
    """An integer 0 <= bits < 2^23 as float32, exactly: placed in the mantissa of 2^23 and the 2^23
    taken away: two full-rate instructions, where integer-to-float conversion has a lower rate."""
    return f32_from_bits(0x4B000000 | bits) - float32(8388608.0)


@device
def int8_at(flipped, byte):
    """Byte `byte` of a 32-bit word as a signed int8 value q, in float32, given the word with every
    byte's top bit flipped (each byte then holds q + 128)."""
    return f32_from_bits(0x4B000000 | ((flipped >> (8 * byte)) & 0xFF)) - float32(8388736.0)  # 2^23 + 128


@device
def int8_dot4(flipped, xw0, xw1):
    """The four int8 quants of a word (top bits flipped) times four bf16 values in two words."""
    x0, x1 = bf16_pair(xw0)
    x2, x3 = bf16_pair(xw1)
    return (int8_at(flipped, 0) * x0 + int8_at(flipped, 1) * x1 + int8_at(flipped, 2) * x2
            + int8_at(flipped, 3) * x3)


def stream_dots(tokens: int):
    """The per-type walkers of the stream kernel, for up to `tokens` tokens. A walker adds its
    lane's share of slice `part` (of `parts`) of one row's dot products to acc[t]. A row is a run
    of units (16-byte pieces for Q8_0 and BF16, one 16-byte load each; 32-bit quant words for
    Q2_K, whose 84-byte blocks are not 16-byte aligned); the lane takes units lane, lane + lanes,
    ... of its slice, two or four at a time while they last (their loads issued together).
    Arguments: the rows as 32-bit words `ww` (uint32 [N, words]) and as fp16 `wf`, x as bf16
    pairs `x32` (uint32 [T, K_total / 2]) with this row's slice at word xo, K, the live tokens."""

    @device
    def q8_0_unit(ww, wf, row, x32, xo, k, n_tokens, acc, u):
        # unit u: the quants 16 u .. 16 u + 15 (half of block u // 2); the scales follow the K quants
        w0, w1, w2, w3 = load_words4(ww, row, U4 * u)
        d = float32(wf[row, uint64(k >> 1) + (u >> U1)])
        w0, w1, w2, w3 = w0 ^ 0x80808080, w1 ^ 0x80808080, w2 ^ 0x80808080, w3 ^ 0x80808080
        for t in range(tokens):
            if t < n_tokens:
                a0, a1, a2, a3 = load_words4(x32, t, xo + U8 * u)
                b0, b1, b2, b3 = load_words4(x32, t, xo + U8 * u + U4)
                acc[t] += d * (int8_dot4(w0, a0, a1) + int8_dot4(w1, a2, a3) + int8_dot4(w2, b0, b1)
                               + int8_dot4(w3, b2, b3))

    @device
    def bf16_unit(ww, wf, row, x32, xo, k, n_tokens, acc, u):
        # unit u: the weights 8 u .. 8 u + 7
        w0, w1, w2, w3 = load_words4(ww, row, U4 * u)
        v0, v1 = bf16_pair(w0)
        v2, v3 = bf16_pair(w1)
        v4, v5 = bf16_pair(w2)
        v6, v7 = bf16_pair(w3)
        for t in range(tokens):
            if t < n_tokens:
                a0, a1, a2, a3 = load_words4(x32, t, xo + U4 * u)
                x0, x1 = bf16_pair(a0)
                x2, x3 = bf16_pair(a1)
                x4, x5 = bf16_pair(a2)
                x6, x7 = bf16_pair(a3)
                acc[t] += v0 * x0 + v1 * x1 + v2 * x2 + v3 * x3 + v4 * x4 + v5 * x5 + v6 * x6 + v7 * x7

    @device
    def q2_k_unit(ww, wf, row, x32, xo, k, n_tokens, acc, u):
        # a 256-value block is 21 words: scales (4), quants (16), d and dmin. Quant word u of the
        # row (block u // 16, word i = u % 16 of its quants, half h = i // 8) holds values
        # 128 h + 32 s + 4 (i % 8) + b in bits 8 b + 2 s, for s, b < 4
        blk = u >> uint64(4)
        i = u & uint64(15)
        h = i >> U3
        word = ww[row, uint64(21) * blk + U4 + i]
        sc_lo = ww[row, uint64(21) * blk + U2 * h]  # scale bytes 8 h .. 8 h + 3
        sc_hi = ww[row, uint64(21) * blk + U2 * h + U1]  # 8 h + 4 .. 8 h + 7
        d = float32(wf[row, uint64(42) * blk + uint64(40)])
        dmin = float32(wf[row, uint64(42) * blk + uint64(41)])
        pair = (i & uint64(7)) >> U2  # which 16-value scale group of the 32 values of an s
        x_word = xo + uint64(128) * blk + uint64(64) * h + U2 * (i & uint64(7))
        for s in range(4):
            sc = ((sc_lo if s < 2 else sc_hi) >> (uint64(16 * (s % 2)) + uint64(8) * pair)) & 0xFF
            scale = d * float32(sc & 15)
            minimum = dmin * float32(sc >> 4)
            q0 = small_int((word >> (2 * s)) & 3)
            q1 = small_int((word >> (8 + 2 * s)) & 3)
            q2 = small_int((word >> (16 + 2 * s)) & 3)
            q3 = small_int((word >> (24 + 2 * s)) & 3)
            for t in range(tokens):
                if t < n_tokens:
                    x0, x1 = bf16_pair(x32[t, x_word + uint64(16 * s)])
                    x2, x3 = bf16_pair(x32[t, x_word + uint64(16 * s) + U1])
                    acc[t] += scale * (q0 * x0 + q1 * x1 + q2 * x2 + q3 * x3) - minimum * (x0 + x1 + x2 + x3)

    def walker(unit, unit_shift, in_flight):
        """K >> unit_shift units a row."""
        @device
        def walk(ww, wf, row, x32, xo, k, n_tokens, acc, part, parts, lane, lanes):
            n = uint64(k >> unit_shift)
            u = uint64(part) * n // uint64(parts) + uint64(lane)
            end = (uint64(part) + U1) * n // uint64(parts)
            step = uint64(lanes)
            if in_flight == 4:
                while u + U3 * step < end:
                    unit(ww, wf, row, x32, xo, k, n_tokens, acc, u)
                    unit(ww, wf, row, x32, xo, k, n_tokens, acc, u + step)
                    unit(ww, wf, row, x32, xo, k, n_tokens, acc, u + U2 * step)
                    unit(ww, wf, row, x32, xo, k, n_tokens, acc, u + U3 * step)
                    u += U4 * step
            else:
                while u + step < end:
                    unit(ww, wf, row, x32, xo, k, n_tokens, acc, u)
                    unit(ww, wf, row, x32, xo, k, n_tokens, acc, u + step)
                    u += U2 * step
            while u < end:
                unit(ww, wf, row, x32, xo, k, n_tokens, acc, u)
                u += step

        return walk

    return {GGMLType.Q8_0: walker(q8_0_unit, 4, 2), GGMLType.BF16: walker(bf16_unit, 3, 2),
            GGMLType.Q2_K: walker(q2_k_unit, 4, 4)}


def stream_split(n_rows: int) -> int:
    """Warps per output row of the stream kernel: enough warps in all for the GPU to keep
    STREAM_TARGET_WARPS loads going, each warp a slice of K (a power of two <= STREAM_WARPS)."""
    split = 1
    while split < STREAM_WARPS and n_rows * split < STREAM_TARGET_WARPS:
        split *= 2
    return split


@cache
def stream_kernel(gtype: GGMLType, out_bf16: bool, tokens: int):
    """Output rows over warps, `split` warps per row (each a slice of K, summed in shared memory),
    for up to `tokens` tokens of bf16 x; block = (LANES, STREAM_WARPS), rows strided over the grid."""
    walk = stream_dots(tokens)[gtype]
    partial_shape = (STREAM_WARPS, tokens)

    @cuda.jit
    def stream(x, w, y, n_tokens, k, group_rows, split):
        partial = cuda.shared.array(partial_shape, float32)
        ww = w.view(np.uint32)
        wf = w.view(np.float16)
        x32 = x.view(np.uint32)
        lane = cuda.threadIdx.x
        warp = cuda.threadIdx.y
        part = warp % split
        per_block = STREAM_WARPS // split
        acc = cuda.local.array(tokens, float32)
        # a block-uniform walk over its rows, so every thread meets the same barriers
        for first in range(cuda.blockIdx.x * per_block, w.shape[0], cuda.gridDim.x * per_block):
            row = first + warp // split
            for t in range(tokens):
                acc[t] = float32(0)
            if row < w.shape[0]:
                walk(ww, wf, row, x32, uint64((row // group_rows) * (k // 2)), k, n_tokens, acc, part, split,
                     lane, LANES)
            for t in range(tokens):
                total = warp_sum(acc[t], acc) if LANES > 1 else acc[t]  # (shuffles: no scratch)
                if lane == 0:
                    partial[warp, t] = total
            if split > 1:
                cuda.syncthreads()
            if lane == 0 and part == 0 and row < w.shape[0]:
                for t in range(tokens):
                    if t < n_tokens:
                        total = float32(0)
                        for j in range(split):
                            total += partial[warp + j, t]
                        if out_bf16:
                            y[t, row] = f32_to_bf16(total)
                        else:
                            y[t, row] = total
            if split > 1:
                cuda.syncthreads()

    return stream


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
                                acc[t] += chunk_dot(buf, xs, t, c)
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
def gemm_kernel(gtype: GGMLType, layout: str, x_bf16: bool, out_bf16: bool):
    """Tiles of TM tokens x TN outputs; block = (THREADS_X, THREADS_Y)."""
    dequant = dequant_q8_0_split if layout == "split" else DEQUANT[gtype]

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
            _stage_x_tile(xs, x, t0, n_tokens, x_off + c * CHUNK, tid, x_bf16)
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


def streamable(w: DeviceWeight) -> bool:
    """The stream kernel decodes Q8_0 and BF16 rows that start on 16-byte boundaries (it reads
    them 16 bytes at a time) and Q2_K rows (32-bit words)."""
    return w.gtype == GGMLType.Q2_K or (w.gtype in STREAM_TYPES and FORMATS[w.gtype].row_bytes(w.k) % 16 == 0)


def pick_kernel(w: DeviceWeight, x_bf16: bool, n_tokens: int) -> str:
    """The default kernel for a product: for up to GEMV_MAX_TOKENS tokens stream where it applies
    (on the simulator only when asked for: it walks words in Python there), else gemv; for more,
    the tensor cores (stages.linear_tc) where they apply (GPU, bf16 x), else gemm."""
    if n_tokens > GEMV_MAX_TOKENS:
        return "tc" if linear_tc.supports(w, np.uint16 if x_bf16 else np.float32) else "gemm"
    if x_bf16 and streamable(w) and not SIM:
        return "stream"
    return "gemm" if w.layout != "stored" else "gemv"


def linear(x, w: DeviceWeight, y, n_tokens: int, group_rows: int = 0, stream=0, kernel: str = "") -> None:
    """y[:n_tokens] = x[:n_tokens] @ w^T on the device (dtypes of x and y pick the variant).

    group_rows > 0: grouped product, output row n reads x[:, (n // group_rows) * K : ... + K].
    kernel: "stream", "gemv", "gemm" or "tc" to force one (tests); by default `pick_kernel` decides.
    """
    x_bf16 = x.dtype == np.uint16
    out_bf16 = y.dtype == np.uint16
    groups = w.n // group_rows if group_rows else 1
    if not group_rows:
        group_rows = w.n
    if w.k % CHUNK or x.shape[1] < groups * w.k or y.shape[1] < w.n or n_tokens > min(x.shape[0], y.shape[0]):
        raise ValueError(f"linear {w.name}: x {x.shape}, y {y.shape}, weight [{w.n}, {w.k}], {n_tokens} tokens")
    kernel = kernel or pick_kernel(w, x_bf16, n_tokens)
    if kernel in ("stream", "gemv") and n_tokens > GEMV_MAX_TOKENS:
        raise ValueError(f"linear {w.name}: {kernel} takes at most {GEMV_MAX_TOKENS} tokens, got {n_tokens}")
    if kernel == "tc":
        linear_tc.linear_tc(x, w, y, n_tokens, group_rows if groups > 1 else 0, stream)
    elif kernel == "stream":
        if not x_bf16 or not streamable(w):
            raise ValueError(f"linear {w.name}: the stream kernel takes bf16 x and Q8_0, Q2_K or BF16 rows of whole "
                             f"32-bit words, not {w.gtype.name} [{w.n}, {w.k}]")
        split = stream_split(w.n)
        per_block = STREAM_WARPS // split
        blocks = 1 if SIM else (w.n + per_block - 1) // per_block
        stream_kernel(w.gtype, out_bf16, gemv_token_cap(n_tokens))[blocks, (LANES, STREAM_WARPS), stream](
            x, w.data, y, n_tokens, w.k, group_rows, split)
    elif kernel == "gemv":
        if w.layout != "stored":
            raise ValueError(f"linear {w.name}: the gemv kernel reads stored rows, not the {w.layout} layout")
        cap = gemv_token_cap(n_tokens)
        rows = gemv_rows(w.gtype, cap)
        per_group = 1 if SIM else (group_rows + rows - 1) // rows
        wide = FORMATS[w.gtype].row_bytes(w.k) % 4 == 0
        gemv_kernel(w.gtype, x_bf16, out_bf16, cap, wide)[groups * per_group, (LANES, rows), stream](
            x, w.data, y, n_tokens, w.k, group_rows, per_group)
    else:
        gemm = gemm_kernel(w.gtype, w.layout, x_bf16, out_bf16)
        grid = ((group_rows + TN - 1) // TN, (n_tokens + TM - 1) // TM)
        for g in range(groups):  # one launch per group (prefill: launch cost is noise here)
            gemm[grid, (THREADS_X, THREADS_Y), stream](x, w.data, y, n_tokens, group_rows, w.k,
                                                       g * group_rows, g * w.k)
