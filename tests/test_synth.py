"""The flash40 preset (V4.1-Flash's real 40-layer schedule) and the stored-format drawers that write
it fast (host.synth_draw.draw_q8_0, draw_bf16): the roles a written file loads with, the drawn blocks'
validity, and their statistics against the quantised Gaussian values they stand in for, each
tolerance derived from the sample's own standard error."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest

import flashv41
from flashv41.host import gguf_layout as L
from flashv41.host import synth, synth_draw
from flashv41.host.errors import InputError, UnsupportedError
from flashv41.host.quants import FORMATS, GGMLType, dequantize, k_scale_min, quantize
from flashv41.host.synth import FLASH40_SCHEDULE, PRESETS, preset, write_synthetic
from tests.test_gguf_layouts import roles_of, same_tensors_by_role
from tests.test_gguf_load import check_model

# docs/performance.md, written out layer by layer: what each of the 40 layers must load as
SWA, KV2, C2, CAND1, IDX1, C1 = ("swa", "kv_index_source_r2", "consumer_r2", "candidate_source_r1",
                                 "candidate_index_source_r1", "consumer_r1")
FLASH40_BLOCKS = (
    [SWA, SWA]
    + [KV2, C2, C2, C2, C2, C2] * 3  # layers 2-19: kv (and index) sources 2, 8, 14
    + [CAND1, C1, C1, C1]  # 20: the candidate source, also a kv source
    + [IDX1, C1, C1, C1] * 4  # 24, 28, 32, 36: index sources that respect its block mask
)
FLASH40_ENGRAM = (1, 14)
SCHEDULE_FIELDS = set(FLASH40_SCHEDULE) | {"stored_draw"}
# the drawers' sample: 131072 Q8_0 blocks, 4.2 M values
ROWS, COLS, STD = 2048, 2048, 0.02
SIGMAS = 5  # every statistical tolerance below: 5 standard errors of the compared difference


def tiny_dims() -> dict:
    """Every field of the tiny preset but the schedule: flash40's schedule at simulator sizes."""
    tiny = PRESETS["tiny"]
    return {f.name: getattr(tiny, f.name) for f in fields(tiny) if f.name not in SCHEDULE_FIELDS}


def test_flash40_is_flash_on_the_real_schedule() -> None:
    flash, p = preset("flash"), preset("flash40")
    for f in fields(p):
        if f.name not in SCHEDULE_FIELDS:
            assert getattr(p, f.name) == getattr(flash, f.name), f.name
    assert p.n_layers == 40 and p.stored_draw and not flash.stored_draw
    assert p.compress_ratios == (0, 0) + (2,) * 18 + (1,) * 20
    assert p.kv_sources == (2, 8, 14, 20)
    assert p.index_sources == (2, 8, 14, 20, 24, 28, 32, 36)
    assert p.candidate_source == 20 and p.engram_layers == FLASH40_ENGRAM
    assert not any(PRESETS[name].stored_draw for name in ("tiny", "small", "flash")), \
        "the other presets keep their quantised bytes"


@pytest.mark.parametrize(("weight_type", "table_type"), [("Q8_0", "Q2_K"), ("BF16", "Q8_0")])
def test_flash40_schedule_loads_with_its_roles(tmp_path: Path, weight_type: str, table_type: str) -> None:
    """The flash40 preset with tiny sizes written (stored-format drawing and all) and loaded: the
    loader's role checks pass and give exactly the documented roles; every tensor's type and
    statistics are what the writer promises (tests.test_gguf_load.check_model)."""
    dims = tiny_dims()
    path = write_synthetic(tmp_path / "flash40-tiny.gguf", "flash40", weight_type=weight_type,
                           table_type=table_type, **dims)
    p = preset("flash40", **dims)
    check_model(path, p, weight_type, table_type)
    model = flashv41.load_model(path)
    try:
        roles = model.config.roles
        assert [r.block_type for r in roles] == FLASH40_BLOCKS
        assert [r.ratio for r in roles] == [0] * 2 + [2] * 18 + [1] * 20
        assert [r.layer for r in roles if r.kv_source] == [2, 8, 14, 20]
        assert [r.layer for r in roles if r.index_source] == [2, 8, 14, 20, 24, 28, 32, 36]
        assert [r.layer for r in roles if r.candidate_source] == [20]
        assert [r.layer for r in roles if r.uses_candidates] == [24, 28, 32, 36]
        assert [r.layer for r in roles if r.engram] == list(FLASH40_ENGRAM)
        assert model.config.engram is not None and model.config.engram.layer_ids == FLASH40_ENGRAM
    finally:
        model.close()


