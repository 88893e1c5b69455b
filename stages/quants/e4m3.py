"""E4M3_ROW264, ds4's engram-table format (a table format, no ggml type), on the device: its block
view, chunk dequantiser and its row of the quant-type table (the generic chunk unit: no matrix
has this type; the loader refuses it for matrices).

Oracle: host.quants.dequantize_e4m3_row264 (tests/test_gguf_ds4.py's device row gather, bit for
bit).
"""

from __future__ import annotations

from numba import float32, uint32

from flashv41.host.quants import E4M3_ROW264_BLOCK, FORMATS, RowType, field_offset
from flashv41.stages.device import CHUNK, bf16_round, device, f32_from_bits
from flashv41.stages.quants.records import entry, padded_stored
from flashv41.stages.quants.units import chunk_stream

# E4M3_ROW264, the ds4 engram-table format (a table format, no ggml type): a block is a row of
# E4M3_CHUNKS chunks of E4M3 codes, then one E8M0 scale byte per chunk.
E4M3_BYTES = E4M3_ROW264_BLOCK.itemsize
E4M3_QS, E4M3_E = field_offset(E4M3_ROW264_BLOCK, "qs"), field_offset(E4M3_ROW264_BLOCK, "e")
E4M3_CHUNKS = FORMATS[RowType.E4M3_ROW264].block_values // CHUNK
assert E4M3_ROW264_BLOCK["e"].shape[0] == E4M3_CHUNKS  # one scale a chunk
E4M3_NAN_MAG = uint32(127)  # (code & 127) == 127: NaN (E4M3FN has no infinities)
E8M0_NAN = uint32(255)
F32_NAN = uint32(0x7FC00000)
E8M0_SUBNORMAL = uint32(0x00400000)  # 2^-127, the fp32 pattern of E8M0 scale 0
TWO_M9 = float32(2.0**-9)  # E4M3's subnormal step
E4M3_TO_F32_BIAS = uint32(127 - 7)  # fp32's exponent bias less E4M3's


# chunk dequantiser


@device
def e4m3_value(code):
    """An E4M3FN code (8 bits) as float32, exactly (host.quants.e4m3_value): (8 + m) 2^(e - 10) placed
    as an fp32 pattern for exponent e >= 1, m * 2^-9 for e = 0 (an exact product), NaN for
    (code & 127) == 127, the sign bit 128."""
    if (code & E4M3_NAN_MAG) == E4M3_NAN_MAG:
        return f32_from_bits(F32_NAN)
    e = (code >> 3) & 15
    m = code & 7
    if e == 0:
        mag = float32(m) * TWO_M9
    else:
        mag = f32_from_bits(((e + E4M3_TO_F32_BIAS) << 23) | (m << 20))
    return -mag if code & 128 else mag


@device
def dequant_e4m3_row264(w, row, chunk, out):
    """E4M3_ROW264 chunk c of a row: e4m3(code) * 2^(scale c - 127) (an exact fp32 product, or inf past
    2^128), rounded to bf16 as host.quants.dequantize_e4m3_row264. The host refuses NaN codes and
    scales of 255; here they give NaN (a kernel cannot raise)."""
    base = (chunk // E4M3_CHUNKS) * E4M3_BYTES
    c = chunk % E4M3_CHUNKS
    s = uint32(w[row, base + E4M3_E + c])
    if s == E8M0_NAN:
        scale = f32_from_bits(F32_NAN)
    elif s == 0:
        scale = f32_from_bits(E8M0_SUBNORMAL)
    else:
        scale = f32_from_bits(s << 23)
    q0 = base + E4M3_QS + c * CHUNK
    for i in range(CHUNK):
        out[i] = bf16_round(e4m3_value(uint32(w[row, q0 + i])) * scale)


ENTRIES = [
    # a table format: the engram row gather reads it (dequant); the loader refuses it for matrices,
    # the generic chunk unit being there for completeness
    entry(RowType.E4M3_ROW264, dequant_e4m3_row264, chunk_stream(dequant_e4m3_row264), weight_rows=padded_stored),
]
