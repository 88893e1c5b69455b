"""stages.sparse_fused's kernel with two changes, for the next GPU run to time against it (issue 44;
not in the package until it has run on a GPU and won):

- a block holds two groups of 16 heads (eight warps, 32 heads) of one token: each row a block
  copies serves twice the products, half the L2 traffic a FLOP;
- two row buffers: block b + 1's entry sources and copies go out before block b's products
  (cp.async.wait_group 1), so a block's copies run under its previous block's mma, where the
  stage's kernel waits for each block's rows with nothing to do (its two blocks an SM hide each
  other's waits only).

Dynamic shared memory (32 + 2 x 64) x D x 2 bytes: 160 KiB at D = 512, one block an SM (eight
warps, as the stage's two blocks of four). The products, the recurrence and their roundings are
the stage kernel's, line for line: the same bits, which dev/test_sparse_fused2.py checks against
it, and the oracle's bound through it. `python -m dev.test_sparse_fused2` times the two.
"""

from __future__ import annotations

from functools import cache

import numpy as np
from numba import cuda, float32, float64, int32, uint32

from flashv41.stages import sparse_fused
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
    cp_async_wait_one,
    ldmatrix_x4,
    ldmatrix_x4_trans,
    word_address,
)
from flashv41.stages.sparse_entries import NEG_INF, SPARSE_BLOCK, START_MAX, _output_pair, _query_word
from flashv41.stages.sparse_split import _entry_sources
from flashv41.stages.warp_mma import kernel_mma as mma

GROUPS = 2  # groups of 16 heads a block
HEADS = 16 * GROUPS
WARPS = 4 * GROUPS
THREADS = WARP * WARPS
SCRATCH = THREADS if SIM else 1
# on the simulator, jitted here so that it gives them its cuda module when this module's kernel calls them
quad_max, quad_sum = ((cuda.jit(device=True)(sparse_fused.quad_max), cuda.jit(device=True)(sparse_fused.quad_sum))
                      if SIM else (sparse_fused.quad_max, sparse_fused.quad_sum))


def shared_bytes(head_dim: int) -> int:
    """The dynamic shared memory a block takes: 32 query rows and two buffers of 64 entry rows."""
    return (HEADS + 2 * SPARSE_BLOCK) * head_dim * 2


