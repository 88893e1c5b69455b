"""dev/mixes_tiles.py against float64 partial sums (the worst-case fp32 bound of each slice's terms)
and, through stages.hyper's mixes kernels, against the oracle's mixes (tests/test_hyper.py's
bounds): `python -m pytest dev/test_mixes_tiles.py` (outside the suite's testpaths: a dev/ kernel).
`python -m dev.test_mixes_tiles` times it against stream_partials on a GPU at flash size (hc 4 x
5120, 24 mixes), 512 tokens, F32 / F16 / BF16 mix weights."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from numba import cuda

import flashv41
from dev.mixes_tiles import FN_TYPES, LANES, SLICE_CHUNKS, mixes_slices, mixes_tiles
from flashv41.host.numerics import to_bits
from flashv41.host.oracle import Oracle
from flashv41.host.quants import GGMLType
from flashv41.stages.device import CHUNK, SIM
from flashv41.stages.hyper import HyperStage
from flashv41.stages.linear import DeviceWeight
from tests.bounds import U
from tests.test_hyper import check_mixes

N_MIX = 24  # (2 + hc) x hc mixes, hc = 4
GPU_ONLY = pytest.mark.skipif(SIM, reason="flash size: on a GPU")


def fn_weight(n: int, k: int, gtype: GGMLType, seed: int) -> tuple[DeviceWeight, np.ndarray]:
    """A random [n, k] mix weight of gtype on the device, and its values."""
    w = (np.random.default_rng(seed).standard_normal((n, k)) * k**-0.5).astype(np.float32)
    if gtype == GGMLType.F16:
        w = w.astype(np.float16).astype(np.float32)
        stored = w.astype(np.float16).view(np.uint8)
    elif gtype == GGMLType.BF16:
        stored = to_bits(w).view(np.uint8)
        w = (stored.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    else:
        stored = w.view(np.uint8)
    return DeviceWeight.from_stored("blk.1.hc_attn_fn", gtype, stored.reshape(n, -1), k), w


def check_partials(gtype: GGMLType, n_tokens: int, k: int, seed: int) -> float:
    """mixes_tiles against float64 sums over each slice: every partial within the worst-case bound
    of its chain of fp32 roundings (a lane's ceil(slice / LANES) ordered terms, each product rounded
    or fused, then log2(LANES) shuffle adds: n = that + 2 roundings of u each on sum |terms|).
    Returns the largest error as a fraction of its bound."""
    w, wv = fn_weight(N_MIX, k, gtype, seed)
    x = (np.random.default_rng(seed + 1).standard_normal((n_tokens, k)) * 0.3).astype(np.float32)
    slices = mixes_slices(k)
    partial = cuda.device_array((n_tokens, N_MIX + 1, slices), np.float32)
    assert mixes_tiles(cuda.to_device(x), w, partial, n_tokens) == slices
    got = partial.copy_to_host().astype(np.float64)
    slice_len = SLICE_CHUNKS * CHUNK
    chain = -(-slice_len // LANES) + int(np.log2(LANES)) + 2
    worst = 0.0
    x64, w64 = x.astype(np.float64), wv.astype(np.float64)
    for s in range(slices):
        cols = slice(s * slice_len, min((s + 1) * slice_len, k))
        terms = np.concatenate([x64[:, cols] @ w64[:, cols].T, (x64[:, cols] ** 2).sum(1, keepdims=True)], 1)
        mags = np.concatenate([np.abs(x64[:, cols]) @ np.abs(w64[:, cols]).T,
                               (x64[:, cols] ** 2).sum(1, keepdims=True)], 1)
        bound = chain * U * mags + 2.0**-149
        ratio = np.abs(got[:, :, s] - terms) / bound
        assert ratio.max() <= 1, (f"{gtype.name} T={n_tokens} K={k} slice {s}: {int((ratio > 1).sum())} partials "
                                  f"out of the bound, worst {ratio.max():.2f} of it at "
                                  f"{np.unravel_index(int(ratio.argmax()), ratio.shape)}")
        worst = max(worst, float(ratio.max()))
    return worst


@pytest.mark.parametrize("gtype", FN_TYPES, ids=lambda t: t.name)
def test_partials_within_bound(gtype):
    """Two whole slices and a partial third (five chunks), 11 tokens (tiles with empty tokens)."""
    k = (2 * SLICE_CHUNKS + 5) * CHUNK
    worst = check_partials(gtype, 11, k, int(gtype))
    print(f"mixes_tiles {gtype.name}: largest error {worst:.3f} of the bound")


def test_refuses_what_it_does_not_take():
    w, _ = fn_weight(N_MIX, 64, GGMLType.F32, 0)
    with pytest.raises(ValueError, match="hc_attn_fn"):
        mixes_tiles(cuda.to_device(np.zeros((4, 64), np.uint16)), w,
                    cuda.device_array((4, N_MIX + 1, 4), np.float32), 4)
    with pytest.raises(ValueError, match="hc_attn_fn"):
        mixes_tiles(cuda.to_device(np.zeros((4, 64), np.float32)), w,
                    cuda.device_array((4, N_MIX, 4), np.float32), 4)


def tiled_mix_args(self, m, h, n_tokens):
    """HyperStage._mix_args with the product from mixes_tiles (any T)."""
    fn, scale, base = self.layers[m.layer][m.kind]
    width = self.cfg.hc * self.cfg.dim
    slices = mixes_tiles(h.reshape(h.shape[0], width), fn, self.partial, n_tokens, self.stream)
    return self.partial, slices, scale, base


@pytest.mark.parametrize("kind,n_tokens", [("attn", 11), ("ffn", 3)])
def test_stage_mixes_from_tiles(synth_model, monkeypatch, kind, n_tokens):
    """The small preset's mixes (pre, post, comb) from mixes_tiles' partials, through the stage's
    mixes kernel, within test_hyper's bounds of the oracle."""
    model = flashv41.load_model(synth_model("small"))
    stage = HyperStage(model, max_tokens=16)
    monkeypatch.setattr(HyperStage, "_mix_args", tiled_mix_args)
    try:
        check_mixes(model, Oracle(model, max_seq=64), stage, 1, kind, n_tokens)
    finally:
        stage.free()


