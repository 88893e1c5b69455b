"""Sparse attention's split path on the CUDA cores (stages.sparse_attention with a workspace: decode
steps, prefill chunks in sub-chunks, batches through sparse_attention_tables): the scores kernel
(a warp per token, 4 heads and 4 entries, lanes over D), the values kernel (a block per token, block
of 64 entries and heads) and the combine kernel (the rescaling over the blocks, the sink, the
output rotated back), the workspace between them; and the entry sources, which the fused kernel
(stages.sparse_fused) shares.

Oracle: host.oracle.attention.attend, through stages.sparse_attention.sparse_attention
(tests/test_attention_kernels.py, test_batch_kernels.py; on the simulator the two paths agree bit
for bit).
"""

from __future__ import annotations

from functools import cache

import numpy as np
from numba import cuda, float32, float64, int32, uint32

from flashv41.stages.device import (
    SIM,
    WARP,
    bf16_round,
    device,
    exp_f32,
    f32_from_bits,
    jit_kernel,
    load_words4,
    mul_rn,
    row_address,
    words4_at,
)
from flashv41.stages.row_tables import u32_rows

if SIM:
    from flashv41.stages.device import _BF16_VALUES

from flashv41.stages.sparse_entries import (
    NEG_INF,
    SPARSE_BLOCK,
    START_MAX,
    _output_pair,
    _pair_angle,
    _resolve,
    _rotated_pair,
    entry_at,
    entry_from,
    selection_at,
)

if SIM:
    from flashv41.stages.sparse_entries import _source


# The split path (GPU sizes; the simulator runs lanes of one and a few threads a block).
# Scores: a warp = SCORE_HEADS heads x SCORE_ENTRIES entries; a lane holds D / 32 dims of its heads'
# queries (16 at D = 512: two 16-byte units a row) and loads the same dims of each entry's row. A
# block = SCORE_HEAD_WARPS head groups (at most: as many as divide the heads) x SCORE_ENTRY_WARPS
# entry groups: its head groups would read the same rows and its entry groups read the same queries,
# so L1 serves the repeats. One head group a block (128 threads: 16 entries x 4 heads; at D = 512 and
# 640 entries, T = 1: 40 x 16 blocks) measured best on the H200 (2026-12-02, 64 heads x 512, 640
# entries): the scores took 8.3 / 35.1 / 130.4 us at T = 1 / 8 / 32 against 9.0 / 36.9 / 136.7 with
# two head groups and 9.3 / 38.0 / 141.1 with four.
SCORE_HEADS = 4
SCORE_ENTRIES = 16 if SIM else 4
SCORE_HEAD_WARPS = 1
SCORE_ENTRY_WARPS = 2 if SIM else 4
LANE_SUMS = 16  # the dot products a warp reduces together (_lane_sums): SCORE_ENTRIES x SCORE_HEADS at most
SCORE_TILE = SCORE_ENTRIES * SCORE_ENTRY_WARPS  # the entries of a scores block: it writes their max per head
assert SPARSE_BLOCK % SCORE_TILE == 0, "an entry block's max must come from whole tiles"
# Values: a block per (token, entry block, VALUE_HEADS heads at most): its threads are the row's
# 16-byte units (8 dims each, all of D on the GPU) x the block's heads in groups of VALUE_THREAD_HEADS
# (one group a thread, so a block's head groups read each row unit once from L2) x groups of the
# block's 64 entries, as many as make VALUE_THREADS threads (at most VALUE_ENTRY_GROUPS; their sums
# are added in group order at the end). Rows are loaded VALUE_BATCH entries at a time before they
# are used. Heads per block halve until there are VALUE_FILL blocks (about one an SM: 132 on an H200).
# The simulator runs one thread a block over all of D, one head and one entry group.
VALUE_THREADS = 1 if SIM else 256
VALUE_HEADS = 16
VALUE_THREAD_HEADS = 1 if SIM else 4
VALUE_ENTRY_GROUPS = 1 if SIM else 4
VALUE_FILL = 1 if SIM else 128
VALUE_BATCH = 8
assert SPARSE_BLOCK % (VALUE_ENTRY_GROUPS * VALUE_BATCH) == 0, "an entry group must be whole batches"
# Combine: a thread per (token, head, dim pair) on the GPU (per (token, head) on the simulator), reading
# COMBINE_BATCH blocks' partial results before it folds them in; 128 threads a block, so that one
# token's 64 heads x 256 pairs still make 128 blocks.
COMBINE_THREADS = 8 if SIM else 128
COMBINE_BATCH = 16


