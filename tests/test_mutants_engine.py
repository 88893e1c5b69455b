"""The engine-vs-oracle check (flashv41.check.compare_call) against broken engines.

Each mutant (tests/mutants.py: a line of a kernel edited, or a helper swapped) is a wiring bug that
the check's adoption of the engine's choices could hide if the check were lax: a window row written
to the wrong ring slot, a query attending the previous token's selection, a compressed / index-key
row published to the wrong group, a window-row quantiser that truncates (every row then "flips").
Each runs a prefill and two decode steps of the two-layer tiny model (tests/reliability.py) through
compare_call, which must reject one of the calls; the same calls pass without the mutant. Which
part of the check catches each is asserted too, so a mutant cannot pass for the wrong reason: the
state after the call (ring slot, cache group), the layer output at the strict bound (the attended
selection), the flip count (the quantiser).

The engram rows on the same model with MXFP4 tables (issue 46): a row's scale one exponent step
off (the E8M0 byte read one higher: every value doubled) and a row id off by one in the device
gather (the hasher's ids, which the check compares, stay right) must show as engram rows that
are not bit-identical to the oracle's. And a state gone wrong between calls (a window ring wiped
after its call was checked), which starting every call from the engine's state hides from the
per-layer comparison, must be caught by the chained one (flashv41.check.Chain): in the last layer
the chained oracle still takes every choice the engine takes, so the strict bound holds it; in the
first, later choices drift, and it must still leave the oracle by more than the drift bound.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from numba import cuda, uint32  # noqa: E402  (after conftest chose the backend)

import flashv41
import flashv41.stages.attention
import flashv41.stages.engram_rows
import flashv41.stages.kv_sources
import flashv41.stages.norm_rope_quant
import flashv41.stages.quants.mxfp4
from flashv41 import stages
from flashv41.check import REL_RMS, CallAgreement, Chain, ChainAgreement, compare_call
from flashv41.host.oracle import Oracle
from flashv41.host.quants import GGMLType
from flashv41.stages.device import device, f32_bits, f32_from_bits
from flashv41.stages.sparse_attention import sparse_attention
from tests.mutants import edited, mutant
from tests.reliability import TWO_LAYER_TINY

PROMPT = 8


@pytest.fixture(scope="module")
def two_layer(synth_model):
    model = flashv41.load_model(synth_model("tiny", **TWO_LAYER_TINY))
    yield model, Oracle(model, max_seq=32)
    model.close()


@pytest.fixture(scope="module")
def two_layer_mxfp4(synth_model):
    """The same two layers with MXFP4 engram tables (one 17-byte block a 32-value row)."""
    model = flashv41.load_model(synth_model("tiny", **{**TWO_LAYER_TINY, "table_type": "MXFP4"}))
    yield model, Oracle(model, max_seq=32)
    model.close()


def checked_run(model, oracle, between=None) -> tuple[list[CallAgreement], ChainAgreement]:
    """A prefill of PROMPT tokens, then two decode steps, each through compare_call on a fresh
    engine (so kernels built under a mutant are the ones it runs), with the chained comparison;
    `between(seq)` runs after each call but the last. Every call's agreement, and the chain's."""
    ids = np.random.default_rng(3).integers(0, 126, PROMPT + 2)
    calls = []
    with flashv41.Engine(model, max_seq=32, max_tokens=PROMPT) as engine:
        seq, ref = engine.new_sequence(), oracle.new_sequence()
        chain = Chain(oracle.new_sequence(), model.config.n_layers)
        parts = (ids[:PROMPT], ids[PROMPT:PROMPT + 1], ids[PROMPT + 1:])
        for k, call_ids in enumerate(parts):
            calls.append(compare_call(seq, ref, call_ids, chain=chain)[1])
            if between is not None and k + 1 < len(parts):
                between(seq)
    return calls, chain.agreement()


def first_disagreement(model, oracle) -> CallAgreement | None:
    """checked_run's first call that disagrees."""
    calls, _ = checked_run(model, oracle)
    return next((call for call in calls if not call.ok), None)


