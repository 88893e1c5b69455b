"""Sparse single-kv-head attention with a sink on the device, and the per-query entry lists.

Shapes (T tokens, H heads x D head_dim, W window slots, E entries per query; bf16 = uint16 bits):
- `sparse_attention(q, ring, chunk_rows, comp_rows, entries, sinks, scale, out, n_tokens)`:
  q bf16 [T, H, D]; ring bf16 [W, D] (the window ring, slot = position % W); chunk_rows bf16 [Cn, D]
  (this chunk's window rows); comp_rows bf16 [G, D] (the compressed cache); entries int32 [T, E]:
  e < 0 skipped, e < W -> ring[e], e < W + Cn -> chunk_rows[e - W], else comp_rows[e - W - Cn];
  sinks fp32 [H]; out bf16 [T, H, D]. K = V = the row (MQA).
- `build_entries(positions, selection, window, chunk_capacity, entries, n_tokens)`: the canonical
  list of each query at position p in that encoding: the W window positions p - W + 1 .. p oldest
  first (-1 before 0; ring slots for positions before the chunk, chunk rows from the chunk's
  first position on), then the K selected compressed positions as given (ascending, -1 padded).
Oracle: host.oracle.attention.sparse_attention(q, ring, chunk_rows, comp_rows, entries, sinks, scale)
and host.oracle.attention.build_entries(positions, selection, window, chunk_capacity): the wrappers
take those arguments in that order, then their output and row count.

The online softmax walks the entries in blocks of 64 in the oracle's order and roundings: per
block the running max (from -1e30) is updated, p = exp(s - max) (float64 exp rounded once, as the
oracle), the block's p summed in float64 into the fp32 running sum after its fp32 rescale, p
rounded to bf16 before the value product; the sink adds exp(sink - max) to the denominator only;
a row without entries gives 0 / inf = 0. What differs from the oracle is the fp32 accumulation of
q . k over D and of the value products over a block (the oracle's are float64). The bound this
implies is derived in tests/test_attention_kernels.py.

One block per (head, token): warps share out the block's 64 dot products (lanes over D), then
every thread owns D / threads output dims.
"""

from __future__ import annotations

from functools import cache

import numpy as np
from numba import cuda, float32, float64, int32

from flashv41.host.errors import InputError
from flashv41.stages.device import (
    SIM,
    WARP,
    DeviceArray,
    bf16_round,
    bf16_to_f32,
    check_array,
    check_rows,
    device,
    exp_f32,
    f32_to_bf16,
    grid_1d,
    jit_for,
    mul_rn,
    warp_sum,
)

if SIM:
    from flashv41.stages.device import _BF16_VALUES

SPARSE_BLOCK = 64
START_MAX = float32(-1e30)
NEG_INF = float32(-np.inf)
# The simulator runs one thread per block (no barriers, lanes of one); the GPU up to 512 threads in
# warps: a decode step has only one block a head, so the block is made wide (16 warps share out
# the 64 dot products of an entry block, and a thread owns D / 512 output dims).
ATTN_THREADS = 1 if SIM else 512
LANES = 1 if SIM else WARP
ENTRY_THREADS = 64 if SIM else 256

if SIM:
    def _source(ring, chunk, comp, src):
        return ring if src == 0 else (chunk if src == 1 else comp)

    def _row_dot(qs, ring, chunk, comp, src, ix, lane, lanes):
        row = _source(ring, chunk, comp, src)[ix, lane::lanes]
        return np.float32(np.dot(qs[lane::lanes], _BF16_VALUES[row]))

    def _row_axpy(pv, p, ring, chunk, comp, src, ix, tid, threads):
        pv += np.float32(p) * _BF16_VALUES[_source(ring, chunk, comp, src)[ix, tid::threads]]
else:
    @cuda.jit(device=True)
    def _row_value(ring, chunk, comp, src, ix, d):
        if src == 0:
            return bf16_to_f32(ring[ix, d])
        if src == 1:
            return bf16_to_f32(chunk[ix, d])
        return bf16_to_f32(comp[ix, d])

    @cuda.jit(device=True)
    def _row_dot(qs, ring, chunk, comp, src, ix, lane, lanes):
        s = float32(0)
        for d in range(lane, qs.shape[0], lanes):
            s += qs[d] * _row_value(ring, chunk, comp, src, ix, d)
        return s

    @cuda.jit(device=True)
    def _row_axpy(pv, p, ring, chunk, comp, src, ix, tid, threads):
        for i in range(pv.shape[0]):
            pv[i] += p * _row_value(ring, chunk, comp, src, ix, tid + i * threads)


