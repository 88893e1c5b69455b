"""Checking the engine against the NumPy oracle, layer by layer (tests and `flashv41 run --check`).

The engine sums in fp32 where the oracle sums in float64, so values differ by accumulation
order. The model's quantisers (fp8 window rows, fp4 latents and index keys, bf16 index scores
feeding a top-k) turn such a last-bit difference, when it lands on a rounding boundary, into a
whole quantisation step or a different selected row, which then travels down the stack and,
through the caches, along the sequence. So a call is compared from identical starting points: the
oracle's attention state is set to the engine's before the call, and each of the oracle's layers
starts from the engine's input to that layer (highway and pre-mix). Then per layer:

- the output highway agrees to cosine >= COSINE (SPEC.md 4) and relative RMS <= REL_RMS;
- unless a quantisation flip happened at that layer or earlier in the call (its selection,
  candidate mask or a quantised state row differs from the oracle's): then to FLIP_COSINE.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

COSINE = 0.99999
REL_RMS = 5e-3
FLIP_COSINE = 0.999


@dataclass(frozen=True)
class LayerAgreement:
    layer: int
    cosine: float
    rel_rms: float
    max_error: float
    flip: bool  # a quantisation flip at this layer or before it in the call
    ids_match: bool  # engram row ids equal (True where the layer has no engram)

    @property
    def ok(self) -> bool:
        if not self.ids_match:
            return False
        if self.flip:
            return self.cosine >= FLIP_COSINE
        return self.cosine >= COSINE and self.rel_rms <= REL_RMS


def agreement(got: np.ndarray, want: np.ndarray) -> tuple[float, float, float]:
    """(cosine similarity, relative RMS error, max |error|) of two arrays."""
    g = np.asarray(got, np.float64).ravel()
    w = np.asarray(want, np.float64).ravel()
    cos = float(g @ w / max(np.linalg.norm(g) * np.linalg.norm(w), 1e-300))
    rel = float(np.sqrt(np.mean((g - w) ** 2)) / max(np.sqrt(np.mean(w**2)), 1e-300))
    return cos, rel, float(np.abs(g - w).max())


def _flipped(cap: dict, ocap: dict, state: dict, ostate: dict) -> bool:
    for key in ("selection", "candidates"):
        if key in ocap and not np.array_equal(np.asarray(cap[key]), np.asarray(ocap[key])):
            return True
    return any(not np.array_equal(state[k], ostate[k]) for k in ("window_ring", "compressed", "index_keys")
               if k in state)


def compare_call(seq, ref, token_ids, token_mask=None) -> tuple[np.ndarray, list[LayerAgreement]]:
    """Run one call on an engine sequence and on an oracle sequence from the same starting points;
    returns the engine's output and every layer's agreement."""
    ref.load_attention_state(seq.attention_state())
    got = seq.prefill(token_ids, token_mask=token_mask, capture=True)
    forced = [(cap["h_in"], cap["pre_mix"]) for cap in seq.captures]
    ref.prefill(token_ids, token_mask=token_mask, capture=True, layer_inputs=forced)
    states, ostates = seq.attention_state(), [vars(s) for s in ref.states]
    out = []
    flip = False
    for i, (cap, ocap) in enumerate(zip(seq.captures, ref.captures, strict=True)):
        ids_match = "engram_ids" not in ocap or np.array_equal(cap["engram_ids"], ocap["engram_ids"])
        flip = flip or _flipped(cap, ocap, states[i], ostates[i])
        cos, rel, err = agreement(cap["h_out"], ocap["h_out"])
        out.append(LayerAgreement(i, cos, rel, err, flip, ids_match))
    return got, out


def synced_oracle(seq, oracle):
    """An oracle sequence standing where the engine sequence `seq` stands: the same position and
    engram hash history (integer state, so copying it loses nothing); `compare_call` then loads the
    attention state before the call. So one call can be checked at any point of a long run without
    the oracle having decoded the whole way in step with the engine."""
    ref = oracle.new_sequence(seq.max_seq)
    ref.position = seq.position
    if ref.hasher is not None:
        ref.hasher.history[:] = seq.hasher.history
    return ref
