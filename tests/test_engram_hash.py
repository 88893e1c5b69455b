"""The engram n-gram hash (host.engram_hash) against an independent scalar formulation.

The scalar hasher below is written from the V4.1 hash's definition with plain Python integers, one position, one
shift and one head at a time: it shares no code with the vectorised oracle hasher (no NumPy
broadcasting, no `blocked` array, no clamped gathers). Both are run on the tiny and small presets'
real tables and on random small tables built with host.engram_tables, over prefill at 0, chunked
prefill from several positions and one-token decode steps, with unmapped raw ids (the stub token
map leaves the last two raw ids unmapped) and masked tokens cutting the look-back.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flashv41 import load_model
from flashv41.host.config import EngramConfig
from flashv41.host.engram_hash import EngramHasher
from flashv41.host.engram_tables import engram_multipliers, engram_offsets, engram_primes, stub_token_map
from flashv41.host.errors import CapacityError, InputError

PROPERTY = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow])


# --- the scalar formulation -------------------------------------------------------------------------


class ScalarHasher:
    """The V4.1 hash one integer at a time: a list of compressed ids (None = never written)."""

    def __init__(self, engram: EngramConfig):
        self.map = [int(v) for v in engram.token_map]
        self.mult = [[int(v) for v in row] for row in engram.multipliers]
        self.primes = engram.primes.tolist()
        self.offsets = engram.offsets.tolist()
        self.n = engram.max_ngram
        self.heads = engram.n_heads
        self.pad = int(engram.pad_id)
        self.history: dict[int, int] = {}

    def put(self, pos: int, raw: int, keep: bool = True) -> None:
        self.history[pos] = self.map[raw] if keep else -1

    def ngram(self, pos: int) -> list[int]:
        """The look-back ids t_0 .. t_{n-1} of position pos, pad from the first blocked shift on."""
        out, blocked = [], False
        for s in range(self.n):
            if pos - s < 0 or self.history[pos - s] == -1:
                blocked = True
            out.append(self.pad if blocked else self.history[pos - s])
        return out

    def rows(self, pos: int) -> list[list[int]]:
        """[layer][(s - 1) * heads + j] row ids of position pos."""
        t = self.ngram(pos)
        result = []
        for layer, mult in enumerate(self.mult):
            rolling = t[0] * mult[0]
            cols = []
            for s in range(1, self.n):
                rolling = rolling ^ (t[s] * mult[s])
                for j in range(self.heads):
                    cols.append(rolling % self.primes[layer][s - 1][j] + self.offsets[layer][s - 1][j])
            result.append(cols)
        return result


def assert_ids_equal(got: np.ndarray, scalar: ScalarHasher, start: int, what: str) -> None:
    want = np.array([scalar.rows(start + i) for i in range(got.shape[0])], dtype=np.int64)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    bad = np.argwhere(got != want)
    if bad.size:
        t, layer, col = (int(v) for v in bad[0])
        raise AssertionError(
            f"{what}: {len(bad)} ids differ; first at position {start + t}, layer {layer}, column {col}: "
            f"got {got[t, layer, col]}, scalar {want[t, layer, col]} (look-back {scalar.ngram(start + t)})"
        )


def run_chunks(engram: EngramConfig, ids: np.ndarray, mask: np.ndarray | None, cuts: list[int],
               max_seq: int) -> tuple[np.ndarray, ScalarHasher]:
    """Hash `ids` in the chunks that `cuts` (sorted split points) make, checking every chunk against
    the scalar hasher; returns all the ids and the scalar hasher."""
    hasher = EngramHasher(engram, max_seq)
    scalar = ScalarHasher(engram)
    bounds = [0, *cuts, ids.size]
    parts = []
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        if a == b:
            continue
        chunk_mask = None if mask is None else mask[a:b]
        got = hasher.hash(ids[a:b], a, chunk_mask)
        for p in range(a, b):
            scalar.put(p, int(ids[p]), True if mask is None else bool(mask[p]))
        assert_ids_equal(got, scalar, a, f"chunk {a}..{b - 1}")
        parts.append(got)
    return np.concatenate(parts), scalar


# --- the presets' tables ------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["tiny", "small"])
def preset_engram(request: pytest.FixtureRequest) -> EngramConfig:
    path: Path = request.getfixturevalue(f"{request.param}_path")
    model = load_model(path)
    engram = model.config.engram
    model.close()
    assert engram is not None
    return engram


def stream(engram: EngramConfig, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Raw ids with unmapped ids and masked tokens sprinkled in, and the mask."""
    vocab = engram.token_map.size
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, size=n)
    unmapped = np.flatnonzero(engram.token_map < 0)
    assert unmapped.size == 2 and unmapped.tolist() == [vocab - 2, vocab - 1], "the stub map's unmapped tail"
    for p, k in ((5, 0), (6, 1), (17, 1), (30, 0)):
        if p < n:
            ids[p] = unmapped[k]
    mask = np.ones(n, bool)
    mask[[p for p in (11, 23, 24, 38) if p < n]] = False
    return ids, mask


