"""GPU only (`-m gpu`; `-s` shows the largest errors): the engram stages at the small preset and at
V4.1-Flash dimensions (24 cols x 256, dim 5120, hc 4), held to the oracle with the bounds of
tests/test_engram_stages.py: rows bit-exact, kv under tests/bounds.py's product rules (at least 99%
of outputs bit-equal to the oracle, the rest within the sqrt(K) bound), the gate within gate_bounds;
both table residencies.

The flash-dimension model is the flash preset cut to two layers (a window-only layer and a kv +
index source), both with engram, a 1024-token vocabulary and tables of about 200k rows.
"""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda  # noqa: E402  (after conftest chose the backend)

import flashv41
from flashv41.bench.engram import random_stored
from flashv41.host.engram_hash_fast import FastEngramHasher
from flashv41.host.numerics import F32, to_bits
from flashv41.host.oracle import Oracle
from flashv41.host.oracle.engram import engram_gate as oracle_gate
from flashv41.host.quants import GGMLType, dequantize
from flashv41.stages.engram import EngramStage
from flashv41.stages.engram_gate import engram_gate
from flashv41.stages.linear import DeviceWeight
from tests.bounds import assert_within
from tests.test_engram_stages import _gate_inputs, check_apply, gate_bounds
from tests.test_linear import check_linear

# one worker of the GPU suite sets up each module fixture once (tools/gpu_suite.sh's --dist loadgroup)
pytestmark = [pytest.mark.gpu, pytest.mark.xdist_group("engram_gpu")]

FLASH = dict(compress_ratios=(0, 2), kv_sources=(1,), index_sources=(1,), candidate_source=99, engram_layers=(0, 1),
             vocab=1024, engram_rows=200_000)


def _model(path):
    model = flashv41.load_model(path)
    return model, Oracle(model, max_seq=256)


@pytest.fixture(scope="module", params=["Q8_0", "BF16"])
def small(request, synth_model):
    model, oracle = _model(synth_model("small", table_type=request.param))
    yield request.param, model, oracle
    model.close()


@pytest.fixture(scope="module", params=["Q2_K", "Q8_0"])
def flash(request, synth_model):
    model, oracle = _model(synth_model("flash", table_type=request.param, **FLASH))
    yield request.param, model, oracle
    model.close()


def _run_sequence(table_type, model, oracle, residency: str, chunks: tuple[int, ...]) -> None:
    """Prefill chunks then decode steps of one sequence through every engram layer in turn."""
    cfg = model.config
    st = EngramStage(model, max(chunks), residency)
    try:
        rng = np.random.default_rng(len(chunks))
        hasher = FastEngramHasher(cfg.engram, 256)
        pos = 0
        for i, n in enumerate(chunks):
            ids = rng.integers(0, cfg.vocab_size, n)
            mask = rng.random(n) < 0.9 if i % 3 == 2 else None
            hashes = hasher.hash(ids, pos, mask)
            layer = cfg.engram.layer_ids[i % len(cfg.engram.layer_ids)]
            h = (rng.standard_normal((n, cfg.hc, cfg.dim)) * 0.5).astype(F32)
            err = check_apply(model, oracle, st, layer, h, hashes[:, cfg.engram.hash_index(layer)], mask)
            print(f"{table_type} {residency} layer {layer} T={n} at {pos}: max |err| kv {err['kv']:.3e} "
                  f"gate {err['gate']:.3e} h {err['h']:.3e}")
            pos += n
    finally:
        st.free()


@pytest.mark.parametrize("residency", ["device", "pinned", "host"])
def test_small(small, residency: str) -> None:
    _run_sequence(*small, residency, (64, 11, 5, 1, 1, 8))


@pytest.mark.parametrize("residency", ["device", "pinned", "host"])
def test_flash_dimensions(flash, residency: str) -> None:
    table_type, model, _ = flash
    e = model.config.engram
    assert (e.cols, e.head_dim, model.config.dim, model.config.hc) == (24, 256, 5120, 4)
    assert model.tensor(0, "engram_embd").ggml_type.name == table_type
    _run_sequence(*flash, residency, (64, 4, 1, 1))


@pytest.mark.parametrize("t,hc,c", [(64, 4, 5120), (3, 4, 300), (2, 1, 33)])
def test_gate(t: int, hc: int, c: int) -> None:
    """The multi-warp reduction at flash width, and widths that do not fill the block."""
    rng = np.random.default_rng(c)
    h, kv, qk, mask = _gate_inputs(rng, t, hc, c)
    h_dev, g_dev = cuda.to_device(h), cuda.device_array((t, hc), np.float32)
    engram_gate(h_dev, cuda.to_device(to_bits(kv)), cuda.to_device(qk), 1e-20, cuda.to_device(mask), g_dev, t)
    h_ref, g_ref = oracle_gate(h, kv, qk, 1e-20, mask)
    dg, dh = gate_bounds(h, kv, qk, 1e-20, g_ref)
    g, out = g_dev.copy_to_host(), h_dev.copy_to_host()
    print(f"gate T={t} hc={hc} C={c}: max |err| g {np.abs(g - g_ref).max():.3e} h {np.abs(out - h_ref).max():.3e}")
    assert_within(g, g_ref, dg, f"gate g C={c}")
    assert_within(out, h_ref, dh, f"gate h C={c}")


@pytest.mark.parametrize("wtype", ["Q2_K", "Q8_0"])
def test_wkv_at_flash_dimensions(wtype: str) -> None:
    """The projection on random stored wkv blocks [25600, 6144] (the Q2_K file's type) through the
    kernels stages.linear picks: stream (T = 1, 4) and tensor cores (T = 64), by
    tests/test_linear.py's check. Bit-equal on the H200 (2026-12-01): Q2_K 99.980-99.984%, Q8_0
    99.982-99.992%."""
    n, k = 5120 * 5, 24 * 256
    gtype = GGMLType[wtype]
    stored = random_stored(n, k, gtype, np.random.default_rng(0))
    w, wq = DeviceWeight.from_stored("engram_wkv", gtype, stored, k), dequantize(stored, gtype, k)
    for t in (1, 4, 64):
        check_linear(w, wq, t, seed=t)
