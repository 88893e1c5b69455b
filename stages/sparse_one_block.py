"""Sparse attention's first path: one block per (head, token) (stages.sparse_attention without a
workspace, or a batch of sparse_attention_tables that the workspace cannot hold): warps share out
a block's 64 dot products (lanes over D), then every thread owns D / threads output dims, block
after block, in the online softmax of stages.sparse_attention's module docstring.

Oracle: host.oracle.attention.attend, through stages.sparse_attention.sparse_attention
(tests/test_attention_kernels.py, test_batch_kernels.py).
"""

from __future__ import annotations

from functools import cache

import numpy as np
from numba import cuda, float32, float64, int32

from flashv41.stages.device import SIM, WARP, bf16_round, bf16_to_f32, exp_f32, jit_kernel, mul_rn, warp_sum
from flashv41.stages.row_tables import u16_rows

if SIM:
    from flashv41.stages.device import _BF16_VALUES

from flashv41.stages.sparse_entries import (
    NEG_INF,
    SPARSE_BLOCK,
    START_MAX,
    _output_pair,
    _query_pair,
    _resolve,
    entry_at,
)

if SIM:
    from flashv41.stages.sparse_entries import _source


# The simulator runs one thread per block (no barriers, lanes of one); the GPU up to 512 threads in
# warps: a decode step has only one block a head, so the block is made wide (16 warps share out
# the 64 dot products of an entry block, and a thread owns D / 512 output dims).
ATTN_THREADS = 1 if SIM else 512
LANES = 1 if SIM else WARP


if SIM:
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


@cache
def sparse_kernel(head_dim: int, threads: int, lanes: int, tables: bool = False, rope_dim: int = 0):
    """Block of `threads` threads (warps of `lanes`) per (head, token). q bf16 [T, H, D]; ring
    [W, D], chunk [Cn, D], comp [G, D] bf16 (tables: ring and comp are address tables [T, 2] of
    each token's own, stages.row_tables); positions int32 [T], selection int32 [T, E - W] (entry_at);
    sinks fp32 [H]; cos, sin fp32 [max_seq, rope_dim / 2]; out bf16 [T, H, D]: the output rounded to
    bf16, its last rope_dim dims then rotated back (_output_pair; none for rope_dim 0)."""
    sync = threads > 1
    warps = threads // lanes
    per_thread = head_dim // threads
    tail = head_dim - rope_dim

    @jit_kernel(threads)
    def kernel(q, rings, chunk, comps, positions, selection, sinks, cos, sin, out, n_entries, scale):
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
        ring, comp = (u16_rows(rings, t, head_dim), u16_rows(comps, t, head_dim)) if tables else (rings, comps)
        window = ring.shape[0]
        chunk_rows = chunk.shape[0]
        pos = positions[t]
        for d in range(tid, head_dim, threads):  # the query, its rope tail rotated (_query_pair)
            if d < tail:
                qs[d] = bf16_to_f32(q[t, h, d])
            else:
                e = d - d % 2  # the pair's first dim
                a, b = _query_pair(bf16_to_f32(q[t, h, e]), bf16_to_f32(q[t, h, e + 1]), e, tail, cos, sin, pos)
                qs[d] = b if d % 2 else a
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
                # (this kernel always runs the whole chunk: its positions are the chunk's own)
                sr, ix = _resolve(entry_at(positions, positions, selection, t, b0 + j, window, chunk_rows, n_entries,
                                           tables), window, chunk_rows)
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
        # a rope pair's two dims may be two threads': the outputs meet in qs (no longer read)
        for i in range(per_thread):
            qs[tid + i * threads] = acc[i] / sum_exp
        if sync:
            cuda.syncthreads()
        for i in range(per_thread):
            d = tid + i * threads
            e = d - d % 2  # the pair's first dim
            a, b = _output_pair(qs[e], qs[e + 1], e, tail, cos, sin, pos)
            out[t, h, d] = b if d % 2 else a

    return kernel
