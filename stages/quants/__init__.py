"""The device half of the quant-type table, one module per quant family (ggml-cuda's traits table):
per GGUF type the pieces every kernel family decodes weights with, found by type in
`table.DEVICE_TYPES`. host.quants.FORMATS is the host half: block layout (a structured dtype whose
size it asserts), values a block, host dequantiser and quantiser. Every constant a family's module
uses (block bytes, field offsets, words a block) is read from those dtypes at import, never typed
again.

Modules:
- `records`: the record of a type (`DeviceType`, with `StreamUnit`, `TcType`, `NarrowType`: what
  each piece is and its one signature) and the layouts' shared host helpers;
- `units`: the device pieces several families share (the exponent tricks, input readers, dots,
  the generic chunk unit, the tensor-core pieces' signatures and helpers);
- a module per family, each holding its types' block views (field offsets and sizes), weight
  layout, chunk dequantisers, stream / GEMV units, tensor-core and narrow pieces side by side, and
  its rows of the table (`ENTRIES`): `floats` (F32, F16, BF16), `q8_0`, the K-quants `q2_k`,
  `q3_k`, `q4_k_q5_k` (one module: Q5_K is Q4_K with a fifth bit, all but the level readers
  shared) and `q6_k`, `mxfp4`, `e4m3` (E4M3_ROW264, ds4's engram-table format);
- `table`: DEVICE_TYPES, the families' rows put together (FAMILIES' order), every FORMATS type
  checked to have one. stages.linear, stages.linear_tc, stages.linear_narrow, stages.engram_rows
  and stages.engram read it, and nothing else of a type.

Adding a type:
1. host/quants.py: its GGMLType id (RowType for a table format), its block dtype, host
   dequantiser (and quantiser, or `no_quantizer`) and its FORMATS row.
2. stages/quants/<family>.py: its block view (constants read from the dtype), its chunk
   dequantiser, its weight layout (`stored_rows`, `padded_stored` or a split of its own), its stream
   unit (or `units.chunk_stream(dequant)`, correct but not tuned), optionally a GEMV unit, tc and
   narrow pieces, and its row in the module's ENTRIES (`records.entry`).
3. Only for a new family: the new module's name in table.FAMILIES.
So a type of an existing family touches two files (host/quants.py and that family's module), a
type of a new family three (host/quants.py, the new module, table.py). The kernels take it from
the table: the stream and gemm products, the tensor-core GEMM where it has tc pieces, the narrow
product where it has narrow ones, the engram row gather and the embedding. The integer tensor-core
GEMV (stages.linear_imma) keeps its own walks and table (IMMA_TYPES) and takes only the types it
names; a type goes there by its own walk step (stages.imma_walks) and an IMMA_TYPES row.

Oracle: host.quants.dequantize holds the dequantisers (tests/test_engram_stages.py's rows and
tests/test_quants_more.py's chunks, bit for bit); the units and tc pieces are held through the
products (tests/test_linear.py, test_linear_tc.py, test_linear_narrow.py, test_quants_more.py).
"""