def test_blocking_by_hand(preset_engram: EngramConfig) -> None:
    """The look-back rule itself, on a stream whose blocked shifts are written out."""
    e = preset_engram
    vocab = e.token_map.size
    ids = np.array([10, 20, 30, vocab - 1, 40, 50, 60, 70, 80, 90])
    mask = np.ones(ids.size, bool)
    mask[7] = False
    hasher = EngramHasher(e, 32)
    got = hasher.hash(ids, 0, mask)
    scalar = ScalarHasher(e)
    for p, raw in enumerate(ids):
        scalar.put(p, int(raw), bool(mask[p]))
    pad, n = e.pad_id, e.max_ngram
    c = [int(e.token_map[i]) if k else -1 for i, k in zip(ids, mask, strict=True)]
    assert scalar.ngram(0) == [c[0]] + [pad] * (n - 1)  # the sequence start blocks every shift >= 1
    assert scalar.ngram(1) == [c[1], c[0]] + [pad] * (n - 2)
    assert scalar.ngram(3) == [pad] * n  # an unmapped current token blocks everything
    assert scalar.ngram(4) == [c[4]] + [pad] * (n - 1)  # ... and every look-back across it
    assert scalar.ngram(6)[:3] == [c[6], c[5], c[4]]
    assert scalar.ngram(7) == [pad] * n  # a masked token likewise
    assert scalar.ngram(8) == [c[8]] + [pad] * (n - 1)
    assert_ids_equal(got, scalar, 0, "hand stream")
    # the same token in a blocked context and in an open one hashes differently
    assert (got[4] != got[6]).any()
    # every id lands in its own (shift, head) bucket range of the layer's table
    lo = e.offsets.reshape(len(e.layer_ids), -1)
    hi = lo + e.primes.reshape(len(e.layer_ids), -1)
    assert ((got >= lo) & (got < hi)).all()
    assert (got.max(axis=(0, 2)) < np.array(e.table_rows)).all()


def test_prefill_chunks_and_decode(preset_engram: EngramConfig) -> None:
    e = preset_engram
    ids, mask = stream(e, 48, seed=1)
    one_shot, _ = run_chunks(e, ids, mask, [], 64)
    for cuts in ([1], [3, 4, 9], [5, 6, 7, 20, 33], [16, 32], list(range(1, 48, 7))):
        got, _ = run_chunks(e, ids, mask, cuts, 64)
        assert np.array_equal(got, one_shot), f"chunks at {cuts}"
    # prefill then one-token decode steps
    got, _ = run_chunks(e, ids, mask, list(range(30, 48)), 64)
    assert np.array_equal(got, one_shot)
    # without a mask, unmapped ids alone cut the look-back
    got, scalar = run_chunks(e, ids, None, [7, 8, 31], 64)
    assert scalar.ngram(7) == [int(e.token_map[ids[7]])] + [e.pad_id] * (e.max_ngram - 1)
    assert not np.array_equal(got, one_shot)  # the mask mattered


def test_decode_only(preset_engram: EngramConfig) -> None:
    e = preset_engram
    ids, mask = stream(e, 40, seed=2)
    got, _ = run_chunks(e, ids, mask, list(range(1, 40)), 40)
    want, _ = run_chunks(e, ids, mask, [], 40)
    assert np.array_equal(got, want)


# --- random tables and streams --------------------------------------------------------------------


@st.composite
def engram_configs(draw: st.DrawFn, wide: bool = False) -> EngramConfig:
    """Random engram tables: the stub token map of published files and small tables; or, `wide`,
    any token map (unmapped ids anywhere, any pad id) and tables up to 2^46 rows a head, where the
    hash's int64 multiply-add is closest to overflowing."""
    n_layers = draw(st.integers(1, 3))
    layer_ids = tuple(sorted(draw(st.sets(st.integers(0, 60), min_size=n_layers, max_size=n_layers))))
    max_ngram = draw(st.integers(2, 5))
    heads = draw(st.integers(1, 4))
    if wide:
        vocab = draw(st.integers(2, 200))
        compressed = draw(st.integers(1, 150))
        token_map = np.array(draw(st.lists(st.integers(-1, compressed - 1), min_size=vocab, max_size=vocab)),
                             np.int64)
        pad_id = draw(st.integers(0, compressed - 1))
        bucket = draw(st.one_of(st.integers(2, 1000), st.integers(1 << 30, 1 << 46)))
    else:
        vocab = draw(st.integers(4, 300))
        tail = draw(st.integers(0, 3))
        token_map, compressed = stub_token_map(vocab, tail)
        pad_id = int(token_map[draw(st.integers(0, vocab - tail - 1))])
        bucket = draw(st.integers(2, 500))
    primes = engram_primes(n_layers, max_ngram, heads, bucket)
    return EngramConfig(
        layer_ids=layer_ids, n_heads=heads, head_dim=8, max_ngram=max_ngram,
        multipliers=engram_multipliers(layer_ids, max_ngram, compressed), primes=primes,
        offsets=engram_offsets(primes), token_map=token_map, pad_id=pad_id,
        table_rows=tuple(int(primes[i].sum()) for i in range(n_layers)),
    )


