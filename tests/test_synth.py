"""The flash40 preset (V4.1-Flash's real 40-layer schedule) and the stored-format drawers that write
it fast (host.synth.draw_q8_0, draw_bf16): the roles a written file loads with, the drawn blocks'
validity, and their statistics against the quantised Gaussian values they stand in for, each
tolerance derived from the sample's own standard error."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest

import flashv41
from flashv41.host import gguf_layout as L
from flashv41.host import synth
from flashv41.host.quants import FORMATS, GGMLType, dequantize, quantize
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
    drawn = synth.draw_q8_0(np.random.default_rng(1), (ROWS, COLS), STD)
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
    expected = synth.q8_0_drawn_mean_square()
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

    amax, tables = synth.q8_0_draw_tables()
    steps = amax.size
    cdf = np.array([erf(a / sqrt(2)) ** 32 for a in amax])
    assert np.allclose(cdf, (np.arange(steps) + 0.5) / steps, atol=1e-9)
    assert (np.diff(amax) > 0).all()
    assert tables.min() >= -127, "-128 is never a quantised level"
    assert (tables[:, ::-1].astype(np.int16) + tables == 0).mean() > 0.99, "the level tables are symmetric"


def test_drawn_bytes_do_not_depend_on_the_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    shape = (1024, 1024)  # 1.1 MB of Q8_0, 2 MiB of BF16: drawn in more than one part
    for draw in (synth.draw_q8_0, synth.draw_bf16):
        got = {}
        for threads in (1, 3):
            monkeypatch.setattr(synth, "_threads", lambda n=threads: n)
            got[threads] = draw(np.random.default_rng(5), shape, 0.1)
        assert np.array_equal(got[1], got[3]), draw.__name__
        assert not np.array_equal(got[1], draw(np.random.default_rng(6), shape, 0.1)), "the seed matters"


# ------------------------------------------------------------------------------- BF16, drawn


def test_drawn_bf16_matches_the_intended_std() -> None:
    """bf16 codes of N(0, STD^2) quantiles: E[value^2] from the 2^16 codes themselves is STD^2 less
    the cut tails (under 1e-3; bf16 rounding is unbiased); the sample meets it within 5 standard
    errors (sqrt(2 / n) relative), and its quartiles sit at +-0.6745 STD within 0.01 (5 standard
    errors of a sample quartile, 0.0034, plus the spacing of bf16 values there, 0.0053)."""
    raw = synth.draw_bf16(np.random.default_rng(3), (ROWS, COLS), STD)
    values = dequantize(raw, GGMLType.BF16, COLS).astype(np.float64) / STD
    assert np.isfinite(values).all()
    codes = synth._normal_quantiles().astype(np.float32) * np.float32(STD)
    table = dequantize(quantize(codes, GGMLType.BF16), GGMLType.BF16, codes.size).astype(np.float64) / STD
    expected = float(np.mean(np.square(table)))
    assert abs(expected - 1) < 1e-3
    assert abs(np.mean(np.square(values)) - expected) < SIGMAS * np.sqrt(2 / values.size)
    q1, q3 = np.quantile(values, [0.25, 0.75])
    assert abs(q1 + 0.6745) < 0.01 and abs(q3 - 0.6745) < 0.01
