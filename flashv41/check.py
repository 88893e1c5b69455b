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

Then every layer's output highway must agree to cosine >= COSINE and relative RMS <= REL_RMS, flips
or not; the engram row ids, the engram rows (dequantised, bf16: bit for bit, SPEC section 4) and the
selection each later layer attended (the one the shared runtime hands down) must be equal; the
layer's attention state after the call must be the oracle's (window ring and both caches bit for
bit, since every row in them is a choice the oracle took from the engine: a row written to the wrong
slot shows here, even though the next call starts the oracle from the engine's state again; the
compressor's fp32 partial group within the layer bound, its empty slots exactly); and the flips of
each kind must be rare: at most MAX_FLIP_SHARE of that kind's values, or one row's worth where that
is more. The row's worth is for short calls: a one-ulp difference in a layer's input shifts every
value of a row a little, so honest flips come in small clusters within a row (up to 8 of the 64
values of a tiny-model window row), and a one-token call of the tiny model has only six window rows
and four selected positions an index layer. Counted over a whole run (`Flips.add`), the row's worth
no longer matters and the 1% is what a run is held to. A wiring bug cannot hide as a flip: the
attended selection is compared exactly, and a producer that is wrong differs in far more than 1% of
its values over a run.

What starting every call from the engine's own state cannot see is the state itself going wrong
between calls (a stray write into a sequence's window ring or caches after a call was checked): the
oracle would start the next call from the damage. So a run is also compared whole (`Chain`): an
oracle sequence runs the same calls from position 0 on its own, nothing loaded, forced or adopted
from the engine, and each call's output highway is compared with the engine's (`ChainAgreement`).
That comparison measures drift, and drift is amplified: a last-bit difference that lands on a
rounding boundary anywhere up the stack, a choice but also a bf16 rounding of a product (which
the per-layer bound admits and no flip count sees), changes later choices of the chained oracle,
and from there the two part by up to CHAIN_DRIFT (SPEC section 3: the reference differs from itself
by 15% when only its tie rule changes; this engine on an 8-layer small-preset model, 19 tokens, no
flip counted: 3.8%). So the chain is held only where the per-layer comparison counted no flip, and
its bound is derived from what is left:
- the chained oracle took every choice the engine took (none of its choices differ): the two runs
  differ by what each layer adds alone, at most REL_RMS each, taken as passed on without
  amplification (the highway's residual mix is doubly stochastic, and a sublayer reads the highway
  through an RMS norm; measured: 1e-7 on the tiny models), so the worst call's relative RMS error
  must be <= n_layers * REL_RMS;
- some of its choices differ: drift, <= max(CHAIN_DRIFT, n_layers * REL_RMS).
With flips counted, the chained numbers are reported and not held (SPEC section 3: a flip chained
through the stack is amplified beyond any bound that would still reject a wrong engine).

The head (`head_agreement`) is compared as each layer is, from the same starting point: the
oracle's head runs from the engine's last layer (`oracle_head`: its highway after the attention
sublayer, whence the collapse weights pre, and its final highway h). Taking the oracle's own h
instead would add the last layer's rounding difference (up to REL_RMS), which a bf16 input passes
on as many ulps wherever the collapse cancels (seen on an H100 at flash dimensions: 94% of the
inputs bit-equal, one 222 ulps apart, the logits still inside their bound). Its input
x = bf16(w r y), y = bf16(sum_c pre_c h_c) and r the RMS norm's scale, rounds twice: from the same
h, the two sides' fp32 sums (pre included) differ by rounding only, so y_e and y_o are equal but where
a rounding boundary lies between them, one bf16 ulp of y apart, which the norm passes on as at
most |w r| ulp(y) <= 2^-7 |x| <= 2 ulp(x), and the final rounding adds up to one ulp more: the
inputs are at least BIT_EQUAL_MIN bit-equal and none more than INPUT_ULPS = 3 bf16 ulps apart (of
the larger of the two values). The logits, engine l_e = fp32 sum of x_e w, oracle l_o = x_o w
(float64, rounded once), then obey, per position and vocabulary row v (K = dim, u = 2^-24):

    |l_e - l_o| <= LAMBDA sqrt(n) u sum_k |x_e,k| a_vk      the engine's fp32 sum (tests/bounds.py)
                 + sum_k |w_vk| min(|x_e,k - x_o,k|, 3 ulp_k)   the inputs' difference, passed on
                 + u |l_o|                                  the oracle's one rounding

with a = |w|, n = K (or, for the types the products add as two parts, Q2_K / Q4_K / Q5_K, the
parts' magnitudes and n = 2K: tests/bounds.py's SPLIT_KERNELS). An input difference counts at most
INPUT_ULPS, so a head that misreads its input (its norm weight ignored, a copy dropped) fails the
bound even where it also fails the input rule. The argmax must agree wherever the oracle's top two
logits are further apart than the bound allows the two to move (a closer pair is a tie, reported).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from flashv41.host.errors import InputError
from flashv41.host.oracle.attention import CHOICES
from flashv41.host.quants import GGMLType, q2_k_terms, q4_k_terms, q5_k_terms

COSINE = 0.99999
REL_RMS = 5e-3
MAX_FLIP_SHARE = 0.01
CHAIN_DRIFT = 0.15  # relative RMS two correct implementations' chained runs may part by (SPEC section 3)
BIT_EQUAL_MIN = 0.99  # the head's inputs: the share of values bit-equal to the oracle's (tests/bounds.py)
INPUT_ULPS = 3  # a normed bf16 input's largest honest difference, in bf16 ulps (module docstring)
LAMBDA = 8.0  # the probabilistic fp32 sum bound's factor (tests/bounds.py derives it)
U = 2.0**-24
PART_TERMS = {GGMLType.Q2_K: q2_k_terms, GGMLType.Q4_K: q4_k_terms, GGMLType.Q5_K: q5_k_terms}


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

    def describe(self, held: bool = True) -> str:
        """'kind flips/values' for every kind compared; held: a '!' after those that are not rare."""
        return ", ".join(f"{k} {self.counts[k]}/{self.units[k]}" + ("" if not held or self.counts[k] <= self.allowed(k)
                                                                   else f" (more than {self.allowed(k)}!)")
                         for k in CHOICES if self.units[k]) or "none compared"


@dataclass(frozen=True)
class LayerAgreement:
    layer: int
    cosine: float
    rel_rms: float
    max_error: float
    flips: Flips  # this layer's choices
    ids_match: bool  # engram row ids equal (True where the layer has no engram)
    rows_match: bool  # engram rows (dequantised, bf16) bit-identical (True where the layer has no engram)
    selection_match: bool  # the selection the layer attended equals the oracle's (True without one)
    state_mismatch: tuple[str, ...]  # the parts of the layer's attention state after the call that differ

    @property
    def close(self) -> bool:
        """The output, the state and every exactly-compared integer agree."""
        return (self.ids_match and self.rows_match and self.selection_match and not self.state_mismatch
                and self.cosine >= COSINE and self.rel_rms <= REL_RMS)

    def describe(self) -> str:
        return (f"layer {self.layer}: cosine {self.cosine:.7f}, rel rms {self.rel_rms:.2e}, engram ids match "
                f"{self.ids_match}, engram rows match {self.rows_match}, attended selection matches "
                f"{self.selection_match}, state differs in "
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


def bits_equal(a: np.ndarray, b: np.ndarray) -> bool:
    """Two float arrays equal bit for bit (bf16 values held as float32)."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def compare_call(seq, ref, token_ids, token_mask=None, chain: Chain | None = None) -> tuple[np.ndarray, CallAgreement]:
    """Run one call on an engine sequence and on an oracle sequence from the same starting points,
    the oracle adopting the engine's choices; returns the engine's output and the agreement.
    chain: the run's chained comparison, which follows the call (Chain.follow)."""
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
        rows_match = "engram_rows" not in ocap or bits_equal(cap["engram_rows"], ocap["engram_rows"])
        selection_match = "selection" not in ocap or np.array_equal(cap["selection"], ocap["selection"])
        cos, rel, err = agreement(cap["h_out"], ocap["h_out"])
        mismatch = state_mismatch(states[i], vars(ref.states[i]))
        layers.append(LayerAgreement(i, cos, rel, err, chosen.flips, ids_match, rows_match, selection_match,
                                     mismatch))
        flips.add(chosen.flips)
    call = CallAgreement(layers, flips)
    if chain is not None:
        chain.follow(seq, token_ids, token_mask, got, states, flips.total)
    return got, call


class ChainChoices(EngineChoices):
    """The chained oracle's hook for one layer of one call: counts where its choices and the engine's
    differ, and keeps its own (nothing of the engine's enters the chained run)."""

    def __call__(self, kind: str, own: np.ndarray) -> np.ndarray:
        super().__call__(kind, own)
        return own


@dataclass(frozen=True)
class ChainAgreement:
    """The engine's output highways over a run against an oracle sequence that ran the same calls
    from position 0 on its own (module docstring: why and how it is held)."""

    calls: int
    cosine: float  # over the whole run's output rows
    rel_rms: float
    max_error: float
    worst_call: int  # the call whose output is furthest from the chained oracle's (relative RMS)
    worst_rel_rms: float  # what the bound holds
    flips: int  # the per-layer comparison's flips over the run
    diverged: Flips  # the chained oracle's choices that differ from the engine's
    n_layers: int

    @property
    def bound(self) -> float | None:
        """The worst call's relative RMS bound, or None where flips were counted (not held)."""
        if self.flips:
            return None
        strict = self.n_layers * REL_RMS
        return strict if self.diverged.total == 0 else max(CHAIN_DRIFT, strict)

    @property
    def ok(self) -> bool:
        return self.bound is None or self.worst_rel_rms <= self.bound

    def describe(self) -> str:
        bound = self.bound
        if bound is None:
            held = f"not held: the per-layer comparison counted {self.flips} flips, and a flip is amplified chained"
        else:
            kind = "the same choices" if self.diverged.total == 0 else "drift"
            held = (f"held to rel rms <= {bound:.3g} ({kind}, {self.n_layers} layers): "
                    + ("ok" if self.ok else "LEFT THE ORACLE"))
        return (f"chained ({self.calls} calls, the oracle from position 0 on its own): cosine {self.cosine:.8f}, "
                f"rel rms {self.rel_rms:.2e}, max |err| {self.max_error:.3e}; worst call {self.worst_call} rel rms "
                f"{self.worst_rel_rms:.2e}; {held}; the chained oracle's choices that differ from the engine's: "
                f"{self.diverged.describe(held=False)}")


class Chain:
    """An oracle sequence run beside an engine sequence from position 0, call for call, on its own:
    each call's output highways of the two are kept for `agreement`. Feed it every call of the engine
    sequence: through compare_call(..., chain=...), or `step` for a call the per-layer comparison
    does not check (it runs the engine call itself)."""

    def __init__(self, oracle_seq, n_layers: int):
        if oracle_seq.position != 0:
            raise InputError(f"the chained oracle must start at position 0, not {oracle_seq.position}")
        self.ref = oracle_seq
        self.n_layers = n_layers
        self.outputs: list[tuple[np.ndarray, np.ndarray]] = []  # (engine, oracle) highways [T, hc, C] a call
        self.flips = 0
        self.diverged = Flips()

    def follow(self, seq, token_ids, token_mask, got: np.ndarray, states: list[dict], flips: int = 0) -> None:
        """The chained oracle's run of the call `seq` just made with captures (`got` its output,
        `states` its attention state after the call, `flips` what the per-layer comparison counted)."""
        if self.ref.position + np.size(token_ids) != seq.position:
            raise InputError(f"the chained oracle at {self.ref.position} does not follow the engine sequence "
                             f"(at {seq.position} after {np.size(token_ids)} tokens): feed it every call")
        hooks = [ChainChoices(cap, state) for cap, state in zip(seq.captures, states, strict=True)]
        want = self.ref.prefill(token_ids, token_mask=token_mask, choices=hooks)
        for hook in hooks:
            self.diverged.add(hook.flips)
        self.flips += flips
        self.outputs.append((np.asarray(got), want))

    def step(self, seq, token_ids, token_mask=None) -> np.ndarray:
        """One engine call (a chunk of at most max_tokens, captured) and the chained oracle's; returns
        the engine's output."""
        got = seq.prefill(token_ids, token_mask=token_mask, capture=True)
        self.follow(seq, token_ids, token_mask, got, seq.attention_state())
        return got

    def agreement(self) -> ChainAgreement:
        if not self.outputs:
            raise InputError("the chained comparison has no call to compare")
        per_call = [agreement(g, w)[1] for g, w in self.outputs]
        worst = int(np.argmax(per_call))
        got = np.concatenate([g for g, _ in self.outputs])
        want = np.concatenate([w for _, w in self.outputs])
        cos, rel, err = agreement(got, want)
        return ChainAgreement(len(self.outputs), cos, rel, err, worst, per_call[worst], self.flips, self.diverged,
                              self.n_layers)


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


def bf16_ulp(x: np.ndarray) -> np.ndarray:
    """The spacing of bf16 values at |x| (never below the smallest normal's)."""
    mag = np.maximum(np.abs(np.asarray(x, np.float64)), 2.0**-126)
    return 2.0 ** (np.floor(np.log2(mag)) - 7)


@dataclass(frozen=True)
class HeadAgreement:
    """The engine's head against the oracle's, over T positions (module docstring: the bound)."""

    positions: int
    input_equal: float  # share of the head inputs bit-equal
    input_ulps: float  # the largest input difference, in bf16 ulps of the larger value
    worst: float  # the largest logit error as a fraction of its bound
    max_error: float
    argmax_equal: int  # positions whose argmax agree
    ties: int  # positions whose argmax differ within the bound (the oracle's top two closer than it)

    @property
    def ok(self) -> bool:
        return (self.input_equal >= BIT_EQUAL_MIN and self.input_ulps <= INPUT_ULPS and self.worst <= 1
                and self.argmax_equal + self.ties == self.positions)

    def describe(self) -> str:
        return (f"head over {self.positions} positions: inputs {self.input_equal:.2%} bit-equal, at most "
                f"{self.input_ulps:g} bf16 ulp apart; logits max |err| {self.max_error:.3e}, {self.worst:.3f} of "
                f"the bound; argmax equal at {self.argmax_equal}" + (f", {self.ties} ties within the bound"
                                                                      if self.ties else ""))


def output_magnitudes(output) -> tuple[np.ndarray, np.ndarray, int]:
    """(w [V, C], a [V, C], n) of the head's output matrix (a TensorRef): its values, the
    magnitudes the fp32 bound weighs (the two parts' for Q2_K / Q4_K / Q5_K) and the terms' count."""
    w = output.dequantize()
    terms = PART_TERMS.get(output.ggml_type)
    if terms is None:
        return w, np.abs(w), w.shape[1]
    scaled, minimum = terms(output.raw())
    return w, (np.abs(scaled) + np.abs(minimum)).reshape(w.shape), 2 * w.shape[1]


def head_agreement(x_e: np.ndarray, x_o: np.ndarray, l_e: np.ndarray, l_o: np.ndarray, output) -> HeadAgreement:
    """The engine's head inputs x_e [T, C] (bf16 values) and logits l_e [T, V] against the oracle's
    (module docstring); `output` the model's output TensorRef."""
    x_e, x_o = np.asarray(x_e, np.float64), np.asarray(x_o, np.float64)
    l_e, l_o = np.asarray(l_e, np.float64), np.asarray(l_o, np.float64)
    w, a, n = output_magnitudes(output)
    ulp = np.maximum(bf16_ulp(x_o), bf16_ulp(x_e))
    dx = np.minimum(np.abs(x_e - x_o), INPUT_ULPS * ulp)
    bound = LAMBDA * np.sqrt(n) * U * (np.abs(x_e) @ a.T) + dx @ np.abs(w.astype(np.float64)).T + U * np.abs(l_o)
    err = np.abs(l_e - l_o)
    top2 = np.sort(l_o, axis=-1)[:, -2:] if l_o.shape[1] > 1 else np.concatenate([l_o, l_o - np.inf], axis=1)
    same = np.argmax(l_e, axis=-1) == np.argmax(l_o, axis=-1)
    rows = np.arange(l_o.shape[0])
    allowed = bound[rows, np.argmax(l_o, -1)] + bound[rows, np.argmax(l_e, -1)]
    ties = int((~same & (top2[:, 1] - top2[:, 0] <= allowed)).sum())
    return HeadAgreement(l_o.shape[0], float((x_e == x_o).mean()), float((np.abs(x_e - x_o) / ulp).max()),
                         float((err / np.maximum(bound, 2.0**-149)).max()), float(err.max()), int(same.sum()), ties)


def oracle_head(seq, ref) -> tuple[np.ndarray, np.ndarray]:
    """The oracle sequence's head (input x [T, C], logits [T, vocab]) from the engine sequence's last
    layer of its last call (module docstring), which must have run with capture=True."""
    if not seq.captures:
        raise ValueError("the engine's last call kept no captures (run it with capture=True)")
    last = seq.captures[-1]
    return ref.head_from(last["h_attn"], last["h_out"])


def engine_head_input(seq) -> np.ndarray:
    """The head's input the engine sequence's last call left, bf16 values [T, C] (float32)."""
    from flashv41.host.numerics import from_bits

    return from_bits(seq.head_x[:seq.head_rows].copy_to_host())


def follow_adopting(seq, ref, token_ids) -> Flips:
    """One call on an engine sequence (captured) and the same call on an oracle sequence that goes
    on from its own state and inputs but takes every attention choice the engine took
    (EngineChoices): the two then differ by rounding only, whatever the run's length. Returns the
    call's flips (where the oracle's own choice differed and it took the engine's)."""
    seq.prefill(token_ids, capture=True)
    hooks = [EngineChoices(cap, state) for cap, state in zip(seq.captures, seq.attention_state(), strict=True)]
    ref.prefill(token_ids, choices=hooks)
    flips = Flips()
    for hook in hooks:
        flips.add(hook.flips)
    return flips