def test_stored_draw_keeps_the_table_types_and_layouts_apart(tmp_path: Path) -> None:
    """As without stored_draw, the engram tables' type and the ds4 layout change the tables only:
    every other tensor is byte for byte the same (a drawn Q8_0 and a drawn BF16 table take the
    same draws from the file's generator; ds4's E4M3 rows are the codes of the drawn BF16 values,
    within E4M3's half step)."""
    kwargs = {**tiny_dims(), "seed": 4}
    paths = {name: write_synthetic(tmp_path / f"{name}.gguf", "flash40", table_type=table, layout=layout, **kwargs)
             for name, table, layout in (("q8_0", "Q8_0", L.LLAMA_CPP), ("bf16", "BF16", L.LLAMA_CPP),
                                         ("ds4", None, L.DS4))}
    models = {name: flashv41.load_model(path) for name, path in paths.items()}
    try:
        bf16 = models["bf16"]
        others = roles_of(bf16.config, tables=False)
        assert same_tensors_by_role(bf16, models["q8_0"], others) == 0
        assert same_tensors_by_role(bf16, models["ds4"], others) == 3 * len(FLASH40_ENGRAM)  # renamed engram ones
        for layer in FLASH40_ENGRAM:
            va = bf16.tensor(layer, L.ENGRAM_TABLE).dequantize()
            vb = models["ds4"].tensor(layer, L.ENGRAM_TABLE).dequantize()
            assert np.all(np.abs(vb - va) <= np.abs(va) / 16 * 1.01 + 2.0**-9), layer
    finally:
        for model in models.values():
            model.close()


# ------------------------------------------------------------------------------- Q8_0, drawn


@pytest.fixture(scope="module")
def q8_0_pair() -> tuple[np.ndarray, np.ndarray]:
    """Q8_0 blocks [n] drawn in the stored format, and the real quantiser's of as many N(0, STD^2)
    values."""
    block = FORMATS[GGMLType.Q8_0].block
    drawn = synth_draw.draw_q8_0(np.random.default_rng(1), (ROWS, COLS), STD)
    values = np.random.default_rng(2).standard_normal((ROWS, COLS), dtype=np.float32) * np.float32(STD)
    real = quantize(values, GGMLType.Q8_0)
    return drawn.reshape(-1).view(block), real.reshape(-1).view(block)


def test_drawn_q8_0_blocks_are_valid(q8_0_pair) -> None:
    drawn, _ = q8_0_pair
    d = drawn["d"]
    assert np.isfinite(d).all() and (d > 0).all()
    assert (d >= np.finfo(np.float16).tiny).all(), "scales this size are normal fp16 numbers"
    qs = drawn["qs"].astype(np.int16)
    assert qs.min() >= -127, "-128 is never a quantised level (levels are |x| / d <= 127)"
    assert (np.abs(qs).max(axis=1) == 127).all(), "every block's largest |value| is level 127, as d = amax / 127"
    top_sign = np.sign(qs[np.arange(qs.shape[0]), np.abs(qs).argmax(axis=1)])
    assert abs(top_sign.mean()) < SIGMAS / np.sqrt(qs.shape[0]), "the top level's sign is +-1 with equal odds"


def test_drawn_q8_0_mean_square_matches_the_intended_std(q8_0_pair) -> None:
    """The drawer's own tables give E[value^2] = STD^2 within 1e-3 (the levels' rounding adds
    E[A^2] / (12 * 127^2) ~ 3e-5, the amax bins' middles ~ 6e-4); the sample's mean square meets that
    within 5 standard errors of a mean of n squared Gaussians (sqrt(2 / n) relative: the drawing
    makes each block's values as dependent as a real block's, i.e. not at all), plus 2^-10 for the
    fp16 rounding of d."""
    expected = synth_draw.q8_0_drawn_mean_square()
    assert abs(expected - 1) < 1e-3
    drawn, _ = q8_0_pair
    raw = drawn.view(np.uint8).reshape(ROWS, -1)
    values = dequantize(raw, GGMLType.Q8_0, COLS).astype(np.float64) / STD
    ms = float(np.mean(np.square(values)))
    tolerance = SIGMAS * np.sqrt(2 / values.size) + 2.0**-10
    assert abs(ms - expected) < tolerance, (ms, expected, tolerance)
    assert abs(values.mean()) < SIGMAS / np.sqrt(values.size), "values are centred"


