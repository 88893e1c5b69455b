"""Sparse attention's split path on the tensor cores (stages.sparse_attention's split_cores: the
GPU's default for a call past eight tokens): the scores (a warp per 16 heads x 16 entries, mma
m16n8k16) and the values (a warp per 16 heads x a slice of D, over the block's rows staged in
shared memory); the combine kernel is the CUDA-core path's (stages.sparse_split). Only fp32 orders
differ from the CUDA-core kernels': q . k over D, and a block's value sums.

Oracle: host.oracle.attention.attend, through stages.sparse_attention.sparse_attention with
cores="tc" (tests/test_attention_kernels.py; on the simulator the emulated mma of
stages.warp_mma).
"""

from __future__ import annotations

from functools import cache

from numba import cuda, float32, float64, int32, uint32

from flashv41.stages.device import WARP, bf16_round, device, exp_f32, f32_bits, jit_kernel, mul_rn
from flashv41.stages.row_tables import u32_rows
from flashv41.stages.sparse_entries import NEG_INF, SPARSE_BLOCK, _query_word, _resolve, entry_at
from flashv41.stages.sparse_split import SCORE_TILE, _block_maxima, _entry_sources, _unit, _widest, _write_tile_max
from flashv41.stages.warp_mma import kernel_mma as mma

# The tensor-core kernels (split_cores: the GPU's default for batches past eight tokens). Measured on
# the H200 (2026-12-02, 64 heads x 512, 640 entries, all three kernels): 310.9 -> 165.6 us at 32
# tokens (scores 130.6 -> 29.6, values 123.1 -> 79.2) and 98.8 -> 62.8 at 8, but 25.4 -> 41.0 at
# one (where the values kernel has only 40 blocks, each staging its rows before its mma). Scores: a
# warp per 16 heads x 16 entries (one score tile), a block SCORE_TC_WARPS warps over consecutive head
# groups (64 heads: one block a tile reads each row once from L2).
SCORE_TC_WARPS = 4
SCORE_TC_UNROLL = 4  # 32-dim blocks of D a lane loads together (at D = 512: four rounds of loads)
# The tensor-core values (split_value_tc_kernel): a block per (token, entry block, 16 x SCORE_TC_WARPS
# heads, VALUE_TC_SLICE dims), its slice of the 64 rows staged in shared memory (18 KB at 128 dims).
VALUE_TC_SLICE = 128


@device
def _mma_lane(tid):
    """(warp, g, t) of thread tid for the mma fragments: lane (g, t) = (lane >> 2, lane & 3)."""
    lane = tid % WARP
    return tid // WARP, lane >> 2, lane & 3


