"""Linear layers on the device: y[t, n] = sum_k x[t, k] * dequant(w)[n, k], fp32 accumulation.

Shapes: x [T, K_total] (bf16 bits uint16, or float32), w the rows of [N, K] in their device layout
(any type of the quant-type table, stages.quants.table.DEVICE_TYPES), y [T, N] (bf16 bits, rounded
to nearest even, or float32). A grouped product (the attention's `wo_a`: G groups of `group_rows`
outputs, each reading its own K-wide slice of x) is the same kernel with the input offset
`(n // group_rows) * K`.

Weights keep their GGUF bytes, except Q8_0, Q2_K, Q6_K, Q3_K and MXFP4 (DeviceWeight.layout
"split"): per row the blocks' quants first (Q8_0's K int8 quants; each Q6_K block's ql, qh and
scales; each Q3_K block's hmask and qs; MXFP4's 16 code bytes a block; Q2_K: every block's scale
bytes, then every block's quant bytes), then the rest of every block (Q3_K's scales, then the fp16
scales d; MXFP4's exponent bytes; Q2_K's d and dmin), padded to whole 16-byte pieces. Same
values; the quants of consecutive blocks become contiguous and aligned, so a warp reads them with
aligned, coalesced 16-byte loads (a stored block starts on a 2-byte boundary, an MXFP4 one on any).

Kernels, chosen by the token count and the weight type (`pick_kernel`):
- `stream` (every type, bf16 or fp32 x; the decode GEMV; launches of up to GEMV_MAX_TOKENS tokens,
  so a token's sums never depend on the others of its call): warps over output
  rows, and for short matrices several warps a row, each a slice of K (`stream_split`: enough warps
  in all to keep the memory busy; slices summed in shared memory); for short rows (K = 1280) a warp
  walks two or four row groups side by side, 16 or 8 lanes each (`stream_lanes`). The lanes of a
  row group walk the row's units (the type's stream unit: 16-byte pieces), two or four in flight,
  each used for every token of the step; x (a few KiB) is read through L1. How a unit decodes is
  the type's (its family's module in stages.quants). `stream_partials` is the same walk with the slices'
  sums written out instead (any T, in groups of GEMV_MAX_TOKENS tokens), plus a row of the inputs'
  square sums: the hyper-connection mixes' product (stages.hyper sums the slices).
- `narrow` (more tokens, up to NARROW_MAX_TOKENS: a batch of decode steps; bf16 x; BF16 and Q8_0
  weights; GPU only): stages.linear_narrow, the tensor cores with the weights as the mma's rows and
  the tokens its columns, each weight byte read once for the whole batch, no shared-memory tiles.
- `tc` (more tokens, bf16 x; Q2_K, Q3_K, Q4_K, Q5_K, Q6_K and MXFP4 weights; GPU only):
  stages.linear_tc, bf16 tensor cores with exact integer weights and fp32 scales.
- on a GPU, a batch of up to NARROW_MAX_TOKENS tokens that neither narrow nor tc takes (fp32 x,
  F16 / F32 weights: the indexer's head weights) runs `stream` in launches of GEMV_MAX_TOKENS: gemm
  would cover such a short matrix with one tile block.
- `imma` (up to GEMV_MAX_TOKENS tokens, in place of stream, on a GPU: bf16 x and the large Q2_K,
  Q3_K, Q4_K, Q5_K and MXFP4 weights of linear_imma.decode_pick, and the tall Q8_0 and Q6_K ones
  (wq_b), measured faster there):
  stages.linear_imma, the decode GEMV on the integer tensor cores, the stored levels as the mma's A
  operand and each input split into four int8 digits as its B columns.
- `wgmma` (past NARROW_MAX_TOKENS tokens, on a GPU of compute capability 9.0: bf16 x, BF16
  weights): stages.gemm_wgmma, the prefill GEMM on Hopper's warpgroup tensor cores (wgmma, sm_90a
  only), its tiles streamed into shared memory by cp.async two K steps ahead.
- `pipe` (past NARROW_MAX_TOKENS tokens, on a GPU: bf16 x, Q8_0 weights, and BF16 ones where wgmma
  is not (other GPUs); tc takes neither type): stages.gemm_pipe, the prefill GEMM on the tensor
  cores (mma.sync) with its tiles streamed into shared memory by cp.async several K steps ahead and
  read with ldmatrix.
- `gemm` (more tokens, what neither tc, wgmma nor pipe takes: every product on the simulator, where
  their inline PTX does not run; on a GPU fp32 x and F16 / F32 weights past NARROW_MAX_TOKENS tokens): a
  shared-memory tile of tokens x outputs, K in steps of 32, the weight chunk dequantised once per
  tile (the type's weight_dequant); a grouped product is one launch per group.

Oracle: host.numerics.linear (bf16 out) / host.numerics.matmul_t (fp32 out). The GPU sums in fp32
in its own order, so a result may differ from the oracle's (float64-accumulated) by the fp32
summation error; tests/bounds.py holds a bf16 result to >= 99% of outputs bit-equal to the
oracle's and every output within half a bf16 ulp plus a sqrt(K)-scaled bound of the exact product.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np
from numba import cuda, float32, uint32, uint64

from flashv41.host.errors import UnsupportedError
from flashv41.host.gguf_model import TensorRef
from flashv41.host.quants import FORMATS, GGMLType, quantize
from flashv41.stages import gemm_pipe, gemm_wgmma, linear_imma, linear_narrow, linear_tc
from flashv41.stages.device import (
    CHUNK,
    SIM,
    WARP,
    device,
    f32_to_bf16,
    inlined,
    jit_kernel,
    lane_group_sum,
    load_f32,
    warp_sum,
)
from flashv41.stages.linear_narrow import NARROW_MAX_TOKENS
from flashv41.stages.quants.records import DeviceType, StreamUnit
from flashv41.stages.quants.table import DEVICE_TYPES
from flashv41.stages.quants.units import U1, U2, U3, U4, x4_bf16, x4_f32

if SIM:
    from flashv41.stages.device import _BF16_VALUES

GEMV_MAX_TOKENS = 8
assert linear_imma.MAX_TOKENS == GEMV_MAX_TOKENS  # (a decode step's launch, whichever GEMV it takes)
GEMV_TOKEN_CAPS = (1, 2, 4, 8)  # the stream kernels are compiled per cap: their accumulators fit T
# The simulator runs every thread as a Python thread and a barrier costs about a millisecond, so
# there a "warp" is one lane (warp_sum is then the identity), blocks have few threads, and only
# matrices of fewer than 8 rows (the tests' small ones) split their rows over warps, whose partial
# sums cost two barriers a row. The kernels' logic is the same; only these sizes change.
if SIM:
    LANES, STREAM_WARPS, STREAM_TARGET_WARPS = 1, 2, 8  # one-thread warps; a block walks all of its rows
    STREAM_MIN_BLOCKS = 1
    TM, TN, WM, WN = 16, 32, 16, 32
else:
    # at most STREAM_WARPS warps (rows, or slices of one) per block; rows split into slices until
    # 4096 warps walk them (half what an H200 holds resident, 132 SMs x 64 warps: the H200 probe of
    # 2026-12-04 at T = 1 had Q8_0 wo_a 16.4 -> 14.5 us and wo_b 18.5 -> 16.7 against 8192, BF16
    # level or better, the index wq_b 0.7 us slower: long rows lose more to the slices' sums than
    # they gain from the extra warps)
    LANES, STREAM_WARPS, STREAM_TARGET_WARPS = WARP, 8, 4096
    STREAM_MIN_BLOCKS = 128  # about one a streaming multiprocessor of an H200 (132)
    TM, TN, WM, WN = 32, 64, 2, 4
# gemm tile: TM tokens x TN outputs, threads (TN / WN) x (TM / WM), each WM x WN outputs
THREADS_X, THREADS_Y = TN // WN, TM // WM
# shared and local array shapes must be compile-time constants: module globals, computed once
X_TILE = (TM, CHUNK + 1)  # +1 column: no shared-memory bank conflicts on the k walk
W_TILE = (TN, CHUNK + 1)
ACC_TILE = (WM, WN)


@dataclass
class DeviceWeight:
    """A weight matrix on the device: `data` uint8 [N, pitch], each row in its type's device layout
    (stages.quants: the stored bytes; Q8_0, Q2_K, Q6_K, Q3_K and MXFP4 split; padded to whole 16-byte
    pieces)."""

    name: str
    gtype: GGMLType
    n: int  # rows (outputs)
    k: int  # values per row (inputs)
    data: object

    @classmethod
    def from_stored(cls, name: str, gtype: GGMLType, stored: np.ndarray, k: int, stream=0) -> DeviceWeight:
        """Upload stored rows (uint8 [N, row_bytes] as the GGUF has them) in the type's layout."""
        rows = DEVICE_TYPES[gtype].weight_rows(stored.reshape(stored.shape[0], -1), k)
        return cls(name, gtype, rows.shape[0], k, cuda.to_device(np.ascontiguousarray(rows), stream=stream))

    @classmethod
    def from_ref(cls, ref: TensorRef, stream=0) -> DeviceWeight:
        gtype = ref.ggml_type
        if not isinstance(gtype, GGMLType):  # the loader already refuses a matrix in a table format
            raise UnsupportedError(f"{ref.name}: {gtype.name} is a table format, not a weight matrix type")
        n = int(np.prod(ref.shape[:-1])) if len(ref.shape) > 1 else 1
        return cls.from_stored(ref.name, gtype, ref.raw().reshape(n, -1), ref.shape[-1], stream)

    @classmethod
    def from_values(cls, name: str, values: np.ndarray, gtype: GGMLType | str) -> DeviceWeight:
        """Quantise float32 [N, K] values to `gtype` and upload (tests and synthetic weights)."""
        t = GGMLType[gtype] if isinstance(gtype, str) else gtype
        stored = np.ascontiguousarray(quantize(values, t)).view(np.uint8).reshape(values.shape[0], -1)
        return cls.from_stored(name, t, stored, values.shape[1])

    @property
    def nbytes(self) -> int:
        """The stored bytes of the rows (what a product reads; a padded row's few pad bytes aside)."""
        return self.n * FORMATS[self.gtype].row_bytes(self.k)

    @property
    def layout(self) -> str:
        return DEVICE_TYPES[self.gtype].layout

    @property
    def dequant(self):
        """The chunk dequantiser of this weight's rows (stages.quants.records' signature)."""
        return DEVICE_TYPES[self.gtype].weight_dequant


