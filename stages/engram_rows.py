"""Engram rows on the device: gather table rows by id, dequantise them to bf16.

Shapes: T tokens, L = cols row ids per token, E = the table's row width (head_dim, 256 at flash).
Row ids int64 [T, L] (from the hasher, on the host) -> rows bf16 bits uint16 [T, L * E], i.e. the
[T * L, E] rows back to back, each token's L rows in column order.

A table lives in one of three places, chosen per model (`RESIDENCIES`):
- `device`: the table's stored bytes (uint8 [rows, row_bytes]) are uploaded once (`upload_table`:
  host threads fill two pinned staging buffers from the file's pages while the previous one is
  copied); the ids are uploaded and one kernel gathers the rows by id and dequantises them.
- `pinned`: the stored bytes are copied once into page-locked host memory mapped into the device's
  address space (`cuda.mapped_array`; host threads share the copy out of the file's pages: a real
  table is 32 GB), and the same gather kernel reads each requested row straight
  from there over the host link: no table byte on the device, and the step is what `device` runs
  (ids uploaded, one kernel), so it can be captured in a CUDA graph. A copy rather than registering
  the file's read-only mapping: the copy cannot be evicted by page-cache pressure, and a read-only
  file mapping is not something every driver lets a device map. The host must have the table's
  bytes free (refused up front, naming the table, otherwise).
- `host`: the table stays in the memory-mapped file; the rows are read by id on the host
  (host.engram_rows.EngramRowReader), uploaded into a preallocated device byte buffer, and the
  same kernel dequantises them in place of a gather.
Host-to-device copies go through pinned staging buffers, so they run asynchronously on the
stage's stream; an event keeps the host from refilling a staging buffer while a copy from it may
still be in flight.

Every type of the quant-type table (stages.quants.table.DEVICE_TYPES: F32, F16, BF16, Q8_0, the
K-quants Q2_K .. Q6_K, MXFP4 and ds4's E4M3_ROW264) is supported: one thread per 32-value chunk of a
row, the type's chunk dequantiser of stored rows, then the round to bf16 (nearest even). The
dequantised values are exact in float32 (host.quants), so the rows are bit-identical to the
oracle's, host.oracle.engram.engram_rows.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from functools import cache

import numpy as np
from numba import cuda, float32

from flashv41.host.engram_rows import EngramRowReader
from flashv41.host.errors import CapacityError, InputError, UnsupportedError
from flashv41.host.gguf_model import TensorRef
from flashv41.host.quants import FORMATS
from flashv41.stages.device import CHUNK, SIM, f32_to_bf16, grid_1d, jit_kernel
from flashv41.stages.quants.records import DeviceType
from flashv41.stages.quants.table import DEVICE_TYPES

RESIDENCIES = ("device", "pinned", "host")
GATHERED = ("device", "pinned")  # residencies whose kernel gathers rows by id from the whole table
PIN_CHUNK_BYTES = 1 << 26  # the copies out of the file go in pieces of about this many bytes
# host threads that copy a table out of the file's pages (page faults and memcpy scale with threads)
COPY_THREADS = min(16, os.cpu_count() or 1)
STAGE_PIECES = 4  # upload_table's staging buffers hold this many pieces (256 MiB)
# threads per block: one thread per 32-value chunk; the simulator runs each thread as a Python thread
ROWS_THREADS = 8 if SIM else 128


@cache
def rows_kernel(qt: DeviceType, gathered: bool):
    """The row kernel for one table type. gathered: rows come from the whole table by id (device and
    pinned residency); otherwise row r of the source is already the r-th requested row (host)."""
    dequant = qt.dequant

    @jit_kernel()
    def rows(source, ids, out, n_tokens, cols, chunks):
        # source uint8 [rows, >= row_bytes]; ids int64 [>= T, L]; out uint16 [>= T, L * E]
        buf = cuda.local.array(CHUNK, float32)
        i = cuda.grid(1)
        if i < n_tokens * cols * chunks:
            chunk = i % chunks
            r = i // chunks
            t = r // cols
            c = r % cols
            row = ids[t, c] if gathered else r
            dequant(source, row, chunk, buf)
            base = (c * chunks + chunk) * CHUNK
            for k in range(CHUNK):
                out[t, base + k] = f32_to_bf16(buf[k])

    return rows


def is_device_array(a: object) -> bool:
    """A Numba device array (on the simulator as on a GPU), not a host array (a plain or pinned
    np.ndarray; an ndarray subclass with `copy_to_host` is tests/compile_check.py's stand-in)."""
    return type(a) is not np.ndarray and hasattr(a, "copy_to_host") and hasattr(a, "dtype")


def check_row_ids(row_ids: np.ndarray, n_tokens: int, cols: int, table_rows: int, what: str) -> np.ndarray:
    """row_ids as int64 [n_tokens, cols] (C order), or InputError naming the first bad id."""
    ids = np.asarray(row_ids)
    if ids.shape != (n_tokens, cols) or not np.issubdtype(ids.dtype, np.integer):
        raise InputError(f"{what}: row ids must be an integer array of shape ({n_tokens}, {cols}), "
                         f"got {ids.dtype} {ids.shape}")
    bad = np.flatnonzero((ids < 0) | (ids >= table_rows))
    if bad.size:
        t, c = (int(i) for i in np.unravel_index(int(bad[0]), ids.shape))
        raise InputError(f"{what}: row id {ids[t, c]} at token {t}, column {c} is out of range: the table "
                         f"has {table_rows} rows (valid ids 0..{table_rows - 1})")
    return np.ascontiguousarray(ids, dtype=np.int64)


def host_available_bytes() -> int | None:
    """The host memory the kernel says is available now (Linux MemAvailable), or None where it
    cannot tell."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def pin_table(table: TensorRef, rows: int, row_bytes: int):
    """The table's stored bytes copied into mapped page-locked host memory (uint8 [rows, row_bytes],
    readable by kernels as a device array). Refused with a CapacityError naming the table where the
    host has fewer bytes available than the table holds, or where the driver refuses to pin them;
    nothing stays pinned after a refusal or a failed copy."""
    nbytes = rows * row_bytes
    available = host_available_bytes()
    if available is not None and nbytes > available:
        raise CapacityError(f"{table.name}: pinning the engram table needs {nbytes / 2**30:.1f} GiB of host "
                            f"memory, only {available / 2**30:.1f} GiB is available "
                            f"(table_residency='host' reads its rows from the file instead)")
    try:
        pinned = cuda.mapped_array((rows, row_bytes), np.uint8)
    except Exception as e:  # the driver's refusal (CudaAPIError, an out-of-memory error)
        raise CapacityError(f"{table.name}: the driver refused to pin {nbytes / 2**30:.1f} GiB of host memory "
                            f"for the engram table ({e}); table_residency='host' reads its rows from the file "
                            f"instead") from e
    try:
        copy_rows(pinned, table.raw())
    except BaseException:
        del pinned  # a failed or interrupted copy leaves nothing pinned
        raise
    return pinned


def copy_rows(dst: np.ndarray, src: np.ndarray, pool: ThreadPoolExecutor | None = None) -> None:
    """dst[:] = src (uint8 [rows, row_bytes], host memory), in pieces of about PIN_CHUNK_BYTES
    shared out over COPY_THREADS threads (NumPy's copy runs without the GIL)."""
    rows, row_bytes = src.shape
    step = max(1, PIN_CHUNK_BYTES // row_bytes)
    pieces = [slice(r, min(rows, r + step)) for r in range(0, rows, step)]

    def piece(s: slice) -> None:
        dst[s] = src[s]

    if pool is None:
        with ThreadPoolExecutor(COPY_THREADS) as own:
            list(own.map(piece, pieces))
    else:
        list(pool.map(piece, pieces))


def upload_table(source: np.ndarray, stream=0):
    """The stored rows (uint8 [rows, row_bytes], the file's pages) on the device: pieces of
    STAGE_PIECES x PIN_CHUNK_BYTES filled by host threads into one of two pinned staging buffers
    while the other's copy to the device runs on `stream`."""
    rows, row_bytes = source.shape
    data = cuda.device_array((rows, row_bytes), np.uint8, stream=stream)
    step = max(1, STAGE_PIECES * PIN_CHUNK_BYTES // row_bytes)
    staging = [cuda.pinned_array((min(step, rows), row_bytes), np.uint8) for _ in range(2)]
    copied = [cuda.event(), cuda.event()]
    with ThreadPoolExecutor(COPY_THREADS) as pool:
        for i, r in enumerate(range(0, rows, step)):
            n = min(step, rows - r)
            buf = staging[i % 2]
            copied[i % 2].synchronize()  # this buffer's previous copy has finished
            copy_rows(buf[:n], source[r:r + n], pool)
            data[r:r + n].copy_to_device(buf[:n], stream=stream)
            copied[i % 2].record(stream)
    for event in copied:
        event.synchronize()
    return data


class RowWorkspace:
    """The buffers that row loads share, allocated once for up to `max_tokens` tokens.

    ids int64 [max_tokens, L] on the device (device and pinned residency) and its pinned staging copy;
    raw uint8 [max_tokens * L, row_bytes] on the device (host residency) and its pinned staging copy.
    """

    def __init__(self, max_tokens: int, cols: int, row_bytes: int, residency: str):
        if residency not in RESIDENCIES:
            raise InputError(f"table residency must be one of {', '.join(RESIDENCIES)}, got {residency!r}")
        self.max_tokens = max_tokens
        self.cols = cols
        self.residency = residency
        self.ids_host = cuda.pinned_array((max_tokens, cols), np.int64)
        self.ids = cuda.device_array((max_tokens, cols), np.int64)
        if residency == "host":
            self.raw_host = cuda.pinned_array((max_tokens * cols, row_bytes), np.uint8)
            self.raw = cuda.device_array((max_tokens * cols, row_bytes), np.uint8)
        else:
            self.raw_host = self.raw = None
        # recorded after each upload from the staging buffers; waited on before they are refilled
        self.uploaded = cuda.event()

    @property
    def row_bytes(self) -> int:
        return 0 if self.raw is None else int(self.raw.shape[1])


class TableRows:
    """One layer's table in its residency. `load` fills rows bf16 bits [T, L * E] from row ids."""

    def __init__(self, table: TensorRef, residency: str, stream=0):
        if residency not in RESIDENCIES:
            raise InputError(f"table residency must be one of {', '.join(RESIDENCIES)}, got {residency!r}")
        if table.ggml_type not in DEVICE_TYPES:
            raise UnsupportedError(f"{table.name}: engram tables of type {table.ggml_type.name} are not supported")
        if len(table.shape) != 2 or table.shape[1] % CHUNK:
            raise UnsupportedError(f"{table.name}: an engram table is [rows, head_dim] with head_dim a multiple "
                                   f"of {CHUNK}, found shape {list(table.shape)}")
        self.name = table.name
        self.gtype = table.ggml_type
        self.residency = residency
        self.rows, self.head_dim = (int(n) for n in table.shape)
        self.row_bytes = FORMATS[self.gtype].row_bytes(self.head_dim)
        self.data = None
        self.reader = None
        if residency == "device":
            self.data = upload_table(table.raw(), stream)  # uint8 [rows, row_bytes]
        elif residency == "pinned":
            self.data = pin_table(table, self.rows, self.row_bytes)  # uint8 [rows, row_bytes], host
        else:
            self.reader = EngramRowReader(table)

    @property
    def device_bytes(self) -> int:
        return self.rows * self.row_bytes if self.residency == "device" and self.data is not None else 0

    @property
    def pinned_bytes(self) -> int:
        """Page-locked host memory held (pinned residency)."""
        return self.rows * self.row_bytes if self.residency == "pinned" and self.data is not None else 0

    def load(self, row_ids: np.ndarray, n_tokens: int, ws: RowWorkspace, out, stream=0) -> None:
        """out[:n_tokens] = the bf16 rows of row_ids (int [n_tokens, L]); out uint16 [>= T, L * E]."""
        self.upload(row_ids, n_tokens, ws, stream)
        self.dequantize(n_tokens, ws, out, stream)

    def upload(self, row_ids: np.ndarray, n_tokens: int, ws: RowWorkspace, stream=0) -> None:
        """Validate row_ids int [n_tokens, L] and put what the kernel reads on the device: the ids
        (device and pinned residency) or the rows' stored bytes (host residency)."""
        if n_tokens > ws.max_tokens:
            raise InputError(f"{self.name}: {n_tokens} tokens exceed the workspace's {ws.max_tokens}")
        ids = check_row_ids(row_ids, n_tokens, ws.cols, self.rows, self.name)
        n = n_tokens * ws.cols
        ws.uploaded.synchronize()
        if self.residency in GATHERED:
            ws.ids_host[:n_tokens] = ids
            ws.ids[:n_tokens].copy_to_device(ws.ids_host[:n_tokens], stream=stream)
        else:
            if ws.raw is None or ws.row_bytes < self.row_bytes:
                raise InputError(f"{self.name}: the workspace has no host-residency buffer of "
                                 f"{self.row_bytes}-byte rows")
            assert self.reader is not None  # host residency reads through one
            ws.raw_host[:n, :self.row_bytes] = self.reader.read(ids)
            ws.raw[:n].copy_to_device(ws.raw_host[:n], stream=stream)
        ws.uploaded.record(stream)

    def dequantize(self, n_tokens: int, ws: RowWorkspace, out, stream=0) -> None:
        """out[:n_tokens] = the rows `upload` put on the device, dequantised to bf16 bits."""
        cols = ws.cols
        if out.dtype != np.uint16 or out.shape[0] < n_tokens or out.shape[1] != cols * self.head_dim:
            raise InputError(f"{self.name}: rows output must be uint16 [>= {n_tokens}, {cols * self.head_dim}], "
                             f"got {out.dtype} {tuple(out.shape)}")
        gathered = self.residency in GATHERED
        source = self.data if gathered else ws.raw
        chunks = self.head_dim // CHUNK
        grid = grid_1d(n_tokens * cols * chunks, ROWS_THREADS)
        rows_kernel(DEVICE_TYPES[self.gtype], gathered)[grid, ROWS_THREADS, stream](
            source, ws.ids, out, n_tokens, cols, chunks)

    def free(self) -> None:
        self.data = None
        self.reader = None
