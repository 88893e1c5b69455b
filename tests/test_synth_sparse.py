"""Sparse synthetic files (Preset.holes, the flash-realtables preset): tensors written as holes
have the file's full size but take almost no disk, read back as zeros through our loader and
gguf-py's reader, and `flashv41 info` prints their memory plan for every table residency."""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

import flashv41
from flashv41.cli import main
from flashv41.host.engram_hash import EngramHasher
from flashv41.host.engram_rows import EngramRowReader
from flashv41.host.errors import InputError
from flashv41.host.gguf_layout import ENGRAM_TABLE
from flashv41.host.synth import PRESETS, REAL_TABLE_ROWS, preset, write_synthetic

# tiny with tables of about 2 x 100,000 Q2_K rows (8.4 MB each): large enough that the holes show in
# st_blocks, small enough for any filesystem that has none
ROWS = 200_000
RESIDENCIES = {"device": "engram tables on the device", "pinned": "engram tables in pinned host memory",
               "host": "engram tables on the host"}
HOST_TABLE_LINE = {"pinned": "engram tables, pinned host", "host": "engram tables on the host"}


def holes_supported(folder: Path) -> bool:
    """Whether `folder`'s filesystem stores a 16 MiB seeked-over gap as a hole (st_blocks)."""
    probe = folder / f"hole-probe-{os.getpid()}.bin"  # (a folder pytest-xdist workers may share)
    with open(probe, "wb") as f:
        f.seek(16 << 20)
        f.write(b"\0")
    try:
        return probe.stat().st_blocks * 512 < (4 << 20)
    finally:
        probe.unlink()


@pytest.fixture(scope="module")
def sparse_tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("sparse")
    return write_synthetic(folder / "tiny-holes.gguf", "tiny", holes="tables", engram_rows=ROWS)


