"""Sparse attention of a prefill chunk in one tensor-core kernel (stages.sparse_attention's
"fused" cores: the GPU's default for a call of more than eight tokens without address tables).

What it replaced there: the split path's three launches on the tensor cores, which write every
score (fp32 [T, H, E]) and every entry block's value sums (fp32 [T, NB, H, D], 84 MB a 64-token
sub-chunk at the flash shape) to global memory and read them back, in blocks of about 1 MFLOP. On
an H100 (2026-12-07; 64 heads x 512, 640 entries) this kernel took 303 / 409 / 592 / 1,060 us for
64 / 128 / 256 / 512 tokens where the split path took 800 / 1,419 / 3,754 / 4,320 us; the split path
stays for batched decode steps (address tables) and where forced.

A block of four warps owns (16 heads, one token) and walks the query's entry blocks of 64 in
order, each once: the block's 64 rows copied whole into shared memory (cp.async, 16-byte chunks
swizzled: chunk c of row r at c ^ (r & 7)), the scores q . k of the 16 heads x 64 entries by mma
m16n8k16 with both operands read by ldmatrix (warp w: entries 16 w .. 16 w + 15, over all of D),
the block's max and p = exp(s - max) made in registers and exchanged through shared memory
(bf16(p) as the values' A operand, each warp's float64 sum of its p), and the value sums bf16(p) x
rows by mma with the rows read by ldmatrix.trans (warp w: dims w D / 4 .. (w + 1) D / 4 - 1 of the
16 heads). The running output is rescaled in registers as the split path's combine does. Dynamic
shared memory: the 16 rotated query rows and the 64 entry rows, (16 + 64) x D x 2 bytes (80 KiB at
D = 512: stages.device.allow_dynamic_shared). ptxas 13 for sm_90: 223 registers, no spills; two
blocks an SM (shared memory's limit).

The recurrence and its roundings are the split path's (stages.sparse_attention's module docstring):
per block b, m_b = max(m_{b-1}, the block's scores) from START_MAX; p_j = exp_f32(s_j - m_b);
block_sum = float32 of the float64 sum of the p_j; the value sums sum_j bf16(p_j) row_j in fp32;
sum = mul_rn(sum, r_b) + block_sum and acc = mul_rn(acc, r_b) + pv_b with r_b = exp_f32(m_{b-1} -
m_b); the sink's exp(sink - m) added to the denominator at the end; the output rounded and rotated
back as _output_pair does. What differs from the split path: the fp32 order of q . k over D, the
order of the float64 block sum (each warp's 16 entries, the four warps in order, instead of entries
0 .. 63), and the mma order of the value sums: all inside the bound the split path is held to.

Shapes: D a multiple of 64. Heads past H read head H - 1 and are not written. Every token is its
own blocks, so a token's bits do not depend on the chunk's length or where it was cut.

Oracle: host.oracle.attention.attend, through stages.sparse_attention.sparse_attention with
cores="fused" (tests/test_attention_kernels.py; on the simulator the emulated mma and ldmatrix, and
the quads' reductions through shared memory).
"""

from __future__ import annotations

from functools import cache

import numpy as np
from numba import cuda, float32, float64, int32, uint32

from flashv41.stages.device import (
    SIM,
    WARP,
    bf16_round,
    exp_f32,
    f32_bits,
    f32_from_bits,
    jit_kernel,
    launch_dynamic_shared,
    mul_rn,
)
from flashv41.stages.row_tables import u32_rows
from flashv41.stages.smem import (
    ALIGN,
    cp_async16,
    cp_async_commit,
    cp_async_wait_all,
    ldmatrix_x4,
    ldmatrix_x4_trans,
    word_address,
)
from flashv41.stages.sparse_entries import NEG_INF, SPARSE_BLOCK, START_MAX, _output_pair, _query_word
from flashv41.stages.sparse_split import _entry_sources
from flashv41.stages.warp_mma import kernel_mma as mma

HEADS = 16  # a block's heads: the mma's rows
WARPS = 4  # a block's warps: each 16 entries of a block's scores, D / 4 of its values
THREADS = WARP * WARPS
SCRATCH = THREADS if SIM else 1

