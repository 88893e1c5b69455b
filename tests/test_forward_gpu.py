"""A complete forward on a real GPU: the engine with HostMoE as its FFN callback and its head against
the oracle at V4.1-Flash dimensions (tests/test_forward.py's comparison), and decode steps still
replayed from CUDA graphs with a capture-safe FFN callback written with Numba."""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

import flashv41
from flashv41.ffn import capturable, host_ffn
from flashv41.host.moe import HostMoE
from flashv41.host.oracle import Oracle
from flashv41.sampling import sample
from flashv41.stages.device import bf16_to_f32, f32_to_bf16
from tests.test_forward import checked_call

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def flash_moe(synth_model):
    """The flash dimensions on the six-layer schedule (one layer of each block type), a small vocabulary
    and four experts of V4.1's width (2304), its Q8_0 head."""
    path = synth_model("flash", moe=True, vocab=2048, n_experts=4, n_active=2, engram_rows=120_000,
                       context_length=4096, stored_draw=True)
    with flashv41.load_model(path) as model:
        yield model


def test_flash_forward_with_host_moe_and_head(flash_moe) -> None:
    """A 40-token prefill and 10 greedy decode steps, each call from the engine's state: every layer
    within the check's bound, the logits within the head's derived bound, the argmax equal at every
    position and the greedy tokens the oracle's."""
    engine = flashv41.Engine(flash_moe, max_seq=128, max_tokens=64, ffn=host_ffn(HostMoE(flash_moe)))
    oracle = Oracle(flash_moe, max_seq=128, ffn=HostMoE(flash_moe))
    seq, ref = engine.new_sequence(), oracle.new_sequence()
    ids = np.random.default_rng(3).integers(0, flash_moe.config.vocab_size, 40)
    tokens, oracle_tokens, worst = [], [], 0.0
    for _ in range(11):
        head, l_e, l_o = checked_call(seq, ref, ids, flash_moe)
        assert head.ok and head.argmax_equal == head.positions, head.describe()
        worst = max(worst, head.worst)
        tokens.append(sample(l_e[-1]))
        oracle_tokens.append(sample(l_o[-1]))
        ids = np.array([tokens[-1]])
    print(f"flash: the largest logit error {worst:.3f} of its bound; tokens {tokens}")
    assert tokens == oracle_tokens


@cuda.jit
def _half_plus(x, out, shift, n):
    """out = bf16(x / 2 + shift), one thread a value (x, out: bf16 bits [T, C])."""
    i = cuda.grid(1)
    if i < n:
        t, d = i // x.shape[1], i % x.shape[1]
        out[t, d] = f32_to_bf16(bf16_to_f32(x[t, d]) * np.float32(0.5) + shift)


def half_plus(layer: int, x: np.ndarray) -> np.ndarray:
    """The host function _half_plus computes, for the oracle (x / 2 exact; one fp32 addition)."""
    return (x * np.float32(0.5) + np.float32(layer / 8)).astype(np.float32)


def test_graphs_replay_with_a_capturable_numba_ffn(flash_moe) -> None:
    """A callback that launches only on the stream it is given, the same work every step, marked
    capturable: decode steps replay CUDA graphs, bit for bit what the eager engine gives, and the
    layers agree with the oracle running the same function."""
    @capturable
    def ffn(layer, x, out, stream) -> None:
        n = x.shape[0] * x.shape[1]
        _half_plus[(n + 255) // 256, 256, stream.stream](x, out, np.float32(layer / 8), n)

    graphed = flashv41.Engine(flash_moe, max_seq=64, max_tokens=16, ffn=ffn)
    eager = flashv41.Engine(flash_moe, max_seq=64, max_tokens=16, ffn=ffn, graphs=False)
    assert graphed.graphs and not eager.graphs
    a, b = graphed.new_sequence(), eager.new_sequence()
    prompt = np.arange(9) * 7
    assert np.array_equal(a.prefill(prompt), b.prefill(prompt))
    for token in (3, 5, 8, 13, 21, 34):
        assert np.array_equal(a.decode(token).view(np.uint32), b.decode(token).view(np.uint32))
        assert np.array_equal(a.logits().view(np.uint32), b.logits().view(np.uint32))
    assert a.graphs, "no decode step was replayed from a graph"
    seq, ref = graphed.new_sequence(), Oracle(flash_moe, max_seq=64, ffn=half_plus).new_sequence()
    head, _, _ = checked_call(seq, ref, prompt, flash_moe)
    assert head.ok, head.describe()
    for token in (3, 5, 8):
        head, _, _ = checked_call(seq, ref, np.array([token]), flash_moe)
        assert head.ok, head.describe()
