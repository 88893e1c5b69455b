"""A complete V4.1 forward on the simulator: the engine with flashv41.HostMoE as its FFN callback and
its head give the oracle's logits, in every layout.

Each call is compared from identical starting points (flashv41.check.compare_call: the oracle's
layers from the engine's inputs, its attention choices the engine's), so what is left between the
two is rounding: every layer within the check's bound, and the head within the bound
flashv41.check derives for it (head_agreement: inputs >= 99% bit-equal and at most 3 bf16 ulps
apart, logits within the engine's fp32-sum bound plus the inputs' difference passed on). A run
free of the engine's choices drifts (SPEC section 3): a last-bit difference that lands on a bf16 or
fp8 rounding boundary in one layer moves the next layers' inputs by ~1e-3, and the MoE, reading a
normed bf16 input, passes that on; two greedy runs may then part at a near tie, as two correct
implementations do. So the greedy tokens are compared call for call: each the argmax of the
logits both computed from the same state.
"""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

import flashv41
from flashv41.check import compare_call, engine_head_input, head_agreement, oracle_head
from flashv41.ffn import host_ffn
from flashv41.host import gguf_layout as L
from flashv41.host.moe import HostMoE
from flashv41.host.oracle import Oracle
from flashv41.runner import random_tokens
from flashv41.sampling import sample

LAYOUTS = (L.LLAMA_CPP, L.MXXM_T, L.DS4)


def checked_call(seq, ref, ids: np.ndarray, model):
    """One call compared from the engine's state; the head's agreement over its positions (the oracle's
    head from the engine's last layer, as each layer from its inputs: flashv41.check.oracle_head)."""
    _, call = compare_call(seq, ref, ids)
    assert call.ok, call.describe()
    x_o, l_o = oracle_head(seq, ref)
    l_e = seq.logits(all_positions=True)
    return head_agreement(engine_head_input(seq), x_o, l_e, l_o, model.tensor(None, L.OUTPUT)), l_e, l_o


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_engine_host_moe_and_head_give_the_oracles_logits(synth_model, layout: str) -> None:
    """A 40-token prefill and 10 greedy decode steps: at every position the logits within the
    derived bound and the argmax equal; the greedy tokens the oracle's."""
    prompt, steps = 40, 10
    with flashv41.load_model(synth_model("tiny", moe=True, layout=layout)) as model:
        engine = flashv41.Engine(model, max_seq=64, max_tokens=48, ffn=host_ffn(HostMoE(model)))
        oracle = Oracle(model, max_seq=64, ffn=HostMoE(model))
        seq, ref = engine.new_sequence(), oracle.new_sequence()
        ids = random_tokens(model.config.vocab_size, prompt, 7, 0)
        tokens, oracle_tokens, worst, positions = [], [], 0.0, 0
        for _ in range(steps + 1):
            head, l_e, l_o = checked_call(seq, ref, ids, model)
            assert head.ok and head.argmax_equal == head.positions, head.describe()
            worst, positions = max(worst, head.worst), positions + head.positions
            tokens.append(sample(l_e[-1]))
            oracle_tokens.append(sample(l_o[-1]))
            ids = np.array([tokens[-1]])
        print(f"{layout}: {positions} positions, the largest logit error {worst:.3f} of its bound; tokens {tokens}")
        assert positions == prompt + steps
        assert tokens == oracle_tokens


def test_the_logits_check_rejects_an_ignored_head_norm(synth_model) -> None:
    """The same comparison, the engine's output_norm weight replaced by ones: rejected."""
    with flashv41.load_model(synth_model("tiny", moe=True)) as model:
        engine = flashv41.Engine(model, max_seq=32, max_tokens=8, ffn=host_ffn(HostMoE(model)))
        assert engine.head is not None
        engine.head.norm = cuda.to_device(np.ones(model.config.dim, np.float32))
        seq = engine.new_sequence()
        ref = Oracle(model, max_seq=32, ffn=HostMoE(model)).new_sequence()
        head, _, _ = checked_call(seq, ref, np.array([4, 8, 15, 16, 23, 42]), model)
        assert not head.ok and head.worst > 1, head.describe()