@GPU_ONLY
@pytest.mark.parametrize("gtype", FN_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n_tokens", [64, 509])
def test_flash_partials(gtype, n_tokens):
    """Flash size: hc 4 x 5120 (16 slices of 1280), a full and a ragged token count."""
    worst = check_partials(gtype, n_tokens, 4 * 5120, 7 + int(gtype))
    print(f"mixes_tiles {gtype.name} T={n_tokens}: largest error {worst:.3f} of the bound")


@GPU_ONLY
def test_flash_stage_mixes_from_tiles(synth_model, monkeypatch):
    """The flash preset's two window layers (F16 attention, BF16 FFN mixes), 64 tokens."""
    model = flashv41.load_model(synth_model("flash", type_map={"hc_attn_fn": "F16", "hc_ffn_fn": "BF16"},
                                            compress_ratios=(0, 0), kv_sources=(), index_sources=(),
                                            candidate_source=99, engram_layers=(), vocab=1024))
    stage = HyperStage(model, max_tokens=64)
    monkeypatch.setattr(HyperStage, "_mix_args", tiled_mix_args)
    try:
        oracle = Oracle(model, max_seq=64)
        for kind in ("attn", "ffn"):
            check_mixes(model, oracle, stage, 1, kind, 64)
    finally:
        stage.free()
        model.close()


def time_them(tokens: int = 512, reps: int = 20) -> None:
    """Median device time of mixes_tiles and stream_partials at flash size, from CUDA events."""
    from flashv41.stages.linear import stream_partials

    k = 4 * 5120
    x = cuda.to_device((np.random.default_rng(1).standard_normal((tokens, k)) * 0.3).astype(np.float32))
    stream_out = cuda.device_array((tokens, N_MIX + 1, k // (8 * CHUNK)), np.float32)
    tiles_out = cuda.device_array((tokens, N_MIX + 1, mixes_slices(k)), np.float32)
    bound_us = tokens * k * 4 / 3.0e12 * 1e6
    print(f"T={tokens}: the highway's {tokens * k * 4 / 1e6:.0f} MB read once at 3.0 TB/s: {bound_us:.1f} us")
    for gtype in FN_TYPES:
        w, _ = fn_weight(N_MIX, k, gtype, 3)
        line = [f"{gtype.name:5s}"]
        for label, fn, out in (("stream_partials", stream_partials, stream_out),
                               ("mixes_tiles", mixes_tiles, tiles_out)):
            fn(x, w, out, tokens)
            times = []
            for _ in range(reps):
                start, end = cuda.event(), cuda.event()
                start.record()
                fn(x, w, out, tokens)
                end.record()
                end.synchronize()
                times.append(cuda.event_elapsed_time(start, end) * 1e3)
            median = float(np.median(times))
            line.append(f"{label} {median:7.1f} us ({median / bound_us:4.1f}x)")
        print(" | ".join(line), flush=True)


if __name__ == "__main__":
    from flashv41.stages.backend import select_backend

    select_backend()
    if SIM:
        sys.exit("dev.test_mixes_tiles times kernels on a GPU")
    time_them(int(sys.argv[1]) if len(sys.argv) > 1 else 512)
