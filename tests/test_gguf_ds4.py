"""The ds4 V4.1 layout (antirez/ds4; section 2 of the shared GGUF notes): HF-named keys, source
lists, engram keys without offsets or geometry, and engram tables stored as I8 rows of 256 E4M3
codes and 8 E8M0 scales, read as the E4M3_ROW264 table format.

The same tiny model (same seed) in ds4 layout and in llama.cpp layout with BF16 tables loads to the
same config and, but for the tables, bit-identical tensors by role; the ds4 tables dequantise (host
dequantiser, device row gather on the simulator, host-residency reads) exactly to an independent
float64 evaluation of the format; with those values written as the llama.cpp file's BF16 tables the
oracle's outputs are bit-identical. Damaged ds4 files are named errors; `flashv41 synth --layout ds4`
/ `info` / `run --check`.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as GQ
from gguf import GGUFReader, GGUFValueType
from numba import cuda  # noqa: E402  (after conftest chose the backend)

import flashv41
from flashv41.cli import main
from flashv41.host import gguf_layout as L
from flashv41.host import gguf_model
from flashv41.host.errors import ModelFormatError, UnsupportedError
from flashv41.host.numerics import to_bits
from flashv41.host.oracle.engram import engram_rows
from flashv41.host.quants import (
    FORMATS,
    RowType,
    dequantize,
    dequantize_e4m3_row264,
    f32_to_bf16_bits,
)
from flashv41.host.synth import preset
from flashv41.stages.engram_rows import RowWorkspace, TableRows
from tests.gguf_edit import expect_load_error, field_value, rewrite_gguf
from tests.test_gguf_layouts import assert_same_config, assert_same_oracle_outputs, roles_of, same_tensors_by_role

TINY = preset("tiny")
U32, U64, F32, STRING = GGUFValueType.UINT32, GGUFValueType.UINT64, GGUFValueType.FLOAT32, GGUFValueType.STRING
ARRAY = GGUFValueType.ARRAY
ROW = FORMATS[RowType.E4M3_ROW264]  # 256 values, 264 bytes a row


@pytest.fixture(scope="module")
def ds4_path(synth_model) -> Path:
    return synth_model("tiny", seed=7, layout=L.DS4)


@pytest.fixture(scope="module")
def bf16_path(synth_model) -> Path:
    """The llama.cpp-layout file of the same seed whose tables draw the same values (BF16 tables)."""
    return synth_model("tiny", seed=7, table_type="BF16")


def _key_value(path: Path, name: str):
    field = GGUFReader(path).get_field(name)
    assert field is not None, name
    return field_value(field)


def _table_name(layer: int) -> str:
    return L.tensor_name(layer, L.ENGRAM_TABLE, L.DS4)


def _stored_table(path: Path, layer: int) -> np.ndarray:
    """A table's bytes as the file holds them: uint8 [rows, 264]."""
    t = next(t for t in GGUFReader(path).tensors if t.name == _table_name(layer))
    assert t.tensor_type == GQ.I8 and [int(d) for d in t.shape] == [ROW.block_bytes, t.data.shape[0]]
    return np.ascontiguousarray(t.data).view(np.uint8).copy()


def rewrite_ds4(src: Path, dst: Path, **changes) -> Path:
    """rewrite_gguf without general.alignment (its writer aligns to gguf-py's default: a copied 16384
    would misplace the data); the loader does not read the key."""
    drop = [*changes.pop("drop_keys", ()), "general.alignment"]
    return rewrite_gguf(src, dst, drop_keys=drop, **changes)


def reference_values(raw: np.ndarray) -> np.ndarray:
    """The format evaluated independently, in float64 (exact): sign * (e ? (1 + m / 8) 2^(e - 7) :
    m 2^-9) * 2^(scale - 127) per value, then ds4's rounding to bf16."""
    codes = raw[:, :256].astype(np.int64)
    scales = np.repeat(raw[:, 256:264].astype(np.int64), 32, axis=1)
    e, m = (codes >> 3) & 15, codes & 7
    mag = np.where(e == 0, m * 2.0**-9, (1 + m / 8) * np.exp2(e - 7.0))
    v = np.where(codes & 128, -mag, mag) * np.exp2(scales - 127.0)
    with np.errstate(over="ignore"):
        return (f32_to_bf16_bits(v.astype(np.float32)).astype(np.uint32) << 16).view(np.float32)


