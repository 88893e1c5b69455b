"""The quant-type table: DEVICE_TYPES, per GGUF type its device record (stages.quants.records'
DeviceType), the one table every kernel family reads (the stream and gemm kernels of
stages.linear, the tensor-core GEMMs of stages.linear_tc and stages.linear_narrow, the engram row
gather and the embedding). Each family's module makes its own rows (its ENTRIES); this module only
puts them together, in FAMILIES' order, and checks that every type of host.quants.FORMATS has one.

Oracle: host.quants.FORMATS (the host half of each row, which its record carries as `host`).
"""

from __future__ import annotations

from flashv41.host.quants import FORMATS, GGMLType, RowType
from flashv41.stages.quants import e4m3, floats, mxfp4, q2_k, q3_k, q4_k_q5_k, q6_k, q8_0
from flashv41.stages.quants.records import DeviceType

FAMILIES = (floats, q8_0, q2_k, q3_k, q4_k_q5_k, q6_k, mxfp4, e4m3)
DEVICE_TYPES: dict[GGMLType | RowType, DeviceType] = dict(row for family in FAMILIES for row in family.ENTRIES)
assert set(DEVICE_TYPES) == set(FORMATS) and len(DEVICE_TYPES) == sum(len(f.ENTRIES) for f in FAMILIES)