if SIM:
    # The simulator executes kernels as Python: the gemm's inner loop and its input staging run as
    # NumPy operations there (same values, another fp32 summation order; the copy by the block's
    # first thread).
    def _tile_fma(acc, xs, ws, ty, tx):
        acc += xs[ty * WM:(ty + 1) * WM, :CHUNK] @ ws[tx * WN:(tx + 1) * WN, :CHUNK].T

    def _stage_x_tile(xs, x, t0, n_tokens, x0, tid, x_bf16):
        if tid == 0:
            vals = np.asarray(x[t0:min(n_tokens, t0 + TM), x0:x0 + CHUNK])
            xs[:, :CHUNK] = 0
            xs[:vals.shape[0], :CHUNK] = _BF16_VALUES[vals] if x_bf16 else vals
else:
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


def square_unit(tokens: int, x_bf16: bool):
    """stream_partials' extra row: unit u is the inputs 4 u .. 4 u + 3 of each token, squared (a
    stream unit that reads no weight)."""
    x4 = x4_bf16 if x_bf16 else x4_f32

    @device
    def square(ww, wf, row, x32, xo, k, n_tokens, acc, u):
        for t in range(tokens):
            if t < n_tokens:
                x0, x1, x2, x3 = x4(x32, t, xo, U4 * u)
                acc[t] += x0 * x0 + x1 * x1 + x2 * x2 + x3 * x3

    return square


