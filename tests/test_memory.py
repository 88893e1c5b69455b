"""flashv41.memory: the estimate against sizes worked out by hand from the config and the file."""

from __future__ import annotations

from pathlib import Path

import pytest

import flashv41
from flashv41.host import gguf_layout as L
from flashv41.host.errors import InputError
from flashv41.memory import estimate_memory, format_bytes
from flashv41.stages import sparse_attention as sa


def test_estimate_for_tiny(tiny_path: Path) -> None:
    model = flashv41.load_model(tiny_path)
    try:
        cfg, weights = model.config, model.weights
        assert cfg.engram is not None
        max_seq, max_tokens = 256, 16
        est = estimate_memory(cfg, weights, max_seq, max_tokens)
        tables = sum(weights.get(i, L.ENGRAM_TABLE).nbytes for i in cfg.engram.layer_ids)
        # every tensor the engine uses is every tensor of a synthetic file
        assert est.weight_bytes == sum(t.nbytes for t in weights)

        ring = cfg.window * cfg.head_dim * 2
        state = max_seq * 8  # the hash cache
        for role, layer in zip(cfg.roles, est.layers, strict=True):
            expected = ring
            if role.kv_source:
                groups = max_seq // role.ratio
                caches = groups * (cfg.head_dim + cfg.index_head_dim) * 2  # compressed rows, index keys
                expected += caches + 2 * role.ratio * cfg.head_dim * 4
            assert layer.state_bytes == expected, role.layer
            assert layer.block_type == role.block_type
            state += expected
        assert est.state_bytes_per_sequence == state
        # what moves with a sequence: a checkpoint holds every ring and partial group; a fork or a
        # save adds, a position, its hash and each kv source's cache rows over the group's r positions
        sources = [role for role in cfg.roles if role.kv_source]
        assert est.checkpoint_bytes == cfg.n_layers * ring + sum(2 * r.ratio * cfg.head_dim * 4 for r in sources)
        assert est.position_bytes == 8 + sum((cfg.head_dim + cfg.index_head_dim) * 2 / r.ratio for r in sources)
        assert est.checkpoint_bytes + max_seq * est.position_bytes == state
        assert f"fork / save move             {format_bytes(est.checkpoint_bytes):>10}  + " in est.table()

        t = max_tokens
        # the sparse attention's decode (and batched decode) scratch: scores, tile maxima, block value sums and
        # 3 per-block rows
        st, entries = min(t, sa.SPLIT_BATCH_TOKENS), cfg.window + cfg.index_topk
        blocks = -(-entries // sa.SPARSE_BLOCK)
        sparse = 4 * st * cfg.n_heads * (entries + -(-entries // sa.SCORE_TILE) + blocks * cfg.head_dim + 3 * blocks)
        # the index scores: bf16, a column a group of the finest compression ratio
        groups = max_seq // min(role.ratio for role in cfg.roles if role.ratio > 0)
        workspace = (2 * t * cfg.hc * cfg.dim * 4 + t * cfg.n_heads * cfg.head_dim * 2 + sparse + t * groups * 2
                     + t * cfg.engram.cols * cfg.engram.head_dim * 2 + t * cfg.dim * (cfg.hc + 1) * 2)
        assert est.workspace_bytes == workspace
        assert est.total_bytes(3) == est.weight_bytes + 3 * state + workspace

        on_host = estimate_memory(cfg, weights, max_seq, max_tokens, table_residency="host")
        assert on_host.weight_bytes == est.weight_bytes - tables
        assert on_host.host_table_bytes == tables and est.host_table_bytes == 0
        text = on_host.table()
        assert "(host)" in text and format_bytes(on_host.total_bytes(1)) in text
        assert f"({(1 << 30) // on_host.state_bytes_per_sequence} sequences per GiB left after the rest)" in text
        pinned = estimate_memory(cfg, weights, max_seq, max_tokens, table_residency="pinned")
        assert pinned.weight_bytes == on_host.weight_bytes and pinned.host_table_bytes == tables
        text = pinned.table()
        assert "(pinned)" in text and "engram tables, pinned host" in text and "in pinned host memory" in text
    finally:
        model.close()


def test_bad_arguments(tiny_path: Path) -> None:
    model = flashv41.load_model(tiny_path)
    try:
        with pytest.raises(InputError, match="max_seq"):
            estimate_memory(model.config, model.weights, 0, 4)
        with pytest.raises(InputError, match="table_residency"):
            estimate_memory(model.config, model.weights, 16, 4, table_residency="disk")
    finally:
        model.close()


def test_format_bytes() -> None:
    assert [format_bytes(n) for n in (0, 1023, 1536, 5 * 2**20, 3 * 2**30)] == [
        "0 B", "1023 B", "1.5 KiB", "5.0 MiB", "3.0 GiB"]


def test_engine_sequence_bytes_and_max_batch(tiny_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine's sequence_bytes is what a new sequence allocates on the device (its attention
    state) plus the estimate's hash cache, checkpoint_bytes what its truncate checkpoint holds;
    max_batch divides the free device memory by the two. At a position, sequence_bytes is the used
    part that a fork copies and a save writes."""
    import flashv41.engine

    model = flashv41.load_model(tiny_path)
    try:
        with flashv41.Engine(model, max_seq=64, max_tokens=8) as engine:
            seq = engine.new_sequence()
            assert engine.sequence_bytes() == seq.state.nbytes() + 64 * 8  # int64 compressed ids a position
            assert engine.checkpoint_bytes() == seq.checkpoints.nbytes()
            assert engine.sequence_bytes(64) == engine.sequence_bytes()
            assert engine.sequence_bytes(0) == engine.checkpoint_bytes()  # every ring and partial group
            per_sequence = engine.sequence_bytes() + engine.checkpoint_bytes()
            monkeypatch.setattr(flashv41.engine, "device_free_bytes", lambda: 10 * per_sequence + 1)
            assert engine.max_batch() == 10
            seq.release()
    finally:
        model.close()


def test_device_memory_grows_linearly_with_max_seq(tiny_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 44's "no buffer grows with the square of the prompt", at the engine: the device bytes an
    engine and one sequence allocate (every numba device array, counted as it is made) are an affine
    function of max_seq at a fixed chunk size: equal steps of max_seq add equal bytes. A buffer of
    max_seq x max_seq (or of max_seq times anything that grows with it) breaks the equality. The
    steps are multiples of every ratio and group width, so no rounding bends the line. (Measured: 690 KB
    at max_seq 64, 29 KB more each 64 positions; the index scores made [T, G^2] fail it.)"""
    from numba import cuda

    counted = [0]

    def counting(make):
        def wrapped(*args, **kwargs):
            a = make(*args, **kwargs)
            counted[0] += int(a.nbytes)
            return a
        return wrapped

    for name in ("device_array", "device_array_like", "to_device"):
        monkeypatch.setattr(cuda, name, counting(getattr(cuda, name)))

    def allocated(max_seq: int) -> int:
        counted[0] = 0
        with flashv41.load_model(tiny_path) as model, \
                flashv41.Engine(model, max_seq=max_seq, max_tokens=16, graphs=False) as engine:
            engine.new_sequence()
            return counted[0]

    sizes = [allocated(s) for s in (64, 128, 192, 256)]
    steps = [b - a for a, b in zip(sizes, sizes[1:], strict=False)]
    assert steps[0] > 0 and steps == [steps[0]] * 3, f"device bytes at max_seq 64..256: {sizes}"
