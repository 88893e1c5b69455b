"""The engram stages against the oracle, on the tiny preset (simulator-sized; the same tests at small
and flash sizes are in tests/test_engram_gpu.py).

- hash (host.engram_hash_fast): equal to host.engram_hash, element for element, for prefill, chunked
  prefill, decode, masks and unmapped ids, with the same errors;
- rows (stages.engram_rows): bit-identical to host.oracle.engram.engram_rows, Q2_K / Q8_0 / BF16 /
  MXFP4 tables (MXFP4 in the llama.cpp and mxxm-t layouts), every residency;
- projection (stages.linear through the stage): tests/bounds.py's product rules (at least 99% of
  outputs bit-equal to the oracle, the rest within the sqrt(K) bound);
- gate (stages.engram_gate): within `gate_bounds` below;
- EngramStage.apply: the four chained, against host.oracle.engram.engram_layer's capture (rows
  equal, kv under the product rules) and the oracle's gate applied to the stage's kv.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from numba import cuda  # noqa: E402  (after conftest chose the backend)

import flashv41
from flashv41.bench.core import BenchOptions, BenchRow, format_table, select_cases
from flashv41.bench.engram import cases as bench_cases
from flashv41.bench.engram import engram_config
from flashv41.cli import main
from flashv41.host.engram_hash import EngramHasher
from flashv41.host.engram_hash import hash_positions as oracle_hash_positions
from flashv41.host.engram_hash_fast import FastEngramHasher, floor_mod, hash_positions
from flashv41.host.errors import CapacityError, InputError, UnsupportedError
from flashv41.host.numerics import F32, bf16, from_bits, to_bits
from flashv41.host.numerics import linear as oracle_linear
from flashv41.host.oracle import Oracle
from flashv41.host.oracle.engram import engram_gate as oracle_gate
from flashv41.host.oracle.engram import engram_layer, engram_rows
from flashv41.stages.backend import using_simulator
from flashv41.stages.engram import EngramStage
from flashv41.stages.engram_gate import engram_gate
from flashv41.stages.engram_rows import RowWorkspace, TableRows
from flashv41.stages.linear import pick_kernel
from tests.bounds import assert_bf16_product, assert_within, weight_terms

U = 2.0**-24  # float32 unit roundoff


def gate_bounds(h: np.ndarray, kv: np.ndarray, qk: np.ndarray, eps: float, g_ref: np.ndarray):
    """Bounds on |g_gpu - g_oracle| [T, hc] and |h_gpu - h_oracle| [T, hc, C] for the same inputs.

    The kernel differs from the oracle only in its fp32 reductions (the oracle sums in float64, and
    both evaluate rsqrt and sigmoid in float64, rounded once). With C terms, u = 2^-24:
    - S = sum((h * qk) * key): the products (h * qk) round identically; the last product may be fused
      into the sum, and an fp32 sum of C terms errs by <= C u sum|terms|: |dS| <= (C + 1) u A + u |S|,
      A = sum|terms| (the last term: the oracle's own rounding of S);
    - mean(h^2) + eps and mean(key^2) + eps: (C + 1) u from the sum, a few u from /C, + eps and the
      oracle's roundings, relative: <= (C + 5) u each; rsqrt halves that and adds 2 u; the three
      products of `dot` add 2 u each side: relative error of dot <= (C + 15) u on top of dS.
      So |d dot| <= e = 1.01 (rstd C^-0.5 ((C + 1) u A + u |S|) + |dot| (C + 15) u).
    - s = copysign(sqrt(max(|dot|, 1e-6)), dot): if |dot| > e the sign is shared and
      |ds| <= e / (2 sqrt(max(|dot| - e, 1e-6))); otherwise |ds| <= 2 sqrt(max(|dot| + e, 1e-6)).
    - g = sigmoid(s): sigmoid' <= 1/4, and each side rounds g to float32 once: |dg| <= |ds| / 4 + 2 u.
    - h + g * value: |dh| <= |value| |dg| + 3 u (|h| + |g value|) (the product and the sum each round,
      or are fused, on either side).
    """
    t, hc, c = h.shape
    key = np.asarray(kv[:, : hc * c], np.float64).reshape(t, hc, c)
    value = np.asarray(kv[:, hc * c:], np.float64)[:, None, :]
    terms = (h * qk[None]).astype(F32).astype(np.float64) * key
    s, a = terms.sum(-1), np.abs(terms).sum(-1)
    h64 = h.astype(np.float64)
    rstd = 1 / np.sqrt((h64 * h64).mean(-1) + eps) / np.sqrt((key * key).mean(-1) + eps)
    scaled = rstd * c**-0.5
    dot = s * scaled
    e = 1.01 * (scaled * ((c + 1) * U * a + U * np.abs(s)) + np.abs(dot) * (c + 15) * U)
    same_sign = np.abs(dot) > e
    ds = np.where(same_sign, e / (2 * np.sqrt(np.maximum(np.abs(dot) - e, 1e-6))),
                  2 * np.sqrt(np.maximum(np.abs(dot) + e, 1e-6)))
    dg = ds / 4 + 2 * U
    gv = np.abs(np.asarray(g_ref, np.float64)[..., None] * value)
    dh = np.abs(value) * dg[..., None] + 3 * U * (np.abs(h64) + gv)
    return dg, dh


# ------------------------------------------------------------------------------------------ hash


@pytest.fixture(scope="module")
def tiny(tiny_path: Path):
    model = flashv41.load_model(tiny_path)
    yield model
    model.close()


def test_preset_engram_config_matches_the_written_file(tiny) -> None:
    """bench_engram.engram_config (used for the flash hash below and in the bench) builds the same
    tables host.synth writes."""
    built, read = engram_config("tiny"), tiny.config.engram
    for name in ("layer_ids", "n_heads", "head_dim", "max_ngram", "pad_id", "table_rows"):
        assert getattr(built, name) == getattr(read, name), name
    for name in ("multipliers", "primes", "offsets", "token_map"):
        assert np.array_equal(getattr(built, name), getattr(read, name)), name


def test_floor_mod_matches_python_modulo() -> None:
    rng = np.random.default_rng(0)
    extremes = [0, 1, -1, 2, -2, 2**63 - 1, -(2**63), -(2**63) + 1, 2**62, -(2**62) - 3]
    values = extremes + [int(v) for v in rng.integers(-(2**63), 2**63 - 1, 2000, dtype=np.int64)]
    for p in (2, 3, 37, 125_003, 2**31 - 1, 4_294_967_311, 2**51 - 129):
        inv = 1.0 / p
        for a in values:
            assert floor_mod(np.int64(a), np.int64(p), inv) == a % p, (a, p)


def _sequence_calls(vocab: int, rng: np.random.Generator):
    """(ids, start, mask) calls of one sequence: chunked prefill from several positions, then decode;
    the stub token map leaves the last two raw ids unmapped, so they are drawn often."""
    def ids(n):
        return np.where(rng.random(n) < 0.15, rng.integers(vocab - 2, vocab, n), rng.integers(0, vocab, n))

    calls, pos = [], 0
    for n, masked in ((1, False), (5, True), (3, False), (9, True)):
        mask = rng.random(n) < 0.8 if masked else None
        calls.append((ids(n), pos, mask))
        pos += n
    for _ in range(4):
        calls.append((ids(1), pos, None))
        pos += 1
    return calls


@pytest.mark.parametrize("preset_name", ["tiny", "flash"])
def test_hash_equals_the_oracle(preset_name: str) -> None:
    engram = engram_config(preset_name)
    vocab = engram.token_map.shape[0]
    rng = np.random.default_rng(5)
    fast, ref = FastEngramHasher(engram, 64), EngramHasher(engram, 64)
    for ids, start, mask in _sequence_calls(vocab, rng):
        got, want = fast.hash(ids, start, mask), ref.hash(ids, start, mask)
        assert got.dtype == np.int64 and got.shape == (ids.size, len(engram.layer_ids), engram.cols)
        assert np.array_equal(got, want), (preset_name, start)
    assert np.array_equal(fast.history, ref.history)
    # one-shot prefill, and the module function on a shared history
    all_ids = rng.integers(0, vocab, 40)
    assert np.array_equal(FastEngramHasher(engram, 40).hash(all_ids, 0), EngramHasher(engram, 40).hash(all_ids, 0))
    for start, count in ((0, 0), (0, 17), (3, 20), (30, 1)):
        assert np.array_equal(hash_positions(engram, ref.history, start, count),
                              oracle_hash_positions(engram, ref.history, start, count))
    fast.reset()
    assert (fast.history == -1).all()


def test_hash_errors_are_the_oracles() -> None:
    engram = engram_config("tiny")
    vocab = engram.token_map.shape[0]
    good = np.arange(4)
    bad_inputs = [
        (np.array([1, vocab]), 0, None),  # outside the vocabulary
        (np.array([-1, 2]), 0, None),
        (np.zeros((2, 2), np.int64), 0, None),  # not 1-D
        (np.array([1.0, 2.0]), 0, None),  # not integers
        (good, 0, np.ones(4, np.uint8)),  # mask not bool
        (good, 0, np.ones(3, bool)),  # mask of another shape
        (good, 14, None),  # past max_seq
        (good, -1, None),
    ]
    for ids, start, mask in bad_inputs:
        fast, ref = FastEngramHasher(engram, 16), EngramHasher(engram, 16)
        with pytest.raises((InputError, CapacityError)) as want:
            ref.hash(ids, start, mask)
        with pytest.raises(type(want.value)) as got:
            fast.hash(ids, start, mask)
        assert str(got.value) == str(want.value)
        assert (fast.history == -1).all()  # nothing written


# ------------------------------------------------------------------------------------------ rows


def _ids(rng: np.random.Generator, table_rows: int, t: int, cols: int) -> np.ndarray:
    ids = rng.integers(0, table_rows, (t, cols))
    ids.flat[:3] = [0, table_rows - 1, 0]  # both ends and a repeat
    return ids


@pytest.mark.parametrize("residency", ["device", "pinned", "host"])
@pytest.mark.parametrize(("table_type", "layout"), [("Q2_K", "llama.cpp"), ("Q8_0", "llama.cpp"), ("BF16", "llama.cpp"),
                                                    ("MXFP4", "llama.cpp"), ("MXFP4", "mxxm-t")])
def test_rows_bit_exact(synth_model, table_type: str, layout: str, residency: str) -> None:
    """MXFP4 in both layouts that carry it: eight 17-byte blocks a 256-value row (llama.cpp's
    `engram_embd`, mxxm-t's `engram_embed`)."""
    model = flashv41.load_model(synth_model("tiny", table_type=table_type, layout=layout))
    try:
        engram = model.config.engram
        table = model.tensor(engram.layer_ids[1], "engram_embd")
        assert table.ggml_type.name == table_type
        ws = RowWorkspace(8, engram.cols, table.row_bytes(), residency)
        rows = TableRows(table, residency)
        out = cuda.device_array((8, engram.cols * engram.head_dim), np.uint16)
        rng = np.random.default_rng(1)
        for t in (7, 2):  # a second, shorter load must not see the first one's rows
            ids = _ids(rng, table.shape[0], t, engram.cols).astype(np.int32 if t == 2 else np.int64)
            rows.load(ids, t, ws, out)
            got = out.copy_to_host()[:t]
            want = to_bits(engram_rows(table, ids))
            assert np.array_equal(got, want), f"{table_type} {residency}: {int((got != want).sum())} bf16 values differ"
    finally:
        model.close()


# --------------------------------------------------------------------------- projection and gate


@pytest.fixture(scope="module")
def stage(tiny):
    st = EngramStage(tiny, 12)
    yield st
    st.free()


@pytest.fixture(scope="module")
def oracle(tiny):
    return Oracle(tiny)


def wkv_terms(st: EngramStage, layer: int, n_tokens: int) -> dict:
    """split_terms for the projection of n_tokens tokens: the wkv's two parts per value when the
    kernel that stages.linear picks adds them apart (Q2_K's stream and, on a GPU, tc), else nothing."""
    w = st.layers[layer].wkv
    return weight_terms(w, pick_kernel(w, True, n_tokens))


@pytest.mark.parametrize("tokens", [2, 9], ids=["stream", "gemm"])
def test_projection_within_bound(tiny, stage, oracle, tokens: int) -> None:
    """Simulator: 100% of the kv outputs bit-equal to the oracle."""
    engram = tiny.config.engram
    layer = engram.layer_ids[0]
    ids = _ids(np.random.default_rng(tokens), engram.table_rows[0], tokens, engram.cols)
    stage.load_rows(layer, ids, tokens)
    stage.project(layer, tokens)
    rows = from_bits(stage.rows.copy_to_host()[:tokens])
    kv = from_bits(stage.kv.copy_to_host()[:tokens])
    wkv = oracle.weight(layer, "engram_wkv")
    assert np.array_equal(to_bits(rows), to_bits(engram_rows(tiny.tensor(layer, "engram_embd"), ids)))
    assert_bf16_product(kv, oracle_linear(rows, wkv), rows, wkv, f"engram kv T={tokens}",
                        **wkv_terms(stage, layer, tokens))


def _gate_inputs(rng: np.random.Generator, t: int, hc: int, c: int):
    h = rng.standard_normal((t, hc, c)).astype(F32)
    kv = bf16(rng.standard_normal((t, c * (hc + 1))).astype(F32))
    qk = bf16(rng.standard_normal((hc, c)).astype(F32) * F32(0.5))
    mask = rng.random(t) < 0.75
    mask[0], mask[-1] = True, t == 1  # at least one live token, and a masked one when t > 1
    return h, kv, qk, mask


@pytest.mark.parametrize("t,hc,c,threads", [(6, 4, 32, 1), (2, 1, 80, 64), (3, 3, 45, 32)],
                         ids=["one-thread", "two-warps", "one-warp"])
def test_gate_within_bound(t: int, hc: int, c: int, threads: int) -> None:
    """One-thread blocks (the simulator's default) and warp reductions over a C that is not a multiple
    of the block, with masked tokens."""
    rng = np.random.default_rng(t * 10 + hc)
    h, kv, qk, mask = _gate_inputs(rng, t, hc, c)
    eps = 1e-20
    h_dev = cuda.to_device(h)
    g_dev = cuda.device_array((t, hc), np.float32)
    engram_gate(h_dev, cuda.to_device(to_bits(kv)), cuda.to_device(qk), eps, cuda.to_device(mask.astype(np.uint8)),
                g_dev, t, threads=threads)
    h_ref, g_ref = oracle_gate(h, kv, qk, eps, mask)
    dg, dh = gate_bounds(h, kv, qk, eps, g_ref)
    g, out = g_dev.copy_to_host(), h_dev.copy_to_host()
    assert_within(g, g_ref, dg, f"gate g ({threads} threads)")
    assert_within(out, h_ref, dh, f"gate h ({threads} threads)")
    assert (g[~mask] == 0).all() and np.array_equal(out[~mask], h[~mask])


# ------------------------------------------------------------------------------- the whole stage


def check_apply(model, oracle_, st, layer: int, h: np.ndarray, row_ids: np.ndarray, mask=None,
                mask_dtype=np.uint8) -> dict[str, float]:
    """st.apply against engram_layer's capture: rows equal, kv under the product rules (bit-equal
    fraction printed; simulator, tiny preset: 100%; the small and flash presets on the H200
    (2026-12-01): 99.95-100%), g and h within gate_bounds of the oracle's gate run on the stage's kv. Returns the
    largest errors."""
    t = h.shape[0]
    cfg = model.config
    h_dev = cuda.to_device(np.concatenate([h, np.full((2, *h.shape[1:]), 7, F32)]))  # rows past T untouched
    mask_dev = None if mask is None else cuda.to_device(mask.astype(mask_dtype))
    cap: dict = {}
    st.apply(layer, h_dev, row_ids, t, mask_dev, cap)
    want: dict = {}
    table = model.tensor(layer, "engram_embd")
    wkv, qk = oracle_.weight(layer, "engram_wkv"), oracle_.engram_qk(layer)
    engram_layer(h, row_ids, table, wkv, qk, cfg.norm_eps, mask, want)
    assert np.array_equal(cap["engram_ids"], want["engram_ids"])
    assert np.array_equal(to_bits(cap["engram_rows"]), to_bits(want["engram_rows"])), "rows differ"
    assert_bf16_product(cap["engram_kv"], want["engram_kv"], want["engram_rows"], wkv, f"kv layer {layer} T={t}",
                        **wkv_terms(st, layer, t))
    h_ref, g_ref = oracle_gate(h, cap["engram_kv"], qk, cfg.norm_eps, mask)
    dg, dh = gate_bounds(h, cap["engram_kv"], qk, cfg.norm_eps, g_ref)
    out = h_dev.copy_to_host()
    assert_within(cap["engram_gate"], g_ref, dg, f"gate layer {layer} T={t}")
    assert_within(out[:t], h_ref, dh, f"h layer {layer} T={t}")
    assert (out[t:] == 7).all()
    return {"kv": float(np.abs(cap["engram_kv"] - want["engram_kv"]).max()),
            "gate": float(np.abs(cap["engram_gate"] - g_ref).max()),
            "h": float(np.abs(out[:t] - h_ref).max())}


def _highway(rng: np.random.Generator, t: int, cfg) -> np.ndarray:
    return (rng.standard_normal((t, cfg.hc, cfg.dim)) * 0.5).astype(F32)


@pytest.mark.parametrize("tokens", [5, 11], ids=["stream", "gemm"])
def test_apply_prefill(tiny, stage, oracle, tokens: int) -> None:
    cfg = tiny.config
    rng = np.random.default_rng(tokens)
    ids = rng.integers(0, cfg.vocab_size, tokens)
    hashes = FastEngramHasher(cfg.engram, 64).hash(ids, 0)
    layer = cfg.engram.layer_ids[tokens % 2]
    check_apply(tiny, oracle, stage, layer, _highway(rng, tokens, cfg), hashes[:, cfg.engram.hash_index(layer)])


def test_apply_chunked_prefill_and_decode_host_tables(tiny, oracle) -> None:
    cfg = tiny.config
    st = EngramStage(tiny, 4, "host")
    try:
        rng = np.random.default_rng(9)
        hasher = FastEngramHasher(cfg.engram, 32)
        pos = 0
        for i, n in enumerate((4, 3, 1, 1)):  # two prefill chunks, two decode steps, alternating layers
            hashes = hasher.hash(rng.integers(0, cfg.vocab_size, n), pos)
            layer = cfg.engram.layer_ids[i % 2]
            check_apply(tiny, oracle, st, layer, _highway(rng, n, cfg), hashes[:, cfg.engram.hash_index(layer)])
            pos += n
    finally:
        st.free()


@pytest.mark.parametrize("mask_dtype", [np.uint8, np.bool_])
def test_apply_token_mask(tiny, stage, oracle, mask_dtype) -> None:
    cfg = tiny.config
    rng = np.random.default_rng(4)
    mask = np.array([True, False, True, False])
    hashes = FastEngramHasher(cfg.engram, 8).hash(rng.integers(0, cfg.vocab_size, 4), 0, mask)
    layer = cfg.engram.layer_ids[1]
    check_apply(tiny, oracle, stage, layer, _highway(rng, 4, cfg), hashes[:, 1], mask, mask_dtype)


@pytest.mark.parametrize("hc", [1, 2])
def test_fewer_copies(synth_model, hc: int) -> None:
    model = flashv41.load_model(synth_model("tiny", hc=hc))
    try:
        cfg = model.config
        assert cfg.hc == hc
        st = EngramStage(model, 2)
        rng = np.random.default_rng(hc)
        hashes = FastEngramHasher(cfg.engram, 8).hash(rng.integers(0, cfg.vocab_size, 1), 0)
        check_apply(model, Oracle(model), st, cfg.engram.layer_ids[0], _highway(rng, 1, cfg), hashes[:, 0])
        st.free()
    finally:
        model.close()


def test_five_copies_refused(synth_model) -> None:
    model = flashv41.load_model(synth_model("tiny", hc=5))
    try:
        with pytest.raises(UnsupportedError, match="hc .* 1..4, got 5"):
            EngramStage(model, 2)
    finally:
        model.close()


def test_errors(tiny, stage) -> None:
    cfg = tiny.config
    e = cfg.engram
    layer = e.layer_ids[0]
    ids = np.zeros((2, e.cols), np.int64)
    h = cuda.device_array((2, cfg.hc, cfg.dim), np.float32)
    with pytest.raises(CapacityError, match="13 tokens exceed max_tokens 12"):
        stage.apply(layer, cuda.device_array((13, cfg.hc, cfg.dim), np.float32), np.zeros((13, e.cols)), 13)
    for bad_n in (0, -1, 2.0):
        with pytest.raises(InputError, match="n_tokens"):
            stage.apply(layer, h, ids, bad_n)
    with pytest.raises(InputError, match="layer 3 has no engram sublayer"):
        stage.apply(3, h, ids, 2)
    with pytest.raises(InputError, match=r"shape \(2, 2\)"):
        stage.apply(layer, h, np.zeros((2, e.cols + 1), np.int64), 2)
    with pytest.raises(InputError, match="integer array"):
        stage.apply(layer, h, ids.astype(np.float64), 2)
    too_big = ids.copy()
    too_big[1, 1] = e.table_rows[0]
    with pytest.raises(InputError, match=f"row id {e.table_rows[0]} at token 1, column 1"):
        stage.apply(layer, h, too_big, 2)
    for bad_h in (np.zeros((2, cfg.hc, cfg.dim), np.float32), cuda.device_array((2, cfg.hc, cfg.dim), np.float64),
                  cuda.device_array((1, cfg.hc, cfg.dim), np.float32), cuda.device_array((2, 3, cfg.dim), np.float32)):
        with pytest.raises(InputError, match="h must be a float32 device array"):
            stage.apply(layer, bad_h, ids, 2)
    for bad_mask in (np.ones(2, np.uint8), cuda.device_array(2, np.int32), cuda.device_array(1, np.uint8)):
        with pytest.raises(InputError, match="token_mask_dev"):
            stage.apply(layer, h, ids, 2, bad_mask)
    with pytest.raises(InputError, match="table residency"):
        EngramStage(tiny, 2, "disk")
    with pytest.raises(InputError, match="max_tokens"):
        EngramStage(tiny, 0)


def test_free_is_idempotent(tiny) -> None:
    st = EngramStage(tiny, 2, "host")
    assert st.device_bytes > 0
    st.free()
    st.free()
    assert st.layers == {} and st.rows is None and st.kv is None
    with pytest.raises(InputError, match="after free"):
        st.apply(tiny.config.engram.layer_ids[0], cuda.device_array((1, 4, 32), np.float32),
                 np.zeros((1, 2), np.int64), 1)


# ----------------------------------------------------------------------------------------- bench


@pytest.mark.skipif(not using_simulator(), reason="on a GPU the benchmark would run")
def test_bench_refuses_the_simulator(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--rows", "engram.hash*"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("flashv41: error: flashv41 bench needs a CUDA GPU") and len(err.splitlines()) == 1


def test_bench_rows_and_table() -> None:
    options = BenchOptions(weight_types=("Q8_0", "Q2_K"))
    names = [c.name for c in bench_cases(options)]
    assert "engram.wkv_gemv.Q2_K" in names and "engram.step.Q8_0.host" in names and "engram.hash.64k" in names
    picked = select_cases(bench_cases(options), ["engram.wkv*"])
    assert [c.name for c in picked] == ["engram.wkv_gemv.Q8_0", "engram.wkv_gemv.Q2_K"]
    with pytest.raises(InputError, match="no row matches"):
        select_cases(bench_cases(options), ["attention.*"])
    row = BenchRow("engram.wkv_gemv.Q8_0", 50e-6, 40e-6, bytes=167_000_000)
    assert row.ratio == pytest.approx(1.25) and row.to_json()["ratio"] == pytest.approx(1.25)
    table = format_table("H200", 4.3e12, [row])
    assert "4.300 TB/s" in table and "engram.wkv_gemv.Q8_0" in table and "1.25" in table and "3340.0" in table
