"""Split GGUF sets (llama.cpp gguf-split): the tiny model written whole and as 3 shards loads the
same from any shard (config, every tensor's bytes, the oracle's outputs bit for bit); the shards are
laid out as gguf-split lays them out; every broken or foreign set fails with a ModelFormatError
naming the file at fault; `flashv41 info` lists a set's shards."""

from __future__ import annotations

import dataclasses
import re
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

import flashv41
from flashv41.cli import main
from flashv41.host.errors import InputError, ModelFormatError
from flashv41.host.model import Model
from flashv41.host.oracle import Oracle
from flashv41.host.synth import shard_paths, write_synthetic
from tests.gguf_edit import HEADER_KEYS, field_value

SHARDS = 3
SPLIT_KEYS = ("split.no", "split.count", "split.tensors.count")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Path]]:
    """(the tiny model as one file, the same model as 3 shards), both from seed 0."""
    root = tmp_path_factory.mktemp("splits")
    whole = write_synthetic(root / "whole.gguf", "tiny")
    first = write_synthetic(root / "set.gguf", "tiny", shards=SHARDS)
    shards = shard_paths(root / "set.gguf", SHARDS)
    assert first == shards[0]
    return whole, shards


def copy_set(shards: list[Path], dst: Path) -> list[Path]:
    dst.mkdir(exist_ok=True)
    return [Path(shutil.copy(s, dst / s.name)) for s in shards]