SQUARES = StreamUnit(square_unit, 2, 2)


def stream_walker(unit: StreamUnit, x_bf16: bool, tokens: int):
    """The walk of a type's units for up to `tokens` tokens of bf16 (x_bf16) or fp32 x: it adds its
    lane's share of slice `part` (of `parts`) of one row's dot products to acc[t], taking units
    lane, lane + lanes, ... of the slice, two or four at a time while they last (their loads issued
    together). Arguments: the rows as 32-bit words `ww` (uint32 [N, words]) and as fp16 `wf`, x as
    32-bit words `x32` with this row's slice at word xo, K, the live tokens."""
    step = unit.make(tokens, x_bf16)
    unit_shift, in_flight = unit.shift, unit.in_flight

    @device
    def walk(ww, wf, row, x32, xo, k, n_tokens, acc, part, parts, lane, lanes):
        n = uint64(k >> unit_shift)
        u = uint64(part) * n // uint64(parts) + uint64(lane)
        end = (uint64(part) + U1) * n // uint64(parts)
        step_lanes = uint64(lanes)
        if in_flight == 4:
            while u + U3 * step_lanes < end:
                step(ww, wf, row, x32, xo, k, n_tokens, acc, u)
                step(ww, wf, row, x32, xo, k, n_tokens, acc, u + step_lanes)
                step(ww, wf, row, x32, xo, k, n_tokens, acc, u + U2 * step_lanes)
                step(ww, wf, row, x32, xo, k, n_tokens, acc, u + U3 * step_lanes)
                u += U4 * step_lanes
        elif in_flight == 2:
            while u + step_lanes < end:
                step(ww, wf, row, x32, xo, k, n_tokens, acc, u)
                step(ww, wf, row, x32, xo, k, n_tokens, acc, u + step_lanes)
                u += U2 * step_lanes
        while u < end:
            step(ww, wf, row, x32, xo, k, n_tokens, acc, u)
            u += step_lanes

    return walk