@cuda.jit
def _previous_rows(selection, shifted, n_tokens):
    """shifted[t] = selection[max(t - 1, 0)] for t < T (a thread per column)."""
    j = cuda.grid(1)
    if j < selection.shape[1]:
        for t in range(n_tokens):
            shifted[t, j] = selection[max(t - 1, 0), j]


def attending_the_previous_tokens_selection(q, ring, chunk_rows, comp_rows, positions, selection, sinks, scale, cos,
                                            sin, out, n_tokens, stream=0, workspace=None):
    """sparse_attention with each query but the first attending the previous token's selection."""
    if selection is not None:
        shifted = cuda.device_array(selection.shape, np.int32)
        _previous_rows[1, 64, stream](selection, shifted, n_tokens)
        selection = shifted
    sparse_attention(q, ring, chunk_rows, comp_rows, positions, selection, sinks, scale, cos, sin, out, n_tokens,
                     stream, workspace=workspace)


@device
def e4m3_truncating(x):
    """e4m3 rounding that drops the 20 low mantissa bits instead of rounding them (no saturation
    needed for these inputs: the scale keeps |x| <= 448)."""
    return f32_from_bits(f32_bits(x) & uint32(0xFFF00000))


def test_unmutated_engine_agrees(two_layer):
    assert first_disagreement(*two_layer) is None


def test_ring_slot_off_by_one(two_layer):
    late = edited(stages.attention, "_ring_write_kernel", "ring[positions[r] % window",
                  "ring[(positions[r] + 1) % window")
    with mutant(stages.attention, _ring_write_kernel=late):
        call = first_disagreement(*two_layer)
    assert call is not None and any("window_ring" in a.state_mismatch for a in call.layers), call


def test_decode_ring_slot_off_by_one(two_layer):
    """A decode step's window row goes to the ring with the kv chain (norm_rope_quant's mirror):
    the prefill's rows land right, the decode steps' one slot late."""
    late = edited(stages.norm_rope_quant, "fused_body", "ring[positions[r] % ring.shape[0]",
                  "ring[(positions[r] + 1) % ring.shape[0]")
    with mutant(stages.norm_rope_quant, fused_body=late):
        call = first_disagreement(*two_layer)
    assert call is not None and any("window_ring" in a.state_mismatch for a in call.layers), call


def test_cache_row_in_the_wrong_group(two_layer):
    late = edited(stages.kv_sources, "_scatter_rows_kernel", "cache[g0 + i // width, i % width]",
                  "cache[min(g0 + i // width + 1, cache.shape[0] - 1), i % width]")
    with mutant(stages.kv_sources, _scatter_rows_kernel=late):
        call = first_disagreement(*two_layer)
    assert call is not None and any({"compressed", "index_keys"} & set(a.state_mismatch) for a in call.layers), call


def test_attending_another_tokens_selection(two_layer):
    with mutant(stages.attention, sparse_attention=attending_the_previous_tokens_selection):
        call = first_disagreement(*two_layer)
    assert call is not None and any(not a.close and not a.state_mismatch for a in call.layers), call


def test_truncating_window_quantiser(two_layer):
    with mutant(stages.norm_rope_quant, e4m3_round=e4m3_truncating):
        call = first_disagreement(*two_layer)
    assert call is not None and not call.flips.rare, call


def test_unmutated_mxfp4_engine_agrees_chained_too(two_layer_mxfp4):
    """No flip, and the chained oracle takes every choice the engine takes: the strict bound holds."""
    calls, chained = checked_run(*two_layer_mxfp4)
    assert all(call.ok for call in calls), [call.describe() for call in calls]
    assert all(a.rows_match for call in calls for a in call.layers)
    assert chained.ok and chained.diverged.total == 0 and chained.bound == 2 * REL_RMS, chained.describe()
    assert chained.worst_rel_rms < 1e-5, chained.describe()  # what is left is fp32 accumulation order


