"""The records of the quant-type table (stages.quants.table's DEVICE_TYPES: one row a type, each
family's module making its own rows) and the weight layouts' host helpers that several families
share.

A record (`DeviceType`) holds, per GGUF type, with one signature per piece:
- `dequant(w, row, chunk, out)`: the 32 values of chunk `chunk` (values chunk*32 .. chunk*32+31)
  of stored row `row` (uint8 [rows, row_bytes], the GGUF's bytes) into the local array `out`,
  exactly as host.quants.dequantize computes them (every product there is exact in float32, so the
  order of operations cannot change a bit). The engram tables and the embedding gather use it.
- the weight layout: `weight_rows(stored, k)` turns stored rows into what a DeviceWeight keeps on
  the device (uint8 [N, pitch]), `weight_dequant` is `dequant` on those rows, `layout` its name.
  Every type keeps its stored bytes, except the "split" ones (Q8_0, Q2_K, Q3_K, Q6_K, MXFP4: each
  family's module says how), whose rows put each block's quants where 16-byte loads reach them
  aligned (a stored block starts on a 2-byte boundary, an MXFP4 one of 17 bytes on any). Each split
  row is zero-padded to whole 16-byte pieces, under one block, so a row's K still reads off its
  width. Q4_K and Q5_K rows ("stored") are whole 16-byte pieces already (`padded_stored` would pad
  them: the kernels view rows as words).
- `stream`: the unit of stages.linear's stream kernels (the partial-sum products; the decode GEMV
  too where `gemv` is None). `make(tokens, x_bf16)` builds unit(ww, wf, row, x32, xo, k, n_tokens,
  acc, u), which adds the dot products of unit u of the row with the inputs to acc[t] for
  t < n_tokens (<= tokens): ww / wf the weight rows as 32-bit words / fp16, x32 the inputs as
  32-bit words [T, K_total / 2] (bf16 pairs) or [T, K_total] (fp32), this row's K-wide slice at
  word xo. A row is K >> shift units, each one 16-byte load or a few (each family's module says
  what its unit is); a lane issues `in_flight` of them together. `gemv` (or None): the decode
  GEMV's unit where it differs, a unit of two rows for Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K and
  MXFP4 (the inputs read and unpacked once for both). The generic `chunk_unit`
  (stages.quants.units: any type with a chunk dequantiser, correct but not tuned) is left to the
  ds4 table format, which no matrix has.
- `tc` (or None): the tensor-core GEMM's fetch / put of a K step (stages.linear_tc; the pieces'
  signatures in stages.quants.units), for Q2_K, Q3_K, Q4_K, Q5_K, Q6_K and MXFP4. BF16 and Q8_0
  have none (their prefill takes stages.gemm_wgmma (BF16, Hopper) or stages.gemm_pipe, which read
  their rows themselves), nor F32 and F16
  (stages.linear's gemm kernel: weight_dequant).
- `narrow` (or None): the narrow tensor-core product's pieces (stages.linear_narrow: BF16, Q8_0).

Oracle: host.quants, whose FORMATS row each record carries as `host`; the pieces are held to it
as each family's module says (tests/test_engram_stages.py's rows for the dequantisers, the
products for the units and tc pieces).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise

import numpy as np

from flashv41.host.quants import FORMATS, GGMLType, QuantFormat, RowType

ROW_ALIGN = 16  # bytes: the stream kernel reads weight rows in aligned 16-byte pieces
WORD = 4  # bytes of the 32-bit words the stream and tensor-core kernels read


# weight layouts (host side)


def split_blocks(stored: np.ndarray, block_bytes: int, cuts: tuple[int, ...]) -> np.ndarray:
    """Rows of whole blocks (uint8 [N, row_bytes]) -> per row the bytes 0 .. cuts[0] - 1 of every block
    back to back, then bytes cuts[0] .. cuts[1] - 1 of every block, ..., then the rest of every
    block (the same bytes, the same size)."""
    n = stored.shape[0]
    blocks = np.ascontiguousarray(stored).reshape(n, -1, block_bytes)
    edges = (0, *cuts, block_bytes)
    return np.concatenate([blocks[:, :, a:b].reshape(n, -1) for a, b in pairwise(edges)], axis=1)


def stored_rows(stored: np.ndarray, k: int) -> np.ndarray:
    return stored


def padded_stored(stored: np.ndarray, k: int) -> np.ndarray:
    """Rows, zero-padded to whole ROW_ALIGN-byte pieces where they are not (the Q3_K and Q6_K split
    rows of some K): the stream kernels view a row as 32-bit words and fp16 halves. The bytes keep
    their offsets, so the chunk dequantisers read these rows as unpadded ones."""
    pad = -stored.shape[1] % ROW_ALIGN
    return np.pad(stored, ((0, 0), (0, pad))) if pad else stored


# the records


@dataclass(frozen=True)
class StreamUnit:
    """The stream kernel's piece of a type: `make(tokens, x_bf16)` -> unit; a row of K values is
    K >> shift units, a lane issuing `in_flight` of them together; a unit covers `rows`
    consecutive rows (their sums in acc[i * tokens + t])."""

    make: Callable
    shift: int
    in_flight: int
    rows: int = 1


@dataclass(frozen=True)
class TcType:
    """How a weight type enters the tensor-core GEMM: its helpers, the stored words a row reads per
    step, whether a block's mins are taken away at its end (Q2_K, Q4_K, Q5_K) and whether the
    scales change every k16 half-step (`halves`: one scale per 16 values, Q3_K and Q6_K) rather
    than every step (an MXFP4 block, a K-quant block's eighth). Every type's step sums are scaled."""

    fetch: Callable
    put: Callable
    fetch_scales: Callable
    put_scales: Callable
    words: int
    mins: bool
    halves: bool = False


# The narrow tensor-core product's pieces (stages.linear_narrow). Lane (g, t) of a warp takes,
# from each 32-value block of a row, the values 8 t .. 8 t + 7; they enter the block's two k16
# mma steps s as its values 8 t + 4 s .. 8 t + 4 s + 3 (the inputs are permuted alike):
# - fetch(w32, row, b, t) -> four words: what the row stores of those values in block b (Q8_0:
#   two words of int8 levels, then two zeros; BF16: four words of bf16 pairs), one load;
# - pairs(w0, w1, w2, w3, s) -> the A fragment's two words for step s: bf16 pairs of values
#   8 t + 4 s, + 1 and 8 t + 4 s + 2, + 3 (Q8_0: the levels, exact in bf16);
# - scales(w32, row, b, k) -> the scales of blocks b .. b + 3 (b a multiple of 4) as float32, one
#   load (Q8_0's fp16 d, after the row's K levels; 1 for BF16).
@dataclass(frozen=True)
class NarrowType:
    """How a weight type enters the narrow tensor-core product (stages.linear_narrow): its fetch,
    pairs and scales pieces, and whether its blocks are scaled."""

    fetch: Callable
    pairs: Callable
    scales: Callable
    scaled: bool


@dataclass(frozen=True)
class DeviceType:
    """One GGUF type's device pieces (module docstring); `host` is its host.quants.FORMATS row."""

    host: QuantFormat
    dequant: Callable
    layout: str
    weight_rows: Callable[[np.ndarray, int], np.ndarray]
    weight_dequant: Callable
    stream: StreamUnit  # one row a unit: the partial-sum products (stages.hyper's mixes)
    tc: TcType | None
    gemv: StreamUnit | None = None  # the decode GEMV's unit where it differs from `stream`
    narrow: NarrowType | None = None  # the narrow tensor-core product's pieces (BF16, Q8_0)

    @property
    def gemv_unit(self) -> StreamUnit:
        return self.gemv or self.stream

    @property
    def gtype(self) -> GGMLType | RowType:
        return self.host.ggml_type


def entry(gtype: GGMLType | RowType, dequant, stream: StreamUnit, tc: TcType | None = None, layout: str = "stored",
          weight_rows=stored_rows, weight_dequant=None, gemv: StreamUnit | None = None,
          narrow: NarrowType | None = None) -> tuple[GGMLType | RowType, DeviceType]:
    """A row of the table: gtype and its record (the host half: its FORMATS row)."""
    return gtype, DeviceType(FORMATS[gtype], dequant, layout, weight_rows, weight_dequant or dequant, stream, tc,
                             gemv, narrow)