# --- the layout loads ---

def test_layout_is_read_from_the_keys(ds4_path: Path) -> None:
    model = flashv41.load_model(ds4_path)
    try:
        assert model.config.layout == L.DS4 and model.weights.layout == L.DS4
        e = model.config.engram
        assert e is not None and (e.n_heads, e.max_ngram, e.head_dim) == (TINY.engram_heads, TINY.max_ngram, 256)
        table = model.tensor(TINY.engram_layers[0], L.ENGRAM_TABLE)
        assert table.ggml_type == RowType.E4M3_ROW264 and table.shape == (e.table_rows[0], 256)
        assert table.row_bytes() == ROW.block_bytes == 264
    finally:
        model.close()
    assert _key_value(ds4_path, "general.alignment") == (L.DS4_ALIGNMENT, U32, None)
    assert _key_value(ds4_path, L.key("engram.encoding")) == (L.DS4_ENCODING, STRING, None)
    assert _key_value(ds4_path, L.key(L.DS4_KV_SOURCES)) == (list(TINY.kv_sources), ARRAY, U32)
    config = json.loads(_key_value(ds4_path, L.key(L.DS4_KEY_CONFIG))[0])
    assert config["hidden_size"] == TINY.dim and config["num_hidden_layers"] == TINY.n_layers
    names = {t.name for t in GGUFReader(ds4_path).tensors}
    for layer in TINY.engram_layers:
        for name in ("engram_kv", "engram_q_norm", "engram_k_norm", "engram_embd"):
            assert f"blk.{layer}.{name}.weight" in names
        assert f"blk.{layer}.engram_wkv.weight" not in names
        _stored_table(ds4_path, layer)  # I8, ggml [264, rows]
    keys = set(GGUFReader(ds4_path).fields)
    assert not any(L.key(k) in keys for k in L.U32_KEYS.values())  # no llama.cpp keys


def test_same_config(ds4_path: Path, bf16_path: Path) -> None:
    with flashv41.load_model(bf16_path) as a, flashv41.load_model(ds4_path) as b:
        assert_same_config(a.config, b.config)


def test_same_tensors_but_the_tables(ds4_path: Path, bf16_path: Path) -> None:
    with flashv41.load_model(bf16_path) as a, flashv41.load_model(ds4_path) as b:
        renamed = same_tensors_by_role(a, b, roles_of(a.config, tables=False))
        assert renamed == 3 * len(TINY.engram_layers)  # engram_kv, engram_q_norm, engram_k_norm
        for layer in TINY.engram_layers:
            # the same Gaussian draw: E4M3 (3 mantissa bits) against bf16, within E4M3's half step
            va = a.tensor(layer, L.ENGRAM_TABLE).dequantize()
            vb = b.tensor(layer, L.ENGRAM_TABLE).dequantize()
            assert np.all(np.abs(vb - va) <= np.abs(va) / 16 * 1.01 + 2.0**-9), layer


def test_table_rows_dequantise_exactly(ds4_path: Path) -> None:
    model = flashv41.load_model(ds4_path)
    try:
        for layer in TINY.engram_layers:
            raw = _stored_table(ds4_path, layer)
            want = reference_values(raw)
            got = model.tensor(layer, L.ENGRAM_TABLE).dequantize()
            assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), layer
            assert np.array_equal(dequantize(raw, RowType.E4M3_ROW264, 256).view(np.uint32), want.view(np.uint32))
    finally:
        model.close()


