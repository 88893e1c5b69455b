"""Bad input through the Engine API, failures in the middle of a call, use after release and close.

Every bad call must raise a flashv41 error that names the cause, before anything is written: the
sequence's position, attention state and hash history are checked unchanged after each one. Then
the sequence continues, and its results must be what a sequence that never saw the bad calls
computes, bit for bit, and agree with the oracle layer by layer. A second live sequence on the same
engine, interleaved with the failing calls, and a sequence on a second engine run the same calls:
they must agree bit for bit (so also: the engine is deterministic run to run). Host-resident
engram tables must give the same results too.

The model is tests/reliability.py's two-layer tiny (simulator cost). An unmapped raw id (the token
map gives -1) is not an error: it blocks the n-gram look-back like a masked token, but unlike a
masked token it keeps its engram contribution (the all-pad n-gram's rows, gate > 0).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

import flashv41
from flashv41.check import compare_call, synced_oracle
from flashv41.host.errors import CapacityError, FlashError, InputError, SequenceStateError
from flashv41.host.oracle import Oracle
from tests.reliability import TWO_LAYER_TINY, UNMAPPED

MAX_SEQ, MAX_TOKENS, VOCAB = 8, 3, 128
# the stream every sequence runs: prefill 3 (an unmapped id inside), decode an unmapped id, prefill
# 3 with a masked token, decode the last position
STREAM = np.array([17, UNMAPPED[0], 40, UNMAPPED[1], 9, 33, 101, 64])
MASK = np.array([True, True, True, True, True, False, True, True])
CALLS = [(0, 3), (3, 4), (4, 7), (7, 8)]

Call = Callable[[flashv41.Sequence], object]
# (what, call, error class, words of the message); the sequence stands at position 3, max_seq 8,
# max_tokens 3 (so five tokens are two chunks)
BAD_CALLS: list[tuple[str, Call, type[FlashError], str]] = [
    ("id = vocab", lambda s: s.prefill(np.array([3, VOCAB])), InputError, f"token id {VOCAB} at index 1"),
    ("negative id", lambda s: s.prefill(np.array([-5, 3])), InputError, "token id -5 at index 0"),
    ("uint64 past int64", lambda s: s.prefill(np.array([2**64 - 1], np.uint64)), InputError, "outside the vocab"),
    ("int past int64", lambda s: s.prefill([2**70]), InputError,
     f"token id {2**70} at index 0 is outside the vocabulary [0, {VOCAB})"),
    ("float ids", lambda s: s.prefill(np.array([1.0, 2.0])), InputError, "the one at index 0 is 1.0 (a float)"),
    ("float in a list", lambda s: s.prefill([1, 2.5]), InputError, "the one at index 1 is 2.5 (a float)"),
    ("bool ids", lambda s: s.prefill(np.array([True, False])), InputError, "the one at index 0 is True (a bool)"),
    ("string", lambda s: s.prefill("12"), InputError, "got '12' (a string)"),
    ("None", lambda s: s.prefill(None), InputError, "a sequence of integers, got None"),
    ("2-D ids", lambda s: s.prefill(np.array([[1, 2]])), InputError, "one flat sequence of integers, got a 2-D array"),
    ("ragged ids", lambda s: s.prefill([[1], [1, 2]]), InputError, "one flat sequence of integers"),
    ("0-D ids", lambda s: s.prefill(np.int64(3)), InputError, "got the single integer 3 (write [3] for one token)"),
    ("no ids", lambda s: s.prefill(np.array([], np.int64)), InputError, "no token ids: a call takes at least one"),
    ("empty list", lambda s: s.prefill([]), InputError, "no token ids: a call takes at least one"),
    ("decode id = vocab", lambda s: s.decode(VOCAB), InputError, f"token id {VOCAB} at index 0"),
    ("decode negative", lambda s: s.decode(-1), InputError, "token id -1"),
    ("decode float", lambda s: s.decode(3.0), InputError,  # type: ignore[arg-type]
     "one integer token id, got 3.0 (a float)"),
    ("decode bool", lambda s: s.decode(True), InputError, "got True (a bool)"),
    ("decode array", lambda s: s.decode(np.array([3])), InputError, "got an array of shape (1,)"),  # type: ignore[arg-type]
    ("decode None", lambda s: s.decode(None), InputError, "got None"),  # type: ignore[arg-type]
    ("decode past int64", lambda s: s.decode(2**70), InputError, f"token id {2**70} at index 0 is outside"),
    ("decode mask of int", lambda s: s.decode(3, 1), InputError,  # type: ignore[arg-type]
     "decode's token_mask is one bool or None, got int"),
    ("mask of ints", lambda s: s.prefill([1, 2], token_mask=np.array([1, 0])), InputError, "token_mask"),
    ("mask of floats", lambda s: s.prefill([1, 2], token_mask=[1.0, 0.0]), InputError, "values of type float64"),
    ("mask too short", lambda s: s.prefill([1, 2, 3], token_mask=np.ones(2, bool)), InputError,
     "one bool a token (3 here), got 2 bools"),
    ("mask too long", lambda s: s.prefill([1, 2], token_mask=np.ones(3, bool)), InputError, "got 3 bools"),
    ("mask 2-D", lambda s: s.prefill([1, 2], token_mask=np.ones((1, 2), bool)), InputError, "(1, 2)"),
    ("past max_seq", lambda s: s.prefill(np.zeros(6, np.int64)), CapacityError, "exceed max_seq 8 (5 positions left)"),
    ("past max_seq in chunks", lambda s: s.prefill(np.arange(7)), CapacityError, "7 tokens at position 3"),
    ("bad id in the 2nd chunk", lambda s: s.prefill(np.array([1, 2, 3, 4, VOCAB])), InputError, "at index 4"),
    ("bad mask, 2 chunks", lambda s: s.prefill(np.arange(5), token_mask=np.ones(4, bool)), InputError, "token_mask"),
    ("unmapped and too long", lambda s: s.prefill(np.full(6, UNMAPPED[0])), CapacityError, "exceed max_seq"),
]


@pytest.fixture(scope="module")
def setup(synth_model):
    model = flashv41.load_model(synth_model("tiny", **TWO_LAYER_TINY))
    assert model.config.vocab_size == VOCAB and (model.config.engram.token_map[list(UNMAPPED)] == -1).all()
    engine = flashv41.Engine(model, max_seq=MAX_SEQ, max_tokens=MAX_TOKENS)
    yield model, engine, Oracle(model, max_seq=MAX_SEQ)
    engine.close()
    model.close()


def snapshot(seq: flashv41.Sequence) -> tuple[int, list[dict[str, np.ndarray]], np.ndarray]:
    return seq.position, seq.attention_state(), seq.hasher.history.copy()


def assert_unchanged(seq: flashv41.Sequence, before, what: str) -> None:
    position, state, history = snapshot(seq)
    assert position == before[0], f"{what}: position {before[0]} -> {position}"
    assert np.array_equal(history, before[2]), f"{what}: hash history changed"
    for i, (now, then) in enumerate(zip(state, before[1], strict=True)):
        for name in then:
            assert np.array_equal(now[name].view(np.uint32), then[name].view(np.uint32)), \
                f"{what}: layer {i} {name} changed"


def run(seq: flashv41.Sequence, k: int) -> np.ndarray:
    """Call k of STREAM on seq (a decode for one-token calls)."""
    a, b = CALLS[k]
    if b - a == 1:
        return seq.decode(int(STREAM[a]), token_mask=bool(MASK[a]))
    return seq.prefill(STREAM[a:b], token_mask=MASK[a:b])


def assert_agrees(seq, ref, k: int, what: str) -> np.ndarray:
    a, b = CALLS[k]
    got, call = compare_call(seq, ref, STREAM[a:b], MASK[a:b])
    assert call.ok, f"{what}: {call.describe()}"
    return got


@pytest.mark.slow
def test_bad_calls_change_nothing(setup, monkeypatch: pytest.MonkeyPatch) -> None:
    model, engine, oracle = setup
    a, c = engine.new_sequence(), engine.new_sequence()  # a sees every bad call, c none
    ref = oracle.new_sequence()
    outputs: dict[str, list[np.ndarray]] = {"a": [run(a, 0)], "c": [run(c, 0)]}
    ref.prefill(STREAM[:3], token_mask=MASK[:3])
    before = snapshot(a)
    for i, (what, call, error, words) in enumerate(BAD_CALLS):
        with pytest.raises(FlashError) as caught:
            call(a)
        assert type(caught.value) is error and words in str(caught.value), f"{what}: {caught.value!r}"
        assert_unchanged(a, before, what)
        if i == len(BAD_CALLS) // 2:
            outputs["c"].append(run(c, 1))  # the other sequence moves on between the failures

    # a failure from inside a call, after validation (here: the attention stage of the second
    # layer raising, as a CUDA error would): the call raises it, the engine and the other
    # sequences are untouched; the failed sequence may be half-written, so it refuses more calls
    d = engine.new_sequence()
    forward = engine.attention.forward
    calls = []

    def failing(*args, **kwargs):
        calls.append(args[0])
        if len(calls) == 2:
            raise RuntimeError("injected device failure")
        return forward(*args, **kwargs)

    monkeypatch.setattr(engine.attention, "forward", failing)
    with pytest.raises(RuntimeError, match="injected"):
        d.prefill(STREAM[:3])
    monkeypatch.undo()
    with pytest.raises(SequenceStateError, match="failed in the middle of a call"):
        d.decode(1)
    d.release()

    # use after release and after close, on a second engine
    with pytest.raises(SequenceStateError, match="released"):
        d.decode(1)
    other = flashv41.Engine(model, max_seq=MAX_SEQ, max_tokens=MAX_TOKENS)
    orphan = other.new_sequence()
    other.close()
    for call in (lambda: orphan.decode(1), lambda: orphan.prefill([1, 2]), orphan.attention_state):
        with pytest.raises(SequenceStateError, match="released"):
            call()
    with pytest.raises(SequenceStateError, match="engine was closed"):
        other.new_sequence()
    other.close()  # idempotent
    orphan.release()
    assert_unchanged(a, before, "after the other engine closed")

    # a continues: each call agrees with the oracle, and the unmapped token is no error
    outputs["a"].append(assert_agrees(a, ref, 1, "decode of an unmapped id after the errors"))
    gates = [cap["engram_gate"] for cap in a.captures if "engram_gate" in cap]
    assert len(gates) == 2 and all((g > 0).all() for g in gates), "an unmapped token keeps its engram gate"
    outputs["a"].append(assert_agrees(a, ref, 2, "prefill after the unmapped id, a masked token"))
    gates = [cap["engram_gate"] for cap in a.captures if "engram_gate" in cap]
    assert all((g[1] == 0).all() and (g[[0, 2]] > 0).all() for g in gates), "the masked token's gate is 0"
    outputs["a"].append(run(a, 3))
    outputs["c"] += [run(c, 2), run(c, 3)]
    assert a.position == MAX_SEQ
    before = snapshot(a)
    for call in (lambda: a.decode(5), lambda: a.prefill([5])):
        with pytest.raises(CapacityError, match="0 positions left"):
            call()
        assert_unchanged(a, before, "past the end")

    # the first calls again on a second engine; the runs agree bit for bit
    with flashv41.Engine(model, max_seq=MAX_SEQ, max_tokens=MAX_TOKENS) as second:
        e = second.new_sequence()
        outputs["e"] = [run(e, k) for k in range(2)]
    for name in ("a", "e"):
        for k, out in enumerate(outputs[name]):
            assert np.array_equal(out.view(np.uint32), outputs["c"][k].view(np.uint32)), \
                f"call {k}: sequence {name} differs from the untouched one"
    a.release()
    c.release()


@pytest.mark.parametrize("residency", ["host", "pinned"])
def test_host_tables_agree(setup, residency: str) -> None:
    """Tables read from the file, or from pinned host memory, give the device tables' results bit
    for bit (and the oracle's, within its bounds)."""
    model, engine, oracle = setup
    with flashv41.Engine(model, max_seq=MAX_SEQ, max_tokens=MAX_TOKENS, table_residency=residency) as other:
        seq = other.new_sequence()
        got = assert_agrees(seq, oracle.new_sequence(), 0, f"{residency} tables")
        assert other.engram is not None and other.engram.pinned_bytes == (
            sum(w.table.rows * w.table.row_bytes for w in other.engram.layers.values()) if residency == "pinned" else 0)
    device = engine.new_sequence()
    assert np.array_equal(run(device, 0).view(np.uint32), got.view(np.uint32))
    device.release()


def test_pinned_tables_refused(setup, monkeypatch) -> None:
    """Pinning that the host cannot hold, or that the driver refuses, is one CapacityError naming
    the table, before anything is pinned; the engine already built stays usable."""
    from numba import cuda

    from flashv41.stages import engram_rows

    model, engine, _ = setup
    monkeypatch.setattr(engram_rows, "host_available_bytes", lambda: 1024)
    with pytest.raises(CapacityError, match=r"engram_embd.*pinning the engram table needs .* GiB of host memory"):
        flashv41.Engine(model, max_seq=MAX_SEQ, max_tokens=MAX_TOKENS, table_residency="pinned")
    monkeypatch.setattr(engram_rows, "host_available_bytes", lambda: None)

    def refuse(*args, **kwargs):
        raise MemoryError("no pinned memory")

    monkeypatch.setattr(cuda, "mapped_array", refuse)
    with pytest.raises(CapacityError, match=r"engram_embd.*the driver refused to pin .*no pinned memory"):
        flashv41.Engine(model, max_seq=MAX_SEQ, max_tokens=MAX_TOKENS, table_residency="pinned")
    seq = engine.new_sequence()
    run(seq, 0)
    seq.release()


def test_unmapped_blocks_like_a_mask_in_the_oracle(setup) -> None:
    """The oracle's reading of an unmapped id, which the engine is held to above: the same engram
    row ids as a masked token at that position (all-pad n-gram), and the same ids for the tokens
    after it (look-back blocked), but an engram gate > 0 where a masked token's is 0."""
    _, _, oracle = setup
    runs = {}
    for name, token, keep in (("unmapped", UNMAPPED[1], True), ("masked", 9, False), ("plain", 9, True)):
        seq = oracle.new_sequence()
        seq.prefill(STREAM[:3])
        seq.prefill(np.array([token, 20, 21]), token_mask=np.array([keep, True, True]), capture=True)
        runs[name] = [cap for cap in seq.captures if "engram_ids" in cap]
    for unmapped, masked, plain in zip(runs["unmapped"], runs["masked"], runs["plain"], strict=True):
        assert np.array_equal(unmapped["engram_ids"], masked["engram_ids"])
        assert not np.array_equal(unmapped["engram_ids"], plain["engram_ids"])
        assert (unmapped["engram_gate"][0] > 0).all() and (masked["engram_gate"][0] == 0).all()


def test_engine_arguments(setup) -> None:
    model, _, _ = setup
    for kwargs, error, words in (
        (dict(max_seq=0), InputError, "max_seq must be at least 1, got 0"),
        (dict(max_tokens=0), InputError, "max_tokens must be at least 1, got 0"),
        (dict(max_seq=model.config.context_length + 1), CapacityError, "context length"),
        (dict(table_residency="disk"), InputError, "table_residency"),
    ):
        with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
            flashv41.Engine(model, **{"max_seq": 8, "max_tokens": 3, **kwargs})


@pytest.mark.parametrize("call", [
    lambda m, e: e.new_sequence().decode(3, token_mask=np.array([True, False])),
    lambda m, e: flashv41.Engine(m, max_seq="8"),
    lambda m, e: flashv41.Engine(m, max_tokens=2.5),
], ids=["decode mask of two", "max_seq a string", "max_tokens a float"])
def test_argument_types(setup, call) -> None:
    model, engine, _ = setup
    with pytest.raises(InputError):
        call(model, engine)


@pytest.mark.gpu
def test_gpu_bitwise_across_engines_interleaving_and_errors(synth_model) -> None:
    """The small preset on a GPU, where one-token steps replay CUDA graphs captured per sequence:
    a sequence run alone, the same calls interleaved with another sequence's calls and with bad
    calls, and the same calls on a second engine, bit for bit; every 16th step checked against the
    oracle layer by layer (the eager path, with captures)."""
    model = flashv41.load_model(synth_model("small"))
    vocab = model.config.vocab_size
    rng = np.random.default_rng(21)
    ids, other_ids = rng.integers(0, vocab, 104), rng.integers(0, vocab, 104)
    mask = rng.random(104) > 0.1
    oracle = Oracle(model, max_seq=128)

    def calls(seq, between=None, check=False):
        outs = [seq.prefill(ids[s:s + 16], token_mask=mask[s:s + 16]) for s in range(0, 40, 16)]
        for p in range(40, 104):
            if between is not None:
                between(p)
            if check and p % 16 == 0:
                got, call = compare_call(seq, synced_oracle(seq, oracle), ids[p:p + 1], mask[p:p + 1])
                assert call.ok, (p, call.describe())
                outs.append(got)
            else:
                outs.append(seq.decode(int(ids[p]), token_mask=bool(mask[p])))
        return np.concatenate(outs)

    with flashv41.Engine(model, max_seq=128, max_tokens=16) as one, \
            flashv41.Engine(model, max_seq=128, max_tokens=16) as two:
        alone = calls(one.new_sequence())
        b, c = one.new_sequence(), one.new_sequence()
        c.prefill(other_ids[:40])

        bad_calls = (lambda: b.prefill(np.array([1, vocab])), lambda: b.decode(-1), lambda: b.prefill([1.0]),
                     lambda: b.prefill(np.array([[1]])), lambda: b.decode(True),
                     lambda: b.prefill([1, 2], token_mask=np.array([1, 0])), lambda: b.prefill(np.arange(200)))

        def disturb(p: int) -> None:
            c.decode(int(other_ids[p]))
            for bad in bad_calls:
                with pytest.raises(FlashError):
                    bad()

        interleaved = calls(b, disturb, check=True)
        elsewhere = calls(two.new_sequence())
    for name, run_ in (("interleaved", interleaved), ("second engine", elsewhere)):
        assert np.array_equal(run_.view(np.uint32), alone.view(np.uint32)), f"{name} differs from the run alone"
    model.close()
