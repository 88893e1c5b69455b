"""The kv sources' compressor, index keys and compressed cache on the device.

A kv-source layer turns its chunk of T tokens into the latents of the groups the chunk completes
(group j stands for position j * ratio; which tokens complete a group depends only on (start, T,
ratio): `completed_groups`), then publishes two caches:
- index keys: k = k_norm(latent @ wk^T) [ID], RoPE at j * ratio, fp4 (32, E8M0) -> `index_keys[j]`;
- compressed rows: the latent, RoPE at j * ratio, fp4 (16, E4M3 scale) -> `compressed[j]`.

Ratio 1: latent = norm(x @ wkv_c^T) (bf16 linear). Ratio r > 1: fp32 projections kv = x @ wkv_c^T and
score = x @ wgate^T (stages.linear, fp32 out); a group's latent pools its r tokens per channel with
softmax weights over their scores, rounded to bf16, then normed. Tokens of a group not yet complete
wait in the per-sequence fp32 state [r, D] (slot = position % r), exactly as the oracle keeps it.

Shapes: x bf16 [T, C]; kv_state / score_state fp32 [ratio, D]; caches bf16 [max_seq // ratio, D]
and [max_seq // ratio, ID]; workspaces for T <= max_tokens rows.

Oracle: host.oracle.attention.compress(cfg, role, w, state, x, start) -> (latents, groups) and
publish(cfg, role, w, state, latents, groups, cos, sin) (with pool_group and index_keys). The
wrappers take those arguments in that order, then the workspace, the device positions, the row
count and the stream; `compress` returns the same pair, as the device holds it: the latents are the
workspace rows ws.latent[:n], the groups a `Groups` (first id, count, positions on the device).

Every kernel reads the chunk's positions from the device (`positions`, int32 [T]) and derives the
first completed group from positions[0], so a launch depends on the host only through counts.
The pooling is bit-exact to `pool_group` given the same projections (fp32 products rounded before
the float64 sums, exp in float64 rounded once, one fp32 division); what differs from the oracle is
only the projections' fp32 summation order (stages.linear).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import cuda, float32, float64

from flashv41.host.config import LayerRole, ModelConfig
from flashv41.stages.device import SIM, DeviceArray, device, exp_f32, f32_to_bf16, fill, grid_1d, jit_kernel, mul_rn
from flashv41.stages.linear import DeviceWeight, linear, linear_pair
from flashv41.stages.norm_rope_quant import Chain, norm_rope_quant_pair, rms_norm
from flashv41.stages.row_tables import f32_rows, u16_rows
from flashv41.stages.trace import Mark, unmarked

POOL_THREADS = 64 if SIM else 128
COPY_THREADS = 64 if SIM else 256
NEG_INF = float32(-np.inf)


@device
def _completes_group(p, ratio):
    """Whether the token at position p completes its group (a batched row's, decided on the device)."""
    return p % ratio == ratio - 1


@device
def _pool_channel(kv, score, row0, kv_state, score_state, pooled, group_pos, out_row, start, n_tokens, gi, n_groups,
                  ratio, d):
    """Channel d of group gi of the n_groups that the chunk at positions start .. start+T-1 (its
    projections in rows row0 .. row0+T-1 of kv and score) completes, into pooled[out_row] (and its
    position into group_pos[out_row]). Group gi's tokens come from the chunk, or (for the first
    group only) from the state where they precede the chunk. Group 0's caller then stores the
    chunk's last token of each slot into the state, after it pooled: the only reader of the state
    is that same thread, so no barrier is needed."""
    first_end = start + (ratio - 1 - start % ratio) % ratio
    if gi < n_groups:
        p0 = (first_end // ratio + gi) * ratio
        m = NEG_INF
        for s in range(ratio):
            p = p0 + s
            sc = score[row0 + p - start, d] if p >= start else score_state[s, d]
            m = max(m, sc)
        den = float64(0)
        for s in range(ratio):
            p = p0 + s
            sc = score[row0 + p - start, d] if p >= start else score_state[s, d]
            den += float64(exp_f32(sc - m))
        den32 = float32(den)
        acc = float64(0)
        for s in range(ratio):
            p = p0 + s
            sc = score[row0 + p - start, d] if p >= start else score_state[s, d]
            v = kv[row0 + p - start, d] if p >= start else kv_state[s, d]
            acc += float64(mul_rn(v, exp_f32(sc - m) / den32))
        pooled[out_row, d] = f32_to_bf16(float32(acc))
        if d == 0:
            group_pos[out_row] = p0
    if gi == 0:
        last = start + n_tokens - 1
        for s in range(ratio):
            p = last - (last - s) % ratio  # the chunk's last position in slot s
            if p >= start:
                kv_state[s, d] = kv[row0 + p - start, d]
                score_state[s, d] = score[row0 + p - start, d]


@jit_kernel()
def _pool_kernel(kv, score, kv_state, score_state, pooled, group_pos, positions, n_tokens, n_groups, ratio,
                 width):
    """Threads over channels, blockIdx.y over the completed groups (at least one block row; row 0
    updates the state). kv, score fp32 [T, D]; kv_state, score_state fp32 [ratio, D]; pooled bf16
    [>= n_groups, D]; group_pos int32 [>= n_groups]; positions int32 [T]."""
    d = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    gi = cuda.blockIdx.y
    if d >= width:
        return
    _pool_channel(kv, score, 0, kv_state, score_state, pooled, group_pos, gi, positions[0], n_tokens, gi, n_groups,
                  ratio, d)


@jit_kernel()
def _pool_batch_kernel(kv, score, kv_states, score_states, pooled, group_pos, positions, ratio, width):
    """A batch, token t its sequence's only one (blockIdx.y = t): its group, if it completes one,
    pooled into row t, else row t zero and group_pos[t] the start of its open group; then its state
    (address tables kv_states, score_states [T, 2] of each sequence's fp32 [ratio, D]) updated."""
    d = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    t = cuda.blockIdx.y
    if d >= width:
        return
    start = positions[t]
    n_groups = 1 if _completes_group(start, ratio) else 0
    if n_groups == 0:
        pooled[t, d] = 0
        if d == 0:
            group_pos[t] = start - start % ratio
    _pool_channel(kv, score, t, f32_rows(kv_states, t, width), f32_rows(score_states, t, width), pooled, group_pos, t,
                  start, 1, 0, n_groups, ratio, d)


@jit_kernel()
def _scatter_rows_kernel(keys, key_cache, rows, row_cache, positions, n_rows, ratio, key_width, row_width):
    """key_cache[g0 + r] = keys[r] and row_cache[g0 + r] = rows[r] for r < n_rows, g0 the first
    group completed by the chunk (both caches in one launch: the first n_rows * key_width threads
    copy keys). keys, rows bf16 [>= n_rows, width], the caches bf16 [groups, width], positions int32
    [T]."""
    i = cuda.grid(1)
    n_keys = n_rows * key_width
    if i >= n_keys + n_rows * row_width:
        return
    src, cache, width = keys, key_cache, key_width
    if i >= n_keys:
        src, cache, width = rows, row_cache, row_width
        i -= n_keys
    start = positions[0]
    g0 = (start + (ratio - 1 - start % ratio) % ratio) // ratio
    cache[g0 + i // width, i % width] = src[i // width, i % width]


@jit_kernel()
def _scatter_batch_kernel(keys, key_caches, rows, row_caches, positions, n_rows, ratio, key_width, row_width):
    """A batch's rows, keys and rows in one launch as _scatter_rows_kernel: the caches are address
    tables [T, 2] of each sequence's cache [groups, width]; row p // ratio of token r's (at p =
    positions[r]) takes its key and row where the token completes its group."""
    i = cuda.grid(1)
    n_keys = n_rows * key_width
    if i >= n_keys + n_rows * row_width:
        return
    src, caches, width = keys, key_caches, key_width
    if i >= n_keys:
        src, caches, width = rows, row_caches, row_width
        i -= n_keys
    r = i // width
    c = i % width
    p = positions[r]
    if _completes_group(p, ratio):
        u16_rows(caches, r, width)[p // ratio, c] = src[r, c]


def completed_groups(start: int, n_tokens: int, ratio: int) -> tuple[int, int]:
    """(first group, count) of the groups whose last token lies in positions start..start+T-1."""
    first_end = start + (ratio - 1 - start % ratio) % ratio  # first position p with p % ratio == ratio - 1
    last = start + n_tokens - 1
    if first_end > last:
        return first_end // ratio, 0
    return first_end // ratio, (last - first_end) // ratio + 1


@dataclass(frozen=True)
class Groups:
    """The groups a chunk completes (the oracle's `groups`, group ids [n]), as the device holds them."""

    first: int  # g0, the id of the first (the others follow it)
    count: int  # n
    positions: DeviceArray  # int32 [>= n]: position j * ratio of each group j = g0 .. g0 + n - 1


@dataclass
class KvSourceWeights:
    """One kv-source layer's compressor and index-key weights on the device."""

    comp_kv: DeviceWeight  # [D, C]
    comp_gate: DeviceWeight | None  # [D, C], ratio > 1 only
    comp_norm: DeviceArray  # fp32 [D]
    wk: DeviceWeight  # [ID, D]
    k_norm: DeviceArray  # fp32 [ID]


@dataclass
class KvSourceState:
    """One sequence's compressor state and caches of one kv-source layer."""

    kv_state: DeviceArray  # fp32 [ratio, D]: the partial group's projections, slot = position % ratio
    score_state: DeviceArray  # fp32 [ratio, D]: their gate scores (-inf = empty)
    compressed: DeviceArray  # bf16 [max_seq // ratio, D]: latents after RoPE + fp4
    index_keys: DeviceArray  # bf16 [max_seq // ratio, ID]: index keys after RoPE + fp4

    @classmethod
    def allocate(cls, ratio: int, head_dim: int, index_head_dim: int, max_seq: int, stream=0) -> KvSourceState:
        """An empty state (reset on `stream`)."""
        groups = max(1, max_seq // ratio)
        state = cls(cuda.device_array((ratio, head_dim), np.float32),
                    cuda.device_array((ratio, head_dim), np.float32),
                    cuda.device_array((groups, head_dim), np.uint16),
                    cuda.device_array((groups, index_head_dim), np.uint16))
        state.reset(stream)
        return state

    def reset(self, stream=0) -> None:
        """Back to an empty sequence: zero state and caches, scores -inf (as the oracle starts),
        written on the device."""
        fill(self.kv_state, 0, stream)
        fill(self.score_state, -np.inf, stream)
        fill(self.compressed, 0, stream)
        fill(self.index_keys, 0, stream)


@dataclass
class KvSourceWorkspace:
    """Per-call scratch for up to max_tokens tokens (shared by every kv-source layer)."""

    proj_kv: DeviceArray  # fp32 [T, D]: ratio > 1 projections
    proj_score: DeviceArray  # fp32 [T, D]: ratio > 1 gate scores
    raw: DeviceArray  # bf16 [T, D]: ratio 1 projection, or the pooled groups before the norm
    latent: DeviceArray  # bf16 [T, D]: the new groups' latents (before RoPE), then their cache rows
    key_raw: DeviceArray  # bf16 [T, ID]: latent @ wk^T
    keys: DeviceArray  # bf16 [T, ID]: the new groups' index keys
    group_pos: DeviceArray  # int32 [T]: position j * ratio of each new group (ratio > 1)

    @classmethod
    def allocate(cls, max_tokens: int, head_dim: int, index_head_dim: int) -> KvSourceWorkspace:
        def bf16(width: int) -> DeviceArray:
            return cuda.device_array((max_tokens, width), np.uint16)

        return cls(cuda.device_array((max_tokens, head_dim), np.float32),
                   cuda.device_array((max_tokens, head_dim), np.float32),
                   bf16(head_dim), bf16(head_dim), bf16(index_head_dim), bf16(index_head_dim),
                   cuda.device_array(max_tokens, np.int32))


def pool_groups(proj_kv: DeviceArray, proj_score: DeviceArray, state: KvSourceState, pooled: DeviceArray,
                group_pos: DeviceArray, positions: DeviceArray, n_tokens: int, n_groups: int, stream=0) -> None:
    """The ratio > 1 pooling: the chunk's fp32 projections [T, D] and the state -> pooled bf16 rows
    [n_groups, D] and their positions (int32 [n_groups]); the state keeps the chunk's last token of
    every slot. n_groups must be `completed_groups(start, n_tokens, ratio)[1]`."""
    ratio, width = state.kv_state.shape
    grid = (grid_1d(width, POOL_THREADS), max(n_groups, 1))
    _pool_kernel[grid, POOL_THREADS, stream](proj_kv, proj_score, state.kv_state, state.score_state, pooled,
                                             group_pos, positions, n_tokens, n_groups, ratio, width)


def compress(cfg: ModelConfig, role: LayerRole, w: KvSourceWeights, state: KvSourceState, x: DeviceArray,
             start: int, ws: KvSourceWorkspace, positions: DeviceArray, n_tokens: int,
             stream=0) -> tuple[DeviceArray, Groups]:
    """The compressor over a chunk: (latents, groups) of the n groups it completes, the latents
    (bf16, before RoPE) in ws.latent[:n]."""
    compress_products(role, w, x, ws, n_tokens, stream)
    return compress_groups(cfg, role, w, state, start, ws, positions, n_tokens, stream)


def compress_products(role: LayerRole, w: KvSourceWeights, x: DeviceArray, ws: KvSourceWorkspace, n_tokens: int,
                      stream=0) -> None:
    """The compressor's products of T rows of x: ws.raw (ratio 1) or ws.proj_kv and ws.proj_score
    (ratio > 1), row for row (a batch's rows may be different sequences' tokens)."""
    if role.ratio == 1:
        linear(x, w.comp_kv, ws.raw, n_tokens, stream=stream)
        return
    assert w.comp_gate is not None
    linear_pair(x, w.comp_kv, ws.proj_kv, w.comp_gate, ws.proj_score, n_tokens, stream=stream)  # one launch


def compress_groups(cfg: ModelConfig, role: LayerRole, w: KvSourceWeights, state: KvSourceState, start: int,
                    ws: KvSourceWorkspace, positions: DeviceArray, n_tokens: int, stream=0,
                    rows: slice | None = None) -> tuple[DeviceArray, Groups]:
    """The rest of `compress` from its products: one sequence's T tokens at start, their products
    in ws's rows `rows` (None: the first T), positions theirs; (latents, groups) in those rows."""
    def part(a: DeviceArray) -> DeviceArray:
        return a if rows is None else a[rows]

    g0, n = completed_groups(start, n_tokens, role.ratio)
    raw, latent = part(ws.raw), part(ws.latent)
    if role.ratio == 1:
        rms_norm(raw, w.comp_norm, cfg.norm_eps, latent, n_tokens, stream=stream)
        return latent, Groups(g0, n, positions)
    group_pos = part(ws.group_pos)
    pool_groups(part(ws.proj_kv), part(ws.proj_score), state, raw, group_pos, positions, n_tokens, n, stream)
    if n:
        rms_norm(raw, w.comp_norm, cfg.norm_eps, latent, n, stream=stream)
    return latent, Groups(g0, n, group_pos)


def publish(cfg: ModelConfig, role: LayerRole, w: KvSourceWeights, state: KvSourceState, latents: DeviceArray,
            groups: Groups, cos: DeviceArray, sin: DeviceArray, ws: KvSourceWorkspace, positions: DeviceArray,
            stream=0, mark: Mark = unmarked) -> None:
    """Index keys and compressed rows of the new groups (latents bf16 [>= n, D], turned into the
    compressed rows in place) into the caches.

    keys = fp4_32(RoPE(k_norm(latent @ wk^T))); rows = fp4_16e4m3(RoPE(latent)), both at the group
    positions; written to cache rows g0 .. g0+n-1 by a kernel that reads g0 off the device positions.
    mark: called with "wk" after the keys' product (stages.trace), the rest being the caller's to mark.
    """
    n = groups.count
    if n == 0:
        return
    linear(latents, w.wk, ws.key_raw, n, stream=stream)
    mark("wk")
    _keys_and_rows(cfg, w, latents, groups.positions, cos, sin, ws, n, stream)
    keys, rows = ws.keys.shape[1], latents.shape[1]
    _scatter_rows_kernel[grid_1d(n * (keys + rows), COPY_THREADS), COPY_THREADS, stream](
        ws.keys, state.index_keys, latents, state.compressed, positions, n, role.ratio, keys, rows)


def _keys_and_rows(cfg: ModelConfig, w: KvSourceWeights, latents: DeviceArray, group_positions: DeviceArray,
                   cos: DeviceArray, sin: DeviceArray, ws: KvSourceWorkspace, n: int, stream) -> None:
    """publish's two chains in one launch: the keys fp4_32(RoPE(k_norm(key_raw))) into ws.keys and
    the rows fp4_16e4m3(RoPE(latent)) in place."""
    norm_rope_quant_pair(Chain(ws.key_raw, w.k_norm, cfg.norm_eps, cos, sin, group_positions, False, "fp4_e8m0_32",
                               out=ws.keys),
                         Chain(latents, None, None, cos, sin, group_positions, False, "fp4_e4m3_16"), n,
                         stream=stream)


def compress_groups_batch(cfg: ModelConfig, role: LayerRole, w: KvSourceWeights, kv_states: DeviceArray,
                          score_states: DeviceArray, ws: KvSourceWorkspace, positions: DeviceArray, n_tokens: int,
                          stream=0) -> tuple[DeviceArray, DeviceArray]:
    """compress_groups for a batch of T sequences, token t its sequence's only one (products in
    ws's first T rows, compress_products): (latents, group positions), row t the group token t
    completes, if it does (ratio 1: every token does; ratio r: position % r == r - 1, decided on
    the device), else a row that publish_batch leaves out. kv_states, score_states: address tables
    of each sequence's compressor state (ratio > 1)."""
    if role.ratio == 1:
        rms_norm(ws.raw, w.comp_norm, cfg.norm_eps, ws.latent, n_tokens, stream=stream)
        return ws.latent, positions
    width = ws.proj_kv.shape[1]
    _pool_batch_kernel[(grid_1d(width, POOL_THREADS), n_tokens), POOL_THREADS, stream](
        ws.proj_kv, ws.proj_score, kv_states, score_states, ws.raw, ws.group_pos, positions, role.ratio, width)
    rms_norm(ws.raw, w.comp_norm, cfg.norm_eps, ws.latent, n_tokens, stream=stream)
    return ws.latent, ws.group_pos


def publish_batch(cfg: ModelConfig, role: LayerRole, w: KvSourceWeights, index_keys: DeviceArray,
                  compressed: DeviceArray, latents: DeviceArray, group_positions: DeviceArray, cos: DeviceArray,
                  sin: DeviceArray, ws: KvSourceWorkspace, positions: DeviceArray, n_tokens: int,
                  stream=0, mark: Mark = unmarked) -> None:
    """publish for a batch (compress_groups_batch's rows): the keys and rows of every token's
    group are made, and those of the tokens that complete one go into their sequence's caches
    (address tables index_keys and compressed), at group positions[t] // ratio. mark: as publish's."""
    linear(latents, w.wk, ws.key_raw, n_tokens, stream=stream)
    mark("wk")
    _keys_and_rows(cfg, w, latents, group_positions, cos, sin, ws, n_tokens, stream)
    keys, rows = ws.keys.shape[1], latents.shape[1]
    _scatter_batch_kernel[grid_1d(n_tokens * (keys + rows), COPY_THREADS), COPY_THREADS, stream](
        ws.keys, index_keys, latents, compressed, positions, n_tokens, role.ratio, keys, rows)
