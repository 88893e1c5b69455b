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
  its own ring and compressed rows through address tables (stages.row_tables); with a workspace
  split_cores' choice (on a GPU past eight steps the fused kernel, the whole batch at once; the
  split path in sub-batches of at most the workspace's tokens, each its own rows of the tables and
  chunk rows).
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
- split (with a workspace: decode steps, batches of up to eight, and every call on the simulator
  or with a D the fused kernel does not take; prefill chunks in sub-chunks of the workspace's
  tokens, batches of up to 64 sequences through sparse_attention_tables): a decode step has only H
  blocks of that kind, each walking every entry, so the walk is cut into three kernels over the
  whole GPU, with the workspace between them, on the CUDA cores. Scores: a warp per (token, 4
  heads, 4 entries), lanes over D (16-byte row loads, the queries in registers); each block also
  writes its 16 entries' max per head. Values: a block per (token, block b of 64 entries, heads):
  the running max m_b is a prefix max, so it comes from the tile maxima of blocks 0..b alone; then
  p, the block's float64 sum and its value sums (a thread per 16-byte unit of the row, a few heads
  and a run of the block's entries, the runs' sums added in run order; the block's shape, and so
  its fp32 order, follows the token count). Combine: a thread per (token, head, dim pair) runs the
  rescaling over b in order, adds the sink and rotates the pair back. Only fp32 orders differ from
  the first path: q . k over D, and a block's value sums (on the simulator, lanes of one and one
  run, not even those: the two agree bit for bit).
