"""Sequences a server can branch, rewind and keep: `fork`, `truncate`, `save` / `load_sequence`.

Each claim is held to a sequence that got where it stands the plain way: a fresh sequence that ran
the same tokens in the same calls, whose outputs are compared bit for bit (on a GPU the kernels'
sums depend on a call's token count, so only like with like can be equal: flashv41.sequence_state),
and whose whole state (every layer's ring, partial group and caches, the hash history, the tokens
and calls) is compared array for array, bit for bit, right after the operation.

The model is the six-layer tiny (every block type; window 8, ratio 2), max_tokens 6. The common
prompt P is 11 tokens in two calls, 6 and 5 (one masked token), past the window's wrap and ending
in the middle of a ratio-2 group; X and Y are two continuations of three decode steps.
"""

from __future__ import annotations

import gc
import json
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import flashv41
from flashv41 import sequence_state
from flashv41.host.engram_hash_fast import FastEngramHasher
from flashv41.host.errors import CapacityError, InputError, SequenceFileError, SequenceStateError
from flashv41.host.oracle import Oracle
from flashv41.sequence_file import _digest, model_hash

MAX_SEQ, MAX_TOKENS = 32, 6
IDS = np.random.default_rng(45).integers(0, 128, 40)
P, P_MASK = IDS[:11], np.array([True] * 8 + [False] + [True] * 2)
X, Y, Z = IDS[11:14], IDS[14:17], IDS[17:20]

Snapshot = dict[str, object]


def snapshot(seq: flashv41.Sequence) -> Snapshot:
    """Everything a sequence holds, on the host."""
    return {"position": seq.position, "tokens": seq.tokens.copy(), "state": seq.attention_state(),
            "hashes": seq.hasher.history.copy(), "calls": list(seq.history.calls),
            "mask": seq.history.mask[:seq.position].copy()}


def differences(a: Snapshot, b: Snapshot) -> list[str]:
    """What differs between two snapshots, bit for bit (arrays of engines of other max_seq compared
    over the shorter length, the rest of the longer required zero, or -1 for the hash history)."""
    out = [k for k in ("position", "calls") if a[k] != b[k]]
    out += [k for k in ("tokens", "mask") if not np.array_equal(a[k], b[k])]

    def same(x: np.ndarray, y: np.ndarray, empty: float) -> bool:
        n = min(len(x), len(y))
        tail_x, tail_y = x[n:], y[n:]
        bits = (lambda v: v.view(np.uint32)) if x.dtype == np.float32 else (lambda v: v)
        return (np.array_equal(bits(x[:n]), bits(y[:n])) and (tail_x == empty).all() and (tail_y == empty).all())

    if not same(a["hashes"], b["hashes"], -1):
        out.append("hash history")
    for i, (la, lb) in enumerate(zip(a["state"], b["state"], strict=True)):
        out += [f"layer {i} {name}" for name in la if not same(la[name], lb[name], 0)]
    return out


def assert_same(got: Snapshot, want: Snapshot, what: str) -> None:
    diff = differences(got, want)
    assert not diff, f"{what}: differs in {', '.join(diff)}"


