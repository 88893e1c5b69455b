"""Loading synthetic models of every preset and type back (config, roles, tensor types, weight
statistics, engram tables), and every load-time validation failing with its own named error."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as GQ
from gguf import GGUFReader, GGUFValueType

import flashv41
from flashv41.host import gguf_layout as L
from flashv41.host.engram_tables import engram_multipliers, engram_offsets, engram_primes, stub_token_map
from flashv41.host.errors import ModelFormatError, UnsupportedError
from flashv41.host.gguf_model import TensorRef
from flashv41.host.quants import FORMATS, GGMLType, dequantize, ggml_type
from flashv41.host.synth import BF16_TYPED, EMBED_STD, GAIN, NORM_MEAN, WEIGHT_TYPED, Preset, preset
from tests.gguf_edit import expect_load_error, rewrite_gguf

WEIGHT_TYPES = ("BF16", "Q8_0", "Q2_K")
# small's engram rows are 32 values wide: no Q2_K tables there
TABLE_TYPES = {"tiny": ("Q2_K", "Q8_0", "BF16"), "small": ("Q8_0", "BF16")}
SAMPLE_ROWS = 512  # statistics of a large tensor come from its first rows
# ModelConfig fields that a Preset holds under the same name
INT_FIELDS = (
    "n_layers", "context_length", "dim", "n_heads", "head_dim", "rope_dim", "q_lora_rank", "window",
    "index_heads", "index_head_dim", "index_topk", "o_groups", "o_lora_rank", "hc", "sinkhorn_iters",
    "rope_original_ctx", "candidate_source", "candidate_block_size", "candidate_topk_blocks",
    "compress_ratios",
)
FLOAT_FIELDS = (
    "norm_eps", "hc_eps", "rope_theta", "compress_rope_theta", "rope_factor", "beta_fast", "beta_slow",
)


def _role_of(name: str) -> tuple[int | None, str]:
    parts = name.removesuffix(".weight").split(".")
    if parts[0] == "blk":
        return int(parts[1]), ".".join(parts[2:])
    return None, ".".join(parts)


def _sample(t: TensorRef) -> np.ndarray:
    """Dequantised values of (the first rows of) a tensor."""
    if len(t.shape) == 1:
        return t.dequantize()
    return dequantize(t.raw()[:SAMPLE_ROWS], t.ggml_type, t.shape[-1])


def _rms(x: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(x, dtype=np.float64))))


def _expected_type(role: str, shape: tuple[int, ...], weight_type: GGMLType,
                   table_type: GGMLType) -> GGMLType:
    """The synthetic writer's type rules, restated: weight-typed matrices take the weight type when
    their rows hold whole blocks, else Q8_0, else BF16; tables likewise; compressor and index-key
    matrices BF16; everything else F32."""
    def fit(want: GGMLType) -> GGMLType:
        fallbacks = (want, GGMLType.Q8_0, GGMLType.BF16)
        return next(t for t in fallbacks if shape[-1] % FORMATS[t].block_values == 0)

    if role == L.ENGRAM_TABLE:
        return fit(table_type)
    if role in WEIGHT_TYPED and len(shape) == 2:
        return fit(weight_type)
    if role in BF16_TYPED:
        return GGMLType.BF16
    return GGMLType.F32


def check_model(path: Path, p: Preset, weight_type: str, table_type: str) -> None:
    """Everything a load must give back for a synthetic model of preset `p`."""
    wt, tt = ggml_type(weight_type), ggml_type(table_type)
    model = flashv41.load_model(path)
    try:
        cfg = model.config
        assert cfg.vocab_size == p.vocab
        for name in INT_FIELDS:
            assert getattr(cfg, name) == getattr(p, name), name
        for name in FLOAT_FIELDS:  # stored as f32
            assert getattr(cfg, name) == float(np.float32(getattr(p, name))), name
        assert [r.kv_source for r in cfg.roles] == [i in p.kv_sources for i in range(p.n_layers)]
        assert [r.index_source for r in cfg.roles] == [i in p.index_sources for i in range(p.n_layers)]
        assert [r.candidate_source for r in cfg.roles] == [i == p.candidate_source for i in range(p.n_layers)]
        assert [r.uses_candidates for r in cfg.roles] == [
            i in p.index_sources and i > p.candidate_source for i in range(p.n_layers)]
        assert [r.engram for r in cfg.roles] == [i in p.engram_layers for i in range(p.n_layers)]

        e = cfg.engram
        assert e is not None
        n_e = len(p.engram_layers)
        primes = engram_primes(n_e, p.max_ngram, p.engram_heads, p.engram_vocab_size)
        token_map, compressed = stub_token_map(p.vocab, p.unmapped_tail)
        assert e.layer_ids == p.engram_layers
        assert (e.n_heads, e.head_dim, e.max_ngram) == (p.engram_heads, p.engram_head_dim, p.max_ngram)
        assert np.array_equal(e.primes, primes)
        assert np.array_equal(e.offsets, engram_offsets(primes))
        assert np.array_equal(e.multipliers, engram_multipliers(p.engram_layers, p.max_ngram, compressed))
        assert np.array_equal(e.token_map, token_map)
        assert e.pad_id == token_map[p.engram_pad_token]
        assert e.table_rows == tuple(int(primes[i].sum()) for i in range(n_e))

        extra_1d: list[np.ndarray] = []
        for t in model.weights:
            layer, role = _role_of(t.name)
            assert t.ggml_type == _expected_type(role, t.shape, wt, tt), t.name
            values = _sample(t)
            assert np.isfinite(values).all(), t.name
            if role == L.TOKEN_EMBD:
                assert t.shape == (p.vocab, p.dim)
                assert abs(_rms(values) / EMBED_STD - 1) < 0.05, (t.name, _rms(values))
            elif role == L.ENGRAM_TABLE:
                assert t.shape == (e.table_rows[e.hash_index(layer)], p.engram_head_dim)
                # Gaussian rows of RMS 1 (quantised), or Q2_K rows drawn in the stored format (about 0.98)
                assert 0.9 < _rms(values) < 1.1, (t.name, _rms(values))
            elif role in NORM_MEAN:
                # mean * (1 + 0.1 N(0, 1)): the sample mean is within 10% / sqrt(n) * 5 of the mean
                assert abs(values.mean() / NORM_MEAN[role] - 1) < 0.5 / np.sqrt(values.size) + 1e-6, t.name
            elif len(t.shape) == 2:
                std = GAIN.get(role, 1.0) / np.sqrt(t.shape[-1])
                # 5 sampling sigmas of an RMS estimate, plus 5% for quantisation (Q2_K measured <= 4.7%)
                tolerance = 0.05 + 5 / np.sqrt(2 * values.size)
                assert abs(_rms(values) / std - 1) < tolerance, (t.name, _rms(values), std)
            else:
                extra_1d.append(values)
        pooled = np.concatenate(extra_1d)  # sinks, hc bases and scales: N(0, 0.5^2)
        assert abs(_rms(pooled) / 0.5 - 1) < 5 / np.sqrt(2 * pooled.size)
    finally:
        model.close()


@pytest.mark.parametrize(("preset_name", "weight_type", "table_type"),
                         [(p, w, t) for p in ("tiny", "small") for w in WEIGHT_TYPES for t in TABLE_TYPES[p]])
def test_load_round_trip(synth_model, preset_name: str, weight_type: str, table_type: str) -> None:
    path = synth_model(preset_name, weight_type=weight_type, table_type=table_type)
    check_model(path, preset(preset_name), weight_type, table_type)


def test_default_types(tiny_path: Path, small_path: Path) -> None:
    check_model(tiny_path, preset("tiny"), "Q8_0", "Q2_K")
    check_model(small_path, preset("small"), "Q8_0", "Q8_0")


def test_engram_rows_override(synth_model) -> None:
    path = synth_model("tiny", engram_rows=1000)
    model = flashv41.load_model(path)
    try:
        e = model.config.engram
        assert e is not None
        # rows per layer = sum of the layer's primes, each the next unused prime above rows / cols
        for rows in e.table_rows:
            assert 1000 <= rows < 1000 + 4 * 40, rows
    finally:
        model.close()


def test_q2_k_table_needs_256_wide_rows(tmp_path: Path) -> None:
    from flashv41.host.synth import write_synthetic

    with pytest.raises(UnsupportedError, match="Q2_K"):
        write_synthetic(tmp_path / "x.gguf", "small", table_type="Q2_K")


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("FLASHV41_FLASH") != "1",
                    reason="writes the ~2.5 GB flash preset; set FLASHV41_FLASH=1 to run")
def test_load_flash_preset(tmp_path: Path) -> None:
    from flashv41.host.synth import write_synthetic

    path = write_synthetic(tmp_path / "flash.gguf", "flash")
    check_model(path, preset("flash"), "Q8_0", "Q2_K")


# --- load-time validation: each broken file gets its own error, naming the tensor or key ---

def _key(name: str) -> str:
    return L.key(name)


def _tensor(path: Path, name: str) -> tuple[np.ndarray, tuple[int, ...]]:
    """A tensor's stored data as GGUFReader gives it, and its shape in values (NumPy order)."""
    t = next(t for t in GGUFReader(path).tensors if t.name == name)
    return np.asarray(t.data), tuple(int(n) for n in reversed(t.shape.tolist()))