def test_corner_rows_dequantise_exactly() -> None:
    """Every code and every scale, both ends of the scale range (fp32 subnormals, inf), host and
    the device chunk dequantiser on the simulator alike."""
    from flashv41.stages.quants.table import DEVICE_TYPES

    codes = np.arange(256, dtype=np.uint8)
    codes = codes[(codes & 127) != 127]
    raw = np.zeros((8, 264), np.uint8)
    for r in range(raw.shape[0]):
        raw[r, :256] = np.resize(np.roll(codes, 37 * r), 256)
        raw[r, 256:] = [0, 1, 2, 126, 127, 128, 253, 254] if r % 2 == 0 else [254, 200, 64, 9, 140, 3, 100, 0]
    want = reference_values(raw)
    host = dequantize_e4m3_row264(raw)
    assert np.array_equal(host.view(np.uint32), want.view(np.uint32))
    assert np.isinf(host).any() and (host == 0).any() and (np.abs(host[host != 0]) < 2.0**-126).any()
    dequant = DEVICE_TYPES[RowType.E4M3_ROW264].dequant
    chunk = np.empty(32, np.float32)
    for r in range(raw.shape[0]):
        for c in range(8):
            with np.errstate(over="ignore"):
                dequant(raw, r, c, chunk)
            assert np.array_equal(chunk.view(np.uint32), host[r, 32 * c:32 * c + 32].view(np.uint32)), (r, c)


@pytest.mark.parametrize("residency", ["device", "pinned", "host"])
def test_device_row_gather(ds4_path: Path, residency: str) -> None:
    model = flashv41.load_model(ds4_path)
    try:
        engram = model.config.engram
        assert engram is not None
        table = model.tensor(engram.layer_ids[1], L.ENGRAM_TABLE)
        ws = RowWorkspace(6, engram.cols, table.row_bytes(), residency)
        rows = TableRows(table, residency)
        out = cuda.device_array((6, engram.cols * engram.head_dim), np.uint16)
        ids = np.random.default_rng(2).integers(0, table.shape[0], (5, engram.cols))
        ids.flat[:3] = [0, table.shape[0] - 1, 0]
        rows.load(ids, 5, ws, out)
        got = out.copy_to_host()[:5]
        want = to_bits(engram_rows(table, ids))
        assert np.array_equal(got, want), f"{int((got != want).sum())} bf16 values differ"
        raw = _stored_table(ds4_path, engram.layer_ids[1])
        assert np.array_equal(want.reshape(-1, 256), to_bits(reference_values(raw[ids.reshape(-1)])))
    finally:
        model.close()


def test_same_oracle_outputs_as_bf16_tables(ds4_path: Path, bf16_path: Path, tmp_path: Path) -> None:
    """The llama.cpp file with its BF16 tables holding the ds4 tables' values: the same model."""
    replace = {}
    for layer in TINY.engram_layers:
        values = dequantize_e4m3_row264(_stored_table(ds4_path, layer))
        replace[f"blk.{layer}.engram_embd.weight"] = (f32_to_bf16_bits(values).view(np.uint8), GQ.BF16)
    same = rewrite_gguf(bf16_path, tmp_path / "same.gguf", replace_tensors=replace)
    assert_same_oracle_outputs(same, ds4_path)


# --- damaged ds4 files: each a named error ---

def test_primes_not_summing_to_rows(ds4_path: Path, tmp_path: Path) -> None:
    key = L.key("engram.rows")
    rows, _, _ = _key_value(ds4_path, key)
    path = rewrite_ds4(ds4_path, tmp_path / "x.gguf", set_keys={key: ([rows[0], rows[1] + 1], ARRAY, U32)})
    expect_load_error(path, ModelFormatError, f"engram layer {TINY.engram_layers[1]}", L.key("engram.primes"),
                      f"sum to {rows[1]}", f"{key}[1] = {rows[1] + 1}")


def test_table_rows_disagree_with_the_key(ds4_path: Path, tmp_path: Path) -> None:
    raw = _stored_table(ds4_path, 0)
    grown = np.concatenate([raw, raw[:1]])
    path = rewrite_ds4(ds4_path, tmp_path / "x.gguf", replace_tensors={_table_name(0): (grown, GQ.I8)})
    expect_load_error(path, ModelFormatError, _table_name(0), f"{raw.shape[0] + 1} rows", L.key("engram.rows"))


