"""Hyper-connections: the mixes each sublayer derives from the highway, and the collapse
(`hc_pre`) and expansion (`hc_post`) around a sublayer. All float32, in the reference's order."""

from __future__ import annotations

import numpy as np

from flashv41.host.numerics import F32, bf16, exp, matmul_t, mean_square, rsqrt, sigmoid, sum_last


def sinkhorn_split(mixes: np.ndarray, scale: np.ndarray, base: np.ndarray, hc: int, iters: int, eps: float):
    """mixes [T, (2+hc)*hc] -> (pre [T, hc], post [T, hc], comb [T, hc(k), hc(c)]).

    pre = sigmoid(m * s0 + b) + eps; post = 2 * sigmoid(m * s1 + b); comb: row softmax + eps, then
    column normalisation, then iters - 1 rounds of row / column normalisation (x / (sum + eps)).
    """
    m = np.asarray(mixes, F32)
    s = np.asarray(scale, F32)
    b = np.asarray(base, F32)
    e = F32(eps)
    pre = sigmoid(m[:, :hc] * s[0] + b[:hc]) + e
    post = F32(2) * sigmoid(m[:, hc:2 * hc] * s[1] + b[hc:2 * hc])
    comb = (m[:, 2 * hc:] * s[2] + b[2 * hc:]).reshape(-1, hc, hc)
    comb = exp(comb - comb.max(axis=-1, keepdims=True))
    comb = comb / sum_last(comb)[..., None] + e
    comb = comb / (sum_last(np.swapaxes(comb, -1, -2))[..., None, :] + e)
    for _ in range(iters - 1):
        comb = comb / (sum_last(comb)[..., None] + e)
        comb = comb / (sum_last(np.swapaxes(comb, -1, -2))[..., None, :] + e)
    return pre.astype(F32), post.astype(F32), comb.astype(F32)


def hc_mixes(h: np.ndarray, fn: np.ndarray, scale: np.ndarray, base: np.ndarray, hc: int, iters: int,
             norm_eps: float, hc_eps: float):
    """h [T, hc, C] fp32 -> (pre, post, comb): mixes = (flat @ fn^T) * rsqrt(mean(flat^2) + eps)."""
    flat = h.reshape(h.shape[0], -1)
    r = rsqrt(mean_square(flat) + F32(norm_eps))
    mixes = matmul_t(flat, fn) * r[:, None]
    return sinkhorn_split(mixes, scale, base, hc, iters, hc_eps)


def hc_pre(h: np.ndarray, pre: np.ndarray) -> np.ndarray:
    """sum_c pre[c] * h[c] -> [T, C], rounded to bf16 (the sublayer input dtype)."""
    prod = pre[:, :, None] * h
    return bf16(sum_last(np.moveaxis(prod, 1, -1)))


def hc_post(a: np.ndarray | None, h: np.ndarray, post: np.ndarray, comb: np.ndarray) -> np.ndarray:
    """[T, hc, C] fp32: post[c] * a + sum_k comb[k, c] * h[k]; a None is a zero sublayer output."""
    mixed = sum_last(np.moveaxis(comb[:, :, :, None] * h[:, :, None, :], 1, -1))  # sum over k
    if a is None:
        return mixed.astype(F32)
    return (post[:, :, None] * np.asarray(a, F32)[:, None, :] + mixed).astype(F32)
