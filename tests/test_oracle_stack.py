"""The oracle's layer stack on the tiny and small presets: every block type, and outputs that do not
depend on how a sequence is fed.

Every position's output must not depend on how the sequence was chunked; in the oracle
that is exact. So chunked prefill, decode after prefill and decode-only runs are compared with one-shot
prefill bit for bit (float32 viewed as uint32), the final highway and every layer's captured
intermediates alike, over sequences of 3-4 windows (the window ring wraps several times, the ratio-2
compressor closes many groups and leaves a partial one at the end). A third model, tiny with a wide
window (48 + top-24 = 72 attended rows), makes the sparse attention's blocks of 64 matter: there the
bf16 probabilities depend on the row order, which the oracle keeps canonical. Then: independent
sequences, reset, token_mask (gate 0, look-back cut) and the errors, which must leave a sequence
usable.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from flashv41 import load_model
from flashv41.host.errors import CapacityError, InputError, SequenceStateError
from flashv41.host.model import Model
from flashv41.host.oracle import Oracle, OracleSequence
from flashv41.host.oracle.attention import SPARSE_BLOCK

BLOCK_TYPES = ["swa", "kv_index_source_r2", "consumer_r2", "candidate_source_r1", "consumer_r1",
               "candidate_index_source_r1"]
# captures with one row per compressed group, not per token; and those [T, width] whose width grows
# with the chunk's end (compared on the columns both runs have)
PER_GROUP = ("latents", "groups")
PER_WIDTH = ("index_score", "candidates")


@dataclass
class Case:
    name: str
    model: Model
    oracle: Oracle
    length: int  # 3-4 windows, odd: the last ratio-2 group stays open
    chunk_sizes: tuple[int, ...]
    decode_after: tuple[int, ...]  # prefill this many tokens, then decode the rest one by one
    tokens: np.ndarray

    @property
    def window(self) -> int:
        return self.model.config.window


@pytest.fixture(scope="module", params=["tiny", "small", "wide"])
def case(request: pytest.FixtureRequest) -> Iterator[Case]:
    if request.param == "wide":
        path: Path = request.getfixturevalue("synth_model")("tiny", window=48, index_topk=24)
    else:
        path = request.getfixturevalue(f"{request.param}_path")
    model = load_model(path)
    cfg = model.config
    if request.param == "tiny":
        length, chunks, decode_after = 4 * cfg.window - 3, (1, 2, 3, 5, 7, 16), (1, 2, 5, 8)
    elif request.param == "small":
        length, chunks, decode_after = 3 * cfg.window + 7, (1, 3, 16, 17), (3, 10)
    else:
        length, chunks, decode_after = 3 * cfg.window + 5, (1, 13, 64), ()  # chunks of 1 decode from 0
    rng = np.random.default_rng(41)
    tokens = rng.integers(0, cfg.vocab_size, size=length)
    tokens[[4, 13]] = cfg.vocab_size - 1  # an unmapped raw id (the stub map's tail): cuts the look-back
    tokens[9] = tokens[0]
    yield Case(request.param, model, Oracle(model), length, chunks, decode_after, tokens)
    model.close()


def bits(x: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(x)
    if a.dtype == np.float32:
        return a.view(np.uint32)
    return a


def assert_identical(got: np.ndarray, want: np.ndarray, what: str) -> None:
    """Bitwise equal; on failure, the first differing element and the largest difference."""
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    diff = bits(got) != bits(want)
    if diff.any():
        first = tuple(int(i) for i in np.argwhere(diff)[0])
        d = np.abs(got.astype(np.float64) - want.astype(np.float64))
        worst = np.unravel_index(int(np.nanargmax(np.where(diff, d, -1))), d.shape)
        raise AssertionError(
            f"{what}: {int(diff.sum())} of {diff.size} elements differ; first at {first}: got {got[first]!r}, "
            f"want {want[first]!r}; largest difference {d[worst]:.3e} at {tuple(int(i) for i in worst)}"
        )


@dataclass
class Run:
    """What a run produced: the final highway [T, hc, C] and, per layer, each capture over the whole
    sequence (per-token captures stacked along tokens; per-width ones as a list of rows)."""

    h: np.ndarray
    layers: list[dict[str, object]]


def run(seq: OracleSequence, tokens: np.ndarray, sizes: list[int], mask: np.ndarray | None = None) -> Run:
    """Feed `tokens` in chunks of the given sizes (a chunk of 1 goes through decode)."""
    assert sum(sizes) == tokens.size
    outs: list[np.ndarray] = []
    caps: list[list[dict]] = []
    start = 0
    for n in sizes:
        m = None if mask is None else mask[start:start + n]
        if n == 1:
            outs.append(seq.decode(int(tokens[start]), None if m is None else bool(m[0]), capture=True))
        else:
            outs.append(seq.prefill(tokens[start:start + n], m, capture=True))
        caps.append(seq.captures)
        start += n
    layers: list[dict[str, object]] = []
    for i in range(len(caps[0])):
        merged: dict[str, object] = {}
        keys = set().union(*(c[i].keys() for c in caps))
        for key in sorted(keys):
            if key in PER_WIDTH:
                rows: list[np.ndarray | None] = []
                for c, n in zip(caps, sizes, strict=True):
                    rows.extend(list(c[i][key]) if key in c[i] else [None] * n)
                merged[key] = rows
            else:
                merged[key] = np.concatenate([c[i][key] for c in caps if key in c[i]], axis=0)
        layers.append(merged)
    return Run(np.concatenate(outs, axis=0), layers)


def assert_runs_identical(got: Run, want: Run, what: str) -> None:
    assert_identical(got.h, want.h, f"{what}: final highway")
    assert len(got.layers) == len(want.layers)
    for i, (g, w) in enumerate(zip(got.layers, want.layers, strict=True)):
        assert set(g) == set(w), f"{what}: layer {i} captures {sorted(g)} != {sorted(w)}"
        for key in g:
            gv, wv = g[key], w[key]
            if key in PER_WIDTH:
                assert isinstance(gv, list) and isinstance(wv, list)
                for t, (a, b) in enumerate(zip(gv, wv, strict=True)):
                    if a is None or b is None:  # no group complete yet in that chunk: nothing scored
                        continue
                    n = min(a.size, b.size)
                    assert_identical(a[:n], b[:n], f"{what}: layer {i} {key} of position {t}")
            else:
                assert isinstance(gv, np.ndarray) and isinstance(wv, np.ndarray)
                assert_identical(gv, wv, f"{what}: layer {i} {key}")


def sizes_of(length: int, chunk: int, first: int = 0) -> list[int]:
    """`first` tokens, then chunks of `chunk` (the last one shorter)."""
    out = [first] if first else []
    rest = length - first
    out += [chunk] * (rest // chunk) + ([rest % chunk] if rest % chunk else [])
    return out


_ONE_SHOT: dict[str, Run] = {}


def one_shot(case: Case) -> Run:
    if case.name not in _ONE_SHOT:
        _ONE_SHOT[case.name] = run(case.oracle.new_sequence(), case.tokens, [case.length])
    return _ONE_SHOT[case.name]


# --- the model ------------------------------------------------------------------------------------------


def test_every_block_type(case: Case) -> None:
    cfg = case.model.config
    assert [r.block_type for r in cfg.roles] == BLOCK_TYPES
    by_type = {r.block_type: r for r in cfg.roles}
    assert by_type["kv_index_source_r2"].kv_source and by_type["kv_index_source_r2"].index_source
    assert not by_type["consumer_r2"].index_source and not by_type["consumer_r1"].index_source
    assert by_type["candidate_source_r1"].candidate_source and by_type["candidate_source_r1"].kv_source
    assert by_type["candidate_index_source_r1"].uses_candidates
    assert cfg.engram is not None and [r.layer for r in cfg.roles if r.engram] == list(cfg.engram.layer_ids)
    assert {cfg.roles[i].block_type for i in cfg.engram.layer_ids} == {"swa", "kv_index_source_r2"}
    # the sequences below cross the window ring several times and close many ratio-2 groups
    assert 3 * case.window <= case.length <= 4 * case.window and case.length % 2 == 1
    if case.name == "wide":
        assert cfg.window + cfg.index_topk > SPARSE_BLOCK


def test_one_shot_is_nontrivial(case: Case) -> None:
    """The comparisons below would be weak on a degenerate run: check the run exercises everything."""
    r = one_shot(case)
    cfg = case.model.config
    assert np.isfinite(r.h).all() and r.h.std() > 0
    k = cfg.index_topk
    for layer in (1, 3, 5):  # index sources: full selections reaching behind the window
        sel = r.layers[layer]["selection"]
        assert isinstance(sel, np.ndarray) and sel.shape == (case.length, k)
        ratio = cfg.roles[layer].ratio
        p = case.length - 1
        assert (sel[-1] >= 0).all() and (sel[-1] * ratio < p - case.window + 1).any(), sel[-1]
    cand = r.layers[3]["candidates"]
    assert isinstance(cand, list) and not cand[-1].all() and cand[-1].any()  # the mask does cut
    groups = r.layers[1]["groups"]
    assert isinstance(groups, np.ndarray) and groups.tolist() == list(range(case.length // 2))
    gate = r.layers[0]["engram_gate"]
    assert isinstance(gate, np.ndarray) and (gate > 0).all() and (gate < 1).all()


# --- chunking ---------------------------------------------------------------------------------------------


def test_chunked_prefill_identical(case: Case) -> None:
    want = one_shot(case)
    for chunk in case.chunk_sizes:
        got = run(case.oracle.new_sequence(), case.tokens, sizes_of(case.length, chunk))
        assert_runs_identical(got, want, f"{case.name}, chunks of {chunk}")


def test_uneven_chunks_identical(case: Case) -> None:
    want = one_shot(case)
    rng = np.random.default_rng(3)
    sizes: list[int] = []
    while sum(sizes) < case.length:
        sizes.append(int(min(rng.integers(1, 2 * case.window), case.length - sum(sizes))))
    got = run(case.oracle.new_sequence(), case.tokens, sizes)
    assert_runs_identical(got, want, f"{case.name}, chunks {sizes}")


def test_decode_after_prefill_identical(case: Case) -> None:
    """Prefill a few tokens (odd and even: the compressor's open group), then decode one by one past
    several window wraps."""
    want = one_shot(case)
    for prefix in case.decode_after:
        got = run(case.oracle.new_sequence(), case.tokens, sizes_of(case.length, 1, prefix))
        assert_runs_identical(got, want, f"{case.name}, prefill {prefix} then decode")


def test_sequences_independent(case: Case) -> None:
    """Two sequences of one oracle, interleaved, with different tokens: each as if alone."""
    other_tokens = np.random.default_rng(5).integers(0, case.model.config.vocab_size, case.length)
    alone = run(case.oracle.new_sequence(), other_tokens, [case.length])
    a, b = case.oracle.new_sequence(), case.oracle.new_sequence()
    sizes_a = sizes_of(case.length, 3)
    sizes_b = sizes_of(case.length, 5, 2)
    outs_a, outs_b = [], []
    pa = pb = 0
    for i in range(max(len(sizes_a), len(sizes_b))):
        if i < len(sizes_b):
            outs_b.append(b.prefill(other_tokens[pb:pb + sizes_b[i]]))
            pb += sizes_b[i]
        if i < len(sizes_a):
            outs_a.append(a.prefill(case.tokens[pa:pa + sizes_a[i]]))
            pa += sizes_a[i]
    assert_identical(np.concatenate(outs_a), one_shot(case).h, f"{case.name}: sequence A interleaved")
    assert_identical(np.concatenate(outs_b), alone.h, f"{case.name}: sequence B interleaved")
    assert a.position == b.position == case.length


def test_reset(case: Case) -> None:
    seq = case.oracle.new_sequence()
    n = 2 * case.window + 1
    first = seq.prefill(case.tokens[:n])
    seq.decode(int(case.tokens[n]))
    seq.reset()
    assert seq.position == 0
    again = run(seq, case.tokens, sizes_of(case.length, 7))
    assert_runs_identical(again, one_shot(case), f"{case.name}: after reset")
    assert_identical(again.h[:n], first, f"{case.name}: first run vs after reset")


# --- token_mask ---------------------------------------------------------------------------------------


def test_token_mask(case: Case) -> None:
    cfg = case.model.config
    assert cfg.engram is not None
    mask = np.ones(case.length, bool)
    masked = [7, 8, 20]
    mask[masked] = False
    tokens = case.tokens.copy()
    tokens[[6, 7, 8, 19, 20]] = [40, 42, 44, 46, 48]  # mapped ids: here only the mask cuts the look-back
    tokens[21] = tokens[0]  # after a masked token the look-back is cut, as at the sequence start
    tokens[9] = tokens[0]
    whole = run(case.oracle.new_sequence(), tokens, [case.length], mask)
    unmasked = run(case.oracle.new_sequence(), tokens, [case.length])
    for layer in cfg.engram.layer_ids:
        cap = whole.layers[layer]
        gate, ids = cap["engram_gate"], cap["engram_ids"]
        assert isinstance(gate, np.ndarray) and isinstance(ids, np.ndarray)
        assert (gate[masked] == 0).all(), f"layer {layer}: masked tokens' gates {gate[masked]}"
        assert (np.delete(gate, masked, axis=0) > 0).all()
        # the n-grams through a masked token: positions 9 and 21 hash like position 0 (every shift
        # >= 1 padded), which they do not without the mask
        for p in (9, 21):
            assert_identical(ids[p], ids[0], f"layer {layer}: ids of position {p} vs 0")
            other = unmasked.layers[layer]["engram_ids"]
            assert isinstance(other, np.ndarray) and not np.array_equal(other[p], other[0])
        # a masked token's own ids are those of an all-pad n-gram: equal for all masked positions
        assert_identical(ids[8], ids[7], f"layer {layer}: ids of two masked positions")
    # causal: everything before the first masked token is untouched by the mask, the rest is not
    assert_identical(whole.h[:7], unmasked.h[:7], f"{case.name}: before the mask")
    assert not np.array_equal(whole.h[7], unmasked.h[7])
    # and masked runs are chunk-invariant too, decode steps included
    for sizes in (sizes_of(case.length, 3), sizes_of(case.length, 1, case.length - case.window - 1)):
        got = run(case.oracle.new_sequence(), tokens, sizes, mask)
        assert_runs_identical(got, whole, f"{case.name}: masked, chunks {sizes[:3]}...")


# --- errors --------------------------------------------------------------------------------------------


def test_errors_leave_the_sequence_usable(case: Case) -> None:
    cfg = case.model.config
    vocab = cfg.vocab_size
    n = case.window + 3
    seq = case.oracle.new_sequence(max_seq=case.length)
    head = seq.prefill(case.tokens[:n])
    bad_calls = [
        (InputError, "outside the vocabulary", lambda: seq.prefill(np.array([1, vocab, 2]))),
        (InputError, "outside the vocabulary", lambda: seq.prefill(np.array([-1]))),
        (InputError, "outside the vocabulary", lambda: seq.decode(vocab)),
        (InputError, "must be integers", lambda: seq.prefill(np.array([1.0, 2.0]))),
        (InputError, "one flat sequence", lambda: seq.prefill(np.array([[1, 2]]))),
        (InputError, "no token ids", lambda: seq.prefill(np.array([], np.int64))),
        (InputError, "outside the vocabulary", lambda: seq.decode(2**70)),
        (InputError, "one integer token", lambda: seq.decode(1.5)),  # type: ignore[arg-type]
        (InputError, "token_mask", lambda: seq.prefill(np.array([1, 2]), np.array([True]))),
        (InputError, "token_mask", lambda: seq.prefill(np.array([1, 2]), np.array([1, 0]))),
        (CapacityError, "max_seq", lambda: seq.prefill(case.tokens[: case.length - n + 1])),
        (CapacityError, "max_seq", lambda: case.oracle.new_sequence(max_seq=case.oracle.max_seq + 1)),
    ]
    for kind, words, call in bad_calls:
        with pytest.raises(kind, match=words):
            call()
        assert seq.position == n, f"{kind.__name__} {words}: position moved to {seq.position}"
    # still usable, and still exact: the rest of the sequence as if nothing had happened
    rest = run(seq, case.tokens[n:], sizes_of(case.length - n, 4))
    assert_identical(np.concatenate([head, rest.h]), one_shot(case).h, f"{case.name}: after the errors")
    assert seq.position == case.length  # exactly full: max_seq is usable to the last position
    with pytest.raises(CapacityError):
        seq.decode(1)
    seq.release()
    for call in (lambda: seq.decode(1), lambda: seq.prefill(case.tokens[:2])):
        with pytest.raises(SequenceStateError, match="released"):
            call()
    # the oracle itself is unaffected
    again = case.oracle.new_sequence().prefill(case.tokens[:n])
    assert_identical(again, head, f"{case.name}: a new sequence after release")
