"""The head: the highway's copies collapsed by the last layer's pre-mix, normed, and multiplied by
the output matrix, in fp32 (the reference's Transformer.forward and ParallelHead).

    x = output_norm(hc_pre(h, pre))      bf16 [T, C]   (pre: the last layer's FFN mixes' pre)
    logits = x @ output^T                fp32 [T, vocab]

V4.1's head has no mixes of its own: its collapse weights are the ones the last layer's FFN mixes
produced (as every sublayer's are the mixes before it). The reference holds `output` in fp32 (bf16
values in its checkpoint) and multiplies in fp32; here its values are the file's. Oracle of
stages.head (HeadStage.input, HeadStage.logits), same arguments.
"""

from __future__ import annotations

import numpy as np

from flashv41.host.numerics import matmul_t, rms_norm
from flashv41.host.oracle.hc import hc_pre


def head_input(h: np.ndarray, pre: np.ndarray, norm: np.ndarray, eps: float) -> np.ndarray:
    """output_norm(hc_pre(h, pre)): bf16 values [T, C] of h [T, hc, C] fp32 and pre [T, hc] fp32."""
    return rms_norm(hc_pre(np.asarray(h, np.float32), np.asarray(pre, np.float32)), norm, eps)


def head_logits(x: np.ndarray, output: np.ndarray) -> np.ndarray:
    """x [T, C] (bf16 values) @ output[vocab, C]^T -> fp32 [T, vocab] (float64 sums, one rounding)."""
    return matmul_t(x, output)