def rewrite_shard(src: Path, dst: Path, *, set_keys: Mapping[str, int] | None = None,
                  drop_tensors: Iterable[str] = (), extra_from: Path | None = None, extra: str | None = None) -> Path:
    """Copy one shard with changes: split keys set to new values (their own types kept), tensors
    dropped, one tensor of another file added. Works on shards without general.architecture (all
    but the first), which tests.gguf_edit.rewrite_gguf needs."""
    reader = GGUFReader(src)
    set_keys, drop = dict(set_keys or {}), set(drop_tensors)
    arch = reader.get_field("general.architecture")
    assert dst != src
    writer = GGUFWriter(dst, arch.contents() if arch is not None else "")
    if arch is None:
        writer.kv_data[0].pop("general.architecture", None)
    for field in reader.fields.values():
        if field.name in HEADER_KEYS or field.name == "general.architecture":
            continue
        value, vtype, sub_type = field_value(field)
        writer.add_key_value(field.name, set_keys.get(field.name, value), vtype, sub_type=sub_type)
    tensors = [t for t in reader.tensors if t.name not in drop]
    if extra_from is not None:
        tensors += [t for t in GGUFReader(extra_from).tensors if t.name == extra]
    for t in tensors:
        typed = t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16)
        writer.add_tensor(t.name, np.ascontiguousarray(t.data), raw_dtype=None if typed else t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def assert_same_config(a: Model, b: Model) -> None:
    for f in dataclasses.fields(a.config):
        x, y = getattr(a.config, f.name), getattr(b.config, f.name)
        if f.name == "engram":
            assert x is not None and y is not None
            for g in dataclasses.fields(x):
                assert np.array_equal(getattr(x, g.name), getattr(y, g.name)), f"engram.{g.name}"
        else:
            assert x == y, f.name


@pytest.mark.parametrize("which", [0, 1, 2], ids=["first", "middle", "last"])
def test_any_shard_loads_the_whole_model(models: tuple[Path, list[Path]], which: int) -> None:
    whole_path, shards = models
    with flashv41.load_model(whole_path) as whole, flashv41.load_model(shards[which]) as split:
        assert_same_config(whole, split)
        assert split.weights.names() == whole.weights.names()  # file order kept across the shards
        for ref in whole.weights:
            got = split.weights._tensors[ref.name]
            assert (got.ggml_type, got.shape) == (ref.ggml_type, ref.shape), ref.name
            assert np.array_equal(got.raw(), ref.raw()), ref.name
        assert [f.path for f in split.weights.files] == shards
        assert sum(f.n_tensors for f in split.weights.files) == len(whole.weights.names())
        assert [f.path for f in whole.weights.files] == [whole_path] and not whole.weights.split


def test_the_oracle_runs_the_same(models: tuple[Path, list[Path]]) -> None:
    whole_path, shards = models
    outs = []
    for path in (whole_path, shards[1]):
        model = flashv41.load_model(path)
        try:
            cfg = model.config
            tokens = np.random.default_rng(7).integers(0, cfg.vocab_size, size=cfg.window + 3)
            seq = Oracle(model, max_seq=64).new_sequence()
            outs.append((seq.prefill(tokens), seq.decode(int(tokens[0]))))
        finally:
            model.close()
    for got, want in zip(outs[1], outs[0], strict=True):
        assert got.dtype == want.dtype == np.float32
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_shards_are_laid_out_as_gguf_split_does(models: tuple[Path, list[Path]]) -> None:
    """Metadata in shard 0 only, the three split keys (u16, u16, i32) in every shard, the tensors
    in file order, about equal bytes each."""
    whole_path, shards = models
    whole = GGUFReader(whole_path)
    names, sizes = [], []
    for i, path in enumerate(shards):
        assert path.name == f"set-{i + 1:05d}-of-{SHARDS:05d}.gguf"
        r = GGUFReader(path)
        keys = [k for k in r.fields if k not in HEADER_KEYS]
        model_keys = [k for k in keys if k not in SPLIT_KEYS]
        if i == 0:
            assert set(model_keys) == {k for k in whole.fields if k not in HEADER_KEYS}
        else:
            assert model_keys == []
        types = [r.fields[k].types[0] for k in SPLIT_KEYS]
        assert types == [GGUFValueType.UINT16, GGUFValueType.UINT16, GGUFValueType.INT32]
        assert [r.fields[k].contents() for k in SPLIT_KEYS] == [i, SHARDS, len(whole.tensors)]
        names += [t.name for t in r.tensors]
        sizes.append(sum(int(t.n_bytes) for t in r.tensors))
    assert names == [t.name for t in whole.tensors]
    assert max(sizes) < 2 * min(sizes), sizes


def test_write_refuses_bad_shard_counts_and_cleans_up(tmp_path: Path) -> None:
    for shards in (0, 10_000):
        with pytest.raises(InputError, match=f"shards {shards}"):
            write_synthetic(tmp_path / "m.gguf", "tiny", shards=shards)
    seen: list[tuple[int, int]] = []

    def stop(name: str, done: int, total: int) -> None:
        seen.append((done, total))
        if done > total // 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_synthetic(tmp_path / "m.gguf", "tiny", shards=SHARDS, progress=stop)
    assert list(tmp_path.iterdir()) == []  # no shard, no temporary folder
    assert all(b >= a for (a, _), (b, _) in zip(seen, seen[1:], strict=False)) and len({t for _, t in seen}) == 1


def refused(path: Path, culprit: str, *words: str) -> None:
    with pytest.raises(ModelFormatError) as err:
        flashv41.load_model(path)
    message = str(err.value)
    assert "\n" not in message and culprit in message, message
    for word in words:
        assert word in message, message


@pytest.mark.parametrize("missing", [0, 1, 2])
def test_a_missing_shard(models: tuple[Path, list[Path]], tmp_path: Path, missing: int) -> None:
    shards = copy_set(models[1], tmp_path)
    shards[missing].unlink()
    named = shards[(missing + 1) % SHARDS]
    refused(named, shards[missing].name, "is missing", str(tmp_path))


def test_split_keys_that_disagree_with_the_name(models: tuple[Path, list[Path]], tmp_path: Path) -> None:
    shards = copy_set(models[1], tmp_path)
    good = tmp_path / "good"
    good.mkdir()
    shutil.copy(shards[1], good / "middle.gguf")
    rewrite_shard(good / "middle.gguf", shards[1], set_keys={"split.count": 4})
    refused(shards[0], shards[1].name, "split.count = 4")
    rewrite_shard(good / "middle.gguf", shards[1], set_keys={"split.no": 2})
    refused(shards[0], shards[1].name, "split.no = 2")
    refused(shards[1], shards[1].name, "split.no = 2")  # the shard named itself


def test_a_shard_of_another_set(models: tuple[Path, list[Path]], tmp_path: Path) -> None:
    shards = copy_set(models[1], tmp_path)
    keep = tmp_path / "keep"
    keep.mkdir()
    last = Path(shutil.copy(shards[2], keep / "last.gguf"))
    rewrite_shard(last, shards[2], set_keys={"split.tensors.count": 200})
    refused(shards[0], shards[2].name, "another set")
    refused(shards[2], shards[2].name, "another set", shards[0].name)  # named itself: still the one at fault
    # the same tensor in two shards (first in shard 1, again in shard 3)
    first_tensor = GGUFReader(shards[0]).tensors[0].name
    rewrite_shard(last, shards[2], extra_from=shards[0], extra=first_tensor)
    refused(shards[1], shards[2].name, first_tensor, shards[0].name)


def test_a_tensor_count_off_the_split_key(models: tuple[Path, list[Path]], tmp_path: Path) -> None:
    shards = copy_set(models[1], tmp_path)
    src = Path(shutil.copy(shards[2], tmp_path / "last.gguf"))
    rewrite_shard(src, shards[2], drop_tensors=[GGUFReader(src).tensors[-1].name])
    refused(shards[2], shards[0].name, "split.tensors.count", str(len(GGUFReader(models[0]).tensors)))


def test_shard_names_without_split_keys(models: tuple[Path, list[Path]], tmp_path: Path) -> None:
    whole, set_shards = models
    plain = Path(shutil.copy(whole, tmp_path / "plain-00001-of-00002.gguf"))
    refused(plain, plain.name, "no split keys")
    shards = copy_set(set_shards, tmp_path / "set")
    shutil.copy(whole, shards[1])  # a plain file where the middle shard should be
    refused(shards[0], shards[1].name, "no split keys")
    # and the other way round: split keys under a name the other shards cannot be found by
    renamed = Path(shutil.copy(set_shards[0], tmp_path / "renamed.gguf"))
    refused(renamed, renamed.name, "split.count = 3")
    outside = Path(shutil.copy(set_shards[0], tmp_path / "set" / "set-00004-of-00003.gguf"))
    refused(outside, outside.name, "outside 1..3")


def test_info_lists_the_shards(models: tuple[Path, list[Path]], tmp_path: Path,
                               capsys: pytest.CaptureFixture[str]) -> None:
    out_path = tmp_path / "cli.gguf"
    assert main(["synth", "-o", str(out_path), "--shards", str(SHARDS)]) == 0
    written = capsys.readouterr().out
    files = shard_paths(out_path, SHARDS)
    assert f"wrote {files[0]} .. {files[-1].name} ({SHARDS} shards)" in written
    assert not out_path.exists() and all(f.is_file() for f in files)

    assert main(["info", str(files[1])]) == 0
    out = capsys.readouterr().out
    assert f"files:       {SHARDS} shards" in out
    for f in files:
        count = len(GGUFReader(f).tensors)
        assert re.search(rf"^ +{re.escape(f.name)} +{count} tensors, ", out, flags=re.MULTILINE), (f.name, out)

    assert main(["info", str(models[0])]) == 0
    assert re.search(r"^  files: +1 file$", capsys.readouterr().out, flags=re.MULTILINE)
