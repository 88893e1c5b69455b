"""Long decode runs against the oracle, two ways.

(a) Synced: every `sync_every` steps the step is compared layer by layer from identical starting
    points (flashv41.check.compare_call, the oracle placed where the engine stands by
    flashv41.check.synced_oracle). Every checkpoint must pass check.py's bounds, however long the
    run: this is the correctness check, and it does not weaken with length.
(b) Free-running: the engine and an oracle sequence decode the same token stream independently,
    and the final highways are compared every step (cosine similarity). Two correct
    implementations drift apart here: the engine sums in fp32 where the oracle sums in float64, and
    a last-bit difference that lands on a rounding boundary of a quantiser (fp8 window rows, fp4
    latents and index keys, bf16 index scores) flips a code or a top-k choice; the flipped row then
    stays in the cache. What bounds the drift: the highway carries nothing from one step to the
    next (each step starts from its token's embedding), so a difference reaches a step only through
    cached rows, and a cached row depends on earlier steps only through the layers below it, a chain
    at most n_layers long. The per-step difference is therefore stationary, not compounding: it
    grows only as far as more cache rows compete for the top-k (more near-ties), and levels off.

    Measured (an oracle against an oracle whose fp32 matmul results carry a relative error of
    1e-7 or 1e-6, the size of fp32 accumulation differences; 3000 steps; the lowest median over
    an eighth of the run): tiny (6 layers) 0.99998 / 0.9993, small 0.995 / 0.985 (creeping down
    over the first eighths, then level), the two-layer tiny 0.9999995 / 0.99996. Single steps are
    not bounded: a flipped top-k choice re-routes that step's attention (single-step cosines down
    to 0.74 on tiny and small, and to -0.01 on the two-layer tiny, whose 4 selected rows beside a
    4-row window are half of what a query sees). A real state error is far outside the noise: a
    stale compressed row every 16 groups gives medians of 0.82 to 0.93 (600 steps, no noise).

    So the bound: every value finite, and the median cosine of every eighth of the run (the last
    one included) at least a floor: 0.9999 for the two-layer tiny on the simulator (measured there:
    1 - cosine below 1e-14 at every step, no flip in 28 steps), 0.995 for tiny and 0.97 for small
    on the GPU (at least twice the pessimistic measurement's 1 - cosine, and well above a stale
    row's).

The token stream has unmapped raw ids (the stub token map's last two) and masked tokens throughout.
The simulator run uses tests/reliability.py's two-layer tiny: 28 decode steps (~35 s on two
cores, ~1.2 s a step) wrap its window of 4 seven times and complete 14 ratio-2 and 28 ratio-1
compressor groups; the `gpu` runs take the full tiny and small presets through 3000 steps.
"""

from __future__ import annotations

import numpy as np
import pytest

import flashv41
from flashv41.check import agreement, compare_call, synced_oracle
from flashv41.host.oracle import Oracle
from tests.reliability import TWO_LAYER_TINY


def token_stream(cfg, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """n raw ids, about 8% of them unmapped, and a mask with about 8% of the tokens masked out."""
    assert cfg.engram is not None
    unmapped = np.flatnonzero(cfg.engram.token_map < 0)
    assert unmapped.size, "the model's token map leaves no id unmapped"
    mapped = np.flatnonzero(cfg.engram.token_map >= 0)
    rng = np.random.default_rng(seed)
    ids = rng.choice(mapped, n)
    swap = rng.random(n) < 0.08
    ids[swap] = rng.choice(unmapped, int(swap.sum()))
    return ids, rng.random(n) >= 0.08


def window_medians(cos: np.ndarray, windows: int = 8) -> list[float]:
    return [float(np.median(part)) for part in np.array_split(cos, windows)]


def long_run(model, steps: int, prompt: int, sync_every: int, max_tokens: int, seed: int) -> np.ndarray:
    """Prefill `prompt` tokens, decode `steps`; checkpoints every sync_every steps must pass. Returns
    the free-running cosine of every decode step."""
    cfg = model.config
    max_seq = prompt + steps
    ids, mask = token_stream(cfg, max_seq, seed)
    oracle = Oracle(model, max_seq=max_seq)
    free = oracle.new_sequence()
    cos = np.zeros(steps)
    with flashv41.Engine(model, max_seq=max_seq, max_tokens=max_tokens) as engine:
        seq = engine.new_sequence()
        for s in range(0, prompt, max_tokens):
            part = slice(s, min(prompt, s + max_tokens))
            free.prefill(ids[part], token_mask=mask[part])
            assert np.isfinite(seq.prefill(ids[part], token_mask=mask[part])).all()
        for i in range(steps):
            p = prompt + i
            tok, keep = int(ids[p]), bool(mask[p])
            if (i + 1) % sync_every == 0:
                got, call = compare_call(seq, synced_oracle(seq, oracle), np.array([tok]), np.array([keep]))
                assert call.ok, f"synced checkpoint at position {p}: {call.describe()}"
            else:
                got = seq.decode(tok, token_mask=keep)
            want = free.decode(tok, token_mask=keep)
            assert np.isfinite(got).all(), f"non-finite highway at position {p}"
            cos[i] = agreement(got, want)[0]
    return cos


def check_drift(cos: np.ndarray, floor: float, what: str) -> None:
    medians = window_medians(cos)
    print(f"{what}: free-running 1 - cosine over {cos.size} steps: max {1 - cos.min():.2e}, window medians "
          + " ".join(f"{1 - m:.2e}" for m in medians))
    assert np.isfinite(cos).all()
    assert min(medians) >= floor, f"{what}: window medians {medians} fall below {floor}"


@pytest.mark.slow
def test_long_decode_on_the_simulator(synth_model) -> None:
    model = flashv41.load_model(synth_model("tiny", **TWO_LAYER_TINY))
    cos = long_run(model, steps=28, prompt=3, sync_every=7, max_tokens=3, seed=11)
    check_drift(cos, 0.9999, "two-layer tiny, simulator")
    model.close()


@pytest.mark.gpu
@pytest.mark.parametrize(("preset", "floor"), [("tiny", 0.995), ("small", 0.97)])
def test_long_decode_on_the_gpu(synth_model, preset: str, floor: float) -> None:
    # tiny's context length is 256; small's default is 4096 already
    model = flashv41.load_model(synth_model(preset, **({"context_length": 4096} if preset == "tiny" else {})))
    cos = long_run(model, steps=3000, prompt=64, sync_every=100, max_tokens=32, seed=12)
    check_drift(cos, floor, f"{preset}, GPU")
    model.close()