- fused (with a workspace, on a GPU, a prefill chunk or a batch of decode steps past eight tokens
  and D whole 64-dim blocks: split_cores' "fused"): one kernel for the whole call, a block per (16
  heads, token) walking its entry blocks once, scores and value sums on the tensor cores, the
  recurrence in registers (stages.sparse_fused); nothing goes through the workspace, and a token's
  bits do not depend on where its chunk was cut. Only fp32 orders (and the float64 block sum's)
  differ from the split path. On an H100 (2026-12-07, 64 heads x 512, 640 entries) 1.4x the split
  path's speed at a batch of 8 and 4.0-4.2x that of the split path's tensor-core kernels (which it
  displaced; history keeps them) in a 64- or 512-token prefill chunk, 1.4-4.5x at 16-128 steps
  (bench rows sparse.*).

Modules: this one holds the wrappers, the path choice and the split path's workspace;
stages.sparse_entries the entry lists and RoPE pieces every kernel shares; stages.sparse_one_block
the first path's kernel; stages.sparse_split the split path's kernels; stages.sparse_fused the
fused kernel. The batch's address tables are stages.row_tables' (each kernel's `tables` variant).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
from numba import cuda

from flashv41.host.errors import InputError
from flashv41.stages.device import SIM, DeviceArray, check_array, check_rows, grid_1d
from flashv41.stages.sparse_entries import SPARSE_BLOCK, entry_at
from flashv41.stages.sparse_fused import fused_attention
from flashv41.stages.sparse_one_block import ATTN_THREADS, LANES, sparse_kernel
from flashv41.stages.sparse_split import (
    COMBINE_THREADS,
    SCORE_ENTRIES,
    SCORE_ENTRY_WARPS,
    SCORE_HEAD_WARPS,
    SCORE_HEADS,
    SCORE_TILE,
    VALUE_BATCH,
    VALUE_ENTRY_GROUPS,
    VALUE_FILL,
    VALUE_HEADS,
    VALUE_THREAD_HEADS,
    VALUE_THREADS,
    _widest,
    split_combine_kernel,
    split_score_kernel,
    split_value_kernel,
)

# the stage's interface (the kernels' modules: sparse_entries, sparse_one_block, sparse_split, sparse_fused)
__all__ = ["SPARSE_BLOCK", "SCORE_TILE", "SPLIT_BATCH_TOKENS", "SPLIT_MAX_TOKENS", "SparseWorkspace", "entry_at",
           "sparse_attention", "sparse_attention_tables", "split_cores", "split_workspace_bytes"]


# The split path's calls (the kernels' own sizes: stages.sparse_split).
SPLIT_MAX_TOKENS = 8  # the most tokens a call runs on a GPU's CUDA cores by default (decode steps; split_cores)
# sparse_attention_tables': batched decode steps of up to this many sequences; the most tokens a workspace holds
# (the engine's: a prefill chunk's sub-chunks)
SPLIT_BATCH_TOKENS = 64


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
        sparse_attention and sparse_attention_tables run a longer call in sub-chunks of that many.
        most = SPLIT_MAX_TOKENS by default (a decode step's), SPLIT_BATCH_TOKENS
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


def split_cores(head_dim: int, n_tokens: int, cores: str = "") -> str:
    """Where a call of n_tokens tokens with a workspace runs: `cores` if given ("fused":
    stages.sparse_fused's one kernel, the whole call at once; "cuda": the split path's
    split_score_kernel and split_value_kernel), else the fused kernel on a GPU for more than
    SPLIT_MAX_TOKENS tokens where D is whole 64-dim blocks (chosen once for the whole call, so every
    sub-chunk of it runs there whatever its size), for a prefill chunk and a batch of decode steps
    alike; the CUDA cores otherwise: for a step of up to eight tokens (so that a batch of up to eight
    gives each sequence the bits of its step alone, as the products' stream kernel does), on the
    simulator (whose emulated mma is slow, and whose CUDA-core kernels give the first path's bits),
    and for a D the fused kernel does not take. Measured on an H100 (2026-12-07, 64 heads x 512,
    640 entries, bench rows sparse.*): the fused kernel 1.4x the CUDA cores' speed at a batch of 8
    (89 against 127 us) and slower at 4 (89 against 73 us; the CUDA cores keep up to 8 for the
    bits); the split path's tensor cores, which it displaced, 1.4-4.5x slower at 16-128 steps and
    4.0-4.2x in a 64- or 512-token prefill chunk."""
    if cores not in ("", "fused", "cuda"):
        raise InputError(f"sparse_attention: cores {cores!r} is not one of 'fused', 'cuda'")
    if cores == "fused" and head_dim % 64:
        raise InputError(f"sparse_attention: the fused kernel needs head_dim a multiple of 64, not {head_dim}")
    if cores or SIM or n_tokens <= SPLIT_MAX_TOKENS or head_dim % 64:
        return cores or "cuda"
    return "fused"


def _split_attention(q, ring, chunk_rows, comp_rows, positions, first, selection, n_entries, sinks, scale, cos, sin,
                     out, n_tokens, stream, threads, ws: SparseWorkspace, tables: bool, rope_dim: int) -> None:
    """The split path (module docstring) for the n_tokens tokens of q, positions, selection and out
    (a sub-chunk's rows; first: the whole chunk's positions): scores, values and combine on
    `stream`, each sized for the call (heads per block shrink until the grid covers the GPU)."""
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
    selection token t's selected groups of its own compressed rows. With a workspace split_cores'
    choice: the fused kernel, the whole batch at once, or the split path in sub-batches of at most
    the workspace's tokens (a batch of B = 128 steps is two of 64); else the one-block-a-head
    kernel. Token t's result is what sparse_attention gives for it alone over its own
    arrays, on the same path and cores (split or not)."""
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
    order, so each reuses it), sparse_attention_tables' likewise, each sub-batch with its own rows of
    the address tables and chunk rows; without a workspace the one-block-a-head kernel. Each query's list is window + K
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
    if workspace is not None:
        cores = split_cores(head_dim, n_tokens, cores)  # the whole call's, so a token's bits ignore the cut
        if cores == "fused":  # the whole call in one launch: no workspace between kernels
            fused_attention(q, ring, chunk_rows, comp_rows, positions, chosen, n_entries, sinks, scale, cos, sin, out,
                            n_tokens, stream, rope_dim, tables)
            return
        step = workspace.tokens
        for t0 in range(0, n_tokens, step):
            # a sub-chunk's own rows of the token-indexed arrays; the chunk's first position from the whole
            # chunk's positions, so that its tokens read the earlier tokens' window rows from chunk_rows. A
            # batch's tables and chunk rows are a row a token too (its token t reads chunk row t: own_rows)
            part = slice(t0, min(t0 + step, n_tokens))
            rows = (ring[part], chunk_rows[part], comp_rows[part]) if tables else (ring, chunk_rows, comp_rows)
            _split_attention(q[part], *rows, positions[part], positions, chosen[part], n_entries, sinks, scale, cos,
                             sin, out[part], part.stop - t0, stream, threads, workspace, tables, rope_dim)
        return
    nt = threads or min(ATTN_THREADS, head_dim)
    lanes = min(LANES, nt)
    if head_dim % nt or nt % lanes:
        raise InputError(f"sparse_attention: {nt} threads do not divide head_dim {head_dim}")
    sparse_kernel(head_dim, nt, lanes, tables, rope_dim)[(heads, n_tokens), nt, stream](
        q, ring, chunk_rows, comp_rows, positions, chosen, sinks, cos, sin, out, n_entries, np.float32(scale))