def test_hole_tables_read_as_zeros(sparse_tiny: Path) -> None:
    model = flashv41.load_model(sparse_tiny)
    try:
        engram = model.config.engram
        assert engram is not None and all(rows >= ROWS // 2 for rows in engram.table_rows)
        for layer, rows in zip(preset("tiny").engram_layers, engram.table_rows, strict=True):
            table = model.tensor(layer, ENGRAM_TABLE)
            assert table.ggml_type.name == "Q2_K" and table.shape == (rows, 256)
            assert not table.raw().any()  # every byte of the hole reads as zero
            reader = EngramRowReader(table)
            ids = np.array([0, rows // 2, rows - 1])
            assert np.array_equal(reader.dequantize(ids), np.zeros((3, 256), np.float32))
        # the other tensors are drawn as usual
        assert model.tensor(1, "attn_q_a").raw().any() and np.abs(model.tensor(0, "attn_norm").dequantize()).min() > 0
    finally:
        model.close()
    # gguf-py's reader takes the file too, its tables zeros
    tables = [t for t in GGUFReader(sparse_tiny).tensors if ENGRAM_TABLE in t.name]
    assert len(tables) == 2 and all(not np.asarray(t.data).any() for t in tables)


def test_hole_file_takes_little_disk(sparse_tiny: Path) -> None:
    st = sparse_tiny.stat()
    table_bytes = 2 * (ROWS // 2) * 84  # Q2_K: 84 bytes a 256-value row
    assert st.st_size > table_bytes
    if not holes_supported(sparse_tiny.parent):
        pytest.skip("this filesystem stores no holes (st_blocks of a seeked-over gap is its full size)")
    assert st.st_blocks * 512 < st.st_size - table_bytes // 2


@pytest.mark.parametrize("holes", ["tables", "matrices"])
@pytest.mark.parametrize("shards", [1, 2])
def test_hole_file_sizes_and_tensors(tmp_path: Path, holes: str, shards: int) -> None:
    """Every file has the size of the same file written in full (a hole at a file's end included),
    and exactly the tensors `holes` names are zeros."""
    full = write_synthetic(tmp_path / "full.gguf", "tiny", shards=shards)
    sparse = write_synthetic(tmp_path / "sparse.gguf", "tiny", shards=shards, holes=holes)
    names = sorted(p.name for p in tmp_path.iterdir())
    sizes = {name: (tmp_path / name).stat().st_size for name in names}
    for name in names:
        if name.startswith("full"):
            assert sizes[name] == sizes[name.replace("full", "sparse")], name
    with flashv41.load_model(sparse) as model, flashv41.load_model(full) as reference:
        stored = {t.name: t for t in model.weights}
        assert sorted(stored) == sorted(reference.weights.names())
        for ref in reference.weights:
            name, got = ref.name, stored[ref.name]
            assert (got.ggml_type, got.shape) == (ref.ggml_type, ref.shape), name
            hole = ENGRAM_TABLE in name or (holes == "matrices" and len(ref.shape) > 1)
            assert got.raw().any() != hole, name


def test_unknown_holes_is_an_input_error(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="holes 'everything'"):
        write_synthetic(tmp_path / "x.gguf", "tiny", holes="everything")
    assert not list(tmp_path.iterdir())


def info(path: Path, residency: str, capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["info", str(path), "--max-seq", "256", "--table-residency", residency]) == 0
    return capsys.readouterr().out


def test_info_every_residency(sparse_tiny: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for residency, where in RESIDENCIES.items():
        out = info(sparse_tiny, residency, capsys)
        assert "device memory estimate (max_seq 256" in out and where in out, residency
        assert re.search(r"total, one sequence +\d", out), residency
        if residency in HOST_TABLE_LINE:
            assert HOST_TABLE_LINE[residency] in out and f"({residency})" in out, residency


def test_realtables_preset_geometry() -> None:
    """flash-realtables: the flash dimensions on the real 40-layer schedule, the official table sizes."""
    p = PRESETS["flash-realtables"]
    assert p.holes == "matrices" and p.n_layers == 40 and p.dim == 5120 and p.engram_layers == (1, 14)
    assert p.default_table_type == "Q2_K"


@pytest.mark.slow
def test_realtables_full_size(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The real-size file (71 GB of apparent size, a few MiB on disk), where holes exist: its table
    rows, a hash into the tables' full range gathered as zero rows, and info's plan per residency.
    Eight tokens: each has a row in every head's range, the last head's at the top of the table, and
    each row read from a hole costs a page fault of milliseconds on this machine (64 tokens took 45 s)."""
    if not holes_supported(tmp_path):
        pytest.skip("this filesystem stores no holes: the real-size file would take 71 GB of disk")
    path = write_synthetic(tmp_path / "realtables.gguf", "flash-realtables")
    st = path.stat()
    assert st.st_size > 70e9 and st.st_blocks * 512 < 64 << 20
    model = flashv41.load_model(path)
    try:
        engram = model.config.engram
        assert engram is not None and tuple(engram.table_rows) == REAL_TABLE_ROWS
        ids = EngramHasher(engram, 8).hash(np.arange(1000, 1008, dtype=np.int64), 0)  # [T, layers, cols]
        for j, layer in enumerate(engram.layer_ids):
            rows = ids[:, j].reshape(-1)
            assert rows.min() >= 0 and rows.max() < REAL_TABLE_ROWS[j] and rows.max() > REAL_TABLE_ROWS[j] * 0.9
            values = EngramRowReader(model.tensor(layer, ENGRAM_TABLE)).dequantize(rows)
            assert values.shape == (rows.size, 256) and not values.any()
    finally:
        model.close()
    table_total = "60.1 GiB"  # 768,022,850 Q2_K rows of 84 bytes
    for residency, where in RESIDENCIES.items():
        out = info(path, residency, capsys)
        assert where in out, residency
        weights = re.search(r"weights on the device +([\d.]+) GiB", out)
        assert weights is not None, residency
        if residency == "device":
            assert float(weights.group(1)) > 60, out
        else:
            assert f"{HOST_TABLE_LINE[residency]} " in out and table_total in out and float(weights.group(1)) < 10
    # whichever residency it is given, info ends with every residency's plan side by side
    plans = out[out.index("by table residency"):].splitlines()[1:]
    assert [line.split()[0] for line in plans] == list(RESIDENCIES)
    assert f"{table_total} of pinned host memory" in plans[1] and "read from the file" in plans[2]
    assert float(plans[0].split()[1]) > 60 and float(plans[1].split()[1]) < 10
