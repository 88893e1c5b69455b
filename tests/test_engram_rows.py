"""host.engram_rows: row gathers from engram tables of every type against the whole table
dequantised, for any id dtype and shape, and the out-of-range errors."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import flashv41
from flashv41.host.engram_rows import EngramRowReader
from flashv41.host.errors import InputError
from flashv41.host.quants import GGMLType

TABLE_TYPES = ("Q2_K", "Q8_0", "BF16", "F16", "F32")


@pytest.fixture(scope="module", params=TABLE_TYPES)
def table_model(request: pytest.FixtureRequest, synth_model) -> Iterator[tuple[flashv41.Model, str]]:
    """tiny (256-wide engram rows) with its tables in one type, and that type."""
    model = flashv41.load_model(synth_model("tiny", table_type=request.param))
    yield model, request.param
    model.close()


def _readers(model: flashv41.Model) -> list[EngramRowReader]:
    assert model.config.engram is not None
    return [EngramRowReader(model.tensor(layer, "engram_embd")) for layer in model.config.engram.layer_ids]


def test_rows_match_the_whole_table(table_model: tuple[flashv41.Model, str]) -> None:
    model, table_type = table_model
    rng = np.random.default_rng(7)
    for reader in _readers(model):
        table = reader.table
        assert table.ggml_type == GGMLType[table_type]
        whole_bytes = table.raw()
        whole = table.dequantize()
        # random ids with repeats, plus both ends of the table
        ids = np.concatenate([rng.integers(0, reader.rows, 200), [0, reader.rows - 1, 0, 5, 5]])
        raw = reader.read(ids)
        assert raw.dtype == np.uint8 and raw.shape == (ids.size, reader.row_bytes)
        assert np.array_equal(raw, whole_bytes[ids])
        values = reader.dequantize(ids)
        assert values.dtype == np.float32 and values.shape == (ids.size, reader.head_dim)
        assert np.array_equal(values.view(np.uint32), whole[ids].view(np.uint32))


@pytest.mark.parametrize("dtype", [np.uint8, np.int16, np.int32, np.uint32, np.int64, np.uint64])
def test_any_integer_dtype_and_shape(synth_model, dtype: type) -> None:
    model = flashv41.load_model(synth_model("tiny"))
    try:
        reader = _readers(model)[0]
        whole = reader.table.dequantize()
        ids = np.random.default_rng(3).integers(0, min(reader.rows, 128), size=(3, 4, 5)).astype(dtype)
        values = reader.dequantize(ids)
        assert values.shape == (60, reader.head_dim)
        assert np.array_equal(values, whole[ids.reshape(-1).astype(np.int64)])  # C order
        assert np.array_equal(reader.read(ids.T), reader.table.raw()[ids.T.reshape(-1).astype(np.int64)])
        assert reader.read(np.zeros(0, dtype)).shape == (0, reader.row_bytes)
        assert reader.dequantize(np.zeros((0, 3), dtype)).shape == (0, reader.head_dim)
    finally:
        model.close()


@pytest.mark.parametrize("past_the_end", [-1, 0, 5])
def test_out_of_range_id(tiny_path: Path, past_the_end: int) -> None:
    model = flashv41.load_model(tiny_path)
    try:
        reader = _readers(model)[1]
        # -1 is the id -1; 0 the first id past the table, rows; 5 rows + 5
        value = -1 if past_the_end < 0 else reader.rows + past_the_end
        ids = np.array([0, 1, 2, value, -7, reader.rows + 9], dtype=np.int64)
        with pytest.raises(InputError) as caught:
            reader.read(ids)
        message = str(caught.value)
        for fragment in (f"row id {value}", "index 3", f"{reader.rows} rows", reader.table.name):
            assert fragment in message, f"{fragment!r} not in {message!r}"
        with pytest.raises(InputError, match=f"row id {value}"):
            reader.dequantize(ids)
    finally:
        model.close()


def test_out_of_range_position_in_a_multidimensional_input(tiny_path: Path) -> None:
    model = flashv41.load_model(tiny_path)
    try:
        reader = _readers(model)[0]
        ids = np.zeros((2, 3), np.int32)
        ids[1, 2] = reader.rows
        with pytest.raises(InputError, match=r"index \(1, 2\)"):
            reader.read(ids)
        # unsigned ids past int64 are caught as they are, not wrapped to negative ones
        with pytest.raises(InputError, match=str(2**64 - 1)):
            reader.read(np.array([2**64 - 1], np.uint64))
    finally:
        model.close()


def test_non_integer_ids(tiny_path: Path) -> None:
    model = flashv41.load_model(tiny_path)
    try:
        reader = _readers(model)[0]
        for ids in (np.array([1.0, 2.0]), np.array([True, False])):
            with pytest.raises(InputError, match="integers"):
                reader.read(ids)
    finally:
        model.close()
