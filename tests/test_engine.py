"""The engine against the oracle over a whole stack: every block type, both engram layers,
prefill, chunked prefill, decode across the window wrap, interleaved sequences, release.

Every call is compared layer by layer from identical starting points, the oracle going on with the
engine's quantised rows and selections, with the bounds and the reasons for them in
flashv41/check.py (cosine 0.99999 and relative RMS 5e-3 per layer whatever flipped; engram ids and
attended selections exactly; flips of each kind at most 1% of the call's values, or one).
"""

from __future__ import annotations

import numpy as np
import pytest

import flashv41
from flashv41.check import Flips
from flashv41.check import compare_call as compare
from flashv41.host.errors import CapacityError, InputError, SequenceStateError
from flashv41.host.oracle import Oracle


def compare_call(seq, ref, ids, what, mask=None, run: Flips | None = None):
    """One call on both (flashv41.check.compare_call), asserting the call's agreement; the call's
    flips are added to `run`, the tally of a test's calls."""
    got, call = compare(seq, ref, ids, mask)
    assert call.ok, f"{what}: {call.describe()}"
    if run is not None:
        run.add(call.flips)
    return got


def assert_flips_rare(run: Flips, what: str) -> None:
    """The flips of a whole run: at most 1% of each kind's values (flashv41.check.Flips)."""
    print(f"\n{what}: flips {run.describe()}")
    assert run.rare, f"{what}: flips not rare over the run: {run.describe()}"


@pytest.fixture(scope="module")
def tiny(synth_model):
    model = flashv41.load_model(synth_model("tiny"))
    engine = flashv41.Engine(model, max_seq=64, max_tokens=6)
    yield model, engine, Oracle(model, max_seq=64)
    engine.close()


def tokens(n, seed):
    return np.random.default_rng(seed).integers(0, 128, n)


def test_every_block_type_and_engram_layer_present(tiny):
    model, _, _ = tiny
    kinds = {r.block_type for r in model.config.roles}
    assert {"swa", "kv_index_source_r2", "consumer_r2", "candidate_source_r1", "consumer_r1",
            "candidate_index_source_r1"} <= kinds
    assert [r.layer for r in model.config.roles if r.engram] == [0, 1]


@pytest.mark.slow
def test_prefill_per_layer(tiny):
    model, engine, oracle = tiny
    seq, ref = engine.new_sequence(), oracle.new_sequence()
    compare_call(seq, ref, tokens(6, 1), "prefill")
    assert len(seq.captures) == model.config.n_layers
    seq.release()


@pytest.mark.slow
def test_chunked_prefill_then_decode_across_the_window(tiny):
    """A 10-token prompt (one call of 4, one of 6), then three windows of decode steps."""
    model, engine, oracle = tiny
    ids = tokens(10 + 3 * model.config.window, 2)
    seq, ref = engine.new_sequence(), oracle.new_sequence()
    run = Flips()
    compare_call(seq, ref, ids[:4], "prefill at 0", run=run)
    compare_call(seq, ref, ids[4:10], "prefill at 4", run=run)
    for step, tok in enumerate(ids[10:]):
        compare_call(seq, ref, np.array([tok]), f"decode step {step} (position {10 + step})", run=run)
    assert seq.position == ref.position == ids.size
    seq.release()
    assert_flips_rare(run, "tiny, 10-token prompt and 24 decode steps")


@pytest.mark.slow
def test_long_prompt_is_chunked_by_max_tokens(tiny):
    """A 14-token prompt through max_tokens = 6: three chunks inside one call, same result as
    feeding the chunks one call at a time."""
    _, engine, _ = tiny
    ids = tokens(14, 8)
    one, parts = engine.new_sequence(), engine.new_sequence()
    whole = one.prefill(ids)
    split = np.concatenate([parts.prefill(ids[s:s + 6]) for s in range(0, 14, 6)])
    assert whole.shape == (14, *whole.shape[1:]) and one.position == 14
    assert np.array_equal(whole.view(np.uint32), split.view(np.uint32))
    one.release()
    parts.release()