@cache
def split_score_tc_kernel(head_dim: int, warps: int, tables: bool = False, rope_dim: int = 0):
    """Split path, scores on the tensor cores (mma m16n8k16, bf16 in, fp32 sums): what
    split_score_kernel computes, another fp32 order of q . k over D. A warp is 16 heads (the mma's
    rows; heads past H read head H - 1 and are not written) x the SCORE_TILE entries of one score
    tile (fragments of 8, the mma's columns); a block is `warps` warps over consecutive head groups,
    for (tile, head groups, token) = blockIdx. Lane (g, t) loads, for each 32 dims of D, dims 8 t ..
    8 t + 7 of heads g, g + 8 and of entry g of each fragment (16-byte units), and they enter the
    two k16 steps permuted alike, as stages.linear_narrow's weights and inputs do. Arguments as
    split_score_kernel's."""
    units = head_dim // 8  # 16-byte units of a row
    tail = head_dim - rope_dim  # the query's rope tail, rotated as it is loaded (_query_word)
    blocks = head_dim // 32
    threads = WARP * warps
    block_heads = 16 * warps
    fragments = SCORE_TILE // 8
    tile_shape = (SCORE_TILE, block_heads)
    acc_shape = (fragments, 4)  # [entry fragment, register]
    rows_shape = (fragments, 2)  # [entry fragment, (source, row)]
    unroll = _widest(blocks, SCORE_TC_UNROLL)  # 32-dim blocks whose loads a lane issues together
    q_held = (unroll, 8)  # [block, word]: heads g and g + 8
    r_held = (unroll, fragments, 4)  # [block, fragment, word]
    assert SCORE_TILE % 8 == 0, "a score tile is whole fragments of 8 entries"

    @jit_kernel(threads)
    def kernel(q32, rings, chunk32, comps, positions, first, selection, cos, sin, scores, tile_max, n_entries,
               n_heads, scale):
        tile_s = cuda.shared.array(tile_shape, float32)  # [tile, heads]: the block's scores
        tid = cuda.threadIdx.x
        warp, g, t4 = _mma_lane(tid)
        tile_i = cuda.blockIdx.x
        hb = cuda.blockIdx.y * block_heads
        h0 = hb + 16 * warp
        t = cuda.blockIdx.z
        e0 = tile_i * SCORE_TILE
        ring32, comp32 = (u32_rows(rings, t, head_dim // 2), u32_rows(comps, t, head_dim // 2)) if tables else (
            rings, comps)
        window = ring32.shape[0]
        chunk_rows = chunk32.shape[0]
        pos = positions[t]
        qa = t * n_heads + min(h0 + g, n_heads - 1)  # this lane's two query rows
        qb = t * n_heads + min(h0 + g + 8, n_heads - 1)
        rows = cuda.local.array(rows_shape, int32)  # its entry of each fragment
        acc = cuda.local.array(acc_shape, float32)
        for f in range(fragments):
            e = entry_at(positions, first, selection, t, e0 + 8 * f + g, window, chunk_rows, n_entries, tables)
            rows[f, 0], rows[f, 1] = _resolve(e, window, chunk_rows)
            for i in range(4):
                acc[f, i] = float32(0)
        qw = cuda.local.array(q_held, uint32)
        rw = cuda.local.array(r_held, uint32)
        for c0 in range(0, blocks, unroll):
            for j in range(unroll):  # every load of the step issued before the first is used
                unit = 4 * (c0 + j) + t4
                qw[j, 0], qw[j, 1], qw[j, 2], qw[j, 3] = _unit(q32, q32, q32, 0, qa, unit, units)
                qw[j, 4], qw[j, 5], qw[j, 6], qw[j, 7] = _unit(q32, q32, q32, 0, qb, unit, units)
                if 8 * unit + 8 > tail:  # the unit reaches into the rope tail
                    for m in range(4):
                        qw[j, m] = _query_word(qw[j, m], 8 * unit + 2 * m, tail, cos, sin, pos)
                        qw[j, 4 + m] = _query_word(qw[j, 4 + m], 8 * unit + 2 * m, tail, cos, sin, pos)
                for f in range(fragments):
                    rw[j, f, 0], rw[j, f, 1], rw[j, f, 2], rw[j, f, 3] = _unit(
                        ring32, chunk32, comp32, rows[f, 0], rows[f, 1], unit, units)
            for j in range(unroll):
                for f in range(fragments):
                    # step 0: words 0 (slots 2 t, 2 t + 1) and 1 (slots 2 t + 8, 2 t + 9); step 1: words 2, 3
                    p0, p1, p2, p3 = mma(qw[j, 0], qw[j, 4], qw[j, 1], qw[j, 5], rw[j, f, 0], rw[j, f, 1],
                                         acc[f, 0], acc[f, 1], acc[f, 2], acc[f, 3])
                    acc[f, 0], acc[f, 1], acc[f, 2], acc[f, 3] = mma(qw[j, 2], qw[j, 6], qw[j, 3], qw[j, 7],
                                                                     rw[j, f, 2], rw[j, f, 3], p0, p1, p2, p3)
        # lane (g, t) holds heads g (registers 0, 1) and g + 8 (2, 3) at entries 2 t, 2 t + 1 of each
        # fragment
        for f in range(fragments):
            for i in range(4):
                j = 8 * f + 2 * t4 + i % 2  # the entry within the tile
                k = 16 * warp + g + 8 * (i // 2)  # the head within the block
                sr, ix = _resolve(entry_at(positions, first, selection, t, e0 + j, window, chunk_rows, n_entries,
                                           tables), window, chunk_rows)
                part = acc[f, i]
                v = mul_rn(part, scale) if sr >= 0 else NEG_INF
                tile_s[j, k] = v
                if e0 + j < n_entries and hb + k < n_heads:
                    scores[t, hb + k, e0 + j] = v
        cuda.syncthreads()
        _write_tile_max(tile_s, tile_max, t, tile_i, hb, n_heads, SCORE_TILE, block_heads, tid, threads)

    return kernel


@cache
def split_value_tc_kernel(head_dim: int, warps: int, d_slice: int, tables: bool = False):
    """Split path, values on the tensor cores (mma m16n8k16: bf16(p) and the rows are exact in bf16,
    fp32 sums): what split_value_kernel computes, another fp32 order of a block's value sums. A block
    per (entry block b, 16 * warps heads x a slice of d_slice dims, token), a warp per 16 heads: the
    mma's rows are heads, its columns dims, its k the block's entries. The block stages its slice of
    the 64 rows in shared memory transposed (a word = one dim of two consecutive entries) and bf16(p)
    as [head, entry pair] words, so every fragment is one 32-bit shared load; the rows' pitch of 36
    words keeps a warp's loads on distinct banks. block_sum, block_max and rescale come from the
    blocks of the first slice. Arguments as split_value_kernel's."""
    threads = WARP * warps
    block_heads = 16 * warps
    slices = head_dim // d_slice
    frags = d_slice // 8  # a warp's column fragments
    pairs = SPARSE_BLOCK // 2  # entry pairs: the words of a staged row
    pitch = pairs + 4
    vt_shape = (d_slice, pitch)  # [dim, entry pair]: the slice's rows, bf16 pairs
    pt_shape = (block_heads, pitch)  # [head, entry pair]: bf16(p), pairs
    acc_shape = (frags, 4)
    units = head_dim // 8  # 16-byte units of a row
    slice_units = d_slice // 8
    tiles = SPARSE_BLOCK // SCORE_TILE
    head_threads = max(1, threads // block_heads)
    tile_reads = head_threads * block_heads
    assert d_slice % 8 == 0 and head_dim % d_slice == 0

    @jit_kernel(threads)
    def kernel(rings, chunk32, comps, positions, first, selection, scores, tile_max, pv, block_sum, block_max,
               rescale, n_entries):
        src = cuda.shared.array(SPARSE_BLOCK, int32)
        row = cuda.shared.array(SPARSE_BLOCK, int32)
        vt = cuda.shared.array(vt_shape, uint32)
        pt = cuda.shared.array(pt_shape, uint32)
        tile_prev = cuda.shared.array(tile_reads, float32)
        tile_new = cuda.shared.array(tile_reads, float32)
        prev_max = cuda.shared.array(block_heads, float32)
        new_max = cuda.shared.array(block_heads, float32)
        tid = cuda.threadIdx.x
        warp, g, t4 = _mma_lane(tid)
        b = cuda.blockIdx.x
        sl = cuda.blockIdx.y % slices
        hb = cuda.blockIdx.y // slices * block_heads
        t = cuda.blockIdx.z
        b0 = b * SPARSE_BLOCK
        n_heads = pv.shape[2]
        ring32, comp32 = (u32_rows(rings, t, head_dim // 2), u32_rows(comps, t, head_dim // 2)) if tables else (
            rings, comps)
        _entry_sources(positions, first, selection, t, b0, n_entries, ring32.shape[0], chunk32.shape[0], tables, src,
                       row, tid, threads)
        _block_maxima(tile_max, t, b, hb, n_entries, tid, block_heads, head_threads, tiles, n_heads, tile_prev,
                      tile_new, prev_max, new_max, True)
        # bf16(p) of entry pairs, [head, pair]; heads past H and entries past E get p = 0
        for i in range(tid, pairs * block_heads, threads):
            k = i // pairs
            j = 2 * (i % pairs)
            lo = uint32(0)
            hi = uint32(0)
            if hb + k < n_heads:
                s0 = scores[t, hb + k, b0 + j] if b0 + j < n_entries else NEG_INF
                s1 = scores[t, hb + k, b0 + j + 1] if b0 + j + 1 < n_entries else NEG_INF
                lo = f32_bits(bf16_round(exp_f32(s0 - new_max[k]))) >> 16  # (exact: bf16 values)
                hi = f32_bits(bf16_round(exp_f32(s1 - new_max[k]))) >> 16
            pt[k, j // 2] = lo | (hi << 16)
        # the slice of the rows, transposed: word [d, j / 2] = dims d of entries j and j + 1
        for i in range(tid, pairs * slice_units, threads):
            jp = i % pairs  # consecutive threads, consecutive pairs: the stores hit distinct banks
            u = i // pairs
            unit = sl * slice_units + u
            a0, a1, a2, a3 = _unit(ring32, chunk32, comp32, src[2 * jp], row[2 * jp], unit, units)
            c0, c1, c2, c3 = _unit(ring32, chunk32, comp32, src[2 * jp + 1], row[2 * jp + 1], unit, units)
            d = 8 * u
            vt[d, jp] = (a0 & 0xFFFF) | (c0 << 16)
            vt[d + 1, jp] = (a0 >> 16) | (c0 & 0xFFFF0000)
            vt[d + 2, jp] = (a1 & 0xFFFF) | (c1 << 16)
            vt[d + 3, jp] = (a1 >> 16) | (c1 & 0xFFFF0000)
            vt[d + 4, jp] = (a2 & 0xFFFF) | (c2 << 16)
            vt[d + 5, jp] = (a2 >> 16) | (c2 & 0xFFFF0000)
            vt[d + 6, jp] = (a3 & 0xFFFF) | (c3 << 16)
            vt[d + 7, jp] = (a3 >> 16) | (c3 & 0xFFFF0000)
        cuda.syncthreads()
        if sl == 0:
            for k in range(tid, block_heads, threads):
                if hb + k < n_heads:
                    block = float64(0)
                    for j in range(SPARSE_BLOCK):
                        s = scores[t, hb + k, b0 + j] if b0 + j < n_entries else NEG_INF
                        block += float64(exp_f32(s - new_max[k]))
                    block_sum[t, b, hb + k] = float32(block)
                    block_max[t, b, hb + k] = new_max[k]
                    rescale[t, b, hb + k] = exp_f32(prev_max[k] - new_max[k])
        acc = cuda.local.array(acc_shape, float32)
        for f in range(frags):
            for i in range(4):
                acc[f, i] = float32(0)
        h = 16 * warp + g  # this lane's rows: heads h and h + 8 of the block
        for s16 in range(SPARSE_BLOCK // 16):
            w = 8 * s16 + t4  # entry pairs 2 t, 2 t + 1 of the step's 16 entries (slots 2 t .. 2 t + 1), then + 8
            a0 = pt[h, w]
            a1 = pt[h + 8, w]
            a2 = pt[h, w + 4]
            a3 = pt[h + 8, w + 4]
            for f in range(frags):
                acc[f, 0], acc[f, 1], acc[f, 2], acc[f, 3] = mma(a0, a1, a2, a3, vt[8 * f + g, w], vt[8 * f + g, w + 4],
                                                                 acc[f, 0], acc[f, 1], acc[f, 2], acc[f, 3])
        # lane (g, t) holds heads h (registers 0, 1) and h + 8 (2, 3) at dims 2 t, 2 t + 1 of each fragment
        for f in range(frags):
            for i in range(4):
                k = h + 8 * (i // 2)
                if hb + k < n_heads:
                    pv[t, b, hb + k, sl * d_slice + 8 * f + 2 * t4 + i % 2] = acc[f, i]

    return kernel