@cache
def fused2_kernel(head_dim: int, rope_dim: int = 0, tables: bool = False):
    """The kernel for heads of head_dim (a multiple of 64) with a rope tail of rope_dim dims:
    kernel(q32, ring32, chunk32, comp32, positions, first, selection, sinks, cos, sin, out,
    n_entries, n_heads, scale) over grid (head groups of 16, tokens), THREADS threads, shared_bytes
    of dynamic shared memory. q32 [T * H, D / 2] and the rows [*, D / 2] as 32-bit words; the rest as
    split_score_kernel's and split_combine_kernel's (tables: ring32 and comp32 are address tables of
    each token's own, its window row in chunk row t)."""
    assert head_dim % 64 == 0, "D is whole groups of 8 16-byte chunks, D / 4 whole 16-dim pairs of fragments"
    words = head_dim // 2  # a row's 32-bit words
    chunks = head_dim // 8  # its 16-byte chunks
    k_steps = head_dim // 16
    tail = head_dim - rope_dim
    slice_dims = head_dim // 4  # a warp's dims of the values (of its group's 16 heads)
    pairs = slice_dims // 16  # its pairs of 8-dim fragments (one ldmatrix.x4.trans each, a k step)
    rows_at = HEADS * words  # the entry rows' two buffers' first word in the dynamic shared memory
    buffer_words = SPARSE_BLOCK * words
    pitch = SPARSE_BLOCK // 2 + 4  # the words of a head's bf16(p) pairs, padded off the banks
    copies = SPARSE_BLOCK * chunks // THREADS  # a thread's 16-byte copies of a block's rows
    q_items = HEADS * chunks
    acc_shape = (pairs, 2, 4)  # [fragment pair, fragment, register]: the running output numerators

    @jit_kernel(THREADS)
    def kernel(q32, rings, chunk32, comps, positions, first, selection, sinks, cos, sin, out, n_entries, n_heads,
               scale):
        smem = cuda.shared.array(0, uint32, alignment=ALIGN) if ALIGN else cuda.shared.array(0, uint32)
        src = cuda.shared.array((2, SPARSE_BLOCK), int32)  # [buffer, entry]: its source (_resolve), -1 skipped
        row = cuda.shared.array((2, SPARSE_BLOCK), int32)  # and its row there
        pt = cuda.shared.array((GROUPS, 16, pitch), uint32)  # [group, head, entry pair]: bf16(p), the values' A
        wmax = cuda.shared.array((GROUPS, 4, 16), float32)  # [group, warp, head]: the max of the warp's 16 scores
        wsum = cuda.shared.array((GROUPS, 4, 16), float64)  # [group, warp, head]: the float64 sum of its 16 p
        scratch = cuda.shared.array(SCRATCH, float64)  # the simulator's quad reductions (the GPU shuffles)
        tid = cuda.threadIdx.x
        grp = tid // (4 * WARP)  # the warp's group of 16 heads
        hb = 16 * grp  # its first head in the block
        warp = tid // WARP % 4  # its quarter: of a block's entries (scores), of D (values)
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
        qr = hb + (lane & 7) + 8 * (mat & 1)
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
        # block b + 1's sources and copies go out before block b's products (two row buffers): at
        # b = -1 the first block's alone
        for b in range(-1, n_blocks):
            nxt = (b + 1) & 1
            if b + 1 < n_blocks:
                _entry_sources(positions, first, selection, t, (b + 1) * SPARSE_BLOCK, n_entries, window, chunk_rows,
                               tables, src[nxt], row[nxt], tid, THREADS)
            cuda.syncthreads()
            if b + 1 < n_blocks:
                for n in range(copies):
                    i = tid + n * THREADS
                    r = i // chunks
                    c = i % chunks
                    at = rows_at + nxt * buffer_words + r * words + 4 * (c ^ (r & 7))
                    sr = src[nxt, r]
                    ix = row[nxt, r]
                    if sr == 0:
                        cp_async16(smem, at, ring32, word_address(ring32, ix, 4 * c), 16)
                    elif sr == 1:
                        cp_async16(smem, at, chunk32, word_address(chunk32, ix, 4 * c), 16)
                    elif sr == 2:
                        cp_async16(smem, at, comp32, word_address(comp32, ix, 4 * c), 16)
                    else:  # a skipped entry: zeros (its p is 0, and 0 x 0 adds nothing)
                        cp_async16(smem, at, ring32, word_address(ring32, 0, 0), 0)
            cp_async_commit()  # (an empty group past the last block: the wait below stays one behind)
            if b < 0:
                continue
            cur = b & 1
            base = rows_at + cur * buffer_words
            cp_async_wait_one()  # every group but the newest (block b + 1's) has landed
            cuda.syncthreads()
            # scores: 16 heads x the warp's 16 entries (two fragments of 8), over all of D
            for f in range(2):
                for i in range(4):
                    s[f, i] = float32(0)
            for k in range(k_steps):
                c = 2 * k + qc
                a0, a1, a2, a3 = ldmatrix_x4(smem, qr * words + 4 * (c ^ (qr & 7)))
                c = 2 * k + ec
                b00, b01, b10, b11 = ldmatrix_x4(smem, base + er * words + 4 * (c ^ (er & 7)))
                s[0, 0], s[0, 1], s[0, 2], s[0, 3] = mma(a0, a1, a2, a3, b00, b01, s[0, 0], s[0, 1], s[0, 2], s[0, 3])
                s[1, 0], s[1, 1], s[1, 2], s[1, 3] = mma(a0, a1, a2, a3, b10, b11, s[1, 0], s[1, 1], s[1, 2], s[1, 3])
            # lane (g, t) holds heads g (registers 0, 1) and g + 8 (2, 3) at entries 8 f + 2 t, + 1
            top_lo = NEG_INF
            top_hi = NEG_INF
            for f in range(2):
                for i in range(4):
                    j = 16 * warp + 8 * f + 2 * t4 + (i & 1)
                    v = mul_rn(s[f, i], scale) if src[cur, j] >= 0 else NEG_INF
                    s[f, i] = v
                    if i < 2:
                        top_lo = max(top_lo, v)
                    else:
                        top_hi = max(top_hi, v)
            top_lo = quad_max(top_lo, scratch)
            top_hi = quad_max(top_hi, scratch)
            if t4 == 0:
                wmax[grp, warp, g] = top_lo
                wmax[grp, warp, g + 8] = top_hi
            cuda.syncthreads()
            new_lo = m_lo
            new_hi = m_hi
            for w in range(4):
                new_lo = max(new_lo, wmax[grp, w, g])
                new_hi = max(new_hi, wmax[grp, w, g + 8])
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
                pt[grp, g, w] = (f32_bits(bf16_round(p0)) >> 16) | (f32_bits(bf16_round(p1)) & 0xFFFF0000)
                pt[grp, g + 8, w] = (f32_bits(bf16_round(p2)) >> 16) | (f32_bits(bf16_round(p3)) & 0xFFFF0000)
            part_lo = quad_sum(part_lo, scratch)
            part_hi = quad_sum(part_hi, scratch)
            if t4 == 0:
                wsum[grp, warp, g] = part_lo
                wsum[grp, warp, g + 8] = part_hi
            cuda.syncthreads()
            block_lo = float64(0)
            block_hi = float64(0)
            for w in range(4):
                block_lo += wsum[grp, w, g]
                block_hi += wsum[grp, w, g + 8]
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
                a0 = pt[grp, g, w]
                a1 = pt[grp, g + 8, w]
                a2 = pt[grp, g, w + 4]
                a3 = pt[grp, g + 8, w + 4]
                r = 16 * ks + vr
                for j in range(pairs):
                    c = vc + 2 * j
                    b00, b01, b10, b11 = ldmatrix_x4_trans(smem, base + r * words + 4 * (c ^ (r & 7)))
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
            cuda.syncthreads()  # this buffer and bf16(p) are block b + 2's to overwrite
        # the outputs, divided by the denominators, into shared memory (fp32 [head, D] over the rows:
        # the last block's barrier has passed), then rounded, rotated back and stored by consecutive
        # threads (the lanes' own indices into acc stay constants, so acc stays in registers)
        total_lo = sum_lo + exp_f32(sinks[min(h0 + hb + g, n_heads - 1)] - m_lo)
        total_hi = sum_hi + exp_f32(sinks[min(h0 + hb + g + 8, n_heads - 1)] - m_hi)
        for j in range(pairs):
            for f in range(2):
                d = warp * slice_dims + 16 * j + 8 * f + 2 * t4
                smem[rows_at + (hb + g) * head_dim + d] = f32_bits(acc[j, f, 0] / total_lo)
                smem[rows_at + (hb + g) * head_dim + d + 1] = f32_bits(acc[j, f, 1] / total_lo)
                smem[rows_at + (hb + g + 8) * head_dim + d] = f32_bits(acc[j, f, 2] / total_hi)
                smem[rows_at + (hb + g + 8) * head_dim + d + 1] = f32_bits(acc[j, f, 3] / total_hi)
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



def fused2_attention(q, ring, chunk_rows, comp_rows, positions, chosen, n_entries: int, sinks, scale: float, cos, sin,
                     out, n_tokens: int, stream, rope_dim: int, tables: bool = False) -> None:
    """stages.sparse_fused.fused_attention, on this kernel."""
    heads, head_dim = q.shape[1], q.shape[2]
    kernel = fused2_kernel(head_dim, rope_dim, tables)
    q32 = q.reshape(q.shape[0] * heads, head_dim).view(np.uint32)
    rows = (ring, chunk_rows.view(np.uint32), comp_rows) if tables else tuple(
        a.view(np.uint32) for a in (ring, chunk_rows, comp_rows))
    args = (q32, *rows, positions, positions, chosen, sinks, cos, sin, out, n_entries, heads, np.float32(scale))
    nbytes = shared_bytes(head_dim)
    launch_dynamic_shared(kernel, (-(-heads // HEADS), n_tokens), THREADS, stream, nbytes, *args)