def per_block_stats(blocks: np.ndarray) -> dict[str, np.ndarray]:
    """Per block (float64 [n] each): A = 127 d / STD (the block's largest |z|), its mean |level|,
    its share of levels of 100 and more, its number of levels +-127."""
    q = np.abs(blocks["qs"].astype(np.float64))
    return {"amax": blocks["d"].astype(np.float64) * 127 / STD, "mean |level|": q.mean(axis=1),
            "levels >= 100": (q >= 100).mean(axis=1), "levels 127": (q == 127).sum(axis=1)}


def test_drawn_q8_0_statistics_are_the_quantisers(q8_0_pair) -> None:
    """Drawn blocks against the real quantiser's on as many Gaussian blocks: each block-level
    statistic's mean and spread agree within 5 standard errors of the difference of two
    independent samples of blocks (so the dependence of the values within a block is counted):
    for the means sqrt(var_a / n + var_b / n), plus 2^-11 relative for the fp16 rounding of d in the
    amax; for the log of the standard deviations sqrt((kurt_a - 1) / 4n + (kurt_b - 1) / 4n). (The
    drawing's one approximation, a bin's levels drawn for the bin's middle amax, moves these by
    0.3% at most, measured on a million blocks: about one standard error here.)"""
    drawn, real = (per_block_stats(b) for b in q8_0_pair)

    def kurtosis(x: np.ndarray) -> float:
        c = x - x.mean()
        return float(np.mean(c**4) / np.mean(c**2) ** 2)

    for name in drawn:
        a, b = drawn[name], real[name]
        se = np.sqrt(a.var() / a.size + b.var() / b.size)
        slack = 2.0**-11 * b.mean() if name == "amax" else 0.0
        assert abs(a.mean() - b.mean()) < SIGMAS * se + slack, (name, a.mean(), b.mean(), se)
        se_log_std = np.sqrt((kurtosis(a) - 1) / (4 * a.size) + (kurtosis(b) - 1) / (4 * b.size))
        assert abs(np.log(a.std() / b.std())) < SIGMAS * se_log_std, (name, a.std(), b.std(), se_log_std)


def test_drawn_amax_quantiles_are_the_analytic_distribution() -> None:
    """The drawer's amax table against the CDF it inverts, (2 Phi(a) - 1)^32 = erf(a / sqrt 2)^32."""
    from math import erf, sqrt

    amax, tables = synth_draw.q8_0_draw_tables()
    steps = amax.size
    cdf = np.array([erf(a / sqrt(2)) ** 32 for a in amax])
    assert np.allclose(cdf, (np.arange(steps) + 0.5) / steps, atol=1e-9)
    assert (np.diff(amax) > 0).all()
    assert tables.min() >= -127, "-128 is never a quantised level"
    assert (tables[:, ::-1].astype(np.int16) + tables == 0).mean() > 0.99, "the level tables are symmetric"


def test_drawn_bytes_do_not_depend_on_the_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    shape = (1024, 1024)  # 1.1 MB of Q8_0, 2 MiB of BF16: drawn in more than one part
    for draw in (synth_draw.draw_q8_0, synth_draw.draw_bf16):
        got = {}
        for threads in (1, 3):
            monkeypatch.setattr(synth_draw, "_threads", lambda n=threads: n)
            got[threads] = draw(np.random.default_rng(5), shape, 0.1)
        assert np.array_equal(got[1], got[3]), draw.__name__
        assert not np.array_equal(got[1], draw(np.random.default_rng(6), shape, 0.1)), "the seed matters"


# ------------------------------------------------------------------------------- BF16, drawn