def test_missing_tensor(tiny_path: Path, tmp_path: Path) -> None:
    name = "blk.2.attn_q_b.weight"
    path = rewrite_gguf(tiny_path, tmp_path / "x.gguf", drop_tensors=[name])
    expect_load_error(path, ModelFormatError, name, "missing")


def test_missing_embedding(tiny_path: Path, tmp_path: Path) -> None:
    name = "token_embd.weight"
    path = rewrite_gguf(tiny_path, tmp_path / "x.gguf", drop_tensors=[name])
    expect_load_error(path, ModelFormatError, name, "missing")


def test_wrong_shape(tiny_path: Path, tmp_path: Path) -> None:
    name = "blk.2.attn_kv.weight"  # Q8_0: one more block a row is 32 more values
    data, (rows, cols) = _tensor(tiny_path, name)
    wider = np.zeros((rows, data.shape[1] + FORMATS[GGMLType.Q8_0].block_bytes), np.uint8)
    path = rewrite_gguf(tiny_path, tmp_path / "x.gguf", replace_tensors={name: (wider, GQ.Q8_0)})
    expect_load_error(path, ModelFormatError, name, f"[{rows}, {cols + 32}]", f"[{rows}, {cols}]")


@pytest.mark.parametrize("name", ["blk.0.engram_wkv.weight", "blk.1.engram_embd.weight"])
def test_unsupported_type(tiny_path: Path, tmp_path: Path, name: str) -> None:
    # the rows stored as Q4_1 (20 bytes a block of 32 values), a type flashv41 does not read
    _, (rows, cols) = _tensor(tiny_path, name)
    as_q4_1 = np.zeros((rows, cols // 32 * 20), np.uint8)
    path = rewrite_gguf(tiny_path, tmp_path / "x.gguf", replace_tensors={name: (as_q4_1, GQ.Q4_1)})
    expect_load_error(path, UnsupportedError, name, "Q4_1")


def test_truncated_file(tiny_path: Path, tmp_path: Path) -> None:
    path = tmp_path / "x.gguf"
    shutil.copy(tiny_path, path)
    size = path.stat().st_size - 1000
    with open(path, "r+b") as f:
        f.truncate(size)
    # the first tensor, in file order, whose data no longer fits
    cut = next(t.name for t in GGUFReader(tiny_path).tensors if int(t.data_offset) + int(t.n_bytes) > size)
    expect_load_error(path, ModelFormatError, cut, "truncated", str(size))


def test_mxxm_layout(synth_model, tiny_path: Path, tmp_path: Path) -> None:
    """An mxxm-t file loads (tests/test_gguf_layouts.py holds it to the llama.cpp one); one mxxm-t key
    is enough to read a file as that layout, whose own keys it must then have."""
    model = flashv41.load_model(synth_model("tiny", layout="mxxm-t"))
    assert model.config.layout == "mxxm-t" and model.config.engram is not None
    model.close()
    key = _key("engram.pad_token_id")
    path = rewrite_gguf(tiny_path, tmp_path / "x.gguf", set_keys={key: (2, GGUFValueType.UINT32, None)})
    expect_load_error(path, ModelFormatError, _key("engram.n_heads"), "missing", "mxxm-t", key)


def test_ds4_layout(tiny_path: Path, tmp_path: Path) -> None:
    """One ds4 key is enough to read a file as that layout (tests/test_gguf_ds4.py reads real ones),
    whose own keys it must then have."""
    key = _key("hidden_size")
    path = rewrite_gguf(tiny_path, tmp_path / "x.gguf", set_keys={key: (64, GGUFValueType.UINT32, None)})
    expect_load_error(path, ModelFormatError, _key("num_hidden_layers"), "missing", "ds4", key)


def test_other_architecture(tiny_path: Path, tmp_path: Path) -> None:
    path = rewrite_gguf(tiny_path, tmp_path / "x.gguf", arch="llama")
    expect_load_error(path, UnsupportedError, "architecture", "'llama'")


def test_no_architecture(tiny_path: Path, tmp_path: Path) -> None:
    path = rewrite_gguf(tiny_path, tmp_path / "x.gguf", drop_keys=["general.architecture"])
    expect_load_error(path, ModelFormatError, "general.architecture", "missing")


def test_not_a_gguf(tmp_path: Path) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(100))
    expect_load_error(path, ModelFormatError, "x.gguf", "not a GGUF file")


def test_missing_key(tiny_path: Path, tmp_path: Path) -> None:
    key = _key("attention.sliding_window")
    expect_load_error(rewrite_gguf(tiny_path, tmp_path / "x.gguf", drop_keys=[key]), ModelFormatError, key, "missing")


def test_key_of_wrong_type(tiny_path: Path, tmp_path: Path) -> None:
    key = _key("attention.sliding_window")
    path = rewrite_gguf(tiny_path, tmp_path / "x.gguf", set_keys={key: ("8", GGUFValueType.STRING, None)})
    expect_load_error(path, ModelFormatError, key, "STRING")


def test_inconsistent_engram_offsets(tiny_path: Path, tmp_path: Path) -> None:
    key = _key("engram.offsets")
    model = flashv41.load_model(tiny_path)
    assert model.config.engram is not None
    offsets = model.config.engram.offsets.reshape(-1).copy()
    model.close()
    offsets[1] += 1
    changed = ([int(v) for v in offsets], GGUFValueType.ARRAY, GGUFValueType.UINT64)
    path = rewrite_gguf(tiny_path, tmp_path / "x.gguf", set_keys={key: changed})
    expect_load_error(path, ModelFormatError, key, "running sums")


def test_table_with_too_few_rows(tiny_path: Path, tmp_path: Path) -> None:
    # the synthetic tables have exactly the rows the hash reaches: one fewer is one too few
    name = "blk.0.engram_embd.weight"
    data, (rows, _) = _tensor(tiny_path, name)
    path = rewrite_gguf(tiny_path, tmp_path / "x.gguf", replace_tensors={name: (data[:-1], GQ.Q2_K)})
    expect_load_error(path, ModelFormatError, name, f"{rows - 1} rows", f"reaches row {rows - 1}")


def test_compress_ratios_shorter_than_block_count(tiny_path: Path, tmp_path: Path) -> None:
    key = _key(L.KEY_COMPRESS_RATIOS)
    path = rewrite_gguf(tiny_path, tmp_path / "x.gguf",
                        set_keys={key: ([0, 2, 2], GGUFValueType.ARRAY, GGUFValueType.INT32)})
    expect_load_error(path, ModelFormatError, key, "3 entries", f"block_count is {preset('tiny').n_layers}")


def test_consumer_without_kv_source(tiny_path: Path, tmp_path: Path) -> None:
    # layer 0 (window only in tiny) turned into a ratio-1 consumer: no kv source at or before it
    key = _key(L.KEY_COMPRESS_RATIOS)
    ratios = [1, *preset("tiny").compress_ratios[1:]]
    path = rewrite_gguf(tiny_path, tmp_path / "x.gguf",
                        set_keys={key: (ratios, GGUFValueType.ARRAY, GGUFValueType.INT32)})
    expect_load_error(path, ModelFormatError, "layer 0", "no kv source", "attn_compressor_kv")


def test_kv_source_without_indexer(tiny_path: Path, tmp_path: Path) -> None:
    name = "blk.1.indexer.attn_q_b.weight"
    path = rewrite_gguf(tiny_path, tmp_path / "x.gguf", drop_tensors=[name])
    expect_load_error(path, ModelFormatError, name, "layer 1")


def test_unedited_rewrite_loads(tiny_path: Path, tmp_path: Path) -> None:
    """The rewriting helper itself changes nothing it is not asked to (so the failures above are
    the edits' doing)."""
    check_model(rewrite_gguf(tiny_path, tmp_path / "x.gguf"), preset("tiny"), "Q8_0", "Q2_K")
