"""The engram sublayer: rows -> projection -> gate, as the oracle computes them.

Shapes: T tokens, L = cols row ids per token, E = engram head_dim (row width), C = dim, hc copies.
"""

from __future__ import annotations

import numpy as np

from flashv41.host.gguf_model import TensorRef
from flashv41.host.numerics import F32, bf16, linear, mean_square, rsqrt, sigmoid, sqrt, sum_last
from flashv41.host.quants import dequantize


def engram_rows(table: TensorRef, row_ids: np.ndarray) -> np.ndarray:
    """row_ids int64 [T, L] -> bf16 values [T, L * E]: the table rows, dequantised, rounded to bf16."""
    ids = np.asarray(row_ids, dtype=np.int64)
    raw = table.raw()[ids.reshape(-1)]
    rows = dequantize(raw, table.ggml_type, table.shape[-1])
    return bf16(rows).reshape(ids.shape[0], -1)


def engram_project(rows: np.ndarray, wkv: np.ndarray) -> np.ndarray:
    """rows [T, L*E] bf16 x wkv [C*(hc+1), L*E] -> kv [T, C*(hc+1)] bf16 (hc keys, then the value)."""
    return linear(rows, wkv)


def engram_gate(h: np.ndarray, kv: np.ndarray, qk: np.ndarray, eps: float,
                token_mask: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """h [T, hc, C] fp32, kv [T, (hc+1)*C] bf16, qk = q_weight * k_weight [hc, C] fp32 ->
    (h + g * value [T, hc, C], g [T, hc]).

    dot = sum(h * qk * key) * rsqrt(mean(h^2) + eps) * rsqrt(mean(key^2) + eps) * C^-0.5;
    g = sigmoid(sign(dot) * sqrt(max(|dot|, 1e-6))); masked-out tokens get g = 0.
    """
    t, hc, c = h.shape
    key = np.asarray(kv[:, : hc * c], F32).reshape(t, hc, c)
    value = np.asarray(kv[:, hc * c:], F32)
    e = F32(eps)
    rstd = rsqrt(mean_square(h) + e) * rsqrt(mean_square(key) + e)
    dot = sum_last(h * qk[None] * key) * rstd * F32(c ** -0.5)
    g = sigmoid(np.copysign(sqrt(np.maximum(np.abs(dot), F32(1e-6))), dot))
    if token_mask is not None:
        g = np.where(np.asarray(token_mask)[:, None], g, F32(0))
    return (h + g[:, :, None] * value[:, None, :]).astype(F32), g.astype(F32)


def engram_layer(h, row_ids, table: TensorRef, wkv, qk, eps, token_mask=None, capture: dict | None = None):
    """The whole sublayer: h [T, hc, C] fp32 updated out of place; intermediates into `capture`."""
    rows = engram_rows(table, row_ids)
    kv = engram_project(rows, wkv)
    out, g = engram_gate(h, kv, qk, eps, token_mask)
    if capture is not None:
        capture.update(engram_ids=np.asarray(row_ids), engram_rows=rows, engram_kv=kv, engram_gate=g)
    return out
