"""Checking the engine against the NumPy oracle, layer by layer (tests and `flashv41 run --check`).

The engine sums in fp32 where the oracle sums in float64, so values differ by accumulation
order. The model's discrete choices (fp8 window rows, fp4 compressed rows and index keys, the
candidate mask and the top-k selection fed by bf16 scores) turn such a last-bit difference, when
it lands on a rounding boundary, into a whole quantisation step or another selected row: a flip.
So a call is compared from identical starting points, choice for choice:

- the oracle's attention state is set to the engine's before the call, and each of the oracle's
  layers starts from the engine's input to that layer (highway and pre-mix);
- wherever the oracle makes one of those choices (host.oracle.attention.CHOICES), it goes on with
  the engine's instead, so the rest of the layer, and the layers after it through the shared
  runtime, see the very rows and selections the engine used. Where the two differ is counted:
  a flip is one quantised value, one selected position (a row's selections compared as sets) or
  one candidate-mask position that differs.

Then every layer's output highway must agree to cosine >= COSINE and relative RMS <= REL_RMS,
flips or not; the engram row ids and the selection each later layer attended (the one
the shared runtime hands down) must be equal; the layer's attention state after the call must be
the oracle's (window ring and both caches bit for bit, since every row in them is a choice the
oracle took from the engine: a row written to the wrong slot shows here, even though the next call
starts the oracle from the engine's state again; the compressor's fp32 partial group within the
layer bound, its empty slots exactly); and the flips of each kind must be rare: at most
MAX_FLIP_SHARE of that kind's values, or one row's worth where that is more. The row's worth is
for short calls: a one-ulp difference in a layer's input shifts every value of a row a little, so
honest flips come in small clusters within a row (up to 8 of the 64 values of a tiny-model window
row), and a one-token call of the tiny model has only six window rows and four selected positions
an index layer. Counted over a whole run (`Flips.add`), the row's worth no longer matters and the
1% is what a run is held to. A wiring bug cannot hide as a flip: the attended selection is compared
exactly, and a producer that is wrong differs in far more than 1% of its values over a run.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from flashv41.host.oracle.attention import CHOICES

COSINE = 0.99999
REL_RMS = 5e-3
MAX_FLIP_SHARE = 0.01


@dataclass
class Flips:
    """Flips per choice kind (host.oracle.attention.CHOICES) over a layer, a call or a run."""

    counts: Counter = field(default_factory=Counter)  # values that differed (the oracle took the engine's)
    units: Counter = field(default_factory=Counter)  # values compared
    row: Counter = field(default_factory=Counter)  # the widest row of each kind seen

    def count(self, kind: str, flips: int, units: int, row: int) -> None:
        self.counts[kind] += flips
        self.units[kind] += units
        self.row[kind] = max(self.row[kind], row)

    def add(self, other: Flips) -> None:
        for kind in other.units:
            self.count(kind, other.counts[kind], other.units[kind], other.row[kind])

    def allowed(self, kind: str) -> int:
        """How many flips of `kind` are rare among these values."""
        return max(int(MAX_FLIP_SHARE * self.units[kind]), self.row[kind])

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def rare(self) -> bool:
        return all(self.counts[k] <= self.allowed(k) for k in self.units)

    def describe(self) -> str:
        """'kind flips/values' for every kind compared, a '!' after those that are not rare."""
        return ", ".join(f"{k} {self.counts[k]}/{self.units[k]}" + ("" if self.counts[k] <= self.allowed(k) else
                                                                   f" (more than {self.allowed(k)}!)")
                         for k in CHOICES if self.units[k]) or "none compared"


@dataclass(frozen=True)
class LayerAgreement:
    layer: int
    cosine: float
    rel_rms: float
    max_error: float
    flips: Flips  # this layer's choices
    ids_match: bool  # engram row ids equal (True where the layer has no engram)
    selection_match: bool  # the selection the layer attended equals the oracle's (True without one)
    state_mismatch: tuple[str, ...]  # the parts of the layer's attention state after the call that differ

    @property
    def close(self) -> bool:
        """The output, the state and every exactly-compared integer agree."""
        return (self.ids_match and self.selection_match and not self.state_mismatch and self.cosine >= COSINE
                and self.rel_rms <= REL_RMS)

    def describe(self) -> str:
        return (f"layer {self.layer}: cosine {self.cosine:.7f}, rel rms {self.rel_rms:.2e}, engram ids match "
                f"{self.ids_match}, attended selection matches {self.selection_match}, state differs in "
                f"{', '.join(self.state_mismatch) or 'nothing'}, flips: {self.flips.describe()}")


@dataclass(frozen=True)
class CallAgreement:
    """One call's comparison: every layer, and the call's flips."""

    layers: list[LayerAgreement]
    flips: Flips

    @property
    def ok(self) -> bool:
        return self.flips.rare and all(a.close for a in self.layers)

    def describe(self) -> str:
        """What disagreed (empty when the call agrees)."""
        lines = [a.describe() for a in self.layers if not a.close]
        if not self.flips.rare:
            lines.append(f"flips not rare: {self.flips.describe()}")
        return "; ".join(lines)


def agreement(got: np.ndarray, want: np.ndarray) -> tuple[float, float, float]:
    """(cosine similarity, relative RMS error, max |error|) of two arrays."""
    g = np.asarray(got, np.float64).ravel()
    w = np.asarray(want, np.float64).ravel()
    cos = float(g @ w / max(np.linalg.norm(g) * np.linalg.norm(w), 1e-300))
    rel = float(np.sqrt(np.mean((g - w) ** 2)) / max(np.sqrt(np.mean(w**2)), 1e-300))
    return cos, rel, float(np.abs(g - w).max())


def state_mismatch(engine: dict[str, np.ndarray], oracle: dict[str, np.ndarray | None]) -> tuple[str, ...]:
    """The parts of one layer's attention state that differ after a call: the window ring and the
    caches exactly; the compressor's fp32 partial group (kv_state, score_state) to the layer bound,
    with its empty (-inf) slots in the same places."""
    bad = []
    for name, got in engine.items():
        want = oracle[name]
        if want is None or got.shape != want.shape:
            bad.append(name)
        elif np.array_equal(got, want):
            continue
        elif name in ("kv_state", "score_state"):
            finite = np.isfinite(want)
            if not np.array_equal(finite, np.isfinite(got)) or not np.array_equal(got[~finite], want[~finite]):
                bad.append(name)
            else:
                cos, rel, _ = agreement(got[finite], want[finite])
                if not (cos >= COSINE and rel <= REL_RMS):
                    bad.append(name)
        else:
            bad.append(name)
    return tuple(bad)


def selection_flips(own: np.ndarray, theirs: np.ndarray) -> tuple[int, int]:
    """(flips, units) of two selections [T, K] (-1 = none): per row, the positions one side chose
    and the other did not (a swap counts once), over the positions chosen."""
    flips = units = 0
    for a, b in zip(own, theirs, strict=True):
        sa, sb = set(a[a >= 0].tolist()), set(b[b >= 0].tolist())
        flips += max(len(sa - sb), len(sb - sa))
        units += max(len(sa), len(sb))
    return flips, units


class EngineChoices:
    """The oracle's Adopt hook for one layer of one call: returns the engine's value of each choice
    (from the layer's capture and the engine's attention state after the call) and counts flips."""

    def __init__(self, capture: dict, state: dict):
        self.capture = capture
        self.state = state
        self.flips = Flips()

    def engine_value(self, kind: str) -> np.ndarray:
        if kind == "window_rows":
            return self.capture["kv"]
        if kind in ("index_keys", "compressed"):  # the rows of the groups the call completed
            return self.state[kind][self.capture["groups"]]
        return self.capture[kind]

    def __call__(self, kind: str, own: np.ndarray) -> np.ndarray:
        theirs = np.asarray(self.engine_value(kind)).astype(own.dtype)
        if theirs.shape != own.shape:  # not a flip: the two made different numbers of choices
            size = max(own.size, theirs.size, 1)
            self.flips.count(kind, size, size, 0)
            return own
        if kind == "selection":
            flips, units = selection_flips(own, theirs)
        else:
            flips, units = int(np.count_nonzero(own != theirs)), own.size
        self.flips.count(kind, flips, units, own.shape[-1])
        return theirs


def compare_call(seq, ref, token_ids, token_mask=None) -> tuple[np.ndarray, CallAgreement]:
    """Run one call on an engine sequence and on an oracle sequence from the same starting points,
    the oracle adopting the engine's choices; returns the engine's output and the agreement."""
    ref.load_attention_state(seq.attention_state())
    got = seq.prefill(token_ids, token_mask=token_mask, capture=True)
    forced = [(cap["h_in"], cap["pre_mix"]) for cap in seq.captures]
    states = seq.attention_state()
    choices = [EngineChoices(cap, state) for cap, state in zip(seq.captures, states, strict=True)]
    ref.prefill(token_ids, token_mask=token_mask, capture=True, layer_inputs=forced, choices=choices)
    layers = []
    flips = Flips()
    for i, (cap, ocap, chosen) in enumerate(zip(seq.captures, ref.captures, choices, strict=True)):
        ids_match = "engram_ids" not in ocap or np.array_equal(cap["engram_ids"], ocap["engram_ids"])
        selection_match = "selection" not in ocap or np.array_equal(cap["selection"], ocap["selection"])
        cos, rel, err = agreement(cap["h_out"], ocap["h_out"])
        mismatch = state_mismatch(states[i], vars(ref.states[i]))
        layers.append(LayerAgreement(i, cos, rel, err, chosen.flips, ids_match, selection_match, mismatch))
        flips.add(chosen.flips)
    return got, CallAgreement(layers, flips)


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
