"""One V4.1 attention layer, every role, prefill in chunks from any position.

Shapes: T tokens of the chunk, C dim, H heads x D head_dim (R = rope_dim on the tail), Q q_lora,
W window, IH x ID index heads x index head_dim, G compressed groups, K index_topk,
O output groups x o_lora (per group `gw` = H * D / O inputs).

The per-query list of attended rows is canonical, whatever the chunking: the W window positions
p - W + 1 .. p oldest first (-1 where negative; the reference's decode layout), then the selected
compressed positions ascending, -1-padded to K. The sparse attention walks that list in blocks of
64, as the reference kernel does, so the bf16 rounding of the probabilities (relative to the
running maximum) is the same for a position however the sequence was split into calls. Each entry
names its row where the layer keeps it: a window position before the chunk in the ring (slot
p % W), one of the chunk in the chunk's own rows, a selected group in the compressed cache.

Each attention stage of stages/ has its function here (RMSNorm and the quantisers in host.numerics),
taking the same arguments in the same order: the stage's wrapper adds only its device-only ones at
the end (output buffers, row counts, workspaces, the stream), so a test hands both one tuple.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from flashv41.host.config import LayerRole, ModelConfig
from flashv41.host.numerics import (
    F32,
    RopeTables,
    act_quant,
    bf16,
    exp,
    f32,
    fp4_act_quant,
    linear,
    matmul_t,
    rms_norm,
    rotate,
    sum_last,
)

SPARSE_BLOCK = 64
NEG_INF = F32(-np.inf)

# The layer's discrete choices, where a last-bit difference between two correct implementations can
# land on a rounding boundary and flip the outcome: the quantised window rows
# ("window_rows" [T, D]), the new index-key and compressed rows ("index_keys" [n, ID], "compressed"
# [n, D]), the candidate mask ("candidates" [T, G]) and the selection ("selection" [T, K]). The
# oracle hands each value it computed to an `Adopt` hook, which returns the value the layer goes on
# with: by default its own; flashv41.check returns the engine's, counting where the two differ.
Adopt = Callable[[str, np.ndarray], np.ndarray]
CHOICES = ("window_rows", "index_keys", "compressed", "candidates", "selection")


def own_choice(kind: str, value: np.ndarray) -> np.ndarray:
    """The default Adopt hook: the oracle keeps what it computed."""
    return value


@dataclass
class AttentionWeights:
    """One layer's attention weights, dequantised to float32 ([out, in] matrices)."""

    attn_norm: np.ndarray  # [C]
    sinks: np.ndarray  # [H]
    wq_a: np.ndarray  # [Q, C]
    q_norm: np.ndarray  # [Q]
    wq_b: np.ndarray  # [H*D, Q]
    wkv: np.ndarray  # [D, C]
    kv_norm: np.ndarray  # [D]
    wo_a: np.ndarray  # [O*o_lora, gw]
    wo_b: np.ndarray  # [C, O*o_lora]
    comp_kv: np.ndarray | None = None  # [D, C] (kv sources)
    comp_gate: np.ndarray | None = None  # [D, C] (ratio-2 kv sources)
    comp_norm: np.ndarray | None = None  # [D]
    wk: np.ndarray | None = None  # [ID, D] (kv sources: index keys)
    k_norm: np.ndarray | None = None  # [ID]
    idx_wq_b: np.ndarray | None = None  # [IH*ID, Q] (index sources)
    idx_proj: np.ndarray | None = None  # [IH, C]


@dataclass
class LayerState:
    """One sequence's state of one layer: its window ring and, for kv sources, the compressor's
    partial group and the two caches it publishes."""

    window_ring: np.ndarray  # [W, D] bf16 values, slot = pos % W
    kv_state: np.ndarray | None = None  # [ratio, D] fp32, the partial group's projections
    score_state: np.ndarray | None = None  # [ratio, D] fp32, their gate scores (-inf = empty)
    compressed: np.ndarray | None = None  # [max_seq // ratio, D] bf16 values (after RoPE + fp4)
    index_keys: np.ndarray | None = None  # [max_seq // ratio, ID] bf16 values (after RoPE + fp4)

    @classmethod
    def create(cls, cfg: ModelConfig, role: LayerRole, max_seq: int) -> LayerState:
        state = cls(window_ring=np.zeros((cfg.window, cfg.head_dim), F32))
        if role.kv_source:
            groups = max_seq // role.ratio
            state.kv_state = np.zeros((role.ratio, cfg.head_dim), F32)
            state.score_state = np.full((role.ratio, cfg.head_dim), NEG_INF, F32)
            state.compressed = np.zeros((groups, cfg.head_dim), F32)
            state.index_keys = np.zeros((groups, cfg.index_head_dim), F32)
        return state


