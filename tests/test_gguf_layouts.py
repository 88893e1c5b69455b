"""The two V4.1 GGUF layouts flashv41 reads, llama.cpp and mxxm-t: the same tiny model written in both
(same seed) loads to the same config and bit-identical tensors by role, and the oracle gives
bit-identical outputs; damaged mxxm-t files are named errors (source lists
against tensors, the raw pad id, key types); the other files a user may meet are refused saying
what they are; `flashv41 synth --layout` / `info` / `run --check` on an mxxm-t file."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType

import flashv41
from flashv41.cli import main
from flashv41.host import gguf_layout as L
from flashv41.host.config import EngramConfig, ModelConfig
from flashv41.host.errors import ModelFormatError, UnsupportedError
from flashv41.host.oracle import Oracle
from flashv41.host.synth import preset
from tests.gguf_edit import expect_load_error, field_value, rewrite_gguf

TINY = preset("tiny")
U32, I32, I64, U64 = GGUFValueType.UINT32, GGUFValueType.INT32, GGUFValueType.INT64, GGUFValueType.UINT64
ARRAY = GGUFValueType.ARRAY


@pytest.fixture(scope="module")
def llama_path(synth_model) -> Path:
    return synth_model("tiny", seed=7)


@pytest.fixture(scope="module")
def mxxm_path(synth_model) -> Path:
    return synth_model("tiny", seed=7, layout=L.MXXM_T)


def _key_value(path: Path, name: str):
    field = GGUFReader(path).get_field(name)
    assert field is not None, name
    return field_value(field)


def roles_of(cfg: ModelConfig, tables: bool = True) -> list[tuple[int | None, str]]:
    """(layer, role) of every tensor the engine reads from a model of this config (the engram
    tables too unless `tables` is False)."""
    out: list[tuple[int | None, str]] = [(None, L.TOKEN_EMBD)]
    for r in cfg.roles:
        out += [(r.layer, s.role) for s in L.layer_tensor_specs(r.ratio, r.kv_source, r.index_source, r.engram)]
        if r.engram and tables:
            out.append((r.layer, L.ENGRAM_TABLE))
    return out


def same_tensors_by_role(a, b, roles: list[tuple[int | None, str]]) -> int:
    """Asserts the two models hold the same type, shape and bytes under each role; returns how many
    of those tensors have another name in b."""
    renamed = 0
    for layer, role in roles:
        ta, tb = a.tensor(layer, role), b.tensor(layer, role)
        assert (ta.ggml_type, ta.shape) == (tb.ggml_type, tb.shape), (layer, role)
        assert np.array_equal(ta.raw(), tb.raw()), (layer, role)
        renamed += ta.name != tb.name
    return renamed


# --- the same model in both layouts ---

def test_layout_is_read_from_the_keys(llama_path: Path, mxxm_path: Path) -> None:
    for path, layout in ((llama_path, L.LLAMA_CPP), (mxxm_path, L.MXXM_T)):
        model = flashv41.load_model(path)
        assert model.config.layout == layout and model.weights.layout == layout
        model.close()
    # what makes the mxxm-t file one: its own keys, the raw pad id, a u32 token map, its names
    assert _key_value(mxxm_path, L.key(L.KEY_KV_SOURCES)) == (list(TINY.kv_sources), ARRAY, U32)
    assert _key_value(mxxm_path, L.key(L.KEY_INDEX_SOURCES)) == (list(TINY.index_sources), ARRAY, U32)
    assert _key_value(mxxm_path, L.key("engram.pad_token_id")) == (TINY.engram_pad_token, U32, None)
    token_map, _, sub = _key_value(mxxm_path, L.key("engram.token_map"))
    assert sub == U32 and token_map[-1] == 0xFFFFFFFF  # the stub map's unmapped tail
    names = {t.name for t in GGUFReader(mxxm_path).tensors}
    for layer in TINY.engram_layers:
        assert f"blk.{layer}.engram_embed.weight" in names and f"blk.{layer}.engram_embd.weight" not in names
    for layer in TINY.kv_sources:
        assert f"blk.{layer}.indexer_compressor_kv.weight" in names
        assert f"blk.{layer}.indexer_compressor_norm.weight" in names
        assert f"blk.{layer}.indexer.attn_k.weight" not in names
    llama_keys = {f.name for f in GGUFReader(llama_path).fields.values()}
    assert not any(L.key(m) in llama_keys for m in L.MXXM_MARKERS)


def assert_same_config(a: ModelConfig, b: ModelConfig) -> None:
    """Two configs equal field by field (engram arrays by dtype and value), the layout aside."""
    for f in dataclasses.fields(ModelConfig):
        if f.name not in ("layout", "engram"):
            assert getattr(a, f.name) == getattr(b, f.name), f.name
    ea, eb = a.engram, b.engram
    assert ea is not None and eb is not None
    for f in dataclasses.fields(EngramConfig):
        va, vb = getattr(ea, f.name), getattr(eb, f.name)
        if isinstance(va, np.ndarray):
            assert va.dtype == vb.dtype and np.array_equal(va, vb), f.name
        else:
            assert va == vb, f.name


def test_same_config(llama_path: Path, mxxm_path: Path) -> None:
    with flashv41.load_model(llama_path) as a, flashv41.load_model(mxxm_path) as b:
        assert_same_config(a.config, b.config)
        eb = b.config.engram
        assert eb is not None
        # mxxm-t's raw pad token id, compressed through the token map, is llama.cpp's pad_id
        assert eb.pad_id == int(eb.token_map[TINY.engram_pad_token])


def test_same_tensors_by_role(llama_path: Path, mxxm_path: Path) -> None:
    with flashv41.load_model(llama_path) as a, flashv41.load_model(mxxm_path) as b:
        assert len(a.weights.names()) == len(b.weights.names())
        renamed = same_tensors_by_role(a, b, roles_of(a.config))
        # engram_embed on 2 layers, indexer_compressor_kv and _norm on 2 kv sources
        assert renamed == len(TINY.engram_layers) + 2 * len(TINY.kv_sources)


def assert_same_oracle_outputs(a: Path, b: Path) -> None:
    """The two tiny models give bit-identical oracle outputs: an 8-token prefill (a pad token and
    unmapped tokens in it), then 3 decodes."""
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, TINY.vocab, size=11)
    tokens[[2, 6]] = TINY.vocab - 1  # unmapped by the stub map: cuts the engram look-back
    tokens[4] = TINY.engram_pad_token
    outs = []
    for path in (a, b):
        model = flashv41.load_model(path)
        try:
            seq = Oracle(model).new_sequence()
            h = [seq.prefill(tokens[:8])] + [seq.decode(int(t)) for t in tokens[8:]]
            outs.append(np.concatenate(h))
        finally:
            model.close()
    assert outs[0].dtype == np.float32 and np.isfinite(outs[0]).all()
    assert np.array_equal(outs[0].view(np.uint32), outs[1].view(np.uint32))


def test_same_oracle_outputs(llama_path: Path, mxxm_path: Path) -> None:
    assert_same_oracle_outputs(llama_path, mxxm_path)


def test_mxxm_split_set_loads(synth_model) -> None:
    path = synth_model("tiny", seed=7, layout=L.MXXM_T, shards=3)
    model = flashv41.load_model(path)
    assert model.config.layout == L.MXXM_T and model.weights.split
    model.close()


@pytest.mark.parametrize(("name", "sub_type", "convert"), [
    ("engram.token_map", I32, lambda v: [-1 if x == 0xFFFFFFFF else x for x in v]),
    ("engram.token_map", I64, lambda v: [-1 if x == 0xFFFFFFFF else x for x in v]),
    ("engram.layer_ids", I64, list),
    ("engram.primes", U32, list),
    ("engram.offsets", I32, list),
    ("engram.multipliers", U64, list),
    (L.KEY_KV_SOURCES, I32, list),
])
def test_any_integer_array_type(mxxm_path: Path, tmp_path: Path, name: str, sub_type: GGUFValueType,
                                convert) -> None:
    """Third parties record the arrays with other element types: any integer type reads the same."""
    value, _, _ = _key_value(mxxm_path, L.key(name))
    path = rewrite_gguf(mxxm_path, tmp_path / "x.gguf",
                        set_keys={L.key(name): (convert(value), ARRAY, sub_type)})
    with flashv41.load_model(mxxm_path) as a, flashv41.load_model(path) as b:
        assert a.config.roles == b.config.roles
        ea, eb = a.config.engram, b.config.engram
        assert ea is not None and eb is not None and ea.pad_id == eb.pad_id
        for f in ("layer_ids", "multipliers", "primes", "offsets", "token_map"):
            assert np.array_equal(getattr(ea, f), getattr(eb, f)), f


# --- damaged mxxm-t files: each a named error ---

def test_kv_source_listed_without_tensors(mxxm_path: Path, tmp_path: Path) -> None:
    path = rewrite_gguf(mxxm_path, tmp_path / "x.gguf",
                        set_keys={L.key(L.KEY_KV_SOURCES): ([1, 2, 3], ARRAY, U32)})
    expect_load_error(path, ModelFormatError, "layer 2", L.key(L.KEY_KV_SOURCES), "blk.2.attn_compressor_kv.weight",
            "missing")


def test_index_source_listed_without_tensors(mxxm_path: Path, tmp_path: Path) -> None:
    path = rewrite_gguf(mxxm_path, tmp_path / "x.gguf",
                        set_keys={L.key(L.KEY_INDEX_SOURCES): ([1, 3, 4, 5], ARRAY, U32)})
    expect_load_error(path, ModelFormatError, "layer 4", L.key(L.KEY_INDEX_SOURCES), "blk.4.indexer.attn_q_b.weight")


def test_kv_source_without_its_index_keys(mxxm_path: Path, tmp_path: Path) -> None:
    name = "blk.3.indexer_compressor_kv.weight"
    path = rewrite_gguf(mxxm_path, tmp_path / "x.gguf", drop_tensors=[name])
    expect_load_error(path, ModelFormatError, "layer 3", L.key(L.KEY_KV_SOURCES), name, "missing")


def test_compressor_layer_missing_from_the_list(mxxm_path: Path, tmp_path: Path) -> None:
    path = rewrite_gguf(mxxm_path, tmp_path / "x.gguf",
                        set_keys={L.key(L.KEY_KV_SOURCES): ([1], ARRAY, U32)})
    expect_load_error(path, ModelFormatError, "layer 3", "blk.3.attn_compressor_kv.weight", "not listed",
            L.key(L.KEY_KV_SOURCES))


def test_indexer_layer_missing_from_the_list(mxxm_path: Path, tmp_path: Path) -> None:
    path = rewrite_gguf(mxxm_path, tmp_path / "x.gguf",
                        set_keys={L.key(L.KEY_INDEX_SOURCES): ([1, 3], ARRAY, U32)})
    expect_load_error(path, ModelFormatError, "layer 5", "blk.5.indexer.attn_q_b.weight", "not listed")


def test_source_list_out_of_range(mxxm_path: Path, tmp_path: Path) -> None:
    path = rewrite_gguf(mxxm_path, tmp_path / "x.gguf",
                        set_keys={L.key(L.KEY_KV_SOURCES): ([1, 3, 9], ARRAY, U32)})
    expect_load_error(path, ModelFormatError, L.key(L.KEY_KV_SOURCES), "[1, 3, 9]", "below block_count 6")


def test_missing_source_list(mxxm_path: Path, tmp_path: Path) -> None:
    key = L.key(L.KEY_INDEX_SOURCES)
    path = rewrite_gguf(mxxm_path, tmp_path / "x.gguf", drop_keys=[key])
    expect_load_error(path, ModelFormatError, key, "missing", "mxxm-t")


def test_unmapped_raw_pad_id(mxxm_path: Path, tmp_path: Path) -> None:
    key = L.key("engram.pad_token_id")
    raw = TINY.vocab - 1  # the stub map's unmapped tail
    path = rewrite_gguf(mxxm_path, tmp_path / "x.gguf", set_keys={key: (raw, U32, None)})
    expect_load_error(path, ModelFormatError, key, f"= {raw}", "unmapped")


def test_raw_pad_id_outside_the_vocabulary(mxxm_path: Path, tmp_path: Path) -> None:
    key = L.key("engram.pad_token_id")
    path = rewrite_gguf(mxxm_path, tmp_path / "x.gguf", set_keys={key: (TINY.vocab + 5, U32, None)})
    expect_load_error(path, ModelFormatError, key, "outside the vocabulary")


@pytest.mark.parametrize(("name", "value", "found"), [
    (L.KEY_KV_SOURCES, ("1,3", GGUFValueType.STRING, None), "STRING"),
    ("engram.token_map", ([0.5, 1.5], ARRAY, GGUFValueType.FLOAT32), "FLOAT32"),
    ("engram.pad_token_id", ("2", GGUFValueType.STRING, None), "STRING"),
    ("engram.n_heads", (1.0, GGUFValueType.FLOAT32, None), "FLOAT32"),
])
def test_key_of_wrong_type(mxxm_path: Path, tmp_path: Path, name: str, value, found: str) -> None:
    path = rewrite_gguf(mxxm_path, tmp_path / "x.gguf", set_keys={L.key(name): value})
    expect_load_error(path, ModelFormatError, L.key(name), "should be", found)


def test_negative_entry_in_a_signed_array(mxxm_path: Path, tmp_path: Path) -> None:
    key = L.key("engram.layer_ids")
    path = rewrite_gguf(mxxm_path, tmp_path / "x.gguf", set_keys={key: ([-1, 1], ARRAY, I32)})
    expect_load_error(path, ModelFormatError, key, "[-1, 1]")


def test_offsets_not_running_sums(mxxm_path: Path, tmp_path: Path) -> None:
    key = L.key("engram.offsets")
    offsets, _, sub = _key_value(mxxm_path, key)
    offsets[1] += 1
    path = rewrite_gguf(mxxm_path, tmp_path / "x.gguf", set_keys={key: (offsets, ARRAY, sub)})
    expect_load_error(path, ModelFormatError, key, "running sums")


def test_compressed_vocab_size_disagrees(mxxm_path: Path, tmp_path: Path) -> None:
    key = L.key("engram.compressed_vocab_size")
    value, _, _ = _key_value(mxxm_path, key)
    path = rewrite_gguf(mxxm_path, tmp_path / "x.gguf", set_keys={key: (value + 1, U32, None)})
    expect_load_error(path, ModelFormatError, key, f"= {value + 1}", "token_map")


def test_num_embeddings_disagrees(mxxm_path: Path, tmp_path: Path) -> None:
    key = L.key("engram.num_embeddings")
    rows, _, sub = _key_value(mxxm_path, key)
    path = rewrite_gguf(mxxm_path, tmp_path / "x.gguf", set_keys={key: ([rows[0], rows[1] + 1], ARRAY, sub)})
    expect_load_error(path, ModelFormatError, key, "engram tables")


# --- files that are not a V4.1 model in a layout flashv41 reads: refused, saying what they are ---

def test_dspark_draft_is_refused(llama_path: Path, tmp_path: Path) -> None:
    path = rewrite_gguf(llama_path, tmp_path / "x.gguf", arch=L.DRAFT_ARCH)
    expect_load_error(path, UnsupportedError, "'dflash'", "DSpark", "draft", "deepseek41")


def test_old_engram_keys_without_a_tokenizer_are_refused(llama_path: Path, tmp_path: Path) -> None:
    # the tiny preset carries no tokenizer, so the missing tables cannot be rebuilt (a file that has one
    # loads: tests/test_engram_rebuild.py)
    engram = [f.name for f in GGUFReader(llama_path).fields.values() if f.name.startswith(L.key("engram."))]
    old = {name.replace(L.key("engram."), L.OLD_ENGRAM_PREFIX): _key_value(llama_path, name)
           for name in engram if name.endswith(("layer_ids", "head_count", "key_length", "max_ngram_size"))}
    path = rewrite_gguf(llama_path, tmp_path / "x.gguf", drop_keys=engram, set_keys=old)
    expect_load_error(path, UnsupportedError, "deepseek4.engram.", "before 2026-09-11", "no tokenizer",
                      L.OLD_ENGRAM_REPAIR)


# --- the command line ---

@pytest.mark.slow
def test_synth_info_run_check_mxxm(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "m.gguf"
    assert main(["synth", "--layout", "mxxm-t", "-o", str(path)]) == 0
    assert "layout mxxm-t" in capsys.readouterr().out
    assert main(["info", str(path)]) == 0
    out = capsys.readouterr().out
    assert "  layout:      mxxm-t\n" in out and "(mxxm-t layout)" in out
    # its renamed tensors are listed under their own names, and as used (no trailing *)
    for name in ("engram_embed", "indexer_compressor_kv", "indexer_compressor_norm"):
        lines = [x for x in out.splitlines() if x.strip().startswith(name + " ")]
        assert lines and not any(x.endswith("*") for x in lines), (name, lines)
    assert main(["run", str(path), "--prompt-len", "3", "--decode", "1", "--check"]) == 0
    assert "check: every layer agrees" in capsys.readouterr().out


def test_info_shows_the_llama_layout(llama_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info", str(llama_path)]) == 0
    assert "  layout:      llama.cpp\n" in capsys.readouterr().out


def test_synth_refuses_an_unknown_layout(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["synth", "--layout", "ds9", "-o", str(tmp_path / "m.gguf")]) == 2
    assert "--layout" in capsys.readouterr().err
    assert not (tmp_path / "m.gguf").exists()