@st.composite
def streams(draw: st.DrawFn, engram: EngramConfig) -> tuple[np.ndarray, np.ndarray | None, list[int]]:
    vocab = engram.token_map.size
    n = draw(st.integers(1, 40))
    ids = np.array(draw(st.lists(st.integers(0, vocab - 1), min_size=n, max_size=n)), np.int64)
    mask = None
    if draw(st.booleans()):
        mask = np.array(draw(st.lists(st.booleans(), min_size=n, max_size=n)), bool)
    cuts = sorted(draw(st.sets(st.integers(1, max(1, n - 1)), max_size=8)))
    return ids, mask, [c for c in cuts if c < n]


@PROPERTY
@given(data=st.data())
def test_random_tables_and_streams(data: st.DataObject) -> None:
    e = data.draw(engram_configs())
    ids, mask, cuts = data.draw(streams(e))
    got, _ = run_chunks(e, ids, mask, cuts, 48)
    assert got.shape == (ids.size, len(e.layer_ids), e.cols)
    one_shot, _ = run_chunks(e, ids, mask, [], 48)
    assert np.array_equal(got, one_shot)
    lo = e.offsets.reshape(len(e.layer_ids), -1)
    assert ((got >= lo) & (got < lo + e.primes.reshape(len(e.layer_ids), -1))).all()


def test_primes_offsets_multipliers_by_hand() -> None:
    """The table builders on a case small enough to write out: primes above 9 - 1, never reused."""
    primes = engram_primes(2, 3, 2, 9)
    assert primes.tolist() == [[[11, 13], [17, 19]], [[23, 29], [31, 37]]]
    assert engram_offsets(primes).tolist() == [[[0, 11], [24, 41]], [[0, 23], [52, 83]]]
    m = engram_multipliers((1, 4), 3, 1000)
    assert m.shape == (2, 3) and (m % 2 == 1).all() and (m > 0).all()
    assert int(m.max()) * 999 <= np.iinfo(np.int64).max
    token_map, compressed = stub_token_map(7, 2)
    assert token_map.tolist() == [0, 0, 1, 1, 2, -1, -1] and compressed == 3


# --- validation ------------------------------------------------------------------------------------


def test_validation_leaves_history_untouched(preset_engram: EngramConfig) -> None:
    e = preset_engram
    vocab = e.token_map.size
    ids, mask = stream(e, 20, seed=3)
    hasher = EngramHasher(e, 24)
    scalar = ScalarHasher(e)
    hasher.hash(ids[:12], 0, mask[:12])
    for p in range(12):
        scalar.put(p, int(ids[p]), bool(mask[p]))
    before = hasher.history.copy()
    ok = np.array([3, 4, 5])
    bad_calls = [
        (InputError, "outside the vocabulary", (np.array([3, vocab, 5]), 12, None)),
        (InputError, "outside the vocabulary", (np.array([-1]), 12, None)),
        (InputError, "token_mask", (ok, 12, np.ones(2, bool))),
        (InputError, "token_mask", (ok, 12, np.ones(3, np.int64))),
        (InputError, "token_mask", (ok, 12, np.ones((3, 1), bool))),
        (InputError, "one flat sequence", (np.array([[3, 4]]), 12, None)),
        (InputError, "must be integers", (np.array([3.0, 4.0]), 12, None)),
        (CapacityError, "max_seq 24", (np.arange(13), 12, None)),
        (CapacityError, "max_seq 24", (ok, 22, None)),
        (CapacityError, "max_seq 24", (ok, -1, None)),
    ]
    for kind, words, (bad_ids, start, bad_mask) in bad_calls:
        with pytest.raises(kind, match=words):
            hasher.hash(bad_ids, start, bad_mask)
        assert np.array_equal(hasher.history, before), f"{kind.__name__} {words}: history changed"
    # still usable, and still right: the rest of the stream continues the look-back
    got = hasher.hash(ids[12:], 12, mask[12:])
    for p in range(12, 20):
        scalar.put(p, int(ids[p]), bool(mask[p]))
    assert_ids_equal(got, scalar, 12, "after the errors")
    # the whole capacity is usable: a chunk that ends exactly at max_seq
    assert hasher.hash(ok[:2], 22).shape == (2, len(e.layer_ids), e.cols)
    hasher.reset()
    assert (hasher.history == -1).all()
