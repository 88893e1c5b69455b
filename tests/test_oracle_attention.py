"""The attention oracle's selection rules, entry lists and sparse attention, against brute-force readings.

The brute forces below are written from the V4.1 attention's definition and the reference's Indexer, in plain Python:
every (score, position) pair sorted with `sorted` and a key, blocks walked one by one, over the whole
compressed width as the reference's `topk(min(index_topk, end_pos // ratio))` does, then positions
the query cannot see mapped out. The oracle instead takes the top min(index_topk, visible) per query;
the two agree exactly when ties go to the lower position, which is what is being tested.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flashv41.host.config import LayerRole
from flashv41.host.numerics import bf16
from flashv41.host.oracle.attention import (
    SPARSE_BLOCK,
    build_entries,
    candidate_blocks,
    select,
    sparse_attention,
    topk_positions,
    window_positions,
)

F32 = np.float32
INF = math.inf
PROPERTY = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow])


# --- brute force ----------------------------------------------------------------------------------------


def by_score(pairs: list[tuple[float, int]]) -> list[tuple[float, int]]:
    """Highest score first, the lower index first among equal scores."""
    return sorted(pairs, key=lambda sq: (-sq[0], sq[1]))


def brute_candidates(row: list[float], visible: int, topk_blocks: int, block: int) -> list[bool]:
    width = len(row)
    n_blocks = -(-width // block)
    blocks = []
    for b in range(n_blocks):
        best = -INF
        for q in range(b * block, min((b + 1) * block, width)):
            best = max(best, row[q])
        if visible > 0 and b == (visible - 1) // block:  # the newest visible position's block is pinned
            best = INF
        blocks.append((best, b))
    kept = {b for s, b in by_score(blocks)[: min(topk_blocks, n_blocks)] if s > -INF}
    return [q // block in kept for q in range(width)]


def brute_topk(row: list[float], visible: int, topk: int, pad_to: int | None = None) -> list[int]:
    """The reference's way: top min(topk, width) over the whole width, invisible ones dropped,
    ascending, -1 padded."""
    width = len(row)
    masked = [row[q] if q < visible else -INF for q in range(width)]
    chosen = by_score([(masked[q], q) for q in range(width)])[: min(topk, width)]
    picks = sorted(q for _, q in chosen if q < visible)
    return picks + [-1] * ((pad_to or topk) - len(picks))


def brute_select(kind: str, score: np.ndarray, positions: np.ndarray, ratio: int, topk: int, topk_blocks: int,
                 block: int, candidates: list[list[bool]] | None) -> tuple[np.ndarray, list[list[bool]] | None]:
    """kind: 'plain' index source, 'source' (candidate source) or 'user' (masks to `candidates`)."""
    out, new_candidates = [], []
    for i, p in enumerate(positions.tolist()):
        visible = (p + 1) // ratio
        row = [float(v) if q < visible else -INF for q, v in enumerate(score[i].tolist())]
        if kind == "source":
            new_candidates.append(brute_candidates(row, visible, topk_blocks, block))
        elif kind == "user":
            assert candidates is not None
            row = [v if candidates[i][q] else -INF for q, v in enumerate(row)]
        out.append(brute_topk(row, visible, topk))
    return np.array(out, np.int64), (new_candidates if kind == "source" else candidates)


# --- the oracle, driven like the layer stack drives it ------------------------------------------------


def role(kind: str, ratio: int) -> LayerRole:
    return LayerRole(layer=3, ratio=ratio, kv_source=kind == "source", index_source=True,
                     candidate_source=kind == "source", uses_candidates=kind == "user", engram=False)


def config(topk: int, topk_blocks: int, block: int) -> SimpleNamespace:
    return SimpleNamespace(index_topk=topk, candidate_topk_blocks=topk_blocks, candidate_block_size=block)


def assert_selection(got: np.ndarray, want: np.ndarray, score: np.ndarray, positions: np.ndarray, what: str):
    assert got.shape == want.shape and got.dtype == np.int64, f"{what}: {got.shape} {got.dtype}"
    bad = np.flatnonzero((got != want).any(axis=1))
    if bad.size:
        i = int(bad[0])
        raise AssertionError(f"{what}: {bad.size} rows differ; first: query {i} at position {positions[i]}, "
                             f"scores {score[i].tolist()}: got {got[i].tolist()}, brute force {want[i].tolist()}")


def check_stack(score: np.ndarray, start: int, ratio: int, topk: int, topk_blocks: int, block: int) -> None:
    """A plain index source, then a candidate source and a later index source respecting it (with its
    own scores, here the reversed rows), each against the brute force."""
    positions = start + np.arange(score.shape[0])
    cfg = config(topk, topk_blocks, block)
    got, _ = select(cfg, role("plain", ratio), score, positions, None)  # type: ignore[arg-type]
    want, _ = brute_select("plain", score, positions, ratio, topk, topk_blocks, block, None)
    assert_selection(got, want, score, positions, "plain index source")

    got, mask = select(cfg, role("source", ratio), score, positions, None)  # type: ignore[arg-type]
    want, cand = brute_select("source", score, positions, ratio, topk, topk_blocks, block, None)
    assert_selection(got, want, score, positions, "candidate source")
    assert mask is not None and mask.tolist() == cand, "candidate mask"
    other = np.ascontiguousarray(score[:, ::-1])
    got, kept = select(cfg, role("user", ratio), other, positions, mask)  # type: ignore[arg-type]
    assert kept is mask, "a later index source hands the mask on as it came"
    want, _ = brute_select("user", other, positions, ratio, topk, topk_blocks, block, cand)
    assert_selection(got, want, other, positions, "candidate-respecting index source")


# --- crafted patterns ---------------------------------------------------------------------------------------


def test_topk_positions_by_hand() -> None:
    row = np.array([3, 1, 3, 2, 3, 9], F32)
    assert topk_positions(row, 5, 2).tolist() == [0, 2]  # three 3s tie: the two lower positions
    assert topk_positions(row, 5, 4).tolist() == [0, 2, 3, 4]
    assert topk_positions(row, 6, 1).tolist() == [5]
    assert topk_positions(row, 5, 9).tolist() == [0, 1, 2, 3, 4]  # min(topk, visible)
    assert topk_positions(row, 0, 3).tolist() == []
    tie = np.zeros(10, F32)
    assert topk_positions(tie, 10, 4).tolist() == [0, 1, 2, 3]
    ninf = np.full(10, -np.inf, F32)
    assert topk_positions(ninf, 7, 3).tolist() == [0, 1, 2]  # fillers, the lowest positions
    mixed = np.array([-np.inf, 5, -np.inf, -np.inf, 4], F32)
    assert topk_positions(mixed, 5, 4).tolist() == [0, 1, 2, 4]  # two finite, two lowest fillers


def test_candidate_blocks_by_hand() -> None:
    # width 7 in blocks of 3: [0, 5, 1 | 2, 2, 2 | 9]; blocks score 5, 2, 9
    row = np.array([[0, 5, 1, 2, 2, 2, 9]], F32)
    keep = candidate_blocks(row, np.array([7]), 2, 3)  # newest block 2 is pinned anyway (and best)
    assert keep.tolist() == [[True, True, True, False, False, False, True]]
    keep = candidate_blocks(row, np.array([4]), 1, 3)  # newest visible position 3: block 1 pinned
    assert keep.tolist() == [[False, False, False, True, True, True, False]]
    keep = candidate_blocks(row, np.array([4]), 2, 3)  # the pin, then the best other block (9)
    assert keep.tolist() == [[False, False, False, True, True, True, True]]
    # all-tie: the pin, then the lowest blocks
    tie = np.ones((1, 10), F32)
    assert candidate_blocks(tie, np.array([10]), 3, 2).tolist() == [[True] * 4 + [False] * 4 + [True] * 2]
    # all -inf: only the pinned block survives; with nothing visible, nothing at all
    ninf = np.full((2, 10), -np.inf, F32)
    got = candidate_blocks(ninf, np.array([5, 0]), 3, 2)
    assert got.tolist() == [[False] * 4 + [True] * 2 + [False] * 4, [False] * 10]
    # more blocks asked for than exist
    assert candidate_blocks(row, np.array([7]), 9, 3).tolist() == [[True] * 7]


def test_select_by_hand() -> None:
    # ratio 2, queries at positions 0..5 of a fresh sequence: visible = 0, 1, 1, 2, 2, 3 of width 3
    score = np.array([[1, 2, 3]] * 6, F32)
    got, _ = select(config(2, 1, 2), role("plain", 2), score, np.arange(6), None)  # type: ignore[arg-type]
    assert got.tolist() == [[-1, -1], [0, -1], [0, -1], [0, 1], [0, 1], [1, 2]]
    # a candidate source keeping one block of 2 (the pinned one), then a user with its own scores:
    # at position 5 (visible 3: block 1 pinned) only position 2 is finite, position 0 and 1 are masked,
    # so the second pick is a filler: the lowest masked position, 0
    _, mask = select(config(2, 1, 2), role("source", 2), score, np.arange(6), None)  # type: ignore[arg-type]
    assert mask is not None
    assert mask[5].tolist() == [False, False, True]
    assert mask[3].tolist() == [True, True, False]
    user = np.array([[9, 8, 7]] * 6, F32)
    got, _ = select(config(2, 1, 2), role("user", 2), user, np.arange(6), mask)  # type: ignore[arg-type]
    assert got[5].tolist() == [0, 2]
    assert got[3].tolist() == [0, 1] and got[0].tolist() == [-1, -1]
    check_stack(score, 0, 2, 2, 1, 2)
    check_stack(user, 0, 2, 2, 1, 2)


@pytest.mark.parametrize("ratio", [1, 2])
def test_crafted_patterns(ratio: int) -> None:
    rng = np.random.default_rng(ratio)
    start, t = 9, 7
    width = (start + t) // ratio
    patterns = {
        "all tie": np.full((t, width), 0.25, F32),
        "all -inf": np.full((t, width), -np.inf, F32),
        "newest lowest": np.tile(np.linspace(9, 0, width, dtype=F32), (t, 1)),  # the pinned block loses
        "few finite": np.where(rng.random((t, width)) < 0.2, rng.standard_normal((t, width)), -np.inf).astype(F32),
        "coarse ties": rng.integers(0, 3, (t, width)).astype(F32),
        "distinct": rng.standard_normal((t, width)).astype(F32),
    }
    for name, score in patterns.items():
        for block in (1, 3, 4, width, width + 2):  # 3 and 4: width not a multiple of the block size
            for topk, topk_blocks in ((1, 1), (3, 2), (4, 1), (width + 3, 9)):
                try:
                    check_stack(score, start, ratio, topk, topk_blocks, block)
                except AssertionError as exc:
                    raise AssertionError(f"{name}, block {block}, topk {topk}/{topk_blocks}: {exc}") from exc


def test_visible_zero_and_first_group() -> None:
    # the first chunk of a ratio-2 layer: position 0 sees nothing, 1 and 2 see group 0
    score = np.array([[4.0], [4.0], [4.0]], F32)
    got, _ = select(config(3, 2, 2), role("source", 2), score, np.arange(3), None)  # type: ignore[arg-type]
    assert got.tolist() == [[-1, -1, -1], [0, -1, -1], [0, -1, -1]]
    check_stack(score, 0, 2, 3, 2, 2)


@st.composite
def patterns(draw: st.DrawFn) -> tuple[np.ndarray, int, int, int, int, int]:
    ratio = draw(st.sampled_from([1, 2]))
    t = draw(st.integers(1, 8))
    start = draw(st.integers(0, 24))
    width = (start + t) // ratio
    if width == 0:
        start += ratio
        width = (start + t) // ratio
    values = st.sampled_from([-np.inf, -1.0, 0.0, 0.5, 1.0, 2.0, 3.5])
    flat = draw(st.lists(values, min_size=t * width, max_size=t * width))
    score = np.array(flat, F32).reshape(t, width)
    return score, start, ratio, draw(st.integers(1, 9)), draw(st.integers(1, 5)), draw(st.integers(1, 6))


@PROPERTY
@given(patterns())
def test_random_patterns(case: tuple[np.ndarray, int, int, int, int, int]) -> None:
    score, start, ratio, topk, topk_blocks, block = case
    check_stack(score, start, ratio, topk, topk_blocks, block)


def test_window_positions() -> None:
    got = window_positions(np.array([0, 3, 9]), 4)
    assert got.tolist() == [[-1, -1, -1, 0], [0, 1, 2, 3], [6, 7, 8, 9]]  # oldest first, -1 before 0


@pytest.mark.parametrize("start,t", [(0, 5), (6, 4), (13, 1), (20, 12)])
def test_entries_name_the_window_positions(start: int, t: int) -> None:
    """Each window entry resolves to the row of the position window_positions names (ring rows
    label the position their slot holds before the chunk, chunk rows their own; the chunk rows'
    capacity above T), then the selection shifted past both."""
    window, cap, k = 8, 12, 3
    positions = np.arange(start, start + t)
    ring_pos = np.full(window, -5)
    for p in range(max(0, start - window), start):
        ring_pos[p % window] = p
    labels = np.concatenate([ring_pos, positions, np.full(cap - t, -9)])
    selection = np.where(np.arange(k)[None, :] < 2, np.arange(t)[:, None] + np.arange(k)[None, :], -1)
    got = build_entries(positions, selection, window, cap)
    win = got[:, :window]
    named = np.where(win >= 0, labels[np.clip(win, 0, None)], -1)
    assert np.array_equal(named, window_positions(positions, window)), "window entries"
    assert np.array_equal(got[:, window:], np.where(selection >= 0, selection + window + cap, -1)), "selected entries"
    assert np.array_equal(build_entries(positions, None, window, cap), got[:, :window]), "without a selection"


# --- sparse attention -----------------------------------------------------------------------------------


def reference_attention(q: np.ndarray, rows: np.ndarray, entries: np.ndarray, sinks: np.ndarray,
                        scale: float) -> tuple[np.ndarray, np.ndarray]:
    """Plain float64 softmax with a sink: (output, the sum of p_j |v_j| / denominator, per value).

    o = sum_j exp(s_j - m) v_j / (sum_j exp(s_j - m) + exp(sink - m)), m = max_j s_j.
    """
    t, h, d = q.shape
    out = np.zeros((t, h, d))
    mag = np.zeros((t, h, d))
    for i in range(t):
        idx = [int(e) for e in entries[i] if e >= 0]
        if not idx:
            continue
        v = rows[idx].astype(np.float64)
        for j in range(h):
            s = v @ q[i, j].astype(np.float64) * scale
            m = s.max()
            p = np.exp(s - m)
            den = p.sum() + math.exp(float(sinks[j]) - m)
            out[i, j] = p @ v / den
            mag[i, j] = p @ np.abs(v) / den
    return out, mag


def attend(q: np.ndarray, rows: np.ndarray, entries: np.ndarray, sinks: np.ndarray, scale: float) -> np.ndarray:
    """sparse_attention over `rows` cut into its three sources (ring, chunk rows, compressed rows):
    laid end to end they are `rows` again, so the entries index them as they index `rows`."""
    n = rows.shape[0]
    return sparse_attention(q, rows[:n // 3], rows[n // 3:2 * n // 3], rows[2 * n // 3:], entries, sinks, scale)


def test_empty_row_gives_zeros() -> None:
    rng = np.random.default_rng(0)
    q = bf16(rng.standard_normal((2, 3, 8)).astype(F32))
    rows = bf16(rng.standard_normal((5, 8)).astype(F32))
    entries = np.array([[-1] * 70, [2] + [-1] * 69])
    sinks = np.array([0.0, 5.0, -3.0], F32)
    out = attend(q, rows, entries, sinks, 8**-0.5)
    assert not np.isnan(out).any()
    assert (out[0] == 0).all()
    assert (out[1] != 0).any()


def test_single_entry_by_hand() -> None:
    # q . k = 2 * 1 = 2, times scale 0.5 = 1: p = exp(1 - 1) = 1, so o = v / (1 + exp(sink - 1))
    q = np.zeros((1, 3, 4), F32)
    q[0, :, 0] = 1.0
    rows = np.array([[0.0] * 4, [2.0, 1.0, -1.0, 0.5]], F32)
    entries = np.array([[-1, 1, -1]])
    sinks = np.array([1.0, -np.inf, 1.0 + math.log(3.0)], F32)
    out = attend(q, rows, entries, sinks, 0.5)
    v = rows[1]
    assert out[0, 0].tolist() == (v / 2).tolist()  # sink 1: exp(0) = 1, denominator 2
    assert out[0, 1].tolist() == v.tolist()  # sink -inf adds nothing
    # sink 1 + ln 3: denominator 1 + 3 (the float32 sink and exp: within a bf16 rounding of v / 4)
    assert np.allclose(out[0, 2], v / 4, rtol=2.0**-8, atol=0)


def test_probabilities_rounded_to_bf16_before_values() -> None:
    # q = e0, rows a = (1, 0, ..) and b = (0.5, 1, ..), scale 0.2: scores 0.2 and 0.1, so p_a = 1 and
    # p_b = exp(-0.1) = 0.904837; bf16(p_b) = 0.90625 (232 steps of 2^-8) multiplies the values, the
    # float32 p_b goes into the denominator 1 + p_b (no sink): o[1] = bf16(0.90625 / 1.904837)
    # = bf16(0.475761) = 0.4765625, where unrounded probabilities would give bf16(0.475021) = 0.474609
    q = np.zeros((1, 1, 4), F32)
    q[0, 0, 0] = 1
    rows = np.array([[1, 0, 0, 0], [0.5, 1, 0, 0]], F32)
    out = attend(q, rows, np.array([[0, 1]]), np.array([-np.inf], F32), 0.2)
    p_b = math.exp(-0.1)
    assert float(bf16(np.array([p_b], F32))[0]) == 0.90625
    assert out[0, 0, 1] == 0.4765625
    assert out[0, 0, 0] == bf16(np.array([(1 + 0.90625 * 0.5) / (1 + p_b)], F32))[0]


def test_trailing_empty_entries_change_nothing() -> None:
    rng = np.random.default_rng(1)
    t, h, d, n = 4, 2, 16, 40
    q = bf16(rng.standard_normal((t, h, d)).astype(F32))
    rows = bf16(rng.standard_normal((n, d)).astype(F32))
    entries = rng.integers(-1, n, (t, 70))
    sinks = rng.standard_normal(h).astype(F32)
    base = attend(q, rows, entries, sinks, d**-0.5)
    for extra in (1, 5, 58, 64, 130):  # within the last block of 64, to its end, into new blocks
        longer = np.concatenate([entries, np.full((t, extra), -1)], axis=1)
        got = attend(q, rows, longer, sinks, d**-0.5)
        assert np.array_equal(got.view(np.uint32), base.view(np.uint32)), f"{extra} trailing -1 entries"
    # but an entry that is not -1 does change it
    more = np.concatenate([entries, np.zeros((t, 1), np.int64)], axis=1)
    assert not np.array_equal(attend(q, rows, more, sinks, d**-0.5), base)


@pytest.mark.parametrize("seed", range(4))
def test_against_float64_softmax(seed: int) -> None:
    """Within the two bf16 roundings the oracle makes: the probabilities (relative error at most
    2^-8 each, so the numerator is off by at most 2^-8 * sum_j p_j |v_j|) and the output (half a bf16
    step, at most 2^-8 of the value); float32 scores and sums add 1e-5 of sum_j p_j |v_j| at most."""
    rng = np.random.default_rng(seed)
    t, h, d, n, e = 5, 3, 32, 300, 200
    q = bf16(rng.standard_normal((t, h, d)).astype(F32))
    rows = bf16(rng.standard_normal((n, d)).astype(F32))
    entries = rng.integers(0, n, (t, e))
    entries[rng.random((t, e)) < 0.3] = -1
    entries[1, :150] = -1  # the first blocks empty, the running max starts late
    entries[2] = np.where(np.arange(e) < 100, entries[2], -1)  # later blocks empty
    if seed % 2:  # scores growing along the row: the running max changes block to block
        q *= 3
        order = np.argsort(rows @ q[0, 0])
        entries[0] = order[np.linspace(0, n - 1, e).astype(int)]
    sinks = (rng.standard_normal(h) * 2).astype(F32)
    scale = d**-0.5
    got = attend(q, rows, entries, sinks, scale)
    assert got.dtype == F32 and (bf16(got) == got).all()
    ref, mag = reference_attention(q, rows, entries, sinks, scale)
    err = np.abs(got.astype(np.float64) - ref)
    bound = 2.0**-8 * mag + 2.0**-8 * np.maximum(np.abs(got), np.abs(ref)) + 1e-5 * mag
    worst = np.unravel_index(int(np.argmax(err - bound)), err.shape)
    assert (err <= bound).all(), (f"worst at {worst}: oracle {got[worst]!r}, float64 {ref[worst]!r}, error "
                                  f"{err[worst]:.3e} > bound {bound[worst]:.3e}")
    # and the bound is not vacuous: the typical error is well inside it
    assert np.median(err / np.maximum(bound, 1e-30)) < 0.5
    assert SPARSE_BLOCK == 64