@pytest.mark.parametrize(("byte", "value", "what"), [(17, 0x7F, "E4M3 NaN code"), (200, 0xFF, "E4M3 NaN code"),
                                                       (261, 0xFF, "E8M0 NaN scale")])
def test_nan_in_a_table_row(ds4_path: Path, tmp_path: Path, byte: int, value: int, what: str) -> None:
    raw = _stored_table(ds4_path, 1)
    raw[5, byte] = value
    path = rewrite_ds4(ds4_path, tmp_path / "x.gguf", replace_tensors={_table_name(1): (raw, GQ.I8)})
    expect_load_error(path, ModelFormatError, _table_name(1), "row 5", f"byte {byte}", what)
    with pytest.raises(ModelFormatError, match=what):
        dequantize_e4m3_row264(raw[5:6])


def test_large_tables_are_checked_on_a_sample(ds4_path: Path, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Past E4M3_FULL_CHECK_BYTES only a sample of rows (the first and last among them) is checked at
    load; the host dequantiser still refuses any bad row it is asked for."""
    monkeypatch.setattr(gguf_model, "E4M3_FULL_CHECK_BYTES", 0)
    monkeypatch.setattr(gguf_model, "E4M3_SAMPLE_ROWS", 3)  # rows 0, the middle one and the last
    raw = _stored_table(ds4_path, 1)
    last = raw.shape[0] - 1
    for row, caught in ((last, True), (1, False)):
        bad = raw.copy()
        bad[row, 256] = 0xFF
        path = rewrite_ds4(ds4_path, tmp_path / f"x{row}.gguf", replace_tensors={_table_name(1): (bad, GQ.I8)})
        if caught:
            expect_load_error(path, ModelFormatError, _table_name(1), f"row {last}", "E8M0 NaN scale")
            continue
        model = flashv41.load_model(path)
        try:
            with pytest.raises(ModelFormatError, match="row 1: byte 256"):
                model.tensor(1, L.ENGRAM_TABLE).dequantize()
        finally:
            model.close()


@pytest.mark.parametrize(("name", "value", "found"), [
    ("hidden_size", ("32", STRING, None), "STRING"),
    ("rope_theta", (10000.0, F32, None), "FLOAT32"),
    ("rms_norm_eps", (1, U32, None), "UINT32"),
    ("engram.rows", ([1.0, 2.0], ARRAY, F32), "FLOAT32"),
    ("engram.encoding", (1, U32, None), "UINT32"),
    (L.DS4_KV_SOURCES, ("1,3", STRING, None), "STRING"),
])
def test_key_of_wrong_type(ds4_path: Path, tmp_path: Path, name: str, value, found: str) -> None:
    path = rewrite_ds4(ds4_path, tmp_path / "x.gguf", set_keys={L.key(name): value})
    expect_load_error(path, ModelFormatError, L.key(name), "should be", found)


def test_missing_key_names_the_layout(ds4_path: Path, tmp_path: Path) -> None:
    key = L.key("hc_mult")
    path = rewrite_ds4(ds4_path, tmp_path / "x.gguf", drop_keys=[key])
    expect_load_error(path, ModelFormatError, key, "missing", "ds4")


def test_kv_source_listed_without_tensors(ds4_path: Path, tmp_path: Path) -> None:
    key = L.key(L.DS4_KV_SOURCES)
    path = rewrite_ds4(ds4_path, tmp_path / "x.gguf", set_keys={key: ([1, 2, 3], ARRAY, U32)})
    expect_load_error(path, ModelFormatError, "layer 2", key, "blk.2.attn_compressor_kv.weight", "missing")


def test_indexer_layer_missing_from_the_list(ds4_path: Path, tmp_path: Path) -> None:
    key = L.key(L.DS4_INDEX_SOURCES)
    path = rewrite_ds4(ds4_path, tmp_path / "x.gguf", set_keys={key: ([1, 3], ARRAY, U32)})
    expect_load_error(path, ModelFormatError, "layer 5", "blk.5.indexer.attn_q_b.weight", "not listed", key)


def test_other_encoding_is_refused(ds4_path: Path, tmp_path: Path) -> None:
    key = L.key("engram.encoding")
    path = rewrite_ds4(ds4_path, tmp_path / "x.gguf", set_keys={key: ("q8_0_row34", STRING, None)})
    expect_load_error(path, UnsupportedError, key, "'q8_0_row34'", L.DS4_ENCODING)


def test_config_string_disagrees(ds4_path: Path, tmp_path: Path) -> None:
    key = L.key(L.DS4_KEY_CONFIG)
    config = json.loads(_key_value(ds4_path, key)[0])
    config["hidden_size"] += 1
    path = rewrite_ds4(ds4_path, tmp_path / "x.gguf", set_keys={key: (json.dumps(config), STRING, None)})
    expect_load_error(path, ModelFormatError, key, f"hidden_size = {TINY.dim + 1}", L.key("hidden_size"))


def test_primes_not_a_whole_number_of_heads(ds4_path: Path, tmp_path: Path) -> None:
    key = L.key("engram.primes")
    primes, _, _ = _key_value(ds4_path, key)
    path = rewrite_ds4(ds4_path, tmp_path / "x.gguf", set_keys={key: (primes[:-1], ARRAY, U32)})
    expect_load_error(path, ModelFormatError, key, f"{len(primes) - 1} entries")


def test_compressed_vocab_size_disagrees(ds4_path: Path, tmp_path: Path) -> None:
    key = L.key("engram.compressed_vocab_size")
    value, _, _ = _key_value(ds4_path, key)
    path = rewrite_ds4(ds4_path, tmp_path / "x.gguf", set_keys={key: (value + 1, U32, None)})
    expect_load_error(path, ModelFormatError, key, f"= {value + 1}", "token_map")


def test_a_matrix_may_not_be_i8(ds4_path: Path, tmp_path: Path) -> None:
    name = "blk.0.attn_q_a.weight"
    rows = np.zeros((TINY.q_lora_rank, TINY.dim), np.int8)
    path = rewrite_ds4(ds4_path, tmp_path / "x.gguf", replace_tensors={name: (rows, GQ.I8)})
    expect_load_error(path, UnsupportedError, name, "I8")


def test_a_table_of_the_wrong_width(ds4_path: Path, tmp_path: Path) -> None:
    raw = _stored_table(ds4_path, 0)[:, :260]
    path = rewrite_ds4(ds4_path, tmp_path / "x.gguf", replace_tensors={_table_name(0): (raw, GQ.I8)})
    expect_load_error(path, ModelFormatError, _table_name(0), "I8", "264")


# --- the command line ---

@pytest.mark.slow
def test_synth_info_run_check_ds4(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "m.gguf"
    assert main(["synth", "--layout", "ds4", "-o", str(path)]) == 0
    out = capsys.readouterr().out
    assert "layout ds4" in out and "engram tables E4M3_ROW264" in out
    assert main(["info", str(path)]) == 0
    out = capsys.readouterr().out
    assert "  layout:      ds4\n" in out and "(ds4 layout)" in out
    for name in ("engram_kv", "engram_q_norm", "engram_embd"):
        lines = [x for x in out.splitlines() if x.strip().startswith(name + " ")]
        assert lines and not any(x.endswith("*") for x in lines), (name, lines)
    assert "E4M3_ROW264" in out
    assert main(["run", str(path), "--prompt-len", "3", "--decode", "1", "--check"]) == 0
    assert "check: every layer agrees" in capsys.readouterr().out


def test_synth_ds4_refuses_a_table_type(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["synth", "--layout", "ds4", "--table-type", "Q8_0", "-o", str(tmp_path / "m.gguf")]) == 2
    assert "--table-type" in capsys.readouterr().err
    assert not (tmp_path / "m.gguf").exists()