if SIM:
    def quad_max(v, scratch):
        """The max of v over the calling lane's quad (lanes 4 g .. 4 g + 3), to each of them: through
        shared memory (the simulator has no shuffles; every thread of the block must call)."""
        tid = cuda.threadIdx.x
        scratch[tid] = v
        cuda.syncthreads()
        q = tid - tid % 4
        top = max(max(float32(scratch[q]), float32(scratch[q + 1])),
                  max(float32(scratch[q + 2]), float32(scratch[q + 3])))
        cuda.syncthreads()
        return top

    def quad_sum(v, scratch):
        """The float64 sum of v over the calling lane's quad, in the GPU's butterfly order."""
        tid = cuda.threadIdx.x
        scratch[tid] = v
        cuda.syncthreads()
        q = tid - tid % 4
        total = (scratch[q] + scratch[q + 1]) + (scratch[q + 2] + scratch[q + 3])
        cuda.syncthreads()
        return total
else:
    @cuda.jit(device=True)
    def quad_max(v, scratch):
        """The max of v over the calling lane's quad (lanes 4 g .. 4 g + 3), to each of them."""
        for d in (1, 2):
            v = max(v, cuda.shfl_xor_sync(0xFFFFFFFF, v, d))
        return v

    @cuda.jit(device=True)
    def quad_sum(v, scratch):
        """The float64 sum of v over the calling lane's quad: (a + b) + (c + d) in every lane."""
        for d in (1, 2):
            v += cuda.shfl_xor_sync(0xFFFFFFFF, v, d)
        return v


def shared_bytes(head_dim: int) -> int:
    """The dynamic shared memory a block takes: 16 query rows and 64 entry rows of D bf16."""
    return (HEADS + SPARSE_BLOCK) * head_dim * 2


