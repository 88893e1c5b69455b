"""Engine.decode_batch (issue 19): one step of several sequences, one token each, each at its own
position with its own state, against the same sequences decoded one by one.

On the tiny preset (window 8; ratio-2 and ratio-1 layers; kv, index and candidate sources;
engram), sequences prefilled to different lengths (across the window's wrap and compressor group
boundaries) decode together: every row equals what the sequence's own `decode` gives, bit for bit
(on the simulator the products' stream kernel sums each token the same way for one token or
several). Bad batches are refused before anything runs, naming the sequence, and leave every
sequence as it was.
"""

from __future__ import annotations

import numpy as np
import pytest

import flashv41
from flashv41.host.errors import CapacityError, InputError, SequenceStateError

PROMPTS = (2, 7, 9)  # prompt lengths: decoded positions 2-3 before the window wraps, 7-8 across it, 9-10 after
STEPS = 2


@pytest.fixture(scope="module")
def model(tiny_path):
    with flashv41.load_model(tiny_path) as m:
        yield m


def tokens(model, seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, model.config.vocab_size, n)


@pytest.mark.slow
def test_batch_equals_each_alone(model) -> None:
    prompts = [tokens(model, i, n) for i, n in enumerate(PROMPTS)]
    nexts = [tokens(model, 10 + i, STEPS) for i in range(len(PROMPTS))]
    masks = [None, False, True]  # the last step: a masked token, an explicit True, no mask
    with flashv41.Engine(model, max_seq=64, max_tokens=8) as engine:
        alone = []
        for prompt, nxt, mask in zip(prompts, nexts, masks, strict=True):
            seq = engine.new_sequence()
            seq.prefill(prompt)
            out = [seq.decode(int(t)) for t in nxt[:-1]]
            out.append(seq.decode(int(nxt[-1]), token_mask=mask))
            alone.append(out)
            seq.release()
        seqs = [engine.new_sequence() for _ in prompts]
        for seq, prompt in zip(seqs, prompts, strict=True):
            seq.prefill(prompt)
        for step in range(STEPS):
            last = step == STEPS - 1
            got = engine.decode_batch(seqs, [int(n[step]) for n in nexts], masks if last else None)
            assert got.shape == (len(seqs), model.config.hc, model.config.dim)
            for b, seq in enumerate(seqs):
                differ = int((got[b] != alone[b][step][0]).sum())
                assert differ == 0, f"step {step}: sequence {b} differs from its own decode in {differ} values"
                assert seq.position == PROMPTS[b] + step + 1


@pytest.mark.slow
def test_bad_batches_change_nothing(model) -> None:
    """Each bad batch is one error naming the sequence; afterwards the batch decodes as if it had
    never been tried."""
    with flashv41.Engine(model, max_seq=8, max_tokens=4) as engine, \
            flashv41.Engine(model, max_seq=8, max_tokens=4) as other:
        a, b, full, gone = (engine.new_sequence() for _ in range(4))
        a.prefill(tokens(model, 1, 2))
        b.prefill(tokens(model, 2, 3))
        full.prefill(tokens(model, 3, 8))
        gone.release()
        stranger = other.new_sequence()
        vocab = model.config.vocab_size
        bad = [
            (([a, b], [1, vocab]), InputError, "sequence 1: token id"),
            (([a, full], [1, 2]), CapacityError, "sequence 1: 1 token at position 8 exceeds max_seq 8"),
            (([a, a], [1, 2]), InputError, "sequence 1 appears twice"),
            (([b, gone], [1, 2]), SequenceStateError, "sequence 1: this sequence was released"),
            (([stranger, a], [1, 2]), InputError, "sequence 0 is not a sequence of this engine"),
            (([a, b], [1]), InputError, "token_ids must be 2 integers"),
            (([a, b], [1, 2], [True]), InputError, "1 token masks for 2 sequences"),
            (([a, b], [1, 2], [True, 1]), InputError, "token mask 1 is one bool"),
            (([], []), InputError, "1 to max_tokens"),
            (([a, b, full, gone, stranger], [1] * 5), InputError, "1 to max_tokens \\(4\\)"),
        ]
        for args, error, message in bad:
            with pytest.raises(error, match=message):
                engine.decode_batch(*args)
        assert (a.position, b.position) == (2, 3) and not a.failed and not b.failed
        got = engine.decode_batch([a, b], [7, 9])
        c, d = engine.new_sequence(), engine.new_sequence()
        c.prefill(tokens(model, 1, 2))
        d.prefill(tokens(model, 2, 3))
        assert np.array_equal(got[0], c.decode(7)[0]) and np.array_equal(got[1], d.decode(9)[0])


def test_closed_engine(model) -> None:
    engine = flashv41.Engine(model, max_seq=8, max_tokens=4)
    seq = engine.new_sequence()
    engine.close()
    with pytest.raises(SequenceStateError, match="closed"):
        engine.decode_batch([seq], [1])


@pytest.mark.slow
def test_a_batch_wider_than_max_seq(model) -> None:
    """B sequences take one position each, so a batch may hold more sequences than max_seq has
    positions (found by the bench's B = 128 row on an engine of max_seq 104): six sequences on an
    engine of four positions step together, each as it decodes alone."""
    prompts = [tokens(model, 20 + i, 1 + i % 3) for i in range(6)]
    with flashv41.Engine(model, max_seq=4, max_tokens=6) as engine:
        alone = []
        for i, prompt in enumerate(prompts):
            seq = engine.new_sequence()
            seq.prefill(prompt)
            alone.append(seq.decode(30 + i)[0])
            seq.release()
        seqs = [engine.new_sequence() for _ in prompts]
        for seq, prompt in zip(seqs, prompts, strict=True):
            seq.prefill(prompt)
        got = engine.decode_batch(seqs, [30 + i for i in range(len(seqs))])
        for b in range(len(seqs)):
            assert np.array_equal(got[b], alone[b]), f"sequence {b} differs from its own decode"