@device
def _resolve(e, window, chunk_rows):
    """(source, row) of entry e: 0 ring, 1 chunk rows, 2 compressed rows; -1 skipped."""
    if e < 0:
        return int32(-1), int32(0)
    if e < window:
        return int32(0), int32(e)
    if e < window + chunk_rows:
        return int32(1), int32(e - window)
    return int32(2), int32(e - window - chunk_rows)


@cache
def sparse_kernel(head_dim: int, threads: int, lanes: int):
    """Block of `threads` threads (warps of `lanes`) per (head, token). q bf16 [T, H, D]; ring
    [W, D], chunk [Cn, D], comp [G, D] bf16; entries int32 [T, E]; sinks fp32 [H]; out bf16 [T, H, D]."""
    sync = threads > 1
    warps = threads // lanes
    per_thread = head_dim // threads

    @jit_for(threads)
    def kernel(q, ring, chunk, comp, entries, sinks, out, n_entries, scale):
        qs = cuda.shared.array(head_dim, float32)  # [D]: the query, fp32
        ss = cuda.shared.array(SPARSE_BLOCK, float32)  # [64]: the block's scores (-inf: skipped)
        ps = cuda.shared.array(SPARSE_BLOCK, float32)  # [64]: their probabilities, fp32
        src = cuda.shared.array(SPARSE_BLOCK, int32)  # [64]: the source of each entry's row (_resolve)
        row = cuda.shared.array(SPARSE_BLOCK, int32)  # [64]: its row there
        scratch = cuda.shared.array(threads, float32)  # [threads]: warp_sum's (simulator)
        h = cuda.blockIdx.x
        t = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        lane = tid % lanes
        warp = tid // lanes
        window = ring.shape[0]
        chunk_rows = chunk.shape[0]
        for d in range(tid, head_dim, threads):
            qs[d] = bf16_to_f32(q[t, h, d])
        acc = cuda.local.array(per_thread, float32)  # [D / threads]: this thread's output dims
        pv = cuda.local.array(per_thread, float32)  # [D / threads]: their value sum over a block
        for i in range(per_thread):
            acc[i] = float32(0)
        run_max = START_MAX
        sum_exp = float32(0)
        if sync:
            cuda.syncthreads()
        for b0 in range(0, n_entries, SPARSE_BLOCK):
            for j in range(warp, SPARSE_BLOCK, warps):
                e = entries[t, b0 + j] if b0 + j < n_entries else -1
                sr, ix = _resolve(e, window, chunk_rows)
                part = float32(0)
                if sr >= 0:
                    part = _row_dot(qs, ring, chunk, comp, sr, ix, lane, lanes)
                if lanes > 1:
                    part = warp_sum(part, scratch)
                if lane == 0:
                    ss[j] = mul_rn(part, scale) if sr >= 0 else NEG_INF
                    src[j] = sr
                    row[j] = ix
            if sync:
                cuda.syncthreads()
            new_max = run_max
            for j in range(SPARSE_BLOCK):
                new_max = max(new_max, ss[j])
            for j in range(tid, SPARSE_BLOCK, threads):
                ps[j] = exp_f32(ss[j] - new_max)
            if sync:
                cuda.syncthreads()
            block_sum = float64(0)
            for j in range(SPARSE_BLOCK):
                block_sum += float64(ps[j])
            rescale = exp_f32(run_max - new_max)
            sum_exp = mul_rn(sum_exp, rescale) + float32(block_sum)
            for i in range(per_thread):
                pv[i] = float32(0)
            for j in range(SPARSE_BLOCK):
                if src[j] >= 0:
                    _row_axpy(pv, bf16_round(ps[j]), ring, chunk, comp, src[j], row[j], tid, threads)
            for i in range(per_thread):
                acc[i] = mul_rn(acc[i], rescale) + pv[i]
            run_max = new_max
            if sync:
                cuda.syncthreads()  # the next block overwrites ss, ps, src, row
        sum_exp = sum_exp + exp_f32(sinks[h] - run_max)
        for i in range(per_thread):
            out[t, h, tid + i * threads] = f32_to_bf16(acc[i] / sum_exp)

    return kernel


