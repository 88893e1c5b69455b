"""stages.mixes_tiles (the mixes' product for a prefill chunk, tiles of tokens) against float64
partial sums, each within the worst-case fp32 bound of its slice's terms; and, through
HyperStage's mixes kernels, the stage's mixes from it against the oracle's (tests/test_hyper.py's
checks and bounds), with MIXES_TILES_MIN_TOKENS lowered so that the simulator's few tokens take
the path a prefill chunk takes on the GPU. tools/time_mixes.py times it against stream_partials."""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda  # noqa: E402  (after conftest chose the backend)

import flashv41
from flashv41.host.numerics import to_bits
from flashv41.host.oracle import Oracle
from flashv41.host.quants import FORMATS, GGMLType
from flashv41.stages import hyper
from flashv41.stages.device import CHUNK
from flashv41.stages.hyper import HyperStage
from flashv41.stages.linear import DeviceWeight
from flashv41.stages.mixes_tiles import FN_TYPES, LANES, SLICE_CHUNKS, mixes_slices, mixes_tiles
from tests.bounds import U
from tests.test_hyper import check_mixes, check_mixes_norm, check_mixes_post, highway

N_MIX = 24  # (2 + hc) x hc mixes, hc = 4
PARTIAL_K = (2 * SLICE_CHUNKS + 5) * CHUNK  # two whole slices and a partial third (five chunks)


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
    partial = cuda.to_device(np.full((n_tokens + 2, N_MIX + 1, slices + 1), np.nan, np.float32))
    assert mixes_tiles(cuda.to_device(x), w, partial, n_tokens) == slices
    got = partial.copy_to_host()
    assert np.isnan(got[n_tokens:]).all() and np.isnan(got[:, :, slices:]).all(), "written past the tokens or slices"
    got = got[:n_tokens, :, :slices].astype(np.float64)
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
                                  f"out of the bound, worst {ratio.max():.2f} of it at (token, row) "
                                  f"{tuple(int(i) for i in np.unravel_index(int(ratio.argmax()), ratio.shape))}")
        worst = max(worst, float(ratio.max()))
    return worst


@pytest.mark.parametrize("gtype", FN_TYPES, ids=lambda t: t.name)
def test_partials_within_bound(gtype):
    """11 tokens: one tile, its third warp's last token empty and its last warps idle."""
    worst = check_partials(gtype, 11, PARTIAL_K, int(gtype))
    print(f"mixes_tiles {gtype.name}: largest error {worst:.3f} of the bound")


def test_partials_two_tiles():
    """37 tokens: a whole tile of WARPS x TOKENS_A_WARP = 32 and one of 5."""
    check_partials(GGMLType.F32, 37, PARTIAL_K, 5)


def test_refuses_what_it_does_not_take():
    w, _ = fn_weight(N_MIX, 64, GGMLType.F32, 0)
    x = cuda.to_device(np.zeros((4, 64), np.float32))
    for bad_x, partial, n in ((cuda.to_device(np.zeros((4, 64), np.uint16)), (4, N_MIX + 1, 4), 4),  # bf16 x
                              (x, (4, N_MIX, 4), 4),  # no square-sum row
                              (x, (4, N_MIX + 1, 0), 4),  # no room for the slice
                              (x, (4, N_MIX + 1, 4), 5)):  # more tokens than x has
        with pytest.raises(ValueError, match="hc_attn_fn"):
            mixes_tiles(bad_x, w, cuda.device_array(partial, np.float32), n)
    q8_row = np.zeros((N_MIX, 2 * FORMATS[GGMLType.Q8_0].block_bytes), np.uint8)  # two blocks of 32
    q8 = DeviceWeight.from_stored("blk.1.hc_attn_fn", GGMLType.Q8_0, q8_row, 64)
    with pytest.raises(ValueError, match="Q8_0"):
        mixes_tiles(x, q8, cuda.device_array((4, N_MIX + 1, 4), np.float32), 4)


@pytest.fixture
def tiled(monkeypatch):
    """HyperStage's mixes take mixes_tiles' product from one token on; the stage's partial buffer
    NaN first, so that a mixes kernel reading a slice mixes_tiles did not write fails the bounds."""
    monkeypatch.setattr(hyper, "MIXES_TILES_MIN_TOKENS", 1)

    def stage(model, max_tokens: int) -> HyperStage:
        built = HyperStage(model, max_tokens=max_tokens)
        built.partial.copy_to_device(np.full(built.partial.shape, np.nan, np.float32))
        return built

    return stage