def bits_equal(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def prompt(seq: flashv41.Sequence) -> None:
    """P in its two calls."""
    seq.prefill(P[:6])
    seq.prefill(P[6:], token_mask=P_MASK[6:])


@pytest.fixture(scope="module")
def tiny(synth_model):
    model = flashv41.load_model(synth_model("tiny"))
    engine = flashv41.Engine(model, max_seq=MAX_SEQ, max_tokens=MAX_TOKENS)
    yield model, engine
    engine.close()
    model.close()


@pytest.fixture(scope="module")
def refs(tiny, tmp_path_factory):
    """Two fresh sequences: P then X, and P then Y, decoded one token a call; their states after
    P's first call (s6) and after P (s11), the empty state, and P saved to a file (then X continued
    in place)."""
    _, engine = tiny
    empty = snapshot(engine.new_sequence())
    rx, ry = engine.new_sequence(), engine.new_sequence()
    rx.prefill(P[:6])
    s6 = snapshot(rx)
    rx.prefill(P[6:], token_mask=P_MASK[6:])
    s11 = snapshot(rx)
    saved = tmp_path_factory.mktemp("saved") / "p.npz"
    rx.save(saved)
    out_x = [rx.decode(int(t)) for t in X]
    prompt(ry)
    out_y = [ry.decode(int(t)) for t in Y]
    yield {"empty": empty, "s6": s6, "s11": s11, "x": out_x, "y": out_y, "saved": saved}
    rx.release()
    ry.release()


@pytest.mark.slow
def test_fork_then_both_decode_as_separate_sequences(tiny, refs) -> None:
    """(a) A fork holds the parent's state; the two then step together (decode_batch, bit for bit a
    decode each) with other tokens and give the fresh sequences' outputs. Then both rewind: the
    parent to P from its checkpoint at 6 (P's masked second call run again), the fork to P from the
    checkpoint it took at the fork point (a copy, nothing run) and to 6 from the start (no
    checkpoint of its own there: its first call run again), the parent to 6 and to 0."""
    _, engine = tiny
    a = engine.new_sequence()
    prompt(a)
    b = a.fork()
    assert_same(snapshot(b), refs["s11"], "the fork")
    assert_same(snapshot(a), refs["s11"], "the parent after the fork")
    assert [c.position for c in b.checkpoints.slots] == [11]
    for i, (x, y) in enumerate(zip(X, Y, strict=True)):
        out = engine.decode_batch([a, b], [x, y])
        assert bits_equal(out[:1], refs["x"][i]), f"parent, step {i}"
        assert bits_equal(out[1:], refs["y"][i]), f"fork, step {i}"
    assert a.tokens.tolist() == [*P, *X] and b.tokens.tolist() == [*P, *Y]
    a.truncate(11)
    assert_same(snapshot(a), refs["s11"], "the parent truncated to 11")
    b.truncate(11)
    assert_same(snapshot(b), refs["s11"], "the fork truncated to its fork point")
    b.truncate(6)
    assert_same(snapshot(b), refs["s6"], "the fork truncated below its fork point")
    a.truncate(6)
    assert_same(snapshot(a), refs["s6"], "the parent truncated to its checkpoint")
    a.truncate(0)
    assert_same(snapshot(a), refs["empty"], "the parent truncated to 0")
    a.release()
    b.release()


@pytest.mark.slow
def test_truncate_then_other_tokens_as_a_fresh_prefill(tiny, refs) -> None:
    """(b) P's first call, then a call of P's last five and one more token, then two decode steps
    (position 14: three ring slots of positions 3..5 overwritten, groups 5 and 6 completed, the
    hash history written): truncated to 11, the sequence is P run in its two calls, and goes on
    with X as the fresh sequence does."""
    _, engine = tiny
    u = engine.new_sequence()
    u.prefill(P[:6])
    u.prefill(np.r_[P[6:], Z[:1]], token_mask=np.r_[P_MASK[6:], True])
    for t in Z[1:]:
        u.decode(int(t))
    assert u.position == 14 and differences(snapshot(u), refs["s11"])
    u.truncate(11)
    assert_same(snapshot(u), refs["s11"], "truncated to 11")
    for i, t in enumerate(X):
        assert bits_equal(u.decode(int(t)), refs["x"][i]), f"decode step {i} after the truncate"
    u.release()


@pytest.mark.slow
def test_save_load_then_continue_as_in_place(tiny, refs) -> None:
    """(c) P saved, loaded into a new engine and continued with X: as P continued in place. Loaded
    into an engine of smaller max_seq (16, which holds P's 11 positions) too, for one step."""
    model, _ = tiny
    with flashv41.Engine(model, max_seq=MAX_SEQ, max_tokens=MAX_TOKENS) as other:
        seq = other.load_sequence(refs["saved"])
        assert_same(snapshot(seq), refs["s11"], "loaded")
        for i, t in enumerate(X):
            assert bits_equal(seq.decode(int(t)), refs["x"][i]), f"decode step {i} after the load"
    with flashv41.Engine(model, max_seq=16, max_tokens=MAX_TOKENS) as small:
        seq = small.load_sequence(refs["saved"])
        assert_same(snapshot(seq), refs["s11"], "loaded into max_seq 16")
        assert bits_equal(seq.decode(int(X[0])), refs["x"][0])


MUTANTS: dict[str, Callable[[pytest.MonkeyPatch], None]] = {
    "rings not restored": lambda mp: mp.setattr(sequence_state.Checkpoint, "restore", restore_partial_only),
    "partial groups not restored": lambda mp: mp.setattr(sequence_state.Checkpoint, "restore", restore_rings_only),
    "cache rows kept": lambda mp: mp.setattr(sequence_state, "clear_groups", lambda *a: None),
    "hash history kept": lambda mp: mp.setattr(FastEngramHasher, "rewind", lambda self, position: None),
}
WHERE = {"rings not restored": "window_ring", "partial groups not restored": "kv_state",
         "cache rows kept": "compressed", "hash history kept": "hash history"}


def restore_rings_only(self, state, stream) -> None:
    for i, layer in enumerate(state.layers):
        layer.ring.copy_to_device(self.rings[i], stream=stream)


def restore_partial_only(self, state, stream) -> None:
    for i, (kv, score) in self.partial.items():
        state.layers[i].source.kv_state.copy_to_device(kv, stream=stream)
        state.layers[i].source.score_state.copy_to_device(score, stream=stream)


@pytest.fixture(scope="module")
def short(tiny, tmp_path_factory):
    """A sequence of three tokens in one call, saved (what the quick tests read and refuse)."""
    _, engine = tiny
    seq = engine.new_sequence()
    seq.prefill(P[:3])
    path = tmp_path_factory.mktemp("short") / "short.npz"
    seq.save(path)
    yield seq, path
    seq.release()


@pytest.fixture(scope="module")
def at_p(tiny):
    _, engine = tiny
    seq = engine.new_sequence()
    prompt(seq)
    yield seq
    seq.release()


@pytest.mark.slow
@pytest.mark.parametrize("mutant", [None, *MUTANTS])
def test_the_comparison_catches_a_truncate_that_forgets_a_piece(tiny, refs, at_p, mutant, monkeypatch) -> None:
    """A fork of P runs Z in one call (from its fork-point checkpoint: three ring slots, both
    partial groups, cache rows of groups 5 and 6, three hash positions written) and truncates back
    to 11, a copy only. Right, it is P; with any one piece left out of the rewind, the comparison
    names that piece."""
    seq = at_p.fork()
    seq.prefill(Z)
    if mutant is not None:
        MUTANTS[mutant](monkeypatch)
    seq.truncate(11)
    monkeypatch.undo()
    diff = differences(snapshot(seq), refs["s11"])
    if mutant is None:
        assert not diff, diff
    else:
        assert any(WHERE[mutant] in d for d in diff), f"{mutant}: found only {diff}"
    seq.release()


# refusals: (d)


def full_snapshot(seq: flashv41.Sequence) -> Snapshot:
    return {**snapshot(seq), "checkpoints": [c.position for c in seq.checkpoints.slots],
            "ids": seq.history.ids.copy()}


@pytest.mark.slow
def test_refused_calls_leave_the_sequence_untouched(tiny, at_p) -> None:
    """A truncate past the position or of a non-integer, and every call on a released or failed
    sequence, is a named error; the sequence is as it was."""
    _, engine = tiny
    seq = at_p.fork()
    before = full_snapshot(seq)
    for n, words in ((12, "holds 11 tokens (0..11)"), (-1, "cannot truncate to -1"), (2.0, "got float 2.0"),
                     (True, "got bool True"), ("3", "got str '3'"), (None, "got NoneType")):
        with pytest.raises(InputError, match=words.replace("(", r"\(").replace(")", r"\)")):
            seq.truncate(n)  # type: ignore[arg-type]
        after = full_snapshot(seq)
        assert not differences(after, before) and after["checkpoints"] == before["checkpoints"], n
    seq.truncate(11)  # the position itself: nothing to do
    assert not differences(full_snapshot(seq), before)
    seq.failed = True
    for call in (lambda: seq.truncate(3), seq.fork, lambda: seq.save("never.npz")):
        with pytest.raises(SequenceStateError, match="failed in the middle of a call"):
            call()
    seq.failed = False
    assert not differences(full_snapshot(seq), before) and not Path("never.npz").exists()
    seq.release()
    for call in (lambda: seq.truncate(3), seq.fork, lambda: seq.save("never.npz")):
        with pytest.raises(SequenceStateError, match="released"):
            call()
    with pytest.raises(InputError, match="checkpoints must be an integer of at least 0"):
        engine.new_sequence(checkpoints=-1)


@pytest.mark.slow
def test_prefill_of_the_last_row_only(tiny) -> None:
    """output="last": a call of 11 tokens over chunks of 6 returns the last token's highway, bit for
    bit the last row of what output="all" returns, and leaves the same state (the decode after it
    agrees too); any other output is refused by name, with the sequence untouched."""
    _, engine = tiny
    a, b = engine.new_sequence(), engine.new_sequence()
    full = a.prefill(P, token_mask=P_MASK)
    last = b.prefill(P, token_mask=P_MASK, output="last")
    assert full.shape[0] == P.size and last.shape == (1, *full.shape[1:]) and bits_equal(last, full[-1:])
    assert_same(snapshot(b), snapshot(a), "after output='last'")
    before = full_snapshot(b)
    for bad in ("first", None, 1):
        with pytest.raises(InputError, match="prefill's output must be one of 'all', 'last', got"):
            b.prefill(X, output=bad)  # type: ignore[arg-type]
    assert not differences(full_snapshot(b), before)
    assert bits_equal(b.decode(int(X[0])), a.decode(int(X[0])))
    a.release()
    b.release()


def test_oracle_prefill_of_the_last_row_only(tiny) -> None:
    model, _ = tiny
    oracle = Oracle(model, max_seq=MAX_SEQ)
    a, b = oracle.new_sequence(), oracle.new_sequence()
    full = a.prefill(P[:4])
    last = b.prefill(P[:4], output="last")
    assert last.shape == (1, *full.shape[1:]) and bits_equal(last, full[-1:]) and b.position == 4
    with pytest.raises(InputError, match="prefill's output must be one of"):
        b.prefill(P[4:6], output="every")
    assert b.position == 4


def live_sequences(engine: flashv41.Engine) -> int:
    gc.collect()
    return len([s for s in engine._sequences if not s.released])


def rewrite(src: Path, dst: Path, change: Callable[[dict], None], redigest: bool = True) -> Path:
    """A copy of a saved file with its arrays changed by `change` (header as a dict under
    "header"), its digest recomputed unless told not to: a consistent file with one thing wrong."""
    with np.load(src) as npz:
        arrays = {name: npz[name] for name in npz.files}
    header = json.loads(arrays.pop("header").tobytes())
    arrays["header"] = header
    change(arrays)
    header = arrays.pop("header")
    if redigest:
        header["digest"] = _digest(arrays)
    with open(dst, "wb") as f:
        np.savez(f, header=np.frombuffer(json.dumps(header).encode(), np.uint8), **arrays)
    return dst


def test_refused_files_load_nothing(tiny, short, synth_model, tmp_path: Path) -> None:
    """(d) Every refused file names its error and leaves the engine without a new sequence."""
    model, engine = tiny
    good = short[1]
    data = good.read_bytes()
    files: list[tuple[str, Path, type, str]] = []

    def add(what: str, name: str, content: bytes | Path, error: type, words: str) -> None:
        path = content if isinstance(content, Path) else tmp_path / name
        if isinstance(content, bytes):
            path.write_bytes(content)
        files.append((what, path, error, words))

    add("absent", "absent.npz", tmp_path / "absent.npz", SequenceFileError, "no such file")
    add("text", "text.npz", b"hello, not a sequence\n", SequenceFileError, "not a flashv41 sequence file")
    np.save(tmp_path / "bare.npy", np.arange(3))
    add("a bare .npy", "bare.npy", tmp_path / "bare.npy", SequenceFileError, "a bare .npy array")
    add("cut short", "cut.npz", data[:len(data) // 2], SequenceFileError, "damaged")
    flipped = bytearray(data)
    at = data.index(b"rings.npy") + 400  # inside the rings' bytes (6 KiB), past the member's headers
    flipped[at] ^= 0x10
    add("one byte flipped", "flipped.npz", bytes(flipped), SequenceFileError, "damaged")

    def bump(name: str, key: str, value: object) -> Callable[[dict], None]:
        return lambda arrays: arrays[name].__setitem__(key, value)

    def edit(name: str, fn: Callable[[np.ndarray], np.ndarray]) -> Callable[[dict], None]:
        return lambda arrays: arrays.__setitem__(name, fn(arrays[name]))

    for what, change, redigest, error, words in [
        ("a ring changed, old digest", edit("rings", lambda a: a + 1), False, SequenceFileError,
         "do not match the digest"),
        ("format version 2", bump("header", "version", 2), True, SequenceFileError, "format version 2"),
        ("another model's hash", bump("header", "model", "0" * 64), True, SequenceFileError, "another model"),
        ("no position", bump("header", "position", "3"), True, SequenceFileError, "position is '3'"),
        ("a ring row short", edit("rings", lambda a: a[:, 1:]), True, SequenceFileError, "rings is uint16"),
        ("cache rows short", edit("layer3.compressed", lambda a: a[1:]), True, SequenceFileError,
         "layer3.compressed is"),
        ("an array missing", lambda arrays: arrays.pop("layer3.index_keys"), True, SequenceFileError,
         "missing or unexpected"),
        ("a token past the vocabulary", edit("tokens", lambda a: a + 1000), True, SequenceFileError,
         "outside the vocabulary"),
        ("calls with a gap", edit("calls", lambda a: a + [[1, -1, 0]]), True, SequenceFileError,
         "do not tile"),
    ]:
        add(what, "", rewrite(good, tmp_path / f"{len(files)}.npz", change, redigest), error, words)

    other_model = flashv41.load_model(synth_model("tiny", seed=1))
    with flashv41.Engine(other_model, max_seq=MAX_SEQ, max_tokens=MAX_TOKENS) as other:
        assert other.model_hash() != engine.model_hash()
        other.new_sequence().save(tmp_path / "other.npz")
    other_model.close()
    add("another model's file", "", tmp_path / "other.npz", SequenceFileError, "saved from another model")

    before = live_sequences(engine)
    for what, path, error, words in files:
        with pytest.raises(error) as caught:
            engine.load_sequence(path)
        assert type(caught.value) is error and words in str(caught.value), f"{what}: {caught.value!r}"
        assert live_sequences(engine) == before, f"{what}: a sequence was left behind"

    with flashv41.Engine(model, max_seq=2, max_tokens=MAX_TOKENS) as small:
        with pytest.raises(CapacityError, match="holds 3 positions, past this engine's max_seq 2"):
            small.load_sequence(good)
        assert live_sequences(small) == 0
    closed = flashv41.Engine(model, max_seq=MAX_SEQ, max_tokens=MAX_TOKENS)
    closed.close()
    with pytest.raises(SequenceStateError, match="engine was closed"):
        closed.load_sequence(good)


def test_a_save_is_whole_or_absent(short, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A save that fails midway leaves no file, nor a partial one beside it, and an older file at
    the path as it was; the file is an ordinary zip of .npy arrays with a JSON header."""
    target = tmp_path / "seq.npz"
    target.write_bytes(b"older")

    def failing(f, **arrays):
        f.write(b"PK half")
        raise OSError("disk full")

    monkeypatch.setattr(np, "savez", failing)
    seq = short[0]
    with pytest.raises(OSError, match="disk full"):
        seq.save(target)
    monkeypatch.undo()
    assert target.read_bytes() == b"older" and [p.name for p in tmp_path.iterdir()] == ["seq.npz"]
    seq.save(target)
    with zipfile.ZipFile(target) as z:
        assert z.testzip() is None and "header.npy" in z.namelist()
    with np.load(target) as npz:
        header = json.loads(npz["header"].tobytes())
        assert (header["format"], header["version"], header["position"]) == ("flashv41-sequence", 1, 3)
        assert npz["tokens"].tolist() == P[:3].tolist() and npz["calls"].tolist() == [[0, 3, 0]]
        assert npz["layer1.compressed"].shape == (1, 64) and npz["layer3.index_keys"].shape == (3, 32)


def test_the_model_hash_tells_models_apart(synth_model, tmp_path: Path) -> None:
    """Same bytes elsewhere: the same hash; another seed (same metadata and tensor infos, other
    weights) or another weight type: another."""
    path = synth_model("tiny")
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(path.read_bytes())
    hashes = []
    for p in (path, copy, synth_model("tiny", seed=1), synth_model("tiny", weight_type="BF16")):
        with flashv41.load_model(p) as m:
            hashes.append(model_hash(m))
    assert hashes[0] == hashes[1] and len(set(hashes)) == 3


def test_position_and_tokens_are_read_only(tiny) -> None:
    _, engine = tiny
    seq = engine.new_sequence()
    with pytest.raises(AttributeError):
        seq.position = 3  # type: ignore[misc]
    tokens = seq.tokens
    assert tokens.shape == (0,) and tokens.dtype == np.int64 and not tokens.flags.writeable
    seq.release()