@cuda.jit
def _entries_kernel(positions, selection, entries, n_tokens, window, chunk_rows, n_selected):
    """One thread per (token, entry): the window entries, then the selection shifted past the ring
    and the chunk rows. positions int32 [T]; selection int32 [T, K]; entries int32 [T, W + K]."""
    i = cuda.grid(1)
    width = window + n_selected
    if i >= n_tokens * width:
        return
    t = i // width
    j = i % width
    start = positions[0]
    if j < window:
        wp = positions[t] - window + 1 + j
        if wp < 0:
            e = -1
        elif wp >= start:
            e = window + (wp - start)
        else:
            e = wp % window
    else:
        s = selection[t, j - window]
        e = -1 if s < 0 else window + chunk_rows + s
    entries[t, j] = e


def build_entries(positions: DeviceArray, selection: DeviceArray | None, window: int, chunk_capacity: int,
                  entries: DeviceArray, n_tokens: int, stream=0) -> None:
    """entries[:T, :W + K] as sparse_attention reads them (K = selection.shape[1], 0 without one)."""
    check_array(positions, (np.int32,), 1, "build_entries positions")
    check_array(entries, (np.int32,), 2, "build_entries entries")
    n_selected = 0
    if selection is not None:
        check_array(selection, (np.int32,), 2, "build_entries selection")
        check_rows(selection, n_tokens, "build_entries selection")
        n_selected = selection.shape[1]
    check_rows(positions, n_tokens, "build_entries positions")
    check_rows(entries, n_tokens, "build_entries entries")
    if entries.shape[1] != window + n_selected:
        raise InputError(f"build_entries: entries {entries.shape} for {window} window + {n_selected} selected")
    total = n_tokens * (window + n_selected)
    if total:
        # without a selection the kernel reads none: any int32 [T, *] array stands in for it
        _entries_kernel[grid_1d(total, ENTRY_THREADS), ENTRY_THREADS, stream](
            positions, entries if selection is None else selection, entries, n_tokens, window, chunk_capacity,
            n_selected)


def sparse_attention(q: DeviceArray, ring: DeviceArray, chunk_rows: DeviceArray, comp_rows: DeviceArray,
                     entries: DeviceArray, sinks: DeviceArray, scale: float, out: DeviceArray, n_tokens: int,
                     stream=0, threads: int = 0) -> None:
    """out[:T] = attention of q[:T] over the rows its entries name (see the module docstring).
    threads: block size (0 = the default; tests force others)."""
    check_array(q, (np.uint16,), 3, "sparse_attention q")
    check_array(out, (np.uint16,), 3, "sparse_attention out")
    for a, what in ((ring, "ring"), (chunk_rows, "chunk_rows"), (comp_rows, "comp_rows")):
        check_array(a, (np.uint16,), 2, f"sparse_attention {what}")
    check_array(entries, (np.int32,), 2, "sparse_attention entries")
    check_array(sinks, (np.float32,), 1, "sparse_attention sinks")
    for a, what in ((q, "q"), (out, "out"), (entries, "entries")):
        check_rows(a, n_tokens, f"sparse_attention {what}")
    heads, head_dim = q.shape[1], q.shape[2]
    if (out.shape[1:] != q.shape[1:] or sinks.shape[0] != heads
            or any(a.shape[1] != head_dim for a in (ring, chunk_rows, comp_rows))):
        raise InputError(f"sparse_attention: q {q.shape}, out {out.shape}, sinks {sinks.shape}, ring {ring.shape}, "
                         f"chunk_rows {chunk_rows.shape}, comp_rows {comp_rows.shape} do not agree")
    if n_tokens == 0:
        return
    nt = threads or min(ATTN_THREADS, head_dim)
    lanes = min(LANES, nt)
    if head_dim % nt or nt % lanes:
        raise InputError(f"sparse_attention: {nt} threads do not divide head_dim {head_dim}")
    sparse_kernel(head_dim, nt, lanes)[(heads, n_tokens), nt, stream](
        q, ring, chunk_rows, comp_rows, entries, sinks, out, entries.shape[1], np.float32(scale))