@pytest.mark.slow
def test_interleaved_sequences_do_not_disturb_each_other(tiny):
    _, engine, oracle = tiny
    a_ids, b_ids = tokens(9, 3), tokens(9, 4)
    a, b = engine.new_sequence(), engine.new_sequence()
    ra, rb = oracle.new_sequence(), oracle.new_sequence()
    run = Flips()
    compare_call(a, ra, a_ids[:5], "A prefill", run=run)
    compare_call(b, rb, b_ids[:3], "B prefill", run=run)
    for i in range(4):
        compare_call(a, ra, a_ids[5 + i:6 + i], f"A step {i}", run=run)
        compare_call(b, rb, b_ids[3 + i:4 + i], f"B step {i}", run=run)
    a.release()
    b.release()
    assert_flips_rare(run, "tiny, two interleaved sequences")


@pytest.mark.slow
def test_deterministic(tiny):
    _, engine, _ = tiny
    ids = tokens(7, 5)
    outs = []
    for _ in range(2):
        seq = engine.new_sequence()
        outs.append(seq.prefill(ids))
        seq.release()
    assert np.array_equal(outs[0].view(np.uint32), outs[1].view(np.uint32))


@pytest.mark.slow
def test_bad_input_leaves_the_sequence_usable(tiny):
    _, engine, oracle = tiny
    seq, ref = engine.new_sequence(), oracle.new_sequence()
    ids = tokens(4, 6)
    compare_call(seq, ref, ids[:2], "before the errors")
    with pytest.raises(InputError, match="token id 128 at index 1"):
        seq.prefill(np.array([3, 128]))
    with pytest.raises(InputError, match="token id -1"):
        seq.decode(-1)
    with pytest.raises(InputError, match="token_mask"):
        seq.prefill(np.array([1, 2]), token_mask=np.array([1, 0]))
    with pytest.raises(CapacityError, match="exceed max_seq 64"):
        seq.prefill(np.zeros(63, np.int64))
    assert seq.position == 2
    compare_call(seq, ref, ids[2:], "after the errors")
    seq.release()
    with pytest.raises(SequenceStateError, match="released"):
        seq.decode(1)
    seq.release()


@pytest.mark.slow
def test_token_mask(tiny):
    _, engine, oracle = tiny
    mask = np.array([True, False, True, True, False])
    seq, ref = engine.new_sequence(), oracle.new_sequence()
    compare_call(seq, ref, tokens(5, 7), "masked prefill", mask)
    gates = [cap["engram_gate"] for cap in seq.captures if "engram_gate" in cap]
    assert len(gates) == 2 and all((g[~mask] == 0).all() and (g[mask] > 0).all() for g in gates)
    seq.release()


def test_token_ids_are_checked_once_in_one_form(tiny, monkeypatch) -> None:
    """A prefill checks its ids once (host.tokens.check_tokens, in Sequence._validate); the device
    upload and the engram hasher then read the same int64 array, which the hasher does not check
    again."""
    _, engine, _ = tiny
    import flashv41.host.engram_hash
    import flashv41.sequence

    checks = []

    def counted(module):
        def check(*args, **kwargs):
            checks.append(module.__name__)
            return real(*args, **kwargs)
        real = module.check_tokens
        return check

    for module in (flashv41.sequence, flashv41.host.engram_hash):
        monkeypatch.setattr(module, "check_tokens", counted(module))
    seq = engine.new_sequence()
    seen = {}
    upload, hash_ = engine.hyper.upload_ids, seq.hasher.hash
    monkeypatch.setattr(engine.hyper, "upload_ids", lambda ids, t: seen.update(uploaded=ids) or upload(ids, t))
    monkeypatch.setattr(seq.hasher, "hash", lambda tokens, start: seen.update(hashed=tokens) or hash_(tokens, start))
    seq.prefill([5, 6, 7], token_mask=np.array([True, False, True]))
    assert checks == ["flashv41.sequence"]
    assert seen["uploaded"] is seen["hashed"].ids and seen["uploaded"].dtype == np.int64
    assert seen["hashed"].mask.tolist() == [True, False, True]
    seq.release()


def test_default_max_seq_fits_the_model(tiny_path) -> None:
    """Engine(model) with no sizes runs on a model whose context is under 4096 positions: its
    max_seq defaults to the shorter of the two (an explicit max_seq past the context is refused)."""
    model = flashv41.load_model(tiny_path)
    try:
        with flashv41.Engine(model) as engine:
            assert engine.max_seq == min(4096, model.config.context_length)
            assert engine.max_tokens == 256
        with pytest.raises(CapacityError, match="exceeds the model's context length"):
            flashv41.Engine(model, max_seq=model.config.context_length + 1)
    finally:
        model.close()
