"""Property tests (hypothesis, seeded and small for CI) of the pieces the existing property tests
leave out, each against an independent formulation:

- the compiled engram hasher (host.engram_hash_fast.FastEngramHasher, float-reciprocal modulo) against
  tests/test_engram_hash.py's scalar Python-integer hasher, on random engram configs with random
  token maps and primes up to 2^46 (the existing property test drives the NumPy oracle hasher
  only, with primes below 600);
- the Q8_0 and Q2_K codecs (host.quants) against gguf-py: our Q8_0 bytes equal gguf-py's, and
  gguf-py dequantises our Q8_0 and Q2_K bytes to exactly our values (the Q2_K error also within
  what the stored scales allow);
- act_quant (host and kernel) and fp4_quant (kernel) against a per-element restatement in Python
  floats (scale from frexp, the e4m3 / E2M1 grids by table lookup), on blocks built to sit on
  rounding ties as well as random ones;
- the GPU top-k / candidate-block selection kernel (stages.indexer.select) against the brute-force
  sort of tests/test_oracle_attention.py (ties to the lower position), on random tie-heavy scores.
"""

from __future__ import annotations

import math

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as GQ
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from numba import cuda  # noqa: E402  (after conftest chose the backend)

from flashv41.host.engram_hash_fast import FastEngramHasher
from flashv41.host.numerics import act_quant, bf16, from_bits, to_bits
from flashv41.host.quants import GGMLType, dequantize, quantize
from flashv41.stages import indexer  # noqa: E402
from flashv41.stages import norm_rope_quant as nrq  # noqa: E402
from tests.test_engram_hash import ScalarHasher, assert_ids_equal, engram_configs, streams
from tests.test_numerics import E4M3_VALUES, e2m1_by_grid, e4m3_by_table
from tests.test_oracle_attention import brute_select, config, patterns, role
from tests.test_quants import _q2_k_excess

F32 = np.float32


def property_settings(n: int) -> settings:
    return settings(max_examples=n, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# --- the compiled hasher -------------------------------------------------------------------------------


@property_settings(40)
@given(data=st.data())
def test_compiled_hasher_against_the_scalar_one(data: st.DataObject) -> None:
    e = data.draw(engram_configs(wide=True))
    ids, mask, cuts = data.draw(streams(e))
    bounds = [0, *cuts, ids.size]
    fast, scalar = FastEngramHasher(e, ids.size), ScalarHasher(e)
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        got = fast.hash(ids[a:b], a, None if mask is None else mask[a:b])
        for p in range(a, b):
            scalar.put(p, int(ids[p]), True if mask is None else bool(mask[p]))
        assert_ids_equal(got, scalar, a, f"chunk {a}..{b - 1} (primes up to {int(e.primes.max())})")


# --- codecs against gguf-py ---------------------------------------------------------------------------------


@st.composite
def rows(draw: st.DrawFn, width: int, block: int, exponents: tuple[int, int]) -> np.ndarray:
    """One row of float32 values, block by block: random values at a random scale 2^k (k in
    `exponents`: the range the format's fp16 scales hold), all zeros, a constant, or one large value
    among small ones."""
    out = []
    for _ in range(width // block):
        kind = draw(st.sampled_from(["random", "random", "zeros", "constant", "spike"]))
        scale = 2.0 ** draw(st.integers(*exponents))
        if kind == "zeros":
            values = np.zeros(block)
        elif kind == "constant":
            values = np.full(block, draw(st.floats(-4, 4, width=32)))
        else:
            values = np.array(draw(st.lists(st.floats(-1, 1, width=32), min_size=block, max_size=block)))
            if kind == "spike":
                values[draw(st.integers(0, block - 1))] = draw(st.sampled_from([-64.0, 50.0, 127.0]))
        out.append(values * scale)
    return np.concatenate(out).astype(F32)[None, :]


@property_settings(60)
@given(rows(64, 32, (-40, 15)))
def test_q8_0_against_gguf_py(x: np.ndarray) -> None:
    ours = quantize(x, GGMLType.Q8_0)
    assert np.array_equal(ours, gguf.quants.quantize(x, GQ.Q8_0)), "Q8_0 bytes differ from gguf-py's"
    theirs = np.asarray(gguf.quants.dequantize(ours, GQ.Q8_0), F32).reshape(x.shape)
    assert np.array_equal(dequantize(ours, GGMLType.Q8_0, 64).view(np.uint32), theirs.view(np.uint32))


@property_settings(40)
@given(rows(256, 16, (-14, 8)))
def test_q2_k_against_gguf_py(x: np.ndarray) -> None:
    stored = quantize(x, GGMLType.Q2_K)  # gguf-py has no Q2_K quantiser to compare with
    ours = dequantize(stored, GGMLType.Q2_K, 256)
    theirs = np.asarray(gguf.quants.dequantize(stored, GQ.Q2_K), F32).reshape(x.shape)
    assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32)), "gguf-py reads our Q2_K otherwise"
    excess = _q2_k_excess(x, ours, stored)
    assert excess.max() <= 0, f"value {int(np.argmax(excess))}: error past what the stored scales allow"


# --- the quantisers, per element ------------------------------------------------------------------------


def pow2_ceil(a: float) -> float:
    """2^ceil(log2 a) for a float32 a > 0, from frexp (a = m * 2^e, m in [0.5, 1))."""
    m, e = math.frexp(a)
    return 2.0 ** (e - 1) if m == 0.5 else 2.0**e