def test_drawn_bf16_matches_the_intended_std() -> None:
    """bf16 codes of N(0, STD^2) quantiles: E[value^2] from the 2^16 codes themselves is STD^2 less
    the cut tails (under 1e-3; bf16 rounding is unbiased); the sample meets it within 5 standard
    errors (sqrt(2 / n) relative), and its quartiles sit at +-0.6745 STD within 0.01 (5 standard
    errors of a sample quartile, 0.0034, plus the spacing of bf16 values there, 0.0053)."""
    raw = synth_draw.draw_bf16(np.random.default_rng(3), (ROWS, COLS), STD)
    values = dequantize(raw, GGMLType.BF16, COLS).astype(np.float64) / STD
    assert np.isfinite(values).all()
    codes = synth_draw._normal_quantiles().astype(np.float32) * np.float32(STD)
    table = dequantize(quantize(codes, GGMLType.BF16), GGMLType.BF16, codes.size).astype(np.float64) / STD
    expected = float(np.mean(np.square(table)))
    assert abs(expected - 1) < 1e-3
    assert abs(np.mean(np.square(values)) - expected) < SIGMAS * np.sqrt(2 / values.size)
    q1, q3 = np.quantile(values, [0.25, 0.75])
    assert abs(q1 + 0.6745) < 0.01 and abs(q3 - 0.6745) < 0.01


# ------------------------------------------------------------------------------- K-quants, drawn

K_QUANTS = (GGMLType.Q3_K, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K)


def test_k_scale_packing_reads_back() -> None:
    """The scale bytes the drawer packs read back as packed: Q4_K / Q5_K through k_scale_min, Q3_K
    through its dequantiser on blocks of d = 1 and every level 1 (value = the sub-block's scale)."""
    rng = np.random.default_rng(11)
    sc, mn = (rng.integers(0, 64, (50, 8), dtype=np.uint8) for _ in range(2))
    got_sc, got_mn = k_scale_min(synth_draw._pack_k_scales(sc, mn))
    assert np.array_equal(got_sc, sc) and np.array_equal(got_mn, mn)
    stored = rng.integers(0, 64, (50, 16), dtype=np.uint8)
    blocks = np.zeros(50, FORMATS[GGMLType.Q3_K].block)
    blocks["scales"] = synth_draw._pack_q3_k_scales(stored)
    blocks["d"], blocks["hmask"], blocks["qs"] = 1.0, 0xFF, 0x55  # high bit 1 and low bits 01: level 1
    values = dequantize(blocks.view(np.uint8).reshape(50, -1), GGMLType.Q3_K, 256).reshape(50, 16, 16)
    assert np.array_equal(values, np.broadcast_to((stored.astype(np.float32) - 32)[:, :, None], values.shape))


def q3_k_scales(raw: np.ndarray) -> np.ndarray:
    """The signed sub-scales of Q3_K rows (the dequantiser's values on a copy of d = 1, levels 1)."""
    probe = raw.copy().reshape(-1, FORMATS[GGMLType.Q3_K].block_bytes).view(FORMATS[GGMLType.Q3_K].block)
    probe["d"], probe["hmask"], probe["qs"] = 1.0, 0xFF, 0x55
    return dequantize(probe.view(np.uint8).reshape(probe.shape[0], -1), GGMLType.Q3_K, 256)[:, ::16]


@pytest.mark.parametrize("gtype", K_QUANTS, ids=lambda t: t.name)
def test_drawn_k_quant_blocks(gtype: GGMLType) -> None:
    """draw_k_quant: valid blocks (gguf-py dequantises them to the same bits, all finite), sub-scales
    in the documented ranges (Q4_K / Q5_K mins equal to their scales, dmin = d * the levels' middle),
    and values of mean 0 and mean square std^2: within 5 standard errors of the sub-blocks' own
    means and mean squares (a sub-block's values share a scale, so the sub-block is the sample),
    plus 2^-9 for the fp16 rounding of d and dmin."""
    import gguf

    std, rows, cols = 0.05, 256, 1024
    raw = synth_draw.draw_k_quant(gtype, np.random.default_rng(int(gtype)), (rows, cols), std)
    fmt = FORMATS[gtype]
    assert raw.dtype == np.uint8 and raw.shape == (rows, fmt.row_bytes(cols))
    values = dequantize(raw, gtype, cols)
    want = np.asarray(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(int(gtype))), np.float32)
    assert np.isfinite(values).all() and np.array_equal(values.view(np.uint32), want.view(np.uint32))
    blocks = raw.reshape(-1, fmt.block_bytes).view(fmt.block).reshape(-1)
    d = blocks["d"].astype(np.float64)
    assert (d == d[0]).all() and d[0] > 0
    lo, hi, (first, _) = synth_draw.K_DRAWN[gtype]
    if gtype in (GGMLType.Q4_K, GGMLType.Q5_K):
        sc, mn = k_scale_min(blocks["scales"])
        assert np.array_equal(sc, mn) and sc.min() >= lo and sc.max() <= hi
        assert (blocks["dmin"] == np.float16(-first * np.float32(d[0]))).all()
        per = 32
    else:
        scales = blocks["scales"].astype(np.float64) if gtype == GGMLType.Q6_K else q3_k_scales(raw)
        assert np.abs(scales).min() >= lo and np.abs(scales).max() <= hi
        assert abs((scales > 0).mean() - 0.5) < SIGMAS * 0.5 / np.sqrt(scales.size), "scale signs +-1 evenly"
        per = 16
    sub = values.astype(np.float64).reshape(-1, per) / std
    means, squares = sub.mean(axis=1), np.square(sub).mean(axis=1)
    assert abs(means.mean()) < SIGMAS * means.std() / np.sqrt(means.size) + 2.0**-9, means.mean()
    assert abs(squares.mean() - 1) < SIGMAS * squares.std() / np.sqrt(squares.size) + 2.0**-9, squares.mean()


