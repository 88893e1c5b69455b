"""Picking tokens from logits, as the reference's `sample` does (model.py), and greedy generation.

`sample(logits, temperature=0.0, seed=None)`: at temperature 0 the argmax (the first of equal
maxima); otherwise softmax(logits / max(temperature, 1e-5)) in fp32 divided by Exponential(1)
noise, then the argmax (the Gumbel-max trick: a draw from the softmax), the noise from NumPy's
generator seeded with `seed` (torch's generator draws other numbers: the same distribution, not
the same tokens). logits: [V] -> an int; [T, V] -> int64 [T].

`generate(seq, prompt, n)`: prefill the prompt, then n greedy steps, each token the argmax of the
last position's logits, fed back in: the token ids, int64 [n]. Works on an engine sequence and on
an oracle sequence (host.oracle.OracleSequence) alike.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from flashv41.host.errors import InputError

MIN_TEMPERATURE = 1e-5  # the reference's floor under a positive temperature


def sample(logits: Any, temperature: float = 0.0, seed: int | None = None) -> Any:
    """A token id from logits [V] (an int), or one a row from [T, V] (int64 [T]) (module docstring)."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float, np.floating, np.integer)):
        raise InputError(f"sample: temperature must be a number >= 0, got {type(temperature).__name__} "
                         f"{temperature!r}")
    if not math.isfinite(float(temperature)) or temperature < 0:
        raise InputError(f"sample: temperature must be a finite number >= 0, got {temperature!r}")
    x = np.asarray(logits)
    if x.ndim not in (1, 2) or x.shape[-1] == 0 or not np.issubdtype(x.dtype, np.floating):
        raise InputError(f"sample: logits must be float [V] or [T, V] with V >= 1, got {x.dtype} {x.shape}")
    if np.isnan(x).any():
        raise InputError("sample: the logits hold NaN")
    x = x.astype(np.float32)
    if temperature == 0:
        picked = np.argmax(x, axis=-1)
    else:
        z = x / np.float32(max(float(temperature), MIN_TEMPERATURE))
        z64 = (z - z.max(axis=-1, keepdims=True)).astype(np.float64)
        probs = np.exp(z64)
        probs = (probs / probs.sum(axis=-1, keepdims=True)).astype(np.float32)
        noise = np.random.default_rng(seed).exponential(1.0, size=probs.shape).astype(np.float32)
        picked = np.argmax(probs / noise, axis=-1)
    return int(picked) if x.ndim == 1 else picked.astype(np.int64)


def generate(seq: Any, prompt: Any, n: int) -> np.ndarray:
    """Prefill `prompt`, then decode n tokens greedily (each the argmax of the last logits, fed
    back); the tokens, int64 [n]. `seq`: an engine or oracle sequence of a model with a head."""
    if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 0:
        raise InputError(f"generate: the token count must be an integer >= 0, got {n!r}")
    out = np.empty(n, np.int64)
    if n == 0:
        return out
    seq.prefill(prompt, output="last")
    for k in range(n):
        out[k] = sample(seq.logits())
        if k + 1 < n:
            seq.decode(int(out[k]))
    return out