@cache
def fused_kernel(head_dim: int, rope_dim: int = 0, tables: bool = False):
    """The kernel for heads of head_dim (a multiple of 64) with a rope tail of rope_dim dims:
    kernel(q32, rings, chunk32, comps, positions, first, selection, sinks, cos, sin, out,
    n_entries, n_heads, scale) over grid (head groups of 16, tokens), THREADS threads, shared_bytes
    of dynamic shared memory. q32 [T * H, D / 2] and the rows [*, D / 2] as 32-bit words (with
    `tables`, rings and comps are address tables of each token's own, its window row in chunk row
    t); the rest as split_score_kernel's and split_combine_kernel's."""
    assert head_dim % 64 == 0, "D is whole groups of 8 16-byte chunks, D / 4 whole 16-dim pairs of fragments"
    words = head_dim // 2  # a row's 32-bit words
    chunks = head_dim // 8  # its 16-byte chunks
    k_steps = head_dim // 16
    tail = head_dim - rope_dim
    slice_dims = head_dim // WARPS  # a warp's dims of the values
    pairs = slice_dims // 16  # its pairs of 8-dim fragments (one ldmatrix.x4.trans each, a k step)
    rows_at = HEADS * words  # the entry rows' first word in the dynamic shared memory
    pitch = SPARSE_BLOCK // 2 + 4  # the words of a head's bf16(p) pairs, padded off the banks
    copies = SPARSE_BLOCK * chunks // THREADS  # a thread's 16-byte copies of a block's rows
    q_items = HEADS * chunks
    acc_shape = (pairs, 2, 4)  # [fragment pair, fragment, register]: the running output numerators

    @jit_kernel(THREADS)
    def kernel(q32, rings, chunk32, comps, positions, first, selection, sinks, cos, sin, out, n_entries, n_heads,
               scale):
        smem = cuda.shared.array(0, uint32, alignment=ALIGN) if ALIGN else cuda.shared.array(0, uint32)
        src = cuda.shared.array(SPARSE_BLOCK, int32)  # the block's entries: their source (_resolve), -1 skipped
        row = cuda.shared.array(SPARSE_BLOCK, int32)  # and their row there
        pt = cuda.shared.array((HEADS, pitch), uint32)  # [head, entry pair]: bf16(p), the values' A operand
        wmax = cuda.shared.array((WARPS, HEADS), float32)  # [warp, head]: the max of the warp's 16 scores
        wsum = cuda.shared.array((WARPS, HEADS), float64)  # [warp, head]: the float64 sum of its 16 p
        scratch = cuda.shared.array(SCRATCH, float64)  # the simulator's quad reductions (the GPU shuffles)
        tid = cuda.threadIdx.x
        warp = tid // WARP
        lane = tid % WARP
        g = lane >> 2
        t4 = lane & 3
        h0 = cuda.blockIdx.x * HEADS
        t = cuda.blockIdx.y
        ring32, comp32 = (u32_rows(rings, t, words), u32_rows(comps, t, words)) if tables else (rings, comps)
        window = ring32.shape[0]
        chunk_rows = chunk32.shape[0]
        pos = positions[t]
        # the 16 query rows, their rope tails rotated, into shared memory (chunk c of row r at c ^ (r & 7))
        for i in range(tid, q_items, THREADS):
            r = i // chunks
            c = i % chunks
            qrow = t * n_heads + min(h0 + r, n_heads - 1)
            at = r * words + 4 * (c ^ (r & 7))
            for m in range(4):
                w = q32[qrow, 4 * c + m]
                if 8 * c + 8 > tail:
                    w = _query_word(w, 8 * c + 2 * m, tail, cos, sin, pos)
                smem[at + m] = w
        # the lane's ldmatrix rows: the queries' (A: rows g, g + 8; chunks 2 k, 2 k + 1), its warp's
        # entries' for the scores (B: entries 16 w + 8 f + l % 8; chunks 2 k + i % 2), and the
        # values' (B, transposed: entries 16 s + 8 (i % 2) + l % 8; chunks of its dims)
        mat = lane >> 3
        qr = (lane & 7) + 8 * (mat & 1)
        qc = mat >> 1
        er = 16 * warp + 8 * (mat >> 1) + (lane & 7)
        ec = mat & 1
        vr = 8 * (mat & 1) + (lane & 7)
        vc = (warp * slice_dims) // 8 + (mat >> 1)
        acc = cuda.local.array(acc_shape, float32)
        pv = cuda.local.array(acc_shape, float32)  # an entry block's value sums
        for j in range(pairs):
            for f in range(2):
                for i in range(4):
                    acc[j, f, i] = float32(0)
        s = cuda.local.array((2, 4), float32)  # [fragment, register]: the lane's scores
        m_lo = START_MAX  # the running max of heads g and g + 8
        m_hi = START_MAX
        sum_lo = float32(0)  # the running denominators (the sink's term comes last)
        sum_hi = float32(0)
        n_blocks = (n_entries + SPARSE_BLOCK - 1) // SPARSE_BLOCK
        for b in range(n_blocks):
            b0 = b * SPARSE_BLOCK
            _entry_sources(positions, first, selection, t, b0, n_entries, window, chunk_rows, tables, src, row, tid,
                           THREADS)
            cuda.syncthreads()
            for n in range(copies):
                i = tid + n * THREADS
                r = i // chunks
                c = i % chunks
                at = rows_at + r * words + 4 * (c ^ (r & 7))
                sr = src[r]
                ix = row[r]
                if sr == 0:
                    cp_async16(smem, at, ring32, word_address(ring32, ix, 4 * c), 16)
                elif sr == 1:
                    cp_async16(smem, at, chunk32, word_address(chunk32, ix, 4 * c), 16)
                elif sr == 2:
                    cp_async16(smem, at, comp32, word_address(comp32, ix, 4 * c), 16)
                else:  # a skipped entry: zeros (its p is 0, and 0 x 0 adds nothing)
                    cp_async16(smem, at, ring32, word_address(ring32, 0, 0), 0)
            cp_async_commit()
            cp_async_wait_all()
            cuda.syncthreads()
            # scores: 16 heads x the warp's 16 entries (two fragments of 8), over all of D
            for f in range(2):
                for i in range(4):
                    s[f, i] = float32(0)
            for k in range(k_steps):
                c = 2 * k + qc
                a0, a1, a2, a3 = ldmatrix_x4(smem, qr * words + 4 * (c ^ (qr & 7)))
                c = 2 * k + ec
                b00, b01, b10, b11 = ldmatrix_x4(smem, rows_at + er * words + 4 * (c ^ (er & 7)))
                s[0, 0], s[0, 1], s[0, 2], s[0, 3] = mma(a0, a1, a2, a3, b00, b01, s[0, 0], s[0, 1], s[0, 2], s[0, 3])
                s[1, 0], s[1, 1], s[1, 2], s[1, 3] = mma(a0, a1, a2, a3, b10, b11, s[1, 0], s[1, 1], s[1, 2], s[1, 3])
            # lane (g, t) holds heads g (registers 0, 1) and g + 8 (2, 3) at entries 8 f + 2 t, + 1
            top_lo = NEG_INF
            top_hi = NEG_INF
            for f in range(2):
                for i in range(4):
                    j = 16 * warp + 8 * f + 2 * t4 + (i & 1)
                    v = mul_rn(s[f, i], scale) if src[j] >= 0 else NEG_INF
                    s[f, i] = v
                    if i < 2:
                        top_lo = max(top_lo, v)
                    else:
                        top_hi = max(top_hi, v)
            top_lo = quad_max(top_lo, scratch)
            top_hi = quad_max(top_hi, scratch)
            if t4 == 0:
                wmax[warp, g] = top_lo
                wmax[warp, g + 8] = top_hi
            cuda.syncthreads()
            new_lo = m_lo
            new_hi = m_hi
            for w in range(WARPS):
                new_lo = max(new_lo, wmax[w, g])
                new_hi = max(new_hi, wmax[w, g + 8])
            part_lo = float64(0)
            part_hi = float64(0)
            for f in range(2):
                p0 = exp_f32(s[f, 0] - new_lo)
                p1 = exp_f32(s[f, 1] - new_lo)
                p2 = exp_f32(s[f, 2] - new_hi)
                p3 = exp_f32(s[f, 3] - new_hi)
                part_lo += float64(p0) + float64(p1)
                part_hi += float64(p2) + float64(p3)
                w = 8 * warp + 4 * f + t4  # the entry pair 16 w + 8 f + 2 t, + 1
                pt[g, w] = (f32_bits(bf16_round(p0)) >> 16) | (f32_bits(bf16_round(p1)) & 0xFFFF0000)
                pt[g + 8, w] = (f32_bits(bf16_round(p2)) >> 16) | (f32_bits(bf16_round(p3)) & 0xFFFF0000)
            part_lo = quad_sum(part_lo, scratch)
            part_hi = quad_sum(part_hi, scratch)
            if t4 == 0:
                wsum[warp, g] = part_lo
                wsum[warp, g + 8] = part_hi
            cuda.syncthreads()
            block_lo = float64(0)
            block_hi = float64(0)
            for w in range(WARPS):
                block_lo += wsum[w, g]
                block_hi += wsum[w, g + 8]
            r_lo = exp_f32(m_lo - new_lo)
            r_hi = exp_f32(m_hi - new_hi)
            sum_lo = mul_rn(sum_lo, r_lo) + float32(block_lo)
            sum_hi = mul_rn(sum_hi, r_hi) + float32(block_hi)
            m_lo = new_lo
            m_hi = new_hi
            # values: the warp's dims of the 16 heads, k over the block's 64 entries (the fragment
            # pairs the inner loop, so that the compiler unrolls it and keeps pv and acc in registers)
            for j in range(pairs):
                for f in range(2):
                    for i in range(4):
                        pv[j, f, i] = float32(0)
            for ks in range(SPARSE_BLOCK // 16):
                w = 8 * ks + t4
                a0 = pt[g, w]
                a1 = pt[g + 8, w]
                a2 = pt[g, w + 4]
                a3 = pt[g + 8, w + 4]
                r = 16 * ks + vr
                for j in range(pairs):
                    c = vc + 2 * j
                    b00, b01, b10, b11 = ldmatrix_x4_trans(smem, rows_at + r * words + 4 * (c ^ (r & 7)))
                    pv[j, 0, 0], pv[j, 0, 1], pv[j, 0, 2], pv[j, 0, 3] = mma(a0, a1, a2, a3, b00, b01, pv[j, 0, 0],
                                                                             pv[j, 0, 1], pv[j, 0, 2], pv[j, 0, 3])
                    pv[j, 1, 0], pv[j, 1, 1], pv[j, 1, 2], pv[j, 1, 3] = mma(a0, a1, a2, a3, b10, b11, pv[j, 1, 0],
                                                                             pv[j, 1, 1], pv[j, 1, 2], pv[j, 1, 3])
            for j in range(pairs):
                for f in range(2):
                    acc[j, f, 0] = mul_rn(acc[j, f, 0], r_lo) + pv[j, f, 0]
                    acc[j, f, 1] = mul_rn(acc[j, f, 1], r_lo) + pv[j, f, 1]
                    acc[j, f, 2] = mul_rn(acc[j, f, 2], r_hi) + pv[j, f, 2]
                    acc[j, f, 3] = mul_rn(acc[j, f, 3], r_hi) + pv[j, f, 3]
            cuda.syncthreads()  # the rows and bf16(p) are the next block's to overwrite
        # the outputs, divided by the denominators, into shared memory (fp32 [head, D] over the rows:
        # the last block's barrier has passed), then rounded, rotated back and stored by consecutive
        # threads (the lanes' own indices into acc stay constants, so acc stays in registers)
        total_lo = sum_lo + exp_f32(sinks[min(h0 + g, n_heads - 1)] - m_lo)
        total_hi = sum_hi + exp_f32(sinks[min(h0 + g + 8, n_heads - 1)] - m_hi)
        for j in range(pairs):
            for f in range(2):
                d = warp * slice_dims + 16 * j + 8 * f + 2 * t4
                smem[rows_at + g * head_dim + d] = f32_bits(acc[j, f, 0] / total_lo)
                smem[rows_at + g * head_dim + d + 1] = f32_bits(acc[j, f, 1] / total_lo)
                smem[rows_at + (g + 8) * head_dim + d] = f32_bits(acc[j, f, 2] / total_hi)
                smem[rows_at + (g + 8) * head_dim + d + 1] = f32_bits(acc[j, f, 3] / total_hi)
        cuda.syncthreads()
        for i in range(tid, HEADS * words, THREADS):
            k = i // words
            d = 2 * (i % words)
            if h0 + k < n_heads:
                at = rows_at + k * head_dim + d
                out[t, h0 + k, d], out[t, h0 + k, d + 1] = _output_pair(f32_from_bits(smem[at]),
                                                                        f32_from_bits(smem[at + 1]), d, tail, cos,
                                                                        sin, pos)

    return kernel


def fused_attention(q, ring, chunk_rows, comp_rows, positions, chosen, n_entries: int, sinks, scale: float, cos, sin,
                    out, n_tokens: int, stream, rope_dim: int, tables: bool = False) -> None:
    """The launch for sparse_attention's call of n_tokens tokens (stages.sparse_attention._attend: its
    arguments checked, `chosen` the selection or its stand-in, cos and sin the table or theirs, the
    whole chunk at once: positions are the chunk's, the first one its start), or with `tables`
    sparse_attention_tables' (ring and comp_rows address tables, the whole batch at once)."""
    heads, head_dim = q.shape[1], q.shape[2]
    kernel = fused_kernel(head_dim, rope_dim, tables)
    q32 = q.reshape(q.shape[0] * heads, head_dim).view(np.uint32)
    rows = (ring, chunk_rows.view(np.uint32), comp_rows) if tables else tuple(
        a.view(np.uint32) for a in (ring, chunk_rows, comp_rows))
    args = (q32, *rows, positions, positions, chosen, sinks, cos, sin, out, n_entries, heads, np.float32(scale))
    launch_dynamic_shared(kernel, (-(-heads // HEADS), n_tokens), THREADS, stream, shared_bytes(head_dim), *args)
