"""The head (stages.head against host.oracle.head, held by flashv41.check.head_agreement's derived
bound), the mutants that bound must reject, Sequence.logits' refusals, and flashv41.sample."""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

import flashv41
from flashv41.check import head_agreement
from flashv41.host import gguf_layout as L
from flashv41.host.errors import InputError, SequenceStateError, UnsupportedError
from flashv41.host.numerics import from_bits
from flashv41.host.oracle.head import head_input, head_logits
from flashv41.sampling import generate, sample
from flashv41.stages.head import HeadStage


@pytest.fixture(scope="module")
def moe_model(synth_model):
    with flashv41.load_model(synth_model("tiny", moe=True)) as model:
        yield model


def _highway(t: int, hc: int, dim: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A highway of the scale the stack hands on (RMS about 2) and positive pre weights."""
    rng = np.random.default_rng(seed)
    h = (rng.standard_normal((t, hc, dim)) * 2).astype(np.float32)
    pre = rng.uniform(0.1, 1.0, (t, hc)).astype(np.float32)
    return h, pre


def _device_head(stage: HeadStage, h: np.ndarray, pre: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    t, dim = h.shape[0], h.shape[2]
    x = cuda.device_array((t, dim), np.uint16)
    stage.input(cuda.to_device(h), cuda.to_device(pre), x, t)
    return from_bits(x.copy_to_host()), stage.logits(x, t)


def _oracle_head(model, h: np.ndarray, pre: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    x = head_input(h, pre, model.tensor(None, L.OUTPUT_NORM).dequantize(), model.config.norm_eps)
    return x, head_logits(x, model.tensor(None, L.OUTPUT).dequantize())


@pytest.mark.parametrize("t", [1, 5, 70])  # a decode step, a chunk, past the workspace's HEAD_ROWS
def test_the_head_stage_is_the_oracles(moe_model, t: int) -> None:
    stage = HeadStage(moe_model, max_tokens=128)
    h, pre = _highway(t, moe_model.config.hc, moe_model.config.dim, t)
    x, logits = _device_head(stage, h, pre)
    x_o, l_o = _oracle_head(moe_model, h, pre)
    agreement = head_agreement(x, x_o, logits, l_o, moe_model.tensor(None, L.OUTPUT))
    print(agreement.describe())
    assert agreement.ok, agreement.describe()
    assert logits.shape == (t, moe_model.config.vocab_size) and logits.dtype == np.float32


@pytest.mark.parametrize("mutant", ["norm weight ignored", "a copy dropped", "logits scaled by 1%"])
def test_the_bound_rejects_a_wrong_head(moe_model, mutant: str) -> None:
    stage = HeadStage(moe_model, max_tokens=8)
    h, pre = _highway(6, moe_model.config.hc, moe_model.config.dim, 11)
    if mutant == "norm weight ignored":
        stage.norm = cuda.to_device(np.ones(moe_model.config.dim, np.float32))
    run_pre = pre.copy()
    if mutant == "a copy dropped":
        run_pre[:, 3] = 0
    x, logits = _device_head(stage, h, run_pre)
    if mutant == "logits scaled by 1%":
        logits = logits * np.float32(1.01)
    x_o, l_o = _oracle_head(moe_model, h, pre)
    agreement = head_agreement(x, x_o, logits, l_o, moe_model.tensor(None, L.OUTPUT))
    assert not agreement.ok and agreement.worst > 1, agreement.describe()


def test_logits_refusals(moe_model, tiny_path) -> None:
    engine = flashv41.Engine(moe_model, max_seq=16, max_tokens=4)
    seq = engine.new_sequence()
    with pytest.raises(SequenceStateError, match="no logits yet"):
        seq.logits()
    seq.prefill([3, 4, 5])
    assert seq.logits().shape == (moe_model.config.vocab_size,)
    assert seq.logits(all_positions=True).shape == (3, moe_model.config.vocab_size)
    assert np.array_equal(seq.logits(), seq.logits(all_positions=True)[-1])
    seq.release()
    with pytest.raises(SequenceStateError, match="released"):
        seq.logits()
    with flashv41.load_model(tiny_path) as plain:
        bare = flashv41.Engine(plain, max_seq=16, max_tokens=4).new_sequence()
        bare.prefill([1])
        with pytest.raises(UnsupportedError, match="no head"):
            bare.logits()


def test_decode_batch_keeps_each_sequences_head(moe_model) -> None:
    """After a batch step, each sequence's logits are those of its own row (as after its own decode)."""
    engine = flashv41.Engine(moe_model, max_seq=16, max_tokens=4)
    a, b, c = engine.new_sequence(), engine.new_sequence(), engine.new_sequence()
    for seq, ids in ((a, [1, 2]), (b, [9, 8, 7]), (c, [1, 2])):
        seq.prefill(ids)
    engine.decode_batch([a, b], [5, 6])
    c.decode(5)
    assert np.array_equal(a.logits(), c.logits())
    assert a.logits(all_positions=True).shape == (1, moe_model.config.vocab_size)
    assert not np.array_equal(a.logits(), b.logits())


def test_sample() -> None:
    logits = np.array([0.1, 2.5, -1.0, 2.5, 0.3], np.float32)
    assert sample(logits) == 1  # greedy: the first of equal maxima
    assert sample(np.stack([logits, -logits])).tolist() == [1, 2]
    draws = [sample(logits, temperature=1.0, seed=s) for s in range(2000)]
    assert sample(logits, 0.7, seed=5) == sample(logits, 0.7, seed=5)
    p = np.exp(logits.astype(np.float64))
    p /= p.sum()
    freq = np.bincount(draws, minlength=5) / len(draws)
    assert np.abs(freq - p).max() < 0.04  # a draw from the softmax (the Gumbel-max trick)
    assert sample(logits, temperature=1e-9, seed=1) in (1, 3)  # below the 1e-5 floor: all but greedy


@pytest.mark.parametrize("temperature, logits, message", [
    (-0.5, [1.0], "temperature must be a finite number >= 0"),
    (float("nan"), [1.0], "temperature must be a finite number >= 0"),
    ("hot", [1.0], "temperature must be a number >= 0, got str"),
    (True, [1.0], "temperature must be a number"),
    (0.0, [], "logits must be float"),
    (0.0, [[[1.0]]], "logits must be float"),
    (0.0, [1, 2], "logits must be float"),
    (0.0, [1.0, float("nan")], "hold NaN"),
])
def test_sample_refusals(temperature, logits, message: str) -> None:
    with pytest.raises(InputError, match=message):
        sample(np.asarray(logits), temperature=temperature)


def test_generate_needs_a_count() -> None:
    with pytest.raises(InputError, match="integer >= 0"):
        generate(None, [1], -1)
    assert generate(None, [1], 0).size == 0
