"""Sparse single-kv-head attention with a sink on the device, each query's entry list and the RoPE of
the queries and of the output made in the kernels.

Shapes (T tokens, H heads x D head_dim, W window slots, K selected, E = W + K entries per query;
bf16 = uint16 bits):
- `sparse_attention(q, ring, chunk_rows, comp_rows, positions, selection, sinks, scale, cos, sin, out,
  n_tokens)`: q bf16 [T, H, D] (not rotated); ring bf16 [W, D] (the window ring, slot = position %
  W); chunk_rows bf16 [Cn, D] (this chunk's window rows, the chunk's first position in row 0);
  comp_rows bf16 [G, D] (the compressed cache); positions int32 [T] (the chunk's, consecutive);
  selection int32 [T, K] (each query's selected groups, -1 = none) or None (K = 0); sinks fp32 [H];
  cos, sin fp32 [max_seq, R / 2] (the layer's RoPE table over the last R dims of a head) or None
  (no rotation); out bf16 [T, H, D] (rotated back). K = V = the row (MQA). With a
  `SparseWorkspace` it takes the split path below, in consecutive sub-chunks of at most the
  workspace's tokens (the engine's holds 64; a decode step is one sub-chunk).
- `sparse_attention_tables(q, rings, chunk_rows, comps, positions, selection, window, ...)`: the same
  for a batch of sequences, token t its sequence's only one (its window row in chunk row t), reading
  its own ring and compressed rows through address tables (stages.row_tables); the split path for up
  to SPLIT_BATCH_TOKENS tokens that the workspace holds (never cut into sub-chunks).
Each query's list is the canonical one (`entry_from`, written once, called where a kernel needs an
entry through `entry_at`, or on reads it issued ahead: no entries array): the W window positions
p - W + 1 .. p oldest first (-1 before 0; ring slots for positions before the chunk, chunk rows
from the chunk's first position on), then the K selected compressed positions as given, encoded
e < 0 skipped, e < W -> ring[e], e < W + Cn -> chunk_rows[e - W], else comp_rows[e - W - Cn].
The chunk's first position comes from its own array (`first`, entry_at): a sub-chunk's kernels get
the sub-chunk's rows of q, positions, selection and out, but the whole chunk's positions there, so
that its tokens read the window rows of the chunk's earlier tokens, earlier sub-chunks' included,
from chunk_rows (the ring gets a prefill chunk's rows only after the attention). A decode step is
one sub-chunk, `first` its own positions array: nothing a launch is given changes from one step to
the next (a step is replayed as a CUDA graph), the position coming from device memory.
The RoPE: the score kernels rotate the rope tail of each query as they load it (_rotated_pair by
_pair_angle's angle: bf16 in, fp32 rotation, bf16), the kernels that write out rotate the bf16
output back (_output_pair), each in stages.norm_rope_quant.rope's roundings, so the result has the
bits of the launches it replaces (rope(q), the former entries kernel, the attention, rope(o,
inverse)); the entries are the same integers, made in registers instead of read from memory.
Oracle: host.oracle.attention.attend(q, ring, chunk_rows, comp_rows, positions, selection, sinks,
scale, cos, sin) = rope_tail(its sparse_attention of rope_tail(q) over build_entries(positions,
selection, W, Cn), inverse=True): the wrappers take those arguments in that order (the tables one
the window after the selection), then their output and row count.

The online softmax walks the entries in blocks of 64 in the oracle's order and roundings: per
block the running max (from -1e30) is updated, p = exp(s - max) (float64 exp rounded once, as the
oracle), the block's p summed in float64 into the fp32 running sum after its fp32 rescale, p
rounded to bf16 before the value product; the sink adds exp(sink - max) to the denominator only
(every list holds the query's own position, so no row is without entries). What differs from the
oracle is the fp32 accumulation of q . k over D and of the value products over a block (the
oracle's are float64). The bound this
implies is derived in tests/test_attention_kernels.py.

Two paths compute that same recurrence:
- one block per (head, token) (no workspace, or a batch of sparse_attention_tables that the
  workspace cannot hold): warps share out a block's 64 dot products (lanes over D), then every
  thread owns D / threads output dims, block after block.
- split (with a workspace: decode steps, prefill chunks in sub-chunks of the workspace's tokens,
  and batches of up to 64 sequences through sparse_attention_tables): a decode step has only H
  blocks of that kind, each walking every entry, so the walk is cut into three kernels over the
  whole GPU, with the workspace between them; a prefill chunk's tokens fill the GPU either way, and
  the split path lets them use the tensor cores. Two sets of scores and values kernels
  (split_cores, chosen once for the whole call): the CUDA cores for up to eight tokens and on the
  simulator, the tensor cores on a GPU for a call past eight, every sub-chunk of it however few its
  tokens (the CUDA-core values kernel's block shape, and so its fp32 order, follows the token count;
  the tensor-core kernels' does not, so a token's bits do not depend on where the chunk was cut).
  Scores: a warp per (token, 4 heads, 4 entries), lanes over D (16-byte row loads, the queries in
  registers), or on the tensor cores a warp per (token, 16 heads, 16 entries: the mma's rows and
  columns); each block also writes its 16 entries' max per head. Values: a block per (token, block
  b of 64 entries, heads): the running max m_b is a prefix max, so it comes from the tile maxima of
  blocks 0..b alone; then p, the block's float64 sum and its value sums (a thread per 16-byte unit
  of the row, a few heads and a run of the block's entries, the runs' sums added in run order; on
  the tensor cores a warp per 16 heads x a slice of D, over the block's rows staged in shared
  memory). Combine: a thread per (token, head, dim pair) runs the rescaling over b in order, adds
  the sink and rotates the pair back. Only fp32 orders differ from the first path: q . k over D,
  and a block's value sums (on the simulator, lanes of one and one run, not even those: the two
  agree bit for bit).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import cache

import numpy as np
from numba import cuda, float32, float64, int32, uint32

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
    f32_bits,
    f32_from_bits,
    f32_to_bf16,
    grid_1d,
    jit_for,
    load_words4,
    mul_rn,
    rotate_pair,
    row_address,
    warp_sum,
    words4_at,
)
from flashv41.stages.row_tables import u16_rows, u32_rows
from flashv41.stages.warp_mma import kernel_mma as mma

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

# The split path (GPU sizes; the simulator runs lanes of one and a few threads a block).
SPLIT_MAX_TOKENS = 8  # the most tokens a call runs on a GPU's CUDA cores by default (decode steps; split_cores)
# sparse_attention_tables': batched decode steps of up to this many sequences; the most tokens a workspace holds
# (the engine's: a prefill chunk's sub-chunks)
SPLIT_BATCH_TOKENS = 64
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
def _pair_angle(cos, sin, pos, d, tail):
    """(cos, sin) of the angle of position pos for the pair at dims d, d + 1 (d even): the table's
    where d is in the rope tail (d >= tail), else (1, 0), which _rotated_pair does not use."""
    if d >= tail:
        pair = (d - tail) // 2
        return cos[pos, pair], sin[pos, pair]
    return float32(1), float32(0)


@device
def _rotated_pair(a, b, d, tail, c, s):
    """The query pair (a, b) (bf16 values, fp32) at dims d, d + 1 (d even) as the scores use it:
    where d is in the rope tail (d >= tail) rotated by the angle (c, s) of its position
    (_pair_angle) and rounded to bf16, as norm_rope_quant.rope rotates wq_b's product (the bits of
    its launch)."""
    if d >= tail:
        u, v = rotate_pair(a, b, c, s)
        return bf16_to_f32(f32_to_bf16(u)), bf16_to_f32(f32_to_bf16(v))
    return a, b


@device
def _query_pair(a, b, d, tail, cos, sin, pos):
    """_rotated_pair of (a, b) by the angle of position pos (cos, sin: the layer's table)."""
    c, s = _pair_angle(cos, sin, pos, d, tail)
    return _rotated_pair(a, b, d, tail, c, s)


@device
def _query_word(word, d, tail, cos, sin, pos):
    """A 32-bit word of the query (the bf16 pair at dims d, d + 1, low half first) as the scores use
    it (_query_pair), as a word again."""
    a, b = _query_pair(f32_from_bits(word << 16), f32_from_bits(word & 0xFFFF0000), d, tail, cos, sin, pos)
    return uint32(f32_to_bf16(a)) | (uint32(f32_to_bf16(b)) << 16)


@device
def _mma_lane(tid):
    """(warp, g, t) of thread tid for the mma fragments: lane (g, t) = (lane >> 2, lane & 3)."""
    lane = tid % WARP
    return tid // WARP, lane >> 2, lane & 3


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


@device
def entry_at(positions, first, selection, t, j, window, chunk_rows, n_entries, own_rows):
    """Entry j of token t's list (module docstring; -1 from j = n_entries = W + K on): entry_from of
    positions[t], the chunk's first position (first[0], or with own_rows positions[t]) and
    selection[t, j - W] (its column clamped into the array, read whatever j is). first: the whole
    chunk's positions, of which positions (and selection) may be a sub-chunk's rows (_attend)."""
    pos = positions[t]
    return entry_from(pos, pos if own_rows else first[0], selection_at(selection, t, j, window), t, j, window,
                      chunk_rows, n_entries, own_rows)


@device
def selection_at(selection, t, j, window):
    """selection[t, j - W], the column clamped into the array (what entry_from reads for entry j only
    where j - W is one of its columns): a read that needs no branch, so that a kernel can issue
    those of several entries together."""
    return selection[t, min(max(j - window, 0), selection.shape[1] - 1)]


@device
def entry_from(pos, start, s, t, j, window, chunk_rows, n_entries, own_rows):
    """Entry j of token t's list, from its position pos, the chunk's first position `start` and s =
    selection[t, j - W] (selection_at): window position wp = pos - W + 1 + j for j < W (-1 before
    0; ring slot wp % W before `start`, chunk row W + (wp - start) from it on, with own_rows (a
    batch, token t its own sequence's only one, in chunk row t) W + t + (wp - start)), then
    selected group s (W + chunk_rows + s; -1 stays -1); -1 from j = n_entries on.
    host.oracle.attention.build_entries, with chunk_capacity = chunk_rows."""
    if j >= n_entries:
        return int32(-1)
    if j < window:
        wp = pos - window + 1 + j
        if wp < 0:
            return int32(-1)
        if wp >= start:
            return int32(window + (t if own_rows else 0) + (wp - start))
        return int32(uint32(wp) % uint32(window))  # (wp >= 0: an unsigned 32-bit remainder, not Python's 64-bit one)
    return int32(-1) if s < 0 else int32(window + chunk_rows + s)


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

    @jit_for(threads)
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


@device
def _output_pair(x, y, d, tail, cos, sin, pos):
    """The bf16 bits that out stores for the output pair (x, y) (fp32) at dims d, d + 1 (d even):
    x and y rounded to bf16, then where d is in the rope tail (d >= tail) rotated back by the angle
    of position pos, as norm_rope_quant.rope(..., inverse=True) rotates the bf16 output (fp32, then
    bf16 again): the bits of the two launches."""
    a = f32_to_bf16(x)
    b = f32_to_bf16(y)
    if d >= tail:
        pair = (d - tail) // 2
        u, v = rotate_pair(bf16_to_f32(a), bf16_to_f32(b), cos[pos, pair], -sin[pos, pair])
        a = f32_to_bf16(u)
        b = f32_to_bf16(v)
    return a, b


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

    @jit_for(threads)
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

    @jit_for(threads)
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

    @jit_for(threads)
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

    @jit_for(threads)
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

    @jit_for(COMBINE_THREADS)
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


@dataclass
class SparseWorkspace:
    """The split path's scratch for T tokens (SPLIT_BATCH_TOKENS at most), H heads x D, up to E entries
    (NB = ceil(E / 64) blocks, NT = ceil(E / SCORE_TILE) tiles). A call uses a prefix of each."""

    scores: DeviceArray  # fp32 [T, H, E]: s_j = q . row_j * scale, -inf for a skipped entry
    tile_max: DeviceArray  # fp32 [T, NT, H]: the max of each tile's scores
    pv: DeviceArray  # fp32 [T, NB, H, D]: each block's value sum, sum_j bf16(p_j) row_j
    block_sum: DeviceArray  # fp32 [T, NB, H]: each block's float64 sum of p_j, rounded once
    block_max: DeviceArray  # fp32 [T, NB, H]: m_b, the running max after block b
    rescale: DeviceArray  # fp32 [T, NB, H]: exp(m_{b-1} - m_b), m_{-1} = START_MAX

    @classmethod
    def allocate(cls, max_tokens: int, heads: int, head_dim: int, n_entries: int,
                 most: int = SPLIT_MAX_TOKENS) -> SparseWorkspace:
        """For calls of up to min(max_tokens, most, SPLIT_BATCH_TOKENS) tokens and n_entries entries:
        sparse_attention runs a longer call in sub-chunks of that many, sparse_attention_tables on the
        one-block-a-head path. most = SPLIT_MAX_TOKENS by default (a decode step's), SPLIT_BATCH_TOKENS
        where prefill chunks or sparse_attention_tables' batches share it (the engine's)."""
        if head_dim % 8 or heads < 1 or max_tokens < 1 or n_entries < 0:
            raise InputError(f"SparseWorkspace: {max_tokens} tokens x {heads} heads x {head_dim} x {n_entries} "
                             "entries (the split path reads rows in 16-byte units: head_dim a multiple of 8)")
        shapes = _workspace_shapes(min(max_tokens, most, SPLIT_BATCH_TOKENS), heads, head_dim, max(n_entries, 1))
        return cls(**{name: cuda.device_array(shape, np.float32) for name, shape in shapes.items()})

    @property
    def tokens(self) -> int:
        return self.scores.shape[0]

    @property
    def nbytes(self) -> int:
        return sum(getattr(self, f.name).nbytes for f in fields(self))

    def check(self, heads: int, head_dim: int, n_entries: int) -> None:
        """InputError unless every array is fp32 and holds `tokens` tokens of this call's shape."""
        for name, need in _workspace_shapes(self.tokens, heads, head_dim, n_entries).items():
            a = getattr(self, name)
            check_array(a, (np.float32,), len(need), f"SparseWorkspace.{name}")
            exact = _HEAD_AXES[name]  # H and D must match; tokens, entries and blocks may be more
            if any(a.shape[i] != n if i in exact else a.shape[i] < n for i, n in enumerate(need)):
                raise InputError(f"SparseWorkspace.{name}: {a.shape} for {self.tokens} tokens x {heads} heads x "
                                 f"{head_dim} x {n_entries} entries, which need {need}")


_HEAD_AXES = {"scores": (1,), "tile_max": (2,), "pv": (2, 3), "block_sum": (2,), "block_max": (2,), "rescale": (2,)}


def _workspace_shapes(tokens: int, heads: int, head_dim: int, n_entries: int) -> dict[str, tuple[int, ...]]:
    blocks = -(-n_entries // SPARSE_BLOCK)
    per_block = (tokens, blocks, heads)
    return {"scores": (tokens, heads, n_entries), "tile_max": (tokens, -(-n_entries // SCORE_TILE), heads),
            "pv": (tokens, blocks, heads, head_dim), "block_sum": per_block, "block_max": per_block,
            "rescale": per_block}


def split_workspace_bytes(max_tokens: int, heads: int, head_dim: int, n_entries: int,
                          most: int = SPLIT_MAX_TOKENS) -> int:
    """Device bytes of SparseWorkspace.allocate(max_tokens, heads, head_dim, n_entries, most) (fp32 arrays)."""
    shapes = _workspace_shapes(min(max_tokens, most, SPLIT_BATCH_TOKENS), heads, head_dim, max(n_entries, 1))
    return sum(4 * int(np.prod(shape)) for shape in shapes.values())


def _widest(n: int, most: int) -> int:
    """The largest power of two <= most that divides n."""
    w = most
    while n % w:
        w //= 2
    return w


def split_cores(head_dim: int, n_tokens: int, cores: str = "") -> str:
    """Where the split path's scores and values run for a call of n_tokens tokens: `cores` if given
    ("tc": split_score_tc_kernel and split_value_tc_kernel; "cuda": split_score_kernel and
    split_value_kernel), else the tensor cores on a GPU for more than SPLIT_MAX_TOKENS tokens (a
    batch of decode steps, or a prefill chunk: chosen once for the whole call, so every sub-chunk of
    it runs there whatever its size) where D is whole 32-dim blocks, and the CUDA cores otherwise:
    for a step of up to eight tokens (so that a batch of up to eight gives each sequence the bits of
    its step alone, as the products' stream kernel does), and on the simulator (whose emulated mma
    is slow, and whose CUDA-core kernels give the first path's bits)."""
    if cores not in ("", "tc", "cuda"):
        raise InputError(f"sparse_attention: cores {cores!r} is not one of 'tc', 'cuda'")
    if cores == "tc" and head_dim % 32:
        raise InputError(f"sparse_attention: the tensor-core kernels need head_dim a multiple of 32, not {head_dim}")
    return cores or ("tc" if not SIM and head_dim % 32 == 0 and n_tokens > SPLIT_MAX_TOKENS else "cuda")


def _split_attention(q, ring, chunk_rows, comp_rows, positions, first, selection, n_entries, sinks, scale, cos, sin,
                     out, n_tokens, stream, threads, ws: SparseWorkspace, tables: bool, cores: str,
                     rope_dim: int) -> None:
    """The split path (module docstring) for the n_tokens tokens of q, positions, selection and out
    (a sub-chunk's rows; first: the whole chunk's positions), its scores and values on `cores` ("tc"
    or "cuda"): scores, values and combine on `stream`, each sized for the call (heads per block
    shrink until the grid covers the GPU)."""
    heads, head_dim = q.shape[1], q.shape[2]
    n_blocks = -(-n_entries // SPARSE_BLOCK)
    if n_entries:
        q32 = q.reshape(q.shape[0] * heads, head_dim).view(np.uint32)
        rows = (ring, chunk_rows.view(np.uint32), comp_rows) if tables else tuple(
            a.view(np.uint32) for a in (ring, chunk_rows, comp_rows))
        n_tiles = -(-n_entries // SCORE_TILE)
        score_args = (q32, *rows, positions, first, selection, cos, sin, ws.scores, ws.tile_max, n_entries, heads,
                      np.float32(scale))
        value_args = (*rows, positions, first, selection, ws.scores, ws.tile_max, ws.pv, ws.block_sum, ws.block_max,
                      ws.rescale, n_entries)
        if cores == "tc":
            warps = min(SCORE_TC_WARPS, -(-heads // 16))
            head_blocks = -(-heads // (16 * warps))
            split_score_tc_kernel(head_dim, warps, tables, rope_dim)[
                (n_tiles, head_blocks, n_tokens), WARP * warps, stream](*score_args)
            d_slice = _widest(head_dim, VALUE_TC_SLICE)
            split_value_tc_kernel(head_dim, warps, d_slice, tables)[
                (n_blocks, head_dim // d_slice * head_blocks, n_tokens), WARP * warps, stream](*value_args)
        else:
            hw = _widest(heads, SCORE_HEADS)
            head_warps = _widest(heads // hw, SCORE_HEAD_WARPS)
            split_score_kernel(head_dim, LANES, hw, head_warps, SCORE_ENTRY_WARPS, SCORE_ENTRIES, tables, rope_dim)[
                (n_tiles, heads // (hw * head_warps), n_tokens), LANES * head_warps * SCORE_ENTRY_WARPS, stream](
                *score_args)
            units = head_dim // 8
            unit_threads = threads or (1 if SIM else units)  # the simulator's thread takes all of D
            if units % unit_threads:
                raise InputError(f"sparse_attention: {unit_threads} threads do not divide the {units} 16-byte units "
                                 f"of head_dim {head_dim}")
            block_heads = _widest(heads, VALUE_HEADS)
            while block_heads > 1 and n_tokens * n_blocks * (heads // block_heads) < VALUE_FILL:
                block_heads //= 2
            thread_heads = min(VALUE_THREAD_HEADS, block_heads)
            head_groups = block_heads // thread_heads
            entry_groups = _widest(SPARSE_BLOCK // VALUE_BATCH,
                                   min(VALUE_ENTRY_GROUPS, max(1, VALUE_THREADS // (unit_threads * head_groups))))
            split_value_kernel(head_dim, unit_threads, units // unit_threads, block_heads, thread_heads, entry_groups,
                               tables)[(n_blocks, heads // block_heads, n_tokens),
                                       unit_threads * head_groups * entry_groups, stream](*value_args)
    per_thread = head_dim if SIM else 2
    total = n_tokens * heads * (head_dim // per_thread)
    split_combine_kernel(head_dim, per_thread, rope_dim)[grid_1d(total, COMBINE_THREADS), COMBINE_THREADS, stream](
        ws.pv, ws.block_sum, ws.block_max, ws.rescale, sinks, positions, cos, sin, out, n_blocks, n_tokens)


def sparse_attention(q: DeviceArray, ring: DeviceArray, chunk_rows: DeviceArray, comp_rows: DeviceArray,
                     positions: DeviceArray, selection: DeviceArray | None, sinks: DeviceArray, scale: float,
                     cos: DeviceArray | None, sin: DeviceArray | None, out: DeviceArray, n_tokens: int, stream=0,
                     threads: int = 0, workspace: SparseWorkspace | None = None, cores: str = "") -> None:
    """out[:T] = attention of q[:T] over the rows of its entry lists, the rope tail of each head's
    output rotated back by the angle of its position (cos, sin: the layer's table; None: not
    rotated) (see the module docstring).
    workspace: the split path's: with one, the call runs there, in consecutive sub-chunks of at most its tokens
    (a prefill chunk longer than it: each sub-chunk reads the window rows of the chunk's earlier tokens from
    chunk_rows), all on the cores chosen for the T tokens; without one, on the one-block-a-head kernel. threads: the
    block size of the one-block-a-head kernel, or the row-unit threads of the split path's values kernel (0 = the
    default; tests force others). cores: where the split path's scores and values run (split_cores; "" = the
    default)."""
    what = "sparse_attention"
    _, head_dim = _check_query_side(q, chunk_rows, positions, selection, sinks, cos, sin, out, n_tokens, what)
    for a, name in ((ring, "ring"), (comp_rows, "comp_rows")):
        check_array(a, (np.uint16,), 2, f"{what} {name}")
    if ring.shape[1] != head_dim or comp_rows.shape[1] != head_dim:
        raise InputError(f"{what}: q {q.shape}, ring {ring.shape}, comp_rows {comp_rows.shape} do not agree")
    _attend(q, ring, chunk_rows, comp_rows, positions, selection, ring.shape[0], sinks, scale, cos, sin, out, n_tokens,
            stream, threads, workspace, False, cores)


def sparse_attention_tables(q: DeviceArray, rings: DeviceArray, chunk_rows: DeviceArray, comps: DeviceArray,
                            positions: DeviceArray, selection: DeviceArray | None, window: int, sinks: DeviceArray,
                            scale: float, cos: DeviceArray | None, sin: DeviceArray | None, out: DeviceArray,
                            n_tokens: int, stream=0, workspace: SparseWorkspace | None = None, cores: str = "") -> None:
    """sparse_attention for a batch of T sequences, token t its sequence's only one at positions[t]:
    rings and comps are address tables (uint64 [>= T, 2], stages.row_tables) of each token's own ring
    [window, D] and compressed rows [G, D], chunk_rows the batch's window rows (token t's in row t),
    selection token t's selected groups of its own compressed rows. The split path when the workspace
    holds the T tokens (never in sub-chunks), else the one-block-a-head kernel. Token t's result is
    what sparse_attention gives for it alone over its own arrays, on the same path (split or not)."""
    what = "sparse_attention_tables"
    _check_query_side(q, chunk_rows, positions, selection, sinks, cos, sin, out, n_tokens, what)
    check_rows(chunk_rows, n_tokens, f"{what} chunk_rows")
    for a, name in ((rings, "rings"), (comps, "comps")):
        check_array(a, (np.uint64,), 2, f"{what} {name}")
        check_rows(a, n_tokens, f"{what} {name}")
    if window < 1:
        raise InputError(f"{what}: window {window} (at least 1)")
    _attend(q, rings, chunk_rows, comps, positions, selection, window, sinks, scale, cos, sin, out, n_tokens, stream,
            0, workspace, True, cores)


def _check_query_side(q, chunk_rows, positions, selection, sinks, cos, sin, out, n_tokens: int,
                      what: str) -> tuple[int, int]:
    """The arguments sparse_attention and sparse_attention_tables share, checked: (heads, head_dim)."""
    check_array(q, (np.uint16,), 3, f"{what} q")
    check_array(out, (np.uint16,), 3, f"{what} out")
    check_array(chunk_rows, (np.uint16,), 2, f"{what} chunk_rows")
    check_array(positions, (np.int32,), 1, f"{what} positions")
    check_array(sinks, (np.float32,), 1, f"{what} sinks")
    for a, name in ((q, "q"), (out, "out"), (positions, "positions")):
        check_rows(a, n_tokens, f"{what} {name}")
    if selection is not None:
        check_array(selection, (np.int32,), 2, f"{what} selection")
        check_rows(selection, n_tokens, f"{what} selection")
    heads, head_dim = q.shape[1], q.shape[2]
    if out.shape[1:] != q.shape[1:] or sinks.shape[0] != heads or chunk_rows.shape[1] != head_dim:
        raise InputError(f"{what}: q {q.shape}, out {out.shape}, sinks {sinks.shape}, chunk_rows {chunk_rows.shape} "
                         "do not agree")
    if (cos is None) != (sin is None):
        raise InputError(f"{what}: cos and sin are both given or both None")
    if cos is not None and sin is not None:
        check_array(cos, (np.float32,), 2, f"{what} cos")
        check_array(sin, (np.float32,), 2, f"{what} sin")
        if sin.shape != cos.shape or not 0 < 2 * cos.shape[1] <= head_dim:
            raise InputError(f"{what}: cos {cos.shape}, sin {sin.shape} for heads of {head_dim}")
    return heads, head_dim


def _attend(q, ring, chunk_rows, comp_rows, positions, selection, window: int, sinks, scale, cos, sin, out, n_tokens,
            stream, threads, workspace: SparseWorkspace | None, tables: bool, cores: str) -> None:
    """The launch of sparse_attention (tables: of sparse_attention_tables), its arguments checked.
    With a workspace, the split path on the cores split_cores chooses for all T tokens: sparse_attention's
    call in consecutive sub-chunks of at most the workspace's tokens (launches on one stream run in
    order, so each reuses it), sparse_attention_tables' when the workspace holds its T tokens (at
    most SPLIT_BATCH_TOKENS); otherwise the one-block-a-head kernel. Each query's list is window + K
    entries (K = selection.shape[1], 0 without one), made in the kernels (entry_at)."""
    heads, head_dim = q.shape[1], q.shape[2]
    n_entries = window + (0 if selection is None else selection.shape[1])
    # without a selection (or with an empty one) entry_at reads but never uses it: any int32 [T, >= 1] array stands in
    chosen = positions.reshape(positions.shape[0], 1) if selection is None or selection.shape[1] == 0 else selection
    # without a table no dim is in the rope tail, and the kernels read none: the sinks stand in
    rope_dim = 0 if cos is None else 2 * cos.shape[1]
    if cos is None:
        cos = sin = sinks.reshape(1, heads)
    if workspace is not None:
        if head_dim % 8:
            raise InputError(f"sparse_attention: the split path needs head_dim a multiple of 8, not {head_dim}")
        workspace.check(heads, head_dim, n_entries)
    if n_tokens == 0:
        return
    if workspace is not None and not (tables and n_tokens > min(workspace.tokens, SPLIT_BATCH_TOKENS)):
        cores = split_cores(head_dim, n_tokens, cores)  # the whole call's, so a token's bits ignore the cut
        step = workspace.tokens  # (a batch of sparse_attention_tables fits in one: its tables are not cut)
        for t0 in range(0, n_tokens, step):
            # a sub-chunk's own rows of the token-indexed arrays; the chunk's first position from the whole
            # chunk's positions, so that its tokens read the earlier tokens' window rows from chunk_rows
            part = slice(t0, min(t0 + step, n_tokens))
            _split_attention(q[part], ring, chunk_rows, comp_rows, positions[part], positions, chosen[part], n_entries,
                             sinks, scale, cos, sin, out[part], part.stop - t0, stream, threads, workspace, tables,
                             cores, rope_dim)
        return
    nt = threads or min(ATTN_THREADS, head_dim)
    lanes = min(LANES, nt)
    if head_dim % nt or nt % lanes:
        raise InputError(f"sparse_attention: {nt} threads do not divide head_dim {head_dim}")
    sparse_kernel(head_dim, nt, lanes, tables, rope_dim)[(heads, n_tokens), nt, stream](
        q, ring, chunk_rows, comp_rows, positions, chosen, sinks, cos, sin, out, n_entries, np.float32(scale))