@pytest.fixture(scope="module")
def small(small_path):
    model = flashv41.load_model(small_path)
    yield model, Oracle(model, max_seq=64)
    model.close()


@pytest.mark.parametrize("kind,n_tokens", [("attn", 11), ("ffn", 3)])
def test_stage_mixes_from_tiles(small, tiled, kind, n_tokens):
    """The small preset's mixes (pre, post, comb) from mixes_tiles' two slices (the buffer holds
    stream_partials' four), within test_hyper's bounds of the oracle."""
    model, oracle = small
    stage = tiled(model, 16)
    try:
        assert stage.n_slices > mixes_slices(model.config.hc * model.config.dim)
        check_mixes(model, oracle, stage, 1, kind, n_tokens)
    finally:
        stage.free()


def test_stage_mixes_norm_and_mixes_post_from_tiles(small, tiled):
    """mixes_norm from the tiles' product (its mixes the bits of `mixes`, x within test_hyper's
    bound) and, past POST_PRODUCT_MAX_TOKENS, the FFN sublayer's mixes and post (mixes_post)."""
    model, oracle = small
    stage = tiled(model, 16)
    try:
        check_mixes_norm(model, oracle, stage, 3)
        check_mixes_post(model, oracle, stage, 1, 11)
    finally:
        stage.free()


def test_stage_picks_by_tokens_and_type(synth_model, monkeypatch):
    """_mix_args: mixes_tiles (its slice count) from MIXES_TILES_MIN_TOKENS tokens for the F32 /
    F16 / BF16 fn it reads, stream_partials (the buffer's count) below them and for other types."""
    monkeypatch.setattr(hyper, "MIXES_TILES_MIN_TOKENS", 4)
    for fn_type in ("F16", "Q8_0"):
        model = flashv41.load_model(synth_model("small", type_map={"hc_attn_fn": fn_type, "hc_ffn_fn": fn_type}))
        stage = HyperStage(model, max_tokens=4)
        try:
            h = cuda.to_device(highway(model.config, 3, 4))
            tiles = mixes_slices(model.config.hc * model.config.dim) if fn_type == "F16" else stage.n_slices
            for n_tokens, want in ((3, stage.n_slices), (4, tiles)):
                partial, n_slices, _, _ = stage._mix_args(stage.sublayer(1, "ffn", None), h, n_tokens)
                assert (partial, n_slices) == (stage.partial, want), (fn_type, n_tokens)
        finally:
            stage.free()
            model.close()


@pytest.mark.gpu
@pytest.mark.parametrize("gtype", FN_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n_tokens", [64, 509])
def test_flash_partials(gtype, n_tokens):
    """Flash size: hc 4 x 5120 (16 slices of 1280), a whole and a ragged token count."""
    worst = check_partials(gtype, n_tokens, 4 * 5120, 7 + int(gtype))
    print(f"mixes_tiles {gtype.name} T={n_tokens}: largest error {worst:.3f} of the bound")


@pytest.mark.gpu
@pytest.mark.parametrize("n_tokens", [64, 509])
def test_flash_stage_mixes_from_tiles(synth_model, tiled, n_tokens):
    """The flash preset's two window layers (F16 attention, BF16 FFN mixes): both sublayers' mixes
    and the FFN sublayer's mixes and post (mixes_post) from the tiles' 16 slices."""
    model = flashv41.load_model(synth_model("flash", type_map={"hc_attn_fn": "F16", "hc_ffn_fn": "BF16"},
                                            compress_ratios=(0, 0), kv_sources=(), index_sources=(),
                                            candidate_source=99, engram_layers=(), vocab=1024))
    stage = tiled(model, n_tokens)
    try:
        oracle = Oracle(model, max_seq=64)
        for kind in ("attn", "ffn"):
            check_mixes(model, oracle, stage, 1, kind, n_tokens)
        check_mixes_post(model, oracle, stage, 0, n_tokens)
    finally:
        stage.free()
        model.close()