@pytest.mark.parametrize("gtype", [*K_QUANTS, GGMLType.MXFP4], ids=lambda t: t.name)
def test_tiny256_in_every_weight_type_loads(tmp_path: Path, gtype: GGMLType) -> None:
    """tiny256 with a K-quant (drawn) or MXFP4 (quantised) weight type and table type: every matrix
    whose rows hold the type's blocks takes it (the index keys' rows of 64 values fall back), and the
    load gives back the preset's config and the writer's statistics (check_model)."""
    path = write_synthetic(tmp_path / "m.gguf", "tiny256", weight_type=gtype.name, table_type=gtype.name)
    check_model(path, preset("tiny256"), gtype.name, gtype.name)
    model = flashv41.load_model(path)
    try:
        typed = [t for t in model.weights if t.ggml_type == gtype]
        assert {_role(t.name) for t in typed} == {*synth.WEIGHT_TYPED, L.ENGRAM_TABLE}
    finally:
        model.close()


def _role(name: str) -> str:
    parts = name.removesuffix(".weight").split(".")
    return ".".join(parts[2:] if parts[0] == "blk" else parts)


# ------------------------------------------------------------------------------- type maps


def test_type_map_sets_each_role(tmp_path: Path) -> None:
    """Every tensor of a mapped role takes its type, in any layer; the others keep the writer's."""
    type_map = {"engram_embd": "Q4_K", "engram_wkv": "Q6_K", "hc_attn_fn": "MXFP4", "attn_compressor_kv": "Q8_0",
                "indexer.proj": "bf16", "token_embd": "F16", "attn_output_a": "F32"}
    path = write_synthetic(tmp_path / "m.gguf", "tiny", type_map=type_map)
    default = write_synthetic(tmp_path / "d.gguf", "tiny")
    with flashv41.load_model(path) as model, flashv41.load_model(default) as plain:
        seen = set()
        for t in model.weights:
            role = _role(t.name)
            if role in type_map:
                assert t.ggml_type.name == type_map[role].upper(), t.name
                seen.add(role)
        assert seen == set(type_map)
        for layer, role in roles_of(model.config):
            if role not in type_map:
                assert model.tensor(layer, role).ggml_type == plain.tensor(layer, role).ggml_type, (layer, role)
            values = model.tensor(layer, role).dequantize()
            assert np.isfinite(values).all(), (layer, role)


def test_type_map_takes_a_layouts_names(tmp_path: Path) -> None:
    """ds4's engram_kv is engram_wkv, mxxm-t's indexer_compressor_kv is indexer.attn_k; ds4's
    tables may be mapped to their own format, E4M3_ROW264."""
    ds4 = write_synthetic(tmp_path / "a.gguf", "tiny", layout=L.DS4,
                          type_map={"engram_kv": "BF16", "engram_embd": "E4M3_ROW264"})
    mxxm = write_synthetic(tmp_path / "b.gguf", "tiny", layout=L.MXXM_T, type_map={"indexer_compressor_kv": "Q8_0"})
    for path, role, gtype in ((ds4, "engram_wkv", "BF16"), (mxxm, "indexer.attn_k", "Q8_0")):
        model = flashv41.load_model(path)
        try:
            layers = [layer for layer, r in roles_of(model.config) if r == role]
            assert layers and all(model.tensor(i, role).ggml_type.name == gtype for i in layers), role
        finally:
            model.close()