# The split path's row pieces, over 32-bit words (bf16 pairs, low half first): a lane's words are its
# 16-byte units lane, lane + lanes, ... (4 words each); a values thread's are w0, w0 + step, ...
if SIM:
    def _pairs(words):
        """The bf16 pairs in `words` as fp32 values, in dim order."""
        w = np.asarray(words, dtype=np.uint32)
        v = np.empty(2 * w.size, np.float32)
        v[0::2] = _BF16_VALUES[w & 0xFFFF]
        v[1::2] = _BF16_VALUES[w >> 16]
        return v

    def _lane_words(a, ix, lane, lanes):
        return np.asarray(a[ix]).reshape(-1, 4)[lane::lanes].reshape(-1)

    def _unit(ring, chunk, comp, src, ix, unit, units):
        if src < 0 or unit >= units:
            return np.uint32(0), np.uint32(0), np.uint32(0), np.uint32(0)
        w = _source(ring, chunk, comp, src)[ix, 4 * unit:4 * unit + 4]
        return w[0], w[1], w[2], w[3]

    def _lane_angles(rc, rs, cos, sin, pos, lane, lanes, per_lane, units, tail):
        dims = (8 * np.arange(lane, units, lanes)[:, None] + np.arange(0, 8, 2)[None, :]).reshape(-1)
        for i, d in enumerate(dims):
            rc[i], rs[i] = _pair_angle(cos, sin, pos, d, tail)

    def _load_query(qv, k, q32, ix, lane, lanes, per_lane, units, tail, rc, rs):
        v = _pairs(_lane_words(q32, ix, lane, lanes))
        dims = (8 * np.arange(lane, units, lanes)[:, None] + np.arange(8)[None, :]).reshape(-1)
        for i in range(0, v.size, 2):
            v[i], v[i + 1] = _rotated_pair(v[i], v[i + 1], dims[i], tail, rc[i // 2], rs[i // 2])
        qv[k] = v

    def _load_row(rw, i, ring, chunk, comp, src, ix, lane, lanes, per_lane, units):
        rw[i] = _lane_words(_source(ring, chunk, comp, src), ix, lane, lanes) if src >= 0 else 0

    def _dot_words(sums, n, qv, heads, rw, i, per_lane):
        for k in range(heads):
            sums[n + k] = np.float32(np.dot(qv[k], _pairs(rw[i])))

    def _load_units(words, c, ring, chunk, comp, src, ix, u0, step, per_thread, units):
        if src < 0:
            words[c] = 0
        else:
            words[c] = _source(ring, chunk, comp, src)[ix].reshape(-1, 4)[u0:u0 + per_thread * step:step].reshape(-1)

    def _decode(vals, words, c, per_thread):
        vals[:] = _pairs(words[c])

    def _axpy(acc, k, p, vals, per_thread):
        acc[k] += np.float32(p) * vals

    def _store_units(pv, t, b, h, acc, k, u0, step, per_thread):
        pv[t, b, h].reshape(-1, 8)[u0:u0 + per_thread * step:step] = acc[k].reshape(-1, 8)
else:
    @cuda.jit(device=True)
    def _pair(word):
        """The two bf16 values of a 32-bit word (low half first) as fp32."""
        return f32_from_bits(word << 16), f32_from_bits(word & 0xFFFF0000)

    @cuda.jit(device=True)
    def _unit(ring, chunk, comp, src, ix, unit, units):
        """16-byte unit `unit` of the row (one load), zeros past the row or for a skipped entry."""
        w0 = w1 = w2 = w3 = uint32(0)
        if unit < units:
            if src == 0:
                w0, w1, w2, w3 = load_words4(ring, ix, 4 * unit)
            elif src == 1:
                w0, w1, w2, w3 = load_words4(chunk, ix, 4 * unit)
            elif src == 2:
                w0, w1, w2, w3 = load_words4(comp, ix, 4 * unit)
        return w0, w1, w2, w3

    @cuda.jit(device=True)
    def _lane_angles(rc, rs, cos, sin, pos, lane, lanes, per_lane, units, tail):
        """rc[4 u + m], rs[4 u + m] = the angle of the lane's pair m of unit lane + u * lanes
        (_pair_angle), read once for every head the lane loads."""
        for u in range(per_lane):
            unit = lane + u * lanes
            for m in range(4):
                c, s = _pair_angle(cos, sin, pos, 8 * unit + 2 * m if unit < units else 0, tail)
                rc[4 * u + m] = c
                rs[4 * u + m] = s

    @cuda.jit(device=True)
    def _put_query_pair(qv, k, i, word, d, tail, c, s):
        """qv[k, i], qv[k, i + 1] = the query pair in `word` at dims d, d + 1 (_rotated_pair)."""
        a, b = _pair(word)
        qv[k, i], qv[k, i + 1] = _rotated_pair(a, b, d, tail, c, s)

    @cuda.jit(device=True)
    def _load_query(qv, k, q32, ix, lane, lanes, per_lane, units, tail, rc, rs):
        for u in range(per_lane):
            unit = lane + u * lanes
            w0, w1, w2, w3 = _unit(q32, q32, q32, 0, ix, unit, units)
            d = 8 * unit if unit < units else 0  # (a unit past the row is zeros, and no rope pair)
            _put_query_pair(qv, k, 8 * u, w0, d, tail, rc[4 * u], rs[4 * u])
            _put_query_pair(qv, k, 8 * u + 2, w1, d + 2, tail, rc[4 * u + 1], rs[4 * u + 1])
            _put_query_pair(qv, k, 8 * u + 4, w2, d + 4, tail, rc[4 * u + 2], rs[4 * u + 2])
            _put_query_pair(qv, k, 8 * u + 6, w3, d + 6, tail, rc[4 * u + 3], rs[4 * u + 3])

    @cuda.jit(device=True)
    def _row_start(ring, chunk, comp, src, ix):
        """The row_address of the entry's row (source src, row ix; ring row 0 for a skipped one, not read):
        one address an entry, each unit of it then one load at a 32-bit offset."""
        if src == 1:
            return row_address(chunk, ix)
        if src == 2:
            return row_address(comp, ix)
        return row_address(ring, ix if src == 0 else 0)

    @cuda.jit(device=True)
    def _load_row(rw, i, ring, chunk, comp, src, ix, lane, lanes, per_lane, units):
        start = _row_start(ring, chunk, comp, src, ix)
        for u in range(per_lane):
            unit = lane + u * lanes
            w0 = w1 = w2 = w3 = uint32(0)
            if src >= 0 and unit < units:
                w0, w1, w2, w3 = words4_at(start, uint32(16 * unit))
            rw[i, 4 * u] = w0
            rw[i, 4 * u + 1] = w1
            rw[i, 4 * u + 2] = w2
            rw[i, 4 * u + 3] = w3

    @cuda.jit(device=True)
    def _dot_words(sums, n, qv, heads, rw, i, per_lane):
        """sums[n + k] = the lane's part of q_k . row i for its `heads` heads, each in dim order (a row
        word unpacked once for every head)."""
        for k in range(heads):
            sums[n + k] = float32(0)
        for w in range(4 * per_lane):
            a, b = _pair(rw[i, w])
            for k in range(heads):
                sums[n + k] += qv[k, 2 * w] * a
                sums[n + k] += qv[k, 2 * w + 1] * b

    @cuda.jit(device=True)
    def _halve(v, half, offset, lane):
        """One step of _lane_sums: lanes with the `offset` bit keep the upper `half` sums, the others the
        lower, each adding its partner's copy of them (one shuffle a kept sum)."""
        upper = (lane & offset) != 0
        for i in range(half):
            lo = v[i]
            hi = v[i + half]
            keep = hi if upper else lo
            v[i] = keep + cuda.shfl_xor_sync(0xFFFFFFFF, lo if upper else hi, offset)

    @cuda.jit(device=True)
    def _lane_sums(v, lane):
        """The 16 partial sums v [16] of each lane of a warp, reduced over the 32 lanes with 16
        shuffles (80 one sum at a time). Returns (n, the total of sum n): lane l finishes sum
        n = 8 b4 + 4 b3 + 2 b2 + b1 (b_i its bits), as does lane l ^ 1. Overwrites v."""
        _halve(v, 8, 16, lane)
        _halve(v, 4, 8, lane)
        _halve(v, 2, 4, lane)
        _halve(v, 1, 2, lane)
        total = v[0] + cuda.shfl_xor_sync(0xFFFFFFFF, v[0], 1)
        n = ((lane >> 4) & 1) * 8 + ((lane >> 3) & 1) * 4 + ((lane >> 2) & 1) * 2 + ((lane >> 1) & 1)
        return n, total

    @cuda.jit(device=True)
    def _load_units(words, c, ring, chunk, comp, src, ix, u0, step, per_thread, units):
        """words[c] = the row's 16-byte units u0, u0 + step, ... (per_thread of them; zeros for a
        skipped entry)."""
        for i in range(per_thread):
            w0, w1, w2, w3 = _unit(ring, chunk, comp, src, ix, u0 + i * step, units)
            words[c, 4 * i] = w0
            words[c, 4 * i + 1] = w1
            words[c, 4 * i + 2] = w2
            words[c, 4 * i + 3] = w3

    @cuda.jit(device=True)
    def _decode(vals, words, c, per_thread):
        for i in range(4 * per_thread):
            a, b = _pair(words[c, i])
            vals[2 * i] = a
            vals[2 * i + 1] = b

    @cuda.jit(device=True)
    def _axpy(acc, k, p, vals, per_thread):
        for i in range(8 * per_thread):
            acc[k, i] += p * vals[i]

    @cuda.jit(device=True)
    def _store_units(pv, t, b, h, acc, k, u0, step, per_thread):
        for i in range(per_thread):
            d0 = 8 * (u0 + i * step)
            for m in range(8):
                pv[t, b, h, d0 + m] = acc[k, 8 * i + m]


@device
def _store_later(later, g, h, acc, k, u0, step, per_thread):
    """later[g, h, :] = a thread's value sums acc[k] (of units u0, u0 + step, ...), value m of its
    i-th unit at (8 i + m) * step + u0: consecutive threads, consecutive words."""
    for i in range(8 * per_thread):
        later[g, h, i * step + u0] = acc[k, i]


@device
def _add_later(acc, k, later, g, h, u0, step, per_thread):
    """acc[k] += what _store_later(later, g, h, ...) stored for this thread."""
    for i in range(8 * per_thread):
        acc[k, i] += later[g, h, i * step + u0]


@device
def _write_tile_max(tile_s, tile_max, t, tile_i, hb, n_heads, tile, block_heads, tid, threads):
    """tile_max[t, tile_i, hb + k] = the max of the block's scores tile_s[:tile, k], heads hb + k < H."""
    for k in range(tid, block_heads, threads):
        if hb + k < n_heads:
            m = NEG_INF
            for j in range(tile):
                m = max(m, tile_s[j, k])
            tile_max[t, tile_i, hb + k] = m


@device
def _entry_sources(positions, first, selection, t, b0, n_entries, window, chunk_rows, own_rows, src, row, tid,
                   threads):
    """src[j], row[j] = _resolve of token t's entry b0 + j, j < 64 (-1 past E), the block's threads
    sharing them out."""
    for j in range(tid, SPARSE_BLOCK, threads):
        sr, ix = _resolve(entry_at(positions, first, selection, t, b0 + j, window, chunk_rows, n_entries,
                                   own_rows), window, chunk_rows)
        src[j] = sr
        row[j] = ix


@device
def _block_maxima(tile_max, t, b, hb, n_entries, tid, block_heads, head_threads, tiles, n_heads, tile_prev,
                  tile_new, prev_max, new_max, sync):
    """prev_max[k], new_max[k] = m_{b-1} and m_b of heads hb + k < H: the maxima of the score tiles of
    entry blocks 0 .. b - 1, and of 0 .. b (each block `tiles` tiles), read by head_threads threads a
    head at once (a one-thread walk waits on each read in turn: about a microsecond per ten tiles),
    then reduced per head. tile_prev and tile_new: head_threads x block_heads scratch."""
    n_tiles = (n_entries + SCORE_TILE - 1) // SCORE_TILE
    last = min(n_tiles, (b + 1) * tiles)
    k = tid % block_heads
    m_prev = START_MAX
    m_new = START_MAX
    if tid < head_threads * block_heads:
        if hb + k < n_heads:
            for i in range(tid // block_heads, last, head_threads):
                v = tile_max[t, i, hb + k]
                if i < b * tiles:
                    m_prev = max(m_prev, v)
                else:
                    m_new = max(m_new, v)
        tile_prev[tid] = m_prev
        tile_new[tid] = m_new
    if sync:
        cuda.syncthreads()
    if tid < block_heads:
        for j in range(1, head_threads):
            m_prev = max(m_prev, tile_prev[j * block_heads + tid])
            m_new = max(m_new, tile_new[j * block_heads + tid])
        prev_max[tid] = m_prev
        new_max[tid] = max(m_prev, m_new)
    if sync:
        cuda.syncthreads()


@cache
def split_score_kernel(head_dim: int, lanes: int, heads: int, head_warps: int, entry_warps: int, per_warp: int,
                       tables: bool = False, rope_dim: int = 0):
    """Split path, scores: a warp of `lanes` lanes per (token, `heads` heads, `per_warp` entries);
    a block of head_warps x entry_warps warps per (tile of per_warp x entry_warps entries, heads x
    head_warps heads, token). q32 [T * H, D / 2] and ring32, chunk32, comp32 [*, D / 2]: the bf16
    arrays as 32-bit words (tables: ring32 and comp32 are address tables of each token's own);
    positions int32 [T], first int32 [>= 1] (first[0] the chunk's first position: a sub-chunk's
    kernels get the whole chunk's positions), selection int32 [T, E - W] (entry_at); scores fp32
    [>= T, H, >= E] (-inf: skipped); tile_max fp32 [>= T, >= NT, H] (NT = ceil(E / tile))."""
    units = head_dim // 8  # 16-byte units of a row
    tail = head_dim - rope_dim  # the query's rope tail, rotated as it is loaded (_query_pair)
    per_lane = -(-units // lanes)  # units a lane holds
    q_dims = per_lane * 8  # (local array shapes must be compile-time constants)
    q_pairs = per_lane * 4
    row_words = per_lane * 4
    threads = lanes * head_warps * entry_warps
    tile = per_warp * entry_warps
    block_heads = heads * head_warps
    n_sums = per_warp * heads
    if lanes > 1:  # a warp's sums are reduced together (_lane_sums), one sum for each pair of lanes
        assert lanes == WARP and n_sums <= LANE_SUMS, "a warp reduces at most 16 sums together"
        n_sums = LANE_SUMS
    n_out = 1 if lanes > 1 else n_sums  # the sums each lane finishes

    @jit_kernel(threads)
    def kernel(q32, rings, chunk32, comps, positions, first, selection, cos, sin, scores, tile_max, n_entries,
               n_heads, scale):
        tile_s = cuda.shared.array((tile, block_heads), float32)  # [tile, heads]: the block's scores
        tid = cuda.threadIdx.x
        lane = tid % lanes
        warp = tid // lanes
        hw = warp % head_warps
        ew = warp // head_warps
        tile_i = cuda.blockIdx.x
        hb = cuda.blockIdx.y * block_heads
        h0 = hb + hw * heads
        t = cuda.blockIdx.z
        e0 = tile_i * tile + ew * per_warp
        ring32, comp32 = (u32_rows(rings, t, head_dim // 2), u32_rows(comps, t, head_dim // 2)) if tables else (
            rings, comps)
        window = ring32.shape[0]
        chunk_rows = chunk32.shape[0]
        qv = cuda.local.array((heads, q_dims), float32)  # [heads, D / lanes]: the lane's query dims
        rc = cuda.local.array(q_pairs, float32)  # [D / 2 / lanes]: the angles of its rope pairs (_lane_angles)
        rs = cuda.local.array(q_pairs, float32)
        sel = cuda.local.array(per_warp, int32)  # [entries]: their selection_at
        rw = cuda.local.array((per_warp, row_words), uint32)  # [entries, D / 2 / lanes]: its row words
        sums = cuda.local.array(n_sums, float32)  # [entries x heads (+ padding)]: the lane's partial dots
        pos = positions[t]
        start = pos if tables else first[0]
        for i in range(per_warp):  # the entries' reads first, together
            sel[i] = selection_at(selection, t, e0 + i, window)
        skipped = 0  # bit i: entry i skipped
        for i in range(per_warp):  # every row load issued before the first is used, and before q's rotation
            sr, ix = _resolve(entry_from(pos, start, sel[i], t, e0 + i, window, chunk_rows, n_entries, tables),
                              window, chunk_rows)
            if sr < 0:
                skipped |= 1 << i
            _load_row(rw, i, ring32, chunk32, comp32, sr, ix, lane, lanes, per_lane, units)
        _lane_angles(rc, rs, cos, sin, pos, lane, lanes, per_lane, units, tail)
        for k in range(heads):
            _load_query(qv, k, q32, t * n_heads + h0 + k, lane, lanes, per_lane, units, tail, rc, rs)
        for n in range(n_sums):
            sums[n] = float32(0)
        for i in range(per_warp):
            _dot_words(sums, i * heads, qv, heads, rw, i, per_lane)
        for r in range(n_out):
            n = r
            part = sums[r]
            if lanes > 1:
                n, part = _lane_sums(sums, lane)
            i = n // heads
            k = n % heads
            if i < per_warp and lane % 2 == 0:
                s = mul_rn(part, scale) if (skipped >> i) & 1 == 0 else NEG_INF
                tile_s[ew * per_warp + i, hw * heads + k] = s
                if e0 + i < n_entries:
                    scores[t, h0 + k, e0 + i] = s
        if threads > 1:
            cuda.syncthreads()
        _write_tile_max(tile_s, tile_max, t, tile_i, hb, n_heads, tile, block_heads, tid, threads)

    return kernel


@cache
def split_value_kernel(head_dim: int, unit_threads: int, per_thread: int, block_heads: int, thread_heads: int,
                       entry_groups: int, tables: bool = False):
    """Split path, values: a block per (entry block b, `block_heads` heads, token), its threads
    unit_threads (over the row's 16-byte units, per_thread each: all of D) x block_heads /
    thread_heads (over the heads, thread_heads each, so the head groups of a block read the same row
    units) x entry_groups (over the block's 64 entries, in runs of 64 / entry_groups; each run's sums
    in entry order, the runs' added in run order). Rows (and tables) as in split_score_kernel; scores
    and tile_max as it writes them; pv fp32 [>= T, >= NB, H, D] (NB = ceil(E / 64)): sum_j bf16(p_j)
    row_j of block b; block_sum, block_max, rescale fp32 [>= T, >= NB, H]: float32(float64 sum_j
    p_j), m_b and exp(m_{b-1} - m_b)."""
    head_groups = block_heads // thread_heads
    threads = unit_threads * head_groups * entry_groups
    units = head_dim // 8
    run = SPARSE_BLOCK // entry_groups  # the entries of a group
    dims = 8 * per_thread  # (local array shapes must be compile-time constants)
    batch_words = (VALUE_BATCH, 4 * per_thread)
    tiles = SPARSE_BLOCK // SCORE_TILE  # score tiles a block of entries
    head_threads = max(1, threads // block_heads)  # threads reading one head's tile maxima
    tile_reads = head_threads * block_heads  # (shared array shapes must be compile-time constants)
    score_items = -(-SPARSE_BLOCK * block_heads // threads)  # the block's scores a thread reads
    sync = threads > 1
    # the value sums of entry groups 1 .. groups - 1, for group 0 to add
    later_shape = (max(1, entry_groups - 1), block_heads, head_dim)

    @jit_kernel(threads)
    def kernel(rings, chunk32, comps, positions, first, selection, scores, tile_max, pv, block_sum, block_max,
               rescale, n_entries):
        src = cuda.shared.array(SPARSE_BLOCK, int32)  # [64]: the source of each entry's row (_resolve)
        row = cuda.shared.array(SPARSE_BLOCK, int32)  # [64]: its row there
        # [64, heads]: p_j in fp32 and rounded to bf16, an entry's heads side by side
        ps = cuda.shared.array((SPARSE_BLOCK, block_heads), float32)
        pr = cuda.shared.array((SPARSE_BLOCK, block_heads), float32)
        tile_prev = cuda.shared.array(tile_reads, float32)  # [threads]: partial m_{b-1}
        tile_new = cuda.shared.array(tile_reads, float32)  # [threads]: block b's partial maxima
        prev_max = cuda.shared.array(block_heads, float32)  # [heads]: m_{b-1}
        new_max = cuda.shared.array(block_heads, float32)  # [heads]: m_b
        later = cuda.shared.array(later_shape, float32)  # [groups - 1, heads, D] (_store_later's order)
        tid = cuda.threadIdx.x
        b = cuda.blockIdx.x
        hb = cuda.blockIdx.y * block_heads
        t = cuda.blockIdx.z
        b0 = b * SPARSE_BLOCK
        ring32, comp32 = (u32_rows(rings, t, head_dim // 2), u32_rows(comps, t, head_dim // 2)) if tables else (
            rings, comps)
        window = ring32.shape[0]
        chunk_rows = chunk32.shape[0]
        _entry_sources(positions, first, selection, t, b0, n_entries, window, chunk_rows, tables, src, row, tid,
                       threads)
        u0 = tid % unit_threads
        k0 = tid // unit_threads % head_groups * thread_heads  # this thread's first head in the block
        group = tid // (unit_threads * head_groups)
        first = group * run  # the group's entries: first .. last - 1
        last = min((group + 1) * run, n_entries - b0)
        words = cuda.local.array(batch_words, uint32)  # [batch, words]: rows loaded ahead
        held = cuda.local.array(score_items, float32)  # the thread's scores of the block, read ahead
        if sync:
            cuda.syncthreads()
        # the group's first batch of rows and the block's scores are read before the maxima, all
        # three reads in flight together
        if first < last:
            for c in range(VALUE_BATCH):
                _load_units(words, c, ring32, chunk32, comp32, src[first + c], row[first + c], u0, unit_threads,
                            per_thread, units)
        for n in range(score_items):
            i = tid + n * threads
            j = i // block_heads
            held[n] = scores[t, hb + i % block_heads, b0 + j] if i < SPARSE_BLOCK * block_heads and b0 + j < n_entries \
                else NEG_INF
        _block_maxima(tile_max, t, b, hb, n_entries, tid, block_heads, head_threads, tiles, tile_max.shape[2],
                      tile_prev, tile_new, prev_max, new_max, sync)
        for n in range(score_items):
            i = tid + n * threads
            if i < SPARSE_BLOCK * block_heads:
                j = i // block_heads
                k = i % block_heads
                p = exp_f32(held[n] - new_max[k])
                ps[j, k] = p
                pr[j, k] = bf16_round(p)
        if sync:
            cuda.syncthreads()
        for k in range(tid, block_heads, threads):
            block = float64(0)
            for j in range(SPARSE_BLOCK):
                block += float64(ps[j, k])
            block_sum[t, b, hb + k] = float32(block)
            block_max[t, b, hb + k] = new_max[k]
            rescale[t, b, hb + k] = exp_f32(prev_max[k] - new_max[k])
        acc = cuda.local.array((thread_heads, dims), float32)  # [heads, dims]: the group's value sums
        vals = cuda.local.array(dims, float32)  # [dims]: one row's, fp32
        for k in range(thread_heads):
            for i in range(dims):
                acc[k, i] = float32(0)
        # a skipped entry (or one past E) reads as zeros with p = 0, adding +0 to sums that are never
        # -0 (they start at +0), so they come out as if it were left out, as the first path does
        for j0 in range(first, last, VALUE_BATCH):
            if j0 > first:  # (the first batch was read ahead)
                for c in range(VALUE_BATCH):
                    _load_units(words, c, ring32, chunk32, comp32, src[j0 + c], row[j0 + c], u0, unit_threads,
                                per_thread, units)
            for c in range(VALUE_BATCH):
                _decode(vals, words, c, per_thread)
                for k in range(thread_heads):
                    _axpy(acc, k, pr[j0 + c, k0 + k], vals, per_thread)
        if entry_groups > 1:
            if group > 0:
                for k in range(thread_heads):
                    _store_later(later, group - 1, k0 + k, acc, k, u0, unit_threads, per_thread)
            cuda.syncthreads()
            if group == 0:
                for g in range(entry_groups - 1):
                    for k in range(thread_heads):
                        _add_later(acc, k, later, g, k0 + k, u0, unit_threads, per_thread)
        if group == 0:
            for k in range(thread_heads):
                _store_units(pv, t, b, hb + k0 + k, acc, k, u0, unit_threads, per_thread)

    return kernel


@cache
def split_combine_kernel(head_dim: int, per_thread: int, rope_dim: int = 0):
    """Split path, combine: a thread per (token, head, per_thread consecutive dims: whole rope
    pairs): the first path's rescaling over the blocks in order, then the sink, and the output as
    the first path stores it (_output_pair). pv, block_sum, block_max, rescale as
    split_value_kernel writes them; sinks fp32 [H]; positions int32 [T]; cos, sin fp32 [max_seq,
    rope_dim / 2]; out bf16 [T, H, D]."""
    lanes_d = head_dim // per_thread  # threads per (token, head)
    tail = head_dim - rope_dim
    assert per_thread % 2 == 0, "a thread owns whole pairs"

    @jit_kernel(COMBINE_THREADS)
    def kernel(pv, block_sum, block_max, rescale, sinks, positions, cos, sin, out, n_blocks, n_tokens):
        i = cuda.grid(1)
        heads = out.shape[1]
        if i >= n_tokens * heads * lanes_d:
            return
        d0 = i % lanes_d
        h = i // lanes_d % heads
        t = i // (lanes_d * heads)
        acc = cuda.local.array(per_thread, float32)  # [dims]: the running output numerators
        vals = cuda.local.array((COMBINE_BATCH, per_thread), float32)  # [batch, dims]: pv read ahead
        scales = cuda.local.array(COMBINE_BATCH, float32)  # [batch]: rescale
        sums = cuda.local.array(COMBINE_BATCH, float32)  # [batch]: block_sum
        for k in range(per_thread):
            acc[k] = float32(0)
        sum_exp = float32(0)
        for c0 in range(0, n_blocks, COMBINE_BATCH):
            for c in range(COMBINE_BATCH):
                if c0 + c < n_blocks:
                    scales[c] = rescale[t, c0 + c, h]
                    sums[c] = block_sum[t, c0 + c, h]
                    for k in range(per_thread):
                        vals[c, k] = pv[t, c0 + c, h, d0 * per_thread + k]
            for c in range(COMBINE_BATCH):
                if c0 + c < n_blocks:
                    sum_exp = mul_rn(sum_exp, scales[c]) + sums[c]
                    for k in range(per_thread):
                        acc[k] = mul_rn(acc[k], scales[c]) + vals[c, k]
        run_max = block_max[t, n_blocks - 1, h] if n_blocks > 0 else START_MAX
        sum_exp = sum_exp + exp_f32(sinks[h] - run_max)
        for k in range(0, per_thread, 2):
            d = d0 * per_thread + k
            out[t, h, d], out[t, h, d + 1] = _output_pair(acc[k] / sum_exp, acc[k + 1] / sum_exp, d, tail, cos, sin,
                                                          positions[t])

    return kernel


def _widest(n: int, most: int) -> int:
    """The largest power of two <= most that divides n."""
    w = most
    while n % w:
        w //= 2
    return w