def engram_rows_rejected(calls: list[CallAgreement]) -> None:
    bad = next((call for call in calls if not call.ok), None)
    assert bad is not None, "the check let the mutant through"
    assert all(not a.rows_match and a.ids_match for a in bad.layers), bad.describe()


def test_mxfp4_row_scale_off_by_one_exponent_step(two_layer_mxfp4):
    qt = stages.engram_rows.DEVICE_TYPES[GGMLType.MXFP4]
    high = edited(stages.quants.mxfp4, "dequant_mxfp4", "uint32(w[row, base + MXFP4_E])",
                  "uint32(w[row, base + MXFP4_E]) + 1")
    types = {**stages.engram_rows.DEVICE_TYPES, GGMLType.MXFP4: replace(qt, dequant=high)}
    with mutant(stages.engram_rows, DEVICE_TYPES=types):
        calls, chained = checked_run(*two_layer_mxfp4)
    engram_rows_rejected(calls)
    print(f"\n{chained.describe()}")


def test_row_id_off_by_one(two_layer_mxfp4):
    late = edited(stages.engram_rows, "rows_kernel", "row = ids[t, c] if gathered else r",
                  "row = (ids[t, c] + 1) % source.shape[0] if gathered else r")
    with mutant(stages.engram_rows, rows_kernel=late):
        calls, chained = checked_run(*two_layer_mxfp4)
    engram_rows_rejected(calls)
    print(f"\n{chained.describe()}")


@pytest.mark.parametrize(("layer", "drift"), [(1, False), (0, True)], ids=["last layer", "first layer"])
def test_window_ring_wiped_between_calls(two_layer_mxfp4, layer: int, drift: bool):
    def wipe(seq) -> None:
        ring = seq.state.layers[layer].ring
        ring.copy_to_device(np.zeros(ring.shape, ring.dtype))

    calls, chained = checked_run(*two_layer_mxfp4, between=wipe)
    assert all(call.ok for call in calls), "the per-layer comparison starts from the wiped state: it agrees"
    assert chained.flips == 0 and (chained.diverged.total > 0) == drift, chained.describe()
    print(f"\n{chained.describe()}")
    assert not chained.ok and chained.worst_call > 0, chained.describe()


def run_check(model) -> tuple[list[str], bool]:
    """`flashv41 run --check`'s own comparison (flashv41.runner.check_against_oracle) over the
    checked_run calls, on a fresh engine (built under whatever mutant is in force)."""
    from flashv41.runner import check_against_oracle

    ids = np.random.default_rng(3).integers(0, 126, PROMPT + 2)
    with flashv41.Engine(model, max_seq=32, max_tokens=PROMPT) as engine:
        return check_against_oracle(model, engine, ids[:PROMPT], ids[PROMPT:])


def test_run_check_passes_the_engine_and_fails_the_mxfp4_mutants(two_layer_mxfp4):
    """What a user runs: `run --check` says every layer agrees on the engine as it is, and reports a
    disagreement (returns False, the command's exit 1) under each engram-row mutant above."""
    model, _ = two_layer_mxfp4
    lines, ok = run_check(model)
    assert ok and lines[-1] == "check: every layer agrees", "\n".join(lines)
    qt = stages.engram_rows.DEVICE_TYPES[GGMLType.MXFP4]
    high = edited(stages.quants.mxfp4, "dequant_mxfp4", "uint32(w[row, base + MXFP4_E])",
                  "uint32(w[row, base + MXFP4_E]) + 1")
    late = edited(stages.engram_rows, "rows_kernel", "row = ids[t, c] if gathered else r",
                  "row = (ids[t, c] + 1) % source.shape[0] if gathered else r")
    for swap in ({"DEVICE_TYPES": {**stages.engram_rows.DEVICE_TYPES, GGMLType.MXFP4: replace(qt, dequant=high)}},
                 {"rows_kernel": late}):
        with mutant(stages.engram_rows, **swap):
            lines, ok = run_check(model)
        assert not ok and lines[-1] == "check: DISAGREEMENT beyond the bounds", "\n".join(lines)