def act_quant_by_element(block: np.ndarray) -> np.ndarray:
    amax = max(float(np.abs(block).max()), 1e-4)
    scale = pow2_ceil(float(F32(amax) * F32(1 / 448)))
    return bf16(np.array([e4m3_by_table(float(F32(v) / F32(scale))) * scale for v in block], F32))


def fp4_by_element(block: np.ndarray, e4m3_scale: bool) -> np.ndarray:
    amax = float(np.abs(block).max())
    if e4m3_scale:
        scale = e4m3_by_table(float(F32(max(amax, 6 * 2.0**-9)) / F32(6)))
    else:
        scale = pow2_ceil(float(F32(max(amax, 6 * 2.0**-126)) * F32(1 / 6)))
    return bf16(np.array([e2m1_by_grid(float(F32(float(v) / scale))) * scale for v in block], F32))


E4M3_MIDPOINTS = (E4M3_VALUES[1:] + E4M3_VALUES[:-1]) / 2
E2M1_POINTS = (0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0)


@st.composite
def quant_blocks(draw: st.DrawFn, block: int, fp8: bool) -> np.ndarray:
    """bf16 values for one block: random at a random scale, or grid values and midpoints between
    them times an exact power-of-two scale that the block's amax sets (so the quantiser meets ties)."""
    k = draw(st.integers(-30, 30))
    if draw(st.booleans()):
        values = np.array(draw(st.lists(st.floats(-1, 1, width=32), min_size=block, max_size=block)))
        return bf16((values * 2.0**k).astype(F32))
    grid = np.concatenate([E4M3_VALUES, E4M3_MIDPOINTS]) if fp8 else np.array(E2M1_POINTS)
    picks = np.array(draw(st.lists(st.sampled_from(grid.tolist()), min_size=block, max_size=block)))
    signs = np.array(draw(st.lists(st.sampled_from([-1.0, 1.0]), min_size=block, max_size=block)))
    values = picks * signs
    values[0] = 448.0 if fp8 else 6.0  # amax: scale exactly 2^k (E8M0) or e4m3(1) * 2^k
    return bf16((values * 2.0**k).astype(F32))


@property_settings(200)
@given(quant_blocks(32, fp8=True))
def test_act_quant_per_element(block: np.ndarray) -> None:
    got, want = act_quant(block), act_quant_by_element(block)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (block, got, want)


@property_settings(30)
@given(st.lists(quant_blocks(32, fp8=True), min_size=1, max_size=4))
def test_act_quant_kernel_per_element(blocks: list[np.ndarray]) -> None:
    x = np.concatenate(blocks).reshape(1, -1) if len(blocks) % 2 else np.stack(blocks).reshape(2, -1)
    dev = cuda.to_device(to_bits(x))
    nrq.act_quant(dev, x.shape[0])
    want = np.concatenate([act_quant_by_element(b) for b in x.reshape(-1, 32)]).reshape(x.shape)
    got = from_bits(dev.copy_to_host())
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (x, got, want)


@property_settings(40)
@given(st.data())
def test_fp4_kernel_per_element(data: st.DataObject) -> None:
    block, e4m3_scale = data.draw(st.sampled_from([(16, True), (32, False)]))
    blocks = data.draw(st.lists(quant_blocks(block, fp8=False), min_size=1, max_size=4))
    x = np.concatenate(blocks).reshape(1, -1)
    dev = cuda.to_device(to_bits(x))
    nrq.fp4_quant(dev, block, e4m3_scale, 1)
    want = np.concatenate([fp4_by_element(b, e4m3_scale) for b in x.reshape(-1, block)]).reshape(x.shape)
    got = from_bits(dev.copy_to_host())
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (x, got, want)


# --- the selection kernel against the brute force -----------------------------------------------------------


@pytest.mark.slow
@property_settings(40)
@given(patterns())
def test_select_kernel_against_brute_force(case: tuple[np.ndarray, int, int, int, int, int]) -> None:
    """A candidate source, then a later index source respecting its blocks (on the scores reversed),
    then a plain index source, each against the brute-force sort."""
    score, start, ratio, topk, topk_blocks, block = case
    t, width = score.shape
    positions = start + np.arange(t)
    pos = cuda.to_device(positions.astype(np.int32))
    n_blocks = -(-width // block)
    cand = cuda.to_device(np.full((t, n_blocks), 7, np.uint8))
    other = np.ascontiguousarray(score[:, ::-1])
    candidates = None
    for kind, scores, source in (("source", score, True), ("user", other, False), ("plain", score, False)):
        want, new = brute_select(kind, scores, positions, ratio, topk, topk_blocks, block, candidates)
        sel = cuda.to_device(np.full((t, topk), 99, np.int32))
        indexer.select(config(topk, topk_blocks, block), role(kind, ratio), cuda.to_device(to_bits(bf16(scores))), pos,
                       cand, sel, t)
        got = sel.copy_to_host()
        assert np.array_equal(got, want), f"{kind}: scores {scores.tolist()} at {positions.tolist()}: " \
                                          f"got {got.tolist()}, brute force {want.tolist()}"
        if source:
            kept = np.repeat(cand.copy_to_host().astype(bool), block, axis=1)[:, :width]
            assert kept.tolist() == new, "candidate blocks"
            candidates = new