def stream_split(n_rows: int) -> int:
    """Warps per output row of the stream kernel: enough warps in all for the GPU to keep
    STREAM_TARGET_WARPS loads going, each warp a slice of K (a power of two <= STREAM_WARPS)."""
    split = 1
    while split < STREAM_WARPS and n_rows * split < STREAM_TARGET_WARPS:
        split *= 2
    return split


def stream_blocks(row_groups: int, split: int, lanes: int) -> int:
    """Blocks of the stream kernel for `row_groups` row groups, `split` warps and `lanes` lanes each:
    a block walks STREAM_WARPS // split * (LANES // lanes) of them."""
    return -(-row_groups // (STREAM_WARPS // split * (LANES // lanes)))


def stream_lanes(units: int, row_groups: int, split: int) -> int:
    """Lanes of a warp that walk one row group's slice of `units` units: of 8, 16 and 32 lanes
    (the warp then takes 4, 2 or 1 row groups), the one that leaves the fewest lanes idle over the
    slice's rounds (units / (lanes * rounds) highest), the most lanes on a tie, among those that
    still give the launch STREAM_MIN_BLOCKS blocks (32 lanes always qualifies). A short row (K =
    1280: 10 to 40 units) then no longer leaves most of a 32-lane warp without work, and a small
    matrix keeps every SM busy. A slice of no unit (a short row split over more warps than it has
    units, in the tests' small models) idles every lane count alike. One lane on the simulator,
    whose warps are one lane."""
    if LANES == 1:
        return 1

    def busy(lanes: int) -> float:
        return units / (lanes * max(1, -(-units // lanes)))

    fitting = (lanes for lanes in (32, 16, 8)
               if lanes == 32 or stream_blocks(row_groups, split, lanes) >= STREAM_MIN_BLOCKS)
    return max(fitting, key=busy)


@cache
def stream_kernel(qt: DeviceType, x_bf16: bool, out_bf16: bool, tokens: int, split: int, split2: int = 0,
                  lanes: int = LANES, lanes2: int = LANES):
    """Output rows over warps, each warp LANES // lanes row groups of the type's `rows` consecutive
    rows (its gemv unit; `lanes` lanes a group, stream_lanes), `split` warps per row group (each a
    slice of K, summed in shared memory), for up to `tokens` tokens; block = (LANES, STREAM_WARPS),
    row groups strided over the grid. `split` is compiled in: its divisions become shifts (a 64-bit
    division costs more than a short row's walk). split2 > 0: a pair of products of the same x,
    kernel(x, w, y, w2, y2, n_tokens, k, group_rows, blocks): the first `blocks` blocks walk (w, y)
    as the single kernel does, the rest the ungrouped (w2, y2) with split2 and lanes2, so each
    output's sum is the one its product gets alone; else kernel(x, w, y, n_tokens, k, group_rows)."""
    unit = qt.gemv_unit
    rows = unit.rows
    walk = stream_walker(unit, x_bf16, tokens)
    sums = rows * tokens  # a lane's accumulators: acc[i * tokens + t] for row i of its group
    per_word = 2 if x_bf16 else 1  # inputs a 32-bit word of x holds

    def product_of(lanes: int):
        """The product's block walk with `lanes` lanes a row group."""
        groups = LANES // lanes  # row groups a warp walks side by side
        partial_shape = (STREAM_WARPS, groups, sums)
        group_sum = lane_group_sum(lanes) if lanes > 1 else None

        @inlined
        def product(x, w, y, n_tokens, k, group_rows, block, blocks, split):
            """Blocks `block` of `blocks` of the product y = x @ w^T, `split` warps a row group."""
            partial = cuda.shared.array(partial_shape, float32)
            ww = w.view(np.uint32)
            wf = w.view(np.float16)
            x32 = x.view(np.uint32)
            # the warp's row group this lane walks (`side`), and the lane's place in it
            lane = cuda.threadIdx.x % lanes if groups > 1 else cuda.threadIdx.x
            side = cuda.threadIdx.x // lanes if groups > 1 else 0
            warp = cuda.threadIdx.y
            part = warp % split
            per_block = STREAM_WARPS // split * groups
            n_rows = w.shape[0]
            n_groups = (n_rows + rows - 1) // rows
            x_words = uint32(k) // uint32(per_word)
            acc = cuda.local.array(sums, float32)
            # a block-uniform walk over its row groups, so every thread meets the same barriers
            for first in range(block * per_block, n_groups, blocks * per_block):
                row = (first + warp // split * groups + side) * rows
                for j in range(sums):
                    acc[j] = float32(0)
                if row < n_rows:
                    xo = uint64((uint32(row) // uint32(group_rows)) * x_words)
                    walk(ww, wf, row, x32, xo, k, n_tokens, acc, part, split, lane, lanes)
                for j in range(sums):
                    total = group_sum(acc[j]) if lanes > 1 else acc[j]
                    if lane == 0:
                        partial[warp, side, j] = total
                if split > 1:
                    cuda.syncthreads()
                if lane == 0 and part == 0:
                    for i in range(rows):
                        if row + i < n_rows:
                            for t in range(tokens):
                                if t < n_tokens:
                                    total = float32(0)
                                    for p in range(split):
                                        total += partial[warp + p, side, i * tokens + t]
                                    if out_bf16:
                                        y[t, row + i] = f32_to_bf16(total)
                                    else:
                                        y[t, row + i] = total
                if split > 1:
                    cuda.syncthreads()

        return product

    product = product_of(lanes)
    if split2:
        second = product_of(lanes2)

        @jit_kernel()
        def stream_pair(x, w, y, w2, y2, n_tokens, k, group_rows, blocks):
            block = cuda.blockIdx.x
            if block < blocks:
                product(x, w, y, n_tokens, k, group_rows, block, blocks, split)
            else:
                second(x, w2, y2, n_tokens, k, w2.shape[0], block - blocks, cuda.gridDim.x - blocks, split2)

        return stream_pair

    @jit_kernel()
    def stream(x, w, y, n_tokens, k, group_rows):
        product(x, w, y, n_tokens, k, group_rows, cuda.blockIdx.x, cuda.gridDim.x, split)

    return stream


@cache
def stream_partials_kernel(qt: DeviceType, x_bf16: bool, tokens: int):
    """One (row, slice) item a warp: the warps of a block take consecutive rows (row N: the square
    sums) of one K slice and one group of `tokens` tokens, so they share those inputs through L1;
    block = (LANES, STREAM_WARPS), items strided over the grid. Each warp writes its own sums: no
    shared memory, no barrier."""
    walk = stream_walker(qt.stream, x_bf16, tokens)
    walk_squares = stream_walker(SQUARES, x_bf16, tokens)

    @jit_kernel()
    def stream_partials(x, w, partial, n_tokens, k, n_slices):
        ww = w.view(np.uint32)
        wf = w.view(np.float16)
        x32 = x.view(np.uint32)
        lane = cuda.threadIdx.x
        warp = cuda.threadIdx.y
        n_rows = w.shape[0]
        row_groups = n_rows // STREAM_WARPS + 1  # rows 0 .. N
        per_tokens = row_groups * n_slices
        acc = cuda.local.array(tokens, float32)
        for item in range(cuda.blockIdx.x, per_tokens * ((n_tokens + tokens - 1) // tokens), cuda.gridDim.x):
            t0 = (item // per_tokens) * tokens
            s = item % n_slices
            row = (item % per_tokens) // n_slices * STREAM_WARPS + warp
            live = min(tokens, n_tokens - t0)
            xt = x32[t0:]
            for t in range(tokens):
                acc[t] = float32(0)
            if row < n_rows:
                walk(ww, wf, row, xt, uint64(0), k, live, acc, s, n_slices, lane, LANES)
            elif row == n_rows:
                walk_squares(ww, wf, row, xt, uint64(0), k, live, acc, s, n_slices, lane, LANES)
            for t in range(tokens):
                total = warp_sum(acc[t], acc) if LANES > 1 else acc[t]  # (shuffles: no scratch)
                if lane == 0 and row <= n_rows and t < live:
                    partial[t0 + t, row, s] = total

    return stream_partials


def gemv_token_cap(n_tokens: int) -> int:
    """The smallest compiled token cap that holds n_tokens (<= GEMV_MAX_TOKENS)."""
    return next(cap for cap in GEMV_TOKEN_CAPS if cap >= n_tokens)


@cache
def gemm_kernel(qt: DeviceType, x_bf16: bool, out_bf16: bool):
    """Tiles of TM tokens x TN outputs; block = (THREADS_X, THREADS_Y)."""
    dequant = qt.weight_dequant

    @jit_kernel()
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


def pick_kernel(w: DeviceWeight, x_bf16: bool, n_tokens: int, group_rows: int = 0) -> str:
    """The default kernel for a product (docs/performance.md, "Which product kernel runs"). Up to
    GEMV_MAX_TOKENS tokens: imma where linear_imma.decode_pick measured it faster (GPU, bf16 x, large
    Q2_K, Q3_K, Q4_K, Q5_K and MXFP4 weights, tall Q8_0 and Q6_K ones), else stream; the same
    kernel for every count up to there, so a batch of decode steps gives each sequence its single
    step's bits. More, up to NARROW_MAX_TOKENS: the narrow
    tensor-core product (stages.linear_narrow) where it applies (GPU, bf16 x, BF16 and Q8_0
    weights). Past that, on a GPU with bf16 x: the warpgroup GEMM (stages.gemm_wgmma) for BF16 on
    a GPU of compute capability 9.0 (gemm_wgmma.supports: wgmma is sm_90a's alone), the pipelined
    GEMM (stages.gemm_pipe) for Q8_0 and for BF16 elsewhere, the tensor cores (stages.linear_tc) for
    the types it takes. Else, on a GPU and up to NARROW_MAX_TOKENS tokens, stream in launches of
    GEMV_MAX_TOKENS tokens; else gemm."""
    x_dtype = np.uint16 if x_bf16 else np.float32
    if n_tokens <= GEMV_MAX_TOKENS:
        imma = (not SIM and linear_imma.takes(w, x_dtype, group_rows)
                and linear_imma.decode_pick(w.gtype, w.n, w.k))
        return "imma" if imma else "stream"
    if n_tokens <= NARROW_MAX_TOKENS and linear_narrow.supports(w, x_dtype, group_rows):
        return "narrow"
    if gemm_wgmma.supports(w, x_dtype):
        return "wgmma"
    if gemm_pipe.supports(w, x_dtype):
        return "pipe"
    if linear_tc.supports(w, x_dtype):
        return "tc"
    return "stream" if not SIM and n_tokens <= NARROW_MAX_TOKENS else "gemm"


def _check_product(x, w: DeviceWeight, y, n_tokens: int, groups: int) -> None:
    if w.k % CHUNK or x.shape[1] < groups * w.k or y.shape[1] < w.n or n_tokens > min(x.shape[0], y.shape[0]):
        raise ValueError(f"linear {w.name}: x {x.shape}, y {y.shape}, weight [{w.n}, {w.k}], {n_tokens} tokens")


def linear(x, w: DeviceWeight, y, n_tokens: int, group_rows: int = 0, stream=0, kernel: str = "") -> None:
    """y[:n_tokens] = x[:n_tokens] @ w^T on the device (dtypes of x and y pick the variant).

    group_rows > 0: grouped product, output row n reads x[:, (n // group_rows) * K : ... + K].
    kernel: "stream", "narrow", "gemm", "tc", "imma", "pipe" or "wgmma" to force one (tests,
    benchmarks); by default `pick_kernel` decides. ValueError where a forced narrow, tc, imma, pipe
    or wgmma does not take the product (naming the weight and what the kernel takes).
    """
    x_bf16 = x.dtype == np.uint16
    out_bf16 = y.dtype == np.uint16
    groups = w.n // group_rows if group_rows else 1
    grouped = group_rows if groups > 1 else 0  # what the tensor-core wrappers take: 0 for one group
    if not group_rows:
        group_rows = w.n
    _check_product(x, w, y, n_tokens, groups)
    kernel = kernel or pick_kernel(w, x_bf16, n_tokens, grouped)
    if kernel == "imma":
        linear_imma.linear_imma(x, w, y, n_tokens, grouped, stream)
    elif kernel == "wgmma":
        gemm_wgmma.gemm_wgmma(x, w, y, n_tokens, grouped, stream)
    elif kernel == "pipe":
        gemm_pipe.gemm_pipe(x, w, y, n_tokens, grouped, stream)
    elif kernel == "tc":
        linear_tc.linear_tc(x, w, y, n_tokens, grouped, stream)
    elif kernel == "narrow":
        linear_narrow.linear_narrow(x, w, y, n_tokens, grouped, stream)
    elif kernel == "stream":
        _stream(x, w, y, None, n_tokens, group_rows if groups > 1 else 0, stream)
    else:
        gemm = gemm_kernel(DEVICE_TYPES[w.gtype], x_bf16, out_bf16)
        grid = ((group_rows + TN - 1) // TN, (n_tokens + TM - 1) // TM)
        for g in range(groups):  # one launch per group (prefill: launch cost is noise here)
            gemm[grid, (THREADS_X, THREADS_Y), stream](x, w.data, y, n_tokens, group_rows, w.k,
                                                       g * group_rows, g * w.k)


def _stream_launch(w: DeviceWeight, group_rows: int) -> tuple[int, int, int]:
    """(split, lanes, blocks) of the stream kernel for w (group_rows 0: one group); the simulator
    walks a product in one block."""
    unit = DEVICE_TYPES[w.gtype].gemv_unit
    rows = unit.rows
    if group_rows and group_rows % rows:  # (one group: a last row group short of `rows` is the unit's to skip)
        raise ValueError(f"linear {w.name}: groups of {group_rows} rows do not split into the stream kernel's "
                         f"row groups of {rows}")
    row_groups = -(-w.n // rows)
    split = stream_split(row_groups)
    lanes = stream_lanes((w.k >> unit.shift) // split, row_groups, split)
    return split, lanes, 1 if SIM else stream_blocks(row_groups, split, lanes)


def _stream(x, w: DeviceWeight, y, second: tuple[DeviceWeight, Any] | None, n_tokens: int, group_rows: int,
            stream) -> None:
    """The stream kernel's launches for `linear` (group_rows 0: one group) and `linear_pair`
    (second: the pair's other product, of w's type and K, ungrouped), GEMV_MAX_TOKENS tokens each."""
    qt = DEVICE_TYPES[w.gtype]
    split, lanes, blocks = _stream_launch(w, group_rows)
    split2, lanes2, blocks2 = _stream_launch(second[0], 0) if second else (0, LANES, 0)
    x_bf16, out_bf16 = x.dtype == np.uint16, y.dtype == np.uint16
    for t0 in range(0, n_tokens, GEMV_MAX_TOKENS):
        live = min(GEMV_MAX_TOKENS, n_tokens - t0)
        kernel = stream_kernel(qt, x_bf16, out_bf16, gemv_token_cap(live), split, split2, lanes, lanes2)
        xt, yt = (x, y) if t0 == 0 else (x[t0:], y[t0:])
        if second is None:
            kernel[blocks, (LANES, STREAM_WARPS), stream](xt, w.data, yt, live, w.k, group_rows or w.n)
        else:
            w2, y2 = second
            kernel[blocks + blocks2, (LANES, STREAM_WARPS), stream](
                xt, w.data, yt, w2.data, y2 if t0 == 0 else y2[t0:], live, w.k, w.n, blocks)


def linear_pair(x, w: DeviceWeight, y, w2: DeviceWeight, y2, n_tokens: int, stream=0) -> None:
    """y = x @ w^T and y2 = x @ w2^T (ungrouped), as `linear` computes each: where both take the
    stream kernel, have one type and one K and y, y2 one dtype, in one launch (a decode step's
    short matrices that read the same input: each alone leaves most of the GPU idle); else one
    `linear` call each. Every output is bit for bit what `linear` gives it alone."""
    x_bf16 = x.dtype == np.uint16
    if (w.gtype != w2.gtype or w.k != w2.k or y.dtype != y2.dtype or pick_kernel(w, x_bf16, n_tokens) != "stream"
            or pick_kernel(w2, x_bf16, n_tokens) != "stream"):
        linear(x, w, y, n_tokens, stream=stream)
        linear(x, w2, y2, n_tokens, stream=stream)
        return
    for weight, out in ((w, y), (w2, y2)):
        _check_product(x, weight, out, n_tokens, 1)
    if n_tokens:
        _stream(x, w, y, (w2, y2), n_tokens, 0, stream)


def stream_partials(x, w: DeviceWeight, partial, n_tokens: int, stream=0) -> None:
    """partial[t, n, s] = the sum over slice s of K of x[t, k] * dequant(w)[n, k] for the N rows,
    and partial[t, N, s] = the sum over slice s of x[t, k]^2, for the S = partial.shape[2] slices
    (equal runs of the type's units): the hc mixes' product and square sum, whose slices
    stages.hyper adds up. x [T, K] (bf16 bits or float32), partial float32 [>= T, N + 1, S]; any T
    (groups of up to GEMV_MAX_TOKENS tokens, one launch)."""
    if (w.k % CHUNK or x.shape[1] < w.k or n_tokens > x.shape[0] or partial.dtype != np.float32
            or partial.shape[0] < n_tokens or partial.shape[1] != w.n + 1):
        raise ValueError(f"stream_partials {w.name}: x {x.shape}, partial {partial.shape} {partial.dtype}, "
                         f"weight [{w.n}, {w.k}], {n_tokens} tokens")
    if n_tokens == 0:
        return
    tokens = gemv_token_cap(min(n_tokens, GEMV_MAX_TOKENS))
    slices = partial.shape[2]
    items = (w.n // STREAM_WARPS + 1) * slices * -(-n_tokens // tokens)
    stream_partials_kernel(DEVICE_TYPES[w.gtype], x.dtype == np.uint16, tokens)[
        1 if SIM else items, (LANES, STREAM_WARPS), stream](x, w.data, partial, n_tokens, w.k, slices)
