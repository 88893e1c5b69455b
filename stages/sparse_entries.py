"""The pieces every sparse-attention kernel shares (stages.sparse_attention's module docstring says
what they serve): each query's entry list, made in registers where a kernel needs an entry
(`entry_from`, `entry_at`, `selection_at`) and resolved to its row (`_resolve`), and the RoPE of the
queries as the score kernels load them (`_pair_angle`, `_rotated_pair`, `_query_pair`,
`_query_word`) and of the output as the kernels that write it rotate it back (`_output_pair`), each
in stages.norm_rope_quant.rope's roundings.

Oracle: host.oracle.attention.build_entries holds the lists (tests/test_attention_kernels.py's
check_entries, exactly); the RoPE pieces are held through host.oracle.attention.attend with the
kernels that use them (tests/test_attention_kernels.py).
"""

from __future__ import annotations

import numpy as np
from numba import float32, int32, uint32

from flashv41.stages.device import SIM, bf16_to_f32, device, f32_from_bits, f32_to_bf16, rotate_pair

SPARSE_BLOCK = 64
START_MAX = float32(-1e30)
NEG_INF = float32(-np.inf)


if SIM:
    def _source(ring, chunk, comp, src):
        return ring if src == 0 else (chunk if src == 1 else comp)


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
