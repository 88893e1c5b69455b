"""Stored rows of the block types for the tests: corner blocks (test_quants_more's dequantisers, the
tensor-core pieces and products of test_linear_tc)."""

from __future__ import annotations

import numpy as np

from flashv41.host.quants import FORMATS, GGMLType


def corner_rows(gtype: GGMLType) -> np.ndarray:
    """Stored rows, one corner a row: zero scales, the largest fp16 scales with every scale bit set,
    all-ones and all-zeros levels, negative and subnormal fp16 scales; for MXFP4 the exponents 0,
    1, 2, 127, 253, 254 and 255 (2^127 times 12 overflows to inf in gguf-py as in float32) over
    every code."""
    fmt = FORMATS[gtype]
    fields = fmt.block.fields
    if gtype == GGMLType.MXFP4:
        exps = [0, 1, 2, 127, 253, 254, 255]
        blocks = np.zeros((len(exps), 2), fmt.block)
        blocks["e"] = np.array(exps)[:, None]
        blocks["qs"] = np.arange(16, dtype=np.uint8) | (np.arange(16, dtype=np.uint8)[::-1] << 4)
        blocks["qs"][:, 1] = 0xFF
        return blocks.view(np.uint8).reshape(len(exps), -1)
    cases = []
    for scale, fill in [(0.0, 0xFF), (65504.0, 0xFF), (65504.0, 0x00), (1e-3, 0xFF), (1e-3, 0x00),
                        (-2.0**-24, 0xFF), (-0.0, 0x5A)]:
        block = np.frombuffer(bytes([fill]) * fmt.block_bytes, fmt.block).copy()
        for name in ("d", "dmin"):
            if name in fields:
                block[name] = scale
        cases.append(block)
    return np.concatenate(cases).view(np.uint8).reshape(len(cases), -1)
