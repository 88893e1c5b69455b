"""The batch modes of the per-sequence kernels, each against the same stage run on one sequence's
own arrays, token by token: bit for bit.

A batched decode step (AttentionStage.forward_batch) hands every kernel the sequences' arrays as
address tables (stages.row_tables) and one token a sequence; what the kernels decide from a
token's position (its window, whether it completes a compressor group, how many groups it scores
and selects from) they decide per row. These tests take B = 10 sequences (more than the decode
split path's SPLIT_MAX_TOKENS, so the sparse attention's batch capacity is used) at positions
that put some rows before the window's first wrap, some with no compressed group yet, some
completing a group and some not. tests/test_batch_decode.py holds the whole step to each
sequence's own decode; these name the stage that broke.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from numba import cuda  # noqa: E402  (after conftest chose the backend)

from flashv41.host.config import LayerRole
from flashv41.host.numerics import act_quant, bf16, fp4_act_quant, rope_tables, to_bits
from flashv41.host.oracle import attention as oracle
from flashv41.model import load_model
from flashv41.stages import indexer, kv_sources  # noqa: E402
from flashv41.stages.linear import DeviceWeight  # noqa: E402
from flashv41.stages.row_tables import address_table  # noqa: E402
from flashv41.stages.sparse_attention import (  # noqa: E402
    SPLIT_BATCH_TOKENS,
    SparseWorkspace,
    sparse_attention,
    sparse_attention_tables,
)
from tests.test_attention_kernels import SELECT_PATHS, dev_bf16, one_hot, rope_angles, score_patterns

B = 10
POSITIONS = np.array([9, 3, 31, 7, 8, 0, 16, 15, 30, 6], np.int32)  # window 8; ratio-2 groups; the last not the largest
HEADS, DIM, WINDOW, GROUPS, TOPK = 4, 64, 8, 16, 4


@pytest.fixture(scope="module")
def tiny_cfg(tiny_path):
    model = load_model(tiny_path)
    yield model.config
    model.close()


def table(arrays) -> object:
    return cuda.to_device(address_table(list(arrays)))


def test_sparse_attention_tables():
    """sparse_attention_tables over each sequence's ring and compressed rows (its entry lists made
    with own_rows: token b's window row in chunk row b), on the split path and on the
    one-block-a-head one, against sparse_attention of that token alone on its own arrays, on the
    same path; on the split path in sub-batches too (a workspace of fewer tokens than the batch: the
    engine's holds 64, a batch of 128 steps is two), each sub-batch on its own rows of the tables.
    (entry_at's own_rows lists: tests/test_attention_kernels.py check_entries.)"""
    rng = np.random.default_rng(21)
    rings = [dev_bf16(act_quant(bf16(rng.standard_normal((WINDOW, DIM)).astype(np.float32)))) for _ in range(B)]
    comps = [dev_bf16(fp4_act_quant(bf16(rng.standard_normal((GROUPS, DIM)).astype(np.float32)), 16, True))
             for _ in range(B)]
    rows = dev_bf16(act_quant(bf16(rng.standard_normal((B, DIM)).astype(np.float32))))
    q = dev_bf16(bf16((rng.standard_normal((B, HEADS, DIM)) * 2).astype(np.float32)))
    sinks = cuda.to_device(rng.standard_normal(HEADS).astype(np.float32))
    # each row's selection: distinct groups it could see (position // 2 of them), ascending, -1 padded
    selection = np.full((B, TOPK), -1, np.int32)
    for b, p in enumerate(POSITIONS):
        k = min(TOPK, (p + 1) // 2)
        selection[b, :k] = np.sort(rng.choice((p + 1) // 2, k, replace=False))
    positions, chosen = cuda.to_device(POSITIONS), cuda.to_device(selection)
    scale = DIM ** -0.5
    cos, sin = (cuda.to_device(a) for a in rope_angles(rng, POSITIONS.max() + 1, DIM // 8))
    out = cuda.device_array((B, HEADS, DIM), np.uint16)
    ws = SparseWorkspace.allocate(B, HEADS, DIM, WINDOW + TOPK, most=SPLIT_BATCH_TOKENS)
    assert ws.tokens == B  # the split path takes the whole batch
    sparse_attention_tables(q, table(rings), rows, table(comps), positions, chosen, WINDOW, sinks, scale, cos, sin,
                            out, B, workspace=ws)
    got = out.copy_to_host()
    # a workspace of 4 tokens: three sub-batches (4, 4, 2), each reading its own rows of the tables
    # and chunk rows; a token's bits are the whole batch's
    small = SparseWorkspace.allocate(4, HEADS, DIM, WINDOW + TOPK, most=SPLIT_BATCH_TOKENS)
    cut = cuda.device_array((B, HEADS, DIM), np.uint16)
    sparse_attention_tables(q, table(rings), rows, table(comps), positions, chosen, WINDOW, sinks, scale, cos, sin,
                            cut, B, workspace=small)
    assert np.array_equal(cut.copy_to_host(), got), "sub-batches of the split path differ from one whole batch"
    # without a workspace, the one-block-a-head path, tables and all
    wide = cuda.device_array((B, HEADS, DIM), np.uint16)
    sparse_attention_tables(q, table(rings), rows, table(comps), positions, chosen, WINDOW, sinks, scale, cos, sin,
                            wide, B)
    wide_rows = wide.copy_to_host()
    one_ws = SparseWorkspace.allocate(1, HEADS, DIM, WINDOW + TOPK)
    for b in range(B):
        alone = (q[b:b + 1], rings[b], rows[b:b + 1], comps[b], positions[b:b + 1], chosen[b:b + 1], sinks, scale,
                 cos, sin)
        one = cuda.device_array((1, HEADS, DIM), np.uint16)
        sparse_attention(*alone, one, 1, workspace=one_ws)
        assert np.array_equal(got[b], one.copy_to_host()[0]), f"row {b} (position {POSITIONS[b]})"
        sparse_attention(*alone, one, 1)
        assert np.array_equal(wide_rows[b], one.copy_to_host()[0]), f"row {b}, one block a head"
    assert (got != 0).any()
    # the fused kernel (forced: a batch's default past eight) over the tables
    # against the fused kernel on each token alone (a chunk of one: its window row in chunk row 0)
    fused = cuda.device_array((B, HEADS, DIM), np.uint16)
    sparse_attention_tables(q, table(rings), rows, table(comps), positions, chosen, WINDOW, sinks, scale, cos, sin,
                            fused, B, workspace=ws, cores="fused")
    fused_rows = fused.copy_to_host()
    for b in range(B):
        one = cuda.device_array((1, HEADS, DIM), np.uint16)
        sparse_attention(q[b:b + 1], rings[b], rows[b:b + 1], comps[b], positions[b:b + 1], chosen[b:b + 1], sinks,
                         scale, cos, sin, one, 1, workspace=one_ws, cores="fused")
        assert np.array_equal(fused_rows[b], one.copy_to_host()[0]), f"row {b}, fused"


def test_index_scores_and_select_tables(tiny_cfg):
    """index_scores_tables over each row's own key cache and select with own_rows (candidate
    source, then a source respecting its mask), against index_scores + select of each row alone:
    scores, selections and candidate blocks equal, rows with nothing visible selecting nothing."""
    cfg = dataclasses.replace(tiny_cfg, index_topk=TOPK, candidate_block_size=2, candidate_topk_blocks=3)
    rng = np.random.default_rng(22)
    ratio, heads, dim = 2, 3, 64
    keys = [dev_bf16(fp4_act_quant(bf16(rng.standard_normal((GROUPS, dim)).astype(np.float32)), 32, False))
            for _ in range(B)]
    iq = dev_bf16(fp4_act_quant(bf16(rng.standard_normal((B, heads * dim)).astype(np.float32)), 32, False))
    hw = dev_bf16(bf16(rng.standard_normal((B, heads)).astype(np.float32)))
    positions = cuda.to_device(POSITIONS)
    widths = (POSITIONS + 1) // ratio
    scale = dim ** -0.5 * heads ** -0.5
    score = cuda.to_device(np.full((B, GROUPS), 0x7FC0, np.uint16))
    indexer.index_scores_tables(iq, hw, table(keys), scale, score, B, positions, ratio, int(widths.max()), dim)
    got = score.copy_to_host()
    for b in range(B):
        one = cuda.device_array((1, GROUPS), np.uint16)
        indexer.index_scores(iq[b:b + 1], hw[b:b + 1], keys[b], scale, one, 1, positions[b:b + 1], ratio,
                             int(widths[b]))
        w = widths[b]
        assert np.array_equal(got[b, :w], one.copy_to_host()[0, :w]), f"row {b}'s scores"
    # select on tie-heavy scores (rows' own widths): the candidate source, then a masked source
    scores = cuda.to_device(to_bits(score_patterns(rng, B, GROUPS)["ties"]))
    cand = cuda.to_device(np.full((B, GROUPS), 7, np.uint8))
    sel = cuda.device_array((B, TOPK), np.int32)
    alone_cand = [cuda.to_device(np.full((1, GROUPS), 7, np.uint8)) for _ in range(B)]
    for path in SELECT_PATHS:  # the batch on each path, each row alone on the split path
        for source, uses in ((True, False), (False, True)):
            role = LayerRole(3, ratio, False, True, source, uses, False)
            indexer.select(cfg, role, scores, positions, cand, sel, B, own_rows=True, **path)
            for b in range(B):
                one = cuda.device_array((1, TOPK), np.int32)
                indexer.select(cfg, role, scores[b:b + 1], positions[b:b + 1], alone_cand[b], one, 1)
                assert np.array_equal(sel.copy_to_host()[b], one.copy_to_host()[0]), f"{path} row {b}: {source=}"
                if source:
                    blocks = -(-int(widths[b]) // cfg.candidate_block_size)
                    assert np.array_equal(cand.copy_to_host()[b, :blocks], alone_cand[b].copy_to_host()[0, :blocks])
        assert (sel.copy_to_host()[5] == -1).all()  # position 0 sees no group


@pytest.mark.slow
@pytest.mark.parametrize("ratio", [1, 2])
def test_compress_and_publish_batch(tiny_cfg, ratio):
    """compress_groups_batch + publish_batch for B sequences, each with its own compressor state
    and caches (prefilled to its position), against compress + publish of each token alone on a
    copy of that sequence's state: state and both caches equal."""
    cfg = tiny_cfg
    rng = np.random.default_rng(23 + ratio)
    c, d, idd = cfg.dim, cfg.head_dim, cfg.index_head_dim
    max_seq = 40
    role = LayerRole(1, ratio, True, True, False, False, False)
    gtype = "F32" if ratio > 1 else "BF16"
    w = kv_sources.KvSourceWeights(
        DeviceWeight.from_values("kv", one_hot(d, c, 0, 1.0), gtype),
        DeviceWeight.from_values("gate", one_hot(d, c, 3, 4.0), gtype) if ratio > 1 else None,
        cuda.to_device(bf16(rng.random(d).astype(np.float32) + 0.5)),
        DeviceWeight.from_values("wk", one_hot(idd, d, 1, 2.0), "BF16"),
        cuda.to_device(bf16(rng.random(idd).astype(np.float32) + 0.5)))
    cos, sin = (cuda.to_device(a) for a in rope_tables(cfg, max_seq).compressed)
    ws = kv_sources.KvSourceWorkspace.allocate(max(B, int(POSITIONS.max())), d, idd)
    batched, alone = [], []
    for p in POSITIONS:  # two identical states a sequence, prefilled to its position
        prompt = dev_bf16(bf16(rng.standard_normal((max(int(p), 1), c)).astype(np.float32)))
        pair = []
        for _ in range(2):
            state = kv_sources.KvSourceState.allocate(ratio, d, idd, max_seq)
            if p:
                pos = cuda.to_device(np.arange(p, dtype=np.int32))
                latents, groups = kv_sources.compress(cfg, role, w, state, prompt, 0, ws, pos, int(p))
                kv_sources.publish(cfg, role, w, state, latents, groups, cos, sin, ws, pos)
            pair.append(state)
        batched.append(pair[0])
        alone.append(pair[1])
    x = dev_bf16(bf16(rng.standard_normal((B, c)).astype(np.float32)))
    positions = cuda.to_device(POSITIONS)
    kv_sources.compress_products(role, w, x, ws, B)
    latents, group_pos = kv_sources.compress_groups_batch(cfg, role, w, table(s.kv_state for s in batched),
                                                          table(s.score_state for s in batched), ws, positions, B)
    kv_sources.publish_batch(cfg, role, w, table(s.index_keys for s in batched), table(s.compressed for s in batched),
                             latents, group_pos, cos, sin, ws, positions, B)
    for b, p in enumerate(POSITIONS):
        pos = positions[b:b + 1]
        latents, groups = kv_sources.compress(cfg, role, w, alone[b], x[b:b + 1], int(p), ws, pos, 1)
        kv_sources.publish(cfg, role, w, alone[b], latents, groups, cos, sin, ws, pos)
        for name in ("kv_state", "score_state", "index_keys", "compressed"):
            got, want = (getattr(s[b], name).copy_to_host().view(np.uint8) for s in (batched, alone))
            assert np.array_equal(got, want), f"sequence {b} (position {p}): {name}"


def test_index_scores_tables_tensor_cores(tiny_cfg):
    """index_scores_tables on the tensor-core kernel (emulated mma): each row's scores over its own
    key cache and its own width equal the oracle's for that row alone, bit for bit."""
    rng = np.random.default_rng(23)
    ratio, heads, dim = 2, 8, 64
    keys = [fp4_act_quant(bf16(rng.standard_normal((GROUPS, dim)).astype(np.float32)), 32, False) for _ in range(B)]
    iq = fp4_act_quant(bf16(rng.standard_normal((B, heads * dim)).astype(np.float32)), 32, False)
    hw = bf16(rng.standard_normal((B, heads)).astype(np.float32))
    widths = (POSITIONS + 1) // ratio
    scale = dim ** -0.5 * heads ** -0.5
    score = cuda.to_device(np.full((B, GROUPS), 0x7FC0, np.uint16))
    dev_keys = [dev_bf16(k) for k in keys]  # alive while the table names them
    indexer.index_scores_tables(dev_bf16(iq), dev_bf16(hw), table(dev_keys), scale, score, B,
                                cuda.to_device(POSITIONS), ratio, int(widths.max()), dim, cores="tc")
    got = score.copy_to_host()
    for b in range(B):
        w = widths[b]
        ref = to_bits(oracle.index_scores(iq[b:b + 1].reshape(1, heads, dim), hw[b:b + 1], keys[b][:w], scale))
        assert np.array_equal(got[b, :w], ref[0]), f"row {b}'s scores"
        assert (got[b, w:] == 0x7FC0).all(), f"row {b}: scores past its width written"
