"""Reading rows of an engram table (`blk.{i}.engram_embd.weight`) by row id, on the host.

A table holds one row of `head_dim` values per hashed n-gram id; real tables
have millions of rows, so the reader gathers only the requested rows from the memory-mapped file
with one vectorised fancy index, never the whole table. `read` returns the stored bytes (what the
GPU gather copies), `dequantize` the float32 values (the oracle's view of the same rows).
"""

from __future__ import annotations

import numpy as np

from flashv41.host.errors import InputError
from flashv41.host.gguf_model import TensorRef
from flashv41.host.quants import dequantize


class EngramRowReader:
    """Row gathers from one engram table, any supported ggml type.

    The reader keeps a view of the table's memory map: use it only while its model is open.
    """

    def __init__(self, table: TensorRef):
        if len(table.shape) != 2:
            raise InputError(f"{table.name}: an engram table is [rows, head_dim], "
                             f"found shape {list(table.shape)}")
        self.table = table
        self.rows, self.head_dim = (int(n) for n in table.shape)
        self.row_bytes = table.row_bytes()
        # [rows, row_bytes] for quantised / BF16 tables, [rows, head_dim] F32 / F16: both index by row
        self._rows_view = np.asarray(table.data).reshape(self.rows, -1)

    def _checked_ids(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids)
        if not np.issubdtype(ids.dtype, np.integer):
            raise InputError(f"{self.table.name}: row ids must be integers, got dtype {ids.dtype}")
        flat = ids.reshape(-1)
        # compared in the ids' own dtype, so uint64 ids past int64 are caught before any cast
        bad = np.flatnonzero((flat < 0) | (flat >= self.rows))
        if bad.size:
            first = int(bad[0])
            position = first if ids.ndim <= 1 else tuple(int(i) for i in np.unravel_index(first, ids.shape))
            raise InputError(
                f"{self.table.name}: row id {flat[first]} at index {position} of the ids is out of range: "
                f"the table has {self.rows} rows (valid ids 0..{self.rows - 1})"
            )
        return flat.astype(np.int64, copy=False)

    def read(self, ids: np.ndarray) -> np.ndarray:
        """The stored bytes of rows `ids` (any integer dtype and shape, flattened in C order):
        uint8 [n, row_bytes]."""
        flat = self._checked_ids(ids)
        gathered = np.ascontiguousarray(self._rows_view[flat])
        return gathered.view(np.uint8).reshape(flat.size, self.row_bytes)

    def dequantize(self, ids: np.ndarray) -> np.ndarray:
        """The values of rows `ids`: float32 [n, head_dim] (exact for every supported type)."""
        raw = self.read(ids)
        if raw.shape[0] == 0:  # host.quants' block reshapes cannot infer a row length from no rows
            return np.zeros((0, self.head_dim), np.float32)
        return dequantize(raw, self.table.ggml_type, self.head_dim).reshape(-1, self.head_dim)