@dataclass
class SharedRuntime:
    """What source layers hand down the stack within one forward call."""

    compressed: np.ndarray | None = None  # the last kv source's compressed cache
    index_keys: np.ndarray | None = None  # the last kv source's index-key cache
    selection: np.ndarray | None = None  # [T, K] int64 compressed positions ascending, -1 padded
    candidates: np.ndarray | None = None  # [T, width] bool, the candidate source's block mask


def rope_tail(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, positions: np.ndarray,
              inverse: bool = False) -> np.ndarray:
    """x [T, ..., D] with the last R values of each of its vectors rotated by the angle of
    positions[t] (cos, sin: the tables [max_seq, R / 2]); `inverse` rotates back (the conjugate)."""
    rd = 2 * cos.shape[-1]
    angle = (len(positions),) + (1,) * (x.ndim - 2) + (rd // 2,)  # broadcast over the vectors of a token
    out = x.copy()
    out[..., -rd:] = rotate(x[..., -rd:], cos[positions].reshape(angle), sin[positions].reshape(angle), inverse)
    return out


def pool_group(kv: np.ndarray, score: np.ndarray) -> np.ndarray:
    """The ratio-2 compressor's gated pooling of one group: per channel softmax over its tokens.
    kv, score [ratio, D] fp32 -> [D] fp32."""
    e = exp(score - score.max(axis=0, keepdims=True))
    weights = e / sum_last(e.T)[None, :]
    return sum_last((kv * weights).T)


def compress(cfg: ModelConfig, role: LayerRole, w: AttentionWeights, state: LayerState, x: np.ndarray,
             start: int) -> tuple[np.ndarray, np.ndarray]:
    """The kv source's compressor over a chunk: (latents [n, D] bf16 before RoPE, group ids [n]).

    Ratio 1: every token is a group, latent = norm(x @ wkv^T). Ratio 2: fp32 projections and gate
    scores wait in the partial-group state until the group's last token arrives; then the group is
    pooled, rounded to bf16 and normalised. Group j stands for position j * ratio.
    """
    assert w.comp_kv is not None and w.comp_norm is not None
    ratio = role.ratio
    t = x.shape[0]
    if ratio == 1:
        latents = rms_norm(linear(x, w.comp_kv), w.comp_norm, cfg.norm_eps)
        return latents, start + np.arange(t)
    assert w.comp_gate is not None and state.kv_state is not None and state.score_state is not None
    kv = matmul_t(x, w.comp_kv)
    score = matmul_t(x, w.comp_gate)
    pooled, groups = [], []
    for i in range(t):
        pos = start + i
        slot = pos % ratio
        state.kv_state[slot] = kv[i]
        state.score_state[slot] = score[i]
        if slot == ratio - 1:
            pooled.append(pool_group(state.kv_state, state.score_state))
            groups.append(pos // ratio)
    if not pooled:
        return np.zeros((0, cfg.head_dim), F32), np.zeros(0, np.int64)
    latents = rms_norm(bf16(np.stack(pooled)), w.comp_norm, cfg.norm_eps)
    return latents, np.asarray(groups, np.int64)


def index_keys(cfg: ModelConfig, w: AttentionWeights, latents: np.ndarray, cos: np.ndarray, sin: np.ndarray,
               group_pos: np.ndarray) -> np.ndarray:
    """Index keys of new groups: k = k_norm(latent @ wk^T), RoPE at the group position, fp4 (32, E8M0)."""
    assert w.wk is not None and w.k_norm is not None
    k = rms_norm(linear(latents, w.wk), w.k_norm, cfg.norm_eps)
    return fp4_act_quant(rope_tail(k, cos, sin, group_pos), 32, e4m3_scale=False)


def publish(cfg: ModelConfig, role: LayerRole, w: AttentionWeights, state: LayerState, latents: np.ndarray,
            groups: np.ndarray, cos: np.ndarray, sin: np.ndarray, adopt: Adopt = own_choice) -> None:
    """The new groups' rows into the kv source's caches, both at the group positions j * ratio:
    index keys (above) and compressed rows fp4_16e4m3(RoPE(latent)). latents [n, D], groups [n]."""
    if groups.size == 0:
        return
    assert state.index_keys is not None and state.compressed is not None
    group_pos = groups * role.ratio
    state.index_keys[groups] = adopt("index_keys", index_keys(cfg, w, latents, cos, sin, group_pos))
    rows = fp4_act_quant(rope_tail(latents, cos, sin, group_pos), 16, e4m3_scale=True)
    state.compressed[groups] = adopt("compressed", rows)


def candidate_blocks(score: np.ndarray, visible: np.ndarray, topk_blocks: int, block: int) -> np.ndarray:
    """Level one of the two-level selection: [T, G] scores -> [T, G] bool mask of kept blocks.

    Block score = max over its positions; the block holding the query's newest visible position is
    pinned (+inf); the top `topk_blocks` blocks by (score desc, block asc) are kept if > -inf.
    """
    t, g = score.shape
    nb = -(-g // block)
    padded = np.full((t, nb * block), NEG_INF, F32)
    padded[:, :g] = score
    bscore = padded.reshape(t, nb, block).max(axis=-1)
    last = (visible - 1) // block
    rows = np.flatnonzero(last >= 0)
    bscore[rows, last[rows]] = np.inf
    keep = np.zeros((t, nb), bool)
    k = min(topk_blocks, nb)
    blocks = np.arange(nb)
    for i in range(t):
        order = np.lexsort((blocks, -bscore[i]))[:k]
        keep[i, order] = bscore[i, order] > NEG_INF
    return np.repeat(keep, block, axis=1)[:, :g]


def topk_positions(score_row: np.ndarray, visible: int, topk: int) -> np.ndarray:
    """The top min(topk, visible) visible positions by (score desc, position asc), ascending."""
    k = min(topk, visible)
    s = score_row[:visible]
    order = np.lexsort((np.arange(visible), -s))[:k]
    return np.sort(order)


def index_queries(w: AttentionWeights, x: np.ndarray, qr: np.ndarray, cos: np.ndarray, sin: np.ndarray,
                  positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The index source's queries: (iq [T, IH, ID] = fp4_32(RoPE(qr @ wq_b^T)), hw [T, IH] = x @ proj^T),
    bf16 values; x [T, C], qr [T, Q]."""
    assert w.idx_wq_b is not None and w.idx_proj is not None
    heads = w.idx_proj.shape[0]
    iq = linear(qr, w.idx_wq_b).reshape(x.shape[0], heads, -1)
    iq = fp4_act_quant(rope_tail(iq, cos, sin, positions), 32, e4m3_scale=False)
    return iq, linear(x, w.idx_proj)


def index_scores(iq: np.ndarray, hw: np.ndarray, keys: np.ndarray, scale: float) -> np.ndarray:
    """Index scores [T, G] (bf16 values) of the T queries against the G index keys [G, ID].

    w = bf16(hw * scale) (scale = ID^-0.5 * IH^-0.5); score = bf16(sum_h bf16(relu(bf16(iq_h . k)) * w_h)).
    """
    head_w = bf16(hw * F32(scale))
    dots = bf16(f32(np.einsum("thd,gd->thg", iq.astype(np.float64), keys.astype(np.float64))))
    weighted = bf16(np.maximum(dots, F32(0)) * head_w[:, :, None])
    return bf16(sum_last(np.swapaxes(weighted, 1, 2)))


def select(cfg: ModelConfig, role: LayerRole, score: np.ndarray, positions: np.ndarray,
           candidates: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None]:
    """Mask, candidate blocks and top-k: scores [T, G] -> (selection [T, K] ascending, -1 padded;
    the candidate mask [T, G] bool). The candidate source returns the mask it makes; a later index
    source ranks the positions outside `candidates` as -inf, and returns it as it came."""
    ratio = role.ratio
    visible = (positions + 1) // ratio
    cols = np.arange(score.shape[1])
    score = np.where(cols[None, :] >= visible[:, None], NEG_INF, score).astype(F32)
    if role.candidate_source:
        candidates = candidate_blocks(score, visible, cfg.candidate_topk_blocks, cfg.candidate_block_size)
    elif role.uses_candidates:
        assert candidates is not None and candidates.shape == score.shape
        score = np.where(candidates, score, NEG_INF).astype(F32)
    out = np.full((score.shape[0], cfg.index_topk), -1, np.int64)
    for i in range(score.shape[0]):
        chosen = topk_positions(score[i], int(visible[i]), cfg.index_topk)
        out[i, : chosen.size] = chosen
    return out, candidates


def window_positions(positions: np.ndarray, window: int) -> np.ndarray:
    """[T, W]: the window positions p - W + 1 .. p of each query, oldest first; -1 before 0."""
    idx = positions[:, None] - window + 1 + np.arange(window)[None, :]
    return np.where(idx < 0, -1, idx)


def build_entries(positions: np.ndarray, selection: np.ndarray | None, window: int,
                  chunk_capacity: int) -> np.ndarray:
    """The canonical list [T, W + K] int64 of each query (K = 0 without a selection), as indices
    into the rows (ring [W], chunk rows [chunk_capacity], compressed rows) laid end to end: window
    position wp before the chunk -> ring slot wp % W, from the chunk's first position on -> W + its
    offset in the chunk; selected group s -> W + chunk_capacity + s; -1 stays -1 (nothing)."""
    start = positions[0]
    wp = window_positions(positions, window)
    entries = np.where(wp < 0, -1, np.where(wp >= start, window + wp - start, wp % window))
    if selection is None:
        return entries
    return np.concatenate([entries, np.where(selection >= 0, window + chunk_capacity + selection, -1)], axis=1)


def sparse_attention(q: np.ndarray, ring: np.ndarray, chunk_rows: np.ndarray, comp_rows: np.ndarray,
                     entries: np.ndarray, sinks: np.ndarray, scale: float) -> np.ndarray:
    """Sparse single-kv-head attention with a sink, online softmax in blocks of 64.

    q [T, H, D] bf16; the rows (K = V), bf16: ring [W, D], chunk_rows [Cn, D], comp_rows [G, D];
    entries [T, E] indices into the three laid end to end (build_entries), -1 = skip; sinks [H]
    fp32. Per block: s = (q . k) * scale; running max from -1e30; p = exp(s - max), summed in fp32,
    rounded to bf16 before the value product; the sink adds exp(sink - max) to the denominator
    only. A row with no entry gives zeros. Returns o [T, H, D] bf16.
    """
    t, h, d = q.shape
    rows = np.concatenate([ring, chunk_rows, comp_rows])
    scale32 = F32(scale)
    valid = entries >= 0
    gathered = rows[np.where(valid, entries, 0)] * valid[..., None]  # [T, E, D]
    s = f32(np.einsum("thd,ted->the", q.astype(np.float64), gathered.astype(np.float64))) * scale32
    s = np.where(valid[:, None, :], s, NEG_INF).astype(F32)
    acc = np.zeros((t, h, d), F32)
    sum_exp = np.zeros((t, h), F32)
    run_max = np.full((t, h), F32(-1e30), F32)
    with np.errstate(over="ignore", invalid="ignore"):
        for b0 in range(0, entries.shape[1], SPARSE_BLOCK):
            sb = s[:, :, b0:b0 + SPARSE_BLOCK]
            prev = run_max
            run_max = np.maximum(prev, sb.max(axis=-1))
            rescale = exp(prev - run_max)
            p = exp(sb - run_max[:, :, None])
            sum_exp = sum_exp * rescale + sum_last(p)
            pv = f32(np.einsum("the,ted->thd", bf16(p).astype(np.float64),
                               gathered[:, b0:b0 + SPARSE_BLOCK].astype(np.float64)))
            acc = acc * rescale[:, :, None] + pv
        sum_exp = sum_exp + exp(np.asarray(sinks, F32)[None, :] - run_max)
        return bf16(acc / sum_exp[:, :, None])


def attend(q: np.ndarray, ring: np.ndarray, chunk_rows: np.ndarray, comp_rows: np.ndarray, positions: np.ndarray,
           selection: np.ndarray | None, sinks: np.ndarray, scale: float, cos: np.ndarray | None,
           sin: np.ndarray | None) -> np.ndarray:
    """The layer's attention of the queries q [T, H, D] at positions [T] (a chunk's, its first
    position's window row in chunk_rows[0]) over their canonical lists, the queries rotated first
    and the output rotated back: rope_tail(sparse_attention(rope_tail(q), ..., build_entries(
    positions, selection, W, chunk_rows' count), ...), inverse=True), W the ring's slots; cos, sin
    None: q and the output as they are."""
    entries = build_entries(positions, selection, ring.shape[0], chunk_rows.shape[0])
    if cos is None or sin is None:
        return sparse_attention(q, ring, chunk_rows, comp_rows, entries, sinks, scale)
    o = sparse_attention(rope_tail(q, cos, sin, positions), ring, chunk_rows, comp_rows, entries, sinks, scale)
    return rope_tail(o, cos, sin, positions, inverse=True)


def output_projection(cfg: ModelConfig, w: AttentionWeights, o: np.ndarray) -> np.ndarray:
    """o [T, H, D] bf16 -> [T, C] bf16: group g of heads times its own wo_a block, then wo_b."""
    t = o.shape[0]
    groups = o.reshape(t, cfg.o_groups, cfg.group_width)
    wo_a = w.wo_a.reshape(cfg.o_groups, cfg.o_lora_rank, cfg.group_width)
    a = np.stack([linear(groups[:, g], wo_a[g]) for g in range(cfg.o_groups)], axis=1)
    return linear(a.reshape(t, -1), w.wo_b)


def attention_layer(cfg: ModelConfig, role: LayerRole, w: AttentionWeights, tables: RopeTables,
                    state: LayerState, shared: SharedRuntime, x: np.ndarray, start: int,
                    capture: dict | None = None, adopt: Adopt = own_choice) -> np.ndarray:
    """One layer's attention over a chunk of T tokens at positions start..start+T-1.

    x [T, C] bf16 (the normed sublayer input) -> [T, C] bf16. Updates `state` (ring, compressor,
    caches) and, for source layers, `shared`. Each discrete choice (CHOICES) goes through `adopt`.
    """
    t = x.shape[0]
    win = cfg.window
    positions = start + np.arange(t)
    cos, sin = tables.for_ratio(role.ratio)

    qr = rms_norm(linear(x, w.wq_a), w.q_norm, cfg.norm_eps)
    q = linear(qr, w.wq_b).reshape(t, cfg.n_heads, cfg.head_dim)  # rotated in attend
    kv = rms_norm(linear(x, w.wkv), w.kv_norm, cfg.norm_eps)
    kv = adopt("window_rows", act_quant(rope_tail(kv, cos, sin, positions), 32))

    selection = None
    comp_rows = np.zeros((0, cfg.head_dim), F32)
    if role.ratio > 0:
        latents = np.zeros((0, cfg.head_dim), F32)
        groups = np.zeros(0, np.int64)
        if role.kv_source:
            assert state.compressed is not None and state.index_keys is not None
            latents, groups = compress(cfg, role, w, state, x, start)
            publish(cfg, role, w, state, latents, groups, cos, sin, adopt)
            shared.compressed, shared.index_keys = state.compressed, state.index_keys
        width = (start + t) // role.ratio
        if role.index_source and width == 0:
            # no group is complete yet: nothing to score (the reference skips its indexer too)
            shared.selection = np.full((t, cfg.index_topk), -1, np.int64)
        elif role.index_source:
            assert shared.index_keys is not None
            iq, hw = index_queries(w, x, qr, cos, sin, positions)
            index_scale = cfg.index_head_dim ** -0.5 * cfg.index_heads ** -0.5
            score = index_scores(iq, hw, shared.index_keys[:width], index_scale)
            chosen, candidates = select(cfg, role, score, positions, shared.candidates)
            if role.candidate_source:
                assert candidates is not None
                shared.candidates = adopt("candidates", candidates)
            shared.selection = adopt("selection", chosen)
            if capture is not None:
                capture["index_score"] = score
        assert shared.compressed is not None and shared.selection is not None
        selection = shared.selection
        comp_rows = shared.compressed[:width]
        if capture is not None:
            capture.update(latents=latents, groups=groups, selection=selection.copy())
            if shared.candidates is not None:
                capture["candidates"] = shared.candidates.copy()

    rows = (state.window_ring, kv, comp_rows, positions, selection, w.sinks, cfg.head_dim ** -0.5)
    o = attend(q, *rows, cos, sin)
    if capture is not None:  # the rotated queries, and the output before its inverse RoPE
        q_rotated = rope_tail(q, cos, sin, positions)
        capture.update(q=q_rotated, attn_o=attend(q_rotated, *rows, None, None))
    # the ring keeps the chunk's last W rows, written once the attention has read the older ones
    for i in range(max(0, t - win), t):
        state.window_ring[(start + i) % win] = kv[i]
    out = output_projection(cfg, w, o)
    if capture is not None:
        capture.update(attn_x=x, qr=qr, kv=kv, attn_out=out)
    return out