def test_no_type_map_keeps_the_bytes(tmp_path: Path) -> None:
    """An empty type map, or one that maps roles to the types they take anyway, writes the very
    bytes of a file written without one (the random draws are the same, tensor for tensor)."""
    plain = write_synthetic(tmp_path / "a.gguf", "tiny", seed=2)
    for i, type_map in enumerate(({}, {"attn_q_a": "Q8_0", "engram_embd": "Q2_K", "hc_ffn_fn": "F32",
                                       "indexer.attn_k": "BF16"})):
        again = write_synthetic(tmp_path / f"b{i}.gguf", "tiny", seed=2, type_map=type_map)
        assert again.read_bytes() == plain.read_bytes(), type_map


ONE_RATIO_1_LAYER = {"compress_ratios": (1,), "kv_sources": (0,), "index_sources": (0,), "candidate_source": 1,
                     "engram_layers": (0,)}


@pytest.mark.parametrize(("type_map", "layout", "overrides", "error", "words"), [
    ({"attn_q_x": "Q4_K"}, L.LLAMA_CPP, {}, InputError, ["unknown role 'attn_q_x'", "attn_q_b", "engram_embd"]),
    ({"attn_norm": "BF16"}, L.LLAMA_CPP, {}, InputError, ["attn_norm=BF16", "is a vector"]),
    ({"attn_q_b": "Q9_K"}, L.LLAMA_CPP, {}, UnsupportedError, ["attn_q_b=Q9_K", "unknown type 'Q9_K'", "Q4_K"]),
    ({"attn_q_b": "E4M3_ROW264"}, L.LLAMA_CPP, {}, UnsupportedError, ["attn_q_b=E4M3_ROW264", "ds4"]),
    ({"engram_embd": "Q8_0"}, L.DS4, {}, InputError, ["engram_embd=Q8_0", "ds4", "E4M3_ROW264"]),
    ({"engram_kv": "Q8_0", "engram_wkv": "BF16"}, L.DS4, {}, InputError, ["engram_wkv", "given twice"]),
    ({"attn_q_a": "Q4_K"}, L.LLAMA_CPP, {}, UnsupportedError,
     ["attn_q_a=Q4_K", "blk.0.attn_q_a.weight", "[32, 32]", "rows of 32 values", "256 values"]),
    ({"engram_embd": "Q4_K"}, L.MXXM_T, {"engram_head_dim": 32, "engram_heads": 2}, UnsupportedError,
     ["engram_embd=Q4_K", "blk.0.engram_embed.weight", "rows of 32 values"]),
    ({"attn_compressor_gate": "BF16"}, L.LLAMA_CPP, ONE_RATIO_1_LAYER, InputError,
     ["attn_compressor_gate=BF16", "preset 'tiny' has no attn_compressor_gate tensor"]),
])
def test_bad_type_maps_are_named_errors(tmp_path: Path, type_map: dict, layout: str, overrides: dict,
                                        error: type, words: list[str]) -> None:
    """Each refused before anything is written, with a message naming the role (the tensor and the
    type where there is one)."""
    with pytest.raises(error) as info:
        write_synthetic(tmp_path / "m.gguf", "tiny", layout=layout, type_map=type_map, **overrides)
    for w in words:
        assert w in str(info.value), (w, str(info.value))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("text", "words"), [
    ("attn_q_b", "item 1, 'attn_q_b', is not role=TYPE"),
    ("attn_q_b=Q4_K,", "item 2, '', is not role=TYPE"),
    ("=Q4_K", "item 1"),
    ("attn_q_b=Q4_K, attn_q_b=Q5_K", "role 'attn_q_b' is given twice"),
])
def test_parse_type_map_errors(text: str, words: str) -> None:
    with pytest.raises(InputError, match=re.escape(words)):
        synth.parse_type_map(text)


def test_parse_type_map() -> None:
    assert synth.parse_type_map("attn_q_b=Q4_K, engram_embd = q8_0") == {"attn_q_b": "Q4_K", "engram_embd": "q8_0"}
    assert set(synth.TYPE_MAP_ROLES) | set(synth.VECTOR_ROLES) == set(L.ALL_ROLES)
    assert not set(synth.TYPE_MAP_ROLES) & set(synth.VECTOR_ROLES)
